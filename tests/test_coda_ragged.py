"""Sizes off the tensor descriptors' 16-byte rule (:mod:`kernels.coda.align`): the CODA kernels at any size.

A row of n elements meets the rule when n times the element size is a multiple of 16 bytes. RAGGED breaks it in
fp32 and fp16 on every dim a descriptor sees: hidden 70 (the producer's K too), FFN 90, qkv width 98, vocabulary 257
(Llama-2's 32000 + a pad token, in small). Under the interpreter the descriptors check the rule, so each of these
failed with ``AssertionError('stride must be 16-byte aligned')`` before the kernels took a padded row layout. Every
result passes the suite's rule against float64 references, as at aligned sizes; the harness fills new CPU
allocations with NaN, so a kernel reading a row's padding would fail its check.
"""
from __future__ import annotations

import os

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from codabench.case import Case
from codabench.cli import main
from codabench.correctness import CHECK_SEED, build_reference, check_impl
from codabench.registry import REGISTRY
from kernels.coda import plugin  # noqa: F401  (registers coda-triton)
from kernels.coda.align import aligned, empty_rows, is_aligned, meets_rule, row_stride, written_back
from kernels.coda.cross_entropy_bwd import rescale_
from kernels.coda import ops
from kernels.coda.functions import CrossEntropy, Linear, RoPE, block, norm_consumer, producer_consumer
from kernels.coda.pack import gate_up_index
from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm
from kernels.coda.strategy import ENV as STRATEGY_ENV
from workloads import reference as R
from workloads.op import DTYPES
from workloads.models import ModelShape
from workloads.ops import OPS

from harness_helpers import isolated_registry
from kernel_helpers import check, launches, rand
from test_coda_bwd import consumers, flat, grads_of

RAGGED = ModelShape("ragged", hidden=70, ffn=90, heads=5, kv_heads=1, head_dim=14, vocab=257, tokens=40, seq_len=40)


# ---- the rule and the row layout ----------------------------------------------------------------------------

def test_row_stride_rounds_rows_to_16_bytes_for_each_element_size():
    assert [row_stride(90, e) for e in (4, 2, 1)] == [92, 96, 96]
    assert [row_stride(72, e) for e in (4, 2, 1)] == [72, 72, 80]  # hidden 72: off the rule in fp8 only
    assert row_stride(32001, 2) == 32008 and row_stride(32000, 2) == 32000 and row_stride(3, 8) == 4
    assert [meets_rule(72, e) for e in (4, 2, 1)] == [True, True, False]


def test_empty_rows_pads_only_rows_off_the_rule_and_aligned_copies_only_those():
    padded, plain = empty_rows(5, 90, torch.float32, "cpu"), empty_rows(5, 92, torch.float32, "cpu")
    assert padded.shape == (5, 90) and padded.stride() == (92, 1) and is_aligned(padded)
    assert plain.is_contiguous() and plain.stride() == (92, 1)
    t = rand(5, 90, seed=1)  # contiguous, rows of 360 bytes
    assert not is_aligned(t) and is_aligned(rand(5, 92, seed=1))
    copy = aligned(t)
    assert copy.stride() == (92, 1) and torch.equal(copy, t)
    assert aligned(copy) is copy and aligned(plain) is plain
    offset = torch.cat([torch.zeros(1), rand(5 * 92, seed=2)])[1:].view(5, 92)  # a base 4 bytes off: copied
    assert not is_aligned(offset) and is_aligned(aligned(offset)) and torch.equal(aligned(offset), offset)
    assert aligned(rand(92, 5, seed=3).T).stride() == (92, 1)  # column-major: copied row-major
    target = rand(5, 90, seed=4)
    buf = aligned(target)
    buf.fill_(2.0)
    assert written_back(buf, target) is target and torch.equal(target, torch.full((5, 90), 2.0))


