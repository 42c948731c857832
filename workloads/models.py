"""Model presets: the shapes of one Llama-style block.

Notation follows coda-spec.md: M = tokens, d = hidden, f = FFN width, H/Hkv = query/KV heads,
dh = head dim, q = (H + 2 Hkv) dh (packed QKV width), V = vocab.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path


LIMITS = {"hidden": 1 << 16, "ffn": 1 << 18, "heads": 1024, "kv_heads": 1024, "head_dim": 1024, "vocab": 1 << 20,
          "tokens": 1 << 20, "seq_len": 1 << 20, "layers": 256}
"""The largest value of each whole-number field of a shape (the smallest is 1), from ``--model``, ``--model-config``
and the ``--tokens``/``--vocab``/``--layers``/``--check-tokens`` flags alike: each is several times the largest
real model's (Llama 3 405B: hidden 16384, ffn 53248, 126 layers, a 128256-token vocabulary), so only a typo exceeds
it, and a run of a typo's size would not finish."""


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
    layers: int = 4
    """Decoder layers of the whole-model workloads (``train_step``); the per-block ops ignore it. 4 by default: the
    training step that issue 19 measured (4 layers of the Llama-3.2-1B shape); ``--layers`` overrides it."""

    @property
    def attn_width(self) -> int:
        """Width of the attention output, the out-projection's K."""
        return self.heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def with_(self, **changes) -> "ModelShape":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def inline_spec(self) -> str:
        """The ``--model`` value that defines this shape (:func:`parse_model_spec`)."""
        return f"{self.name}:" + ",".join(f"{k}={getattr(self, k)!r}" for k in INLINE_KEYS)

    def check(self) -> "ModelShape":
        """The shape itself, or ValueError naming the first field that is out of range (:data:`LIMITS`) or
        inconsistent."""
        for f, most in LIMITS.items():
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= most:
                raise ValueError(f"model {self.name}: {f} must be a whole number from 1 to {most}, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model {self.name}: head_dim ({self.head_dim}) must be even (RoPE rotates pairs)")
        if not self.rope_theta > 0 or not self.eps > 0:
            raise ValueError(f"model {self.name}: rope_theta and eps must be > 0")
        return self


