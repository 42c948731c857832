"""Hugging Face drop-in: ``apply_coda(model)`` runs a loaded Llama, Mistral or Qwen2 causal LM on the CODA kernels.

The patched model computes the Llama with CODA's shifted block boundary (coda-spec "The block") from the model's own
parameters, layer l's modules named as in Hugging Face::

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

PEFT LoRA (on any of the projections and the LM head, before or after ``apply_coda``): a LoRA projection
computes ``x W^T + s B A x`` = ``x (W + s B A)^T``, so its weight in the formulas above is the merged
``W + s B A`` (summed over the active adapters), built in the autograd graph on every forward (:func:`_weight`).
It is exact, it keeps every kernel fused whatever projection carries the adapter (q/k inside the RoPE epilogue,
gate/up inside SwiGLU's, o/down before the residual norm), and its gradients are autograd's: ``dA = s B^T dW``
and ``dB = s dW A^T`` from the merged weight's gradient dW, which the fused backward computes anyway (it computes
every weight's gradient, frozen or not): ``2 r out in`` FLOPs per projection against the ``2 M out in`` of
each of the step's GEMMs, r/M of a GEMM (0.1% at rank 16 and 16384 tokens). It costs one [out, in] add per
projection and step in forward and the merged copy, held for backward like the packed Wqkv / Wgu.

The merged form cannot apply PEFT's dropout to the adapter's input, so an adapter whose dropout is active
(lora_dropout > 0 in training) runs beside the kernels instead, as PEFT computes it, ``s B A dropout(x)`` on the
projection's input, exact too: q/k/v's on the normalized input (the model's own norm on the residual stream),
rotated like the bias (``RoPE`` is linear) and added to the kernel's qkv; o_proj's added to the residual that
enters the out-proj + residual + norm kernel; gate/up's and down_proj's need SwiGLU's pre-activation and input,
which the fused block keeps inside, so that layer's MLP runs split: out-proj + residual + norm + the gate/up GEMM
(a linear consumer), the adapters and SwiGLU in torch, then down-proj + residual + norm + the next consumer. The
adapters draw their dropout masks in the unpatched model's order. A rank-r path like that for every adapter would
also skip the frozen W's weight gradient (a third of the step's GEMM FLOPs); the fused backward computes every
weight's gradient.

The model is checked again on every forward (:func:`_current_plan`): the identities of the planned modules
(projections, their LoRA wrappers and base layers, norms, layers with their attention and MLP, embedding, RoPE
and its ``inv_freq`` buffer) and of their weight and bias Parameters are compared with the plan's, and the
buffer's version counter with the one it was read at, without reading any data. A change (LoRA wrapped around a
projection after patching, a projection replaced or given a bias, ``torch.func.functional_call``'s parameters,
``inv_freq`` edited in place) makes the plan again: a supported model runs, an unsupported one raises
:class:`CodaUnsupportedError` naming the module. The RMSNorm epsilons, sliding windows and
``config.num_hidden_layers`` are read at every call. A call where a module the CODA forward bypasses has a hook
or a forward other than its class's own runs the model's own forward (:func:`_runs_own_forward`).

Sizes: any vocabulary, FFN and hidden size, also where rows are not a multiple of 16 bytes (the tensor descriptors'
rule; 32001: Llama-2 and a pad token, an FFN of 90 in fp32): the kernels lay such tensors out with padded row
strides themselves (:mod:`kernels.coda.align`), so nothing here pads, and the results are the unpadded math's.

Works, with the unpatched model's results (details: :func:`apply_coda`, ``docs/hf.md``): Llama, Mistral, Qwen2; GQA/MQA,
any head_dim; tied or untied embeddings; RoPE default / linear / llama3; padding, position_ids, packed sequences,
sliding windows, attention dropout; Qwen2's q/k/v biases; silu or swish; any vocabulary, FFN and hidden size; labels
(bad ones, of the wrong shape or dtype, or with an LM head whose width is not config.vocab_size, raise as unpatched),
num_items_in_batch, shift_labels, inputs_embeds, logits_to_keep (an int or a tensor) without labels; cache_position
(ignored, as transformers 5 ignores it); use_cache as the unpatched model resolves it (the returned cache included);
config.num_hidden_layers below the layers; hooks and replaced forwards (the call runs the model's own forward);
state_dict / save_pretrained / optimizers / the Trainer; PEFT LoRA on any projection, before or after patching, dropout
included, disable_adapter / merge_adapter, modules_to_save; gradient checkpointing (reentrant or not); generate()
(prefill on the CODA kernels, decode through the model's own forward); torch.compile(model), fullgraph included (the
CODA kernels as opaque ``coda::`` ops, :mod:`kernels.coda.ops`); a model changed after patching (planned again);
torch.save(model); DDP, and FSDP2's fully_shard of the model; float64 weights, bf16 ones under the Triton interpreter,
torch.autocast to a dtype other than the weights', position_ids or inputs of a shape the model reads otherwise (a 1-D
[seq] position_ids), output_attentions, output_hidden_states (called or the config's), return_dict=False with labels
or as the config's, logits_to_keep with labels, any other call option (``ignore_index``), and FSDP2's fully_shard of
the layers (their hooks) run the model's own forward, with a warning; return_dict=False in a call without labels;
masks built ahead (a dict by layer type, as Qwen2's generate with a static cache passes them).

Refused in one line (:class:`CodaUnsupportedError`): other architectures, activations (``config.hidden_act`` or an MLP's
``act_fn``), RoPE types or a partial rotary factor; a decoder, layer, attention or MLP of another class; biases on
o_proj, the MLP or the LM head; projections that are neither nn.Linear nor PEFT LoRA on one (other PEFT methods,
quantized layers); other norms; a custom loss_function; a model split across devices; LoRA variants (DoRA, ...),
lora_bias, LoRA dropout in training on the LM head; embeddings of a dtype other than the weights'; a backward with
create_graph=True (the CODA kernels' gradients are not differentiable).
"""
from __future__ import annotations

import inspect
import sys
import warnings
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from kernels import layouts as L
from kernels.coda.functions import (Consumer, CrossEntropy, Linear, NoConsumer, Recomputation, RoPE, SwiGLU,
                                    block, norm_consumer, producer_consumer)
from kernels.coda.mainloop import INTERPRET
from kernels.coda.pack import gate_up_index, pack_rows, qkv_index
from kernels.coda.precompile import Precompiled, compiles_here, dry_pass, precompile_autograd
from kernels.coda.rope import rope_freq_table
from workloads.reference import IGNORE_INDEX

SILU_NAMES = ("silu", "swish")
"""``hidden_act`` values that Hugging Face computes as silu (its ACT2FN maps "swish" to the same SiLU)."""
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE types whose cos/sin are exactly those of ``pos * inv_freq``: no attention factor, no dynamic update."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The weight dtypes the CODA kernels compute in (accumulating in float32); a call on other weights (float64) runs
the model's own forward, and so does one on bfloat16 weights under the Triton interpreter, which has no bf16 math."""
TRANSFORMERS_RANGE = ("5.24", "6")
"""The transformers versions the drop-in follows (>= the first, < the second: the model classes' forward, outputs and
checkpointing it reproduces change between major versions); pyproject.toml's ``[hf]`` extra says the same."""

# Each architecture -> the sliding window of a layer (the config, the layer's attention module) as its model uses it.
_WINDOW: dict[str, Callable[[Any, nn.Module], int | None]] = {
    "LlamaForCausalLM": lambda config, attn: None,
    "MistralForCausalLM": lambda config, attn: config.sliding_window,
    "Qwen2ForCausalLM": lambda config, attn: attn.sliding_window,
}
# Call options whose value is also the unpatched model's default behaviour. Any other option runs the model's own
# forward (:func:`_other_call`).
_NEUTRAL_OPTIONS = {"output_attentions": False, "output_hidden_states": False, "return_dict": True}
_IGNORED_OPTIONS = ("cache_position",)
"""Call options that the unpatched model takes into its ``**kwargs`` and never reads, whatever their value (transformers
5 removed ``cache_position`` from these models, whose caches count their own tokens; ``generate()`` makes one only
for remote-code models): the CODA forward ignores them too."""