def test_dgrad_rmsnorm_in_place_into_a_dres_off_the_rule_writes_the_callers_tensor(strategy):
    """dx in place into a dres whose rows (70 fp32: 280 bytes) are off the rule: the kernels write an aligned copy,
    which comes back into the caller's dres, the tensor returned."""
    inp = OPS["rmsnorm_dgrad"].make_inputs(RAGGED, torch.float32, "cpu", seed=3)
    args = (inp["dz"], inp["w"], inp["x"], inp["rstd"], inp["gamma"], inp["zdz"])
    dres = inp["dres"].clone()
    assert not is_aligned(dres)
    want, _, _ = dgrad_rmsnorm(*args, inp["dres"])
    dx, _, _ = dgrad_rmsnorm(*args, dres, inplace=True)
    assert dx is dres and torch.equal(dres, want)


def test_rescale_scales_a_padded_tensor_and_leaves_its_padding():
    storage = torch.full((3, 92), 7.0)
    t = storage[:, :90]
    t.copy_(rand(3, 90, seed=5))
    original, applied = t.clone(), torch.ones(1)
    rescale_(torch.tensor(3.0), applied, t)
    torch.testing.assert_close(t, 3 * original, rtol=1e-6, atol=0)
    assert torch.equal(storage[:, 90:], torch.full((3, 2), 7.0))


# ---- the compositions, forward and backward -------------------------------------------------------------------

def ragged_case(composition: str, consumer_name: str, dtype: torch.dtype):
    """``(inputs, ours, ref)`` of one composition at RAGGED: contiguous inputs in ``dtype`` (W of the consumer last),
    the CODA function and the torch reference of its outputs ``(x, consumer output)`` (norm_consumer: the output)."""
    m, d, f, eps = RAGGED.tokens, RAGGED.hidden, RAGGED.ffn, RAGGED.eps
    k = RAGGED.attn_width
    pos = torch.arange(m) % RAGGED.seq_len
    target = torch.randint(0, RAGGED.vocab, (m,), generator=torch.Generator().manual_seed(0))
    target[::5], target[1] = R.IGNORE_INDEX, RAGGED.vocab - 1  # ignored rows; the ragged last column a target
    consumer, n_out, ref_out = consumers(RAGGED, pos, target)[consumer_name]

    def gamma(seed):
        return rand(d, dtype=dtype, seed=seed, scale=0.1, mean=1.0)

    w = rand(n_out, d, dtype=dtype, seed=21, scale=d ** -0.5)
    if composition == "norm_consumer":
        inputs = [rand(m, d, dtype=dtype, seed=22), gamma(20), w]
        return (inputs, lambda x, g, w: norm_consumer(x, g, w, consumer, eps)[:1],
                lambda x, g, w: (ref_out(R.rmsnorm(x, g, eps), w),))
    producer = [rand(m, k, dtype=dtype, seed=22), rand(m, d, dtype=dtype, seed=23),
                rand(d, k, dtype=dtype, seed=24, scale=k ** -0.5)]
    if composition == "producer_consumer":
        def pc_ref(a, residual, w_p, g, w):
            x = residual + F.linear(a, w_p)
            return x, ref_out(R.rmsnorm(x, g, eps), w)
        return (producer + [gamma(20), w], lambda *t: producer_consumer(*t, consumer, eps)[:2], pc_ref)

    def block_ref(a, residual, w_o, g_mlp, w_gu, w_down, g, w):
        x1 = residual + F.linear(a, w_o)
        h1 = R.rmsnorm(x1, g_mlp, eps)
        x = x1 + F.linear(R.swiglu(F.linear(h1, w_gu[0::2]), F.linear(h1, w_gu[1::2])), w_down)
        return x, ref_out(R.rmsnorm(x, g, eps), w)
    mlp = [gamma(25), rand(2 * f, d, dtype=dtype, seed=26, scale=d ** -0.5),
           rand(d, f, dtype=dtype, seed=27, scale=f ** -0.5)]
    return producer + mlp + [gamma(20), w], lambda *t: block(*t, consumer, eps)[:2], block_ref


RAGGED_COMPOSITIONS = [("block", "rope"), ("block", "ce"), ("norm_consumer", "linear"),
                       ("producer_consumer", "swiglu")]
"""Together every forward kernel (the producer, SwiGLU, RoPE, the plain and the cross-entropy consumer) and every
backward piece (RoPE and SwiGLU backward, the RMSNorm dgrads, the CE gradients over chunks, the weight GEMMs)."""


