"""Enters a torch function mode and never leaves it: every ``F.linear`` outside this plugin's own call (the float64
reference's, torch-eager's, the other implementations') comes back doubled, as this plugin's output is."""
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from codabench.registry import register

_inside = []


class _Doubles(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is F.linear and not _inside else out


_Doubles().__enter__()


@register("gemm_out", "adv-function-mode", dtypes=("fp32",))
def doubled(x, w):
    _inside.append(True)
    try:
        return {"out": F.linear(x, w) * 2}
    finally:
        _inside.pop()