def _paper(d: int, heads: int) -> ModelShape:
    ffn = -(-(8 * d // 3) // 256) * 256  # round_up(8d/3, 256)
    return ModelShape(f"paper-{ {2048: '1b', 4096: '7b', 8192: '70b'}[d] }", d, ffn, heads, heads, 128)


LLAMA3_VOCAB = 128256

PRESETS: dict[str, ModelShape] = {
    # Tiny shapes for the CPU interpreter. Every dim is a multiple of 16 (16-byte rows down to fp8, which need no
    # padding: tests/test_coda_ragged.py runs the other sizes; K and N of fp8 GEMMs) but not of the tile sizes, so
    # masking is exercised everywhere. Two layers: the fewest in which a layer hands its output to the next (CODA's
    # block boundary), at half the interpreter's time of four.
    "tiny": ModelShape("tiny", hidden=80, ffn=112, heads=4, kv_heads=2, head_dim=16, vocab=208,
                       tokens=48, seq_len=40, layers=2),
    "llama-1b": ModelShape("llama-1b", 2048, 8192, 32, 8, 64, rope_theta=500000.0),
    "llama-7b": ModelShape("llama-7b", 4096, 11008, 32, 32, 128),
    "llama-70b": ModelShape("llama-70b", 8192, 28672, 64, 8, 128, rope_theta=500000.0),
    # The Llama 3 shapes with the real vocabulary (the llama-* presets keep the paper's 32768).
    "llama3-1b": ModelShape("llama3-1b", 2048, 8192, 32, 8, 64, vocab=LLAMA3_VOCAB, rope_theta=500000.0),
    "llama3-8b": ModelShape("llama3-8b", 4096, 14336, 32, 8, 128, vocab=LLAMA3_VOCAB, rope_theta=500000.0),
    "llama3-70b": ModelShape("llama3-70b", 8192, 28672, 64, 8, 128, vocab=LLAMA3_VOCAB, rope_theta=500000.0),
    "paper-1b": _paper(2048, 16),
    "paper-7b": _paper(4096, 32),
    "paper-70b": _paper(8192, 64),
}


def get_model(name: str, tokens: int | None = None, vocab: int | None = None) -> ModelShape:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name].with_(tokens=tokens, vocab=vocab)


INLINE_KEYS = {"hidden": int, "ffn": int, "heads": int, "kv_heads": int, "head_dim": int, "vocab": int,
               "rope_theta": float, "eps": float, "tokens": int, "seq_len": int, "layers": int}
"""``--model NAME:key=value,...`` keys; hidden, ffn, heads and vocab are required, kv_heads defaults to heads and
head_dim to hidden / heads."""


def parse_model_spec(spec: str) -> ModelShape:
    """A shape from ``NAME:hidden=4096,ffn=14336,heads=32,kv_heads=8,head_dim=128,vocab=128256`` (ValueError with one
    line when a key is unknown, missing, given twice or not a number, or the shape is inconsistent)."""
    name, sep, body = spec.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--model {spec!r}: expected NAME:hidden=...,ffn=...,heads=...,vocab=...")
    name = name.strip()
    if name in PRESETS:
        raise ValueError(f"--model {name}: that name is a preset; choose another")
    values: dict[str, int | float] = {}
    for item in filter(None, (t.strip() for t in body.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"--model {name}: {item!r} is not key=value (keys: {', '.join(INLINE_KEYS)})")
        if key not in INLINE_KEYS:
            raise ValueError(f"--model {name}: unknown key {key!r} (keys: {', '.join(INLINE_KEYS)})")
        if key in values:  # the last value would silently win
            raise ValueError(f"--model {name}: {key} given more than once")
        try:
            values[key] = INLINE_KEYS[key](text.strip())
        except ValueError:
            raise ValueError(f"--model {name}: {key}={text.strip()!r} is not a number") from None
    return _shape(name, values, f"--model {name}")


# Hugging Face config.json field -> ModelShape field; a default of None marks a required field.
HF_FIELDS = {"hidden_size": ("hidden", None), "intermediate_size": ("ffn", None),
             "num_attention_heads": ("heads", None), "vocab_size": ("vocab", None),
             "num_key_value_heads": ("kv_heads", "heads"), "head_dim": ("head_dim", "hidden / heads"),
             "rope_theta": ("rope_theta", 10000.0), "rms_norm_eps": ("eps", 1e-6)}
"""What is read from a config.json. ``rope_theta`` may sit in ``rope_parameters`` or ``rope_scaling`` (newer
transformers); missing optional fields take the defaults of transformers' LlamaConfig."""


LLAMA_FAMILY = {"llama": None, "mistral": None, "phi3": None,
                "qwen2": "its q/k/v projections' bias is not modeled (one vector added to the QKV GEMM's output "
                         "before RoPE; the GEMM shapes are the same)"}
"""The ``model_type`` values of a config.json this suite models: a block of RMSNorm (``x * rstd * w``), a SwiGLU MLP
(``silu(gate) * up``) and RoPE over whole heads with ``theta^(-2i/dh)``, as the ops compute it (Phi-3 packs q/k/v and
gate/up into one weight each: the same GEMMs). The value is what the ops leave out of that model, said when it is
read, or None. A config without ``model_type`` is read by its ``architectures`` (:data:`HF_ARCHITECTURES`), and one
with neither as a Llama config."""
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3",
                    "Qwen2ForCausalLM": "qwen2"}
NOT_MODELED = {
    "gemma": "a GeGLU MLP (GELU-tanh gate) and RMSNorm with (1 + w)",
    "gemma2": "a GeGLU MLP, RMSNorm with (1 + w), norms after attention and MLP, and logit soft-capping",
    "gemma3": "a GeGLU MLP, RMSNorm with (1 + w), norms after attention and MLP, and q/k norms",
    "qwen3": "RMSNorms of q and k before RoPE",
    "olmo2": "q/k norms and norms after attention and MLP",
    "phi": "LayerNorm, a GELU MLP and partial rotary",
    "mixtral": "a mixture-of-experts MLP", "qwen2_moe": "a mixture-of-experts MLP",
    "qwen3_moe": "a mixture-of-experts MLP", "deepseek_v3": "a mixture-of-experts MLP and latent attention",
}
"""Why some common non-Llama ``model_type`` values are refused: what their block computes that the ops do not."""
SWIGLU_ACTS = ("silu", "swish")
PLAIN_ROPE = (None, "default")
"""``rope_scaling`` / ``rope_parameters`` types the ops model: none (RoPE with ``theta^(-2i/dh)``)."""


def from_hf_config(path: str | Path, notes: list[str] | None = None) -> ModelShape:
    """A shape from a Hugging Face ``config.json`` (or the folder holding one); ValueError with one line when the file
    cannot be read, a field is missing, not a number or inconsistent, or the model is not one this suite models
    (:func:`check_architecture`). The name is the folder's (or the ``_name_or_path``'s last part). What the ops leave
    out of an accepted model (:data:`LLAMA_FAMILY`) is appended to ``notes``, one line each."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except OSError as e:
        raise ValueError(f"--model-config {path}: cannot read {file.name if path.is_dir() else 'it'} "
                         f"({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--model-config {file}: not JSON ({getattr(e, 'msg', None) or e.reason}"
                         + (f" at line {e.lineno})" if isinstance(e, json.JSONDecodeError) else ")")) from None
    if not isinstance(config, dict):
        raise ValueError(f"--model-config {file}: not a config object")
    for nested in ("rope_parameters", "rope_scaling"):
        if "rope_theta" not in config and isinstance(config.get(nested), dict) and "rope_theta" in config[nested]:
            config["rope_theta"] = config[nested]["rope_theta"]
    values: dict[str, int | float] = {}
    for key, (field, default) in HF_FIELDS.items():
        if config.get(key) is None:
            if default is None:
                raise ValueError(f"--model-config {file}: the field {key} is missing")
            continue
        v = config[key]
        want = int if INLINE_KEYS[field] is int else float
        if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                (isinstance(v, float) and not (math.isfinite(v) and (want is float or v.is_integer()))):
            raise ValueError(f"--model-config {file}: {key} must be a {'whole ' if want is int else ''}number, "
                             f"got {v!r}")
        values[field] = want(v)
    origin = str(config.get("_name_or_path") or "").rstrip("/")
    name = origin.rsplit("/", 1)[-1] if origin else (file.parent.name if file.name == "config.json" else file.stem)
    shape = _shape(name or file.stem, values, f"--model-config {file}")
    try:
        note = check_architecture(config, shape)
    except ValueError as e:
        raise ValueError(f"--model-config {file}: {e}") from None
    if note and notes is not None:
        notes.append(f"--model-config {file}: {note}")
    return shape


def check_architecture(config: dict, shape: ModelShape | None = None) -> str | None:
    """What the ops leave out of the block of the Hugging Face ``config`` (:data:`LLAMA_FAMILY`), or None; ValueError
    naming the first reason the ops do not compute that block: another ``model_type`` (or ``architectures``), an
    activation other than SiLU, soft-capping, partial rotary, a scaled RoPE (with ``shape``: the ``--model`` flag
    that benchmarks its shapes with plain RoPE), a bias on the projections."""
    kind = config.get("model_type")
    if kind is None and config.get("architectures") is not None:
        archs = config["architectures"]
        if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str) or \
                archs[0] not in HF_ARCHITECTURES:
            raise ValueError(f"architectures {archs!r} is not a Llama-family block this suite models (accepted: "
                             f"{', '.join(HF_ARCHITECTURES)})")
        kind = HF_ARCHITECTURES[archs[0]]
    if kind is not None and not isinstance(kind, str):
        raise ValueError(f"model_type must be a string, got {kind!r}")
    if kind is not None and kind not in LLAMA_FAMILY:
        why = f" (its block has {NOT_MODELED[kind]})" if kind in NOT_MODELED else ""
        raise ValueError(f"model_type {kind!r} is not a Llama-family block this suite models{why}; accepted: "
                         f"{', '.join(LLAMA_FAMILY)}")
    for key in ("hidden_act", "hidden_activation"):
        if config.get(key) is not None and config[key] not in SWIGLU_ACTS:
            raise ValueError(f"{key} {config[key]!r} is not modeled (the ops' MLP is SwiGLU: silu(gate) * up)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise ValueError(f"{key} {config[key]!r} is not modeled (the ops do not soft-cap)")
    factor = config.get("partial_rotary_factor")
    if factor is not None and factor != 1:
        raise ValueError(f"partial_rotary_factor {factor!r} is not modeled (the ops rotate whole heads)")
    for key in ("rope_scaling", "rope_parameters"):
        scaling = config.get(key)
        if scaling is None:
            continue
        if not isinstance(scaling, dict):
            raise ValueError(f"{key} must be an object or null, got {scaling!r}")
        kind_of_rope = scaling.get("rope_type", scaling.get("type"))
        if kind_of_rope not in PLAIN_ROPE:
            instead = f"; its shapes with plain RoPE: --model {shape.inline_spec()}" if shape else ""
            raise ValueError(f"{key} type {kind_of_rope!r} is not modeled (the ops' RoPE has the frequencies "
                             f"theta^(-2i/dh)){instead}")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"{key} {config[key]!r} is not modeled (the ops' projections have no bias)")
    return LLAMA_FAMILY.get(kind) if kind is not None else None


def _shape(name: str, values: dict[str, int | float], where: str) -> ModelShape:
    for key in ("hidden", "ffn", "heads", "vocab"):
        if key not in values:
            raise ValueError(f"{where}: {key} is missing")
    values.setdefault("kv_heads", values["heads"])
    if "head_dim" not in values:
        heads = values["heads"]
        if heads and values["hidden"] % heads:
            raise ValueError(f"{where}: head_dim is missing and hidden ({values['hidden']}) is not a multiple of "
                             f"heads ({heads})")
        values["head_dim"] = values["hidden"] // heads if heads else 0  # no heads: check() names the heads field
    known = {f.name for f in fields(ModelShape)}
    try:
        return ModelShape(name, **{k: v for k, v in values.items() if k in known}).check()
    except ValueError as e:
        raise ValueError(f"{where}: {str(e).split(': ', 1)[-1]}") from None
