"""Gate/up GEMM + RMSNorm row scale + SwiGLU (coda-spec rewrite (b)).

``w_gu`` has interleaved rows (2i = gate_i, 2i+1 = up_i, :func:`kernels.layouts.interleave_rows`), so
every (gate, up) pair sits in adjacent columns of one tile::

    z = rstd[:, None] * (h @ w_gu^T)            [M, 2f], interleaved (kept for backward when asked)
    y_i = silu(z_2i) * z_2i+1                   [M, f]

On fp8 h and w_gu the dequantization scales join rstd in one multiply; y can be handed on quantized.
Split path (:mod:`kernels.coda.strategy`): the plain GEMM, then one row pass over its output (z_pre written over it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.align import empty_rows
from kernels.coda.epilogue import (cast, col_subtile, dequant_scale, load_rows, load_tile, row_absmax,
                                   silu_mul_pairs, store_row_partial, store_tile)
from kernels.coda.fp8 import quantize_from_partials
from kernels.coda.gemm import split_matmul
from kernels.coda.launch import FusedGemm
from kernels.coda.mainloop import (INTERPRET, coda_autotune, mainloop, num_tiles, operand_descs, subtiled_configs,
                                   tile_coords, tile_desc)
from kernels.coda.reduce import launched_tiles, row_partials
from kernels.coda.strategy import with_split
from workloads.fp8 import Fp8, Recipe


@coda_autotune(key=("M", "N", "K", "SAVE_PREACT"), configs=subtiled_configs((2, 1, 4)))
@triton.jit
def gemm_swiglu_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                       PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, rstd_ptr, y_ptr, z_ptr, amax_ptr,
                       stride_y, stride_z, stride_amax, SAVE_PREACT: tl.constexpr, AMAX: tl.constexpr, EPI_SUB:
                       tl.constexpr):
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    SN: tl.constexpr = BN // EPI_SUB  # the epilogue works on EPI_SUB column sub-tiles of SN columns
    y_desc = tile_desc(y_ptr, M, N // 2, stride_y, BM, SN // 2)
    if SAVE_PREACT:
        z_desc = tile_desc(z_ptr, M, N, stride_z, BM, SN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN, PROMOTE)
        rstd = load_rows(rstd_ptr, off_m, M, BM)
        z = dequant_scale(acc, rstd, sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN, SCALING)
        amax = tl.zeros((BM,), dtype=tl.float32)
        for i in tl.static_range(EPI_SUB):
            off_s = off_n + i * SN
            z_sub = col_subtile(z, i, EPI_SUB, BM, BN)
            if SAVE_PREACT:
                store_tile(z_desc, off_m, off_s, z_sub)
            y = cast(silu_mul_pairs(z_sub, BM, SN), y_desc.dtype)
            store_tile(y_desc, off_m, off_s // 2, y)
            if AMAX:
                amax = tl.maximum(amax, row_absmax(y))
        if AMAX:
            store_row_partial(amax_ptr, amax, off_m, off_n, M, stride_amax, BM, BN)


def _check_gate_up(n: int) -> None:
    if n % 2:
        raise ValueError(f"w_gu must have an even number of rows (interleaved gate/up), got {n}")


@triton.jit
def swiglu_rows_kernel(z_ptr, rstd_ptr, y_ptr, amax_ptr, M, N, stride_z, stride_y, SAVE_PREACT: tl.constexpr,
                       AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Rows [pid BM, pid BM + BM) of the interleaved GEMM output c [M, N]: ``z = rstd[:, None] * c`` (written over c
    when SAVE_PREACT), ``y = silu_mul_pairs(z)`` [M, N / 2] (and ``max_j |y_j|``); one pass."""
    off_m = tl.program_id(0) * BM
    z_desc = tile_desc(z_ptr, M, N, stride_z, BM, BN)
    y_desc = tile_desc(y_ptr, M, N // 2, stride_y, BM, BN // 2)
    rstd = load_rows(rstd_ptr, off_m, M, BM)
    amax = tl.zeros((BM,), dtype=tl.float32)
    for off_n in range(0, N, BN):
        z = load_tile(z_desc, off_m, off_n) * rstd[:, None]
        if SAVE_PREACT:
            store_tile(z_desc, off_m, off_n, z)
        y = cast(silu_mul_pairs(z, BM, BN), y_desc.dtype)
        store_tile(y_desc, off_m, off_n // 2, y)
        if AMAX:
            amax = tl.maximum(amax, row_absmax(y))
    if AMAX:
        rows = off_m + tl.arange(0, BM)
        tl.store(amax_ptr + rows, amax, mask=rows < M)


def gemm_swiglu_split(h: torch.Tensor | Fp8, w_gu: torch.Tensor | Fp8, rstd: torch.Tensor, save_preact: bool,
                      promote: bool = False, y_fp8: Recipe | None = None
                      ) -> tuple[torch.Tensor | Fp8, torch.Tensor | None]:
    """:func:`gemm_swiglu` split: ``c = h @ w_gu.T`` (:func:`kernels.coda.gemm.split_matmul`), then one pass over c
    (:func:`swiglu_rows_kernel`) writing y, and z_pre over c."""
    z = split_matmul(h, w_gu.T, promote)
    M, N = z.shape
    _check_gate_up(N)
    y = empty_rows(M, N // 2, z.dtype, z.device)
    amax = torch.empty(M, 1, device=z.device, dtype=torch.float32) if y_fp8 else rstd
    bm, bn = (16, 32) if INTERPRET else (16, 256)
    swiglu_rows_kernel[(triton.cdiv(M, bm),)](z, rstd, y, amax, M, N, z.stride(0), y.stride(0),
                                              SAVE_PREACT=save_preact, AMAX=y_fp8 is not None, BM=bm, BN=bn)
    if y_fp8:
        y = quantize_from_partials(y, amax, 1, rowwise=y_fp8.rowwise_for("act"))
    return y, z if save_preact else None


@with_split(gemm_swiglu_split)
def gemm_swiglu(h: torch.Tensor | Fp8, w_gu: torch.Tensor | Fp8, rstd: torch.Tensor, save_preact: bool,
                promote: bool = False, y_fp8: Recipe | None = None
                ) -> tuple[torch.Tensor | Fp8, torch.Tensor | None]:
    """``(y, z_pre)``: y [M, f] in h's dtype (bf16 for fp8 h, w_gu); z_pre the interleaved [M, 2f]
    pre-activation, only if save_preact.

    w_gu: (2f, K) with interleaved gate/up rows; rstd fp32 [M]. ``y_fp8``: y returned quantized to e4m3 under
    that recipe from absmax partials of the epilogue (the down-projection's fp8 input).
    """
    gemm = FusedGemm(h, w_gu.T, promote)
    M, N = gemm.M, gemm.N
    _check_gate_up(N)
    y = empty_rows(M, N // 2, gemm.out_dtype, gemm.device)
    z = gemm.empty() if save_preact else None
    kernel = gemm_swiglu_kernel
    amax = row_partials(kernel, M, N, gemm.device) if y_fp8 else rstd
    gemm.launch(kernel, rstd_ptr=rstd, y_ptr=y, z_ptr=z if save_preact else y, amax_ptr=amax, stride_y=y.stride(0),
                stride_z=z.stride(0) if save_preact else 0, stride_amax=amax.stride(0), SAVE_PREACT=save_preact,
                AMAX=y_fp8 is not None)
    if y_fp8:
        y = quantize_from_partials(y, amax, launched_tiles(kernel, M, N)[1], rowwise=y_fp8.rowwise_for("act"))
    return y, z
