"""fp8 cells on the CPU: the recipes of workloads/fp8.py, which cells exist, and a run through the runner.

torch 2.13 runs ``torch._scaled_mm`` on the CPU (tensorwise, rowwise, e5m2) and Inductor compiles it,
so the torch-eager and torch-compile fp8 baselines run here end to end.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from codabench.case import Case
from codabench.cli import run_parser
from codabench.eager import TorchEager
from codabench.matrix import Selection, build_cells
from codabench.metrics import rel_err
from codabench.report import finalize
from codabench.results import load_run
from harness_helpers import CPU, isolated_registry, make_runner
from workloads import fp8
from workloads.models import get_model
from workloads.ops import OPS

TINY = get_model("tiny")
FMAX = {fp8.E4M3: 448.0, fp8.E5M2: 57344.0}
HALF_ULP = {fp8.E4M3: 2.0**-4, fp8.E5M2: 2.0**-3}
"""Relative rounding bound of a normal fp8 number (3 and 2 mantissa bits)."""


def normal_range(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random signs and magnitudes within 2^-3..2^3: after any dynamic scale, far from fp8's subnormals."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(rows, cols, generator=g) * 6 - 3)
    return torch.where(torch.rand(rows, cols, generator=g) < 0.5, -mag, mag)


# ---- quantization ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("rowwise", [False, True])
def test_quantize_dequantize_round_trip(dtype, rowwise):
    x = normal_range(16, 64) * torch.linspace(0.01, 100, 16)[:, None]  # rows of very different size
    q = fp8.quantize(x, dtype, rowwise)
    assert q.data.dtype == dtype and q.scale.dtype == torch.float32
    assert q.scale.shape == ((16, 1) if rowwise else ())
    y = q.dequantize()
    if rowwise:  # every row uses its own range: the normal-number rounding bound holds everywhere
        assert ((y - x).abs() <= HALF_ULP[dtype] * x.abs()).all()
    else:  # the largest row keeps it; the smallest rows lose bits to the shared scale
        assert ((y[-1] - x[-1]).abs() <= HALF_ULP[dtype] * x[-1].abs()).all()
    assert (y.abs().amax(-1) <= x.abs().amax(-1) * (1 + HALF_ULP[dtype])).all()


def test_rowwise_keeps_small_rows_that_per_tensor_flushes():
    x = normal_range(2, 256) * torch.tensor([[1.0], [2.0**-14]])
    err = {rw: ((fp8.quantize(x, rowwise=rw).dequantize() - x).abs() / x.abs())[1].max() for rw in (False, True)}
    assert err[True] <= HALF_ULP[fp8.E4M3] < err[False]


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_pow2_scale_is_the_smallest_power_of_two_that_fits(dtype):
    fmax = FMAX[dtype]
    g = torch.Generator().manual_seed(3)
    amax = torch.exp2(torch.rand(4000, generator=g, dtype=torch.float64) * 160 - 80).float()
    edges = torch.tensor([fmax, fmax * 2.0**-20, fmax * 2.0**20], dtype=torch.float32)
    above = torch.nextafter(edges, torch.full_like(edges, math.inf))
    amax = torch.cat([amax, edges, above])
    s = fp8.pow2_scale(amax, dtype).double()
    mant, _ = torch.frexp(s)
    assert (mant == 0.5).all()  # a power of two
    a = amax.double()
    assert (a <= fmax * s).all() and (a > fmax * s / 2).all()
    assert torch.equal(s[-6:-3], edges.double() / fmax)  # amax = fmax 2^k exactly: s = 2^k
    assert torch.equal(s[-3:], 2 * edges.double() / fmax)  # one ulp above: the next power
    assert fp8.pow2_scale(torch.zeros(3), dtype).tolist() == [1.0, 1.0, 1.0]
    assert fp8.quantize(torch.zeros(4, 8)).scale.item() == 1.0


@pytest.mark.parametrize("dtype", fp8.FP8_DTYPES)
@pytest.mark.parametrize("op_name", ["rmsnorm_swiglu", "swiglu_dgrad"])
def test_grid_rounded_inputs_requantize_bit_exactly(op_name, dtype):
    op, rec = OPS[op_name], fp8.recipe(dtype)
    inp = op.inputs(TINY, dtype, "cpu", 5)
    for name, t in fp8.round_inputs(inp, op.fp8_operands, rec).items():
        assert torch.equal(t, inp[name]), name
    for name, q in fp8.quantize_operands(inp, op.fp8_operands, rec).items():
        if isinstance(q, fp8.Fp8):
            back = q.dequantize(inp[name].dtype)
            assert torch.equal(back.t() if op.fp8_operands[name] == "weight_bwd" else back, inp[name]), name


def test_round_inputs_touches_only_the_declared_operands():
    op = OPS["rmsnorm_swiglu"]
    raw = op.make_inputs(TINY, torch.bfloat16, "cpu", 9)
    for dtype in fp8.FP8_DTYPES:
        rounded = op.inputs(TINY, dtype, "cpu", 9)
        assert set(rounded) == set(raw)
        for name in raw:
            same = torch.equal(rounded[name], raw[name])
            assert same == (name not in op.fp8_operands), (dtype, name)
        assert rounded["residual"].dtype == rounded["a"].dtype == torch.bfloat16
    assert set(op.fp8_operands) == {"a", "w_o", "w_gate", "w_up"}


# ---- the _scaled_mm GEMMs -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", fp8.FP8_DTYPES)
def test_scaled_mm_linear_is_the_dequantized_matmul(dtype):
    rec, g = fp8.recipe(dtype), torch.Generator().manual_seed(1)
    x, w = torch.randn(48, 80, generator=g).bfloat16(), (torch.randn(112, 80, generator=g) / 9).bfloat16()
    wq = fp8.quantize_as(w, "weight", rec)
    assert wq.scale.shape == ((112, 1) if rec.rowwise else ())
    mm = fp8.ScaledMMGemms(rec)
    out = mm.linear(x, wq)
    ref = F.linear(fp8.quantize_as(x, "act", rec).dequantize(torch.float64), wq.dequantize(torch.float64))
    assert out.dtype == torch.bfloat16 and out.shape == (48, 112)
    assert rel_err(out, ref) < 4e-3  # the bf16 output rounding
    assert torch.equal(mm.linear(fp8.quantize_as(x, "act", rec), wq), out)  # a pre-quantized activation: same
    assert rel_err(out, F.linear(x.double(), w.double())) > 1e-2  # ... and fp8 really rounded the operands


@pytest.mark.parametrize("dtype", fp8.FP8_DTYPES)
def test_scaled_mm_dgrad_is_the_dequantized_matmul(dtype):
    rec, g = fp8.recipe(dtype), torch.Generator().manual_seed(2)
    dy, w = torch.randn(48, 112, generator=g).bfloat16(), (torch.randn(112, 80, generator=g) / 9).bfloat16()
    wq, dq = fp8.quantize_as(w, "weight_bwd", rec), fp8.quantize_as(dy, "grad", rec)
    assert wq.data.shape == (80, 112) and wq.data.is_contiguous()  # stored transposed, K-major
    assert wq.scale.shape == dq.scale.shape == () and dq.data.dtype == fp8.E5M2  # per-tensor in either recipe
    out = fp8.ScaledMMGemms(rec).dgrad(dy, wq)
    ref = dq.dequantize(torch.float64) @ wq.dequantize(torch.float64).t()
    assert out.dtype == torch.bfloat16 and out.shape == (48, 80)
    assert rel_err(out, ref) < 4e-3


@pytest.mark.parametrize("dtype", fp8.FP8_DTYPES)
def test_scaled_mm_gemms_run_at_a_k_and_n_off_the_multiple_of_16(dtype, monkeypatch):
    """CUDA's torch._scaled_mm takes K and N in multiples of 16 only (the CPU's takes any; the rule is put in here): the
    GEMMs pad the operands there, so the PyTorch error of an fp8 cell at such a shape (a 50257 vocabulary) exists, and
    it is the dequantized matmul's, up to the bf16 output's rounding."""
    rec, g = fp8.recipe(dtype), torch.Generator().manual_seed(3)
    x, w = torch.randn(30, 40, generator=g).bfloat16(), (torch.randn(50, 40, generator=g) / 9).bfloat16()
    dy = torch.randn(30, 50, generator=g).bfloat16()
    wq, wbq = fp8.quantize_as(w, "weight", rec), fp8.quantize_as(w, "weight_bwd", rec)
    scaled_mm = torch._scaled_mm

    def cuda_rule(a, b, *args, **kwargs):
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", cuda_rule)
    mm = fp8.ScaledMMGemms(rec)
    out, dgrad = mm.linear(x, wq), mm.dgrad(dy, wbq)
    ref = F.linear(fp8.quantize_as(x, "act", rec).dequantize(torch.float64), wq.dequantize(torch.float64))
    dref = fp8.quantize_as(dy, "grad", rec).dequantize(torch.float64) @ wbq.dequantize(torch.float64).t()
    assert out.shape == (30, 50) and dgrad.shape == (30, 40)
    assert rel_err(out, ref) < 4e-3 and rel_err(dgrad, dref) < 4e-3  # the bf16 output rounding


# ---- which cells exist ----------------------------------------------------------------------------

def test_fp8_cells_are_forward_and_dgrad_ops_only():
    swiglu, dgrad, gelu = OPS["rmsnorm_swiglu"], OPS["swiglu_dgrad"], OPS["gemm_bias_gelu"]
    for dtype in fp8.FP8_DTYPES:
        assert swiglu.has_cell("fwd", dtype) and not swiglu.has_cell("bwd", dtype)
        assert not swiglu.has_cell("fwd_bwd", dtype)
        assert dgrad.has_cell("bwd", dtype) and not dgrad.has_cell("fwd", dtype)
        assert not gelu.has_cell("fwd", dtype)  # no fp8 operands declared
    assert all(swiglu.has_cell(m, "bf16") for m in ("fwd", "bwd", "fwd_bwd"))
    with isolated_registry() as registry:
        sel = Selection(ops=("rmsnorm_swiglu", "swiglu_dgrad", "gemm_bias_gelu"), models=("tiny",),
                        modes=("fwd", "bwd", "fwd_bwd"), dtypes=("bf16", "fp8", "fp8-row"), impls=("torch-eager",))
        cells = build_cells(sel, registry)
    fp8_cells = {(c.op, c.mode, c.dtype) for c in cells if c.dtype != "bf16"}
    assert fp8_cells == {("rmsnorm_swiglu", "fwd", d) for d in fp8.FP8_DTYPES} | \
        {("swiglu_dgrad", "bwd", d) for d in fp8.FP8_DTYPES}
    assert sum(c.dtype == "bf16" for c in cells) == 3 + 1 + 3  # bf16: every mode of each op


def test_fp8_needs_an_sm89_gpu(monkeypatch):
    case = Case(OPS["gemm_out"], TINY, "fwd", "fp8", torch.device("cuda"), {})
    eager = TorchEager(OPS["gemm_out"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert eager.skip_reason(case) == "skipped: fp8 (torch._scaled_mm) needs an sm89+ GPU"
    assert eager.skip_reason(replace(case, dtype="bf16")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert eager.skip_reason(case) is None


def test_a_recipe_is_the_one_encoding_of_the_granularity():
    row, tensor = fp8.recipe("fp8-row"), fp8.recipe("fp8")
    assert row.rowwise and not tensor.rowwise and fp8.recipe("bf16") is None
    assert {r: row.rowwise_for(r) for r in fp8.ROLES} == {"act": True, "weight": True, "grad": False,
                                                           "weight_bwd": False}
    assert not any(tensor.rowwise_for(r) for r in fp8.ROLES)
    x = torch.randn(6, 8)
    assert fp8.quantize_as(x, "act", row).scale.shape == (6, 1)
    assert fp8.quantize_as(x, "grad", row).scale.shape == ()


def test_accumulation_mode_flag(tmp_path):
    assert run_parser().parse_args([]).fp8_accum == "fast"
    assert run_parser().parse_args(["--fp8-accum", "promoted"]).fp8_accum == "promoted"
    with pytest.raises(SystemExit):
        run_parser().parse_args(["--fp8-accum", "fp32"])
    with pytest.raises(ValueError, match="fast' or 'promoted"):
        make_runner(tmp_path, fp8_accum="slow")
    case = Case(OPS["gemm_out"], TINY, "fwd", "fp8-row", CPU, {}, "promoted")
    assert case.recipe == fp8.Recipe(rowwise=True, accum="promoted")
    assert replace(case, dtype="bf16").recipe is None


# ---- end to end ---------------------------------------------------------------------------------

def test_fp8_cells_run_through_the_runner(tmp_path):
    with isolated_registry():
        make_runner(tmp_path, ops=["gemm_out", "rmsnorm_swiglu", "swiglu_dgrad"], modes=("fwd", "bwd"),
                    dtypes=("fp8", "fp8-row"), impls=["torch-eager", "torch-compile"], fp8_accum="promoted").run()
        finalize(tmp_path)
    df, err, env = load_run(tmp_path)
    cells = {(r["op"], r["mode"], r["dtype"]) for _, r in df.iterrows()}
    assert cells == {(op, mode, d) for op, mode in [("gemm_out", "fwd"), ("rmsnorm_swiglu", "fwd"),
                                                    ("swiglu_dgrad", "bwd")] for d in fp8.FP8_DTYPES}
    assert (df["status"] == "ok").all(), df[["op", "impl", "dtype", "message"]].to_string()
    assert (df["correct"] == True).all()  # noqa: E712
    for dtype, g in df.groupby("dtype"):
        assert set(g["fp8_recipe"]) == {fp8.recipe(dtype, "promoted").label}
        assert "promoted accum" in g["fp8_recipe"].iloc[0]
    assert env["fp8_accum"] == "promoted" and set(env["fp8_recipes"]) == set(fp8.FP8_DTYPES)
    for _, g in df.groupby(["op", "mode", "dtype"]):
        assert g["cast_ms"].nunique() == 1 and g["cast_ms"].iloc[0] > 0  # one cast time per group
    # PyTorch's error is torch-eager's own _scaled_mm composition: ratio 1 exactly
    eager = df[df["impl"] == "torch-eager"]
    assert (eager["err_ratio"] == 1.0).all()
    # fp8 is further from the unquantized bf16 computation than from its float64 reference on the grid
    assert (df["rel_err_vs_bf16"] > df["rel_err"]).all()
    assert err["rel_err_vs_bf16"].notna().all() and set(err["dtype"]) == set(fp8.FP8_DTYPES)
    assert {"dgate", "dup", "a", "zdz"} <= set(err[err["op"] == "swiglu_dgrad"]["output"])
    html = (tmp_path / "report.html").read_text()
    assert "cast ms" in html and "err vs bf16" in html and "fp8-row recipe" in html
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(r["cast_ms"] > 0 for r in data["results"])
    raw = pd.read_csv(tmp_path / "results.csv", keep_default_na=False, na_values=[""])
    assert raw["fp8_recipe"].str.startswith(("per-tensor", "rowwise")).all()
