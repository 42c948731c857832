"""``apply_coda`` on Hugging Face models: the patched model equals the unpatched one (kernels.coda.hf).

CPU: tiny configs in fp32 in the Triton interpreter. Every compared tensor (loss, logits, every parameter's
gradient, parameters after optimizer steps) passes the suite's rule (:mod:`codabench.metrics`) against the
unpatched model in float64: rel_err(patched fp32) <= 2 x rel_err(unpatched fp32) + 1e-6. GPU (only where CUDA
is available): bf16 at the Llama-3.2-1B and Llama-3-8B shapes with two layers, under the same rule with
the bf16 floor.
"""
from __future__ import annotations

import copy
import os
import weakref

import pytest
import torch
from torch import nn

from codabench.metrics import passes, rel_err
from kernels.coda import cross_entropy_bwd, functions
from kernels.coda.hf import CodaUnsupportedError, apply_coda, apply_coda_to_mistral, apply_coda_to_qwen2
from kernels.coda.strategy import ENV as STRATEGY_ENV

from kernel_helpers import launches

transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")

BATCH, SEQ, VOCAB, PAD = 2, 24, 256, 6  # the second row's first PAD tokens are padding
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# Llama: tied embeddings and llama3 RoPE like Llama-3.2-1B, SDPA. Mistral: a sliding window shorter than the
# sequence, untied, SDPA. Qwen2: q/k/v biases, tied, SDPA. (Eager attention: the dropout test; HF's eager
# attention gives NaN in float64 on the fully masked rows of left padding.)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}


FUSED = {"norm_input_kernel", "gemm_rope_kernel", "gemm_residual_norm_kernel", "gemm_swiglu_kernel",  # forward
         "gemm_cross_entropy_kernel", "dgrad_rmsnorm_kernel", "dgrad_swiglu_kernel", "rope_bwd_kernel"}  # backward


def tiny(arch: str = "llama", seed: int = 0, **overrides) -> nn.Module:
    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(
        **{"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": VOCAB, "num_hidden_layers": 2, "max_position_embeddings": 64,
           "rms_norm_eps": 1e-5, "initializer_range": 0.2, **copy.deepcopy(extra), **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels): left padding on row 1 (labels -100 there), a quarter more -100.

    Left padding, so that the mask changes what the other tokens of the row attend to."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :PAD] = 0
    labels = ids.clone()
    labels[(mask == 0) | (torch.rand(BATCH, SEQ, generator=g) < 0.25)] = -100
    return ids, mask, labels


def assert_passes(name: str, ours: torch.Tensor, torch_out: torch.Tensor, ref: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> None:
    torch_err, err = rel_err(torch_out, ref), rel_err(ours, ref)
    assert passes(err, torch_err, dtype), f"{name}: rel_err {err:.2e} vs unpatched {dtype} {torch_err:.2e}"


def loss_and_grads(model: nn.Module, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor], object]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}, out


@pytest.mark.parametrize("arch,ce_chunk", [(arch, None) for arch in ARCHS] + [("llama", 20)])
def test_loss_and_every_gradient_match_the_unpatched_model(arch, ce_chunk, monkeypatch):
    """ce_chunk: rows per chunk of the LM head's gradient pass (20: chunks of 20, 20 and 8 of the 48 tokens)."""
    if ce_chunk:
        monkeypatch.setattr(cross_entropy_bwd, "ce_chunk_rows", lambda m, v, element_size: ce_chunk)
    model = tiny(arch)
    ids, mask, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    loss64, grads64, _ = loss_and_grads(copy.deepcopy(model).double(), **inputs)
    loss32, grads32, _ = loss_and_grads(model, **inputs)
    assert apply_coda(model) is model
    with launches() as names:
        loss, grads, out = loss_and_grads(model, **inputs)
    assert out.logits is None  # the fused cross-entropy wrote no logits: the CODA forward ran
    assert FUSED <= set(names), sorted(set(names))
    assert names.count("gemm_cross_entropy_kernel") == (3 if ce_chunk else 1)
    assert set(grads) == set(grads64) and all(g is not None for g in grads.values())
    assert_passes("loss", loss, loss32, loss64)
    for name in grads64:
        assert_passes(name, grads[name], grads32[name], grads64[name])


@pytest.mark.slow
def test_padding_and_ignored_labels_change_the_loss():
    """The fixture's padding mask and -100 labels are not no-ops: the patched loss follows both as HF's does."""
    model = apply_coda(tiny())
    ids, mask, labels = batch()
    ref = tiny()
    with torch.no_grad():
        base = model(ids, attention_mask=mask, labels=labels).loss
        for m, lab in [(torch.ones_like(mask), labels), (mask, torch.where(labels == -100, ids, labels))]:
            ours, theirs = model(ids, attention_mask=m, labels=lab).loss, ref(ids, attention_mask=m, labels=lab).loss
            assert abs(ours - base) > 1e-3 and abs(ours - theirs) < 1e-5 * abs(theirs)


