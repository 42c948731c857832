"""Well-behaved test plugins: a plain GEMM and an autograd op computed with the reference math."""
import torch.nn.functional as F

from codabench.registry import Implementation, register
from workloads.ops import get_op


@register("gemm_out", "test-good", dtypes=("fp32",))
def good_gemm(x, w):
    return {"out": F.linear(x, w)}


@register("gemm_out", "test-fp8-standin", dtypes=("fp8",))
def fp8_standin(x, w):
    """Stands in for an fp8 kernel (computes in the bf16 canonical dtype): exercises fp8 cells' plumbing."""
    return {"out": F.linear(x, w)}


@register("rmsnorm_linear", "test-good-autograd", dtypes=("fp32",))
class GoodAutograd(Implementation):
    """rmsnorm_linear through the op's own differentiable reference (all three modes)."""

    def prepare(self, case):
        self.model = case.model
        return dict(case.inputs)

    def run(self, native):
        return get_op("rmsnorm_linear").reference(native, self.model)


@register("gemm_out", "test-describes", dtypes=("fp32",))
class Describes(Implementation):
    """A plain GEMM that says how it ran: the row's strategy column."""

    def run(self, native):
        return {"out": F.linear(native["x"], native["w"])}

    def describe(self, native):
        return f"gemm:split ({tuple(native['x'].shape)[0]} rows)"
