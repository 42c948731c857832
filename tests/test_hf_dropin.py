"""``apply_coda`` as a drop-in: calls where the patched model must do what the unpatched one does (kernels.coda.hf).

Each test compares the patched model with an unpatched copy on the CPU (tiny fp32 models of ``test_hf``, the Triton
kernels in the interpreter): the config defaults transformers resolves per call (``use_cache``, gradient
checkpointing, ``num_hidden_layers``), the errors it raises for bad labels, hooks on the modules the CODA forward
bypasses, the values it reads from the modules at every call (RoPE frequencies, RMSNorm epsilons), dtypes (autocast,
float64 weights, the embeddings', bf16 under the interpreter, float16), double backward, pickling the patched model,
call shapes (position_ids, input_ids), call options that run the model's own forward, an LM head of another width
than config.vocab_size, cache_position, logits_to_keep tensors, num_items_in_batch=0, generate() without the cache,
FSDP2 on one rank, and (slow) DDP and FSDP2 on two.
"""
from __future__ import annotations

import copy
import inspect
import io
import os
import warnings

import pytest
import torch

from kernels.coda.hf import CodaUnsupportedError, apply_coda, apply_coda_to_llama, apply_coda_to_mistral

from kernel_helpers import launches
from test_hf import BATCH, SEQ, VOCAB, assert_close_to, assert_passes, batch, tiny, trainable_grads

transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")