@pytest.mark.parametrize("rope", ["default", "linear", "llama3"])
def test_logits_without_labels(rope):
    params = {"default": {"rope_type": "default", "rope_theta": 10000.0},
              "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, "llama3": LLAMA3_ROPE}[rope]
    model = tiny(rope_parameters=params, tie_word_embeddings=False)
    ids, mask, _ = batch()
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        logits64, logits32 = ref(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
        apply_coda(model)
        out = model(ids, attention_mask=mask)
        last = model(ids, attention_mask=mask, logits_to_keep=5).logits
    assert out.loss is None and out.logits.shape == (BATCH, SEQ, VOCAB)
    assert_passes("logits", out.logits, logits32, logits64)
    assert torch.equal(last, out.logits[:, -5:])


def test_loss_options_num_items_shift_labels_and_inputs_embeds():
    model = tiny()
    ids, mask, labels = batch()
    n_items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 3)  # as the Trainer passes it, over micro-batches
    other = torch.where(labels == -100, -100, (labels + 1) % VOCAB)  # HF uses shift_labels as given when passed
    calls = [{"labels": labels, "num_items_in_batch": n_items}, {"labels": labels, "shift_labels": other}]
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        expected = [(ref(ids, attention_mask=mask, **c).loss, model(ids, attention_mask=mask, **c).loss) for c in calls]
        apply_coda(model)
        for c, (loss64, loss32) in zip(calls, expected):
            out = model(ids, attention_mask=mask, **c)
            assert out.logits is None
            assert_passes(str(list(c)), out.loss, loss32, loss64)
        embeds = model.model.embed_tokens(ids)
        assert torch.equal(model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss,
                           model(ids, attention_mask=mask, labels=labels).loss)


def test_attention_dropout_is_the_models_own():
    """In training, the model's attention applies its dropout: same seed, same masks, same loss as unpatched."""
    model = tiny(attention_dropout=0.5, attn_implementation="eager").train()
    ids, mask, labels = batch()
    with torch.no_grad():
        torch.manual_seed(7)
        theirs = model(ids, attention_mask=mask, labels=labels).loss
        apply_coda(model)
        torch.manual_seed(7)
        ours = model(ids, attention_mask=mask, labels=labels).loss
        no_dropout = model.eval()(ids, attention_mask=mask, labels=labels).loss
    assert abs(ours - theirs) < 1e-5 * abs(theirs) and abs(ours - no_dropout) > 1e-3


@pytest.mark.slow
def test_adamw_steps_track_the_unpatched_model():
    """Three AdamW steps on the HF parameters: each step's loss and the final parameters follow fp64 training."""
    ids, mask, labels = batch()
    models = {"ours": apply_coda(tiny()), "fp32": tiny(), "fp64": tiny().double()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    losses: dict[str, list[torch.Tensor]] = {k: [] for k in models}
    for _ in range(3):
        for k, m in models.items():
            loss = m(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opts[k].step()
            opts[k].zero_grad()
            losses[k].append(loss.detach())
    for step, (ours, fp32, fp64) in enumerate(zip(*losses.values())):
        assert_passes(f"loss at step {step}", ours, fp32, fp64)
    assert losses["ours"][2] < losses["ours"][1] < losses["ours"][0]  # the steps reached the CODA forward
    params = {k: dict(m.named_parameters()) for k, m in models.items()}
    for name, p64 in params["fp64"].items():
        assert_passes(name, params["ours"][name].detach(), params["fp32"][name].detach(), p64.detach())


def test_state_dict_and_save_pretrained_keep_the_hf_layout(tmp_path):
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    apply_coda(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters())  # the same nn.Parameter objects
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert {k: v.shape for k, v in loaded.state_dict().items()} == {k: v.shape for k, v in before.items()}
    assert all(torch.equal(loaded.state_dict()[k], before[k]) for k in before)
    ids, mask, labels = batch()
    with torch.no_grad():
        assert torch.equal(apply_coda(loaded)(ids, attention_mask=mask, labels=labels).loss,
                           model(ids, attention_mask=mask, labels=labels).loss)


def _with(model: nn.Module, name: str, value) -> nn.Module:
    """The model with the attribute at the dotted ``name`` replaced by ``value``."""
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, value)
    return model


class LoRALinear(nn.Linear):
    """Stands in for an adapter or quantized layer: a subclass of nn.Linear whose forward is not F.linear."""


class _ForeignRMSNorm(nn.Module):
    """Another library's RMSNorm (as Liger's patch puts into transformers' Llama module for models built after it)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


@pytest.mark.parametrize("make, apply, message", [
    (lambda: transformers.LlamaForSequenceClassification(tiny().config), apply_coda,
     "LlamaForSequenceClassification is not supported"),
    (lambda: tiny("llama"), apply_coda_to_mistral, "expected a MistralForCausalLM, got LlamaForCausalLM"),
    (lambda: tiny(hidden_act="gelu"), apply_coda, "hidden_act='gelu'"),
    (lambda: tiny(mlp_bias=True), apply_coda, "biases on the LM head, o_proj or the MLP"),
    (lambda: tiny(attention_bias=True), apply_coda, "biases on the LM head, o_proj or the MLP"),
    (lambda: tiny(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                   "original_max_position_embeddings": 16}), apply_coda, "rope_type='yarn'"),
    (lambda: tiny(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}), apply_coda,
     "rope_type='dynamic'"),
    (lambda: _with(tiny(), "model.layers.1.self_attn.q_proj", LoRALinear(64, 64, bias=False)), apply_coda,
     "model.layers.1.self_attn.q_proj is a LoRALinear: the projections must be nn.Linear or PEFT LoRA"),
    (lambda: _with(tiny(), "loss_function", lambda **kwargs: 0.0), apply_coda, "a custom loss_function"),
    (lambda: _with(tiny(), "model.norm", nn.LayerNorm(64)), apply_coda,
     "model.norm is a torch.nn.modules.normalization.LayerNorm, not a LlamaRMSNorm"),
    (lambda: _with(tiny(), "model.layers.1.post_attention_layernorm", _ForeignRMSNorm(64)), apply_coda,
     r"model.layers.1.post_attention_layernorm is a test_hf._ForeignRMSNorm, not a LlamaRMSNorm"),
])
def test_unsupported_models_are_refused_with_one_line(make, apply, message):
    model = make()
    with pytest.raises(CodaUnsupportedError, match=message) as err:
        apply(model)
    assert "\n" not in str(err.value) and str(err.value).startswith("apply_coda: ")
    assert not hasattr(model, "_coda_plan")  # not patched


def test_qwen2_alias_patches_qwen2_once():
    model = tiny("qwen2")
    assert apply_coda_to_qwen2(model) is model and model._coda_plan.qkv_bias
    plan, forward = model._coda_plan, model.forward
    assert apply_coda(model) is model and model._coda_plan is plan and model.forward == forward


# ---- a model changed after apply_coda, PEFT LoRA, checkpointing, packed sequences, generate() ----------------

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trainable_grads(model: nn.Module, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_close_to(name: str, ours: torch.Tensor, theirs: torch.Tensor, tol: float = 1e-5) -> None:
    err = rel_err(ours, theirs)
    assert err <= tol, f"{name}: rel_err {err:.2e} against the unpatched model"


@pytest.mark.parametrize("order, config", [
    ("after", {"target_modules": ALL_PROJECTIONS, "lora_alpha": 32, "use_rslora": True}),
    ("before", {"target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "lora_alpha": 8,
                "lora_dropout": 0.1}),
])
def test_peft_lora_before_or_after_apply_coda_gives_hf_peft_loss_and_adapter_grads(order, config):
    """r=16 LoRA (random A and B, so that every term counts), PEFT applied after apply_coda or apply_coda to the
    PEFT model: the loss and every LoRA A/B gradient equal unpatched HF + PEFT's. With lora_dropout in training,
    the adapters run beside the kernels (q/v rotated onto the kernel's qkv, down_proj through the split MLP) and
    draw their dropout masks in the unpatched model's order: the same seed gives the same loss."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=16, init_lora_weights=False, **config)
    torch.manual_seed(3)
    ref = peft.get_peft_model(tiny(), lora)
    model = tiny()
    if order == "before":
        apply_coda(model)
        model = peft.get_peft_model(model, lora)
    else:
        model = peft.get_peft_model(model, lora)
        assert apply_coda(model) is model
    model.load_state_dict(ref.state_dict())
    model.train(), ref.train()
    ids, mask, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    torch.manual_seed(11)
    with launches() as names:
        loss, grads = trainable_grads(model, **inputs)
    assert "gemm_cross_entropy_kernel" in names  # the CODA forward ran, with the adapters
    torch.manual_seed(11)
    ref_loss, ref_grads = trainable_grads(ref, **inputs)
    if config.get("lora_dropout"):
        torch.manual_seed(12)
        with torch.no_grad():
            assert abs(ref(**inputs).loss - ref_loss) > 1e-4  # the dropout masks count
    assert set(grads) == set(ref_grads) and any("lora_A" in n for n in grads)
    base_loss = tiny()(**inputs).loss.detach()
    assert abs(loss - base_loss) > 1e-3  # the adapters changed the loss
    if config.get("lora_dropout"):  # float64 would draw other dropout masks: the fp32 model's result is the reference
        assert_close_to("loss", loss, ref_loss)
        for name in ref_grads:
            assert_close_to(name, grads[name], ref_grads[name])
        return
    loss64, grads64 = trainable_grads(copy.deepcopy(ref).double(), **inputs)
    assert_passes("loss", loss, ref_loss, loss64)
    for name in ref_grads:
        assert_passes(name, grads[name], ref_grads[name], grads64[name])


def test_lora_disabled_and_merged_adapters_follow_peft():
    """disable_adapter() gives the base model's loss; merge_adapter() (W holds the adapter) the adapter's, once."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "up_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    ref = peft.get_peft_model(tiny(), lora)
    model = apply_coda(peft.get_peft_model(tiny(), lora))
    model.load_state_dict(ref.state_dict())
    ids, mask, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        with_adapter = ref(**inputs).loss
        with model.disable_adapter(), ref.disable_adapter():
            assert_close_to("disabled", model(**inputs).loss, ref(**inputs).loss)
        model.merge_adapter()
        assert_close_to("merged", model(**inputs).loss, with_adapter)
        assert abs(with_adapter - tiny()(**inputs).loss) > 1e-3


def test_lora_variants_and_lora_bias_are_refused_naming_the_module():
    peft = pytest.importorskip("peft")
    ids, _, labels = batch()
    for config, message in [({"lora_bias": True}, r"model.layers.0.self_attn.q_proj: lora_bias is not fused"),
                            ({"use_dora": True}, r"model.layers.0.self_attn.q_proj: LoRA variant")]:
        model = apply_coda(peft.get_peft_model(tiny(), peft.LoraConfig(r=4, target_modules=["q_proj"], **config)))
        with pytest.raises(CodaUnsupportedError, match=message) as err:
            model.train()(input_ids=ids, labels=labels)
        assert "\n" not in str(err.value)


def test_a_projection_replaced_after_apply_coda_is_planned_for_or_refused():
    """Every forward checks the planned modules and parameters: a new plain projection is used (the loss follows
    the unpatched model's), a bias on o_proj is refused naming the module, and nothing is silently ignored."""
    model = apply_coda(tiny())
    ref = tiny()
    ids, mask, labels = batch()
    torch.manual_seed(5)
    for m in (model, ref):
        torch.manual_seed(5)
        m.model.layers[1].self_attn.q_proj = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        assert_close_to("loss", model(ids, attention_mask=mask, labels=labels).loss,
                        ref(ids, attention_mask=mask, labels=labels).loss)
        model.model.layers[0].self_attn.o_proj = nn.Linear(64, 64, bias=True)
        with pytest.raises(CodaUnsupportedError, match="model.layers.0.self_attn.o_proj has a bias") as err:
            model(ids, labels=labels)
    assert "\n" not in str(err.value)


def test_the_plan_keeps_no_replaced_weights_alive():
    """functional_call's weights (the train suite hands fresh ones every step) make a new plan, which holds only
    weak references: once the caller drops them they are freed."""
    model = apply_coda(tiny())
    ids, _, labels = batch()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        loss = torch.func.functional_call(model, weights, (ids,), {"labels": labels}).loss
        assert torch.equal(loss, model(ids, labels=labels).loss)
    freed = weakref.ref(weights["model.layers.0.self_attn.q_proj.weight"])
    del weights
    assert freed() is None


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 44, -5])
def test_bad_labels_raise_as_the_unpatched_model_does(bad):
    model, ref = apply_coda(tiny()), tiny()
    ids, _, labels = batch()
    labels[0, 7] = bad
    errors = []
    for m in (ref, model):
        with pytest.raises(Exception) as err:
            m(ids, labels=labels)
        errors.append((type(err.value), str(err.value)))
    assert errors[0] == errors[1] == (IndexError, f"Target {bad} is out of bounds.")


def test_swish_is_silu():
    model, ref = apply_coda(tiny(hidden_act="swish")), tiny(hidden_act="swish")
    ids, mask, labels = batch()
    with torch.no_grad():
        assert_close_to("loss", model(ids, attention_mask=mask, labels=labels).loss,
                        ref(ids, attention_mask=mask, labels=labels).loss)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_matches_the_unpatched_model(reentrant, monkeypatch):
    """gradient_checkpointing_enable() (reentrant or not): the same loss and gradients as unpatched HF with it. Each
    layer is recomputed in backward from its input alone (its own norm + QKV + RoPE and its block; the last layer
    keeps its attention), the LM head runs once (outside the checkpoints); a non-reentrant recomputation skips the
    down projection, and the SwiGLU dgrad writes over the recomputed pre-activation."""
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    model, ref = tiny(), tiny()
    for m in (model, ref):
        m.train().gradient_checkpointing_enable(**kwargs)
    apply_coda(model)
    ids, mask, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    addmm, overwrites = [], []  # the down projections of the blocks that end at x; the SwiGLU dgrads' overwrite
    monkeypatch.setattr(torch, "addmm", lambda *args: addmm.append(1) or torch.Tensor.addmm(*args))
    dgrad_swiglu = functions.dgrad_swiglu
    monkeypatch.setattr(functions, "dgrad_swiglu",
                        lambda *args, overwrite: overwrites.append(overwrite) or dgrad_swiglu(*args, overwrite=overwrite))
    with launches() as names:
        loss, grads = trainable_grads(model, **inputs)
    layers = model.config.num_hidden_layers
    # every block runs twice; every layer's QKV but the last one's, whose attention is kept, too
    assert names.count("gemm_swiglu_kernel") == 2 * layers and names.count("gemm_rope_kernel") == 2 * layers - 1
    assert names.count("gemm_cross_entropy_kernel") == 1 and "gemm_residual_norm_kernel" in names
    assert len(addmm) == (2 if reentrant else 1) * layers
    assert overwrites == [not reentrant] * layers  # a non-reentrant recomputation's z_pre takes dz_pre
    ref_loss, ref_grads = trainable_grads(ref, **inputs)
    assert_close_to("loss", loss, ref_loss)
    for name in ref_grads:
        assert_close_to(name, grads[name], ref_grads[name], 1e-4)


def test_frozen_weights_get_no_weight_gradient_gemm(monkeypatch):
    """Frozen weights (the LM head, one down projection): the same loss and trainable gradients as the unpatched model,
    and their weight-gradient GEMMs are not run (the LM head's in the cross-entropy's forward, the down
    projection's in the block's backward)."""
    def freeze(m: nn.Module) -> nn.Module:
        m.lm_head.weight.requires_grad_(False)
        m.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
        return m

    products: list[tuple[str, tuple[int, ...]]] = []  # (module, shape) of every product of mm / mm_acc

    def recorded(module, name):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: products.append((module.__name__, tuple((out := fn(
            *a, **k)).shape))) or out)

    for module, name in ((functions, "mm"), (cross_entropy_bwd, "mm"), (cross_entropy_bwd, "mm_acc")):
        recorded(module, name)
    model = freeze(apply_coda(tiny(tie_word_embeddings=False)))
    ids, mask, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    loss, grads = trainable_grads(model, **inputs)
    assert {m for m, _ in products} == {functions.__name__}  # no LM-head dW in cross-entropy's forward
    down = tuple(model.model.layers[1].mlp.down_proj.weight.shape)  # a dW of this shape: the other layer's only
    assert [shape for _, shape in products].count(down) == 1
    ref_loss, ref_grads = trainable_grads(freeze(tiny(tie_word_embeddings=False)), **inputs)
    assert_close_to("loss", loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and "lm_head.weight" not in grads
    for name in ref_grads:
        assert_close_to(name, grads[name], ref_grads[name], 1e-4)


def test_checkpointing_second_backward_gets_the_same_gradients():
    """A second backward through the same graph (retain_graph) recomputes the checkpointed layers again: the first
    one's overwritten recomputed tensors are not read again, so both backwards give the same gradients."""
    model = apply_coda(tiny().train())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, mask, labels = batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    params = [p for p in model.parameters() if p.requires_grad]
    first = torch.autograd.grad(loss, params, retain_graph=True)
    second = torch.autograd.grad(loss, params)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layer", [0, 1])
def test_checkpointing_some_layers_matches_the_unpatched_model(layer):
    """Only one layer checkpointed (as ``every_n_layers`` leaves others out): the block before a checkpointed layer
    ends at x, a checkpointed layer's block before a plain one fuses that one's QKV; loss and gradients are HF's."""
    model, ref = tiny(), tiny()
    for m in (model, ref):
        m.train().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.model.layers[1 - layer].gradient_checkpointing = False
    apply_coda(model)
    ids, mask, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with launches() as names:
        loss, grads = trainable_grads(model, **inputs)
    assert names.count("gemm_swiglu_kernel") == 3  # the checkpointed layer's recomputed once
    ref_loss, ref_grads = trainable_grads(ref, **inputs)
    assert_close_to("loss", loss, ref_loss)
    for name in ref_grads:
        assert_close_to(name, grads[name], ref_grads[name], 1e-4)


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_sequences_follow_the_unpatched_model(use_cache):
    """position_ids restarting at 0 inside a row, no attention_mask: with use_cache=False each sequence attends to
    itself only (HF's packed-sequence mask), with the config's use_cache=True (a cache, no packing detection) the
    whole row is causal -- as in the unpatched model under the same config."""
    model, ref = apply_coda(tiny(use_cache=use_cache)), tiny(use_cache=use_cache)
    ids, _, _ = batch()
    pos = torch.cat([torch.arange(10), torch.arange(SEQ - 10)])[None].expand(BATCH, SEQ)
    with torch.no_grad():
        ours, theirs = model(ids, position_ids=pos).logits, ref(ids, position_ids=pos).logits
        alone = ref(ids[:, 10:]).logits  # the second sequence on its own
    assert_close_to("logits", ours, theirs)
    assert (rel_err(ours[:, 10:], alone) < 1e-5) == (not use_cache)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_greedy_tokens_equal_the_unpatched_model(arch):
    """generate() with the KV cache, left padding (Mistral's sliding window, Qwen2's biases): the prefill runs on the
    CODA kernels and fills the cache with Hugging Face's keys and values, the decode steps run the model's own
    forward from it; the greedy tokens are the unpatched model's."""
    model, ref = apply_coda(tiny(arch).eval()), tiny(arch).eval()
    ids, mask, _ = batch()
    args = {"attention_mask": mask, "max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        with launches() as names:
            ours = model.generate(ids, **args)
        theirs = ref.generate(ids, **args)
    assert names.count("gemm_rope_kernel") == 2  # the prefill's two layers, and no decode step
    assert ours.shape == (BATCH, SEQ + 16) and torch.equal(ours, theirs)
    with torch.no_grad():
        mine, hf = model(ids, attention_mask=mask, use_cache=True), ref(ids, attention_mask=mask, use_cache=True)
    assert_close_to("prefill logits", mine.logits, hf.logits)
    for a, b in zip(mine.cache.layers, hf.cache.layers, strict=True):
        assert_close_to("cached keys", a.keys, b.keys)
        assert_close_to("cached values", a.values, b.values)


def test_vocab_ffn_and_hidden_sizes_off_the_16_byte_rule():
    """vocab 257 (like Llama-2's 32000 + a pad token), FFN 90, hidden 70 and 5 heads of 14 (qkv 98): rows of 1028,
    360, 280 and 392 bytes, which the tensor descriptors refuse as they are. The loss, every gradient and the logits
    still equal the unpatched model's (the kernels lay such rows out with padded strides: kernels.coda.align)."""
    model = tiny(vocab_size=VOCAB + 1, intermediate_size=90, hidden_size=70, num_attention_heads=5,
                 num_key_value_heads=1, head_dim=14, tie_word_embeddings=False)
    ids, mask, labels = batch()
    labels[0, 5] = VOCAB  # the ragged last column is a target
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ref64 = copy.deepcopy(model).double()
    loss64, grads64, _ = loss_and_grads(ref64, **inputs)
    loss32, grads32, _ = loss_and_grads(model, **inputs)
    with torch.no_grad():
        logits64, logits32 = ref64(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    apply_coda(model)
    loss, grads, out = loss_and_grads(model, **inputs)
    assert out.logits is None
    assert_passes("loss", loss, loss32, loss64)
    for name in grads64:
        assert_passes(name, grads[name], grads32[name], grads64[name])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    assert logits.shape == (BATCH, SEQ, VOCAB + 1)
    assert_passes("logits", logits, logits32, logits64)


# ---- GPU: bf16 at the real shapes ----------------------------------------------------------------------

GPU_SHAPES = {  # two layers each, the real vocabulary
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                     "max_position_embeddings": 131072,
                     "rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}},
    "llama-3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
                   "max_position_embeddings": 8192,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
}


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="bf16 agreement at the Llama-3 shapes needs a CUDA GPU and compiled kernels")
@pytest.mark.parametrize("shape,ce_chunk,strategy", [(shape, None, None) for shape in GPU_SHAPES]
                         + [("llama-3.2-1b", 1024, "fused"), ("llama-3.2-1b", 1024, "split"),
                            ("llama-3.2-1b", 256, None)])
def test_bf16_loss_and_grads_at_llama3_shapes_gpu(shape, ce_chunk, strategy, monkeypatch):
    """ce_chunk 1024: the LM head's gradient in two chunks of rows, its weight gradient summed in place by
    :func:`kernels.coda.gemm.mm_acc`, on the mainloop (``fused``) or cuBLAS (``split``, every other kernel split
    too); 256: eight chunks, eight roundings of the bf16 weight gradient."""
    if ce_chunk:
        monkeypatch.setattr(cross_entropy_bwd, "ce_chunk_rows", lambda m, v, element_size: ce_chunk)
    if strategy:
        monkeypatch.setenv(STRATEGY_ENV, strategy)
    config = transformers.LlamaConfig(vocab_size=128256, num_hidden_layers=2, rms_norm_eps=1e-5, **GPU_SHAPES[shape])
    with torch.device("cuda"):
        torch.manual_seed(0)
        ref = transformers.LlamaForCausalLM._from_config(config, dtype=torch.float64)
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(ref.state_dict())
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, 1024), generator=g, device="cuda")
    labels = torch.where(torch.rand(ids.shape, generator=g, device="cuda") < 0.1, -100, ids)
    loss64, grads64, _ = loss_and_grads(ref, input_ids=ids, labels=labels)
    del ref
    loss16, grads16, _ = loss_and_grads(model, input_ids=ids, labels=labels)  # zero_grad(set_to_none) keeps these
    loss, grads, out = loss_and_grads(apply_coda(model), input_ids=ids, labels=labels)
    assert out.logits is None
    bad = []
    for name, ours, theirs, ref64 in [("loss", loss, loss16, loss64)] + [
            (n, grads[n], grads16[n], grads64[n]) for n in grads64]:
        torch_err, err = rel_err(theirs, ref64), rel_err(ours, ref64)
        if not passes(err, torch_err, torch.bfloat16):
            bad.append((name, err, torch_err))
    assert not bad, bad


def bf16_pair(shape: str, layers: int = 2, seed: int = 0, **overrides) -> tuple[nn.Module, nn.Module]:
    """A Llama of ``GPU_SHAPES[shape]`` in bf16 on the GPU, and an equal copy to patch."""
    config = transformers.LlamaConfig(vocab_size=128256, num_hidden_layers=layers, rms_norm_eps=1e-5,
                                      **{**GPU_SHAPES[shape], **overrides})
    with torch.device("cuda"):
        torch.manual_seed(seed)
        ref = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return ref, copy.deepcopy(ref)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="torch.compile of the drop-in with Inductor needs a CUDA GPU")