@pytest.mark.parametrize("path,dtype", [("fused", "fp32"), ("fused", "fp16"), ("split", "fp16")])
@pytest.mark.parametrize("composition,consumer_name", RAGGED_COMPOSITIONS)
def test_compositions_at_sizes_off_the_rule(composition, consumer_name, path, dtype, monkeypatch):
    """Outputs and every input gradient against float64 autograd, the inputs contiguous (rows off the rule: the
    kernels lay out what they read themselves); the split path (PyTorch's GEMM, then the row kernels) in fp16, whose
    rule (rows of 8 elements) is the stricter of the two."""
    monkeypatch.setenv(STRATEGY_ENV, path)
    inputs, ours_t, ref_t = ragged_case(composition, consumer_name, DTYPES[dtype])
    ours = lambda *t: flat(*ours_t(*t))  # noqa: E731
    ref = lambda *t: flat(*ref_t(*t))  # noqa: E731
    out_ref = ref(*inputs)
    dout = rand(out_ref.numel(), dtype=out_ref.dtype, seed=30)
    out64, g64 = grads_of(ref, [t.double() for t in inputs], dout.double())
    out_t, g_t = grads_of(ref, inputs, dout)
    with launches() as names:
        out, g = grads_of(ours, inputs, dout)
    assert names  # the kernels ran (no fallback)
    check("out", out, out64, out_t)
    for i, (a, r, t) in enumerate(zip(g, g64, g_t)):
        assert a.shape == t.shape, (i, a.shape)
        check(f"grad {i}", a, r, t)


def test_the_ops_fake_rules_give_the_strides_of_the_row_layout():
    """The ``coda::`` ops' fake-tensor rules give each output off the rule the padded row stride its kernel gives it
    (a compiled graph reads outputs by the fake strides): torch.library.opcheck's fake-tensor check at sizes off
    the rule, fp32 (hidden 18, FFN 9, producer K 22, qkv 30, vocabulary 49)."""
    m, d, f, k, v = 16, 18, 9, 22, 49

    def r(*shape, seed):
        return rand(*shape, seed=seed, scale=0.3)

    def fake_check(op, *args):
        torch.library.opcheck(op, args, test_utils="test_faketensor")

    rope = RoPE(torch.arange(m) % 5, 3, 1, 6, 10000.0)
    target = torch.randint(0, v, (m,), generator=torch.Generator().manual_seed(9))
    ce = CrossEntropy(target, chunk_rows=8)
    a, res, w_o, g = r(m, k, seed=1), r(m, d, seed=2), r(d, k, seed=3), 1 + r(d, seed=4)
    w_gu, w_down, w_qkv, w_lm = r(2 * f, d, seed=5), r(d, f, seed=6), r(30, d, seed=7), r(v, d, seed=8)
    for c, w in ((rope, w_qkv), (ce, w_lm)):
        fake_check(ops.block, a, res, w_o, g, w_gu, w_down, g, w, 1e-5, True, c.kind, *c.op_args())
    fake_check(ops.norm_consumer, res, g, w_lm, 1e-5, True, "linear", *Linear().op_args())
    out, rstd = ops.norm_consumer(res, g, w_lm, 1e-5, True, "linear", *Linear().op_args())
    fake_check(ops.consumer_bwd, r(m, v, seed=9), [], w_lm, res, rstd, g, r(m, d, seed=10), True, "linear",
               *Linear().op_args())
    fake_check(ops.producer_bwd, r(m, d, seed=11), a, w_o, True)
    mlp = (r(m, d, seed=12), w_down, r(m, 2 * f, seed=13), w_gu, res, rstd, g, True, True)
    fake_check(ops.mlp_bwd, *mlp)
    fake_check(ops.mlp_bwd_, *mlp)
    fake_check(ops.pack_rows, *gate_up_index(f, torch.device("cpu")), [r(f, d, seed=14), r(f, d, seed=15)])


# ---- the plugin, through the harness ---------------------------------------------------------------------------

