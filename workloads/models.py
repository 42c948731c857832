"""Model presets: the shapes of one Llama-style block.

Notation follows coda-spec.md: M = tokens, d = hidden, f = FFN width, H/Hkv = query/KV heads,
dh = head dim, q = (H + 2 Hkv) dh (packed QKV width), V = vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 32768
    tokens: int = 16384
    seq_len: int = 8192
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def attn_width(self) -> int:
        """Width of the attention output, the out-projection's K."""
        return self.heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def with_(self, **changes) -> "ModelShape":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _paper(d: int, heads: int) -> ModelShape:
    ffn = -(-(8 * d // 3) // 256) * 256  # round_up(8d/3, 256)
    return ModelShape(f"paper-{ {2048: '1b', 4096: '7b', 8192: '70b'}[d] }", d, ffn, heads, heads, 128)


PRESETS: dict[str, ModelShape] = {
    # Tiny shapes for the CPU interpreter. Every dim is a multiple of 16 (16-byte rows for TMA down to
    # fp8; K and N of fp8 GEMMs) but not of the tile sizes, so masking is exercised everywhere.
    "tiny": ModelShape("tiny", hidden=80, ffn=112, heads=4, kv_heads=2, head_dim=16, vocab=208,
                       tokens=48, seq_len=40),
    "llama-1b": ModelShape("llama-1b", 2048, 8192, 32, 8, 64, rope_theta=500000.0),
    "llama-7b": ModelShape("llama-7b", 4096, 11008, 32, 32, 128),
    "llama-70b": ModelShape("llama-70b", 8192, 28672, 64, 8, 128, rope_theta=500000.0),
    "paper-1b": _paper(2048, 16),
    "paper-7b": _paper(4096, 32),
    "paper-70b": _paper(8192, 64),
}


def get_model(name: str, tokens: int | None = None, vocab: int | None = None) -> ModelShape:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name].with_(tokens=tokens, vocab=vocab)
