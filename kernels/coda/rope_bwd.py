"""RoPE backward + ZdZ, elementwise (coda-spec, backward rewrites).

The forward (:mod:`kernels.coda.rope`) wrote ``qkv = R z`` with R the per-row rotation of adjacent column
pairs (angle ``pos_m * f_p``; v pairs have f = 0). Given ``dqkv``::

    dz = R^T dqkv                    (rotate every pair by the opposite angle)
    zdz_m = <qkv_m, dqkv_m>          (= <z_m, dz_m>: R is orthogonal, so the pre-RoPE z is never needed)

One pass over dqkv in short, wide blocks (zdz from their row partials, then a row sum); the angles come from the same
table and the same epilogue helper as the forward, so R^T is the exact transpose of the rotation the forward applied.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.align import aligned, empty_rows
from kernels.coda.epilogue import load_block, rope_cos_sin, rotate_pairs, row_dot, store_block, store_row_partial
from kernels.coda.host import cdiv
from kernels.coda.mainloop import INTERPRET
from kernels.coda.reduce import finish_row_sum
from kernels.coda.rope import rope_freq_table


@triton.jit
def rope_bwd_kernel(dq_ptr, q_ptr, pos_ptr, freq_ptr, dz_ptr, part_ptr, M, N, stride_dq, stride_q, stride_dz, stride_p,
                    BM: tl.constexpr, BN: tl.constexpr):
    """One (BM, BN) block per program (grid: row blocks x column blocks), read and written with pointer accesses (a
    bandwidth-bound pass: no descriptors, no loop): ``dz = R^T dq`` and the block's row partials of ``q dq`` into
    ``part[:, column block]``."""
    off_m, off_n = tl.program_id(0) * BM, tl.program_id(1) * BN
    dq = load_block(dq_ptr, stride_dq, off_m, off_n, M, N, BM, BN)
    q = load_block(q_ptr, stride_q, off_m, off_n, M, N, BM, BN)
    cos, sin = rope_cos_sin(pos_ptr, freq_ptr, off_m, off_n, M, N, BM, BN)
    store_block(dz_ptr, stride_dz, off_m, off_n, M, N, rotate_pairs(dq, cos, -sin, BM, BN), BM, BN)
    store_row_partial(part_ptr, row_dot(q, dq), off_m, off_n, M, stride_p, BM, BN)


ROW_BLOCK = (4, 1024, 8)
"""(BM, BN, num_warps) of :func:`rope_bwd_kernel` on the GPU. Measured on an H200 (M = 16384; 1B / 7B QKV widths
3072 / 12288): 0.082 / 0.302 ms, 3.7 / 4.0 TB/s; the eight shapes tried (1-16 rows, 256-1024 columns) were within
4% of it."""


def rope_bwd(dqkv: torch.Tensor, qkv: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int,
             head_dim: int, theta: float, inv_freq: tuple[float, ...] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dz, zdz)``: dz [M, q] = R^T dqkv in dqkv's dtype, zdz fp32 [M] = <qkv, dqkv> per row.

    dqkv and qkv (the saved rotated output of :func:`kernels.coda.rope.gemm_rope`) are in the adjacent-pair
    layout; positions [M] integer; heads, kv_heads, head_dim, theta, inv_freq as in the forward.
    """
    M, N = dqkv.shape
    if qkv.shape != dqkv.shape or N != (heads + 2 * kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"dqkv {tuple(dqkv.shape)} / qkv {tuple(qkv.shape)} do not match "
                         f"(heads + 2 kv_heads) * head_dim = {(heads + 2 * kv_heads) * head_dim}")
    dqkv, qkv = aligned(dqkv), aligned(qkv)
    freq = rope_freq_table(heads, kv_heads, head_dim, float(theta), dqkv.device, inv_freq)
    dz = empty_rows(M, N, dqkv.dtype, dqkv.device)
    bm, bn, warps = (16, 32, 4) if INTERPRET else ROW_BLOCK
    n_tiles = cdiv(N, bn)
    part = torch.empty(M, n_tiles, device=dqkv.device, dtype=torch.float32)
    rope_bwd_kernel[(cdiv(M, bm), n_tiles)](dqkv, qkv, positions.contiguous(), freq, dz, part, M, N,
                                             dqkv.stride(0), qkv.stride(0), dz.stride(0), part.stride(0),
                                             BM=bm, BN=bn, num_warps=warps)
    return dz, finish_row_sum(part, n_tiles)
