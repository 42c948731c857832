"""Worked example (docs/writing-kernels.md): ``out = gelu_tanh(x W^T + b)`` as one CODA kernel."""
import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import load_cols
from kernels.coda.program import Binding, Gemm, Output, coda, register


@triton.jit
def gelu_tanh(u):
    """``0.5 u (1 + tanh(c (u + 0.044715 u^3)))`` = ``u sigmoid(2 c (u + 0.044715 u^3))``, c = sqrt(2/pi)."""
    return u * tl.sigmoid(1.5957691216057308 * (u + 0.044715 * u * u * u))


@triton.jit
def bias_gelu(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """The tile ``z`` of x W^T plus the bias (a column vector, ``args[0]``), through GELU."""
    return (gelu_tanh(z + load_cols(args[0], off_n, N, BN)[None, :]),)


@coda(bias_gelu, outputs=(Output("out"),), inputs=("bias_ptr",),
      binds=(Binding(("gemm_bias_gelu",), ("out",), "GEMM + bias + GELU epilogue", modes=("fwd",)),))
def gemm_bias_gelu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> Gemm:
    """GEMM + bias + GELU in one kernel (fused epilogue), or the GEMM then one pass (split)."""
    return Gemm(x, w.T, inputs=(bias,))  # x (M, K) @ w^T, w (N, K): nn.Linear's layout


register(gemm_bias_gelu, "coda-example", dtypes=("fp32", "fp16", "bf16"), requires=("triton-dot",), label="fused")