def test_compiled_fullgraph_bf16_equals_eager_patched_gpu():
    """``torch.compile(model, fullgraph=True)`` with Inductor, bf16, llama-3.2-1b's shape: the CODA ops stay opaque,
    Inductor compiles the rest (attention, embedding); the loss and every gradient pass the suite's rule against the
    unpatched model in float64, as the eager patched model's do."""
    torch._dynamo.reset()
    ref, model = bf16_pair("llama-3.2-1b")
    ref64 = copy.deepcopy(ref).double()
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, ref.config.vocab_size, (2, 1024), generator=g, device="cuda")
    labels = torch.where(torch.rand(ids.shape, generator=g, device="cuda") < 0.1, -100, ids)
    loss64, grads64, _ = loss_and_grads(ref64, input_ids=ids, labels=labels)
    del ref64
    loss16, grads16, _ = loss_and_grads(ref, input_ids=ids, labels=labels)
    apply_coda(model)
    loss_and_grads(model, input_ids=ids, labels=labels)  # the first step: packs the weights, chooses each path
    with launches() as eager:
        loss_and_grads(model, input_ids=ids, labels=labels)
    step = torch.compile(model, fullgraph=True)
    loss_and_grads(step, input_ids=ids, labels=labels)  # compiles
    with launches() as names:
        loss, _, out = loss_and_grads(step, input_ids=ids, labels=labels)
    grads = {n: p.grad for n, p in model.named_parameters()}
    bad = [(n, rel_err(o, r), rel_err(t, r)) for n, o, t, r in [("loss", loss, loss16, loss64)]
           + [(n, grads[n], grads16[n], grads64[n]) for n in grads64] if not passes(rel_err(o, r), rel_err(t, r),
                                                                                    torch.bfloat16)]
    assert not bad, bad
    # the CODA LM head + cross-entropy ran, by the path this GPU's strategy takes (fused or split)
    assert out.logits is None and {"gemm_cross_entropy_kernel", "ce_split_rows_kernel"} & set(names)
    assert sorted(names) == sorted(eager)  # the compiled step runs the eager patched step's kernels


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="CUDA graphs of the drop-in need a CUDA GPU")
def test_reduce_overhead_cuda_graphs_replay_the_patched_step_on_each_new_batch_gpu():
    """``torch.compile(model, mode="reduce-overhead")``: Inductor's CUDA graphs capture the patched step, CODA kernels
    included (the remedy for a small model whose eager step is host-bound: docs/hf.md). Recorded on one batch, a
    replay on another gives that batch's loss and gradients, passing the suite's rule against the unpatched model in
    float64 as the eager patched step's do."""
    torch._dynamo.reset()
    ref, model = bf16_pair("llama-3.2-1b")
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, ref.config.vocab_size, (2, 512), generator=g, device="cuda")
        batches.append({"input_ids": ids,
                        "labels": torch.where(torch.rand(ids.shape, generator=g, device="cuda") < 0.1, -100, ids)})
    ref64 = copy.deepcopy(ref).double()
    loss64, grads64, _ = loss_and_grads(ref64, **batches[1])
    del ref64
    loss16, grads16, _ = loss_and_grads(ref, **batches[1])
    apply_coda(model)
    loss_and_grads(model, **batches[0])  # the first step: packs the weights, chooses each path
    step = torch.compile(model, mode="reduce-overhead")
    for _ in range(3):  # a warm-up run, the recording, a replay
        torch.compiler.cudagraph_mark_step_begin()
        loss_and_grads(step, **batches[0])
    torch.compiler.cudagraph_mark_step_begin()
    loss, _, out = loss_and_grads(step, **batches[1])
    grads = {n: p.grad for n, p in model.named_parameters()}  # the compiled module's names carry a prefix
    assert out.logits is None
    bad = [(n, rel_err(o, r), rel_err(t, r)) for n, o, t, r in [("loss", loss, loss16, loss64)]
           + [(n, grads[n], grads16[n], grads64[n]) for n in grads64] if not passes(rel_err(o, r), rel_err(t, r),
                                                                                    torch.bfloat16)]
    assert not bad, bad


