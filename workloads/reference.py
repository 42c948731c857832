"""The unfused PyTorch math every provider is compared against (canonical layouts).

These functions are the torch-eager baseline when called on low-precision tensors, and the
error reference when called on float64 copies of the same inputs. Canonical layouts:
gate and up are separate weights; RoPE uses Hugging Face's half-split pairs,
``out = [x1 cos - x2 sin, x2 cos + x1 sin]`` with ``x1, x2`` the two halves of each head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def rmsnorm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """``g * x * (mean_j x_j^2 + eps)^(-1/2)`` along the last dim."""
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


def rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row ``r = (mean_j x_j^2 + eps)^(-1/2)`` in fp32 (fp64 for fp64 input), as F.rms_norm computes it."""
    xf = x if x.dtype == torch.float64 else x.float()
    return torch.rsqrt(xf.pow(2).mean(-1) + eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """Angles ``pos_m * theta^(-2i/dh)``, shape (M, dh/2), computed in fp32 (fp64 for an fp64 reference)."""
    adt = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=adt) / head_dim))
    return positions.to(adt)[:, None] * inv_freq[None, :]


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split RoPE on x of shape (M, heads, dh); cos/sin cast to x.dtype as Hugging Face does."""
    ang = rope_angles(positions, x.shape[-1], theta, x.dtype)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def qkv_rope(qkv: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
             theta: float) -> torch.Tensor:
    """RoPE applied to the q and k parts of a packed (M, (H + 2 Hkv) dh) tensor; v passes through."""
    m = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = rope(q.reshape(m, heads, head_dim), positions, theta).reshape(m, -1)
    k = rope(k.reshape(m, kv_heads, head_dim), positions, theta).reshape(m, -1)
    return torch.cat([q, k, v], -1)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy with ignore_index -100, computed in fp32 (fp64 for an fp64 reference)."""
    lf = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(lf, target, ignore_index=IGNORE_INDEX, reduction=reduction)


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    lf = logits if logits.dtype == torch.float64 else logits.float()
    return torch.logsumexp(lf, -1)