def pair(arch: str = "llama", **overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(patched, unpatched) copies of one tiny model (Llama unless ``arch`` says)."""
    ref = tiny(arch, **overrides)
    return apply_coda(copy.deepcopy(ref)), ref


def assert_same_step(model: torch.nn.Module, ref: torch.nn.Module, **inputs) -> None:
    """The loss and every trainable gradient of ``model`` are ``ref``'s; the CODA forward ran."""
    torch.manual_seed(0)
    with launches() as names:
        loss, grads = trainable_grads(model, **inputs)
    assert "gemm_cross_entropy_kernel" in names
    torch.manual_seed(0)
    ref_loss, ref_grads = trainable_grads(ref, **inputs)
    assert_close_to("loss", loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert (grads[name] is None) == (g is None), name
        if g is not None:
            assert_close_to(name, grads[name], g, 1e-4)


def test_packed_sequences_under_checkpointing_in_training_get_per_sequence_masks():
    """Gradient checkpointing in training turns the config's use_cache=True off in the unpatched model
    (``merge_with_config_defaults``), so its mask builder finds the packed sequences: each attends to itself."""
    model, ref = pair()
    for m in (model, ref):
        m.train().gradient_checkpointing_enable()
    ids, _, labels = batch()
    pos = torch.cat([torch.arange(10), torch.arange(SEQ - 10)])[None].expand(ids.shape[0], SEQ)
    assert_same_step(model, ref, input_ids=ids, position_ids=pos, labels=labels)


def test_eval_with_the_configs_use_cache_returns_the_cache_a_decode_loop_continues_from():
    """In eval, without use_cache in the call (the config's True), the unpatched model returns a filled cache;
    the patched one returns the same keys and values, and the next step decoded from it gives the same logits."""
    model, ref = pair()
    model.eval(), ref.eval()
    ids, _, _ = batch()
    with torch.no_grad():
        with launches() as names:
            ours = model(ids)
        theirs = ref(ids)
        assert "gemm_rope_kernel" in names and type(ours.cache) is type(theirs.cache)
        for a, b in zip(ours.cache.layers, theirs.cache.layers, strict=True):
            assert_close_to("cached keys", a.keys, b.keys)
            assert_close_to("cached values", a.values, b.values)
        step = ours.logits[:, -1:].argmax(-1)
        assert_close_to("decoded logits", model(step, cache=ours.cache).logits, ref(step, cache=theirs.cache).logits)


def test_a_training_step_with_the_configs_use_cache_runs_coda_and_returns_the_cache():
    """In training without checkpointing the config's use_cache=True holds: the unpatched model returns a cache
    filled with the step's keys and values; so does the patched one, from the CODA forward."""
    model, ref = pair()
    ids, mask, labels = batch()
    assert_same_step(model, ref, input_ids=ids, attention_mask=mask, labels=labels)
    with torch.no_grad():
        ours, theirs = model(ids, labels=labels).cache, ref(ids, labels=labels).cache
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        assert_close_to("cached keys", a.keys, b.keys)


@pytest.mark.parametrize("labels, shift_labels", [
    (lambda ids: ids[:, :-1], None),  # one short: the loss read past the targets
    (lambda ids: torch.cat([ids, ids[:, :3]], 1), None),
    (lambda ids: ids[:, -1:], None),
    (lambda ids: ids, lambda ids: torch.cat([ids, ids], 1)[:, 1:SEQ + 1]),  # the right numel, not contiguous
    (lambda ids: ids, lambda ids: ids[:, 1:].contiguous()),
    (lambda ids: ids.float(), None),
    (lambda ids: ids.int(), None),
])
def test_labels_of_another_shape_or_dtype_raise_as_the_unpatched_model(labels, shift_labels):
    model, ref = pair()
    ids, _, _ = batch()
    call = {"labels": labels(ids)} | ({} if shift_labels is None else {"shift_labels": shift_labels(ids)})
    errors = []
    for m in (ref, model):
        with pytest.raises((ValueError, RuntimeError)) as err:
            m(ids, **call)
        errors.append(err.value)
    assert type(errors[1]) is type(errors[0]) and "\n" not in str(errors[1])
    if isinstance(errors[0], ValueError):
        assert str(errors[1]) == str(errors[0])  # "Expected input batch_size (48) to match target batch_size (46)."


def test_flat_labels_and_logits_to_keep_with_labels():
    """Flat [B * S] labels: Hugging Face shifts them across the rows, and so does the patched model. logits_to_keep
    with labels (Hugging Face's loss then covers the kept positions only) runs the model's own forward, with a
    warning: labels cut to the kept positions give its loss, uncut ones its ValueError."""
    model, ref = pair()
    ids, _, labels = batch()
    with torch.no_grad():
        assert_close_to("loss", model(ids, labels=labels.reshape(-1)).loss, ref(ids, labels=labels.reshape(-1)).loss)
    assert_own_forward(model, ref, "logits_to_keep=4 with labels", input_ids=ids, labels=labels[:, -4:],
                       logits_to_keep=4)
    errors = []
    for m in (ref, model):
        with pytest.raises(ValueError) as err, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m(ids, labels=labels, logits_to_keep=4)
        errors.append(str(err.value))
    assert errors[0] == errors[1]


def test_config_num_hidden_layers_below_the_layers_runs_only_the_first():
    """``config.num_hidden_layers`` smaller than ``len(model.model.layers)``: the unpatched decoder runs
    ``layers[:num_hidden_layers]``; so does the patched one (the last layer gets no gradient in either)."""
    model, ref = pair(num_hidden_layers=3)
    model.config.num_hidden_layers = ref.config.num_hidden_layers = 2
    ids, mask, labels = batch()
    assert_same_step(model, ref, input_ids=ids, attention_mask=mask, labels=labels)
    assert model.model.layers[2].mlp.down_proj.weight.grad is None


def test_hooks_on_bypassed_modules_run_the_models_own_forward():
    """A forward hook that changes an MLP's output, a pre-hook on a projection, a global module hook: the call runs
    the model's own forward (with a warning naming the module), so the hooks run and the loss is the unpatched
    model's. An embedding hook, which the CODA forward calls, and transformers' own output-capturing hooks (inert
    unless output_hidden_states is asked for) leave the CODA forward on."""
    model, ref = pair()
    ids, _, labels = batch()
    calls = {"ours": 0, "theirs": 0}
    for name, m in (("ours", model), ("theirs", ref)):
        m.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: out * 0.5)
        m.model.layers[1].self_attn.q_proj.register_forward_pre_hook(
            lambda mod, args, name=name: calls.__setitem__(name, calls[name] + 1))
    with torch.no_grad():
        with pytest.warns(UserWarning, match="model.layers.0.mlp has a hook"), launches() as names:
            loss = model(ids, labels=labels).loss
        assert_close_to("loss", loss, ref(ids, labels=labels).loss)
        assert calls == {"ours": 1, "theirs": 1} and "gemm_cross_entropy_kernel" not in names

        model, ref = pair()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
        try:
            with pytest.warns(UserWarning, match="a global module hook"), launches() as names:
                model(ids, labels=labels)
        finally:
            handle.remove()
        assert "gemm_cross_entropy_kernel" not in names

        type(model).forward(model, ids, output_hidden_states=True)  # installs transformers' capturing hooks
        model.model.embed_tokens.register_forward_hook(lambda mod, args, out: out * 2)
        ref.model.embed_tokens.register_forward_hook(lambda mod, args, out: out * 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with launches() as names:
                loss = model(ids, labels=labels).loss
        assert "gemm_cross_entropy_kernel" in names
        assert_close_to("loss", loss, ref(ids, labels=labels).loss)


def test_rope_frequencies_and_norm_epsilons_are_read_from_the_modules():
    """``rotary_emb.inv_freq`` changed in place after apply_coda, and RMSNorm epsilons other than the config's
    (all of them; then the post-attention norms' alone, which splits each fused block in two): the loss and
    gradients follow the modules, as the unpatched model's do."""
    model, ref = pair()
    ids, mask, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    for m in (model, ref):
        m.model.rotary_emb.inv_freq.mul_(0.5)
    assert_same_step(model, ref, **inputs)
    for m in (model, ref):
        for name, norm in m.named_modules():
            if hasattr(norm, "variance_epsilon"):
                norm.variance_epsilon = 0.5 if "post_attention" in name else 0.25
    assert_same_step(model, ref, **inputs)


def assert_own_forward(model: torch.nn.Module, ref: torch.nn.Module, warning: str, **call) -> None:
    """``model(**call)`` runs the model's own forward (a warning matching ``warning``, no CODA kernel): its outputs
    and every gradient of its loss are ``ref``'s, exactly."""
    with pytest.warns(UserWarning, match=warning), launches() as names:
        ours = model(**call)
    assert not names
    theirs = ref(**call)
    ours, theirs = (o.to_tuple() if hasattr(o, "to_tuple") else o for o in (ours, theirs))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        if isinstance(b, tuple):  # hidden states, attentions
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        elif isinstance(b, torch.Tensor):
            assert torch.equal(a, b)
    ours[0].backward(), theirs[0].backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_to_another_dtype_than_the_weights_runs_the_models_own_forward(dtype):
    """Mixed precision over float32 weights (the Trainer's ``bf16=True`` / ``fp16=True``): the CODA kernels compute
    in the weights' dtype, so the call runs the model's own forward under the autocast, with a warning: the unpatched
    loss and gradients."""
    model, ref = pair()
    ids, mask, labels = batch()
    with torch.autocast("cpu", dtype=dtype):
        assert_own_forward(model, ref, f"torch.autocast to {dtype}", input_ids=ids, attention_mask=mask, labels=labels)


def test_a_config_default_the_coda_forward_does_not_compute_runs_the_models_own_forward():
    model, ref = pair(output_hidden_states=True)
    ids, _, labels = batch()
    assert_own_forward(model, ref, r"output_hidden_states=True \(the config's\)", input_ids=ids, labels=labels)


@pytest.mark.parametrize("attn, call", [
    ("sdpa", {"output_hidden_states": True}),
    ("eager", {"output_attentions": True}),
    ("sdpa", {"ignore_index": 7}),  # a keyword Hugging Face's loss takes
])
def test_call_options_the_coda_forward_does_not_compute_run_the_models_own_forward(attn, call):
    """Hidden states, attentions, a loss option: the call runs the model's own forward, with a warning naming the
    option; its outputs and gradients are the unpatched model's."""
    model, ref = pair(attn_implementation=attn)
    ids, mask, labels = batch()
    name, value = next(iter(call.items()))
    assert_own_forward(model, ref, f"the option {name}={value}", input_ids=ids, attention_mask=mask,
                       labels=torch.where(labels == -100, 7, labels), use_cache=False, **call)


def test_the_architecture_aliases_take_a_peft_model_as_apply_coda_does():
    """``apply_coda_to_llama(peft_model)`` checks the causal LM inside, which ``apply_coda`` patches."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert apply_coda_to_llama(model) is model and model.get_base_model()._coda_plan is not None
    with pytest.raises(CodaUnsupportedError, match="expected a MistralForCausalLM, got LlamaForCausalLM"):
        apply_coda_to_mistral(model)


def test_torch_save_and_load_of_a_patched_model():
    """``torch.save(model)`` pickles the patched model (its plan without weak references); the loaded model plans
    again at its first forward and gives the same loss on the CODA kernels."""
    model = apply_coda(tiny())
    ids, mask, labels = batch()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        with launches() as names:
            loss = loaded(ids, attention_mask=mask, labels=labels).loss
        assert torch.equal(loss, model(ids, attention_mask=mask, labels=labels).loss)
    assert "gemm_cross_entropy_kernel" in names and len(loaded._coda_plan.watched) > 0


def test_float64_weights_run_the_models_own_forward():
    """The CODA kernels accumulate in float32: on a model cast to float64 after apply_coda a call runs the model's
    own forward (with a warning), so its logits are the unpatched float64 model's, not float32-accurate ones."""
    model, ref = pair()
    model.double(), ref.double()
    ids, mask, _ = batch()
    with torch.no_grad(), pytest.warns(UserWarning, match="torch.float64 weights"), launches() as names:
        logits = model(ids, attention_mask=mask).logits
    assert not names and torch.equal(logits, ref(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_embeddings_of_another_dtype_than_the_weights_are_refused_in_one_line(dtype):
    """float16 embeddings into float32 weights: the unpatched model rounds its first norm's output to float16;
    float64 ones: it raises. The patched model refuses both, saying to cast them."""
    model = apply_coda(tiny())
    ids, _, labels = batch()
    with torch.no_grad(), pytest.raises(CodaUnsupportedError, match=f"{dtype} embeddings over torch.float32") as err:
        model(inputs_embeds=model.model.embed_tokens(ids).to(dtype), labels=labels)
    assert "\n" not in str(err.value) and "cast inputs_embeds" in str(err.value)


def test_another_peft_method_is_refused_naming_its_class():
    """IA3's layer class is also called ``Linear``: the message names its module."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny(), peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                       feedforward_modules=["down_proj"]))
    with pytest.raises(CodaUnsupportedError, match="k_proj is a Linear: .* not peft.tuners.ia3.layer.Linear") as err:
        apply_coda(model)
    assert "\n" not in str(err.value)


def test_a_backward_with_create_graph_is_refused_in_one_line():
    """A gradient penalty: the unpatched model (eager attention) differentiates its gradient; the CODA kernels'
    gradients are constants, so ``loss + |dL/dx|^2`` would silently lose the penalty's gradients. The backward with
    ``create_graph=True`` raises instead; a plain backward and an in-place change of the logits are unaffected."""
    model, ref = pair(attn_implementation="eager")
    ids, mask, labels = batch()
    for m in (ref, model):
        embeds = m.model.embed_tokens(ids).detach().requires_grad_()
        loss = m(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
        if m is ref:
            torch.autograd.grad(loss, embeds, create_graph=True)[0].pow(2).sum().backward()
            assert ref.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
            continue
        with pytest.raises(CodaUnsupportedError, match="create_graph=True") as err:
            torch.autograd.grad(loss, embeds, create_graph=True)
        assert "\n" not in str(err.value)
    logits = model(ids, attention_mask=mask).logits
    logits.mul_(0.5).logsumexp(-1).sum().backward()
    assert model.lm_head.weight.grad is not None


def test_a_bypassed_modules_forward_replaced_runs_the_models_own_forward(monkeypatch):
    """``mlp.forward`` set on a module, and ``LlamaAttention.forward`` monkeypatched on the class (after apply_coda
    or before it): the CODA forward computes those modules without calling them, so the call runs the model's own
    forward, with a warning, and the loss is the patched modules'."""
    from transformers.models.llama import modeling_llama

    model, ref = pair()
    ids, mask, labels = batch()
    for m in (model, ref):
        m.model.layers[1].mlp.forward = lambda x, mlp=m.model.layers[1].mlp: 0.5 * type(mlp).forward(mlp, x)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="model.layers.1.mlp has a forward other than its class's own"), \
                launches() as names:
            loss = model(ids, attention_mask=mask, labels=labels).loss
        assert not names
        assert_close_to("loss", loss, ref(ids, attention_mask=mask, labels=labels).loss)

        stock = modeling_llama.LlamaAttention.forward

        def halved(self, *args, **kwargs):
            out, weights = stock(self, *args, **kwargs)
            return 0.5 * out, weights

        for patch_first in (False, True):
            model, ref = tiny(), tiny()
            if not patch_first:
                apply_coda(model)
            monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", halved)
            apply_coda(model)
            with pytest.warns(UserWarning, match="self_attn has a forward other than its class's own"):
                loss = model(ids, labels=labels).loss
            assert_close_to("loss", loss, ref(ids, labels=labels).loss)
            monkeypatch.undo()


@pytest.mark.parametrize("name, message", [
    ("model.layers.0.mlp.act_fn", "model.layers.0.mlp.act_fn is a GELU"),
    ("model.layers.1.self_attn", "model.layers.1.self_attn is a test_hf_dropin.SinkAttention, not a LlamaAttention"),
])
def test_a_replaced_activation_or_attention_is_refused_naming_it(name, message):
    """An MLP's ``act_fn`` or an attention module replaced after apply_coda (a subclass with its own forward): the
    CODA forward would compute silu / the model's attention without calling them, so the next call is refused."""
    model = apply_coda(tiny())
    ids, _, labels = batch()
    owner, _, attr = name.rpartition(".")
    replaced = torch.nn.GELU() if attr == "act_fn" else copy.deepcopy(model.get_submodule(name))
    if attr == "self_attn":
        replaced.__class__ = SinkAttention
    setattr(model.get_submodule(owner), attr, replaced)
    with torch.no_grad(), pytest.raises(CodaUnsupportedError, match=message) as err:
        model(ids, labels=labels)
    assert "\n" not in str(err.value)


class SinkAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """An attention of another forward (as attention-sink or long-context libraries write them)."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return 0.5 * out, weights


def test_return_dict_false_gives_the_unpatched_tuple():
    """``return_dict=False`` in the call: without labels the unpatched model's tuple, (logits,) or (logits, cache),
    from the CODA forward; with labels, whose tuple holds the logits the fused loss never writes, from the model's
    own forward, with a warning."""
    model, ref = pair()
    ids, mask, labels = batch()
    with torch.no_grad():
        for call in ({"use_cache": False}, {}):
            ours, theirs = model(ids, attention_mask=mask, return_dict=False, **call), \
                ref(ids, attention_mask=mask, return_dict=False, **call)
            assert type(ours) is tuple and len(ours) == len(theirs) == (1 if call else 2)
            assert_close_to("logits", ours[0], theirs[0])
    assert_own_forward(model, ref, "return_dict=False with labels", input_ids=ids, labels=labels, return_dict=False,
                       use_cache=False)


def test_qwen2_generate_with_a_static_cache_reads_the_masks_built_ahead():
    """Qwen2's ``generate(cache_implementation="static")`` builds its masks ahead and passes them as a dict by layer
    type (``attention_mask={"full_attention": ..., "sliding_attention": ...}``): the prefill on the CODA kernels
    reads them as the unpatched model does, and the greedy tokens are its."""
    ref = tiny("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model = apply_coda(copy.deepcopy(ref))
    model.eval(), ref.eval()
    ids, mask, _ = batch()
    args = {"attention_mask": mask[:, :12], "max_new_tokens": 4, "do_sample": False, "cache_implementation": "static"}
    with torch.no_grad():
        with launches() as names:
            ours = model.generate(ids[:, :12], **args)
        assert "gemm_rope_kernel" in names
        assert torch.equal(ours, ref.generate(ids[:, :12], **args))


@pytest.mark.parametrize("tie", [False, True])
def test_peft_modules_to_save_on_the_lm_head_and_a_projection(tie):
    """LoRA with ``modules_to_save=["lm_head", "embed_tokens", "o_proj"]`` (the recipe for added tokens): the CODA
    forward uses the active adapter's copies (trained away from the originals here), and the originals inside
    ``disable_adapter()``, as PEFT's wrapper does: the loss and every trainable gradient are unpatched PEFT's."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, init_lora_weights=False, target_modules=["q_proj", "v_proj", "down_proj"],
                             modules_to_save=["lm_head", "embed_tokens", "o_proj"])
    torch.manual_seed(3)
    ref = peft.get_peft_model(tiny(tie_word_embeddings=tie), config)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.05 * torch.randn_like(p))
    model = apply_coda(copy.deepcopy(ref))
    ids, mask, labels = batch()
    assert_same_step(model, ref, input_ids=ids, attention_mask=mask, labels=labels)
    with torch.no_grad(), model.disable_adapter(), ref.disable_adapter():
        with launches() as names:
            loss = model(input_ids=ids, labels=labels).loss
        assert "gemm_cross_entropy_kernel" in names
        assert_close_to("loss", loss, ref(input_ids=ids, labels=labels).loss)


# ---- call shapes, vocabulary widths, options transformers ignores, dtypes the interpreter cannot compute ----------

def test_position_ids_or_input_ids_of_another_shape_run_the_models_own_forward():
    """The model's RoPE broadcasts the cos/sin of ``position_ids`` against [batch, heads, seq, head_dim]: a 1-D [seq]
    one raises there (24 positions against 4 heads), or, where seq is the number of heads and of kv heads, gives head
    h position h. 1-D input_ids raise there too. The patched call runs the model's own forward, with a warning: the
    same error, the same loss. [batch, 1] positions (one per row) are read per token by both, on the CODA kernels."""
    model, ref = pair()
    ids, _, labels = batch()
    for call in ({"input_ids": ids, "position_ids": torch.arange(SEQ)}, {"input_ids": ids[0], "labels": labels[0]}):
        with torch.no_grad(), pytest.raises(RuntimeError) as theirs:
            ref(**call)
        with torch.no_grad(), pytest.warns(UserWarning, match=r"of shape \[24\]"), pytest.raises(RuntimeError) as ours:
            model(**call)
        assert str(ours.value) == str(theirs.value)
    model, ref = pair(num_key_value_heads=4)
    call = {"input_ids": ids[:, :4], "position_ids": torch.arange(4), "labels": labels[:, :4]}
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"position_ids of shape \[4\]"), launches() as names:
            loss = model(**call).loss
        assert not names and torch.equal(loss, ref(**call).loss)
    assert_same_step(model, ref, input_ids=ids, position_ids=torch.tensor([[3], [5]]), labels=labels)


