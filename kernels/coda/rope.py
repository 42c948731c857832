"""QKV GEMM + RMSNorm row scale + RoPE (coda-spec rewrite (c)).

The q and k rows of ``w_qkv`` are permuted once (:func:`kernels.layouts.qkv_rows_to_adjacent`) so each
head's rotary pairs are adjacent columns. Epilogue, for pair p = (column 2p, column 2p+1)::

    z = rstd[:, None] * (h @ w_qkv^T)
    (x, y) = (z_2p, z_2p+1) -> (x cos - y sin, y cos + x sin),   angle = pos_m * theta^(-2i/dh)

with i = p mod (dh / 2) the pair's index within its head; v columns have frequency 0 (cos 1, sin 0). A scaled
RoPE (linear, llama3) replaces ``theta^(-2i/dh)`` by its own frequencies ``inv_freq_i``. This equals Hugging
Face's half-split RoPE after the layout permutation.
Split path (:mod:`kernels.coda.strategy`): the plain GEMM, then the row scale and rotation in place over its output,
with the same angle computation (:func:`kernels.coda.epilogue.rope_cos_sin`).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import (col_subtile, dequant_scale, load_rows, load_tile, rope_cos_sin, rotate_pairs,
                                   store_tile)
from kernels.coda.gemm import split_matmul
from kernels.coda.launch import FusedGemm
from kernels.coda.mainloop import (INTERPRET, coda_autotune, mainloop, num_tiles, operand_descs, subtiled_configs,
                                   tile_coords, tile_desc)
from kernels.coda.strategy import with_split
from workloads.fp8 import Fp8


@functools.lru_cache(maxsize=32)
def rope_freq_table(heads: int, kv_heads: int, head_dim: int, theta: float, device: torch.device,
                    inv_freq: tuple[float, ...] | None = None) -> torch.Tensor:
    """fp32 [2, q/2] (q = (H + 2 Hkv) dh): per column pair, its head's frequency ``f_i`` as ``hi + lo``.

    ``f_i = theta^(-2i/dh)``, or ``inv_freq[i]`` when given (the dh/2 frequencies of a scaled RoPE, e.g. a Hugging
    Face model's ``rotary_emb.inv_freq``). f is taken in fp64; ``hi`` keeps its 8 leading significant bits (exact in
    fp32, and ``pos * hi`` is exact in fp32 for pos < 2^16), ``lo`` is the rest rounded to fp32. v pairs get f = 0.
    """
    if inv_freq is None:
        f = theta ** (-2.0 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
    elif len(inv_freq) == head_dim // 2:
        f = torch.tensor(inv_freq, dtype=torch.float64)
    else:
        raise ValueError(f"inv_freq has {len(inv_freq)} frequencies; expected head_dim / 2 = {head_dim // 2}")
    per_pair = torch.cat([f.repeat(heads + kv_heads), torch.zeros(kv_heads * head_dim // 2, dtype=torch.float64)])
    mant, exp = torch.frexp(per_pair)
    hi = torch.ldexp(torch.floor(mant * 256) / 256, exp)
    return torch.stack([hi, per_pair - hi]).to(device=device, dtype=torch.float32)


@coda_autotune(configs=subtiled_configs((2, 1, 4)))
@triton.jit
def gemm_rope_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                     PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, rstd_ptr, pos_ptr, freq_ptr, out_ptr,
                     stride_o, EPI_SUB: tl.constexpr):
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    SN: tl.constexpr = BN // EPI_SUB  # the epilogue works on EPI_SUB column sub-tiles of SN columns
    out_desc = tile_desc(out_ptr, M, N, stride_o, BM, SN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN, PROMOTE)
        rstd = load_rows(rstd_ptr, off_m, M, BM)
        z = dequant_scale(acc, rstd, sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN, SCALING)
        for i in tl.static_range(EPI_SUB):
            off_s = off_n + i * SN
            cos, sin = rope_cos_sin(pos_ptr, freq_ptr, off_m, off_s, M, N, BM, SN)
            store_tile(out_desc, off_m, off_s, rotate_pairs(col_subtile(z, i, EPI_SUB, BM, BN), cos, sin, BM, SN))


@triton.jit
def rope_rows_kernel(z_ptr, rstd_ptr, pos_ptr, freq_ptr, M, N, stride_z, BM: tl.constexpr, BN: tl.constexpr):
    """Rows [pid BM, pid BM + BM) of the GEMM output c: ``rotate_pairs(rstd[:, None] * c)`` in place, one pass."""
    off_m = tl.program_id(0) * BM
    z_desc = tile_desc(z_ptr, M, N, stride_z, BM, BN)
    rstd = load_rows(rstd_ptr, off_m, M, BM)
    for off_n in range(0, N, BN):
        z = load_tile(z_desc, off_m, off_n) * rstd[:, None]
        cos, sin = rope_cos_sin(pos_ptr, freq_ptr, off_m, off_n, M, N, BM, BN)
        store_tile(z_desc, off_m, off_n, rotate_pairs(z, cos, sin, BM, BN))


def gemm_rope_split(h: torch.Tensor | Fp8, w_qkv: torch.Tensor | Fp8, rstd: torch.Tensor, positions: torch.Tensor,
                    heads: int, kv_heads: int, head_dim: int, theta: float, promote: bool = False,
                    inv_freq: tuple[float, ...] | None = None) -> torch.Tensor:
    """:func:`gemm_rope` split: ``c = h @ w_qkv.T`` (:func:`kernels.coda.gemm.split_matmul`), then the row scale and
    the rotation in place over c (:func:`rope_rows_kernel`, the fused epilogue's angles)."""
    out = split_matmul(h, w_qkv.T, promote)
    M, N = out.shape
    freq = _freq(N, heads, kv_heads, head_dim, theta, out.device, inv_freq)
    bm, bn = (16, 32) if INTERPRET else (16, 256)
    rope_rows_kernel[(triton.cdiv(M, bm),)](out, rstd, positions.contiguous(), freq, M, N, out.stride(0), BM=bm, BN=bn)
    return out


def _freq(n: int, heads: int, kv_heads: int, head_dim: int, theta: float, device: torch.device,
          inv_freq: tuple[float, ...] | None) -> torch.Tensor:
    """The frequency table of a qkv output with n columns (:func:`rope_freq_table`), after checking n."""
    if n != (heads + 2 * kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"w_qkv has {n} rows; expected (heads + 2 kv_heads) * head_dim with an even head_dim")
    return rope_freq_table(heads, kv_heads, head_dim, float(theta), device, inv_freq)


@with_split(gemm_rope_split)
def gemm_rope(h: torch.Tensor | Fp8, w_qkv: torch.Tensor | Fp8, rstd: torch.Tensor, positions: torch.Tensor,
              heads: int, kv_heads: int, head_dim: int, theta: float, promote: bool = False,
              inv_freq: tuple[float, ...] | None = None) -> torch.Tensor:
    """Packed qkv [M, (H + 2 Hkv) dh] in h's dtype (bf16 for fp8 h, w_qkv), RoPE'd q and k in the adjacent-pair
    layout.

    w_qkv: nn.Linear layout with q/k rows in the adjacent-pair order; rstd fp32 [M]; positions [M] (integer);
    inv_freq: the head's dh/2 frequencies instead of ``theta^(-2i/dh)`` (:func:`rope_freq_table`).
    """
    gemm = FusedGemm(h, w_qkv.T, promote)
    freq = _freq(gemm.N, heads, kv_heads, head_dim, theta, gemm.device, inv_freq)
    out = gemm.empty()
    gemm.launch(gemm_rope_kernel, rstd_ptr=rstd, pos_ptr=positions.contiguous(), freq_ptr=freq, out_ptr=out,
                stride_o=out.stride(0))
    return out
