"""Gate/up GEMM + RMSNorm row scale + SwiGLU (coda-spec rewrite (b)).

``w_gu`` has interleaved rows (2i = gate_i, 2i+1 = up_i, :func:`kernels.layouts.interleave_rows`), so
every (gate, up) pair sits in adjacent columns of one tile::

    z = rstd[:, None] * (h @ w_gu^T)            [M, 2f], interleaved (kept for backward when asked)
    y_i = silu(z_2i) * z_2i+1                   [M, f]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import scale_rows, silu_mul_pairs, store_tile
from kernels.coda.mainloop import (coda_autotune, mainloop, num_sms, num_tiles, operand, operand_descs,
                                   persistent_grid, tile_coords, tile_desc)


@coda_autotune(key=("M", "N", "K", "SAVE_PREACT"))
@triton.jit
def gemm_swiglu_kernel(h_ptr, w_ptr, rstd_ptr, y_ptr, z_ptr, M, N, K, stride_h, stride_w, stride_y, stride_z,
                       SAVE_PREACT: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    a_desc, b_desc = operand_descs(h_ptr, w_ptr, M, N, K, stride_h, stride_w, BM, BN, BK, A_KM, B_KN)
    y_desc = tile_desc(y_ptr, M, N // 2, stride_y, BM, BN // 2)
    if SAVE_PREACT:
        z_desc = tile_desc(z_ptr, M, N, stride_z, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), NUM_SMS, flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN)
        z = scale_rows(acc, rstd_ptr, off_m, M, BM)
        if SAVE_PREACT:
            store_tile(z_desc, off_m, off_n, z)
        store_tile(y_desc, off_m, off_n // 2, silu_mul_pairs(z, BM, BN))


def gemm_swiglu(h: torch.Tensor, w_gu: torch.Tensor, rstd: torch.Tensor, save_preact: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, z_pre)``: y [M, f] in h's dtype; z_pre the interleaved [M, 2f] pre-activation, only if save_preact.

    w_gu: (2f, K) with interleaved gate/up rows; rstd fp32 [M].
    """
    (a_s, a_t), (w_s, w_t) = operand(h), operand(w_gu.T)
    M, K = h.shape
    N = w_gu.shape[0]
    if N % 2:
        raise ValueError(f"w_gu must have an even number of rows (interleaved gate/up), got {N}")
    y = torch.empty(M, N // 2, device=h.device, dtype=h.dtype)
    z = torch.empty(M, N, device=h.device, dtype=h.dtype) if save_preact else None
    gemm_swiglu_kernel[persistent_grid(M, N, h.device)](
        a_s, w_s, rstd, y, z if save_preact else y, M, N, K, a_s.stride(0), w_s.stride(0), y.stride(0),
        z.stride(0) if save_preact else 0, SAVE_PREACT=save_preact, A_KM=a_t, B_KN=not w_t,
        NUM_SMS=num_sms(h.device))
    return y, z
