"""A plugin whose import takes 1.5 s: above the slow-import threshold its test sets, so it must be reported."""
import time

import torch.nn.functional as F

from codabench.registry import register

time.sleep(1.5)


@register("gemm_out", "test-slow-import", dtypes=("fp32",))
def slow_import(x, w):
    return {"out": F.linear(x, w)}
