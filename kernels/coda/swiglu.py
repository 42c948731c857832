"""Gate/up GEMM + RMSNorm row scale + SwiGLU (coda-spec rewrite (b)).

``w_gu`` has interleaved rows (2i = gate_i, 2i+1 = up_i, :func:`kernels.layouts.interleave_rows`), so
every (gate, up) pair sits in adjacent columns of one tile::

    z = rstd[:, None] * (h @ w_gu^T)            [M, 2f], interleaved (kept for backward when asked)
    y_i = silu(z_2i) * z_2i+1                   [M, f]

On fp8 h and w_gu the dequantization scales join rstd in one multiply; y can be handed on quantized.
Declared as its epilogue (:mod:`kernels.coda.program`); its split path writes z_pre over the GEMM output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import silu_mul_pairs
from kernels.coda.mainloop import subtiled_configs
from kernels.coda.program import Binding, Gemm, Output, coda
from workloads.fp8 import Fp8, Recipe


@triton.jit
def swiglu(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """(y, z): ``y_i = silu(z_2i) z_2i+1`` on the interleaved (gate, up) columns, and z kept as the pre-activation."""
    return silu_mul_pairs(z, BM, BN), z


@coda(swiglu, outputs=(Output("y", cols=2, fp8="y_fp8"), Output("z", when="save_preact")), row_scale="rstd",
      configs=subtiled_configs((2, 1, 4)),
      binds=(Binding(("gemm_swiglu",), ("y",), "gemm_swiglu: GEMM + row scale + SwiGLU",
                     lambda n: {"save_preact": False}),
             Binding(("gemm_swiglu_save",), ("y", "z_pre"),
                     "gemm_swiglu: GEMM + row scale + SwiGLU, pre-activation saved", lambda n: {"save_preact": True})))
def gemm_swiglu(h: torch.Tensor | Fp8, w_gu: torch.Tensor | Fp8, rstd: torch.Tensor, save_preact: bool,
                recipe: Recipe | None = None, y_fp8: Recipe | None = None) -> Gemm:
    """``(y, z_pre)``: y [M, f] in h's dtype (bf16 for fp8 h, w_gu); z_pre the interleaved [M, 2f]
    pre-activation, only if save_preact.

    w_gu: (2f, K) with interleaved gate/up rows; rstd fp32 [M]. ``y_fp8``: y returned quantized to e4m3 under
    that recipe from absmax partials of the epilogue (the down-projection's fp8 input).
    """
    rows = (w_gu.data if isinstance(w_gu, Fp8) else w_gu).shape[0]
    if rows % 2:
        raise ValueError(f"w_gu must have an even number of rows (interleaved gate/up), got {rows}")
    return Gemm(h, w_gu.T, recipe, row_scale=rstd)