def test_the_run_bench_command_at_sizes_off_the_rule(tmp_path):
    """``run_bench.py --model ...`` for the block and the LM head, forward + backward, at a smaller shape off the rule
    (fp16: hidden 38, FFN 45, qkv 108, attention 36, vocabulary 257): each coda-triton cell ends ok and passes (before
    the row layout: error rows, 'stride must be 16-byte aligned'). ~10 s in the interpreter."""
    out = tmp_path / "run"
    spec = "odd:hidden=38,ffn=45,heads=2,head_dim=18,vocab=257,tokens=16"
    with isolated_registry():
        code = main(["--model", spec, "--ops", "block,lm_head_ce", "--dtypes", "fp16", "--modes", "fwd_bwd",
                     "--impls", "coda-triton", "--warmup", "0", "--inline", "--out", str(out), "--quiet",
                     "--no-entry-points"])
    df = pd.read_csv(out / "results.csv")
    assert code == 0 and len(df) == 2, df[["op", "dtype", "status", "message"]]
    assert (df.status == "ok").all() and df.correct.all(), df[["op", "dtype", "status", "message"]]


FP8_CASES = [("block", "fp8"), ("lm_head_ce", "fp8-row"), ("rmsnorm_dgrad", "fp8"), ("swiglu_dgrad", "fp8-row")]
"""fp8 (rows of one byte: hidden 70 and FFN 90 off the rule), which the interpreter runs exactly: the producer and
SwiGLU epilogues quantizing their outputs for the next GEMM, the LM head, the two dgrads on K-major weights."""


def check_cell(name: str, mode: str, dtype: str, device: torch.device = torch.device("cpu")) -> None:
    """coda-triton's cell of op ``name`` at RAGGED passes the harness's correctness check (its float64 reference,
    PyTorch's error on the same inputs)."""
    op, impl = OPS[name], REGISTRY.get(name, "coda-triton")
    case = Case(op, RAGGED, mode, dtype, device, op.inputs(RAGGED, dtype, device, CHECK_SEED))
    assert impl.skip_reason(case) is None
    outcome = check_impl(build_reference(op, case), impl)
    assert outcome.correct, (outcome.errors, [(c.output, c.stats, c.torch_rel_err) for c in outcome.checks])


@pytest.mark.parametrize("name,dtype", FP8_CASES)
def test_fp8_ops_pass_at_sizes_off_the_rule(name, dtype):
    check_cell(name, OPS[name].modes[0], dtype)


def coda_cells(dtypes: tuple[str, ...] = ("fp16",)) -> list[tuple[str, str, str]]:
    """Every cell of coda-triton at one mode per op (autograd ops: fwd_bwd, fp8: fwd) in ``dtypes``: (op, mode,
    dtype). fp16 by default: rows of 2-byte elements (fp32's 4 bytes and fp8's 1 are the tests above)."""
    cells = []
    for (name, impl_name), impl in REGISTRY.impls.items():
        if impl_name == "coda-triton":
            for dtype in dtypes:
                mode = next((m for m in ("fwd_bwd", "fwd", "bwd") if m in impl.modes
                             and OPS[name].has_cell(m, dtype)), None)
                if mode is not None:
                    cells.append((name, mode, dtype))
    return sorted(cells)


@pytest.mark.slow
@pytest.mark.parametrize("name,mode,dtype", coda_cells())
def test_every_coda_triton_cell_passes_at_sizes_off_the_rule(name, mode, dtype, strategy):
    check_cell(name, mode, dtype)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="bf16 needs a CUDA GPU and compiled kernels (the interpreter has no bf16 math)")
@pytest.mark.parametrize("name,mode", [(n, m) for n, m, _ in coda_cells()])
def test_every_coda_triton_cell_passes_in_bf16_at_sizes_off_the_rule_gpu(name, mode, strategy):
    """bf16 on the GPU (the compiled kernels' TMA descriptors on rows of 140, 180, 196 and 514 bytes). fp8 is the
    CPU tests' above: on a GPU PyTorch's ``_scaled_mm``, the harness's fp8 baseline, needs K and N multiples of 16."""
    check_cell(name, mode, "bf16", torch.device("cuda"))
