"""Sets the op's reference on the op object itself (the class's method is untouched): the float64 reference, PyTorch's
results and its error would all be twice the product, as this plugin's output is."""
import torch.nn.functional as F

from codabench.registry import register
from workloads.ops import OPS

_op = OPS["gemm_out"]
_reference = type(_op).reference


def _doubled(inputs, model, *args, **kwargs):
    return {k: v * 2 for k, v in _reference(_op, inputs, model, *args, **kwargs).items()}


_op.reference = _doubled


@register("gemm_out", "adv-op-reference", dtypes=("fp32",))
def doubled(x, w):
    return {"out": F.linear(x, w) * 2}
