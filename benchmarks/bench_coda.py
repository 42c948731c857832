"""GPU check of the CODA kernels: error vs float64 and time vs the plain cuBLAS GEMM and unfused PyTorch.

    python benchmarks/bench_coda.py [--models llama-1b,llama-7b,llama-70b] [--tokens 16384]
                                    [--kernels producer_out,...] [--no-compile] [--model-check]

For every kernel (``KERNELS``) and model, in bf16:
- error: every output (fp32 side outputs too) against the same unfused math in float64 on the same bf16
  inputs; printed as our relative Frobenius error, PyTorch's (the unfused math in bf16, eager) and the
  ratio, judged by the suite's pass rule (:mod:`codabench.metrics`: at most 2x PyTorch's error plus the bf16
  floor);
- time (``triton.testing.do_bench``: median, L2 flushed): the fused host function (its GEMM plus any
  finishing reductions) and the plain cuBLAS GEMM of its shape (``F.linear``), taking turns over ROUNDS
  rounds (median of the rounds), then the unfused PyTorch math eager and under ``torch.compile``; printed
  as fused/GEMM and the speedups over eager and compiled.
A failing kernel prints an error row and the table goes on. Each kernel's unfused function is dtype
generic: on float64 inputs it is the reference. Backward kernels (dgrad GEMM + RMSNorm backward, down-proj
dgrad + SwiGLU backward, the CE-scaled LM-head dgrad and weight gradient, elementwise RoPE / SwiGLU backward)
are in the same table. With ``--model-check`` (about a minute more: new shapes to autotune), last: the CODA
Llama (kernels/coda/model.py) against the standard unfused Llama in bf16, loss and every parameter gradient
under the same error rule (also ``TRITON_INTERPRET=0 pytest tests/test_coda_model.py -k gpu``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton
from triton.runtime.autotuner import Autotuner

import kernels.coda.functions  # noqa: F401  (imports every CODA kernel module)
from codabench.metrics import passes, rel_err
from kernels import layouts
from kernels.coda import tuning
from kernels.coda.cross_entropy import gemm_cross_entropy
from kernels.coda.gemm import matmul
from kernels.coda.model import check_equivalence
from kernels.coda.producer import gemm_residual_norm, norm_input
from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm
from kernels.coda.rope import gemm_rope, rope_freq_table
from kernels.coda.rope_bwd import rope_bwd
from kernels.coda.scaled_linear import scaled_linear
from kernels.coda.swiglu import gemm_swiglu
from kernels.coda.swiglu_bwd import dgrad_swiglu, swiglu_bwd
from workloads.models import ModelShape, get_model

Tensors = dict[str, torch.Tensor]


@dataclass
class KernelSpec:
    """One fused kernel: its inputs, the fused call, the same math unfused, and its GEMM."""

    name: str
    inputs: Callable[[ModelShape, torch.Generator], Tensors]
    fused: Callable[[Tensors, ModelShape], Tensors]
    unfused: Callable[[Tensors, ModelShape], Tensors]
    gemm: Callable[[Tensors], tuple[torch.Tensor, torch.Tensor]]
    """(x, w) of the plain GEMM ``x @ w.T`` of the same shape."""


def _up(t: torch.Tensor) -> torch.Tensor:
    """fp32 for low-precision tensors, fp64 stays fp64 (so the unfused math doubles as the reference)."""
    return t if t.dtype == torch.float64 else t.float()


def _randn(gen: torch.Generator, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)
    return (t * std + mean).to(torch.bfloat16)


def _weight(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    return _randn(gen, n, k, std=k ** -0.5)


def _normed_inputs(m: ModelShape, gen: torch.Generator, n: int) -> Tensors:
    """h = x * gamma and rstd of a residual stream x, and a weight (n, d): a consumer GEMM's inputs."""
    x = _randn(gen, m.tokens, m.hidden)
    gamma = _randn(gen, m.hidden, std=0.1, mean=1.0)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + m.eps)
    return {"h": x * gamma, "rstd": rstd, "w": _weight(gen, n, m.hidden)}


# ---- producer: x = residual + a Wp^T; h = x * gamma; rstd(x) -------------------------------------------

def producer_inputs(k_of: Callable[[ModelShape], int]):
    def make(m: ModelShape, gen: torch.Generator) -> Tensors:
        k = k_of(m)
        return {"a": _randn(gen, m.tokens, k), "w": _weight(gen, m.hidden, k),
                "residual": _randn(gen, m.tokens, m.hidden), "gamma": _randn(gen, m.hidden, std=0.1, mean=1.0)}
    return make