class CodaUnsupportedError(ValueError):
    """The model, its config or a call uses something the CODA forward does not compute. The message says what."""


@dataclass(frozen=True)
class _Plan:
    """What the CODA forward needs besides the parameters and what it reads from the modules at every call (the
    norms' ``variance_epsilon``, the sliding windows, ``config.num_hidden_layers``). Made when the model is patched,
    and again when a planned module, parameter or the RoPE buffer has changed (:func:`_current_plan`)."""

    heads: int
    kv_heads: int
    head_dim: int
    theta: float
    inv_freq: tuple[float, ...]
    """``rotary_emb.inv_freq`` as read (which synchronizes with its device) when the plan was made."""
    inv_freq_version: int
    """The buffer's version counter then: an in-place change of it (``inv_freq.mul_``) makes the plan again."""
    qkv_bias: bool
    indices: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]
    """The packing indices (:func:`kernels.coda.pack.qkv_index`, ``gate_up_index`` per FFN size), made when the plan
    is made: a compiled forward reads them as inputs instead of building them in its graphs (:func:`_packing_index`)."""
    watched: tuple[weakref.ref | None, ...]
    """Weak references to the modules and parameters the plan was made for (:func:`_watched`; None for a missing
    bias): the plan keeps none of them alive (``functional_call``'s weights go when the call's caller drops them)."""
    bypassed: tuple[tuple[str, weakref.ref, Callable[..., Any] | None], ...]
    """(name, weak reference, its class's own forward) of every module the CODA forward computes without calling it
    (:func:`_bypassed`, :func:`_own_forward`), whose hooks and forward a call looks at (:func:`_runs_own_forward`)."""

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        """Pickled (``torch.save(model)``, ``copy.deepcopy``) without its weak references, which cannot be: the
        copy's plan matches no module, so the copy's first forward makes its own."""
        return _Plan, tuple(() if f.name in ("watched", "bypassed") else getattr(self, f.name) for f in fields(self))


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
    as in Hugging Face: an int, or a 1-D or 2-D tensor of positions or a 2-D bool mask). ``attention_mask``
    (padding) and ``position_ids`` are supported: they go to the model's own mask builder and attention, and to the
    RoPE positions. ``position_ids`` of another shape than [batch or 1, seq or 1] or [1] (a 1-D [seq]), which the
    model's RoPE broadcasts against the heads (it raises, or gives each head its own position), and ``input_ids``
    not [batch, seq], make the call run the model's own forward, with a warning (:func:`_other_shapes`).
    ``cache_position`` is ignored, as the unpatched model ignores it. ``use_cache`` is resolved as the unpatched
    decoder does (:func:`_use_cache`): the call's, else the config's, and False under gradient checkpointing in
    training with gradients. Packed sequences (position_ids that restart at 0 inside a row, no attention_mask) then
    get the unpatched model's masks: each sequence its own causal mask when it is False, one causal mask over the
    row when it is True (the unpatched model then builds its masks with the cache and does not look for packed
    sequences). The layers run are ``model.model.layers[:config.num_hidden_layers]``; the RoPE frequencies are
    ``rotary_emb.inv_freq`` (read again when the buffer is replaced or changed in place), each RMSNorm's epsilon its
    ``variance_epsilon``, and each layer's sliding window its attention's, at every call.

    Labels are checked as Hugging Face's loss takes them (:func:`_targets`): a number of targets other than the
    tokens raises its ``ValueError`` ("Expected input batch_size (48) to match target batch_size (45)."), a dtype
    other than int64 / uint8 a ``RuntimeError``; flat [B * S] labels are shifted across rows as there;
    ``logits_to_keep`` with labels is refused. Its view of the logits as ``[-1, config.vocab_size]`` is followed
    too: an LM head whose width is not ``config.vocab_size`` (replaced, or resized without the config) raises with
    labels as there (``model.resize_token_embeddings`` updates the config, and runs). ``num_items_in_batch=0``
    where every label is -100 gives the unpatched NaN loss and zero gradients (:class:`_DividedLoss`). A label that
    is neither -100 nor in [0, vocab) raises torch's ``IndexError("Target 300 is out of bounds.")`` on the CPU and
    fails a device-side assertion on a GPU, as the unpatched loss does.

    KV caches: where ``use_cache`` is True (the config's default included) or a ``cache`` / ``past_key_values`` is
    given empty, the CODA forward, in eval or training, with labels or without, fills the cache with the keys and
    values the unpatched model would (q/k back in Hugging Face's head-dim order) and returns it as ``.cache``.
    Decode steps (a filled cache) and a given cache with checkpointed layers (which drop it) run the model's own
    forward (the same modules, adapters included). ``generate()`` then gives the unpatched model's tokens, and so
    does a decode loop that feeds ``.cache`` back.

    Hooks: a call where a module the CODA forward computes without calling it (the decoder, its layers and every
    module in them, the final norm, the LM head and their adapters; not the embedding) has a forward, forward-pre,
    backward or backward-pre hook, or where a global module hook is registered (``torch.nn.modules.module``),
    runs the model's own forward instead, so that the hooks run (with a warning naming the module,
    :func:`_runs_own_forward`). transformers' own output-capturing hooks, inert unless hidden states or attentions
    are asked for, do not count. So does a call where such a module's forward is not its class's own: set on the
    module (``module.forward = ...``), or on its class by another module than the class's (a monkeypatch).

    ``torch.compile(model)``, ``fullgraph=True`` included, traces the CODA forward and its backward into graphs:
    the CODA kernels and the weight packing are custom ops (:mod:`kernels.coda.ops`) with fake-tensor rules and
    autograd, which the graphs call as opaque ops; the embedding, masks, attention and the torch code around the
    kernels are compiled as in the unpatched model. The results are the eager patched model's. Two differences in
    a traced call: a bad label fails a device-side assertion (a RuntimeError on the CPU) instead of raising
    IndexError, and the cross-entropy's gradients computed in forward are scaled into copies in backward (eager
    scales them in place). The weight-packing indices are made with the plan, eagerly, and are the graphs' inputs.

    Activation checkpointing (``gradient_checkpointing_enable()``, reentrant or not, ``every_n_layers``): in
    training, each checkpointed layer runs under the layer's own checkpoint function and is recomputed in backward
    from its input, the residual stream x alone: it computes its own norm + QKV + RoPE from x (the block before it
    then ends at x instead of fusing them), and its block ends at x. The last layer, if checkpointed, keeps its
    attention's tensors (its backward runs first) and recomputes only its block. Under torch's non-reentrant
    checkpoint (the default) the recomputation skips the block's down projection, whose output it does not need,
    and the SwiGLU backward writes over the recomputed pre-activation (:func:`_checkpoint`). The final norm, the LM
    head and the loss run after the checkpointed layers, outside them.

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
    model's own mask and attention), attention dropout (the model's attention applies it), Qwen2's q/k/v biases,
    ``hidden_act`` silu or swish, any vocabulary, FFN and hidden size, PEFT LoRA (``model`` may be the PEFT model: its
    base model is patched and ``model`` returned), activation checkpointing, ``generate()``.

    Refused with :class:`CodaUnsupportedError`, by this function or by a forward after the model changed (the message
    names the module): other architectures, ``hidden_act`` other than silu/swish (or an MLP's ``act_fn``), a decoder,
    layer, attention or MLP of another class than the architecture's (a subclass too), biases on o_proj, the MLP or the
    LM head, projections that are neither ``nn.Linear`` nor PEFT LoRA on one (other adapters, quantized layers), norms
    that are not the model's RMSNorm, RoPE types other than the three above (dynamic, yarn, longrope, ...) or a partial
    rotary factor, a custom ``loss_function``, a model split across devices.
    By a forward: LoRA variants (DoRA, ...), ``lora_bias``, lora_dropout > 0 in training on the LM head, embeddings
    of a dtype other than the weights' (cast them). By the backward: ``create_graph=True`` (:func:`_first_order`).
    Refused too: a transformers version outside :data:`TRANSFORMERS_RANGE`.

    A call the CODA forward does not compute runs the model's own forward, with a warning saying why: float64
    weights, bfloat16 ones under the Triton interpreter (which has no bf16 math), ``torch.autocast`` to a dtype other
    than the weights' (the Trainer's ``bf16=True`` over float32 weights; cast the model to run the kernels),
    ``output_attentions``/``output_hidden_states`` (in the call or as the config's default), ``return_dict=False``
    with labels (the tuple's logits are not written) or as the config's default, ``logits_to_keep`` with labels, any
    other keyword (:func:`_other_call`). ``return_dict=False`` in a call without labels returns the unpatched model's
    tuple from the CODA forward.

    torch.distributed: DDP wraps the patched model unchanged. FSDP2's ``fully_shard`` gives each module it wraps the
    class ``FSDP<cls>``, read as its own class (:func:`_class`): sharding the model as a whole (before or after
    ``apply_coda``), its hooks gather every parameter before the CODA forward; sharding its layers too, their hooks
    make each call run the model's own forward.

    ``torch.save(model)`` pickles the patched model (the plan without its weak references; the loaded model plans
    again at its first forward).
    """
    _check_transformers()
    target = _causal_lm(model)
    if getattr(target, "_coda_plan", None) is not None:
        return model
    target._coda_plan = _plan(target)
    target.forward = partial(_coda_forward, target)  # a partial, not a bound method, pickles with the model
    return model


def _causal_lm(model: nn.Module) -> nn.Module:
    """The causal LM inside a PEFT model (``get_base_model()``), or the model itself."""
    if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def _alias(arch: str) -> Callable[[nn.Module], nn.Module]:
    def apply(model: nn.Module) -> nn.Module:
        got = _class(_causal_lm(model)).__name__
        if got != arch:
            raise _refuse(f"expected a {arch}, got {got}")
        return apply_coda(model)

    apply.__doc__ = f":func:`apply_coda` for a ``{arch}`` (any other model is refused)."
    return apply


def precompile_step(model: nn.Module, **batch: Any) -> Precompiled:
    """Compile the CODA kernels of one training step of ``model`` (patched by :func:`apply_coda`) at ``batch``'s
    shape, in parallel, before the first real step: ``model(**batch).loss`` and its backward run once as a dry
    pass (:func:`kernels.coda.precompile.precompile`), which launches no kernel of ours, leaves the parameters,
    their ``.grad`` and the random number generators' states alone and drops its garbage results. The patched
    model does this itself at the first training step of each batch shape (:func:`_first_step`); call it to
    choose when::

        model = apply_coda(model)
        precompile_step(model, input_ids=input_ids, labels=labels)   # seconds instead of a serial compile
        for batch in loader: model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
    """
    if getattr(model, "_coda_plan", None) is None:
        raise CodaUnsupportedError("precompile_step needs a model patched by apply_coda")
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # dropout draws in the dry pass
        return precompile_autograd(lambda: model(**batch).loss, params, device)


def _first_step(model: nn.Module, x: torch.Tensor | None) -> bool:
    """Whether a call with labels (input ids or embeddings ``x``) is a training step at a shape this model has not
    stepped at yet, with gradients, eagerly, on a GPU Triton compiles for: then the forward runs
    :func:`precompile_step` first, once per shape (a shape first met inside a dry pass is only noted)."""
    if torch.compiler.is_compiling() or x is None or not torch.is_grad_enabled() or not compiles_here(x.device):
        return False
    seen = model.__dict__.setdefault("_coda_precompiled", set())
    key = (tuple(x.shape), x.dtype)
    if key in seen:
        return False
    seen.add(key)
    return not dry_pass()


apply_coda_to_llama = _alias("LlamaForCausalLM")
apply_coda_to_mistral = _alias("MistralForCausalLM")
apply_coda_to_qwen2 = _alias("Qwen2ForCausalLM")


def _refuse(reason: str) -> CodaUnsupportedError:
    return CodaUnsupportedError(f"apply_coda: {reason}")


def _check_transformers() -> None:
    import transformers
    from packaging.version import Version

    lo, hi = TRANSFORMERS_RANGE
    if not Version(lo) <= Version(transformers.__version__) < Version(hi):
        raise _refuse(f"transformers {transformers.__version__} is not supported (the drop-in follows >={lo},<{hi}: "
                      "pip install -c constraints.txt -e '.[hf]')")


_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _class(m: nn.Module) -> type:
    """``m``'s class, under the wrapper class that torch.distributed's composable APIs (``fully_shard``,
    ``replicate``) give a module they wrap: ``type(prefix + cls.__name__, (Wrapper, cls), ...)``, made in
    torch.distributed, whose first base (the wrapper) is defined there and which computes nothing of its own: no
    forward but the one transformers' ``GradientCheckpointingLayer`` puts on every subclass, which wraps the class's.
    The module's own class computes; the wrapper's hooks shard, gather and reduce around it."""
    cls = type(m)
    bases = cls.__bases__
    if not (len(bases) == 2 and cls.__module__.startswith("torch.distributed.")
            and bases[0].__module__.startswith("torch.distributed.") and "forward" not in bases[0].__dict__):
        return cls
    forward = cls.__dict__.get("forward")
    return bases[1] if forward is None or getattr(forward, "__wrapped__", None) is bases[1].forward else cls


def _lora_linear_type() -> type | None:
    """PEFT's LoRA ``Linear``, if PEFT is loaded (no PEFT module exists otherwise)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return getattr(layer, "Linear", None)


def _computing(m: nn.Module) -> nn.Module:
    """The module whose output is ``m``'s: for PEFT's ``modules_to_save`` wrapper the active adapter's copy (its
    original module where adapters are disabled, none is active or an active one has no copy, as its forward
    chooses), else m itself."""
    wrapper = getattr(sys.modules.get("peft.utils.other"), "ModulesToSaveWrapper", None)
    if type(m) is not wrapper:
        return m
    if m.disable_adapters or not m.active_adapters or any(a not in m._adapters for a in m.active_adapters):
        return m.original_module
    return m.modules_to_save[m.active_adapters[0]]


def _base(m: nn.Module) -> nn.Module:
    """The ``nn.Linear`` that computes ``m``'s ``x W^T + b``: m itself (or the copy of PEFT's ``modules_to_save``
    wrapper that computes it, :func:`_computing`), or a LoRA layer's base layer."""
    m = _computing(m)
    return m.base_layer if type(m) is _lora_linear_type() else m


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the LM head and every layer's projections."""
    return [("lm_head", model.lm_head)] + [
        (f"model.layers.{i}.{part}.{name}", getattr(getattr(layer, part), name))
        for i, layer in enumerate(model.model.layers) for part, name in _PROJECTIONS]


_INV_FREQ = 2
"""The index of ``rotary_emb.inv_freq`` in :func:`_watched`."""


def _watched(model: nn.Module) -> list[Any]:
    """What a plan is made for: the embedding, the RoPE module and its ``inv_freq`` buffer, the decoder, its layers
    with their attention and MLP modules and the MLPs' activations, the norms and projections (LoRA layers and their
    base layers, the copy a ``modules_to_save`` wrapper computes with) and their weight and bias Parameters. A forward
    compares their identities with the plan's (no data is read)."""
    base = model.model
    norms = [base.norm] + [n for layer in base.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    out: list[Any] = [base.embed_tokens, base.rotary_emb, base.rotary_emb.inv_freq, base, base.layers]
    for layer in base.layers:
        out += (layer, layer.self_attn, layer.mlp, getattr(layer.mlp, "act_fn", None))
    for m in norms:
        out += (m, m.weight)
    for _, m in _linears(model):
        b = _base(m)
        out += (m, b, b.weight, b.bias)
    return out


def _bypassed(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module the CODA forward computes without calling it, so that their hooks would not
    run: the decoder (``model.model``) and all its modules but the embedding (which it calls), and the LM head with
    its adapters' modules. Containers without a forward of their own (ModuleList, ModuleDict: nothing calls them,
    so their hooks never run) are left out."""
    named = [(f"model.{name}".rstrip("."), m) for name, m in model.model.named_modules()
             if name != "embed_tokens" and not name.startswith("embed_tokens.")]
    named += [(f"lm_head.{name}".rstrip("."), m) for name, m in model.lm_head.named_modules()]
    return [(name, m) for name, m in named if type(m).forward is not nn.Module.forward]


_INERT_HOOK_MODULE = "transformers.utils.output_capturing"
"""Where transformers' output-capturing hooks are defined: installed once output_attentions / output_hidden_states
is asked for, they do nothing unless it is asked for in the call, which then runs the model's own forward."""


def _live_hooks(m: nn.Module) -> bool:
    """Whether ``m`` has a forward, forward-pre, backward or backward-pre hook other than transformers' inert
    output-capturing ones (a module without hooks, the common case of a per-call check, by four dictionary tests)."""
    if not (m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks):
        return False
    return any(getattr(hook, "__module__", None) != _INERT_HOOK_MODULE
               for hooks in (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks)
               for hook in hooks.values())


def _own_forward(m: nn.Module) -> Callable[..., Any] | None:
    """The forward of ``m``'s class where the class that defines it (itself or a base) was given it by its own module
    (decorators that keep ``__module__`` included); None where another module set it (a monkeypatch)."""
    owner = next(c for c in type(m).__mro__ if "forward" in c.__dict__)
    forward = owner.__dict__["forward"]
    return forward if getattr(forward, "__module__", None) == owner.__module__ else None


def _runs_own_forward(plan: _Plan) -> str | None:
    """Why a call runs the model's own forward: a module the CODA forward would bypass has a hook
    (:func:`_live_hooks`), or a forward other than its class's own (:func:`_own_forward`: one set on the module,
    or on its class by another module, before the plan or since), or a global module hook (torch's
    ``register_module_*_hook``) is registered; None where none of these holds. Dictionary lookups only."""
    from torch.nn.modules import module as torch_module

    if (torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks
            or torch_module._global_backward_pre_hooks or torch_module._global_backward_hooks):
        return "a global module hook is registered"
    for name, ref, forward in plan.bypassed:
        m = ref()
        if m is None:
            continue
        if _live_hooks(m):
            return f"{name} has a hook"
        if forward is None or type(m).forward is not forward or "forward" in m.__dict__:
            return f"{name} has a forward other than its class's own"
    return None


def _plan(model: nn.Module, old: _Plan | None = None) -> _Plan:
    """Check the model against what the CODA forward computes (see :func:`apply_coda`) and read its constants.

    ``old``: the previous plan; its RoPE frequencies are reused while ``rotary_emb.inv_freq`` is the same tensor at
    the same version (reading them synchronizes with the device)."""
    arch = _class(model).__name__
    if arch not in _WINDOW:
        raise _refuse(f"{arch} is not supported (supported: {', '.join(_WINDOW)})")
    from transformers.activations import ACT2FN
    from transformers.loss.loss_utils import ForCausalLMLoss

    config, base = model.config, model.model
    layers = list(base.layers)
    prefix = arch.removesuffix("ForCausalLM")
    norm_cls = f"{prefix}RMSNorm"
    if config.hidden_act not in SILU_NAMES:
        raise _refuse(f"hidden_act={config.hidden_act!r}: the CODA MLP is SwiGLU with silu")
    if model.loss_function is not ForCausalLMLoss:
        raise _refuse("a custom loss_function: the fused cross-entropy computes Hugging Face's causal LM loss")
    if len({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}) > 1:
        raise _refuse("the model is split across devices (device_map)")
    lora = _lora_linear_type()
    for name, m in ((name, _computing(m)) for name, m in _linears(model)):
        if type(m) is not nn.Linear and (type(m) is not lora or type(m.base_layer) is not nn.Linear):
            shown = type(m.base_layer if type(m) is lora else m)
            raise _refuse(f"{name} is a {type(m).__name__}: the projections must be nn.Linear or PEFT LoRA on "
                          f"an nn.Linear, not {'LoRA on ' if type(m) is lora else ''}"
                          f"{shown.__module__}.{shown.__qualname__} (other adapters, quantized or otherwise "
                          "replaced layers are not fused)")
    norms = [("model.norm", base.norm)] + [(f"model.layers.{i}.{k}", getattr(layer, k))
                                           for i, layer in enumerate(layers)
                                           for k in ("input_layernorm", "post_attention_layernorm")]
    other = next(((name, type(n)) for name, n in norms if _class(n).__name__ != norm_cls), None)
    if other is not None:  # e.g. Liger's apply_liger_kernel_to_* swaps transformers' class for models built after it
        raise _refuse(f"{other[0]} is a {other[1].__module__}.{other[1].__qualname__}, not a {norm_cls}: the CODA "
                      "forward fuses the model's own RMSNorm (a model built after another library patched "
                      "transformers' classes has that library's)")
    parts = [("model", base, "Model"), ("model.rotary_emb", base.rotary_emb, "RotaryEmbedding")] + [
        (f"model.layers.{i}{name}", m, cls) for i, layer in enumerate(layers)
        for name, m, cls in (("", layer, "DecoderLayer"), (".self_attn", layer.self_attn, "Attention"),
                             (".mlp", layer.mlp, "MLP"))]
    other = next(((name, _class(m), prefix + cls) for name, m, cls in parts if _class(m).__name__ != prefix + cls),
                 None)
    if other is not None:  # the CODA forward computes these modules' math, and would bypass another class's
        raise _refuse(f"{other[0]} is a {other[1].__module__}.{other[1].__qualname__}, not a {other[2]}: the CODA "
                      "forward computes the model's own decoder, layers, attention and MLP")
    silu = {type(ACT2FN[name]) for name in SILU_NAMES}
    act = next(((i, type(layer.mlp.act_fn)) for i, layer in enumerate(layers) if type(layer.mlp.act_fn) not in silu),
               None)
    if act is not None:
        raise _refuse(f"model.layers.{act[0]}.mlp.act_fn is a {act[1].__qualname__}: the CODA MLP is SwiGLU with silu")
    biased = [name for name, m in _linears(model) if _base(m).bias is not None
              and not name.endswith(("q_proj", "k_proj", "v_proj"))]
    if biased:
        raise _refuse(f"{biased[0]} has a bias: biases on the LM head, o_proj or the MLP (mlp_bias / "
                      "attention_bias) are not fused")
    has_bias = {tuple(_base(getattr(layer.self_attn, p)).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
                for layer in layers}
    if has_bias not in ({(True,) * 3}, {(False,) * 3}):
        raise _refuse("q/k/v biases must be on all of q, k and v in every layer, or on none")
    rotary = base.rotary_emb
    head_dim = layers[0].self_attn.head_dim
    if rotary.rope_type not in SUPPORTED_ROPE_TYPES or rotary.attention_scaling != 1.0:
        raise _refuse(f"rope_type={rotary.rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rotary.inv_freq.numel() != head_dim // 2:
        raise _refuse(f"RoPE on {2 * rotary.inv_freq.numel()} of the {head_dim} head dims (partial_rotary_factor)")
    same_rope = (old is not None and len(old.watched) > _INV_FREQ and old.watched[_INV_FREQ]() is rotary.inv_freq
                 and old.inv_freq_version == rotary.inv_freq._version)
    device = _base(layers[0].self_attn.q_proj).weight.device
    indices = {("qkv", 0): qkv_index(config.num_attention_heads, config.num_key_value_heads, head_dim, device)}
    indices.update({("gate_up", n): gate_up_index(n, device)
                    for n in {_base(layer.mlp.gate_proj).weight.shape[0] for layer in layers}})
    return _Plan(heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=head_dim,
                 theta=float(config.rope_parameters["rope_theta"]),
                 inv_freq=old.inv_freq if same_rope else tuple(rotary.inv_freq.double().tolist()),
                 inv_freq_version=rotary.inv_freq._version, qkv_bias=has_bias == {(True,) * 3}, indices=indices,
                 watched=tuple(None if o is None else weakref.ref(o) for o in _watched(model)),
                 bypassed=tuple((name, weakref.ref(m), _own_forward(m)) for name, m in _bypassed(model)))


def _current_plan(model: nn.Module) -> _Plan:
    """The model's plan, made again when a planned module or parameter has been replaced since (LoRA wrapped
    around a projection, a bias given to one, ``functional_call``'s parameters) or ``rotary_emb.inv_freq`` has been
    replaced or changed in place (its version counter, not its data, is read; not under torch.compile, whose graphs
    keep the frequencies they were traced with): a supported change is planned for, an unsupported one raises
    :class:`CodaUnsupportedError` naming it."""
    plan: _Plan = model._coda_plan
    now = _watched(model)
    if (len(now) != len(plan.watched) or any((o is not None if r is None else r() is not o)
                                             for r, o in zip(plan.watched, now))
            or (not torch.compiler.is_compiling() and now[_INV_FREQ]._version != plan.inv_freq_version)):
        plan = model._coda_plan = _plan(model, plan)
    return plan


Side = Callable[[torch.Tensor], torch.Tensor]
"""A LoRA term computed beside a kernel: the projection's input -> ``sum_a s_a B_a A_a dropout_a(x)``."""


def _weight(m: nn.Module, name: str) -> tuple[torch.Tensor, Side | None]:
    """``(W, side)``: the weight a kernel uses for ``m``'s output, and the LoRA term beside it (None: none).

    nn.Linear (or the copy of PEFT's ``modules_to_save`` wrapper that computes ``m``, :func:`_computing`): its own
    weight. PEFT LoRA (unless its adapters are disabled or merged into W): each active adapter whose dropout is the
    identity (p = 0, or eval mode) is merged, ``W + s B A`` in the autograd graph; one whose dropout is active
    (training, p > 0) is left to ``side``, which applies it on the projection's input as PEFT does, adapter by adapter
    in PEFT's order (so the dropout masks are those of the unpatched model's forward under the same seed). Refused
    (:class:`CodaUnsupportedError`, naming the module): LoRA variants (DoRA, ...) and a LoRA bias."""
    m = _computing(m)
    if type(m) is nn.Linear:
        return m.weight, None
    w = m.base_layer.weight
    if m.disable_adapters:
        if m.merged:
            m.unmerge()  # as PEFT's own forward does
        return w, None
    if m.merged:
        return w, None
    beside = []
    for adapter in m.active_adapters:
        if adapter not in m.lora_A:
            continue
        a, b, dropout = m.lora_A[adapter], m.lora_B[adapter], m.lora_dropout[adapter]
        if adapter in m.lora_variant:
            raise _refuse(f"{name}: LoRA variant {type(m.lora_variant[adapter]).__name__} (DoRA, ...) is not fused")
        if b.bias is not None:
            raise _refuse(f"{name}: lora_bias is not fused")
        if isinstance(dropout, nn.Dropout) and dropout.p > 0 and dropout.training:
            beside.append(adapter)
        else:
            w = w + (b.weight @ a.weight).to(w.dtype) * m.scaling[adapter]

    def side(x: torch.Tensor) -> torch.Tensor:
        terms = [m.lora_B[k](m.lora_A[k](m.lora_dropout[k](x.to(m.lora_A[k].weight.dtype)))) * m.scaling[k]
                 for k in beside]
        return sum(terms[1:], terms[0]).to(x.dtype)

    return w, (side if beside else None)


def _use_cache(model: nn.Module, use_cache: bool | None) -> bool:
    """``use_cache`` as the unpatched decoder resolves it (transformers' ``merge_with_config_defaults``): the call's,
    else the config's; False where gradient checkpointing is on in training with gradients enabled."""
    value = getattr(model.config, "use_cache", None) if use_cache is None else use_cache
    base = model.model
    return bool(value) and not (getattr(base, "gradient_checkpointing", False) and base.training
                                and torch.is_grad_enabled())


def _other_dtype(dtype: torch.dtype) -> str | None:
    """Why the CODA kernels would not compute a call on weights of ``dtype`` as the model does, or None: float64
    (they accumulate in float32), bfloat16 under the Triton interpreter (it has no bf16 math: its results would be
    wrong)."""
    if dtype not in KERNEL_DTYPES:
        return f"{dtype} weights, which the CODA kernels do not compute in (they accumulate in float32)"
    if INTERPRET and dtype == torch.bfloat16:
        return f"{dtype} weights under the Triton interpreter, which has no bf16 math (run bf16 on a GPU)"
    return None


def _other_shapes(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                  position_ids: torch.Tensor | None) -> str | None:
    """Why the model would not read the call's tokens as [batch, seq] rows with the positions ``position_ids``
    broadcast to [batch, seq], as the CODA forward does, or None. ``input_ids`` must be [batch, seq] and
    ``inputs_embeds`` [batch, seq, hidden]. The model's RoPE broadcasts the cos/sin of ``position_ids`` (their shape +
    head dim, a head axis inserted at 1) against the [batch, heads, seq, head_dim] queries and keys: it reads a 2-D
    [batch or 1, seq or 1] tensor, or a single position [1], per token; others raise there (a 1-D [seq] one, unless
    seq is the number of heads: then head h gets position h) or earlier, in the mask builder."""
    x, name, dims = ((input_ids, "input_ids", 2) if input_ids is not None else
                     (inputs_embeds, "inputs_embeds", 3))
    if x is None:
        return None
    if x.dim() != dims:
        return f"{name} of shape {list(x.shape)}, not [batch, seq{', hidden' if dims == 3 else ''}]"
    shape = None if position_ids is None else tuple(position_ids.shape)
    if shape in (None, (1,)) or (len(shape) == 2 and shape[0] in (1, x.shape[0]) and shape[1] in (1, x.shape[1])):
        return None
    return (f"position_ids of shape {list(shape)}, not [batch or 1, seq or 1], which the model's RoPE broadcasts "
            "against the attention heads")


def _other_call(model: nn.Module, options: dict[str, Any], labels: torch.Tensor | None,
                logits_to_keep: int | torch.Tensor, as_tuple: bool, weight: torch.Tensor) -> str | None:
    """Why the CODA forward would not compute this call as the model does, or None. The model's own forward computes
    every one of these, so the call runs it: a call option, or a config default of :data:`_NEUTRAL_OPTIONS`, other
    than those the CODA forward computes (``output_attentions``, ``output_hidden_states``, ``ignore_index`` for Hugging
    Face's loss, ...); ``return_dict=False`` with labels (the tuple holds the logits, which the fused loss does not
    write); ``logits_to_keep`` with labels (Hugging Face's loss is then over the kept positions only; the fused loss
    covers every position); a ``torch.func`` transform; ``torch.autocast`` to a dtype other than the weights' (the
    kernels compute in the weights' dtype)."""
    defaults = {name: getattr(model.config, name, None) for name in _NEUTRAL_OPTIONS}
    for name, value in {**defaults, **options}.items():
        if value is not None and not (name in _NEUTRAL_OPTIONS and value == _NEUTRAL_OPTIONS[name]):
            shown = repr(value) if isinstance(value, (bool, int, float, str)) else type(value).__name__
            where = "" if name in options else " (the config's)"
            return f"the option {name}={shown}{where}"
    if labels is not None and as_tuple:
        return "return_dict=False with labels (the tuple's logits, which the fused cross-entropy does not write)"
    if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        shown = logits_to_keep if isinstance(logits_to_keep, int) else type(logits_to_keep).__name__
        return f"logits_to_keep={shown} with labels (a loss over the kept positions; the fused loss covers all)"
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        return ("a torch.func transform (grad, vmap, jvp, ...), which the CODA kernels' autograd Functions and raw "
                "pointers do not support")
    device = weight.device.type
    if torch.is_autocast_enabled(device) and (dtype := torch.get_autocast_dtype(device)) != weight.dtype:
        return (f"torch.autocast to {dtype} over {weight.dtype} weights (the CODA kernels compute in the weights' "
                f"dtype: cast the model, model.to({dtype}), to run them)")
    return None


def _targets(labels: torch.Tensor, shift_labels: torch.Tensor | None, rows: int, vocab: int,
             vocab_size: int) -> torch.Tensor:
    """The loss's [rows] targets, as Hugging Face's ``ForCausalLMLoss`` makes them: ``shift_labels`` flattened as
    given, else ``labels`` shifted left by one along their last dim (-100 at the end) and flattened (flat [B * S]
    labels too, shifted across rows as there). Raises as it does: ``ValueError`` where their number is not the
    rows' (``Expected input batch_size (48) to match target batch_size (45).``), ``RuntimeError`` for a dtype
    other than int64 / uint8 or non-contiguous ``shift_labels`` (``.view(-1)``). It views the [rows, vocab] logits
    as ``[-1, config.vocab_size]``: an LM head of another width than ``vocab_size`` (replaced, or resized without
    the config) raises that view's ``RuntimeError`` (``shape '[-1, 256]' is invalid for input of size 12624``), or
    where the size divides, the ``ValueError`` of the rows that view makes."""
    if (rows * vocab) % vocab_size:
        raise RuntimeError(f"shape '[-1, {vocab_size}]' is invalid for input of size {rows * vocab}")
    rows = rows * vocab // vocab_size
    if shift_labels is None:
        targets = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    else:
        targets = shift_labels.view(-1)
    if targets.numel() != rows:
        raise ValueError(f"Expected input batch_size ({rows}) to match target batch_size ({targets.numel()}).")
    if targets.dtype not in (torch.int64, torch.uint8):
        raise RuntimeError(f"expected target dtype to be Long or Byte, but got {targets.dtype}")
    return targets.long()


def _check_targets(targets: torch.Tensor, vocab: int) -> None:
    """Targets are ``IGNORE_INDEX`` or in ``[0, vocab)``. On the CPU a bad one raises the IndexError of torch's
    cross-entropy (as the unpatched model does); on a GPU a device-side assertion fails, as it does in torch's
    cross-entropy there, without synchronizing the host. Under torch.compile the assertion too, on any device (a
    graph cannot branch on the targets' values; on the CPU it raises a RuntimeError with the message)."""
    bad = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= vocab)
    if targets.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), f"a target is out of bounds: not {IGNORE_INDEX} nor in [0, {vocab})")
    elif bad.any():
        raise IndexError(f"Target {int(targets[bad][0])} is out of bounds.")


def _w_qkv(attn: nn.Module, plan: _Plan, name: str) -> tuple[torch.Tensor, Side | None]:
    """The CODA QKV weight: ``[Wq; Wk; Wv]`` with q/k rows in adjacent RoPE pairs (in the autograd graph), and the
    LoRA terms beside it (:func:`_weight`) as one function of the normalized input: their [M, q + k + v]
    output in half-split column order (zeros for a projection without one), or None."""
    pairs = [_weight(getattr(attn, p), f"{name}.{p}") for p in ("q_proj", "k_proj", "v_proj")]
    w = [p[0] for p in pairs]
    index = _packing_index(plan, ("qkv", 0), w[0].device,
                           lambda: qkv_index(plan.heads, plan.kv_heads, plan.head_dim, w[0].device))
    packed = pack_rows(index, *w)
    if all(side is None for _, side in pairs):
        return packed, None

    def side(h: torch.Tensor) -> torch.Tensor:
        return torch.cat([f(h) if f is not None else h.new_zeros(h.shape[0], wt.shape[0]) for wt, f in pairs], -1)

    return packed, side


def _rotated(delta: torch.Tensor, plan: _Plan, positions: torch.Tensor) -> torch.Tensor:
    """``R_m delta``: a half-split [M, q + k + v] term (a bias, LoRA's output) in the kernel's adjacent-pair columns,
    rotated by each row's RoPE angles with the kernel's frequency table (v's columns have zero frequency)."""
    d = L.qkv_cols_to_adjacent(delta, plan.heads, plan.kv_heads, plan.head_dim)
    f = rope_freq_table(plan.heads, plan.kv_heads, plan.head_dim, plan.theta, d.device, plan.inv_freq).sum(0)
    return L.rotate_adjacent(d, positions[:, None].to(f.dtype) * f)


def _w_gu(gate: torch.Tensor, up: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """The CODA gate/up weight: rows interleaved ``[g0, u0, g1, u1, ...]`` (in the autograd graph)."""
    ffn = gate.shape[0]
    index = _packing_index(plan, ("gate_up", ffn), gate.device, lambda: gate_up_index(ffn, gate.device))
    return pack_rows(index, gate, up)


def _packing_index(plan: _Plan, key: tuple[str, int], device: torch.device,
                   build: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's packing index ``key``, or one built here where the weights are on another device (the model
    moved since it was planned): a compiled forward takes the plan's as an input and builds none in its graphs."""
    index = plan.indices.get(key)
    return index if index is not None and index[0].device == device else build()


def _with_bias(qkv: torch.Tensor, attn: nn.Module, plan: _Plan, positions: torch.Tensor) -> torch.Tensor:
    """``R_m z + R_m b``: the kernel's rotated qkv plus the adjacent-layout bias rotated by each row's angles."""
    if not plan.qkv_bias:
        return qkv
    b = torch.cat([_base(getattr(attn, p)).bias for p in ("q_proj", "k_proj", "v_proj")])
    return qkv + _rotated(b, plan, positions)


def _attend(attn: nn.Module, qkv: torch.Tensor, mask: Any, window: int | None, position_ids: torch.Tensor,
            plan: _Plan, batch: int, seq: int, cache: Any = None) -> torch.Tensor:
    """The model's own attention function on the packed qkv rows; returns [batch * seq, heads * head_dim].

    ``cache`` (a prefill for generation): q and k are put back in Hugging Face's half-split head-dim order first,
    so that the keys the cache keeps (``cache.update``, as the model's attention calls it) are the unpatched
    model's and its own forward can decode from them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(attn).__module__].eager_attention_forward
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
    if cache is not None:
        qkv = qkv[:, torch.argsort(L.qkv_perm(plan.heads, plan.kv_heads, plan.head_dim, qkv.device))]
    q, k, v = qkv.split([plan.heads * plan.head_dim, plan.kv_heads * plan.head_dim, plan.kv_heads * plan.head_dim],
                        -1)

    def heads_first(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, -1, plan.head_dim).transpose(1, 2)

    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    out, _ = fn(attn, q, k, v, mask,
                dropout=attn.attention_dropout if attn.training else 0.0, scaling=attn.scaling,
                sliding_window=window, position_ids=position_ids)
    return out.reshape(batch * seq, -1).contiguous()


def _first_order(grad: torch.Tensor) -> torch.Tensor:
    """The hook on the CODA forward's output (the loss or the logits): refuses a backward that builds a graph of the
    gradients (``create_graph=True``: double backward, Hessian-vector products), whose hooks run with gradients
    enabled. The CODA kernels' gradients are not differentiable: a second-order term would be silently zero, or
    partial (LoRA's A and B get autograd's part)."""
    if torch.is_grad_enabled():
        raise _refuse("a backward with create_graph=True (double backward, Hessian-vector products): the CODA "
                      "kernels' gradients are not differentiable")
    return grad


class _DividedLoss(torch.autograd.Function):
    """``total / items``: the loss of a call with ``num_items_in_batch``, the fused loss's sum over the targets divided
    as Hugging Face's loss divides it. Its backward passes ``grad / items`` on, or zeros where no target is counted
    (``counted`` False): torch's cross-entropy gives an ignored target no gradient whatever the incoming one, so the
    unpatched model's gradients stay 0 for a batch whose labels are all -100 with ``num_items_in_batch=0`` (a loss of
    0 / 0 = NaN), where the fused loss's gradients (zeros, computed in forward) times ``1 / 0`` would be NaN."""

    @staticmethod
    def forward(ctx: Any, total: torch.Tensor, items: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(items, counted)
        return total / items

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        items, counted = ctx.saved_tensors
        return torch.where(counted, grad / items, torch.zeros_like(grad)), None, None


def _checkpoint(checkpoint: Callable[..., Any], step: Callable[..., Any], *inputs: torch.Tensor) -> Any:
    """``checkpoint(step, *inputs)``, the layer's own checkpoint function. Where that is torch's non-reentrant
    checkpoint (``functools.partial`` of it, as ``gradient_checkpointing_enable`` makes it) without a ``context_fn`` of
    the user's, and not traced, the recomputation runs in :class:`~kernels.coda.functions.Recomputation`, where a block
    ending at x skips its down projection: nothing reads the recomputed outputs there."""
    options = getattr(checkpoint, "keywords", None) or {}
    if options.get("use_reentrant") is False and "context_fn" not in options and not torch.compiler.is_compiling():
        return checkpoint(step, *inputs, context_fn=lambda: (nullcontext(), Recomputation()))
    return checkpoint(step, *inputs)


def _coda_forward(self: nn.Module, *args: Any, **kwargs: Any):
    """The CODA forward of :func:`apply_coda` (set as the patched model's ``forward``): the call's arguments named as
    the model's own forward names them (:func:`_by_name`), then :func:`_coda_call`."""
    return _coda_call(self, **(_by_name(self, args, kwargs) if args else kwargs))


def _by_name(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by name, its positional ones bound as the model's class's own ``forward`` takes them (in
    transformers 5: input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, use_cache, logits_to_keep),
    so that a positional call means what it means unpatched; a call that forward refuses raises its ``TypeError``."""
    sig = inspect.signature(_class(model).forward)
    named = dict(sig.bind(model, *args, **kwargs).arguments)
    named.pop(next(iter(sig.parameters)))  # self
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            named.update(named.pop(p.name, {}))
        elif p.kind is p.VAR_POSITIONAL and named.pop(p.name, ()):
            raise TypeError(f"{_class(model).__name__}.forward: unexpected positional arguments")
    return named


def _signature_of_forward() -> inspect.Signature:
    """What ``inspect.signature(model.forward)`` shows of the patched model (the Trainer keeps the dataset columns
    named there, ``generate`` looks for ``logits_to_keep``): transformers 5's parameters, then ``**kwargs``."""
    p = inspect.Parameter
    names = ("input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "labels", "use_cache")
    return inspect.Signature([p("self", p.POSITIONAL_OR_KEYWORD)] +
                             [p(n, p.POSITIONAL_OR_KEYWORD, default=None) for n in names] +
                             [p("logits_to_keep", p.POSITIONAL_OR_KEYWORD, default=0), p("kwargs", p.VAR_KEYWORD)])


_coda_forward.__signature__ = _signature_of_forward()


def _coda_call(self: nn.Module, *, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
               labels: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
               num_items_in_batch: torch.Tensor | int | None = None, shift_labels: torch.Tensor | None = None,
               **options: Any):
    """The CODA forward of one call, its arguments by name."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep

    call = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "inputs_embeds": inputs_embeds, "labels": labels, "logits_to_keep": logits_to_keep, **options,
            **{k: v for k, v in (("num_items_in_batch", num_items_in_batch), ("shift_labels", shift_labels))
               if v is not None}}  # the call as given, for the model's own forward (its loss takes what is given)
    layers = list(self.model.layers)[:self.config.num_hidden_layers]  # the layers the unpatched model runs
    # A layer is checkpointed under the condition of transformers' GradientCheckpointingLayer.
    checkpointed = [self.training and torch.is_grad_enabled() and bool(getattr(layer, "gradient_checkpointing", False))
                    for layer in layers]
    for name in _IGNORED_OPTIONS:
        options.pop(name, None)
    use_cache = _use_cache(self, options.pop("use_cache", None))
    cache, legacy = options.pop("cache", None), options.pop("past_key_values", None)
    cache = legacy if cache is None else cache
    if use_cache and cache is None:
        cache = DynamicCache(config=self.config)  # as the unpatched model makes one
    if cache is not None and (cache.get_seq_length() > 0 or any(checkpointed)):
        # Decoding, or a cache with checkpointed layers (which drop it): the model's own forward, with the call's
        # cache (every module is still the model's own, adapters included).
        return type(self).forward(self, **call)
    plan = _current_plan(self)
    reason = _runs_own_forward(plan)
    if reason is not None:
        warnings.warn(f"apply_coda: {reason}, which the CODA forward would not run: this call runs the model's own "
                      "forward", stacklevel=5)
        return type(self).forward(self, **call)
    weight = _base(self.lm_head).weight
    return_dict = options.pop("return_dict", None)  # the call's (the config's False: HF's own call, which fails)
    as_tuple = return_dict is not None and not return_dict
    reason = (_other_dtype(weight.dtype) or _other_shapes(input_ids, inputs_embeds, position_ids)
              or _other_call(self, options, labels, logits_to_keep, as_tuple, weight))
    if reason is not None:
        warnings.warn(f"apply_coda: {reason}: this call runs the model's own forward", stacklevel=5)
        return type(self).forward(self, **call)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids or inputs_embeds")
    if labels is not None and _first_step(self, input_ids if input_ids is not None else inputs_embeds):
        precompile_step(self, **call)
    embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    if embeds.dtype != weight.dtype:  # the unpatched model raises, or rounds its first norm's output to their dtype
        raise _refuse(f"{embeds.dtype} embeddings over {weight.dtype} weights: the CODA kernels take them in the "
                      f"weights' dtype; cast inputs_embeds (or the embedding) to {weight.dtype}")
    batch, seq, hidden = embeds.shape
    final: Consumer = Linear()
    if labels is not None:
        vocab = _base(self.lm_head).out_features
        targets = _targets(labels, shift_labels, batch * seq, vocab, self.config.vocab_size)
        _check_targets(targets, vocab)
        targets = targets.to(embeds.device)
        final = CrossEntropy(targets, IGNORE_INDEX, "mean" if num_items_in_batch is None else "sum")
    # As in the unpatched model: with use_cache it builds its masks with the cache, and then does not look for packed
    # sequences in position_ids; without, position_ids that restart at 0 inside a row (packed sequences) give each
    # sequence its own causal mask. The mask builder gets no default arange positions: it would search them for
    # packed sequences and synchronize the host to find none. The windows, RMSNorm epsilons and RoPE frequencies are
    # the modules' own at this call.
    arch = _class(self).__name__
    windows = [_WINDOW[arch](self.config, layer.self_attn) for layer in layers]
    if isinstance(attention_mask, dict):  # masks built ahead by layer type (Qwen2's generate with a static cache)
        masks = {w: attention_mask["full_attention" if w is None else "sliding_attention"] for w in set(windows)}
    else:
        masks = {w: (create_causal_mask if w is None else create_sliding_window_causal_mask)(
            self.config, embeds, attention_mask, cache, position_ids) for w in set(windows)}
    if position_ids is None:
        position_ids = torch.arange(seq, device=embeds.device)[None]
    positions = position_ids.expand(batch, seq).reshape(-1)
    rope = RoPE(positions, plan.heads, plan.kv_heads, plan.head_dim, plan.theta, plan.inv_freq)

    def next_qkv(j: int, out: torch.Tensor, x: torch.Tensor, side: Side | None) -> torch.Tensor:
        """Layer j's rotated qkv: the kernel's ``out`` plus its LoRA terms beside the kernel, on the normalized x
        (the model's own norm) and rotated like the kernel's output."""
        return out if side is None else out + _rotated(side(layers[j].input_layernorm(x)), plan, positions)

    def own_qkv(i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's rotated qkv from its input x: its own norm + QKV GEMM + RoPE (a layer that starts the forward or
        a checkpointed one, whose recomputation then needs only x)."""
        w, side = _w_qkv(layers[i].self_attn, plan, f"model.layers.{i}.self_attn")
        norm = layers[i].input_layernorm
        return next_qkv(i, norm_consumer(x, norm.weight, w, rope, norm.variance_epsilon)[0], x, side)

    def mlp(i: int, a: torch.Tensor, residual: torch.Tensor, w_o: torch.Tensor, gamma: torch.Tensor | None,
            w: torch.Tensor | None, consumer: Consumer | None, eps: float | None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i's block after attention: (x, consumer's out; None without a consumer: the block ends at x), eps
        the epsilon of the consumer's norm. One fused block (one epsilon for its two norms); or the split form, with
        a LoRA term beside gate/up/down (SwiGLU's pre-activation and the down projection's input are inside the
        block) or where the two norms' epsilons differ: out-proj + residual + norm + gate/up GEMM (+ SwiGLU when
        there is no gate/up adapter), the adapters' terms and SwiGLU in torch, then down-proj + residual (+ norm +
        the consumer; without one, a cuBLAS ``addmm``)."""
        layer, name = layers[i], f"model.layers.{i}.mlp"
        (w_gate, s_gate), (w_up, s_up), (w_d, s_d) = (
            _weight(getattr(layer.mlp, p), f"{name}.{p}") for p in ("gate_proj", "up_proj", "down_proj"))
        w_gu = _w_gu(w_gate, w_up, plan)
        gamma_mlp, eps_mlp = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        if s_gate is None and s_up is None and s_d is None:
            if consumer is None:  # the block ends at x: its gamma and w are stand-ins nothing reads
                return block(a, residual, w_o, gamma_mlp, w_gu, w_d, gamma_mlp, w_d, NoConsumer(), eps_mlp)[0], None
            if eps == eps_mlp:
                return block(a, residual, w_o, gamma_mlp, w_gu, w_d, gamma, w, consumer, eps)[:2]
        if s_gate is None and s_up is None:
            x1, y = producer_consumer(a, residual, w_o, gamma_mlp, w_gu, SwiGLU(), eps_mlp)[:2]
        else:
            x1, z = producer_consumer(a, residual, w_o, gamma_mlp, w_gu, Linear(), eps_mlp)[:2]
            gate, up = z[:, 0::2], z[:, 1::2]
            h = layer.post_attention_layernorm(x1)
            gate = gate if s_gate is None else gate + s_gate(h)
            up = up if s_up is None else up + s_up(h)
            y = layer.mlp.act_fn(gate) * up
        residual = x1 if s_d is None else x1 + s_d(y)
        if consumer is None:
            return torch.addmm(residual, y, w_d.T), None
        return producer_consumer(y, residual, w_d, gamma, w, consumer, eps)[:2]

    def attention(i: int, x: torch.Tensor, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's attention output from its input x (and its rotated qkv, None: computed here from x)."""
        attn = layers[i].self_attn
        qkv = own_qkv(i, x) if qkv is None else qkv
        return _attend(attn, _with_bias(qkv, attn, plan, positions), masks[windows[i]], windows[i], position_ids, plan,
                       batch, seq, cache)

    def block_step(i: int, a: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i's block after its attention output a, x the layer's input: x of layer i + 1 and the output of the
        consumer the block ends in: layer i + 1's rotated qkv, or after the last layer the LM head's, or None where
        the block ends at x (:func:`ends_at_x`)."""
        w_o, s_o = _weight(layers[i].self_attn.o_proj, f"model.layers.{i}.self_attn.o_proj")
        residual = x if s_o is None else x + s_o(a)
        if ends_at_x(i):
            return mlp(i, a, residual, w_o, None, None, None, None)
        side = None
        if i + 1 < len(layers):
            w, side = _w_qkv(layers[i + 1].self_attn, plan, f"model.layers.{i + 1}.self_attn")
            norm, consumer = layers[i + 1].input_layernorm, rope
        else:
            w, norm, consumer = lm_head(), self.model.norm, final
        x, out = mlp(i, a, residual, w_o, norm.weight, w, consumer, norm.variance_epsilon)
        return x, (out if side is None else next_qkv(i + 1, out, x, side))

    def layer_step(i: int, x: torch.Tensor, qkv: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i: its attention, then its block (:func:`block_step`)."""
        return block_step(i, attention(i, x, qkv), x)

    def lm_head() -> torch.Tensor:
        w, s_lm = _weight(self.lm_head, "lm_head")
        if s_lm is not None:
            raise _refuse("lm_head: lora_dropout > 0 in training is not supported on the LM head (fused with "
                          "the loss)")
        return w

    # Activation checkpointing as the model's own layers do it (their function, reentrant or not, every n layers).
    # A checkpointed layer takes only the residual stream x: it computes its own qkv from x, and the block before it
    # ends at x, so that no qkv is kept for a recomputation. The LM head and the loss (gradients computed in forward)
    # are never inside a checkpoint. The last layer, when checkpointed, keeps its attention's tensors and recomputes
    # only its block: its backward comes first, and what it keeps is freed at the start of backward.
    def ends_at_x(i: int) -> bool:
        """Whether layer i's block ends at x: the next layer or, after the last, the LM head computes its own input
        from x, because that layer is checkpointed or this one is (the LM head stays outside)."""
        return checkpointed[i + 1] if i + 1 < len(layers) else checkpointed[i]

    x, out = embeds.reshape(batch * seq, hidden), None
    for i, layer in enumerate(layers):
        if checkpointed[i] and i + 1 == len(layers):
            x, out = _checkpoint(layer._gradient_checkpointing_func, partial(block_step, i), attention(i, x), x)
        elif checkpointed[i]:
            x, out = _checkpoint(layer._gradient_checkpointing_func, partial(layer_step, i), x)
        else:
            x, out = layer_step(i, x, out)
    if out is None:
        out = norm_consumer(x, self.model.norm.weight, lm_head(), final, self.model.norm.variance_epsilon)[0]
    if out.requires_grad and not torch.compiler.is_compiling():
        out.register_hook(_first_order)
    if labels is None:
        output = CausalLMOutputWithPast(logits=slice_logits_to_keep(out.view(batch, seq, -1), logits_to_keep),
                                        cache=cache)
        return output.to_tuple() if as_tuple else output  # (logits, cache) without None, as HF's tuple
    if num_items_in_batch is None:
        return CausalLMOutputWithPast(loss=out, cache=cache)
    loss = _DividedLoss.apply(out, torch.as_tensor(num_items_in_batch, device=out.device),
                              (targets != IGNORE_INDEX).any())
    return CausalLMOutputWithPast(loss=loss, cache=cache)
