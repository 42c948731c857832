"""Replaces ``time.perf_counter`` while being imported (by every worker that imports it), then computes honestly.

The blame must fall on this plugin's load error, in every worker; never on the first cell a new worker runs.
"""
import time

import torch.nn.functional as F

from codabench.registry import register


class _ShrunkClock:
    """``time.perf_counter`` running at a tenth of the speed."""

    def __init__(self, clock):
        self.clock, self.t0 = clock, clock()

    def __call__(self):
        return self.t0 + (self.clock() - self.t0) / 10


time.perf_counter = _ShrunkClock(time.perf_counter)


@register("gemm_out", "test-import-patcher", dtypes=("fp32",))
def import_patcher(x, w):
    return {"out": F.linear(x, w)}