def producer_fused(t: Tensors, m: ModelShape) -> Tensors:
    x, h, rstd = gemm_residual_norm(t["a"], t["w"], t["residual"], t["gamma"], m.eps)
    return {"x": x, "h": h, "rstd": rstd}


def producer_unfused(t: Tensors, m: ModelShape) -> Tensors:
    x = t["residual"] + F.linear(t["a"], t["w"])
    return {"x": x, "h": x * t["gamma"], "rstd": torch.rsqrt(_up(x).pow(2).mean(-1) + m.eps)}


# ---- consumers: z = rstd * (h W^T), then SwiGLU / RoPE / cross-entropy ---------------------------------

def _scaled(t: Tensors) -> torch.Tensor:
    return _up(F.linear(t["h"], t["w"])) * t["rstd"][:, None].to(_up(t["h"]).dtype)


def scaled_linear_unfused(t: Tensors, m: ModelShape) -> Tensors:
    return {"z": _scaled(t).to(t["h"].dtype)}


def swiglu_unfused(t: Tensors, m: ModelShape) -> Tensors:
    z = _scaled(t)
    return {"y": (F.silu(z[:, 0::2]) * z[:, 1::2]).to(t["h"].dtype), "z_pre": z.to(t["h"].dtype)}


def rope_inputs(m: ModelShape, gen: torch.Generator) -> Tensors:
    t = _normed_inputs(m, gen, m.qkv_width)
    t["w"] = layouts.qkv_rows_to_adjacent(t["w"], m.heads, m.kv_heads, m.head_dim)
    t["positions"] = torch.arange(m.tokens, device="cuda") % m.seq_len
    t["freq"] = rope_freq_table(m.heads, m.kv_heads, m.head_dim, m.rope_theta, t["h"].device)
    return t


def rope_unfused(t: Tensors, m: ModelShape) -> Tensors:
    z = _scaled(t)
    freq = t["freq"].sum(0)  # f = hi + lo: fp32-rounded f for the PyTorch run, f to ~2^-32 for the float64 reference
    ang = t["positions"].to(z.dtype)[:, None] * freq[None, :]
    cos, sin = ang.cos(), ang.sin()
    x, y = z[:, 0::2], z[:, 1::2]
    return {"qkv": torch.stack([x * cos - y * sin, y * cos + x * sin], -1).reshape(z.shape).to(t["h"].dtype)}


def ce_inputs(m: ModelShape, gen: torch.Generator) -> Tensors:
    t = _normed_inputs(m, gen, m.vocab)
    target = torch.randint(0, m.vocab, (m.tokens,), generator=gen, device="cuda")
    t["target"] = target.masked_fill(torch.rand(m.tokens, generator=gen, device="cuda") < 0.05, -100)
    return t


def ce_unfused(with_grad: bool):
    def fn(t: Tensors, m: ModelShape) -> Tensors:
        logits = _scaled(t)
        out = {"loss": F.cross_entropy(logits, t["target"], ignore_index=-100), "lse": torch.logsumexp(logits, -1)}
        if with_grad:
            valid = (t["target"] != -100)[:, None].to(logits.dtype)
            dlogits = torch.softmax(logits, -1).scatter_add(1, t["target"].clamp(min=0)[:, None], -valid) * valid
            out["dlogits"] = dlogits.to(t["h"].dtype)
            out["zdz"] = (logits * dlogits).sum(-1)
        return out
    return fn


def ce_fused(with_grad: bool):
    def fn(t: Tensors, m: ModelShape) -> Tensors:
        loss, lse, dlogits, zdz = gemm_cross_entropy(t["h"], t["w"], t["rstd"], t["target"], with_grad=with_grad)
        out = {"loss": loss, "lse": lse}
        if with_grad:
            out.update(dlogits=dlogits, zdz=zdz)
        return out
    return fn


def norm_input_inputs(m: ModelShape, gen: torch.Generator) -> Tensors:
    return {"x": _randn(gen, m.tokens, m.hidden), "gamma": _randn(gen, m.hidden, std=0.1, mean=1.0)}


def norm_input_unfused(t: Tensors, m: ModelShape) -> Tensors:
    return {"h": t["x"] * t["gamma"], "rstd": torch.rsqrt(_up(t["x"]).pow(2).mean(-1) + m.eps)}


def _ab(a: str, w: str = "w"):
    return lambda t: (t[a], t[w])


