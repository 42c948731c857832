"""Hugging Face implementations of ``train_step``: a transformers ``LlamaForCausalLM`` trained one step.

Each builds the model of the cell's shape in ``prepare`` (untimed) and computes ``model(input_ids,
labels=labels).loss`` in ``run``; the harness times that call and the backward from the loss:

  hf-eager    the model as transformers ships it, SDPA attention
  hf-compile  the same model under ``model.compile(dynamic=False)`` (torch.compile of its call, default mode),
              compiled by the first call at each shape (the correctness pass, then ``first_call_s``)
  hf-liger    Liger's ``apply_liger_kernel_to_llama(model=model)``: RMSNorm, SwiGLU MLP, RoPE and fused linear
              cross-entropy as Liger's Triton kernels, pinned to Triton as in :mod:`kernels.liger`
  hf-coda     ``kernels.coda.hf.apply_coda(model)``: the model's norms, projections and loss on the CODA kernels;
              a cell's first step starts with ``precompile_step``'s dry pass (kernels compiled in parallel)
  hf-liger-lora, hf-coda-lora
              hf-liger and hf-coda with PEFT LoRA on the 7 projections of every layer (:func:`add_lora`: rank 16,
              alpha 32, no dropout), as a LoRA fine-tune runs them

LoRA cells: the op's outputs are the loss and the base weights' gradients, so the base weights stay trainable
leaves (unlike a LoRA fine-tune, which freezes them) and B starts at zero (PEFT's initialization): the loss and the
gradients are the plain model's, checked against the same reference, while every step also computes the adapters'
gradients (into their ``.grad``, which the harness does not read). PEFT renames a wrapped projection's weight
``...q_proj.base_layer.weight``; ``run`` hands the harness's leaves to the model under those names.

``--checkpointing`` (:attr:`codabench.case.Case.checkpointing`): every implementation here calls the model's
``gradient_checkpointing_enable()`` (non-reentrant), so that a cell measures the step with activation
checkpointing, its peak memory included. The layers' recomputation in backward reads the module's weights after
the call, so then ``run`` sets the leaves as the model's parameters and leaves them there until the next call
(instead of ``functional_call``, which puts the meta ones back when the forward returns).

Weights: the harness hands ``run`` the weights as fresh leaf tensors on every call and reads the gradients from
those leaves. So the model holds no weights of its own: it is built on the meta device (its RoPE table, a buffer,
is real), and ``run`` calls it through ``torch.func.functional_call(model, weights, ...)``, which makes the leaves its
parameters for the duration of the call. The canonical names are the model's own state-dict names, so nothing is
renamed or copied. This works under each patch: apply_coda's and Liger's forwards read ``module.weight`` like the
model's own, and torch.compile guards the parameters by shape, dtype and strides, not identity, so new leaves of
the same shape reuse the compiled graph. A model is built once per configuration (shape without the token count,
dtype, device) and kept: its compiled code is then traced once per token count, and a new configuration resets
torch.compile's caches, as torch-compile does.

The model is in training mode (Liger computes the loss without logits only in training), with ``use_cache=False``,
untied embeddings, default RoPE with the shape's theta, and no dropout.

Isolation: ``apply_liger_kernel_to_llama`` also replaces names in ``transformers.models.llama.modeling_llama``
(``LlamaRMSNorm``, ``LlamaMLP``, ``apply_rotary_pos_emb``), which would turn every Llama built later in the worker
process into a Liger model. They are put back as soon as the model is patched; Liger's RoPE, the one patch that
only works through that module's global, is swapped in by hf-liger's attention layers for the length of each of
their calls (so also in a checkpointed layer's recomputation in backward).
"""
from __future__ import annotations

import functools
import importlib.metadata
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.func import functional_call

from codabench.case import Case
from codabench.registry import REGISTRY, FirstCalls, Implementation, Tensors
from workloads.models import ModelShape
from workloads.ops.train_step import TrainStep

