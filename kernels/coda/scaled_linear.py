"""Consumer GEMM with the RMSNorm row scale (coda-spec rewrite (a)): ``z = rstd[:, None] * (h @ w^T)``.

With ``h = x * gamma`` from :mod:`kernels.coda.producer` this is ``rmsnorm(x; gamma) @ w^T``. On fp8 h and
w the dequantization scales join rstd in the same multiply (:func:`kernels.coda.epilogue.dequant_scale`).
Split path (:mod:`kernels.coda.strategy`): the plain GEMM, then the row scale in place over its output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import dequant_scale, load_rows, load_tile, store_tile
from kernels.coda.gemm import split_matmul
from kernels.coda.launch import FusedGemm
from kernels.coda.mainloop import INTERPRET, coda_autotune, mainloop, num_tiles, operand_descs, tile_coords, tile_desc
from kernels.coda.strategy import with_split
from workloads.fp8 import Fp8


@coda_autotune()
@triton.jit
def scaled_linear_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                         PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, rstd_ptr, z_ptr, stride_z):
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    z_desc = tile_desc(z_ptr, M, N, stride_z, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN, PROMOTE)
        rstd = load_rows(rstd_ptr, off_m, M, BM)
        store_tile(z_desc, off_m, off_n, dequant_scale(acc, rstd, sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN, SCALING))


@triton.jit
def row_scale_kernel(z_ptr, rstd_ptr, M, N, stride_z, BM: tl.constexpr, BN: tl.constexpr):
    """Rows [pid BM, pid BM + BM): ``z = rstd[:, None] * z`` in place, one pass."""
    off_m = tl.program_id(0) * BM
    z_desc = tile_desc(z_ptr, M, N, stride_z, BM, BN)
    rstd = load_rows(rstd_ptr, off_m, M, BM)
    for off_n in range(0, N, BN):
        store_tile(z_desc, off_m, off_n, load_tile(z_desc, off_m, off_n) * rstd[:, None])


def scaled_linear_split(h: torch.Tensor | Fp8, w: torch.Tensor | Fp8, rstd: torch.Tensor, promote: bool = False
                        ) -> torch.Tensor:
    """:func:`scaled_linear` split: ``c = h @ w.T`` (:func:`kernels.coda.gemm.split_matmul`), then the row scale in
    place over c (:func:`row_scale_kernel`)."""
    z = split_matmul(h, w.T, promote)
    M, N = z.shape
    bm, bn = (16, 32) if INTERPRET else (16, 256)
    row_scale_kernel[(triton.cdiv(M, bm),)](z, rstd, M, N, z.stride(0), BM=bm, BN=bn)
    return z


@with_split(scaled_linear_split)
def scaled_linear(h: torch.Tensor | Fp8, w: torch.Tensor | Fp8, rstd: torch.Tensor, promote: bool = False
                  ) -> torch.Tensor:
    """``rstd[:, None] * (h @ w.T)`` in h's dtype (bf16 for fp8 h, w); w in nn.Linear layout (N, K), rstd fp32 [M]."""
    gemm = FusedGemm(h, w.T, promote)
    z = gemm.empty()
    gemm.launch(scaled_linear_kernel, rstd_ptr=rstd, z_ptr=z, stride_z=z.stride(0))
    return z
