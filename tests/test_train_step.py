"""The ``train_step`` workload: its reference, its FLOPs, its Hugging Face implementations and its suite.

CPU: tiny shapes in fp32; the Triton kernels (CODA's, Liger's RoPE and fused linear cross-entropy) run in the
interpreter. GPU (only where CUDA is available): the train suite's cells at fewer tokens, every implementation ok and
passing the error rule.
"""
from __future__ import annotations

import importlib.util

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from codabench.case import Case
from codabench.cli import main, run_config, run_parser
from codabench.correctness import CHECK_SEED, build_reference, check_impl
from codabench.execute import differentiable_keys, fresh_leaves
from codabench.registry import prepared
from codabench.matrix import Selection
from codabench.results import load_run
from codabench.report import finalize
from codabench.report.training import train_step_table
from harness_helpers import isolated_registry, make_runner
from kernel_helpers import launches
from kernels import hf_train
from workloads.models import PRESETS, ModelShape, parse_model_spec
from workloads.op import InputMaker
from workloads.ops import OPS
from workloads.ops.train_step import batch_and_seq
from workloads.suites import get_suite

transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")

OP = OPS["train_step"]
CPU = torch.device("cpu")
# 3 layers, GQA, a RoPE theta that is not the default, 2 sequences of 20 tokens
SMALL = ModelShape("small", hidden=48, ffn=64, heads=4, kv_heads=2, head_dim=16, vocab=96, tokens=40, seq_len=20,
                   rope_theta=1000.0, layers=3)


def weights(inputs: dict[str, torch.Tensor]) -> list[str]:
    return OP.differentiable(inputs)


def reference_loss_and_grads(inputs: dict[str, torch.Tensor], shape: ModelShape):
    leaves = fresh_leaves(inputs, weights(inputs))
    loss = OP.reference(leaves, shape)["loss"]
    loss.backward()
    return loss.detach(), {k: leaves[k].grad for k in weights(inputs)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_inputs_are_a_hugging_face_llama_and_a_batch():
    inputs = OP.inputs(SMALL, "fp32", CPU, 0)
    names = {n for n, _ in transformers.LlamaForCausalLM(hf_train.llama_config(SMALL)).named_parameters()}
    assert set(weights(inputs)) == names  # every parameter of the untied 3-layer model, under its state-dict name
    assert inputs["input_ids"].shape == inputs["labels"].shape == (2, 20)
    ignored = inputs["labels"] == -100
    assert ignored.any() and torch.equal(inputs["labels"][~ignored], inputs["input_ids"][~ignored])


def test_reference_is_transformers_llama_in_float64():
    """Loss and every gradient equal LlamaForCausalLM's with the same weights. Not to 1e-12: Hugging Face computes its
    RMSNorm, RoPE angles and loss in float32 even in a float64 model (``hidden_states.to(torch.float32)``,
    ``position_ids.float()``, ``logits.float()``), so agreement is at float32's roundoff; a wrong shift, RoPE
    layout, head grouping or theta is off by far more (checked below with the unshifted labels)."""
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in OP.inputs(SMALL, "fp32", CPU, 0).items()}
    model = transformers.LlamaForCausalLM(hf_train.llama_config(SMALL)).double()
    model.load_state_dict({k: inputs[k] for k in weights(inputs)})
    out = model(input_ids=inputs["input_ids"], labels=inputs["labels"])
    out.loss.backward()
    loss, grads = reference_loss_and_grads(inputs, SMALL)
    assert rel(out.loss.detach(), loss) < 1e-6
    for name, p in model.named_parameters():
        assert rel(p.grad, grads[name]) < 1e-5, name
    unshifted = F.pad(inputs["labels"][:, :-1], (1, 0), value=-100)  # its loss: targets[t] = labels[t], no shift
    assert rel(OP.reference({**inputs, "labels": unshifted}, SMALL)["loss"], out.loss.detach()) > 1e-2


@pytest.mark.parametrize("tokens,seq_len,expected", [(16384, 8192, (2, 8192)), (1024, 8192, (1, 1024)),
                                                     (48, 40, (2, 24)), (10001, 8192, (73, 137))])
def test_batch_and_seq(tokens, seq_len, expected):
    assert batch_and_seq(SMALL.with_(tokens=tokens, seq_len=seq_len)) == expected


