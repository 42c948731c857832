"""Baseline plugins (Liger, FlashInfer, quack): registration, skip reasons, and their compositions.

No GPU here, so the compositions are checked on CPU in fp32 against the float64 reference through
the harness's own calls (``codabench.execute``):
- Liger: its RoPE, fused gate-up SwiGLU and fused linear cross-entropy kernels run for real in the
  Triton interpreter (a subprocess with TRITON_INTERPRET=1); its two RMSNorm kernels do not run
  there (their ``eps.to(...)`` needs a compiled scalar) and are replaced by torch stand-ins. Its fp8
  cells (``_scaled_mm`` + Liger) run there too, with its plain cross-entropy kernel for real; the fused
  gate-up SwiGLU is a stand-in in them (in bf16 the interpreter computes it wrong: NaN/garbage).
- FlashInfer and quack run CUDA/CuTe-DSL code only: their calls are replaced by torch stand-ins that
  follow the documented semantics (FlashInfer's in-place mutation of its arguments included), so
  the tests check the plumbing: weight layouts, tables, which tensor is mutated, output names.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kernels.flashinfer as KF
import kernels.liger as KL
import kernels.quack as KQ
from codabench.case import Case
from codabench.correctness import CHECK_SEED, build_reference, check_impl
from codabench.execute import reference_once, run_once
from codabench.metrics import rel_err
from codabench.registry import REGISTRY
from workloads import fp8
from workloads.models import PRESETS
from workloads.ops import OPS

ROOT = Path(__file__).resolve().parents[1]
TINY = PRESETS["tiny"]
CPU = torch.device("cpu")


def make_case(op_name: str, mode: str, dtype: str = "fp32", device: torch.device = CPU, seed: int = 1) -> Case:
    op = OPS[op_name]
    inputs = op.make_inputs(TINY, torch.float32, CPU, seed) if device.type == "cpu" else {}
    return Case(op, TINY, mode, dtype, device, inputs)


def check_against_reference(impl, case: Case) -> dict[str, float]:
    """Run ``impl`` once like the harness does; relative errors of every output and gradient."""
    op = case.op
    grad_outputs = None
    if case.mode != "fwd":
        ref_fwd = reference_once(op, replace(case, mode="fwd"), None).outputs
        grad_outputs = op.grad_outputs({k: ref_fwd[k].float() for k in op.outputs}, 2)
    before = {k: v.clone() for k, v in case.inputs.items()}
    got = run_once(op, impl, case, grad_outputs)
    for k, v in before.items():
        assert torch.equal(case.inputs[k], v), f"{impl.name} mutated canonical input {k}"
    ref = reference_once(op, case, grad_outputs)
    assert set(op.outputs) <= set(got.outputs), f"missing outputs: {set(op.outputs) - set(got.outputs)}"
    assert set(got.grads) == set(ref.grads)
    errs = {k: rel_err(got.outputs[k], ref.outputs[k]) for k in got.outputs}
    errs.update({k: rel_err(got.grads[k], ref.grads[k]) for k in ref.grads})
    return errs


# ---- registration and skip reasons ------------------------------------------------------------

def test_registration():
    liger = {op for (op, name) in REGISTRY.impls if name == "liger"}
    assert liger == {"rmsnorm_linear", "rmsnorm_swiglu", "rmsnorm_rope", "rmsnorm_ce", "lm_head_ce", "block"}
    flashinfer = {op for (op, name) in REGISTRY.impls if name == "flashinfer"}
    assert flashinfer == {"rmsnorm_linear", "rmsnorm_swiglu", "rmsnorm_rope", "block"}
    quack = {op for (op, name) in REGISTRY.impls if name == "quack"}
    assert quack == {"rmsnorm_linear", "rmsnorm_swiglu"}
    for (op, name), impl in REGISTRY.impls.items():
        if name in ("liger", "flashinfer", "quack"):
            assert impl.label == ("expert fused" if name == "quack" else "baseline")
            assert set(impl.modes) <= set(OPS[op].modes) and impl.description
    assert REGISTRY.get("rmsnorm_ce", "liger").modes == ("fwd", "fwd_bwd")
    assert REGISTRY.get("block", "liger").modes == ("fwd", "bwd", "fwd_bwd")
    assert all(REGISTRY.get(op, "flashinfer").modes == ("fwd",) for op in flashinfer)
    assert "liger-compile" not in REGISTRY.names()


def test_skip_reasons_without_gpu():
    for op, name, reason in [("block", "liger", "skipped: needs a CUDA GPU"),
                             ("block", "flashinfer", "skipped: needs a CUDA GPU"),
                             ("rmsnorm_swiglu", "quack", "skipped: needs a Hopper (sm90+) GPU")]:
        assert REGISTRY.get(op, name).skip_reason(make_case(op, "fwd", "bf16")) == reason


def test_not_applicable_cells_say_why():
    fi = REGISTRY.get("block", "flashinfer")
    for mode in ("bwd", "fwd_bwd"):
        assert fi.skip_reason(make_case("block", mode, "bf16")).startswith("n/a: FlashInfer's kernels are inference-only")
    assert fi.skip_reason(make_case("block", "fwd", "fp32")).startswith("n/a:")
    ce = REGISTRY.get("rmsnorm_ce", "liger")
    assert ce.skip_reason(make_case("rmsnorm_ce", "bwd", "bf16")).startswith("n/a: liger computes the gradients inside")
    for dtype in ("fp8", "fp8-row"):  # fp8 cells exist (_scaled_mm + Liger/FlashInfer): only the GPU is missing
        for name in ("liger", "flashinfer"):
            reason = REGISTRY.get("block", name).skip_reason(make_case("block", "fwd", dtype))
            assert reason == "skipped: needs a CUDA GPU", (name, dtype, reason)
    assert REGISTRY.get("rmsnorm_linear", "quack").skip_reason(make_case("rmsnorm_linear", "bwd", "bf16")).startswith("n/a:")


@pytest.mark.parametrize("op,name,package", [("block", "liger", "liger_kernel"), ("block", "flashinfer", "flashinfer"),
                                             ("rmsnorm_linear", "quack", "quack")])
def test_skip_reason_when_package_missing(monkeypatch, op, name, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == package else real(mod, *a))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # pretend a Hopper GPU
    case = make_case(op, "fwd", "bf16", device=torch.device("cuda"))
    assert REGISTRY.get(op, name).skip_reason(case) == f"skipped: package {package} is not installed"


# ---- Liger: real Triton kernels in the interpreter -----------------------------------------------

LIGER_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
import torch, torch.nn.functional as F
sys.path.insert(0, "tests")
import kernels.liger as KL
from codabench.registry import REGISTRY
from test_baselines import TINY, OPS, check_against_reference, make_case

class AddRMSNorm:  # torch stand-in with LigerFusedAddRMSNormFunction's signature
    @staticmethod
    def forward(ctx, X, R, W, eps, offset=0.0, casting_mode="llama", in_place=False): ...
    @staticmethod
    def apply(X, R, W, eps, offset, casting_mode, in_place):
        s = X + R
        return F.rms_norm(s, (s.shape[-1],), W, eps), s

class RMSNorm:  # torch stand-in with LigerRMSNormFunction's signature
    @staticmethod
    def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None): ...
    @staticmethod
    def apply(X, W, eps, offset, casting_mode, in_place, row_mode):
        return F.rms_norm(X, (X.shape[-1],), W, eps)

real = KL._ops()
KL._ops = lambda: SimpleNamespace(**{**vars(real), "add_rms_norm": AddRMSNorm, "rms_norm": RMSNorm})
out = {}
for op, mode in [("rmsnorm_linear", "fwd_bwd"), ("rmsnorm_swiglu", "fwd_bwd"), ("rmsnorm_rope", "fwd_bwd"),
                 ("rmsnorm_ce", "fwd"), ("rmsnorm_ce", "fwd_bwd"), ("lm_head_ce", "fwd_bwd"), ("block", "fwd_bwd")]:
    out[f"{op}/{mode}"] = check_against_reference(REGISTRY.get(op, "liger"), make_case(op, mode))

from codabench.case import Case
from codabench.correctness import CHECK_SEED, build_reference, check_impl

class GateUpSwiGLU:  # torch stand-in: the interpreter gets Liger's bf16 fused gate-up kernel wrong
    @staticmethod
    def apply(y):
        g, u = y.chunk(2, -1)
        return F.silu(g) * u

ce_calls = []
class CountingCE:  # Liger's real cross-entropy kernel, counted
    forward = real.cross_entropy.forward
    @staticmethod
    def apply(*args):
        ce_calls.append(args[0].dtype)
        return real.cross_entropy.apply(*args)

KL._ops = lambda: SimpleNamespace(**{**vars(real), "add_rms_norm": AddRMSNorm, "rms_norm": RMSNorm,
                                     "gate_up_swiglu": GateUpSwiGLU, "cross_entropy": CountingCE})
fp8_out = {}
for op, dtype in [("rmsnorm_swiglu", "fp8"), ("rmsnorm_rope", "fp8-row"), ("rmsnorm_ce", "fp8"),
                  ("lm_head_ce", "fp8-row"), ("block", "fp8")]:
    o = OPS[op]
    case = Case(o, TINY, "fwd", dtype, torch.device("cpu"), o.inputs(TINY, dtype, "cpu", CHECK_SEED))
    res = check_impl(build_reference(o, case), REGISTRY.get(op, "liger"))
    fp8_out[f"{op}/{dtype}"] = {"correct": res.correct, "errors": res.errors,
                                "vs_bf16": {c.output: c.rel_err_vs_bf16 for c in res.checks}}
print(json.dumps({"fp32": out, "fp8": fp8_out, "ce_calls": [str(d) for d in ce_calls]}))
"""


