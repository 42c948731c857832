"""RoPE backward + ZdZ, elementwise (coda-spec, backward rewrites).

The forward (:mod:`kernels.coda.rope`) wrote ``qkv = R z`` with R the per-row rotation of adjacent column
pairs (angle ``pos_m * f_p``; v pairs have f = 0). Given ``dqkv``::

    dz = R^T dqkv                    (rotate every pair by the opposite angle)
    zdz_m = <qkv_m, dqkv_m>          (= <z_m, dz_m>: R is orthogonal, so the pre-RoPE z is never needed)

One kernel, one pass over the rows; the angles come from the same table and the same epilogue helper as
the forward, so R^T is the exact transpose of the rotation the forward applied.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import load_tile, rope_cos_sin, rotate_pairs, row_dot, store_tile
from kernels.coda.mainloop import INTERPRET, tile_desc
from kernels.coda.rope import rope_freq_table


@triton.jit
def rope_bwd_kernel(dq_ptr, q_ptr, pos_ptr, freq_ptr, dz_ptr, zdz_ptr, M, N, stride_dq, stride_q, stride_dz,
                    BM: tl.constexpr, BN: tl.constexpr):
    """Rows [pid BM, pid BM + BM): ``dz = R^T dq`` tile by tile and ``zdz = sum_j q_j dq_j``."""
    off_m = tl.program_id(0) * BM
    dq_desc = tile_desc(dq_ptr, M, N, stride_dq, BM, BN)
    q_desc = tile_desc(q_ptr, M, N, stride_q, BM, BN)
    dz_desc = tile_desc(dz_ptr, M, N, stride_dz, BM, BN)
    zdz = tl.zeros((BM,), dtype=tl.float32)
    for off_n in range(0, N, BN):
        dq = load_tile(dq_desc, off_m, off_n)
        zdz += row_dot(load_tile(q_desc, off_m, off_n), dq)
        cos, sin = rope_cos_sin(pos_ptr, freq_ptr, off_m, off_n, M, N, BM, BN)
        store_tile(dz_desc, off_m, off_n, rotate_pairs(dq, cos, -sin, BM, BN))
    rows = off_m + tl.arange(0, BM)
    tl.store(zdz_ptr + rows, zdz, mask=rows < M)


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
    dqkv, qkv = dqkv.contiguous(), qkv.contiguous()
    freq = rope_freq_table(heads, kv_heads, head_dim, float(theta), dqkv.device, inv_freq)
    dz = torch.empty_like(dqkv)
    zdz = torch.empty(M, device=dqkv.device, dtype=torch.float32)
    bm, bn = (16, 32) if INTERPRET else (16, 256)
    rope_bwd_kernel[(triton.cdiv(M, bm),)](dqkv, qkv, positions.contiguous(), freq, dz, zdz, M, N, dqkv.stride(0),
                                           qkv.stride(0), dz.stride(0), BM=bm, BN=bn)
    return dz, zdz
