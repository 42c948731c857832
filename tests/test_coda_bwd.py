"""CODA backward kernels and autograd Functions against float64 references (CPU, Triton interpreter).

Shapes are multiples of 8 but not of the interpreter's 32x32x32 tile, so every edge is masked. Each output
passes when its relative error is at most 2x that of plain PyTorch in the same dtype plus a floor (the
suite's pass rule), and each fused kernel is checked to be one launch plus the finishing reductions its
math needs. The tests of a host function, of the autograd Functions and of the plugin run both paths of the
kernels (the ``strategy`` fixture).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from codabench.case import Case
from codabench.correctness import CHECK_SEED, build_reference, check_impl
from codabench.metrics import rel_err
from codabench.registry import REGISTRY
from kernels import layouts as L
from kernels.coda import plugin  # noqa: F401  (registers coda-triton)
from kernels.coda import cross_entropy_bwd
from kernels.coda.cross_entropy_bwd import ce_chunk_rows, ce_grad_scale, rescale_
from kernels.coda.gemm import matmul
from kernels.coda.functions import CrossEntropy, Linear, RoPE, SwiGLU, block, norm_consumer, producer_consumer
from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm
from kernels.coda.rope_bwd import rope_bwd
from kernels.coda.swiglu_bwd import dgrad_swiglu, swiglu_bwd
from workloads import reference as R
from workloads.models import ModelShape, get_model
from workloads.ops import OPS

from kernel_helpers import DTYPES, check, launches, rand

TINY = get_model("tiny")  # M 48, d 72, f 88, 4 heads / 2 kv heads of 16, vocab 200
H, HKV, DH = TINY.heads, TINY.kv_heads, TINY.head_dim


def f64(inp: dict) -> dict:
    return {k: (v.double() if v.is_floating_point() else v) for k, v in inp.items()}


# ---- kernels --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["residual", "scaled_no_residual", "inplace"])
def test_dgrad_rmsnorm(dtype, variant, strategy):
    op = OPS["rmsnorm_dgrad"]
    inp = op.make_inputs(TINY, dtype, "cpu", seed=1)
    ref, tor = op.reference(f64(inp), TINY), op.reference(inp, TINY)
    scale = 1.0
    if variant == "scaled_no_residual":  # the CE path: dz = s * dlogits, no residual gradient
        scale = torch.tensor(0.5)
        inp["dres"] = torch.zeros_like(inp["dres"])  # reference: dx + 0
        ref, tor = op.reference(f64({**inp, "dz": inp["dz"] * 0.5}), TINY), op.reference({**inp, "dz": inp["dz"] * 0.5}, TINY)
    dres = None if variant == "scaled_no_residual" else inp["dres"].clone()
    with launches() as names:
        dx, y, dgamma = dgrad_rmsnorm(inp["dz"], inp["w"], inp["x"], inp["rstd"], inp["gamma"], inp["zdz"], dres,
                                      dz_scale=scale, inplace=variant == "inplace")
    assert names == [{"fused": "dgrad_rmsnorm_kernel", "split": "dgrad_rmsnorm_rows_kernel"}[strategy], "col_sum_kernel"]
    if variant == "inplace":
        assert dx.data_ptr() == dres.data_ptr()
    check("dx", dx, ref["dx"], tor["dx"])
    check("y", y, ref["y"], tor["y"])
    check("dgamma", dgamma, ref["dgamma"], tor["dgamma"])


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dgrad_swiglu(dtype, strategy, overwrite):
    op = OPS["swiglu_dgrad"]
    inp = op.make_inputs(TINY, dtype, "cpu", seed=2)
    ref, tor = op.reference(f64(inp), TINY), op.reference(inp, TINY)
    z_pre = L.interleave_cols(inp["gate"], inp["up"])
    with launches() as names:
        dz_pre, y, zdz = dgrad_swiglu(inp["dx"], inp["w_down"], z_pre, overwrite=overwrite)
    first = {"fused": "dgrad_swiglu_kernel", "split": "dgrad_swiglu_rows_kernel"}[strategy]
    assert names == [first, "row_sum_kernel"]  # either way, the kernel's zdz partials are then summed
    assert (dz_pre.data_ptr() == z_pre.data_ptr()) == overwrite
    dgate, dup = L.deinterleave_cols(dz_pre)
    for name, out in [("dgate", dgate), ("dup", dup), ("a", y), ("zdz", zdz)]:
        check(name, out, ref[name], tor[name])


def swiglu_grads(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(dgate, dup, zdz) by autograd through silu(gate) * up, in the inputs' dtype (zdz in fp32 or fp64)."""
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    R.swiglu(g, u).backward(dy)
    acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
    zdz = (g.to(acc) * g.grad.to(acc) + u.to(acc) * u.grad.to(acc)).sum(-1)
    return g.grad, u.grad, zdz


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_bwd_elementwise(dtype):
    M, f = 40, 88  # three column blocks of the interpreter's 32 (one masked), three row blocks (one masked)
    dy, gate, up = (rand(M, f, dtype=dtype, seed=s) for s in (3, 4, 5))
    ref, tor = swiglu_grads(dy.double(), gate.double(), up.double()), swiglu_grads(dy, gate, up)
    with launches() as names:
        dz_pre, zdz = swiglu_bwd(dy, L.interleave_cols(gate, up))
    assert names == ["swiglu_bwd_kernel", "row_sum_kernel"]  # blocks, then the sum of their row partials
    dgate, dup = L.deinterleave_cols(dz_pre)
    for name, out, r, t in zip(("dgate", "dup", "zdz"), (dgate, dup, zdz), ref, tor):
        check(name, out, r, t)