def near_tie(bf16: torch.Tensor, fp32: torch.Tensor) -> float:
    """The gap between two logits that bf16 rounding can reverse: 3 standard deviations of the difference of two
    logits, each off by the unpatched bf16 model's own error against fp32 (its RMS over ``bf16``'s logits)."""
    sigma = float((bf16.float() - fp32.float()).pow(2).mean().sqrt())
    return 3 * 2**0.5 * sigma


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="bf16 generate() at a real shape needs a CUDA GPU")
def test_generate_64_greedy_tokens_bf16_follow_the_unpatched_model_gpu():
    """generate() with the KV cache in bf16 at llama-3-8b's layer shape, left padding, 64 greedy tokens: the prefill
    logits pass the suite's rule against the unpatched model in fp32 (as its bf16 logits do), and each row's tokens
    equal Hugging Face's up to a step where Hugging Face's own two best logits are closer than its bf16 rounding
    reaches (:func:`near_tie`, measured on the prefill); random weights have such steps, trained ones rarely. At
    least 32 of the 4 x 64 tokens are compared."""
    ref, model = bf16_pair("llama-3-8b", initializer_range=0.05)
    ref32 = copy.deepcopy(ref).float().eval()
    apply_coda(model.eval())
    ref.eval()
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, ref.config.vocab_size, (4, 256), generator=g, device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    mask[3, :100] = 0
    with torch.no_grad():
        logits = [m(ids, attention_mask=mask).logits[:, -1].float() for m in (model, ref, ref32)]
        del ref32
        tie = near_tie(logits[1], logits[2])
        for row in range(4):
            err, torch_err = rel_err(logits[0][row], logits[2][row]), rel_err(logits[1][row], logits[2][row])
            assert passes(err, torch_err, torch.bfloat16), (row, err, torch_err)
        args = {"attention_mask": mask, "max_new_tokens": 64, "do_sample": False, "pad_token_id": 0}
        with launches() as names:
            ours = model.generate(ids, **args)
        theirs = ref.generate(ids, **args, output_logits=True, return_dict_in_generate=True)
    assert {"gemm_rope_kernel", "gemm_rope_rows_kernel"} & set(names) and ours.shape == theirs.sequences.shape == (4, 256 + 64)
    compared = 0
    for row in range(4):
        differ = (ours[row, 256:] != theirs.sequences[row, 256:]).nonzero()
        step = int(differ[0]) if len(differ) else 64
        compared += step
        if step < 64:
            gap = theirs.logits[step][row].float().topk(2).values
            assert float(gap[0] - gap[1]) < tie, (row, step, float(gap[0] - gap[1]), tie)
    assert compared >= 32, compared


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="host synchronizations are a CUDA matter")
def test_a_training_step_does_not_synchronize_the_host_gpu():
    """Forward with labels and backward, warm, under torch's sync debug mode "error": no call waits for the GPU (the
    mask builder gets no arange position_ids to search for packed sequences; the CE scale stays on the device)."""
    config = transformers.LlamaConfig(vocab_size=128256, num_hidden_layers=1, rms_norm_eps=1e-5,
                                      **GPU_SHAPES["llama-3.2-1b"])
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = apply_coda(transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16))
    ids = torch.randint(0, config.vocab_size, (2, 512), device="cuda")
    loss_and_grads(model, input_ids=ids, labels=ids)  # compiles, measures strategies (those synchronize)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_and_grads(model, input_ids=ids, labels=ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_transformers_version_outside_the_followed_range_is_refused_in_one_line(monkeypatch):
    """apply_coda reproduces the model classes' forward of one transformers major version: another version (the
    GPU image's 4.x raised a TypeError deep in a forward) is refused at once, naming the range, which is
    pyproject's [hf] extra."""
    import sys
    import tomllib
    from pathlib import Path

    from kernels.coda.hf import TRANSFORMERS_RANGE

    lo, hi = TRANSFORMERS_RANGE
    extra = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert f"transformers>={lo},<{hi}" in extra["optional-dependencies"]["hf"]
    model = tiny()
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")  # the module imported now
    with pytest.raises(CodaUnsupportedError, match=rf"transformers 4.57.1 is not supported .*>={lo},<{hi}"):
        apply_coda(model)
    assert getattr(model, "_coda_plan", None) is None
