"""Consumer GEMM with the RMSNorm row scale (coda-spec rewrite (a)): ``z = rstd[:, None] * (h @ w^T)``.

With ``h = x * gamma`` from :mod:`kernels.coda.producer` this is ``rmsnorm(x; gamma) @ w^T``. On fp8 h and
w the dequantization scales join rstd in the same multiply (:func:`kernels.coda.epilogue.dequant_scale`).
Declared as its epilogue (:mod:`kernels.coda.program`): the row scale alone; its split path scales the GEMM output
in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.program import Binding, Gemm, Output, coda
from workloads.fp8 import Fp8, Recipe


@triton.jit
def row_scaled(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """z itself: the row scale is applied before the epilogue."""
    return (z,)


@coda(row_scaled, outputs=(Output("z"),), row_scale="rstd",
      binds=(Binding(("scaled_linear",), ("z",), "scaled_linear: GEMM + row scale"),))
def scaled_linear(h: torch.Tensor | Fp8, w: torch.Tensor | Fp8, rstd: torch.Tensor, recipe: Recipe | None = None
                  ) -> Gemm:
    """``rstd[:, None] * (h @ w.T)`` in h's dtype (bf16 for fp8 h, w); w in nn.Linear layout (N, K), rstd fp32 [M]."""
    return Gemm(h, w.T, recipe, row_scale=rstd)