def test_liger_compositions_in_triton_interpreter():
    pytest.importorskip("liger_kernel")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", LIGER_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = result["fp32"]
    assert set(errors) == {"rmsnorm_linear/fwd_bwd", "rmsnorm_swiglu/fwd_bwd", "rmsnorm_rope/fwd_bwd",
                           "rmsnorm_ce/fwd", "rmsnorm_ce/fwd_bwd", "lm_head_ce/fwd_bwd", "block/fwd_bwd"}
    assert "grad_w_gate" in errors["block/fwd_bwd"] and "grad_w_lm" in errors["rmsnorm_ce/fwd_bwd"]
    bad = {cell: {k: e for k, e in errs.items() if not e < 1e-5} for cell, errs in errors.items()}
    assert not any(bad.values()), bad
    fp8_cells = result["fp8"]
    assert len(fp8_cells) == 5 and all(c["correct"] for c in fp8_cells.values()), fp8_cells
    assert all(c["vs_bf16"] and all(v > 0 for v in c["vs_bf16"].values()) for c in fp8_cells.values())
    assert result["ce_calls"] == ["torch.float32"] * 2  # the CE ops' fp8 cells: _scaled_mm logits + Liger's CE


# ---- FlashInfer: documented semantics as torch stand-ins -----------------------------------------

