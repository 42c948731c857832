"""The kernel-level ops (``Op.level`` ``kernel``, the kernels suite): each reference against an independent
formulation in float64 (autograd for the backward ops, complex numbers for RoPE, F.rms_norm for the row scale), the
inputs' saved statistics against the tensors they summarize, and the coda-triton implementation of every op of the
suite through the harness's correctness check (CPU, Triton interpreter, the tiny model)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from codabench.case import Case
from codabench.correctness import CHECK_SEED, build_reference, check_impl
from codabench.registry import REGISTRY
from kernels.coda import plugin  # noqa: F401  (registers coda-triton)
from workloads import reference as R
from workloads.models import get_model
from workloads.ops import OPS
from workloads.suites import KERNEL_SUITE_OPS

TINY = get_model("tiny")
H, HKV, DH, EPS = TINY.heads, TINY.kv_heads, TINY.head_dim, TINY.eps
CPU = torch.device("cpu")


def inputs64(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The op's inputs at the tiny shape, drawn in fp32 and held in float64."""
    inp = OPS[name].make_inputs(TINY, torch.float32, "cpu", seed)
    return {k: (v.double() if v.is_floating_point() else v) for k, v in inp.items()}


def reference(name: str, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return OPS[name].reference(inp, TINY)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def normed(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """x, gamma and the consumer inputs h = x * gamma, rstd(x) made from them, float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TINY.tokens, TINY.hidden, generator=g, dtype=torch.float64)
    gamma = 1 + 0.1 * torch.randn(TINY.hidden, generator=g, dtype=torch.float64)
    return x, gamma, {"h": x * gamma, "rstd": torch.rsqrt(x.pow(2).mean(-1) + EPS)}


def rope_complex(t: torch.Tensor, positions: torch.Tensor, sign: int = 1) -> torch.Tensor:
    """Half-split RoPE on the q and k heads of packed t as a complex product: pair i of a head is
    ``t_i + 1j t_{i + dh/2}``, times ``exp(sign 1j pos theta^(-2i/dh))``."""
    m, half = t.shape[0], DH // 2
    q_k, v = t[:, :(H + HKV) * DH], t[:, (H + HKV) * DH:]
    heads = q_k.reshape(m, H + HKV, 2, half)
    c = torch.complex(heads[:, :, 0], heads[:, :, 1])
    freq = TINY.rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / DH)
    angle = sign * positions.double()[:, None, None] * freq
    c = c * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([torch.stack([c.real, c.imag], 2).reshape(m, -1), v], -1)


# ---- references against independent formulations ----------------------------------------------------------

@pytest.mark.parametrize("name", ["producer_out", "producer_down"])
def test_producer_reference(name):
    inp = inputs64(name)
    out = reference(name, inp)
    x = inp["residual"] + inp["a"] @ inp["w"].T
    close(out["x"], x)
    close(out["h"] * out["rstd"][:, None], F.rms_norm(x, (TINY.hidden,), inp["gamma"], EPS))
    assert inp["a"].shape[1] == {"producer_out": TINY.attn_width, "producer_down": TINY.ffn}[name]


def test_norm_input_reference():
    inp = inputs64("norm_input")
    out = reference("norm_input", inp)
    close(out["h"] * out["rstd"][:, None], F.rms_norm(inp["x"], (TINY.hidden,), inp["gamma"], EPS))


def test_scaled_linear_reference():
    x, gamma, inp = normed()
    w = torch.randn(2 * TINY.ffn, TINY.hidden, dtype=torch.float64)
    close(reference("scaled_linear", {**inp, "w": w})["z"], F.rms_norm(x, (TINY.hidden,), gamma, EPS) @ w.T)


@pytest.mark.parametrize("name", ["gemm_swiglu", "gemm_swiglu_save"])
def test_gemm_swiglu_reference(name):
    x, gamma, inp = normed()
    wg, wu = (torch.randn(TINY.ffn, TINY.hidden, dtype=torch.float64) for _ in range(2))
    out = reference(name, {**inp, "w_gate": wg, "w_up": wu})
    n = F.rms_norm(x, (TINY.hidden,), gamma, EPS)
    gate, up = n @ wg.T, n @ wu.T
    close(out["y"], gate * torch.sigmoid(gate) * up)
    assert set(out) == set(OPS[name].outputs)
    if name == "gemm_swiglu_save":
        close(out["gate"], gate)
        close(out["up"], up)


def test_gemm_rope_reference():
    x, gamma, inp = normed()
    w = torch.randn(TINY.qkv_width, TINY.hidden, dtype=torch.float64)
    pos = torch.arange(TINY.tokens) % TINY.seq_len
    out = reference("gemm_rope", {**inp, "w_qkv": w, "positions": pos})
    close(out["qkv"], rope_complex(F.rms_norm(x, (TINY.hidden,), gamma, EPS) @ w.T, pos))
    assert OPS["gemm_rope"].make_inputs(TINY, torch.float32, "cpu", 0)["positions"].max() == TINY.seq_len - 1


@pytest.mark.parametrize("name", ["gemm_ce", "gemm_ce_grad"])
def test_gemm_ce_reference(name):
    x, gamma, inp = normed()
    w = torch.randn(TINY.vocab, TINY.hidden, dtype=torch.float64)
    target = OPS[name].make_inputs(TINY, torch.float32, "cpu", 0)["target"]
    assert 0 < (target == -100).sum() < TINY.tokens // 4  # about 5% ignored
    out = reference(name, {**inp, "w_lm": w, "target": target})
    logits = (F.rms_norm(x, (TINY.hidden,), gamma, EPS) @ w.T).requires_grad_()
    loss_sum = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    (dlogits,) = torch.autograd.grad(loss_sum, logits)  # softmax - onehot on the rows that count, 0 elsewhere
    valid = target != -100
    close(out["loss"], loss_sum.detach() / valid.sum())
    close(out["lse"], torch.logsumexp(logits.detach(), -1))
    if name == "gemm_ce_grad":
        close(out["dlogits"], dlogits)
        close(out["zdz"], (logits.detach() * dlogits).sum(-1))
        assert (out["dlogits"][~valid] == 0).all()


@pytest.mark.parametrize("name", ["rmsnorm_dgrad", "rmsnorm_dgrad_qkv", "rmsnorm_dgrad_lm"])
def test_rmsnorm_dgrad_references_are_autograd(name):
    """dx, dgamma, y of the loss ``s <rmsnorm(x; gamma) W^T, dz> (+ <x, dres>)`` by autograd; the saved rstd and zdz
    are those of x and of z = y W^T."""
    op = OPS[name]
    inp = inputs64(name)
    assert inp["dz"].shape[1] == op.width(TINY)
    x, gamma = inp["x"].clone().requires_grad_(), inp["gamma"].clone().requires_grad_()
    y = F.rms_norm(x, (TINY.hidden,), gamma, EPS)
    z = y @ inp["w"].T
    s = inp["scale"] if op.loss_scaled else 1.0
    loss = s * (z * inp["dz"]).sum() + ((x * inp["dres"]).sum() if "dres" in inp else 0.0)
    dx, dgamma = torch.autograd.grad(loss, [x, gamma])
    out = reference(name, inp)
    close(out["dx"], dx)
    close(out["dgamma"], dgamma)
    close(out["y"], y.detach())
    torch.testing.assert_close(inp["rstd"], R.rstd(inp["x"], EPS), rtol=1e-6, atol=0)  # fp32-exact statistics
    torch.testing.assert_close(inp["zdz"], (z * inp["dz"]).sum(-1).detach(), rtol=1e-5, atol=1e-5)
    assert ("scale" in inp) == op.loss_scaled and ("dres" in inp) != op.loss_scaled


@pytest.mark.parametrize("name", ["swiglu_bwd", "swiglu_dgrad"])
def test_swiglu_backward_references_are_autograd(name):
    inp = inputs64(name)
    gate, up = inp["gate"].clone().requires_grad_(), inp["up"].clone().requires_grad_()
    dy = inp["dy"] if name == "swiglu_bwd" else inp["dx"] @ inp["w_down"]
    y = F.silu(gate) * up
    dgate, dup = torch.autograd.grad(y, [gate, up], dy)
    out = reference(name, inp)
    close(out["dgate"], dgate)
    close(out["dup"], dup)
    close(out["zdz"], (inp["gate"] * dgate + inp["up"] * dup).sum(-1))


def test_rope_bwd_reference_is_the_transposed_rotation():
    """dz is autograd's gradient through the forward RoPE (the transpose, not the inverse, of the rotation), also the
    complex product by exp(-i angle); zdz = <qkv, dqkv> = <z, dz> for z the pre-RoPE value of qkv."""
    inp = inputs64("rope_bwd")
    out = reference("rope_bwd", inp)
    z = torch.zeros_like(inp["dqkv"], requires_grad=True)
    (dz,) = torch.autograd.grad(rope_complex(z, inp["positions"]), z, inp["dqkv"])
    close(out["dz"], dz)
    close(out["dz"], rope_complex(inp["dqkv"], inp["positions"], sign=-1))
    z_of_qkv = rope_complex(inp["qkv"], inp["positions"], sign=-1)
    close(out["zdz"], (z_of_qkv * out["dz"]).sum(-1))


def test_lm_head_wgrad_reference_is_autograd():
    inp = inputs64("lm_head_wgrad")
    w = torch.zeros(TINY.vocab, TINY.hidden, dtype=torch.float64, requires_grad=True)
    (dw,) = torch.autograd.grad(inp["scale"] * ((inp["y"] @ w.T) * inp["dz"]).sum(), w)
    close(reference("lm_head_wgrad", inp)["dw"], dw)
    assert float(inp["scale"]) == pytest.approx(1 / TINY.tokens, rel=1e-7)  # fp32


# ---- the op contract ---------------------------------------------------------------------------------------

def test_kernel_ops_are_direct_and_their_gemms_have_the_kernels_shapes():
    m, d, f, q, v = TINY.tokens, TINY.hidden, TINY.ffn, TINY.qkv_width, TINY.vocab
    gemms = {name: [(g.m, g.n, g.k, g.a_layout, g.b_layout) for g in OPS[name].gemms(TINY, OPS[name].modes[0])]
             for name in KERNEL_SUITE_OPS}
    assert gemms == {
        "producer_out": [(m, d, TINY.attn_width, "mk", "nk")], "producer_down": [(m, d, f, "mk", "nk")],
        "scaled_linear": [(m, 2 * f, d, "mk", "nk")], "gemm_swiglu": [(m, 2 * f, d, "mk", "nk")],
        "gemm_swiglu_save": [(m, 2 * f, d, "mk", "nk")], "gemm_rope": [(m, q, d, "mk", "nk")],
        "gemm_ce": [(m, v, d, "mk", "nk")], "gemm_ce_grad": [(m, v, d, "mk", "nk")], "norm_input": [],
        "rmsnorm_dgrad": [(m, d, 2 * f, "mk", "kn")], "rmsnorm_dgrad_qkv": [(m, d, q, "mk", "kn")],
        "rmsnorm_dgrad_lm": [(m, d, v, "mk", "kn")], "swiglu_dgrad": [(m, f, d, "mk", "kn")], "swiglu_bwd": [],
        "rope_bwd": [], "lm_head_wgrad": [(v, d, m, "km", "kn")]}
    for name in KERNEL_SUITE_OPS:
        op = OPS[name]
        assert op.kind == "direct" and len(op.modes) == 1, name
        assert op.level == ("pattern" if name in ("rmsnorm_dgrad", "swiglu_dgrad") else "kernel"), name
        out = op.reference(op.make_inputs(TINY, torch.float32, "cpu", 0), TINY)
        assert set(op.outputs) | set(op.side_outputs) == set(out), name


# ---- coda-triton through the harness's check -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("name", KERNEL_SUITE_OPS)
def test_coda_triton_passes_the_harness_check(name, dtype):
    op, impl = OPS[name], REGISTRY.get(name, "coda-triton")
    mode = op.modes[0]
    case = Case(op, TINY, mode, dtype, CPU, op.inputs(TINY, dtype, CPU, CHECK_SEED))
    assert impl.skip_reason(case) is None
    outcome = check_impl(build_reference(op, case), impl)
    assert outcome.correct, (outcome.errors, [(c.output, c.stats, c.torch_rel_err) for c in outcome.checks])
    assert {c.output for c in outcome.checks} == set(op.outputs) | set(op.side_outputs)
