"""Hugging Face drop-in: ``apply_coda(model)`` runs a loaded Llama, Mistral or Qwen2 causal LM on the CODA kernels.

The patched model computes the function of :mod:`kernels.coda.model` (CODA's shifted block boundary) from the
model's own parameters, layer l's modules named as in Hugging Face::

    x_0    = embed_tokens(input_ids)                                          (the model's own embedding)
    qkv_0  = norm_consumer(x_0, g_in_0, Wqkv_0, RoPE)  [+ R_m b_0]             RMSNorm + QKV + RoPE
    x_l+1, qkv_l+1 = block(attn_l(qkv_l), x_l, Wo_l, g_post_l, Wgu_l, Wd_l,   out-proj + residual + norm,
                           g_in_l+1, Wqkv_l+1, RoPE)  [+ R_m b_l+1]            gate/up + SwiGLU, down-proj +
                                                                              residual + norm, next QKV + RoPE
    last layer: (g_in_l+1, Wqkv_l+1, RoPE) -> (norm.weight, lm_head.weight, CrossEntropy) with labels (the loss;
                no logits are written), Linear without (the logits)

with ``Wqkv = qkv_rows_to_adjacent([q_proj.weight; k_proj.weight; v_proj.weight])`` (q/k rows in adjacent RoPE
pairs) and ``Wgu = interleave_rows(gate_proj.weight, up_proj.weight)`` (:mod:`kernels.layouts`), each packed every
forward by one row-copy kernel (:mod:`kernels.coda.pack`). ``attn_l`` is the
model's own attention function (``config._attn_implementation``: eager, sdpa, flash, flex) with the model's own
causal / sliding-window / padding mask, scaling and attention dropout, called on the q, k, v that the CODA kernel
wrote. Nothing applies RoPE again there. The q/k head dims are in adjacent-pair order, and ``q k^T`` does not change
when q and k have their head dims permuted the same way. v is not permuted, so the attention output is in Hugging
Face's layout for o_proj. q/k/v biases (Qwen2): ``RoPE(z + b) = R_m z + R_m b``. The kernel writes ``R_m z``,
and ``R_m b`` (the bias, permuted like the rows and rotated with the kernel's frequency table) is added in torch.
Autograd carries its gradient back to the biases.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from types import MethodType
from typing import Any, Callable

import torch
from torch import nn

from kernels import layouts as L
from kernels.coda.functions import Consumer, CrossEntropy, Linear, RoPE, block, norm_consumer
from kernels.coda.pack import gate_up_index, pack_rows, qkv_index
from kernels.coda.precompile import Precompiled, precompile_autograd
from kernels.coda.rope import rope_freq_table
from workloads.reference import IGNORE_INDEX, shifted_targets

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE types whose cos/sin are exactly those of ``pos * inv_freq``: no attention factor, no dynamic update."""

# Each architecture -> the sliding window of a layer (the config, the layer's attention module) as its model uses it.
_WINDOW: dict[str, Callable[[Any, nn.Module], int | None]] = {
    "LlamaForCausalLM": lambda config, attn: None,
    "MistralForCausalLM": lambda config, attn: config.sliding_window,
    "Qwen2ForCausalLM": lambda config, attn: attn.sliding_window,
}
# Call options whose value is also the unpatched model's default behaviour. Any other option is refused.
_NEUTRAL_OPTIONS = {"use_cache": False, "output_attentions": False, "output_hidden_states": False, "return_dict": True}


class CodaUnsupportedError(ValueError):
    """The model, its config or a call uses something the CODA forward does not compute. The message says what."""


