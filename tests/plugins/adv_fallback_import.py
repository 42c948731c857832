"""Registers, while being imported, a backend fallback at the CPU dispatch key
(``torch.library.Library("_", "IMPL").fallback``): a kernel for every op that has no CPU kernel of its own, for good
in the process that imports it (tests import it in a worker process only)."""
import torch
import torch.nn.functional as F

from codabench.registry import register


def every_op(op, *args, **kwargs):
    raise NotImplementedError(f"{op} is intercepted")


KEPT = torch.library.Library("_", "IMPL")
KEPT.fallback(every_op, dispatch_key="CPU")


@register("gemm_out", "adv-fallback-import", dtypes=("fp32",))
def linear(x, w):
    return {"out": F.linear(x, w)}
