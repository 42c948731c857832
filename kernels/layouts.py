"""Layout conversions between the canonical layout and the providers' native layouts (pure torch).

Every provider must compute the same function, so weight permutations are done once, outside
timing, and outputs and gradients are converted back before comparison.

SwiGLU gate/up (``W_gate, W_up`` of shape (f, d); canonical: two separate weights)
  - interleaved (CODA, quack): ``W[2f, d]`` with rows ``[g0, u0, g1, u1, ...]``; the GEMM output
    has columns ``z[:, 2i] = gate_i``, ``z[:, 2i+1] = up_i``.
  - concatenated (Liger fused gate-up, FlashInfer ``silu_and_mul``): ``W = [W_gate; W_up]``; output
    columns ``z[:, :f] = gate``, ``z[:, f:] = up``.

RoPE pairs within one head of size dh (canonical: Hugging Face half-split)
  - half-split: column ``i`` pairs with ``i + dh/2``;
    ``out_i = x_i cos_i - x_{i+dh/2} sin_i``, ``out_{i+dh/2} = x_{i+dh/2} cos_i + x_i sin_i``.
  - adjacent (CODA): column ``2i`` pairs with ``2i + 1``, same angle ``angle_i = pos * theta^(-2i/dh)``
    and the same sign convention: ``(x, y) -> (x cos - y sin, y cos + x sin)``.
  Permuting the q and k rows of ``W_qkv`` (v untouched) with :func:`rope_pair_perm` turns one layout
  into the other: adjacent column ``2i`` holds half-split column ``i`` and ``2i+1`` holds ``i + dh/2``.
"""
from __future__ import annotations

import torch


# ---- SwiGLU gate/up ------------------------------------------------------------------------

def interleave_rows(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``W[2f, d]`` with rows ``[g0, u0, g1, u1, ...]`` from gate and up weights of shape (f, d)."""
    return torch.stack([w_gate, w_up], dim=1).reshape(2 * w_gate.shape[0], *w_gate.shape[1:])


def deinterleave_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_rows`: ``(W[0::2], W[1::2])`` as contiguous tensors."""
    return w[0::2].contiguous(), w[1::2].contiguous()


def interleave_cols(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``t[..., 2f]`` with columns ``[g0, u0, g1, u1, ...]`` (activations or their gradients)."""
    return torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def deinterleave_cols(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_cols`: ``(t[..., 0::2], t[..., 1::2])`` as contiguous tensors."""
    return t[..., 0::2].contiguous(), t[..., 1::2].contiguous()


def concat_rows(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``[W_gate; W_up]``, shape (2f, d): the concatenated gate/up weight."""
    return torch.cat([w_gate, w_up], dim=0)


def split_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`concat_rows`: the two halves of the rows, as contiguous tensors."""
    gate, up = w.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


# ---- RoPE pairs ----------------------------------------------------------------------------

def rope_pair_perm(heads: int, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Index permutation p of ``heads * head_dim`` columns: ``adjacent[:, j] = halfsplit[:, p[j]]``.

    Within each head block: ``p[2i] = i`` and ``p[2i + 1] = i + head_dim/2``.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    half = head_dim // 2
    i = torch.arange(half, device=device)
    within = torch.stack([i, i + half], dim=1).reshape(head_dim)
    base = torch.arange(heads, device=device)[:, None] * head_dim
    return (base + within[None, :]).reshape(heads * head_dim)


def qkv_perm(heads: int, kv_heads: int, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Permutation of the packed QKV width ``(H + 2 Hkv) dh``: q and k blocks by :func:`rope_pair_perm`, v identity."""
    q = rope_pair_perm(heads, head_dim, device)
    k = heads * head_dim + rope_pair_perm(kv_heads, head_dim, device)
    v = torch.arange((heads + kv_heads) * head_dim, (heads + 2 * kv_heads) * head_dim, device=device)
    return torch.cat([q, k, v])


def qkv_rows_to_adjacent(w_qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rows of ``W_qkv`` (canonical half-split) reordered so the GEMM emits adjacent RoPE pairs."""
    return w_qkv[qkv_perm(heads, kv_heads, head_dim, w_qkv.device)]


def qkv_rows_to_halfsplit(w_qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`qkv_rows_to_adjacent` (e.g. for the gradient of the permuted weight)."""
    inv = torch.argsort(qkv_perm(heads, kv_heads, head_dim, w_qkv.device))
    return w_qkv[inv]


def qkv_cols_to_adjacent(t: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Columns of a packed (..., q) tensor from half-split to adjacent pairs (e.g. upstream gradients)."""
    return t[..., qkv_perm(heads, kv_heads, head_dim, t.device)]


def qkv_cols_to_halfsplit(t: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Columns of a packed (..., q) tensor from adjacent pairs back to half-split (outputs, gradients)."""
    inv = torch.argsort(qkv_perm(heads, kv_heads, head_dim, t.device))
    return t[..., inv]


def rotate_adjacent(t: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent column pair ``(t_2p, t_2p+1)`` of t (..., 2P) by ``angles`` (..., P), broadcast.

    ``out_2p = t_2p cos - t_2p+1 sin``, ``out_2p+1 = t_2p+1 cos + t_2p sin``; cos/sin cast to t.dtype first, as
    Hugging Face casts its RoPE tables.
    """
    cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
    te, to = t[..., 0::2], t[..., 1::2]
    return torch.stack([te * cos - to * sin, to * cos + te * sin], dim=-1).flatten(-2)