def _fake_flashinfer() -> SimpleNamespace:
    def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
        residual.add_(input)
        input.copy_(F.rms_norm(residual, (residual.shape[-1],), weight, eps))

    def silu_and_mul(input, out=None, enable_pdl=None):
        d = input.shape[-1] // 2
        return F.silu(input[..., :d]) * input[..., d:]

    def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
        assert is_neox
        cos, sin = cos_sin_cache[positions].chunk(2, -1)
        for t in (query, key):
            x = t.view(t.shape[0], -1, head_size)
            x1, x2 = x.chunk(2, -1)
            c, s = cos[:, None, :].to(t.dtype), sin[:, None, :].to(t.dtype)
            x.copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1))

    return SimpleNamespace(norm=SimpleNamespace(fused_add_rmsnorm=fused_add_rmsnorm, _USE_CUDA_NORM=True),
                           activation=SimpleNamespace(silu_and_mul=silu_and_mul),
                           rope=SimpleNamespace(apply_rope_with_cos_sin_cache_inplace=apply_rope_with_cos_sin_cache_inplace))


@pytest.mark.parametrize("op", ["rmsnorm_linear", "rmsnorm_swiglu", "rmsnorm_rope", "block"])
def test_flashinfer_compositions_with_standins(monkeypatch, op):
    monkeypatch.setattr(KF, "_fi", _fake_flashinfer)
    monkeypatch.setattr(KF, "JIT_WARMUP_S", {})
    monkeypatch.setattr(KF, "_BUILDS", {})
    errors = check_against_reference(REGISTRY.get(op, "flashinfer"), make_case(op, "fwd"))
    assert errors and all(e < 1e-5 for e in errors.values()), errors
    kernels = {"fused_add_rmsnorm/float32"} | ({"silu_and_mul/float32"} if "swiglu" in op or op == "block" else set()) \
        | ({"rope/float32"} if "rope" in op or op == "block" else set())
    assert set(KF.JIT_WARMUP_S) == kernels
    assert REGISTRY.get(op, "flashinfer").metadata()["jit_warmup_s"].keys() == kernels


