"""CODA forward kernels against float64 references (CPU, Triton interpreter, fp32 and fp16).

Shapes are multiples of 8 but not of the interpreter's 32x32x32 tile, so every edge is masked. Each
output passes when its relative error is at most 2x that of plain PyTorch in the same dtype plus a
floor (the suite's pass rule), and each fused op is checked to be one GEMM launch plus the finishing
reductions its math needs. The tests of a host function run both of its paths (the ``strategy`` fixture): the
split path is PyTorch's GEMM (no Triton launch) and one row kernel.
"""
from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from codabench.case import Case
from codabench.correctness import CHECK_SEED, build_reference, check_impl
from codabench.registry import REGISTRY
from kernels import layouts as L
from kernels.coda import epilogue as E
from kernels.coda import plugin  # noqa: F401  (registers coda-triton)
from kernels.coda.cross_entropy import gemm_cross_entropy
from kernels.coda.launch import MAINLOOP_PARAMS, FusedGemm
from kernels.coda.mainloop import coda_autotune, tile_desc
from kernels.coda.producer import gemm_residual_norm, norm_input
from kernels.coda.reduce import finish_col_sum, finish_row_sum, finish_rstd
from kernels.coda.rope import gemm_rope, rope_freq_table
from kernels.coda.scaled_linear import scaled_linear
from kernels.coda.swiglu import gemm_swiglu
from workloads import reference as R
from workloads.fp8 import quantize
from workloads.models import get_model
from workloads.ops import OPS

from kernel_helpers import DTYPES, check, launches, rand

M, K, D, F2, V = 80, 56, 72, 48, 200  # tokens, producer K, hidden, 2 * ffn, vocab
H, HKV, DH, THETA = 2, 1, 16, 10000.0
EPS = 1e-5


def producer_inputs(dtype):
    return (rand(M, K, dtype=dtype, seed=1), rand(D, K, dtype=dtype, seed=2, scale=K ** -0.5),
            rand(M, D, dtype=dtype, seed=3), rand(D, dtype=dtype, seed=4, scale=0.1, mean=1.0))


def normed(dtype):
    """h, rstd from the producer kernel, and the fp64 / torch-dtype normalized activations."""
    a, w, res, g = producer_inputs(dtype)
    x, h, rstd = gemm_residual_norm(a, w, res, g, EPS)
    x64 = res.double() + a.double() @ w.double().T
    xt = res + F.linear(a, w) if dtype == torch.float32 else (res.float() + F.linear(a, w).float()).to(dtype)
    return h, rstd, R.rmsnorm(x64, g.double(), EPS), R.rmsnorm(xt, g, EPS)


# ---- the launch contract ----------------------------------------------------------------------------

def test_every_autotuned_kernel_starts_with_the_mainloop_block():
    import kernels.coda
    import kernels.examples
    found = {}
    for pkg in (kernels.coda, kernels.examples):
        for info in pkgutil.iter_modules(pkg.__path__):
            for obj in vars(importlib.import_module(f"{pkg.__name__}.{info.name}")).values():
                obj = getattr(obj, "kernel", obj)  # a declared kernel's host function holds its fused kernel
                if isinstance(obj, triton.runtime.Autotuner):
                    found[obj.base_fn.__name__] = tuple(obj.arg_names[:len(MAINLOOP_PARAMS)])
    assert set(found) == {"gemm_kernel", "gemm_residual_norm_kernel", "scaled_linear_kernel", "gemm_swiglu_kernel",
                          "gemm_rope_kernel", "gemm_cross_entropy_kernel", "dgrad_rmsnorm_kernel",
                          "dgrad_swiglu_kernel", "gemm_bias_gelu_kernel"}
    assert all(block == MAINLOOP_PARAMS for block in found.values()), found


@triton.jit
def _no_block_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                     PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, out_ptr):
    tl.store(out_ptr, 1.0)


def test_launch_refuses_a_kernel_whose_block_is_out_of_order_and_checks_the_operands():
    out = torch.zeros(1)
    gemm = FusedGemm(rand(8, 16), rand(4, 16).T)
    assert (gemm.M, gemm.N, gemm.K, gemm.a_km, gemm.b_kn) == (8, 4, 16, False, False)
    with pytest.raises(TypeError, match="mainloop block"):
        gemm.launch(coda_autotune()(_no_block_kernel), out_ptr=out)
    assert out.item() == 0.0  # refused before the launch
    with pytest.raises(ValueError, match="shape mismatch"):
        FusedGemm(rand(8, 16), rand(4, 8).T)
    with pytest.raises(ValueError, match="fp8 operands carry their own scales"):
        FusedGemm(quantize(rand(8, 16)), quantize(rand(4, 16)).T, scale=torch.ones(1))