def test_a_step_that_splits_only_into_rows_of_one_token_is_n_a(capsys, tmp_path):
    """1 token, or a prime count above seq_len, makes rows of 1 token, whose shifted labels are all ignored: the loss
    is undefined (NaN in every implementation), so the op's cells are n/a there, with the reason."""
    assert OP.na_reason(SMALL) is None
    for tokens in (1, 41):  # 41: a prime above SMALL's seq_len of 20
        assert "rows of 1 token, which have no next-token target" in OP.na_reason(SMALL.with_(tokens=tokens))
    with isolated_registry():
        assert main(["--suite", "train", "--model", "w:hidden=48,ffn=64,heads=4,vocab=96,seq_len=20", "--tokens", "41",
                     "--list", "--no-entry-points", "--out", str(tmp_path / "run")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train_step")]
    assert rows and all("n/a: a step of 41 token(s) splits into rows" in line for line in rows)


def test_the_first_target_is_never_ignored():
    """A mean loss over the targets has a term at any token count: the first of an op's targets, and the train step's
    first shifted label (its first row's second), are never the ignored -100 (5% of the others are)."""
    assert (InputMaker(torch.float32, CPU, 0).targets(64, 10, ignore_frac=1.0) != -100).tolist() == [True] + [False] * 63
    model = SMALL.with_(tokens=4, seq_len=2)
    assert all(OP.make_inputs(model, torch.float32, CPU, seed)["labels"][0, 1] != -100 for seed in range(200))


def test_flops_are_the_gemms_and_causal_attention():
    """torch's FLOP counter on the reference's forward + backward: its matmuls are the op's GEMMs, and its attention
    (SDPA's math backend: batched matmuls over every (query, key) pair) times the causal fraction (T + 1) / 2T is the
    op's attention count."""
    inputs = OP.inputs(SMALL, "fp32", CPU, 0)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        OP.reference(fresh_leaves(inputs, weights(inputs)), SMALL)["loss"].backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert set(counts) == {"aten.mm", "aten.bmm"}
    _, seq = batch_and_seq(SMALL)
    assert sum(g.flops for g in OP.gemms(SMALL, "fwd_bwd")) == counts["aten.mm"]
    assert OP.flops(SMALL, "fwd_bwd") == counts["aten.mm"] + counts["aten.bmm"] * (seq + 1) // (2 * seq)


def check(impl, shape: ModelShape = PRESETS["tiny"], checkpointing: bool = False):
    """The harness's correctness pass of one implementation (float64 reference, PyTorch's fp32 error, the rule)."""
    case = Case(OP, shape, "fwd_bwd", "fp32", CPU, OP.inputs(shape, "fp32", CPU, CHECK_SEED),
                checkpointing=checkpointing)
    outcome = check_impl(build_reference(OP, case), impl)
    assert outcome.correct, (outcome.errors, [(c.output, c.stats.rel_err, c.torch_rel_err) for c in outcome.checks])
    assert len(outcome.checks) == 1 + len(weights(case.inputs))  # the loss and every weight's gradient
    return outcome


def test_hf_eager_and_hf_coda_pass_the_error_rule():
    check(hf_train.HFTrainStep())
    with launches() as names:
        check(hf_train.HFCoda())
    assert {"gemm_rope_kernel", "gemm_residual_norm_kernel", "gemm_cross_entropy_kernel"} <= set(names)


def lora_grads(impl) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in impl._model.named_parameters() if "lora_" in n}


def test_hf_coda_lora_passes_the_error_rule_and_trains_the_adapters():
    """PEFT LoRA (B = 0 at the start, as PEFT initializes it) leaves the loss and the base weights' gradients the
    plain model's, which the harness checks; the adapters' B matrices get their gradients, through the merged
    weights of the fused kernels."""
    pytest.importorskip("peft")
    impl = hf_train.HFCodaLoRA()
    with launches() as names:
        check(impl)
    assert {"gemm_rope_kernel", "gemm_swiglu_kernel", "gemm_cross_entropy_kernel"} <= set(names)
    grads = lora_grads(impl)
    layers = PRESETS["tiny"].layers
    assert len(grads) == 2 * len(hf_train.LORA_TARGETS) * layers
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)


@pytest.mark.parametrize("name", ["hf-eager", "hf-coda"])
def test_checkpointing_reaches_the_model_and_passes_the_error_rule(name, tmp_path):
    """``--checkpointing`` sets the run's and so each Case's flag; the model then recomputes each checkpointed layer
    in backward (hf-coda: every layer's gate/up GEMM runs twice) and still passes the rule."""
    suite = get_suite("train")
    cfg = run_config(run_parser().parse_args(["--checkpointing"]), suite, Selection.from_suite(suite), CPU, tmp_path)
    assert cfg.checkpointing and not run_config(run_parser().parse_args([]), suite, Selection.from_suite(suite), CPU,
                                                tmp_path).checkpointing
    impl = {"hf-eager": hf_train.HFTrainStep, "hf-coda": hf_train.HFCoda}[name]()
    with launches() as names:
        check(impl, checkpointing=True)
    assert impl._model.is_activation_checkpointing
    if name == "hf-coda":
        layers = PRESETS["tiny"].layers
        assert names.count("gemm_swiglu_kernel") == 2 * layers


