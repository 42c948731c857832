"""Its first call in each process registers a backend fallback at the CPU dispatch key
(``torch.library.Library("_", "IMPL").fallback``): a kernel for every op that has no CPU kernel of its own, in this
process for good (torch.library does not record which Library holds a fallback, so nothing takes it back)."""
import torch
import torch.nn.functional as F

from codabench.registry import register

_KEPT = []


def every_op(op, *args, **kwargs):
    raise NotImplementedError(f"{op} is intercepted")


def register_fallback() -> None:
    if not _KEPT:
        _KEPT.append(torch.library.Library("_", "IMPL"))
        _KEPT[0].fallback(every_op, dispatch_key="CPU")


@register("gemm_out", "adv-fallback", dtypes=("fp32",))
def linear(x, w):
    register_fallback()
    return {"out": F.linear(x, w)}