@dataclass(frozen=True)
class _Plan:
    """What the CODA forward needs besides the parameters. It is read once, when the model is patched."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    theta: float
    inv_freq: tuple[float, ...]
    windows: tuple[int | None, ...]
    qkv_bias: bool


def apply_coda(model: nn.Module) -> nn.Module:
    """Patch a loaded ``LlamaForCausalLM``, ``MistralForCausalLM`` or ``Qwen2ForCausalLM`` in place to run on CODA.

    Returns the same model. Its ``forward`` is replaced (only on this instance) by the CODA forward in this
    module's docstring. RMSNorm + QKV + RoPE, out-proj + residual + norm, gate/up + SwiGLU, down-proj + residual
    + norm and final norm + LM head + cross-entropy run as CODA kernels, forward and backward. Embedding and
    attention stay the model's own. Applying it twice changes nothing.

    Calls: ``model(input_ids | inputs_embeds, attention_mask=None, position_ids=None, labels=None,
    logits_to_keep=0, num_items_in_batch=None, shift_labels=None)``. With labels, ``.loss`` is Hugging Face's
    causal LM loss: the labels are shifted left by one (the last position gets -100), ``ignore_index=-100``, and
    the mean is over the tokens that are not ignored. With ``num_items_in_batch`` the loss is the sum divided
    by it, as the Trainer uses it. ``.logits`` is then None, because the fused cross-entropy never writes the
    logits. ``shift_labels`` (given with labels) are used as the targets unshifted, as in Hugging Face. Without
    labels, the last norm + LM head run as a CODA linear consumer and ``.logits`` is returned (``logits_to_keep``
    as in Hugging Face). ``attention_mask`` (padding) and ``position_ids`` are supported: they go to the
    model's own mask builder and attention, and to the RoPE positions. The RoPE frequencies are the model's
    ``rotary_emb.inv_freq``, read when the model is patched.

    Weights: the parameters stay the model's own ``nn.Parameter`` objects, in Hugging Face layout, so
    ``state_dict()``, ``save_pretrained()`` and any optimizer see the model unchanged. The packed/permuted CODA
    weights (Wqkv, Wgu) are derived from them inside the autograd graph on every forward: one cat + row gather
    per layer, whose gradient autograd scatters back into q/k/v_proj and gate/up_proj. A cache would save that
    copy, but it would have to know when an optimizer, ``load_state_dict`` or a write through ``.data`` has
    changed a parameter, and it would keep a second copy of those weights in memory between steps. The derived
    copy costs one read + write of the QKV and gate/up weights per step. It is held until backward:
    ``((heads + 2 kv_heads) head_dim + 2 intermediate) x hidden`` elements per layer (285 MB in bf16 for a
    Llama-3-8B layer).

    Supported: GQA, any ``head_dim``, tied or untied embeddings (a tied LM head is the embedding's parameter,
    and both gradients reach it), RoPE types default / linear / llama3, sliding windows (Mistral, Qwen2: the
    model's own mask and attention), attention dropout (the model's attention applies it), Qwen2's q/k/v biases.

    Refused with :class:`CodaUnsupportedError`, by this function: other architectures, ``hidden_act`` other
    than silu, biases on o_proj or the MLP, projections that are not plain ``nn.Linear`` (LoRA, quantized
    layers) or norms that are not the model's RMSNorm, RoPE types other than the three above (dynamic, yarn,
    longrope, ...) or a partial rotary factor, a custom ``loss_function``, a model split across devices. By
    a call: a KV cache (``cache``/``past_key_values``, ``use_cache=True``, so no ``generate``),
    ``output_attentions``/``output_hidden_states``, ``return_dict=False``, activation (gradient)
    checkpointing in training, any other keyword.
    """
    if getattr(model, "_coda_plan", None) is not None:
        return model
    model._coda_plan = _plan(model)
    model.forward = MethodType(_coda_forward, model)
    return model


def _alias(arch: str) -> Callable[[nn.Module], nn.Module]:
    def apply(model: nn.Module) -> nn.Module:
        if type(model).__name__ != arch:
            raise _refuse(f"expected a {arch}, got {type(model).__name__}")
        return apply_coda(model)

    apply.__doc__ = f":func:`apply_coda` for a ``{arch}`` (any other model is refused)."
    return apply


def precompile_step(model: nn.Module, **batch: Any) -> Precompiled:
    """Compile the CODA kernels of one training step of ``model`` (patched by :func:`apply_coda`) at ``batch``'s
    shape, in parallel, before the first real step: ``model(**batch).loss`` and its backward run once as a dry
    pass (:func:`kernels.coda.precompile.precompile`), which launches no kernel of ours, leaves the parameters
    and their ``.grad`` alone and drops its garbage results. Call it once per batch shape::

        model = apply_coda(model)
        precompile_step(model, input_ids=input_ids, labels=labels)   # seconds instead of a serial compile
        for batch in loader: model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
    """
    if getattr(model, "_coda_plan", None) is None:
        raise CodaUnsupportedError("precompile_step needs a model patched by apply_coda")
    params = [p for p in model.parameters() if p.requires_grad]
    return precompile_autograd(lambda: model(**batch).loss, params, params[0].device)


apply_coda_to_llama = _alias("LlamaForCausalLM")
apply_coda_to_mistral = _alias("MistralForCausalLM")
apply_coda_to_qwen2 = _alias("Qwen2ForCausalLM")


def _refuse(reason: str) -> CodaUnsupportedError:
    return CodaUnsupportedError(f"apply_coda: {reason}")


def _plan(model: nn.Module) -> _Plan:
    """Check the model against what the CODA forward computes (see :func:`apply_coda`) and read its constants."""
    arch = type(model).__name__
    if arch not in _WINDOW:
        raise _refuse(f"{arch} is not supported (supported: {', '.join(_WINDOW)})")
    from transformers.loss.loss_utils import ForCausalLMLoss

    config, base = model.config, model.model
    layers = list(base.layers)
    norm_cls = f"{arch.removesuffix('ForCausalLM')}RMSNorm"
    if config.hidden_act != "silu":
        raise _refuse(f"hidden_act={config.hidden_act!r}: the CODA MLP is SwiGLU with silu")
    if model.loss_function is not ForCausalLMLoss:
        raise _refuse("a custom loss_function: the fused cross-entropy computes Hugging Face's causal LM loss")
    if len({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}) > 1:
        raise _refuse("the model is split across devices (device_map)")
    linears = [model.lm_head] + [m for layer in layers for m in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    if any(type(m) is not nn.Linear for m in linears):
        raise _refuse("a projection is not a plain nn.Linear (LoRA, quantized or otherwise replaced layers)")
    norms = [base.norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(type(n).__name__ != norm_cls for n in norms):
        raise _refuse(f"a norm is not a {norm_cls}")
    if any(m.bias is not None for m in [model.lm_head] + [layer.self_attn.o_proj for layer in layers]
           + [p for layer in layers for p in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]):
        raise _refuse("biases on the LM head, o_proj or the MLP (mlp_bias / attention_bias) are not fused")
    has_bias = {(a.q_proj.bias is not None, a.k_proj.bias is not None, a.v_proj.bias is not None)
                for a in (layer.self_attn for layer in layers)}
    if has_bias not in ({(True,) * 3}, {(False,) * 3}):
        raise _refuse("q/k/v biases must be on all of q, k and v in every layer, or on none")
    rotary = base.rotary_emb
    head_dim = layers[0].self_attn.head_dim
    if rotary.rope_type not in SUPPORTED_ROPE_TYPES or rotary.attention_scaling != 1.0:
        raise _refuse(f"rope_type={rotary.rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rotary.inv_freq.numel() != head_dim // 2:
        raise _refuse(f"RoPE on {2 * rotary.inv_freq.numel()} of the {head_dim} head dims (partial_rotary_factor)")
    return _Plan(heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=head_dim,
                 eps=config.rms_norm_eps, theta=float(config.rope_parameters["rope_theta"]),
                 inv_freq=tuple(rotary.inv_freq.double().tolist()),
                 windows=tuple(_WINDOW[arch](config, layer.self_attn) for layer in layers),
                 qkv_bias=has_bias == {(True,) * 3})


def _check_call(model: nn.Module, options: dict[str, Any]) -> None:
    for name, value in options.items():
        if value is not None and not (name in _NEUTRAL_OPTIONS and value == _NEUTRAL_OPTIONS[name]):
            shown = repr(value) if isinstance(value, (bool, int, float, str)) else type(value).__name__
            what = "a KV cache (generation)" if name in ("cache", "past_key_values", "use_cache") else "the option"
            raise _refuse(f"the CODA forward does not support {what}: {name}={shown}")
    if model.training and model.is_activation_checkpointing:
        raise _refuse("activation (gradient) checkpointing is not supported: the CODA blocks save their own tensors")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it in the graph when its storage offset leaves it off the 16-byte alignment that the
    kernels' tensor descriptors need (a parameter that is a view: safetensors' mmap on the CPU, flat buffers)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _w_qkv(attn: nn.Module, plan: _Plan) -> torch.Tensor:
    """The CODA QKV weight: ``[Wq; Wk; Wv]`` with q/k rows in adjacent RoPE pairs (in the autograd graph)."""
    w = attn.q_proj.weight
    return pack_rows(qkv_index(plan.heads, plan.kv_heads, plan.head_dim, w.device), w, attn.k_proj.weight,
                     attn.v_proj.weight)


def _w_gu(mlp: nn.Module) -> torch.Tensor:
    """The CODA gate/up weight: rows interleaved ``[g0, u0, g1, u1, ...]`` (in the autograd graph)."""
    w = mlp.gate_proj.weight
    return pack_rows(gate_up_index(w.shape[0], w.device), w, mlp.up_proj.weight)


def _with_bias(qkv: torch.Tensor, attn: nn.Module, plan: _Plan, positions: torch.Tensor) -> torch.Tensor:
    """``R_m z + R_m b``: the kernel's rotated qkv plus the adjacent-layout bias rotated by each row's angles."""
    if not plan.qkv_bias:
        return qkv
    b = L.qkv_rows_to_adjacent(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]),
                               plan.heads, plan.kv_heads, plan.head_dim)
    f = rope_freq_table(plan.heads, plan.kv_heads, plan.head_dim, plan.theta, b.device, plan.inv_freq).sum(0)
    return qkv + L.rotate_adjacent(b, positions[:, None].to(f.dtype) * f)


def _attend(attn: nn.Module, qkv: torch.Tensor, mask: Any, window: int | None, position_ids: torch.Tensor,
            plan: _Plan, batch: int, seq: int) -> torch.Tensor:
    """The model's own attention function on the packed qkv rows; returns [batch * seq, heads * head_dim]."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(attn).__module__].eager_attention_forward
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
    q, k, v = qkv.split([plan.heads * plan.head_dim, plan.kv_heads * plan.head_dim, plan.kv_heads * plan.head_dim],
                        -1)

    def heads_first(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, -1, plan.head_dim).transpose(1, 2)

    out, _ = fn(attn, heads_first(q), heads_first(k), heads_first(v), mask,
                dropout=attn.attention_dropout if attn.training else 0.0, scaling=attn.scaling,
                sliding_window=window, position_ids=position_ids)
    return out.reshape(batch * seq, -1).contiguous()


