"""The dry pass that compiles a step's kernels in parallel (kernels/coda/precompile.py): on the CPU its mechanism
(launches turned into compile-only warm-ups on every thread, measurements left to the real step, nothing done
where nothing compiles); on the GPU a real step after it compiles nothing."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from triton.runtime import _async_compile
from triton.runtime.jit import JITFunction

from kernels.coda import precompile as P
from kernels.coda import strategy as S
from kernels.coda import tuning
from test_strategy import _fused, _split, gpu  # noqa: F401  (the stand-in GPU fixture)
from test_tuning import CONFIGS, scripted_bench, tuner

ROOT = Path(__file__).resolve().parents[1]


def test_nothing_is_compiled_or_run_on_the_cpu_the_interpreter_or_when_turned_off(monkeypatch):
    calls = []
    monkeypatch.delenv(P.ENV, raising=False)
    done = P.precompile(lambda: calls.append(1), torch.device("cpu"))
    assert done.kernels == 0 and "cpu" in done.reason and not calls
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in P.precompile(lambda: calls.append(1), torch.device("cuda")).reason and not calls
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(P.ENV, "0")
    assert P.ENV in P.precompile(lambda: calls.append(1), torch.device("cuda")).reason and not calls


def test_launches_become_compile_only_warmups_on_every_thread_and_are_put_back(monkeypatch):
    seen = []

    def run(self, *args, grid, warmup, **kwargs):
        seen.append((threading.current_thread().name, warmup, _async_compile.active_mode.get(), P._DRY))

    monkeypatch.setattr(JITFunction, "run", run)
    mode = object()
    with pytest.raises(KeyError):
        with P._launches_compile_only(mode):
            JITFunction.run(None, grid=(1,), warmup=False)
            worker = threading.Thread(target=lambda: JITFunction.run(None, grid=(1,), warmup=False), name="engine")
            worker.start()
            worker.join()
            raise KeyError("the step failed")
    assert seen == [("MainThread", True, mode, True), ("engine", True, mode, True)]
    assert JITFunction.run is run and not P._DRY and _async_compile.active_mode.get() is None
    JITFunction.run(None, grid=(1,), warmup=False)
    assert seen[-1] == ("MainThread", False, None, False)


def test_a_dry_pass_ends_at_an_untuned_key_and_launches_a_tuned_one(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.TUNE_ENV, "1")  # tuning on (by default the key's config is predicted: test_configs.py)
    monkeypatch.setenv("CODABENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CODABENCH_AUTOTUNE_CACHE", raising=False)
    launches = []
    t = tuner()
    t.run = lambda *args, **kwargs: launches.append(args[2])
    t._bench = scripted_bench({})  # a dry pass must not time anything
    tuning.attach(t, lambda: "Test GPU")
    t.cache[(2048,)] = CONFIGS[0]
    monkeypatch.setattr(P, "_DRY", True)
    t.run(None, None, 2048, grid=None, warmup=False)
    with pytest.raises(P.Untuned, match=r"no tuned config for \(1024,\)"):
        t.run(None, None, 1024, grid=None, warmup=False)
    assert launches == [2048] and (1024,) not in t.cache
    assert not tuning.cache_file("Test GPU").exists()  # nothing stored from a dry pass


def test_precompile_ends_the_pass_at_an_untuned_launch_and_reports_the_choices_left(monkeypatch):
    monkeypatch.delenv(P.ENV, raising=False)
    monkeypatch.setattr(P, "compiles_here", lambda device: True)  # the GPU's parts, stood in for
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    after = []

    def step():
        P.skipped("choice")
        P.untuned("kernel: no tuned config")
        after.append(1)

    done = P.precompile(step, torch.device("cuda"), workers=2)
    assert done.stopped == "kernel: no tuned config" and done.skipped == ("choice",) and not after
    assert done.kernels == 0 and done.reason is None and not P._DRY
    assert P.precompile(lambda: None, torch.device("cuda"), workers=2).skipped == ()  # a new pass starts afresh
    with pytest.raises(ValueError):  # anything else the step raises is the caller's
        P.precompile(lambda: int("x"), torch.device("cuda"), workers=2)
    assert not P._DRY


def test_a_dry_pass_compiles_the_fused_path_of_an_unchosen_key_without_choosing(gpu, monkeypatch):
    dispatch = S.with_split(_split)(_fused)
    x = torch.zeros(8, 4)
    monkeypatch.setattr(P, "_DRY", True)
    P._SKIPPED.clear()
    assert dispatch(x, 3) == "fused" and not gpu["log"]  # nothing timed
    assert "_fused: no strategy chosen" in P._SKIPPED[0]
    monkeypatch.setattr(P, "_DRY", False)
    gpu["times"] = {"fused": [1.0] * 3, "split": [0.5] * 3}
    assert dispatch(x, 3) == "split" and gpu["log"]  # the real call measures and chooses


def test_autograd_step_differentiates_the_outputs_that_need_it_without_touching_grad(monkeypatch):
    w = torch.randn(3, requires_grad=True)
    b = torch.randn(3)
    seen = {}

    def fake(step, device):
        step()
        seen["device"] = device
        return P.Precompiled(0, 0.0)

    monkeypatch.setattr(P, "precompile", fake)
    calls = []
    orig = torch.autograd.grad

    def grad(outputs, inputs, grad_outputs, allow_unused):
        calls.append((len(outputs), [i is w for i in inputs], [g.shape for g in grad_outputs]))
        return orig(outputs, inputs, grad_outputs, allow_unused=allow_unused)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    P.precompile_autograd(lambda: {"y": (w * b).sum(), "lse": b.sum(), "n": 3}, [w, b], torch.device("cpu"))
    assert calls == [(1, [True], [torch.Size([])])] and w.grad is None and seen["device"].type == "cpu"


@pytest.mark.slow
def test_each_prepared_cell_starts_with_one_dry_pass_over_what_the_harness_differentiates(monkeypatch):
    """coda-triton and hf-coda: the first call after a shape's first ``prepare`` hands the cell's forward to the dry
    pass (the op's compared outputs only, the cell's device, its leaves), later calls do not, nor do the calls after
    a ``prepare`` of new inputs at the same shape (the harness prepares before every timed call); a new shape does."""
    from codabench.case import Case
    from codabench.execute import fresh_leaves
    from codabench.registry import prepared
    from kernels import hf_train
    from kernels.coda import plugin
    from workloads.models import get_model
    from workloads.ops import OPS

    passes = []

    def record(forward, inputs, device):
        out = forward()
        passes.append((sorted(out) if isinstance(out, dict) else out.shape, [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad],
                       device))
        return P.Precompiled(0, 0.0)

    monkeypatch.setattr(plugin, "precompile_autograd", record)
    model = get_model("tiny")
    op, impl = OPS["block"], plugin.REGISTRY.get("block", "coda-triton")
    case = Case(op, model, "fwd_bwd", "fp32", torch.device("cpu"), op.make_inputs(model, torch.float32, "cpu", 0))
    native = fresh_leaves(prepared(impl, case), ["a", "residual", "w_o"])
    impl.run(native)
    impl.run(native)
    (outputs, leaves, device), = passes
    assert outputs == sorted(op.outputs) and device == case.device
    assert {id(t) for t in leaves} == {id(native[k]) for k in ("a", "residual", "w_o")}
    impl.prepare(case)
    impl.run(native)
    assert len(passes) == 1
    wider = model.with_(tokens=2 * model.tokens)
    other = Case(op, wider, "fwd_bwd", "fp32", torch.device("cpu"), op.make_inputs(wider, torch.float32, "cpu", 1))
    impl.run(fresh_leaves(prepared(impl, other), ["a", "residual", "w_o"]))
    assert len(passes) == 2

    pytest.importorskip("transformers")
    import kernels.coda.hf  # noqa: F401  (imported before the patch below, so that it keeps the real function)
    import kernels.coda.precompile as precompile_module

    monkeypatch.setattr(precompile_module, "precompile_autograd", record)
    op, hf = OPS["train_step"], hf_train.HFCoda()
    small = get_model("tiny").with_(layers=1)
    case = Case(op, small, "fwd_bwd", "fp32", torch.device("cpu"), op.make_inputs(small, torch.float32, "cpu", 0))
    native = prepared(hf, case)
    native = fresh_leaves(native, op.differentiable(case.inputs))
    hf.run(native)
    hf.run(native)
    assert len(passes) == 3 and passes[2][0] == torch.Size([]) and passes[2][2] == case.device  # the loss
    assert len(passes[2][1]) == len(op.differentiable(case.inputs))


def test_precompile_step_needs_a_patched_model_and_does_nothing_on_the_cpu(monkeypatch):
    from kernels.coda.hf import CodaUnsupportedError, apply_coda, precompile_step
    from test_hf import tiny

    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with pytest.raises(CodaUnsupportedError, match="patched by apply_coda"):
        precompile_step(model, input_ids=ids, labels=ids)
    apply_coda(model)
    monkeypatch.delenv(P.ENV, raising=False)
    monkeypatch.setattr(model, "forward", lambda **kw: pytest.fail("nothing to compile on the CPU: no dry pass"))
    assert "cpu" in precompile_step(model, input_ids=ids, labels=ids).reason
    assert all(p.grad is None for p in model.parameters())


def test_a_patched_model_precompiles_its_first_training_step_at_each_shape(monkeypatch):
    """With a GPU to compile for (stood in for: Triton compiles on the CPU, the dry pass runs its step), the first
    call with labels and gradients at each input shape runs precompile_step first, once; later calls, calls
    without gradients and calls inside the dry pass do not. The dry pass leaves the random state alone (attention
    dropout draws the same masks), and the loss and gradients are those of the model that never precompiles."""
    import kernels.coda.hf as hf
    from kernels.coda.hf import apply_coda
    from test_hf import loss_and_grads, tiny

    passes = []

    def dry(step, device, workers=None):
        monkeypatch.setattr(P, "_DRY", True)
        try:
            torch.rand(100)  # a dry pass consumes random numbers (dropout)
            step()
        finally:
            monkeypatch.setattr(P, "_DRY", False)
        passes.append(device)
        return P.Precompiled(1, 0.0)

    monkeypatch.setattr(P, "precompile", dry)
    model, plain = (apply_coda(tiny(attention_dropout=0.3, num_hidden_layers=1)) for _ in range(2))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    results = []
    for m, compiles in ((plain, False), (model, True)):
        monkeypatch.setattr(hf, "compiles_here", lambda device: compiles)
        torch.manual_seed(5)
        loss, grads, _ = loss_and_grads(m.train(), input_ids=ids, labels=ids)
        results.append((loss, {n: g.clone() for n, g in grads.items()}))
    assert len(passes) == 1
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(results[0][1][n], results[1][1][n]) for n in results[0][1])
    loss_and_grads(model, input_ids=ids, labels=ids)
    with torch.no_grad():
        model(input_ids=ids[:, :6], labels=ids[:, :6])
    assert len(passes) == 1
    loss_and_grads(model, input_ids=ids[:, :6], labels=ids[:, :6])
    assert len(passes) == 2


GPU_SCRIPT = r"""
import json, os, sys, tempfile, torch, triton
from triton import knobs
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction
from kernels.coda.functions import RoPE, block
from kernels.coda.precompile import precompile_autograd
torch.manual_seed(0)
dev, dt, M, d, f, H, KV, D = torch.device("cuda"), torch.bfloat16, 1536, 1024, 2816, 8, 4, 128
leaf = lambda *s, scale=1.0: (torch.randn(*s, device=dev, dtype=dt) * scale).requires_grad_()
a, res = leaf(M, d), leaf(M, d)
w_o, w_gu, w_d = leaf(d, d, scale=d ** -0.5), leaf(2 * f, d, scale=d ** -0.5), leaf(d, f, scale=f ** -0.5)
w_qkv = leaf((H + 2 * KV) * D, d, scale=d ** -0.5)
g_mlp, g_attn = torch.ones(d, device=dev, dtype=dt, requires_grad=True), torch.ones(d, device=dev, dtype=dt, requires_grad=True)
rope = RoPE(torch.arange(M, device=dev), H, KV, D, 500000.0)
leaves = [a, res, w_o, g_mlp, w_gu, w_d, g_attn, w_qkv]
dx, dqkv = torch.randn(M, d, device=dev, dtype=dt), torch.randn(M, (H + 2 * KV) * D, device=dev, dtype=dt)
compiled = []
knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(1)