def test_flashinfer_builds_its_jit_modules_at_once_and_each_kernel_waits_for_its_own(monkeypatch):
    """The first prepare starts the three modules' builds together (each in a thread: every build has started
    before any has ended); a kernel's first call comes after its module is built; a build that fails in the
    background leaves the kernel to its own first call, which runs."""
    log: list[tuple[str, str, float]] = []
    lock = threading.Lock()

    def spec(name: str, fails: bool = False):
        def build_and_load():
            with lock:
                log.append((name, "start", time.perf_counter()))
            time.sleep(0.3)
            with lock:
                log.append((name, "end", time.perf_counter()))
            if fails:
                raise RuntimeError("nvcc failed")
        return SimpleNamespace(build_and_load=build_and_load)

    fake = _fake_flashinfer()
    fake.norm.gen_norm_module = lambda: spec("norm")
    fake.activation.gen_act_and_mul_module = lambda act: spec(f"act-{act}", fails=True)
    fake.rope.gen_rope_module = lambda: spec("rope")
    fused_add_rmsnorm = fake.norm.fused_add_rmsnorm

    def traced(*args, **kwargs):
        log.append(("call", "fused_add_rmsnorm", time.perf_counter()))
        return fused_add_rmsnorm(*args, **kwargs)

    fake.norm.fused_add_rmsnorm = traced
    monkeypatch.setattr(KF, "_fi", lambda: fake)
    monkeypatch.setattr(KF, "JIT_WARMUP_S", {})
    monkeypatch.setattr(KF, "_BUILDS", {})
    errors = check_against_reference(REGISTRY.get("rmsnorm_swiglu", "flashinfer"), make_case("rmsnorm_swiglu", "fwd"))
    assert errors and all(e < 1e-5 for e in errors.values()), errors  # silu_and_mul ran despite its failed build
    for future in KF._BUILDS.values():
        future.result()
    starts = [t for _, what, t in log if what == "start"]
    ends = {name: t for name, what, t in log if what == "end"}
    assert len(starts) == 3 and max(starts) < min(ends.values())  # all three under way at once
    first_call = next(t for name, _, t in log if name == "call")
    assert first_call >= ends["norm"] and KF.JIT_WARMUP_S["fused_add_rmsnorm/float32"] >= 0.25


