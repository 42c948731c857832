"""QKV GEMM + RMSNorm row scale + RoPE (coda-spec rewrite (c)).

The q and k rows of ``w_qkv`` are permuted once (:func:`kernels.layouts.qkv_rows_to_adjacent`) so each
head's rotary pairs are adjacent columns. Epilogue, for pair p = (column 2p, column 2p+1)::

    z = rstd[:, None] * (h @ w_qkv^T)
    (x, y) = (z_2p, z_2p+1) -> (x cos - y sin, y cos + x sin),   angle = pos_m * theta^(-2i/dh)

with i = p mod (dh / 2) the pair's index within its head; v columns have frequency 0 (cos 1, sin 0). A scaled
RoPE (linear, llama3) replaces ``theta^(-2i/dh)`` by its own frequencies ``inv_freq_i``. This equals Hugging
Face's half-split RoPE after the layout permutation.
Declared as its epilogue (:mod:`kernels.coda.program`); its split path rotates the GEMM output in place, with the
same angle computation (:func:`kernels.coda.epilogue.rope_cos_sin`).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from codabench.registry import Native
from kernels.coda.epilogue import rope_cos_sin, rotate_pairs
from kernels.coda.mainloop import subtiled_configs
from kernels.coda.program import Binding, Gemm, Output, coda
from workloads.fp8 import Fp8, Recipe


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


@triton.jit
def rope(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """z's adjacent column pairs rotated by the angles of positions ``args[0]`` and frequencies ``args[1]``."""
    cos, sin = rope_cos_sin(args[0], args[1], off_m, off_n, M, N, BM, BN)
    return (rotate_pairs(z, cos, sin, BM, BN),)


def _freq(n: int, heads: int, kv_heads: int, head_dim: int, theta: float, device: torch.device,
          inv_freq: tuple[float, ...] | None) -> torch.Tensor:
    """The frequency table of a qkv output with n columns (:func:`rope_freq_table`), after checking n."""
    if n != (heads + 2 * kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"w_qkv has {n} rows; expected (heads + 2 kv_heads) * head_dim with an even head_dim")
    return rope_freq_table(heads, kv_heads, head_dim, float(theta), device, inv_freq)


def model_rope(n: Native) -> dict[str, Any]:
    """The RoPE arguments of a cell's model (``n.model``): heads, kv_heads, head_dim, theta (a Binding's args)."""
    model = n.model
    return {"heads": model.heads, "kv_heads": model.kv_heads, "head_dim": model.head_dim, "theta": model.rope_theta}


@coda(rope, outputs=(Output("out"),), inputs=("pos_ptr", "freq_ptr"), row_scale="rstd",
      configs=subtiled_configs((2, 1, 4)),
      binds=(Binding(("gemm_rope",), ("qkv",), "gemm_rope: GEMM + row scale + RoPE",
                     model_rope),))
def gemm_rope(h: torch.Tensor | Fp8, w_qkv: torch.Tensor | Fp8, rstd: torch.Tensor, positions: torch.Tensor,
              heads: int, kv_heads: int, head_dim: int, theta: float, recipe: Recipe | None = None,
              inv_freq: tuple[float, ...] | None = None) -> Gemm:
    """Packed qkv [M, (H + 2 Hkv) dh] in h's dtype (bf16 for fp8 h, w_qkv), RoPE'd q and k in the adjacent-pair
    layout.

    w_qkv: nn.Linear layout with q/k rows in the adjacent-pair order; rstd fp32 [M]; positions [M] (integer);
    inv_freq: the head's dh/2 frequencies instead of ``theta^(-2i/dh)`` (:func:`rope_freq_table`).
    """
    n = (w_qkv.data if isinstance(w_qkv, Fp8) else w_qkv).shape[0]
    freq = _freq(n, heads, kv_heads, head_dim, theta, rstd.device, inv_freq)
    return Gemm(h, w_qkv.T, recipe, row_scale=rstd, inputs=(positions.contiguous(), freq))