def _coda_forward(self: nn.Module, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                  labels: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
                  num_items_in_batch: torch.Tensor | int | None = None, shift_labels: torch.Tensor | None = None,
                  **options: Any):
    """The CODA forward of :func:`apply_coda` (bound to the patched model as its ``forward``)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.modeling_outputs import CausalLMOutputWithPast

    _check_call(self, options)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids or inputs_embeds")
    plan: _Plan = self._coda_plan
    layers = self.model.layers
    embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    batch, seq, hidden = embeds.shape
    # The mask builder gets the caller's position_ids: given arange positions (the default below) it would look for
    # packed sequences, find none, and synchronize the host to say so (transformers' find_packed_sequence_indices).
    masks = {w: (create_causal_mask if w is None else create_sliding_window_causal_mask)(
        self.config, embeds, attention_mask, None, position_ids) for w in set(plan.windows)}
    if position_ids is None:
        position_ids = torch.arange(seq, device=embeds.device)[None]
    positions = position_ids.expand(batch, seq).reshape(-1)
    rope = RoPE(positions, plan.heads, plan.kv_heads, plan.head_dim, plan.theta, plan.inv_freq)
    final: Consumer = Linear()
    if labels is not None:
        targets = shift_labels if shift_labels is not None else shifted_targets(labels)
        final = CrossEntropy(targets.reshape(-1).to(embeds.device), IGNORE_INDEX,
                             "mean" if num_items_in_batch is None else "sum")

    x = embeds.reshape(batch * seq, hidden)
    out = norm_consumer(x, _aligned(layers[0].input_layernorm.weight), _w_qkv(layers[0].self_attn, plan), rope,
                        plan.eps)[0]
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        qkv = _with_bias(out, attn, plan, positions)
        a = _attend(attn, qkv, masks[plan.windows[i]], plan.windows[i], position_ids, plan, batch, seq)
        if i + 1 < len(layers):
            nxt = layers[i + 1]
            gamma, w, consumer = nxt.input_layernorm.weight, _w_qkv(nxt.self_attn, plan), rope
        else:
            gamma, w, consumer = self.model.norm.weight, _aligned(self.lm_head.weight), final
        x, out = block(a, x, _aligned(attn.o_proj.weight), _aligned(layer.post_attention_layernorm.weight),
                       _w_gu(layer.mlp), _aligned(layer.mlp.down_proj.weight), _aligned(gamma), w, consumer,
                       plan.eps)[:2]
    if labels is None:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=out.view(batch, seq, -1)[:, keep])
    loss = out if num_items_in_batch is None else out / torch.as_tensor(num_items_in_batch, device=out.device)
    return CausalLMOutputWithPast(loss=loss)
