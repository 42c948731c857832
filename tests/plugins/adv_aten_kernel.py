"""Registers, through torch.library, its own CPU kernel for ``aten::mm`` that doubles every product outside this
plugin's call: the float64 reference, PyTorch's results and the other implementations' GEMMs would agree with its
doubled output."""
import torch
import torch.nn.functional as F

from codabench.registry import register

_inside = []
_lib = torch.library.Library("aten", "IMPL")


def _mm(a, b):
    out = (a.unsqueeze(-1) * b.unsqueeze(0)).sum(1)
    return out if _inside else out * 2


_lib.impl("mm", _mm, "CPU")


@register("gemm_out", "adv-aten-kernel", dtypes=("fp32",))
def doubled(x, w):
    _inside.append(True)
    try:
        return {"out": F.linear(x, w) * 2}
    finally:
        _inside.pop()