# ---- epilogue primitives and finishing reductions --------------------------------------------------

@triton.jit
def _partials_kernel(x_ptr, y_ptr, ss_ptr, dot_ptr, col_ptr, lse_ptr, M, N, stride_x, stride_p, stride_c,
                     BM: tl.constexpr, BN: tl.constexpr):
    off_m, off_n = tl.program_id(0) * BM, tl.program_id(1) * BN
    x = E.load_tile(tile_desc(x_ptr, M, N, stride_x, BM, BN), off_m, off_n)
    y = E.load_tile(tile_desc(y_ptr, M, N, stride_x, BM, BN), off_m, off_n)
    E.store_row_partial(ss_ptr, E.row_sumsq(x), off_m, off_n, M, stride_p, BM, BN)
    E.store_row_partial(dot_ptr, E.row_dot(x, y), off_m, off_n, M, stride_p, BM, BN)
    E.col_sum_partial(col_ptr, x * y, off_m, off_n, N, stride_c, BM, BN)
    E.store_row_partial(lse_ptr, E.tile_lse(x, off_n, N, BN), off_m, off_n, M, stride_p, BM, BN)


def test_partials_and_finishing_reductions():
    x, y = rand(M, D, seed=5), rand(M, D, seed=6)
    bm, bn = 32, 32
    tm, tn = triton.cdiv(M, bm), triton.cdiv(D, bn)
    ss, dot, lse = (torch.full((M, tn + 1), float("nan")) for _ in range(3))  # one spare column, never read
    col = torch.full((tm, D), float("nan"))
    _partials_kernel[(tm, tn)](x, y, ss, dot, col, lse, M, D, x.stride(0), ss.stride(0), col.stride(0), BM=bm, BN=bn)
    x64, y64 = x.double(), y.double()
    for t in range(tn):
        cols = slice(t * bn, min(D, (t + 1) * bn))
        torch.testing.assert_close(ss[:, t].double(), (x64[:, cols] ** 2).sum(1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dot[:, t].double(), (x64[:, cols] * y64[:, cols]).sum(1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, t].double(), torch.logsumexp(x64[:, cols], 1), rtol=1e-5, atol=1e-5)
    for t in range(tm):
        rows = slice(t * bm, min(M, (t + 1) * bm))
        torch.testing.assert_close(col[t].double(), (x64[rows] * y64[rows]).sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(finish_rstd(ss, tn, D, EPS).double(), R.rstd(x64, EPS), rtol=1e-6, atol=0)
    torch.testing.assert_close(finish_row_sum(dot, tn).double(), (x64 * y64).sum(1), rtol=1e-5, atol=1e-5)
    dg = finish_col_sum(col, tm, torch.float16)
    assert dg.dtype == torch.float16
    torch.testing.assert_close(dg.double(), (x64 * y64).sum(0), rtol=2e-3, atol=2e-3)


@triton.jit
def _subtile_kernel(x_ptr, out_ptr, N, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Each program copies one (BM, BN) tile through its S column sub-tiles (reversed order, own offsets)."""
    off_n = tl.program_id(0) * BN
    x = E.load_tile(tile_desc(x_ptr, BM, N, N, BM, BN), 0, off_n)
    out_desc = tile_desc(out_ptr, BM, N, N, BM, BN // S)
    for i in tl.static_range(S):
        j: tl.constexpr = S - 1 - i
        E.store_tile(out_desc, 0, off_n + j * (BN // S), E.col_subtile(x, j, S, BM, BN))


@pytest.mark.parametrize("subtiles", [1, 2, 4])
def test_col_subtile_covers_the_tile_in_order(subtiles):
    x = rand(16, 128, seed=4)
    out = torch.full_like(x, float("nan"))
    _subtile_kernel[(2,)](x, out, 128, S=subtiles, BM=16, BN=64)
    assert torch.equal(out, x)


# ---- fused forward kernels --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_residual_norm(dtype, strategy):
    a, w, res, g = producer_inputs(dtype)
    with launches() as names:
        x, h, rstd = gemm_residual_norm(a, w, res, g, EPS)
    assert names == {"fused": ["gemm_residual_norm_kernel", "rstd_kernel"],
                     "split": ["gemm_residual_norm_rows_kernel", "rstd_kernel"]}[strategy]
    x64 = res.double() + a.double() @ w.double().T
    xt = (res.float() + F.linear(a, w).float()).to(dtype)
    check("x", x, x64, xt)
    check("h", h, x64 * g.double(), xt * g)
    assert rstd.dtype == torch.float32
    check("rstd", rstd, R.rstd(x64, EPS), R.rstd(xt, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_input(dtype):
    x, g = rand(M, D, dtype=dtype, seed=7), rand(D, dtype=dtype, seed=8, scale=0.1, mean=1.0)
    with launches() as names:
        h, rstd = norm_input(x, g, EPS)
    assert names == ["norm_input_kernel"]
    check("h", h, x.double() * g.double(), x * g)
    check("rstd", rstd, R.rstd(x.double(), EPS), R.rstd(x, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_linear(dtype, strategy):
    h, rstd, n64, nt = normed(dtype)
    w = rand(F2, D, dtype=dtype, seed=9, scale=D ** -0.5)
    with launches() as names:
        z = scaled_linear(h, w, rstd)
    assert names == [{"fused": "scaled_linear_kernel", "split": "scaled_linear_rows_kernel"}[strategy]]
    check("z", z, n64 @ w.double().T, F.linear(nt, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_swiglu(dtype, strategy):
    h, rstd, n64, nt = normed(dtype)
    wg, wu = (rand(F2 // 2, D, dtype=dtype, seed=s, scale=D ** -0.5) for s in (10, 11))
    with launches() as names:
        y, z = gemm_swiglu(h, L.interleave_rows(wg, wu), rstd, save_preact=True)
        y2, none = gemm_swiglu(h, L.interleave_rows(wg, wu), rstd, save_preact=False)
    assert names == [{"fused": "gemm_swiglu_kernel", "split": "gemm_swiglu_rows_kernel"}[strategy]] * 2 and none is None
    g64, u64 = n64 @ wg.double().T, n64 @ wu.double().T
    gt, ut = F.linear(nt, wg), F.linear(nt, wu)
    check("y", y, R.swiglu(g64, u64), R.swiglu(gt, ut))
    check("z_pre", z, L.interleave_cols(g64, u64), L.interleave_cols(gt, ut))
    assert torch.equal(y, y2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_rope(dtype, strategy):
    h, rstd, n64, nt = normed(dtype)
    w = rand((H + 2 * HKV) * DH, D, dtype=dtype, seed=12, scale=D ** -0.5)
    pos = (torch.arange(M) * 797) % 60000  # large positions: angles up to 6e4 rad
    with launches() as names:
        qkv = gemm_rope(h, L.qkv_rows_to_adjacent(w, H, HKV, DH), rstd, pos, H, HKV, DH, THETA)
    assert names == [{"fused": "gemm_rope_kernel", "split": "gemm_rope_rows_kernel"}[strategy]]
    ref = R.qkv_rope(n64 @ w.double().T, pos, H, HKV, DH, THETA)
    check("qkv", L.qkv_cols_to_halfsplit(qkv, H, HKV, DH), ref, R.qkv_rope(F.linear(nt, w), pos, H, HKV, DH, THETA))
    if dtype == torch.float32:  # the reduced angle: far below the error of a plain fp32 angle (~2e-3 here)
        assert (L.qkv_cols_to_halfsplit(qkv, H, HKV, DH).double() - ref).abs().max() < 1e-4


def test_rope_freq_table_takes_a_scaled_ropes_frequencies():
    """``inv_freq`` replaces theta^(-2i/dh) per head (q and k heads), v pairs stay at 0; hi + lo carries f to
    about 32 significant bits."""
    f = (THETA ** (-2.0 * torch.arange(DH // 2, dtype=torch.float64) / DH)).tolist()
    cpu = torch.device("cpu")
    assert torch.equal(rope_freq_table(H, HKV, DH, THETA, cpu), rope_freq_table(H, HKV, DH, THETA, cpu, tuple(f)))
    scaled = [x / (1 + i) for i, x in enumerate(f)]  # not a function of any theta
    table = rope_freq_table(H, HKV, DH, THETA, cpu, tuple(scaled))
    want = torch.tensor(scaled * (H + HKV) + [0.0] * (HKV * DH // 2), dtype=torch.float64)
    assert torch.allclose(table.double().sum(0), want, rtol=2.0 ** -31, atol=0.0)
    with pytest.raises(ValueError, match="head_dim / 2"):
        rope_freq_table(H, HKV, DH, THETA, cpu, tuple(f[:-1]))


def test_cross_entropy_paths_agree_on_targets_outside_the_vocabulary():
    """A target outside [0, V) that is not ignore_index: neither path reads outside the logits; both count that
    row's target logit as 0 (loss = lse) and its dlogits as the softmax."""
    h, rstd, _, _ = normed(torch.float32)
    w = rand(V, D, dtype=torch.float32, seed=13, scale=D ** -0.5)
    target = torch.randint(0, V, (M,), generator=torch.Generator().manual_seed(14))
    target[::5], target[1::5] = V + 3, -7
    fused = gemm_cross_entropy.fused(h, w, rstd, target, with_grad=True)
    split = gemm_cross_entropy.split(h, w, rstd, target, with_grad=True)
    for a, b in zip(fused, split):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    logits = (h @ w.T) * rstd[:, None]
    inside = (target >= 0) & (target < V)
    tgt = torch.where(inside, logits.gather(1, target.clamp(0, V - 1)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(split[0], (torch.logsumexp(logits, -1) - tgt).mean(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(split[2][~inside], torch.softmax(logits, -1)[~inside], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_cross_entropy(dtype, strategy):
    h, rstd, n64, nt = normed(dtype)
    w = rand(V, D, dtype=dtype, seed=13, scale=D ** -0.5)
    target = torch.randint(0, V, (M,), generator=torch.Generator().manual_seed(14))
    target[::7] = -100
    lg64, lgt = n64 @ w.double().T, F.linear(nt, w)
    valid = (target != -100)[:, None]
    onehot = F.one_hot(target.clamp(min=0), V)
    d64 = (torch.softmax(lg64, -1) - onehot) * valid
    dt = ((torch.softmax(lgt.float(), -1) - onehot) * valid).to(dtype)
    with launches() as names:
        loss, lse, dlogits, zdz = gemm_cross_entropy(h, w, rstd, target, with_grad=True)
    assert names == {"fused": ["gemm_cross_entropy_kernel", "ce_rows_kernel", "ce_loss_kernel"],
                     "split": ["ce_split_rows_kernel", "ce_loss_kernel"]}[strategy]
    check("loss", loss, R.cross_entropy(lg64, target), R.cross_entropy(lgt, target))
    check("lse", lse, R.logsumexp(lg64), R.logsumexp(lgt))
    check("dlogits", dlogits, d64, dt)
    check("zdz", zdz, (lg64 * d64).sum(-1), (lgt.float() * dt.float()).sum(-1))
    assert (dlogits[~valid[:, 0]] == 0).all() and (zdz[~valid[:, 0]] == 0).all()
    s = torch.tensor([0.25])  # a loss scale: a power of two, exact but where it takes fp16 into subnormals
    loss_s, _, dlogits_s, zdz_s = gemm_cross_entropy(h, w, rstd, target, with_grad=True, grad_scale=s)
    assert torch.equal(loss_s, loss)
    torch.testing.assert_close(dlogits_s.float(), 0.25 * dlogits.float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(zdz_s, 0.25 * zdz, rtol=1e-6, atol=1e-7)
    loss_sum, lse2, none1, none2 = gemm_cross_entropy(h, w, rstd, target, reduction="sum", with_grad=False)
    assert none1 is None and none2 is None
    check("loss_sum", loss_sum, R.cross_entropy(lg64, target, "sum"), R.cross_entropy(lgt, target, "sum"))
    torch.testing.assert_close(lse2, lse, rtol=1e-6, atol=1e-6)


# ---- the plugin, through the harness's correctness check ----------------------------------------------

FWD_OPS = ["rmsnorm_linear", "rmsnorm_swiglu", "rmsnorm_rope", "rmsnorm_ce", "lm_head_ce", "block", "gemm_out"]


@pytest.mark.parametrize("op_name", FWD_OPS)
def test_plugin_fwd_passes_the_harness_check(op_name, strategy):
    op, impl = OPS[op_name], REGISTRY.get(op_name, "coda-triton")
    model = get_model("tiny")
    case = Case(op, model, "fwd", "fp32", torch.device("cpu"), op.make_inputs(model, torch.float32, "cpu", CHECK_SEED))
    assert impl.skip_reason(case) is None and impl.label == "fused"
    outcome = check_impl(build_reference(op, case), impl)
    assert outcome.correct, (outcome.errors, [(c.output, c.stats, c.torch_rel_err) for c in outcome.checks])
    assert {c.output for c in outcome.checks} == set(op.outputs) | set(op.side_outputs)