@pytest.mark.slow
def test_hf_compile_traces_once_per_shape(monkeypatch):
    """hf-compile through functional_call: new leaves each call reuse the graph, a new token count adds one. Inductor's
    code generation takes about 40 s per graph on 2 CPU cores, so the model is compiled with the aot_eager backend
    here (dynamo and AOTAutograd, forward and backward); the smoke suite runs the inductor cell."""
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="aot_eager", **kw))
    from torch._dynamo.utils import counters

    impl = hf_train.HFCompile()
    check(impl)

    def step(shape: ModelShape) -> int:
        """One call on new leaves and its backward; the number of graphs compiled so far."""
        inputs = OP.inputs(shape, "fp32", CPU, 5)
        native = prepared(impl, Case(OP, shape, "fwd_bwd", "fp32", CPU, inputs))
        keys = differentiable_keys(OP, impl, native)
        leaves = fresh_leaves(native, keys)
        impl.run(leaves)["loss"].backward()
        assert keys == weights(inputs) and all(leaves[k].grad is not None for k in keys)
        return counters["stats"]["unique_graphs"]

    tiny = PRESETS["tiny"]
    graphs = step(tiny)  # (the correctness call ran with deterministic algorithms on: a guard of its own)
    assert graphs >= 1 and step(tiny) == graphs and step(tiny.with_(tokens=80)) == graphs + 1


def test_hf_liger_runs_liger_and_leaves_transformers_unpatched(monkeypatch):
    """Liger's RoPE and fused linear cross-entropy kernels run for real in the interpreter; its RMSNorm and SwiGLU
    kernels cannot (a scalar ``.to()`` the interpreter lacks) and are torch stand-ins. Under checkpointing the
    recomputed layers run Liger's RoPE as their forward did (else torch's CheckpointError: the saved tensors
    differ). Afterwards the names Liger replaces in transformers' modeling_llama are the originals again, so a model
    built next is plain Hugging Face."""
    pytest.importorskip("liger_kernel")
    import liger_kernel.transformers.rms_norm as liger_rms_norm
    import liger_kernel.transformers.swiglu as liger_swiglu
    from transformers.models.llama import modeling_llama

    class RMSNorm:  # LigerRMSNormFunction's signature
        @staticmethod
        def apply(x, w, eps, offset, casting_mode, in_place, row_mode):
            return F.rms_norm(x, (x.shape[-1],), w, eps)

    monkeypatch.setattr(liger_rms_norm, "LigerRMSNormFunction", RMSNorm)
    monkeypatch.setattr(liger_swiglu, "_swiglu_dispatch", lambda a, b: F.silu(a) * b)
    before = {k: getattr(modeling_llama, k) for k in hf_train.LIGER_GLOBALS}
    with launches() as names:
        check(hf_train.HFLiger())
    assert {"_triton_rope", "liger_cross_entropy_kernel"} <= set(names), sorted(set(names))
    with launches() as recomputed:
        check(hf_train.HFLiger(), checkpointing=True)
    assert recomputed.count("_triton_rope") > names.count("_triton_rope")
    if importlib.util.find_spec("peft"):  # hf-liger-lora: Liger's model with PEFT's adapters, which get gradients
        lora = hf_train.HFLigerLoRA()
        check(lora)
        assert all(g is not None and g.abs().sum() > 0 for n, g in lora_grads(lora).items() if "lora_B" in n)
    assert {k: getattr(modeling_llama, k) for k in hf_train.LIGER_GLOBALS} == before
    model = hf_train.build_llama(PRESETS["tiny"], torch.float32, CPU)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm" and type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