def step():
    for t in leaves:
        t.grad = None
    x, qkv, _, _ = block(a, res, w_o, g_mlp, w_gu, w_d, g_attn, w_qkv, rope, 1e-5)
    torch.autograd.backward([x, qkv], [dx, dqkv])
    torch.cuda.synchronize()
    return [x.float(), qkv.float()] + [t.grad.float() for t in leaves]

first = step()  # tunes, chooses and compiles everything
serial = len(compiled)
for mod in [m for n, m in sys.modules.items() if n.startswith("kernels.")]:  # forget every compiled kernel
    for v in vars(mod).values():  # a declared kernel's host function holds its two kernels
        for obj in (v, getattr(v, "kernel", None), getattr(v, "rows_kernel", None)):
            while isinstance(obj, (Autotuner, Heuristics)):
                obj = obj.fn
            if isinstance(obj, JITFunction):
                obj.device_caches.clear()
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # and Triton's on-disk cache
compiled.clear()
done = precompile_autograd(lambda: block(a, res, w_o, g_mlp, w_gu, w_d, g_attn, w_qkv, rope, 1e-5)[:2], leaves, dev)
ahead = len(compiled)
compiled.clear()
again = step()
print(json.dumps({"serial": serial, "kernels": done.kernels, "ahead": ahead, "skipped": list(done.skipped),
                  "stopped": done.stopped, "in_step": len(compiled),
                  "same": all(((p - q).norm() <= 1e-3 * p.norm()).item() for p, q in zip(first, again))}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["auto", "gluon"])  # gluon: the producers' Gluon kernel on Hopper (fused elsewhere)
def test_after_a_dry_pass_the_real_step_compiles_nothing_and_computes_the_same(tmp_path, strategy):
    env = {**os.environ, "CODABENCH_CACHE_DIR": str(tmp_path / "coda"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "PYTHONPATH": str(ROOT), "CODABENCH_STRATEGY": strategy,
           tuning.TUNE_ENV: "1"}  # the first step tunes and measures its choices; the dry pass does neither
    env.pop("CODABENCH_AUTOTUNE_CACHE", None)
    out = subprocess.run([sys.executable, "-c", GPU_SCRIPT], env=env, capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # the dry pass compiled the block's kernels (as many as the first step compiled, less the tuning's other
    # configs and the choices' other paths), chose nothing, ran to the end; the step after it compiled nothing
    assert 0 < r["kernels"] == r["ahead"] < r["serial"] and r["skipped"] == [] and r["stopped"] is None, r
    assert r["in_step"] == 0 and r["same"], r
