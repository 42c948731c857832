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
only works through that module's global, is swapped in for the duration of hf-liger's forward only.
"""
from __future__ import annotations

import importlib.metadata
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import torch
from torch import nn
from torch.func import functional_call

from codabench.case import Case
from codabench.registry import REGISTRY, FirstCalls, Implementation, Tensors
from workloads.models import ModelShape
from workloads.ops.train_step import TrainStep

BATCH = ("input_ids", "labels")


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

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._model: nn.Module | None = None

    def patch(self, model: nn.Module) -> nn.Module:
        """The model as this implementation runs it (hf-eager: unchanged)."""
        return model

    def prepare(self, case: Case) -> Tensors:
        key = (replace(case.model, tokens=0), case.torch_dtype, case.device)
        if key != self._key:
            self._model, self._key = self.patch(build_llama(case.model, case.torch_dtype, case.device)), key
        return {**case.inputs, "hf_model": self._model}

    def forward(self, model: nn.Module, weights: Tensors, batch: Tensors) -> torch.Tensor:
        return functional_call(model, weights, (), batch).loss

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
        self._rope = (modeling_llama, {"apply_rotary_pos_emb": liger_rotary_pos_emb})
        return model

    def forward(self, model: nn.Module, weights: Tensors, batch: Tensors) -> torch.Tensor:
        with _setattrs(*self._rope):
            return super().forward(model, weights, batch)

    def metadata(self) -> dict[str, Any]:
        from kernels.liger import pin_triton

        return {**super().metadata(), "liger_kernel": importlib.metadata.version("liger_kernel"),
                "liger_resolved_impl": pin_triton()}


for _name, _cls, _label, _desc in [
    ("hf-eager", HFTrainStep, "baseline", "Hugging Face LlamaForCausalLM, eager, SDPA attention"),
    ("hf-compile", HFCompile, "baseline", "Hugging Face LlamaForCausalLM under torch.compile (default mode)"),
    ("hf-liger", HFLiger, "baseline", "Hugging Face LlamaForCausalLM + Liger's apply_liger_kernel_to_llama (Triton)"),
    ("hf-coda", HFCoda, "fused", "Hugging Face LlamaForCausalLM + apply_coda (CODA kernels, the model's SDPA)"),
]:
    _impl = _cls()
    _impl.name, _impl.label, _impl.description, _impl.source = _name, _label, _desc, __name__
    REGISTRY.add(_impl)