@pytest.mark.slow
def test_cells_in_the_harness(tmp_path):
    """The worker's whole path (correctness, timing, the same-buffers / refilled / new-buffers checks) for hf-eager;
    hf-liger is a skipped row on the CPU, --layers reaches the model, hf-coda says which path each CODA kernel of
    its step took, and the training-step table reads the rows."""
    with isolated_registry():
        make_runner(tmp_path, ops=("train_step",), modes=("fwd_bwd",),
                    impls=("torch-eager", "hf-eager", "hf-liger", "hf-coda"), layers=1).run()
    df, errors, _ = load_run(tmp_path)
    rows = {r["impl"]: r for _, r in df.iterrows()}
    assert rows["hf-eager"]["status"] == "ok" and rows["hf-eager"]["correct"] is True, rows["hf-eager"]["message"]
    assert rows["hf-coda"]["correct"] is True, rows["hf-coda"]["message"]
    assert sorted(rows["hf-coda"]["strategy"].split()) == [  # fwd and bwd, fused on the CPU
        "cross_entropy:fused", "dgrad_rmsnorm:fused", "dgrad_swiglu:fused", "mm:fused", "residual_norm:fused",
        "rope:fused", "swiglu:fused"]
    assert pd.isna(rows["hf-eager"]["strategy"])
    assert rows["hf-liger"]["status"] == "skipped" and "CUDA" in rows["hf-liger"]["message"]
    errs = errors[errors["impl"] == "hf-eager"].set_index("output")["rel_err"]
    assert "grad_model.layers.0.self_attn.q_proj.weight" in errs and not any("layers.1." in g for g in errs.index)

    table = train_step_table(df, errors).set_index("impl")  # the training-step section's figures
    assert set(table.index) == {"torch-eager", "hf-eager", "hf-coda"}  # the ok cells
    eager = table.loc["hf-eager"]
    assert eager["tokens_per_s"] == pytest.approx(48 / rows["hf-eager"]["median_ms"] * 1e3)
    assert eager["vs_hf-eager"] == 1 and table.loc["torch-eager", "vs_hf-eager"] == pytest.approx(
        rows["hf-eager"]["median_ms"] / rows["torch-eager"]["median_ms"]) and pd.isna(eager["vs_hf-liger"])
    assert eager["loss_rel_err"] == errs["loss"] and eager["grad_rel_err"] == errs.drop("loss").max()
    html = (finalize(tmp_path)).read_text()  # the report's own section, one row per ok cell (CPU: no speed figures)
    section = html[html.index("<h2>Training step</h2>"):html.index("<h2>Per-op results</h2>")]
    assert "train_step &middot; tiny &middot; 1 layers" in section and section.count("<tr class=") == 3
    assert "tokens/s" not in section.split("</p>", 1)[1]


def test_layers_from_the_command_line(tmp_path):
    """``--layers`` overrides every model's depth, presets and defined models alike; ``--model ...,layers=N`` sets it
    for one model."""
    suite = get_suite("train")
    cfg = run_config(run_parser().parse_args(["--layers", "3"]), suite, Selection.from_suite(suite), CPU, tmp_path,
                     {"m": parse_model_spec("m:hidden=64,ffn=96,heads=4,vocab=128,layers=6")})
    assert cfg.model("llama3-1b").layers == cfg.model("m").layers == cfg.model("m", check=True).layers == 3
    cfg = run_config(run_parser().parse_args([]), suite, Selection.from_suite(suite), CPU, tmp_path,
                     {"m": parse_model_spec("m:hidden=64,ffn=96,heads=4,vocab=128,layers=6")})
    assert (cfg.model("m").layers, cfg.model("llama3-1b").layers, cfg.model("tiny").layers) == (6, 4, 2)


def test_train_suite_and_pattern_suites():
    train = get_suite("train")
    assert (train.ops, train.models, train.modes, train.dtypes) == (("train_step",), ("llama3-1b",), ("fwd_bwd",),
                                                                    ("bf16",))
    shape = PRESETS["llama3-1b"]
    assert (shape.vocab, shape.layers, batch_and_seq(shape), train.check_tokens) == (128256, 4, (2, 8192), 1024)
    pattern = get_suite("quick").op_names()
    assert OPS["train_step"].level == "model" and "train_step" not in pattern
    assert set(pattern) == {n for n, op in OPS.items() if op.level == "pattern"}
    assert get_suite("full").op_names() == pattern and "train_step" in get_suite("smoke").op_names()


IMPLS = ("torch-eager", "torch-compile", "hf-eager", "hf-compile", "hf-liger", "hf-coda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_train_suite_cells_on_the_gpu(tmp_path):
    """Every implementation of the train suite at 4096 tokens (1 x 4096), the float64 reference at 1024: ok and
    passing the error rule; Liger's fused linear cross-entropy never writes the 4096 x 128256 logits that Hugging
    Face eager does, so its peak memory is lower."""
    with isolated_registry():
        make_runner(tmp_path, ops=("train_step",), models=("llama3-1b",), modes=("fwd_bwd",), dtypes=("bf16",),
                    impls=IMPLS, device=torch.device("cuda"), tokens=4096, check_tokens=1024).run()
    df, _, _ = load_run(tmp_path)
    rows = {r["impl"]: r for _, r in df.iterrows()}
    assert set(rows) == set(IMPLS)
    for name, r in rows.items():
        assert r["status"] == "ok" and r["correct"] is True, (name, r["message"])
        assert r["peak_mem_mib"] > 0 and r["first_call_s"] > 0
    assert rows["hf-liger"]["peak_mem_mib"] < rows["hf-eager"]["peak_mem_mib"]