KERNELS: list[KernelSpec] = [
    KernelSpec("producer_out", producer_inputs(lambda m: m.attn_width), producer_fused, producer_unfused, _ab("a")),
    KernelSpec("producer_down", producer_inputs(lambda m: m.ffn), producer_fused, producer_unfused, _ab("a")),
    KernelSpec("scaled_linear", lambda m, g: _normed_inputs(m, g, 2 * m.ffn),
               lambda t, m: {"z": scaled_linear(t["h"], t["w"], t["rstd"])}, scaled_linear_unfused, _ab("h")),
    KernelSpec("swiglu", lambda m, g: _normed_inputs(m, g, 2 * m.ffn),
               lambda t, m: {"y": gemm_swiglu(t["h"], t["w"], t["rstd"], save_preact=False)[0]},
               lambda t, m: {"y": swiglu_unfused(t, m)["y"]}, _ab("h")),
    KernelSpec("swiglu_save", lambda m, g: _normed_inputs(m, g, 2 * m.ffn),
               lambda t, m: dict(zip(("y", "z_pre"), gemm_swiglu(t["h"], t["w"], t["rstd"], save_preact=True))),
               swiglu_unfused, _ab("h")),
    KernelSpec("rope", rope_inputs,
               lambda t, m: {"qkv": gemm_rope(t["h"], t["w"], t["rstd"], t["positions"], m.heads, m.kv_heads,
                                              m.head_dim, m.rope_theta)}, rope_unfused, _ab("h")),
    KernelSpec("ce", ce_inputs, ce_fused(False), ce_unfused(False), _ab("h")),
    KernelSpec("ce_grad", ce_inputs, ce_fused(True), ce_unfused(True), _ab("h")),
    KernelSpec("norm_input", norm_input_inputs,
               lambda t, m: dict(zip(("h", "rstd"), norm_input(t["x"], t["gamma"], m.eps))), norm_input_unfused,
               None),
]


# ---- backward: dgrad GEMM + RMSNorm backward -----------------------------------------------------------

def dgrad_rmsnorm_inputs(n_of: Callable[[ModelShape], int], ce: bool):
    """dz [M, n] and W [n, d] of the consumer, the saved x, gamma, rstd and zdz (exact, fp32), and either the
    incoming residual gradient dres or (``ce``: the LM-head path) the loss scale 1/M and no dres."""
    def make(m: ModelShape, gen: torch.Generator) -> Tensors:
        n = n_of(m)
        t = {"dz": _randn(gen, m.tokens, n), "w": _weight(gen, n, m.hidden), "x": _randn(gen, m.tokens, m.hidden),
             "gamma": _randn(gen, m.hidden, std=0.1, mean=1.0)}
        if ce:
            t["scale"] = torch.full((1,), 1.0 / m.tokens, device="cuda")
        else:
            t["dres"] = _randn(gen, m.tokens, m.hidden)
        x = t["x"].float()
        t["rstd"] = torch.rsqrt(x.pow(2).mean(-1) + m.eps)
        y = x * t["rstd"][:, None] * t["gamma"].float()
        t["zdz"] = ((t["dz"].float() @ t["w"].float()) * y).sum(-1)  # <z, dz> = <y, dz W> (the ZdZ identity)
        return t
    return make


def dgrad_rmsnorm_fused(t: Tensors, m: ModelShape) -> Tensors:
    dx, y, dgamma = dgrad_rmsnorm(t["dz"], t["w"], t["x"], t["rstd"], t["gamma"], t["zdz"], t.get("dres"),
                                  dz_scale=t.get("scale", 1.0))
    return {"dx": dx, "y": y, "dgamma": dgamma}


def dgrad_rmsnorm_unfused(t: Tensors, m: ModelShape) -> Tensors:
    """gy = s dz W, then the RMSNorm backward recomputing rstd and c = mean(gy gamma xhat) from x and gy."""
    gy = _up(t["dz"] @ t["w"])
    if "scale" in t:
        gy = gy * t["scale"].to(gy.dtype)
    x, g = _up(t["x"]), _up(t["gamma"])
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps)
    xhat = x * r
    dx = r * (gy * g - xhat * (gy * g * xhat).mean(-1, keepdim=True))
    if "dres" in t:
        dx = dx + _up(t["dres"])
    dt = t["x"].dtype
    return {"dx": dx.to(dt), "y": (xhat * g).to(dt), "dgamma": (gy * xhat).sum(0).to(dt)}


