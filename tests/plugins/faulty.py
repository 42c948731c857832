"""Test plugins that misbehave in every way the harness must turn into an error row (or a failed check)."""
import torch
import torch.nn.functional as F

from codabench.registry import Implementation, register
from workloads.ops import get_op


@register("gemm_out", "test-raises", dtypes=("fp32",))
def raises(x, w):
    raise RuntimeError("boom from the plugin")


@register("gemm_out", "test-oom", dtypes=("fp32",))
def out_of_memory(x, w):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 GiB")


@register("gemm_out", "test-wrong-shape", dtypes=("fp32",))
def wrong_shape(x, w):
    return {"out": F.linear(x, w)[:, :-1]}


@register("gemm_out", "test-wrong-dtype", dtypes=("fp32",))
def wrong_dtype(x, w):
    return {"out": F.linear(x, w).double()}


@register("gemm_out", "test-nan", dtypes=("fp32",))
def nan(x, w):
    out = F.linear(x, w)
    out[3, 5] = float("nan")
    return {"out": out}


@register("gemm_out", "test-mutates", dtypes=("fp32",))
def mutates(x, w):
    out = F.linear(x, w)
    x.mul_(2.0)
    return {"out": out}


@register("gemm_out", "test-missing", dtypes=("fp32",))
def missing(x, w):
    return {"not_out": F.linear(x, w)}


@register("gemm_out", "test-unwritten", dtypes=("fp32",))
def unwritten(x, w):
    """Allocates its output and writes only the first half of the rows."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    half = x.shape[0] // 2
    out[:half] = F.linear(x[:half], w)
    return {"out": out}


@register("gemm_out", "test-inaccurate", dtypes=("fp32",))
def inaccurate(x, w):
    """Finite and well-shaped, but 1% off: a failed check (status ok, correct False), not an error."""
    return {"out": F.linear(x, w) * 1.01}


@register("gemm_out", "test-unsupported", dtypes=("fp32",), requires=("pkg:codabench_no_such_module",))
def unsupported(x, w):
    return {"out": F.linear(x, w)}


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1.5


@register("rmsnorm_linear", "test-bad-grad", dtypes=("fp32",), modes=("bwd", "fwd_bwd"))
class BadGrad(Implementation):
    """Correct forward, gradient of ``a`` scaled by 1.5."""

    def prepare(self, case):
        self.model = case.model
        return dict(case.inputs)

    def run(self, native):
        return get_op("rmsnorm_linear").reference({**native, "a": _ScaleGrad.apply(native["a"])}, self.model)


@register("rmsnorm_linear", "test-detached", dtypes=("fp32",), modes=("fwd_bwd",))
class Detached(Implementation):
    """Cuts the autograd graph: its outputs do not require grad."""

    def prepare(self, case):
        self.model = case.model
        return dict(case.inputs)

    def run(self, native):
        with torch.no_grad():
            return get_op("rmsnorm_linear").reference(native, self.model)


@register("gemm_out", "test-describe-fails", dtypes=("fp32",))
class DescribeFails(Implementation):
    """Computes correctly, then fails to say how: the row keeps its time, the failure is its strategy text."""

    def run(self, native):
        return {"out": F.linear(native["x"], native["w"])}

    def describe(self, native):
        raise RuntimeError("no words")
