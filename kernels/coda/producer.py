"""Producer GEMM + residual + RMSNorm statistics (coda-spec rewrite (a)).

    x = residual + a @ w^T          (the new residual stream, written in residual's dtype)
    h = x * gamma                   (gamma as a column scale; the consumer GEMM applies rstd per row)
    rstd_m = (sum_j x_mj^2 / d + eps)^(-1/2)

One fused GEMM writes x, h and per-N-tile partial sums of squares of the fp32 x (before rounding);
:func:`kernels.coda.reduce.finish_rstd` turns them into rstd. :func:`norm_input` does the same for an x
that no GEMM produces (the first layer's input, the LM head's input).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import add_tile, load_tile, row_sumsq_partial, scale_cols, store_tile
from kernels.coda.mainloop import (coda_autotune, mainloop, num_sms, num_tiles, operand, operand_descs,
                                   persistent_grid, tile_coords, tile_desc)
from kernels.coda.reduce import finish_rstd, launched_tiles, row_partials


@coda_autotune()
@triton.jit
def gemm_residual_norm_kernel(a_ptr, w_ptr, res_ptr, gamma_ptr, x_ptr, h_ptr, ss_ptr, M, N, K,
                              stride_a, stride_w, stride_res, stride_x, stride_h, stride_ss,
                              A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                              BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    a_desc, b_desc = operand_descs(a_ptr, w_ptr, M, N, K, stride_a, stride_w, BM, BN, BK, A_KM, B_KN)
    res_desc = tile_desc(res_ptr, M, N, stride_res, BM, BN)
    x_desc = tile_desc(x_ptr, M, N, stride_x, BM, BN)
    h_desc = tile_desc(h_ptr, M, N, stride_h, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), NUM_SMS, flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN)
        x = add_tile(acc, res_desc, off_m, off_n)
        store_tile(x_desc, off_m, off_n, x)
        row_sumsq_partial(ss_ptr, x, off_m, off_n, M, stride_ss, BM, BN)
        store_tile(h_desc, off_m, off_n, scale_cols(x, gamma_ptr, off_n, N, BN))


def gemm_residual_norm(a: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, h, rstd)``: ``x = residual + a @ w.T`` (residual's dtype), ``h = x * gamma`` (a's dtype),
    ``rstd`` fp32 [M] of x; w in nn.Linear layout (N, K)."""
    (a_s, a_t), (w_s, w_t) = operand(a), operand(w.T)
    M, K = a.shape
    N = w.shape[0]
    residual, gamma = residual.contiguous(), gamma.contiguous()
    x = torch.empty(M, N, device=a.device, dtype=residual.dtype)
    h = torch.empty(M, N, device=a.device, dtype=a.dtype)
    kernel = gemm_residual_norm_kernel
    ss = row_partials(kernel, M, N, a.device)
    kernel[persistent_grid(M, N, a.device)](
        a_s, w_s, residual, gamma, x, h, ss, M, N, K, a_s.stride(0), w_s.stride(0), residual.stride(0),
        x.stride(0), h.stride(0), ss.stride(0), A_KM=a_t, B_KN=not w_t, NUM_SMS=num_sms(a.device))
    return x, h, finish_rstd(ss, launched_tiles(kernel, M, N)[1], N, eps)


@triton.jit
def norm_input_kernel(x_ptr, gamma_ptr, h_ptr, rstd_ptr, M, N, stride_x, stride_h, eps,
                      BM: tl.constexpr, BN: tl.constexpr):
    """Rows [pid BM, pid BM + BM): ``h = x * gamma`` and ``rstd = (mean_j x_j^2 + eps)^(-1/2)``."""
    off_m = tl.program_id(0) * BM
    x_desc = tile_desc(x_ptr, M, N, stride_x, BM, BN)
    h_desc = tile_desc(h_ptr, M, N, stride_h, BM, BN)
    ss = tl.zeros((BM,), dtype=tl.float32)
    for off_n in range(0, N, BN):
        x = load_tile(x_desc, off_m, off_n)
        ss += tl.sum(x * x, axis=1)
        store_tile(h_desc, off_m, off_n, scale_cols(x, gamma_ptr, off_n, N, BN))
    rows = off_m + tl.arange(0, BM)
    tl.store(rstd_ptr + rows, tl.rsqrt(ss / N + eps), mask=rows < M)


def norm_input(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rstd)`` of an x no GEMM produced: ``h = x * gamma`` (x's dtype), rstd fp32 [M]; one pass over x."""
    x, gamma = x.contiguous(), gamma.contiguous()
    M, N = x.shape
    h = torch.empty_like(x)
    rstd = torch.empty(M, device=x.device, dtype=torch.float32)
    bm, bn = 16, min(256, triton.next_power_of_2(N))
    norm_input_kernel[(triton.cdiv(M, bm),)](x, gamma, h, rstd, M, N, x.stride(0), h.stride(0), eps,
                                             BM=bm, BN=bn)
    return h, rstd