BATCH = ("input_ids", "labels")
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_config(shape: ModelShape) -> Any:
    """The ``LlamaConfig`` of a ``train_step`` shape: ``shape.layers`` layers, untied, SDPA, no KV cache."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab,
                       num_hidden_layers=shape.layers, max_position_embeddings=shape.seq_len, rms_norm_eps=shape.eps,
                       rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
                       tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")


def build_llama(shape: ModelShape, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A ``LlamaForCausalLM`` in training mode whose parameters are on the meta device (the caller supplies them)
    and whose RoPE table ``rotary_emb.inv_freq`` is real, fp32, on ``device``."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    with torch.device(device):
        model.model.rotary_emb = LlamaRotaryEmbedding(config)
    return model.train()


def add_lora(model: nn.Module, dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """PEFT LoRA on ``LORA_TARGETS`` of every layer of ``model`` (in place; rank ``LORA_RANK``, alpha
    ``LORA_ALPHA``, no dropout), its A and B real trainable tensors of ``dtype`` on ``device`` (the base weights
    may be on the meta device): A random (std 1 / sqrt(in_features)), B zero as PEFT initializes it. Returns each
    wrapped base weight's name in the plain model -> its name in the LoRA model."""
    import peft

    peft.get_peft_model(model, peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                               target_modules=list(LORA_TARGETS)))
    gen = torch.Generator(device=device).manual_seed(0)
    renamed = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            renamed[f"{name}.weight"] = f"{name}.base_layer.weight"
            for a in module.lora_A.values():
                a.weight = nn.Parameter(torch.randn(a.weight.shape, generator=gen, device=device, dtype=dtype)
                                        * a.weight.shape[1] ** -0.5)
            for b in module.lora_B.values():
                b.weight = nn.Parameter(torch.zeros(b.weight.shape, device=device, dtype=dtype))
    return renamed


def _weights_and_batch(native: Tensors) -> tuple[Tensors, Tensors]:
    """A cell's native tensors split into the model's weights (by state-dict name) and the batch."""
    weights = {k: v for k, v in native.items() if isinstance(v, torch.Tensor) and k not in BATCH}
    return weights, {k: native[k] for k in BATCH}


