"""Raises the pass rule's fp32 floor (an entry of a table of the harness, not a function) so that an output 50% off
passes."""
import torch
import torch.nn.functional as F

import codabench.metrics
from codabench.registry import register

codabench.metrics.FLOOR[torch.float32] = 10.0


@register("gemm_out", "adv-pass-floor", dtypes=("fp32",))
def off(x, w):
    return {"out": F.linear(x, w) * 1.5}
