"""CODA kernels on fp8 operands: on the GPU when there is one, else in the Triton interpreter.

The interpreter runs fp8 dots exactly and, with :func:`kernels.coda.epilogue.round_like_gpu`, rounds its
bf16/fp8 stores as the GPU does, so the checks are the same on both (the GPU's fp32 reference kernels use
TF32, hence a looser tolerance for fp32 outputs there):
- the quantizing pass is bit-identical to the recipe (:func:`workloads.fp8.quantize`);
- every fp8 kernel equals the same kernel on the dequantized operands in fp32 (the scale folding), up to
  the rounding of its bf16 outputs;
- through the harness, every fp8 op of coda-triton passes the pass rule against ``_scaled_mm`` + PyTorch.
Each runs both paths of the kernels (the ``strategy`` fixture: the split path's GEMM is the mainloop's, dequantizing).
"""
from __future__ import annotations

import pytest
import torch

from codabench.case import Case
from codabench.correctness import CHECK_SEED, build_reference, check_impl
from codabench.metrics import rel_err
from codabench.registry import REGISTRY, prepared
from kernels.coda import plugin  # noqa: F401  (registers coda-triton)
from kernels.coda.cross_entropy import gemm_cross_entropy
from kernels.coda import fp8
from kernels.coda.fp8 import quantize_from_partials
from kernels.coda.gemm import linear
from kernels.coda.producer import gemm_residual_norm, norm_input
from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm
from kernels.coda.rope import gemm_rope
from kernels.coda.scaled_linear import scaled_linear
from kernels.coda.swiglu import gemm_swiglu
from kernels.coda.swiglu_bwd import dgrad_swiglu
from workloads.fp8 import E4M3, E5M2, Fp8, Recipe, quantize
from workloads.models import get_model
from workloads.ops import OPS

from kernel_helpers import launches, rand

DEV = "cuda" if torch.cuda.is_available() else "cpu"
M, K, N = 48, 80, 112
BF16_ROUNDING = 4e-3  # relative Frobenius error of rounding to bf16 is about 2^-9 / sqrt(3) ~ 1.1e-3
FP32_TOL = 1e-5 if DEV == "cpu" else 1e-3  # fp32 outputs (loss, lse, zdz); TF32 GEMMs on the GPU


def _r(*shape: int, **kw) -> torch.Tensor:
    return rand(*shape, **kw).to(DEV)


def _q(t: torch.Tensor, rowwise: bool, dtype=E4M3) -> Fp8:
    return quantize(t, dtype, rowwise)