@pytest.mark.parametrize("dtype", ["fp8", "fp8-row"])
@pytest.mark.parametrize("op", ["rmsnorm_swiglu", "block"])
def test_flashinfer_fp8_cells_with_standins(monkeypatch, op, dtype):
    """_scaled_mm GEMMs + FlashInfer's kernels (stand-ins) pass the harness's fp8 error rule."""
    monkeypatch.setattr(KF, "_fi", _fake_flashinfer)
    monkeypatch.setattr(KF, "JIT_WARMUP_S", {})
    monkeypatch.setattr(KF, "_BUILDS", {})
    o = OPS[op]
    case = Case(o, TINY, "fwd", dtype, CPU, o.inputs(TINY, dtype, CPU, CHECK_SEED))
    impl = REGISTRY.get(op, "flashinfer")
    native = impl.prepare(case)
    assert isinstance(native["w_gate_up"], fp8.Fp8) and isinstance(native["a"], fp8.Fp8)
    assert native["w_gate_up"].scale.shape == ((2 * TINY.ffn, 1) if dtype == "fp8-row" else ())
    outcome = check_impl(build_reference(o, case), impl)
    assert outcome.correct, (outcome.errors, [(c.output, c.stats, c.torch_rel_err) for c in outcome.checks])
    assert all(c.rel_err_vs_bf16 > 0 for c in outcome.checks)
    assert "fused_add_rmsnorm/bfloat16" in KF.JIT_WARMUP_S


# ---- quack: documented semantics (its *_ref functions) as torch stand-ins -----------------------

def _fake_gemm_interface(calls: list[str]) -> SimpleNamespace:
    def gemm_rms(A, B, C=None, norm_weight=None, premult_out=None, eps=1e-6, tuned=True):
        calls.append("gemm_rms")
        d = A @ B + C
        premult_out.copy_(d)
        return d * norm_weight, torch.rsqrt(d.float().square().mean(-1) + eps)

    def gemm_norm_act(A, B, rstd=None, activation=None, tuned=True):
        calls.append(f"gemm_norm_act:{activation}")
        d = (A @ B) * rstd[:, None]
        return None, d if activation is None else F.silu(d[:, 0::2]) * d[:, 1::2]

    return SimpleNamespace(gemm_rms=gemm_rms, gemm_norm_act=gemm_norm_act)


@pytest.mark.parametrize("op,act", [("rmsnorm_linear", "None"), ("rmsnorm_swiglu", "swiglu")])
def test_quack_compositions_with_standins(monkeypatch, op, act):
    calls: list[str] = []
    monkeypatch.setattr(KQ, "_gemm_interface", lambda: _fake_gemm_interface(calls))
    monkeypatch.setattr(KQ, "_FAILURE", None)
    errors = check_against_reference(REGISTRY.get(op, "quack"), make_case(op, "fwd"))
    assert "rstd" in errors and all(e < 1e-5 for e in errors.values()), errors
    assert calls == ["gemm_rms", f"gemm_norm_act:{act}"] * 2  # autotuning call in prepare, then the run


def test_quack_epilogue_failure_becomes_a_clear_error(monkeypatch):
    calls: list[str] = []

    def broken(*a, **k):
        calls.append("gemm_rms")
        raise TypeError("epilogue fn depends on <x> which has no fail-closed semantic key")

    monkeypatch.setattr(KQ, "_gemm_interface", lambda: SimpleNamespace(gemm_rms=broken))
    monkeypatch.setattr(KQ, "_FAILURE", None)
    impl = REGISTRY.get("rmsnorm_linear", "quack")
    for _ in range(2):
        with pytest.raises(RuntimeError) as info:
            impl.prepare(make_case("rmsnorm_linear", "fwd"))
        msg = str(info.value)
        assert "quack" in msg and "nvidia-cutlass-dsl" in msg and "fail-closed semantic key" in msg
    assert calls == ["gemm_rms"]  # the second cell fails fast