def rope_grads(z: torch.Tensor, dqkv: torch.Tensor, pos: torch.Tensor):
    """(qkv, dz, zdz) by autograd through the half-split RoPE reference, in z's dtype."""
    zl = z.clone().requires_grad_()
    qkv = R.qkv_rope(zl, pos, H, HKV, DH, TINY.rope_theta)
    qkv.backward(dqkv)
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    return qkv.detach(), zl.grad, (qkv.detach().to(acc) * dqkv.to(acc)).sum(-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_bwd(dtype):
    M, q = TINY.tokens, TINY.qkv_width
    z, dqkv = rand(M, q, dtype=dtype, seed=6), rand(M, q, dtype=dtype, seed=7)
    pos = (torch.arange(M) * 797) % 60000  # large positions: angles up to 6e4 rad
    qkv64, ref_dz, ref_zdz = rope_grads(z.double(), dqkv.double(), pos)
    qkv_t, tor_dz, tor_zdz = rope_grads(z, dqkv, pos)
    adj = lambda t: L.qkv_cols_to_adjacent(t, H, HKV, DH)  # noqa: E731
    with launches() as names:
        dz, zdz = rope_bwd(adj(dqkv), adj(qkv_t), pos, H, HKV, DH, TINY.rope_theta)
    assert names == ["rope_bwd_kernel", "row_sum_kernel"]  # blocks, then the sum of their zdz partials
    check("dz", L.qkv_cols_to_halfsplit(dz, H, HKV, DH), ref_dz, tor_dz)
    check("zdz", zdz, ref_zdz, tor_zdz)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dgrad_rmsnorm_without_zdz_takes_it_from_gy_on_the_split_path(dtype, strategy):
    """A consumer that keeps no z (the plain linear) gives no ZdZ: the split path takes c from each whole row of the
    dgrad output, (1/d) sum_j gy_j gamma_j xhat_j, in its one row pass under every strategy (the fused epilogue needs c
    before its first tile); the results pass against the reference built from the saved zdz."""
    op = OPS["rmsnorm_dgrad"]
    inp = op.make_inputs(TINY, dtype, "cpu", seed=1)
    ref, tor = op.reference(f64(inp), TINY), op.reference(inp, TINY)
    with launches() as names:
        dx, y, dgamma = dgrad_rmsnorm(inp["dz"], inp["w"], inp["x"], inp["rstd"], inp["gamma"], None,
                                      inp["dres"].clone())
    assert names == ["dgrad_rmsnorm_rows_kernel", "col_sum_kernel"]
    for name, out in [("dx", dx), ("y", y), ("dgamma", dgamma)]:
        check(name, out, ref[name], tor[name])


def test_dgrad_rmsnorm_reads_the_zdz_it_is_given(strategy):
    """With a ZdZ, c comes from it on every path (the split kernel takes c from the rows of gy only without one): a
    zdz one higher per row moves dx by -rstd xhat / d, as c = zdz / d says."""
    inp = OPS["rmsnorm_dgrad"].make_inputs(TINY, torch.float32, "cpu", seed=1)
    args = (inp["dz"], inp["w"], inp["x"], inp["rstd"], inp["gamma"])
    dx, _, _ = dgrad_rmsnorm(*args, inp["zdz"])
    moved, _, _ = dgrad_rmsnorm(*args, inp["zdz"] + 1.0)
    rstd = inp["rstd"][:, None]
    torch.testing.assert_close(moved - dx, -rstd * (inp["x"] * rstd) / TINY.hidden, rtol=1e-3, atol=1e-5)


def test_ce_grad_scale_and_scaled_matmul_epilogue():
    target = torch.tensor([3, -100, 5, 7, -100, 1, 0, 2])
    dloss = torch.tensor(3.0)
    assert ce_grad_scale(dloss, target, reduction="mean").item() == pytest.approx(3.0 / 6, rel=1e-7)
    assert ce_grad_scale(dloss, target, reduction="sum").item() == 3.0
    a, b = rand(40, 72, seed=10), rand(40, 56, seed=11)
    s = torch.tensor([0.37])
    with launches() as names:
        c = matmul(a.T, b, scale=s)  # transposed A (the weight-gradient layout dz^T y)
    assert names == ["gemm_kernel"]
    check("matmul(scale=s)", c, 0.37 * (a.double().T @ b.double()), 0.37 * (a.T @ b))


def test_matmul_accumulates_in_place():
    """``acc``: C += s (A @ B) in C's dtype (fp32 here, from fp16 operands: a weight gradient summed over chunks)."""
    a, b, c0 = rand(40, 72, dtype=torch.float16, seed=12), rand(40, 56, dtype=torch.float16, seed=13), rand(72, 56)
    acc, s = c0.clone(), torch.tensor([0.37])
    with launches() as names:
        out = matmul(a.T, b, scale=s, acc=acc)
    assert names == ["gemm_kernel"] and out is acc and acc.dtype == torch.float32
    check("matmul(acc=C)", acc, c0.double() + 0.37 * (a.double().T @ b.double()), c0 + 0.37 * (a.float().T @ b.float()))
    with pytest.raises(ValueError, match="row-major"):
        matmul(a.T, b, acc=torch.zeros(56, 72).T)


# ---- autograd Functions ---------------------------------------------------------------------------------

def consumers(model: ModelShape, pos: torch.Tensor, target: torch.Tensor):
    """(name, consumer, weight rows, reference of the output from the normalized activation and W)."""
    qkv = (model.heads, model.kv_heads, model.head_dim)
    rope = lambda n, w: R.qkv_rope(F.linear(n, w), pos, *qkv, model.rope_theta)  # noqa: E731
    swiglu = lambda n, w: R.swiglu(F.linear(n, w[0::2]), F.linear(n, w[1::2]))  # noqa: E731
    return {
        "linear": (Linear(), 2 * model.ffn, F.linear),
        "swiglu": (SwiGLU(), 2 * model.ffn, swiglu),
        "rope": (RoPE(pos, *qkv, model.rope_theta), model.qkv_width,  # W and the output in adjacent-pair layout
                 lambda n, w: L.qkv_cols_to_adjacent(rope(n, L.qkv_rows_to_halfsplit(w, *qkv)), *qkv)),
        "ce": (CrossEntropy(target, reduction="sum"), model.vocab,
               lambda n, w: R.cross_entropy(F.linear(n, w), target, "sum")),
    }


def grads_of(fn, inputs: list[torch.Tensor], dout: torch.Tensor):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


COMPOSITIONS = ["producer_consumer", "block", "norm_consumer"]


def composition_case(composition: str, model: ModelShape, consumer, n_out: int, ref_out):
    """``(inputs, ours, ref)``: the composition's differentiable inputs (fp32, W of ``n_out`` rows last) and its
    outputs ``(x, consumer output)`` (norm_consumer: the consumer output alone) by the CODA Function and by the
    torch reference (``ref_out`` of the normalized activation and W)."""
    m, d, f, eps = model.tokens, model.hidden, model.ffn, model.eps
    gamma, w = rand(d, seed=20, scale=0.1, mean=1.0), rand(n_out, d, seed=21, scale=d ** -0.5)
    if composition == "norm_consumer":
        inputs = [rand(m, d, seed=22), gamma, w]
        ours = lambda x, g, w: norm_consumer(x, g, w, consumer, eps)[:1]  # noqa: E731
        ref = lambda x, g, w: (ref_out(R.rmsnorm(x, g, eps), w),)  # noqa: E731
    elif composition == "producer_consumer":
        inputs = [rand(m, 56, seed=22), rand(m, d, seed=23), rand(d, 56, seed=24, scale=56 ** -0.5), gamma, w]
        ours = lambda *t: producer_consumer(*t, consumer, eps)[:2]  # noqa: E731
        ref = lambda *t: _pc_ref(*t, ref_out, eps)  # noqa: E731
    else:
        inputs = [rand(m, 64, seed=22), rand(m, d, seed=23), rand(d, 64, seed=24, scale=64 ** -0.5),
                  rand(d, seed=25, scale=0.1, mean=1.0), rand(2 * f, d, seed=26, scale=d ** -0.5),
                  rand(d, f, seed=27, scale=f ** -0.5), gamma, w]
        ours = lambda *t: block(*t, consumer, eps)[:2]  # noqa: E731
        ref = lambda *t: _block_ref(*t, ref_out, eps)  # noqa: E731
    return inputs, ours, ref


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("consumer_name", ["linear", "swiglu", "rope", "ce"])
def test_functions_match_autograd(composition, consumer_name, strategy):
    """Output and every input gradient of each composition x consumer, fp32, against fp64 autograd."""
    model = TINY.with_(tokens=48)
    m = model.tokens
    pos = torch.arange(m) % model.seq_len
    target = torch.randint(0, model.vocab, (m,), generator=torch.Generator().manual_seed(0))
    target[::5] = R.IGNORE_INDEX
    consumer, n_out, ref_out = consumers(model, pos, target)[consumer_name]
    inputs, ours_t, ref_t = composition_case(composition, model, consumer, n_out, ref_out)
    ours = lambda *t: flat(*ours_t(*t))  # noqa: E731
    ref = lambda *t: flat(*ref_t(*t))  # noqa: E731
    n_flat = ref(*[t.double() for t in inputs]).numel()
    dout = rand(n_flat, seed=30)
    if consumer_name == "ce":  # a scalar loss gets one upstream gradient: 1.7 (exercises the loss scale)
        dout[-1] = 1.7
    out64, g64 = grads_of(ref, [t.double() for t in inputs], dout.double())
    out32, g32 = grads_of(ref, inputs, dout)
    out, g = grads_of(ours, inputs, dout)
    check("out", out, out64, out32)
    for i, (a, r, t) in enumerate(zip(g, g64, g32)):
        check(f"grad {i}", a, r, t)


def flat(*ts: torch.Tensor) -> torch.Tensor:
    """The outputs as one vector (x and the consumer's output), so one upstream gradient covers both."""
    return torch.cat([t.reshape(-1) for t in ts])


def _pc_ref(a, residual, w_p, gamma, w, ref_out, eps):
    x = residual + F.linear(a, w_p)
    return x, ref_out(R.rmsnorm(x, gamma, eps), w)


def _block_ref(a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w, ref_out, eps):
    x1 = residual + F.linear(a, w_o)
    h1 = R.rmsnorm(x1, gamma_mlp, eps)
    x = x1 + F.linear(R.swiglu(F.linear(h1, w_gu[0::2]), F.linear(h1, w_gu[1::2])), w_down)
    return x, ref_out(R.rmsnorm(x, gamma, eps), w)


def test_block_backward_launches():
    """Backward of the block: 1 elementwise + 3 fused dgrad GEMMs + 3 small sums + 5 plain GEMMs, nothing else."""
    model = TINY.with_(tokens=48)
    m, d, f = model.tokens, model.hidden, model.ffn
    pos = torch.arange(m) % model.seq_len
    inputs = [rand(m, 64, seed=1), rand(m, d, seed=2), rand(d, 64, seed=3, scale=0.1), rand(d, seed=4, mean=1.0),
              rand(2 * f, d, seed=5, scale=0.1), rand(d, f, seed=6, scale=0.1), rand(d, seed=7, mean=1.0),
              rand(model.qkv_width, d, seed=8, scale=0.1)]
    leaves = [t.requires_grad_() for t in inputs]
    rope = RoPE(pos, model.heads, model.kv_heads, model.head_dim, model.rope_theta)
    with launches() as fwd:
        x, qkv, *_ = block(*leaves, rope, model.eps)
    assert fwd == ["gemm_residual_norm_kernel", "rstd_kernel", "gemm_swiglu_kernel", "gemm_residual_norm_kernel",
                   "rstd_kernel", "gemm_rope_kernel"]
    with launches() as bwd:
        torch.autograd.backward([x, qkv], [torch.ones_like(x), torch.ones_like(qkv)])
    assert bwd == ["rope_bwd_kernel", "row_sum_kernel", "dgrad_rmsnorm_kernel", "col_sum_kernel", "gemm_kernel",
                   "dgrad_swiglu_kernel", "row_sum_kernel", "gemm_kernel", "dgrad_rmsnorm_kernel", "col_sum_kernel",
                   "gemm_kernel", "gemm_kernel", "gemm_kernel"]
    assert all(t.grad is not None for t in leaves)


def test_no_grad_forward_saves_nothing(monkeypatch):
    """Without grad the LM head never writes logits (with_grad=False) and no graph is recorded."""
    from kernels.coda import functions

    calls: list[bool] = []
    for module in (functions, cross_entropy_bwd):  # the forward alone; the chunked gradient pass
        real = module.gemm_cross_entropy
        monkeypatch.setattr(module, "gemm_cross_entropy",
                            lambda *a, real=real, **k: calls.append(k.get("with_grad", False)) or real(*a, **k))
    model = TINY
    x, g = rand(model.tokens, model.hidden, seed=1), rand(model.hidden, seed=2, mean=1.0)
    w = rand(model.vocab, model.hidden, seed=3, scale=0.1).requires_grad_()
    target = torch.randint(0, model.vocab, (model.tokens,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss_ng = norm_consumer(x, g, w, CrossEntropy(target), model.eps)[0]
    loss = norm_consumer(x, g, w, CrossEntropy(target), model.eps)[0]
    assert calls == [False, True]
    assert loss_ng.grad_fn is None and loss.requires_grad
    torch.testing.assert_close(loss_ng, loss.detach(), rtol=1e-6, atol=1e-6)


# ---- cross-entropy: the gradients computed in forward, over chunks of rows ---------------------------------

CE_MODEL = TINY.with_(tokens=40)  # 40 rows: chunks of 16, 16 and 8 rows; vocab 200, d 72
CE_CHUNK = 16


def ce_target(model: ModelShape) -> torch.Tensor:
    target = torch.randint(0, model.vocab, (model.tokens,), generator=torch.Generator().manual_seed(3))
    target[::5] = R.IGNORE_INDEX
    return target


def ce_grads(fn, inputs: list[torch.Tensor], dloss: float, dx_out: torch.Tensor | None):
    """(loss, input gradients) of ``fn`` (outputs ``(x, loss)`` or ``(loss,)``) for upstream gradients dloss and
    dx_out (None: x unused); a second backward on the same graph must add the very same gradients."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    *x, loss = fn(*leaves)
    outs, grads = [loss], [torch.tensor(dloss, dtype=loss.dtype)]
    if dx_out is not None:
        outs, grads = outs + x, grads + [dx_out.to(x[0].dtype)]
    torch.autograd.backward(outs, grads, retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    torch.autograd.backward(outs, grads)
    for i, (g, t) in enumerate(zip(first, leaves)):
        assert torch.equal(t.grad, 2 * g), f"grad {i}: the first backward changed what the second one reads"
    return loss.detach(), first


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("reduction,dloss", [("mean", 1.0), ("mean", 3.0), ("sum", 3.0)])
def test_ce_chunks_match_autograd(composition, reduction, dloss):
    """Cross-entropy over 3 chunks (ignored rows, M not a multiple of the chunk): the loss and every input gradient
    against fp64 autograd and against one chunk. dloss 1: the loss alone, x unused (the LM head in apply_coda);
    dloss 3: x gets an upstream gradient too (producer_consumer, block)."""
    model, target = CE_MODEL, ce_target(CE_MODEL)
    ref_out = lambda n, w: R.cross_entropy(F.linear(n, w), target, reduction)  # noqa: E731
    dx_out = rand(model.tokens, model.hidden, seed=31) if dloss != 1 and composition != "norm_consumer" else None
    results = {}
    for chunk in (CE_CHUNK, None):  # None: the default rule, one chunk of 40 rows here
        inputs, ours, ref = composition_case(composition, model, CrossEntropy(target, reduction=reduction,
                                                                              chunk_rows=chunk), model.vocab, ref_out)
        with launches() as names:
            results[chunk] = ce_grads(ours, inputs, dloss, dx_out)
        assert names.count("gemm_cross_entropy_kernel") == (3 if chunk else 1)
    loss64, g64 = ce_grads(ref, [t.double() for t in inputs], dloss, dx_out)
    loss32, g32 = ce_grads(ref, inputs, dloss, dx_out)
    (loss, g), (loss1, g1) = results[CE_CHUNK], results[None]
    check("loss", loss, loss64, loss32)
    torch.testing.assert_close(loss, loss1, rtol=1e-6, atol=0)
    assert len(g) == len(g64) and all(t is not None for t in g)
    for i, (a, one, r, t) in enumerate(zip(g, g1, g64, g32)):
        check(f"grad {i}", a, r, t)
        apart, torch_err = rel_err(a, one), rel_err(t, r)  # chunks sum in another order: rounding apart, no more
        assert apart <= torch_err, f"grad {i}: chunks vs one chunk {apart:.2e}, PyTorch's own error {torch_err:.2e}"


@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_ce_saves_no_m_by_v_tensor(composition, monkeypatch):
    """The memory property: nothing of V columns but the weight and its gradient [V, d] is saved for backward (the
    unchunked path saved dlogits [M, V]), and every chunk writes its logits into one [chunk, V] buffer."""
    model, target = CE_MODEL, ce_target(CE_MODEL)
    V, d = model.vocab, model.hidden
    buffers: list[tuple[int, tuple[int, ...], int]] = []
    real = cross_entropy_bwd.gemm_cross_entropy

    def recording(h, *args, out, **kwargs):
        buffers.append((out.data_ptr(), tuple(out.shape), out.untyped_storage().nbytes()))
        return real(h, *args, out=out, **kwargs)

    monkeypatch.setattr(cross_entropy_bwd, "gemm_cross_entropy", recording)
    inputs, ours, _ = composition_case(composition, model, CrossEntropy(target, chunk_rows=CE_CHUNK), V,
                                       lambda n, w: None)
    leaves = [t.clone().requires_grad_() for t in inputs]
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = ours(*leaves)[-1]
    assert [s for s in saved if V in s] == [(V, d), (V, d)], saved  # W and dW; no dlogits [M, V]
    assert [b[1] for b in buffers] == [(16, V), (16, V), (8, V)]
    assert len({b[0] for b in buffers}) == 1 and {b[2] for b in buffers} == {CE_CHUNK * V * 4}
    loss.backward()
    assert all(t.grad is not None for t in leaves)


def test_ce_forward_launches_per_chunk_and_backward_none():
    """norm_consumer + cross-entropy over 3 chunks: the forward launches the loss scale once, then per chunk the
    LM head, its two finishing kernels, the dgrad (+ dgamma sum) and the accumulating weight-gradient GEMM; the
    backward of loss.backward() (dloss = 1) launches only the rescaling of dx, dgamma and dW (which return at once
    for dloss 1) and synchronizes nothing."""
    model, target = CE_MODEL, ce_target(CE_MODEL)
    inputs, ours, _ = composition_case("norm_consumer", model, CrossEntropy(target, chunk_rows=CE_CHUNK),
                                       model.vocab, lambda n, w: None)
    leaves = [t.requires_grad_() for t in inputs]
    with launches() as fwd:
        (loss,) = ours(*leaves)
    chunk = ["gemm_cross_entropy_kernel", "ce_rows_kernel", "ce_loss_kernel", "dgrad_rmsnorm_kernel",
             "col_sum_kernel", "gemm_kernel"]
    assert fwd == ["norm_input_kernel", "ce_grad_scale_kernel"] + 3 * chunk
    with launches() as bwd:
        loss.backward()
    assert bwd == ["rescale_kernel"] * 3 + ["store_scalar_kernel"] and all(t.grad is not None for t in leaves)


def test_rescale_multiplies_by_the_ratio_of_the_new_to_the_applied_gradient():
    """rescale_: t *= grad / applied, then applied := grad; a factor of 1 leaves t as it is (bit for bit)."""
    t = rand(3, 1000, seed=5)  # 3000 elements: a partial block
    original, applied = t.clone(), torch.ones(1)
    rescale_(torch.tensor(1.0), applied, t)
    assert torch.equal(t, original) and applied.item() == 1.0
    rescale_(torch.tensor(3.0), applied, t)
    torch.testing.assert_close(t, 3 * original, rtol=1e-6, atol=0)
    assert applied.item() == 3.0
    rescale_(torch.tensor(3.0), applied, t)  # a second backward with the same dloss: unchanged
    torch.testing.assert_close(t, 3 * original, rtol=1e-6, atol=0)
    rescale_(torch.tensor(-1.5, dtype=torch.float64), applied, t)
    torch.testing.assert_close(t, -1.5 * original, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="contiguous"):
        rescale_(torch.tensor(2.0), applied, t.T)


def test_ce_chunk_rows_rule():
    """The default chunk: at most the rows (a multiple of 256) whose [rows, V] buffer fits 1 GiB, or 4096 where that is
    more; the fewest such chunks, their rows spread evenly (rounded up to 256); M where one chunk holds it."""
    assert ce_chunk_rows(16384, 128256, 2) == 4096  # Llama 3, bf16: 1002 MiB, 4 chunks of 2 x 8192 tokens
    assert ce_chunk_rows(16384, 152064, 2) == 4096  # Qwen2: 3328 rows fit 1 GiB, under the 4096 minimum
    assert ce_chunk_rows(16384, 128256, 4) == 4096  # fp32: 2048 fit, the minimum holds
    assert ce_chunk_rows(10 ** 6, 32000, 2) == 16640  # 61 chunks of at most 16640 rows
    assert ce_chunk_rows(10000, 128256, 2) == 3584  # 3 chunks: 3584, 3584, 2832, not 4096, 4096, 1808
    assert ce_chunk_rows(10 ** 6, 1 << 21, 2) == 4096  # 245 chunks of at most the minimum
    assert ce_chunk_rows(1000, 128256, 2) == 1000  # capped by M
    assert ce_chunk_rows(4096, 152064, 2) == 4096  # one chunk


# ---- the plugin, through the harness's correctness check ------------------------------------------------

AUTOGRAD_OPS = ["rmsnorm_linear", "rmsnorm_swiglu", "rmsnorm_rope", "rmsnorm_ce", "lm_head_ce", "block"]
CE_OPS = ("rmsnorm_ce", "lm_head_ce")
"""Their gradients are computed in the forward: ``bwd`` alone is n/a, ``fwd_bwd`` checks them."""


def test_the_ce_ops_backward_alone_is_not_applicable():
    for op_name in CE_OPS:
        op, impl = OPS[op_name], REGISTRY.get(op_name, "coda-triton")
        case = Case(op, TINY, "bwd", "fp32", torch.device("cpu"), {})
        assert impl.grads_in_forward and impl.skip_reason(case).startswith("n/a: coda-triton computes the gradients")
        assert impl.skip_reason(Case(op, TINY, "fwd_bwd", "fp32", torch.device("cpu"), {})) is None


@pytest.mark.parametrize("op_name,mode", [(o, m) for o in AUTOGRAD_OPS for m in ("bwd", "fwd_bwd")
                                          if not (o in CE_OPS and m == "bwd")]
                         + [("rmsnorm_dgrad", "bwd"), ("swiglu_dgrad", "bwd")])
def test_plugin_bwd_passes_the_harness_check(op_name, mode, strategy):
    op, impl = OPS[op_name], REGISTRY.get(op_name, "coda-triton")
    case = Case(op, TINY, mode, "fp32", torch.device("cpu"), op.make_inputs(TINY, torch.float32, "cpu", CHECK_SEED))
    assert impl.skip_reason(case) is None
    outcome = check_impl(build_reference(op, case), impl)
    assert outcome.correct, (outcome.errors, [(c.output, c.stats, c.torch_rel_err) for c in outcome.checks])
    compared = {c.output for c in outcome.checks}
    if op.kind == "direct":
        assert compared == set(op.outputs) | set(op.side_outputs)
    else:
        grads = {f"grad_{k}" for k in op.differentiable(case.inputs)}
        assert grads <= compared and (mode == "bwd" or set(op.outputs) <= compared)