def _deq(q: Fp8) -> torch.Tensor:
    return q.dequantize(torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_from_partials_is_bit_identical_to_the_recipe(dtype, rowwise):
    x = _r(48, 96, seed=1) * torch.exp2(torch.arange(48, device=DEV).float()[:, None] % 13 - 6)
    x[3] = 0.0  # a zero row: scale 1
    x[5, :4] = torch.tensor([-1e-6, 1e-6, -3e-5, 0.0])  # values that round to (signed) zero
    part = x.abs().reshape(48, 3, 32).amax(-1)
    ours, ref = quantize_from_partials(x, part, 3, rowwise, dtype), quantize(x, dtype, rowwise)
    assert ours.scale.shape == ref.scale.shape and torch.equal(ours.scale, ref.scale)
    assert ours.data.dtype == dtype and torch.equal(_bits(ours.data), _bits(ref.data))


@pytest.mark.parametrize("rowwise", [False, True])
def test_the_per_tensor_scale_is_the_max_over_every_block_of_rows(rowwise, monkeypatch):
    """Per tensor, the maxima of blocks of 64 rows, reduced by every quantizing program two at a time here (so over
    three steps): the largest value, in the last block, sets the scale."""
    monkeypatch.setattr(fp8, "BLOCK_MAX_STEP", 2)
    x = _r(300, 48, seed=4)
    x[297, 5] = 1000.0  # rows 256-299: the fifth block of 64
    part = x.abs().reshape(300, 6, 8).amax(-1)
    ours, ref = quantize_from_partials(x, part, 6, rowwise), quantize(x, E4M3, rowwise)
    assert torch.equal(ours.scale, ref.scale) and torch.equal(_bits(ours.data), _bits(ref.data))


@pytest.mark.parametrize("accum", ["fast", "promoted"])
@pytest.mark.parametrize("rowwise", [False, True])
def test_fp8_gemm_equals_the_dequantized_product(rowwise, accum):
    xq, wq = _q(_r(M, K, seed=2), rowwise), _q(_r(N, K, seed=3, scale=0.1), rowwise)
    out = linear(xq, wq, recipe=Recipe(rowwise, accum))
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert rel_err(out, _deq(xq).double() @ _deq(wq).double().T) < BF16_ROUNDING


def test_fp8_operands_take_matching_scale_kinds():
    xq, wq = _q(_r(M, K, seed=2), False), _q(_r(N, K, seed=3), True)
    with pytest.raises(ValueError, match="per-tensor scales on both sides or rowwise"):
        linear(xq, wq)
    with pytest.raises(ValueError, match="two fp8 operands"):
        linear(xq, _r(N, K, seed=3))


@pytest.mark.parametrize("rowwise", [False, True])
def test_fp8_consumers_fold_scales_like_fp32_on_dequantized_operands(rowwise, strategy):
    hq, rstd = _q(_r(M, K, seed=4), rowwise), _r(M, seed=5).abs() + 0.5
    w = {n: _q(_r(n_rows, K, seed=6 + i, scale=0.1), rowwise) for i, (n, n_rows) in
         enumerate([("lin", N), ("gu", N), ("qkv", 128), ("lm", 208)])}
    h32 = _deq(hq)
    assert rel_err(scaled_linear(hq, w["lin"], rstd), scaled_linear(h32, _deq(w["lin"]), rstd)) < BF16_ROUNDING
    y8, z8 = gemm_swiglu(hq, w["gu"], rstd, save_preact=True)
    y32, z32 = gemm_swiglu(h32, _deq(w["gu"]), rstd, save_preact=True)
    assert y8.dtype == z8.dtype == torch.bfloat16
    assert rel_err(y8, y32) < BF16_ROUNDING and rel_err(z8, z32) < BF16_ROUNDING
    pos = torch.arange(M, device=DEV) % 40
    qkv8 = gemm_rope(hq, w["qkv"], rstd, pos, 4, 2, 16, 10000.0)
    assert rel_err(qkv8, gemm_rope(h32, _deq(w["qkv"]), rstd, pos, 4, 2, 16, 10000.0)) < BF16_ROUNDING
    target = torch.randint(0, 208, (M,), generator=torch.Generator().manual_seed(0)).to(DEV)
    loss8, lse8, _, _ = gemm_cross_entropy(hq, w["lm"], rstd, target)
    loss32, lse32, _, _ = gemm_cross_entropy(h32, _deq(w["lm"]), rstd, target)
    tol = FP32_TOL if strategy == "fused" else BF16_ROUNDING  # split: the GEMM's logits are rounded to bf16 first
    assert rel_err(loss8, loss32) < tol and rel_err(lse8, lse32) < tol


@pytest.mark.parametrize("rowwise", [False, True])
def test_fp8_producer_hands_on_its_output_quantized(rowwise, strategy):
    """x, rstd as on the dequantized operands; h quantized exactly as the recipe quantizes the bf16 h."""
    aq, wq = _q(_r(M, K, seed=10), rowwise), _q(_r(N, K, seed=11, scale=0.1), rowwise)
    res, gamma = _r(M, N, seed=12).bfloat16(), _r(N, seed=13, scale=0.1, mean=1.0).bfloat16()
    recipe = Recipe(rowwise=rowwise)
    x, h, rstd = gemm_residual_norm(aq, wq, res, gamma, 1e-5)  # (on the GPU: also tunes, before the count)
    with launches() as names:
        x8, h8, rstd8 = gemm_residual_norm(aq, wq, res, gamma, 1e-5, h_fp8=recipe)
    assert names == {"fused": ["gemm_residual_norm_kernel", "scale_kernel", "quantize_kernel", "rstd_kernel"],
                     "split": ["gemm_kernel", "gemm_residual_norm_rows_kernel", "scale_kernel", "quantize_kernel",
                               "rstd_kernel"]}[strategy]
    assert torch.equal(x8, x) and torch.equal(rstd8, rstd)
    ref = quantize(h, E4M3, rowwise)
    assert torch.equal(h8.scale, ref.scale) and torch.equal(_bits(h8.data), _bits(ref.data))
    x32, _, _ = gemm_residual_norm(_deq(aq), _deq(wq), res.float(), gamma.float(), 1e-5)
    assert rel_err(x, x32) < BF16_ROUNDING
    hn, _ = norm_input(x, gamma, 1e-5)
    hn8, _ = norm_input(x, gamma, 1e-5, h_fp8=recipe)
    assert torch.equal(_bits(hn8.data), _bits(quantize(hn, E4M3, rowwise).data))
    w_gu = _q(_r(128, N, seed=14, scale=0.1), rowwise)
    y, _ = gemm_swiglu(h8, w_gu, rstd, save_preact=False)
    y8, _ = gemm_swiglu(h8, w_gu, rstd, save_preact=False, y_fp8=recipe)
    assert torch.equal(_bits(y8.data), _bits(quantize(y, E4M3, rowwise).data))


def test_fp8_dgrad_kernels_fold_the_per_tensor_scales(strategy):
    """e5m2 gradient x e4m3 weight (stored K-major, passed as its transposed view), per-tensor scales."""
    d, f = 80, 56
    dzq, dxq = _q(_r(M, 2 * f, seed=20), False, E5M2), _q(_r(M, d, seed=21), False, E5M2)
    w = _r(2 * f, d, seed=22, scale=0.1)   # gate/up weight, nn.Linear (2f, d)
    wd = _r(d, f, seed=23, scale=0.1)      # down weight, nn.Linear (d, f)
    wq, wdq = _q(w.T.contiguous(), False), _q(wd.T.contiguous(), False)   # K-major copies
    w_lin, wd_lin = wq.T, wdq.T
    x, gamma, zdz = _r(M, d, seed=24).bfloat16(), _r(d, seed=25, scale=0.1, mean=1.0), _r(M, seed=26)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5)
    dx8, y8, dg8 = dgrad_rmsnorm(dzq, w_lin, x, rstd, gamma, zdz)
    dx32, y32, dg32 = dgrad_rmsnorm(_deq(dzq), _deq(wq).T, x.float(), rstd, gamma, zdz)
    assert dx8.dtype == y8.dtype == torch.bfloat16
    for ours, ref in ((dx8, dx32), (y8, y32), (dg8, dg32)):
        assert rel_err(ours, ref) < BF16_ROUNDING
    z_pre = _r(M, 2 * f, seed=27).bfloat16()
    dz8, a8, zdz8 = dgrad_swiglu(dxq, wd_lin, z_pre)
    dz32, a32, zdz32 = dgrad_swiglu(_deq(dxq), _deq(wdq).T, z_pre.float())
    tol = FP32_TOL if strategy == "fused" else BF16_ROUNDING  # split: dy is rounded to bf16 first
    assert rel_err(dz8, dz32) < BF16_ROUNDING and rel_err(a8, a32) < BF16_ROUNDING and rel_err(zdz8, zdz32) < tol