class HFTrainStep(Implementation):
    """``LlamaForCausalLM(input_ids, labels=labels).loss`` with the canonical weights as its parameters."""

    op = TrainStep.name
    modes = ("fwd_bwd",)
    dtypes = ("fp32", "fp16", "bf16")
    requires: tuple[str, ...] = ("pkg:transformers",)
    lora = False
    """Whether the model gets PEFT LoRA (:func:`add_lora`) after :meth:`patch`."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._model: nn.Module | None = None
        self._renamed: dict[str, str] = {}

    def patch(self, model: nn.Module) -> nn.Module:
        """The model as this implementation runs it (hf-eager: unchanged)."""
        return model

    def prepare(self, case: Case) -> Tensors:
        key = (replace(case.model, tokens=0), case.torch_dtype, case.device, case.checkpointing)
        if key != self._key:
            model = build_llama(case.model, case.torch_dtype, case.device)
            if case.checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model = self.patch(model)
            self._renamed = add_lora(model, case.torch_dtype, case.device) if self.lora else {}
            self._model, self._key = model, key
        return {**case.inputs, "hf_model": self._model}

    def forward(self, model: nn.Module, weights: Tensors, batch: Tensors) -> torch.Tensor:
        weights = {self._renamed.get(k, k): v for k, v in weights.items()}
        if not model.is_activation_checkpointing:
            return functional_call(model, weights, (), batch).loss
        # Checkpointed layers run again in backward, after functional_call would have put the meta weights back:
        # the leaves are set as the model's parameters and stay there until the next call replaces them.
        for name, leaf in weights.items():
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = leaf
        return model(**batch).loss

    def run(self, native: Tensors) -> Tensors:
        weights, batch = _weights_and_batch(native)
        return {"loss": self.forward(native["hf_model"], weights, batch)}

    def metadata(self) -> dict[str, Any]:
        return {"transformers": importlib.metadata.version("transformers"), "torch": torch.__version__}


class HFCompile(HFTrainStep):
    def patch(self, model: nn.Module) -> nn.Module:
        torch._dynamo.reset()  # a new configuration: drop the graphs of the previous one (and their recompile budget)
        model.compile(dynamic=False)
        return model


class HFCoda(HFTrainStep):
    requires = ("pkg:transformers", "triton-dot")

    def __init__(self) -> None:
        super().__init__()
        self._first_calls = FirstCalls()

    def patch(self, model: nn.Module) -> nn.Module:
        from kernels.coda.hf import apply_coda

        return apply_coda(model)

    def prepare(self, case: Case) -> Tensors:
        self._first_calls.arm((case.model, case.torch_dtype, case.device), case.device)
        return super().prepare(case)

    def run(self, native: Tensors) -> Tensors:
        from kernels.coda.plugin import RECORDER
        from kernels.coda.precompile import precompile_autograd

        device = self._first_calls.take()
        if device is not None:  # the shape's first step: its kernels compiled in parallel first
            weights, batch = _weights_and_batch(native)
            precompile_autograd(lambda: self.forward(native["hf_model"], weights, batch), weights.values(), device)
        RECORDER.start()  # the step's forward and backward: which kernels ran fused or split
        return super().run(native)

    def describe(self, native: Tensors) -> str:
        from kernels.coda.plugin import RECORDER
        from kernels.coda.strategy import summary

        return summary(RECORDER.launches())


@contextmanager
def _setattrs(module: Any, values: dict[str, Any]) -> Iterator[None]:
    """``module``'s attributes set to ``values`` inside the block, and put back as they were after it."""
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def _with_attrs(fn: Callable[..., Any], module: Any, values: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` run with ``module``'s attributes set to ``values`` (:func:`_setattrs`) for the length of each call."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _setattrs(module, values):
            return fn(*args, **kwargs)

    return call


LIGER_GLOBALS = ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")
"""The names of ``modeling_llama`` that ``apply_liger_kernel_to_llama`` replaces."""


class HFLiger(HFTrainStep):
    requires = ("cuda", "pkg:transformers", "pkg:liger_kernel")

    def patch(self, model: nn.Module) -> nn.Module:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        from transformers.models.llama import modeling_llama

        from kernels.liger import pin_triton

        pin_triton()
        with _setattrs(modeling_llama, {k: getattr(modeling_llama, k) for k in LIGER_GLOBALS}):  # restored after
            apply_liger_kernel_to_llama(model=model)  # rope, rms_norm, swiglu, fused_linear_cross_entropy
        # Liger's RoPE replaces a module global; this model's attention layers set it for their own calls only, so
        # that a checkpointed layer's recomputation in backward runs Liger's RoPE as its forward did.
        for layer in model.model.layers:
            layer.self_attn.forward = _with_attrs(layer.self_attn.forward, modeling_llama,
                                                  {"apply_rotary_pos_emb": liger_rotary_pos_emb})
        return model

    def metadata(self) -> dict[str, Any]:
        from kernels.liger import pin_triton

        return {**super().metadata(), "liger_kernel": importlib.metadata.version("liger_kernel"),
                "liger_resolved_impl": pin_triton()}


class HFLigerLoRA(HFLiger):
    requires = HFLiger.requires + ("pkg:peft",)
    lora = True


class HFCodaLoRA(HFCoda):
    requires = HFCoda.requires + ("pkg:peft",)
    lora = True


for _name, _cls, _label, _desc in [
    ("hf-eager", HFTrainStep, "baseline", "Hugging Face LlamaForCausalLM, eager, SDPA attention"),
    ("hf-compile", HFCompile, "baseline", "Hugging Face LlamaForCausalLM under torch.compile (default mode)"),
    ("hf-liger", HFLiger, "baseline", "Hugging Face LlamaForCausalLM + Liger's apply_liger_kernel_to_llama (Triton)"),
    ("hf-coda", HFCoda, "fused", "Hugging Face LlamaForCausalLM + apply_coda (CODA kernels, the model's SDPA)"),
    ("hf-liger-lora", HFLigerLoRA, "baseline", "hf-liger + PEFT LoRA rank 16 on the 7 projections of every layer"),
    ("hf-coda-lora", HFCodaLoRA, "fused", "hf-coda + PEFT LoRA rank 16 on the 7 projections of every layer (merged "
                                          "into the fused GEMMs' weights)"),
]:
    _impl = _cls()
    _impl.name, _impl.label, _impl.description, _impl.source = _name, _label, _desc, __name__
    REGISTRY.add(_impl)
