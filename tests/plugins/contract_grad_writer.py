"""A backward that writes into the upstream gradient it was given (correct gradients otherwise), and an honest
implementation of the same op that runs after it in the group: the upstream gradients are the harness's."""
import torch

from codabench.registry import Implementation, register
from workloads.ops import get_op


class _UsesThenZeroes(torch.autograd.Function):
    """Identity forward; the backward passes the gradient on, then zeroes the caller's tensor in place."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        out = g.clone()
        g.zero_()
        return out


@register("rmsnorm_linear", "contract-zeroes-grad", dtypes=("fp32",), modes=("bwd", "fwd_bwd"))
class ZeroesGrad(Implementation):
    def run(self, native):
        out = get_op("rmsnorm_linear").reference(native, native.model)
        return {"x": out["x"], "z": _UsesThenZeroes.apply(out["z"])}


@register("rmsnorm_linear", "contract-honest-after", dtypes=("fp32",), modes=("bwd", "fwd_bwd"))
class HonestAfter(Implementation):
    """The op's own reference: named to run after contract-zeroes-grad in its group."""

    def run(self, native):
        return get_op("rmsnorm_linear").reference(native, native.model)