@pytest.mark.parametrize("change, error", [
    (lambda m: setattr(m, "lm_head", torch.nn.Linear(64, m.config.vocab_size + 7, bias=False)),
     "shape '[-1, 256]' is invalid for input of size 12624"),
    (lambda m: setattr(m, "lm_head", torch.nn.Linear(64, 2 * m.config.vocab_size, bias=False)),
     "Expected input batch_size (96) to match target batch_size (48)."),
    (lambda m: setattr(m.config, "vocab_size", m.config.vocab_size + 4),
     "shape '[-1, 260]' is invalid for input of size 12288"),
], ids=["a wider head", "a head twice as wide", "the config changed"])
def test_an_lm_head_of_another_width_than_config_vocab_size_raises_with_labels_as_unpatched(change, error):
    """Hugging Face's loss views the logits as [-1, config.vocab_size]: an LM head replaced by a wider one, or a
    config changed without it, raises there (the view's RuntimeError, or where the size divides, the
    cross-entropy's ValueError on the rows it makes). The patched model raises the same; without labels both
    return the head's logits."""
    model, ref = pair(tie_word_embeddings=False)
    for m in (model, ref):
        torch.manual_seed(5)
        change(m)
    ids, mask, labels = batch()
    with torch.no_grad():
        for m in (ref, model):
            with pytest.raises((RuntimeError, ValueError)) as err:
                m(ids, attention_mask=mask, labels=labels)
            assert str(err.value) == error
        assert_close_to("logits", model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("tie", [False, True])
def test_resize_token_embeddings_matches_the_unpatched_model(tie):
    """``resize_token_embeddings`` updates config.vocab_size with the embedding and LM head (tied or not): the
    patched model, planned again, gives the unpatched loss and gradients, a target in the new rows included."""
    model, ref = pair(tie_word_embeddings=tie)
    for m in (model, ref):
        torch.manual_seed(5)
        m.resize_token_embeddings(VOCAB + 13)
    ids, mask, labels = batch()
    labels[0, 4] = VOCAB + 12
    assert_same_step(model, ref, input_ids=ids, attention_mask=mask, labels=labels)


def test_cache_position_is_ignored_as_the_unpatched_model_ignores_it():
    """transformers 5 reads no ``cache_position`` in these models (the caches count their own tokens): any value
    leaves the unpatched results alone. The patched model takes it too, on the CODA kernels, in a training step and
    in a prefill + decode loop over a static and a dynamic cache that passes it as older transformers did."""
    model, ref = pair()
    ids, mask, labels = batch()
    assert_same_step(model, ref, input_ids=ids, attention_mask=mask, labels=labels, cache_position=torch.arange(SEQ))
    model.eval(), ref.eval()
    for cache_cls in (transformers.StaticCache, transformers.DynamicCache):
        steps = []
        for m in (model, ref):
            size = {"max_cache_len": 20} if cache_cls is transformers.StaticCache else {}
            cache = cache_cls(config=m.config, **size)
            with torch.no_grad(), launches() as names:
                out = m(ids[:, :12], cache=cache, cache_position=torch.arange(12))
                logits = [out.logits[:, -1]]
                for t in range(12, 14):
                    out = m(out.logits[:, -1:].argmax(-1), cache=out.cache, cache_position=torch.tensor([t]))
                    logits.append(out.logits[:, -1])
            steps.append(torch.stack(logits))
            if m is model:
                assert names.count("gemm_rope_kernel") == 2  # the prefill's two layers
        assert_close_to(f"{cache_cls.__name__} logits", steps[0], steps[1])


@pytest.mark.parametrize("keep", [torch.tensor([0, 5, 7]), torch.tensor([[0, 5], [3, 9]]),
                                  torch.arange(SEQ)[None].expand(BATCH, SEQ) % 3 == 0],
                         ids=["positions", "positions by row", "a mask"])
def test_logits_to_keep_tensors_select_as_the_unpatched_model(keep):
    """``logits_to_keep`` as positions for every row (1-D), positions per row (2-D int: gathered) or a 2-D bool mask
    (the kept rows flattened): Hugging Face's ``slice_logits_to_keep``."""
    model, ref = pair()
    ids, mask, _ = batch()
    with torch.no_grad():
        ours, theirs = (m(ids, attention_mask=mask, logits_to_keep=keep).logits for m in (model, ref))
    assert ours.shape == theirs.shape
    assert_close_to("kept logits", ours, theirs)


def test_num_items_in_batch_zero_with_every_label_ignored_leaves_zero_gradients():
    """A batch whose labels are all -100 (a truncated prompt) with the Trainer's ``num_items_in_batch=0``: the
    unpatched loss is 0 / 0 = NaN, and its gradients are zeros (torch's cross-entropy gives ignored targets none),
    so an optimizer step moves nothing. The patched model's are zeros too, not NaN."""
    model, ref = pair()
    ids, mask, labels = batch()
    ignored = torch.full_like(labels, -100)
    for m in (model, ref):
        m(ids, attention_mask=mask, labels=ignored, num_items_in_batch=torch.tensor(0)).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad) and not p.grad.any(), name
    with torch.no_grad():
        assert model(ids, labels=ignored, num_items_in_batch=0).loss.isnan()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter's limit")