def _dgrad_ab(t: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    return t["dz"], t["w"].T  # F.linear(dz, W^T) = dz @ W


# ---- backward: SwiGLU (fused into the down-proj dgrad, and elementwise) -----------------------------------

def _swiglu_grads(dy: torch.Tensor, z_pre: torch.Tensor) -> Tensors:
    g, u = _up(z_pre[:, 0::2]), _up(z_pre[:, 1::2])
    s = torch.sigmoid(g)
    dg, du = dy * u * s * (1 + g * (1 - s)), dy * g * s
    dt = z_pre.dtype
    return {"dz_pre": torch.stack([dg, du], -1).reshape(z_pre.shape).to(dt), "a": (g * s * u).to(dt),
            "zdz": (g * dg + u * du).sum(-1)}


def dgrad_swiglu_inputs(m: ModelShape, gen: torch.Generator) -> Tensors:
    return {"dz": _randn(gen, m.tokens, m.hidden), "w": _weight(gen, m.hidden, m.ffn),
            "z_pre": _randn(gen, m.tokens, 2 * m.ffn)}


def swiglu_bwd_inputs(m: ModelShape, gen: torch.Generator) -> Tensors:
    return {"dy": _randn(gen, m.tokens, m.ffn), "z_pre": _randn(gen, m.tokens, 2 * m.ffn)}


def swiglu_bwd_unfused(t: Tensors, m: ModelShape) -> Tensors:
    out = _swiglu_grads(_up(t["dy"]), t["z_pre"])
    return {"dz_pre": out["dz_pre"], "zdz": out["zdz"]}


# ---- backward: RoPE (elementwise) and the CE-scaled LM-head weight gradient --------------------------------

def rope_bwd_inputs(m: ModelShape, gen: torch.Generator) -> Tensors:
    return {"dqkv": _randn(gen, m.tokens, m.qkv_width), "qkv": _randn(gen, m.tokens, m.qkv_width),
            "positions": torch.arange(m.tokens, device="cuda") % m.seq_len,
            "freq": rope_freq_table(m.heads, m.kv_heads, m.head_dim, m.rope_theta, torch.device("cuda"))}


def rope_bwd_unfused(t: Tensors, m: ModelShape) -> Tensors:
    """dz = R^T dqkv (rotate each adjacent pair by minus its angle), zdz = <qkv, dqkv>."""
    dq = _up(t["dqkv"])
    ang = t["positions"].to(dq.dtype)[:, None] * t["freq"].sum(0)[None, :]
    cos, sin = ang.cos(), ang.sin()
    x, y = dq[:, 0::2], dq[:, 1::2]
    dz = torch.stack([x * cos + y * sin, y * cos - x * sin], -1).reshape(dq.shape)
    return {"dz": dz.to(t["dqkv"].dtype), "zdz": (_up(t["qkv"]) * dq).sum(-1)}


def wgrad_lm_inputs(m: ModelShape, gen: torch.Generator) -> Tensors:
    return {"dz": _randn(gen, m.tokens, m.vocab), "y": _randn(gen, m.tokens, m.hidden),
            "scale": torch.full((1,), 1.0 / m.tokens, device="cuda")}


BACKWARD_KERNELS: list[KernelSpec] = [
    KernelSpec("dgrad_norm_gu", dgrad_rmsnorm_inputs(lambda m: 2 * m.ffn, ce=False), dgrad_rmsnorm_fused,
               dgrad_rmsnorm_unfused, _dgrad_ab),
    KernelSpec("dgrad_norm_qkv", dgrad_rmsnorm_inputs(lambda m: m.qkv_width, ce=False), dgrad_rmsnorm_fused,
               dgrad_rmsnorm_unfused, _dgrad_ab),
    KernelSpec("dgrad_norm_ce", dgrad_rmsnorm_inputs(lambda m: m.vocab, ce=True), dgrad_rmsnorm_fused,
               dgrad_rmsnorm_unfused, _dgrad_ab),
    KernelSpec("dgrad_swiglu", dgrad_swiglu_inputs,
               lambda t, m: dict(zip(("dz_pre", "a", "zdz"), dgrad_swiglu(t["dz"], t["w"], t["z_pre"]))),
               lambda t, m: _swiglu_grads(_up(t["dz"] @ t["w"]), t["z_pre"]), _dgrad_ab),
    KernelSpec("swiglu_bwd", swiglu_bwd_inputs,
               lambda t, m: dict(zip(("dz_pre", "zdz"), swiglu_bwd(t["dy"], t["z_pre"]))), swiglu_bwd_unfused, None),
    KernelSpec("rope_bwd", rope_bwd_inputs,
               lambda t, m: dict(zip(("dz", "zdz"), rope_bwd(t["dqkv"], t["qkv"], t["positions"], m.heads,
                                                              m.kv_heads, m.head_dim, m.rope_theta))),
               rope_bwd_unfused, None),
    KernelSpec("wgrad_lm", wgrad_lm_inputs, lambda t, m: {"dw": matmul(t["dz"].T, t["y"], scale=t["scale"])},
               lambda t, m: {"dw": (t["dz"].T @ t["y"]) * t["scale"].to(t["dz"].dtype)},
               lambda t: (t["dz"].T, t["y"].T)),
]
KERNELS += BACKWARD_KERNELS


def model_check(device: str = "cuda") -> list[str]:
    """The CODA Llama vs the standard unfused Llama in bf16 (2 layers, GQA, M = 2048): one line per tensor."""
    shape = ModelShape("check-small", hidden=1024, ffn=2816, heads=16, kv_heads=4, head_dim=64, vocab=8192,
                       tokens=2048, seq_len=1024, rope_theta=500000.0)
    lines = []
    for reduction in ("mean", "sum"):
        for r in check_equivalence(shape, 2, 2, 1024, torch.bfloat16, device, reduction=reduction):
            ok = r.passed
            lines.append(f"  {reduction:4s} {r.name:22s} ours {r.coda:.2e} torch {r.torch:.2e} "
                         f"x{r.coda / max(r.torch, 1e-30):.2f}{'' if ok else ' FAIL'}")
    return lines


# ---- measurement --------------------------------------------------------------------------------------

ROUNDS = 3
"""Rounds in which the fused kernel and its GEMM take turns (:func:`bench_rounds`)."""


def bench(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Keep the GPU busy with large GEMMs for ``seconds`` before the first measurement.

    An idle H100 sits at low clocks; timed straight away, the first kernel of the table ran 1.48x its GEMM
    where the same config measures 1.26x once the GPU is busy.
    """
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def bench_rounds(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median over ROUNDS of each function's :func:`bench`, the functions taking turns within every round.

    Back-to-back single runs of the same cuBLAS GEMM differed by up to 12% on the H100 (clock drift), more
    than the epilogue costs being measured; alternating keeps the fused/GEMM ratio from inheriting it.
    """
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(ROUNDS):
        for k, fn in fns.items():
            samples[k].append(bench(fn))
    return {k: statistics.median(v) for k, v in samples.items()}


def run_kernel(spec: KernelSpec, model: ModelShape, compile_: bool) -> tuple[list[str], dict[str, float]]:
    """Error lines and times (ms) of one kernel on one model."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = spec.inputs(model, gen)
    ours, tuned = with_picked_configs(lambda: spec.fused(t, model))
    theirs = spec.unfused(t, model)
    t64 = {k: (v.double() if v.is_floating_point() else v) for k, v in t.items()}
    ref = spec.unfused(t64, model)
    del t64
    lines = []
    for k, r in ref.items():
        e_ours, e_torch = rel_err(ours[k], r), rel_err(theirs[k], r)
        ok = passes(e_ours, e_torch, torch.bfloat16)
        lines.append(f"{k}: {e_ours:.2e} torch {e_torch:.2e} x{e_ours / max(e_torch, 1e-30):.2f}"
                     f"{'' if ok else ' FAIL'}")
    del ours, theirs, ref
    lines.append(f"config {tuned}")
    timed = {"fused": lambda: spec.fused(t, model)}
    if spec.gemm is not None:
        x, w = spec.gemm(t)
        timed["gemm"] = lambda: F.linear(x, w)
    times = {**bench_rounds(timed), "eager": bench(lambda: spec.unfused(t, model))}
    if compile_:
        try:
            torch._dynamo.reset()
            compiled = torch.compile(lambda inp: spec.unfused(inp, model), fullgraph=True, dynamic=False)
            compiled(t)
            times["compile"] = bench(lambda: compiled(t))
        except Exception as e:  # a torch.compile failure costs only its column
            lines.append(f"torch.compile failed: {type(e).__name__}")
    return lines, times


def autotuners() -> list[Autotuner]:
    """Every autotuned CODA kernel."""
    return [v for name, mod in list(sys.modules.items()) if name.startswith("kernels.") for v in vars(mod).values()
            if isinstance(v, Autotuner)]


def short_config(fn_name: str, cfg: triton.Config) -> str:
    kw = cfg.kwargs
    sub = f"/{kw['EPI_SUB']}" if "EPI_SUB" in kw else ""
    return f"{fn_name.removesuffix('_kernel')}:{kw['BM']}x{kw['BN']}x{kw['BK']}{sub} s{cfg.num_stages} w{cfg.num_warps}"


def with_picked_configs(fn: Callable[[], Tensors]) -> tuple[Tensors, str]:
    """``fn()`` and the tile config of each autotuned kernel launch it made (the tuners' caches also hold the
    winners of every other shape that the on-disk cache knows, so they are read per launch)."""
    launches, tuners = [], autotuners()
    runs = [a.run for a in tuners]  # tuning.attach's wrapper, or the class's own
    for a, run in zip(tuners, runs):
        def spy(*args, _a=a, _run=run, **kwargs):
            launches.append((_a, tuning.tuning_key(_a, args, kwargs)))
            return _run(*args, **kwargs)
        a.run = spy
    try:
        out = fn()
    finally:
        for a, run in zip(tuners, runs):
            a.run = run
    picked = dict.fromkeys(short_config(a.base_fn.__name__, a.cache[k]) for a, k in launches if k in a.cache)
    return out, ", ".join(picked)


def fmt(v: float | None, spec: str = "7.3f") -> str:
    return format(v, spec) if v is not None else " " * (int(spec.split(".")[0]) - 1) + "-"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="llama-1b,llama-7b,llama-70b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--kernels", default=",".join(k.name for k in KERNELS))
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column (saves compile time)")
    p.add_argument("--model-check", action="store_true", help="also check the CODA Llama against the standard Llama")
    args = p.parse_args()
    wanted = args.kernels.split(",")
    unknown = set(wanted) - {k.name for k in KERNELS}
    if unknown:
        raise SystemExit(f"unknown kernel(s) {sorted(unknown)}; known: {[k.name for k in KERNELS]}")
    print(f"device {torch.cuda.get_device_name()} triton {triton.__version__} torch {torch.__version__}, bf16, "
          f"M = {args.tokens}; times in ms (median, L2 flushed); errors: rel. Frobenius vs float64")
    head = (f"{'model':10s} {'kernel':14s} {'fused':>7s} {'gemm':>7s} {'f/gemm':>6s} {'eager':>7s} {'compile':>7s} "
            f"{'eag/f':>6s} {'cmp/f':>6s} {'took':>5s}  errors (ours, torch, ratio)")
    print(head, flush=True)
    warm_up_gpu()
    start = time.time()
    rows = []
    for name in args.models.split(","):
        model = get_model(name, tokens=args.tokens)
        for spec in (k for k in KERNELS if k.name in wanted):
            t0 = time.time()
            try:
                lines, tm = run_kernel(spec, model, not args.no_compile)
            except Exception as e:  # one failing kernel must not stop the table
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]
                print(f"{name:10s} {spec.name:14s} ERROR {msg}", flush=True)
                traceback.print_exc(limit=2)
                rows.append((name, spec.name, "ERROR"))
                continue
            finally:
                torch.cuda.empty_cache()
            fused, gemm, eager, comp = tm["fused"], tm.get("gemm"), tm["eager"], tm.get("compile")
            ratio = fused / gemm if gemm else None
            print(f"{name:10s} {spec.name:14s} {fmt(fused)} {fmt(gemm)} {fmt(ratio, '6.3f')} {fmt(eager)} "
                  f"{fmt(comp)} {fmt(eager / fused, '6.2f')} {fmt(comp / fused if comp else None, '6.2f')} "
                  f"{time.time() - t0:4.0f}s  " + "; ".join(lines), flush=True)
            failed = [line.split(":")[0] for line in lines if line.endswith("FAIL")]
            fails = f"  error FAIL: {', '.join(failed)}" if failed else ""
            rows.append((name, spec.name, fmt(ratio, "6.3f") + fails))
    print(f"\nfused / plain cuBLAS GEMM (target <= 1.03-1.10 forward), {time.time() - start:.0f} s in all:")
    for name, kernel, summary in rows:
        print(f"  {name:10s} {kernel:14s} {summary}")
    if args.model_check:
        print("\nCODA Llama vs standard Llama, bf16, loss and every parameter gradient vs float64:", flush=True)
        try:
            lines = model_check()
            print("\n".join(lines))
            print(f"model check: {sum(line.endswith('FAIL') for line in lines)} FAIL of {len(lines)}")
        except Exception:  # the table above stands on its own
            traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
