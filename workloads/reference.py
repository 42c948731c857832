"""The unfused PyTorch math every provider is compared against (canonical layouts).

These functions are the torch-eager baseline when called on low-precision tensors, and the
error reference when called on float64 copies of the same inputs. Canonical layouts:
gate and up are separate weights; RoPE uses Hugging Face's half-split pairs,
``out = [x1 cos - x2 sin, x2 cos + x1 sin]`` with ``x1, x2`` the two halves of each head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workloads.models import ModelShape

IGNORE_INDEX = -100


def upcast(t: torch.Tensor) -> torch.Tensor:
    """fp32 for a low-precision tensor; fp64 stays fp64, so a composition that upcasts is its own float64 reference."""
    return t if t.dtype == torch.float64 else t.float()


def rmsnorm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """``g * x * (mean_j x_j^2 + eps)^(-1/2)`` along the last dim."""
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


def rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row ``r = (mean_j x_j^2 + eps)^(-1/2)`` in fp32 (fp64 for fp64 input), as F.rms_norm computes it."""
    return torch.rsqrt(upcast(x).pow(2).mean(-1) + eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` of ``y = silu(gate) up`` given dy, in the inputs' dtype::

        dgate = dy up silu'(gate),   silu'(g) = s (1 + g (1 - s)),  s = sigmoid(g);     dup = dy silu(gate)
    """
    s = torch.sigmoid(gate)
    return dy * up * s * (1 + gate * (1 - s)), dy * gate * s


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
    return F.cross_entropy(upcast(logits), target, ignore_index=IGNORE_INDEX, reduction=reduction)


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(upcast(logits), -1)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal LM targets of labels [batch, seq]: ``targets[b, t] = labels[b, t + 1]``, the last
    position of each row ignored (-100)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def sequence_positions(batch: int, seq: int, device: torch.device | str) -> torch.Tensor:
    """Position of each of the batch * seq token rows (row-major): ``m mod seq``."""
    return torch.arange(seq, device=device).repeat(batch)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, heads: int, kv_heads: int,
                     head_dim: int) -> torch.Tensor:
    """``softmax(q k^T / sqrt(dh) + causal mask) v`` per sequence and head, GQA (query head h reads kv head
    ``h // (heads / kv_heads)``), by torch SDPA, on packed rows: q [M, heads * dh], k and v [M, kv_heads * dh],
    M = batch * seq. Returns [M, heads * dh]."""
    t = q.shape[0] // batch

    def heads_first(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.reshape(batch, t, n, head_dim).transpose(1, 2)

    o = F.scaled_dot_product_attention(heads_first(q, heads), heads_first(k, kv_heads), heads_first(v, kv_heads),
                                       is_causal=True, enable_gqa=kv_heads != heads)
    return o.transpose(1, 2).reshape(batch * t, heads * head_dim)


LLAMA_LAYER_WEIGHTS = ("gamma_attn", "w_q", "w_k", "w_v", "w_o", "gamma_mlp", "w_gate", "w_up", "w_down")
"""The weights of one Llama layer, as :func:`llama_loss` names them (nn.Linear layout ``W[out, in]``)."""


def llama_loss(embed: torch.Tensor, layers: list[dict[str, torch.Tensor]], gamma_final: torch.Tensor,
               w_lm: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor, shape: ModelShape,
               reduction: str = "mean") -> torch.Tensor:
    """The standard pre-norm Llama's loss on tokens and targets [batch, seq] (targets as given, not shifted)::

        x = embed[tokens]
        per layer:  h = rmsnorm(x; ga),  x += attn(rope(h Wq^T), rope(h Wk^T), h Wv^T) Wo^T
                    h = rmsnorm(x; gm),  x += (silu(h Wg^T) * (h Wu^T)) Wd^T
        loss = CE(rmsnorm(x; gf) Wlm^T, targets)   (ignore_index -100; mean over the other tokens, or sum)

    with half-split RoPE at each token's position in its sequence and causal GQA attention
    (:func:`causal_attention`); ``layers[i]`` holds layer i's :data:`LLAMA_LAYER_WEIGHTS`.
    """
    batch, seq = tokens.shape
    pos = sequence_positions(batch, seq, tokens.device)
    H, Hkv, dh, eps = shape.heads, shape.kv_heads, shape.head_dim, shape.eps
    x = F.embedding(tokens.reshape(-1), embed)
    for p in layers:
        h = rmsnorm(x, p["gamma_attn"], eps)
        q = rope(F.linear(h, p["w_q"]).reshape(-1, H, dh), pos, shape.rope_theta).reshape(-1, H * dh)
        k = rope(F.linear(h, p["w_k"]).reshape(-1, Hkv, dh), pos, shape.rope_theta).reshape(-1, Hkv * dh)
        x = x + F.linear(causal_attention(q, k, F.linear(h, p["w_v"]), batch, H, Hkv, dh), p["w_o"])
        h = rmsnorm(x, p["gamma_mlp"], eps)
        x = x + F.linear(swiglu(F.linear(h, p["w_gate"]), F.linear(h, p["w_up"])), p["w_down"])
    logits = F.linear(rmsnorm(x, gamma_final, eps), w_lm)
    return cross_entropy(logits, targets.reshape(-1), reduction)