def test_bf16_weights_under_the_interpreter_run_the_models_own_forward():
    """The Triton interpreter has no bf16 math: the CODA kernels' results on bf16 weights there would be garbage
    (a loss of 5.5 for the unpatched 7.0). The call runs the model's own forward instead, with a warning."""
    model, ref = pair()
    model.bfloat16(), ref.bfloat16()
    ids, mask, labels = batch()
    with torch.no_grad():
        with pytest.warns(UserWarning, match="under the Triton interpreter"), launches() as names:
            loss = model(ids, attention_mask=mask, labels=labels).loss
        assert not names and torch.equal(loss, ref(ids, attention_mask=mask, labels=labels).loss)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_generate_without_the_cache_runs_every_step_on_coda(arch):
    """``generate(use_cache=False)``: each step is a forward over the whole sequence without a cache, which runs on
    the CODA kernels (left padding, Mistral's sliding window, Qwen2's biases); the greedy tokens are the unpatched
    model's."""
    model, ref = pair(arch)
    model.eval(), ref.eval()
    ids, mask, _ = batch()
    args = {"attention_mask": mask, "max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "use_cache": False}
    with torch.no_grad():
        with launches() as names:
            ours = model.generate(ids, **args)
        assert names.count("gemm_rope_kernel") == 3 * 2  # every step's two layers
        assert torch.equal(ours, ref.generate(ids, **args))


def test_a_float16_model_passes_the_suites_rule():
    """``model.half()`` on the CPU (the interpreter computes float16): the loss and every gradient pass the suite's
    rule against the unpatched model in float64, as the unpatched float16 model's error sets it."""
    ref = tiny(tie_word_embeddings=False)
    ids, mask, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    loss64, grads64 = trainable_grads(copy.deepcopy(ref).double(), **inputs)
    loss16, grads16 = trainable_grads(copy.deepcopy(ref).half(), **inputs)
    with launches() as names:
        loss, grads = trainable_grads(apply_coda(ref).half(), **inputs)
    assert "gemm_cross_entropy_kernel" in names
    assert_passes("loss", loss, loss16, loss64, torch.float16)
    for name, g in grads64.items():
        assert_passes(name, grads[name], grads16[name], g, torch.float16)


@pytest.fixture
def process_group(tmp_path):
    """A one-process gloo group (FSDP2 shards over one), destroyed after the test."""
    dist = pytest.importorskip("torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_step(model: torch.nn.Module, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and every gradient of a model wrapped by FSDP2 (its gradients are DTensors: gathered whole)."""
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_fsdp2_fully_shard_of_the_model_runs_coda_and_of_its_layers_the_models_own_forward(process_group):
    """FSDP2's ``fully_shard`` gives each module it wraps a class ``FSDP<cls>`` (bases ``(FSDPModule, cls)``) and
    hooks that gather its parameters before its forward. The model alone sharded, then patched: the model's own
    hooks gather every parameter before the CODA forward, which runs, with the unpatched loss and gradients. Its
    layers sharded too: their hooks would not run in the CODA forward, so the call runs the model's own forward,
    with a warning naming the layer."""
    from torch.distributed.fsdp import fully_shard

    ids, mask, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ref_loss, ref_grads = sharded_step(fully_shard(tiny()), **inputs)
    with launches() as names:
        loss, grads = sharded_step(apply_coda(fully_shard(tiny())), **inputs)
    assert "gemm_cross_entropy_kernel" in names
    assert_close_to("loss", loss, ref_loss)
    for name, g in ref_grads.items():
        assert_close_to(name, grads[name], g, 1e-4)
    model = tiny()
    for layer in model.model.layers:
        fully_shard(layer)
    apply_coda(fully_shard(model))
    with pytest.warns(UserWarning, match="model.layers.0 has a hook"):
        loss, grads = sharded_step(model, **inputs)
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor, or a DTensor (FSDP2's parameters and gradients) gathered whole, detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def data_parallel_rank(rank: int, store: str, out: str) -> None:
    """One of two ranks (gloo): unpatched DDP, patched DDP and patched FSDP2 (``fully_shard`` of the model), each
    two AdamW steps on the rank's row of the batch. Rank 0 saves each one's gradients after the first backward
    (all-reduced) and parameters after the steps to ``out``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    ids, mask, labels = batch()
    rows = slice(rank, rank + 1)
    wraps = {"ddp": DistributedDataParallel, "coda ddp": lambda m: DistributedDataParallel(apply_coda(m)),
             "coda fsdp2": lambda m: apply_coda(fully_shard(m))}
    results = {}
    for name, wrap in wraps.items():
        model = wrap(tiny())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows], use_cache=False).loss.backward()
            if step == 0:
                grads = {n.removeprefix("module."): whole(p.grad) for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        results[name] = grads, {n.removeprefix("module."): whole(p) for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_and_fsdp2_on_two_ranks_match_unpatched_ddp(tmp_path):
    """Two processes, a row of the batch each: the patched model under DDP and under FSDP2 (the model sharded as a
    whole) gets unpatched DDP's all-reduced gradients, and its parameters after two AdamW steps."""
    out = tmp_path / "results.pt"
    torch.multiprocessing.spawn(data_parallel_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    results = torch.load(out)
    ref_grads, ref_params = results.pop("ddp")
    for name, (grads, params) in results.items():
        assert grads.keys() == ref_grads.keys() and params.keys() == ref_params.keys()
        for n, g in ref_grads.items():
            assert_close_to(f"{name}: {n}", grads[n], g, 1e-4)
        for n, p in ref_params.items():
            assert_close_to(f"{name}: {n}", params[n], p, 1e-4)


def test_positional_arguments_mean_what_they_mean_unpatched():
    """The model's forward takes (input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, use_cache,
    logits_to_keep): a call that gives them by position gets the unpatched loss, logits and cache, on the CODA kernels
    where it computes them; one position too many raises the unpatched model's TypeError."""
    from transformers import DynamicCache

    model, ref = pair()
    ids, _, labels = batch()
    mask = torch.ones_like(ids)
    with launches() as names:
        loss = model(ids, mask, None, None, None, labels).loss
    assert "gemm_cross_entropy_kernel" in names
    assert_close_to("loss", loss, ref(ids, mask, None, None, None, labels).loss)
    with torch.no_grad():
        ours, theirs = model(ids, mask, None, None, None, None, False, 2), ref(ids, mask, None, None, None, None, False, 2)
        assert ours.logits.shape == theirs.logits.shape == (ids.shape[0], 2, VOCAB) and ours.cache is None
        assert_close_to("kept logits", ours.logits, theirs.logits)
        ours = model(ids, mask, None, DynamicCache(config=model.config))
        theirs = ref(ids, mask, None, DynamicCache(config=ref.config))
        assert ours.cache.get_seq_length() == theirs.cache.get_seq_length() == ids.shape[1]
        assert_close_to("logits", ours.logits, theirs.logits)
    with pytest.raises(TypeError):
        ref(ids, mask, None, None, None, None, False, 0, "extra")
    with pytest.raises(TypeError):
        model(ids, mask, None, None, None, None, False, 0, "extra")
    assert list(inspect.signature(model.forward).parameters)[:8] == list(inspect.signature(ref.forward).parameters)[:8]


def test_torch_func_transforms_run_the_models_own_forward():
    """grad over functional_call and vmap: the CODA kernels' autograd Functions and raw pointers do not support them,
    so the call runs the model's own forward, with a warning, and gives the unpatched results."""
    model, ref = pair()
    ids, _, labels = batch()

    def loss(params, m):
        return torch.func.functional_call(m, params, (), {"input_ids": ids, "labels": labels}).loss

    with pytest.warns(UserWarning, match="torch.func transform"):
        ours = torch.func.grad(loss)({n: p.detach() for n, p in model.named_parameters()}, model)
    theirs = torch.func.grad(loss)({n: p.detach() for n, p in ref.named_parameters()}, ref)
    for name, g in theirs.items():
        assert_close_to(name, ours[name], g, 1e-5)
    with torch.no_grad(), pytest.warns(UserWarning, match="torch.func transform"):
        ours = torch.func.vmap(lambda x: model(input_ids=x[None]).logits[0])(ids)
    with torch.no_grad():
        assert_close_to("logits", ours, torch.func.vmap(lambda x: ref(input_ids=x[None]).logits[0])(ids))