# ---- the plugin, through the harness ------------------------------------------------------------------

FP8_OPS = ["gemm_out", "rmsnorm_linear", "rmsnorm_swiglu", "rmsnorm_rope", "rmsnorm_ce", "lm_head_ce", "block",
           "rmsnorm_dgrad", "swiglu_dgrad",
           # the kernel level: each host function on fp8 operands
           "producer_out", "producer_down", "scaled_linear", "gemm_swiglu", "gemm_swiglu_save", "gemm_rope", "gemm_ce",
           "gemm_ce_grad", "rmsnorm_dgrad_qkv", "rmsnorm_dgrad_lm"]


@pytest.mark.parametrize("dtype", ["fp8", "fp8-row"])
@pytest.mark.parametrize("op_name", FP8_OPS)
def test_plugin_fp8_passes_the_harness_check(op_name, dtype, strategy):
    op, impl = OPS[op_name], REGISTRY.get(op_name, "coda-triton")
    model = get_model("tiny")
    mode = op.modes[0]
    assert op.has_cell(mode, dtype)
    case = Case(op, model, mode, dtype, torch.device(DEV), op.inputs(model, dtype, DEV, CHECK_SEED))
    assert impl.skip_reason(case) is None
    outcome = check_impl(build_reference(op, case), impl)
    assert outcome.correct, (outcome.errors, [(c.output, c.stats, c.torch_rel_err) for c in outcome.checks])
    assert {c.output for c in outcome.checks} == set(op.outputs) | set(op.side_outputs)


@pytest.mark.parametrize("accum", ["fast", "promoted"])
@pytest.mark.parametrize("op_name", ["block", "swiglu_dgrad", "gemm_out"])
def test_the_cells_recipe_reaches_every_launch_as_its_accumulation_mode(op_name, accum, monkeypatch):
    """The cell's recipe travels from the Case through the plugin, the compositions and the host functions to the
    launch, where every mainloop kernel of the call gets ``PROMOTE`` from its accumulation mode (fused paths)."""
    from kernels.coda.launch import MAINLOOP_PARAMS
    from kernel_helpers import rstd_kernel
    monkeypatch.setenv("CODABENCH_STRATEGY", "fused")
    op, impl = OPS[op_name], REGISTRY.get(op_name, "coda-triton")
    model = get_model("tiny")
    case = Case(op, model, op.modes[0], "fp8", torch.device(DEV), op.inputs(model, "fp8", DEV, CHECK_SEED), accum)
    native = prepared(impl, case)
    seen: list[bool] = []
    cls = type(rstd_kernel)
    orig = cls.run

    def run(self, *args, **kwargs):
        if tuple(self.arg_names[:len(MAINLOOP_PARAMS)]) == MAINLOOP_PARAMS:
            seen.append({**dict(zip(self.arg_names, args)), **kwargs}["PROMOTE"])
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(cls, "run", run)
    impl.run(native)
    assert seen and set(seen) == {accum == "promoted"}
