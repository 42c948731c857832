"""Computes honestly, but its first call leaves a torch function mode entered that makes every later torch call of
every other implementation (and the harness's) slower: its cell must be an error row naming the mode, and the mode
is gone before the next cell."""
import time

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from codabench.registry import register


class _Slows(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        time.sleep(0.001)
        return func(*args, **(kwargs or {}))


@register("gemm_out", "adv-slows-others", dtypes=("fp32",))
def slows(x, w):
    out = F.linear(x, w)
    _Slows().__enter__()
    return {"out": out}
