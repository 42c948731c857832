"""The ``coda-triton`` implementation of every op of the catalogue (label "fused").

Each op is composed from the CODA kernels of this package, through the autograd compositions of
:mod:`kernels.coda.functions` (under no_grad: the forward kernels alone; backward: the fused dgrad kernels)::

  producer        x, h, rstd = gemm_residual_norm(a, Wp, residual, gamma)   (+ finish_rstd)
  rmsnorm_linear  z = scaled_linear(h, Wc, rstd)
  rmsnorm_swiglu  y = gemm_swiglu(h, W_gu, rstd)           W_gu: gate/up rows interleaved
  rmsnorm_rope    qkv = gemm_rope(h, W_qkv', rstd, positions)  W_qkv': q/k rows in adjacent-pair order
  rmsnorm_ce      loss, lse = gemm_cross_entropy(h, Wlm, rstd, target)   (logits never written)
  lm_head_ce      h, rstd = norm_input(x, gamma); loss as above
  block           producer(out-proj) -> gemm_swiglu -> producer(down-proj) -> gemm_rope
  rmsnorm_dgrad   dx, y, dgamma = dgrad_rmsnorm(dz, W, x, rstd, gamma, zdz, dres)   (direct op, bwd)
  swiglu_dgrad    dz_pre, a, zdz = dgrad_swiglu(dx, Wd, z_pre)   z_pre: gate/up columns interleaved (bwd)
  gemm_*          the plain mainloop GEMM (kernels.coda.gemm.linear)

The kernel-level ops (``Op.level`` ``kernel``, the kernels suite) call one host function each, directly::

  producer_out/_down   x, h, rstd = gemm_residual_norm(a, Wp, residual, gamma)
  scaled_linear        z = scaled_linear(h, Wc, rstd)
  gemm_swiglu(_save)   y (, z_pre) = gemm_swiglu(h, W_gu, rstd, save_preact)
  gemm_rope            qkv = gemm_rope(h, W_qkv', rstd, positions)
  gemm_ce(_grad)       loss, lse (, dlogits, zdz) = gemm_cross_entropy(h, Wlm, rstd, target, with_grad)
  norm_input           h, rstd = norm_input(x, gamma)
  rmsnorm_dgrad_qkv    as rmsnorm_dgrad, at the QKV shape
  rmsnorm_dgrad_lm     dx, y, dgamma = dgrad_rmsnorm(dz, Wlm, x, rstd, gamma, zdz, dz_scale=scale)   (no dres)
  swiglu_bwd           dz_pre, zdz = swiglu_bwd(dy, z_pre)
  rope_bwd             dz, zdz = rope_bwd(dqkv, qkv, positions)     dqkv, qkv, dz: adjacent RoPE pairs
  lm_head_wgrad        dw = matmul(dz^T, y, scale=scale)

``prepare`` (untimed) interleaves the gate/up weights (and saved gate/up activations) and permutes the q/k rows of
W_qkv (and the q/k columns of packed qkv activations); outputs and gradients are converted back to the canonical
layouts (half-split qkv, separate gate/up weights and activations).
Side outputs: rstd (rstd_mlp / rstd_attn for the block) and lse.

rmsnorm_ce and lm_head_ce with grad compute the LM head's gradients in the forward, over chunks of rows
(:func:`kernels.coda.cross_entropy_bwd.lm_head_ce_grad`), as Liger's fused linear cross-entropy does: their
``bwd`` cells would time little more than handing those gradients back, so they are n/a (``grads_in_forward``),
as Liger's are; ``fwd`` (no grad) is unchanged, and ``fwd_bwd`` is the comparison that counts.
Each fused kernel runs fused, split or gluon (:mod:`kernels.coda.strategy`); ``describe`` reports which, for the
cell's last call (the ``strategy`` column).

fp8 cells (``fp8`` per-tensor, ``fp8-row`` rowwise): ``prepare`` also quantizes the op's GEMM operands
(after the layout changes) under the cell's recipe; the compositions run through
``kernels.coda.functions.FP8_FORWARD``, the dgrad ops and plain GEMMs on the fp8 operands directly.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton

from codabench.case import Case
from codabench.registry import REGISTRY, FirstCalls, Implementation, Native, Tensors
from kernels import layouts
from kernels.coda.align import aligned
from kernels.coda.functions import (FP8_FORWARD, CrossEntropy, Linear, RoPE, SwiGLU, block, norm_consumer,
                                    producer_consumer)
from kernels.coda.cross_entropy import gemm_cross_entropy
from kernels.coda.gemm import linear, matmul
from kernels.coda.precompile import precompile_autograd
from kernels.coda.program import Binding, register
from kernels.coda.producer import gemm_residual_norm, model_eps, norm_input
from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm
from kernels.coda.rope import gemm_rope, model_rope
from kernels.coda.rope_bwd import rope_bwd
from kernels.coda.scaled_linear import scaled_linear
from kernels.coda.strategy import Recorder, summary
from kernels.coda.swiglu import gemm_swiglu
from kernels.coda.swiglu_bwd import dgrad_swiglu, swiglu_bwd
from workloads import fp8
from workloads.models import ModelShape
from workloads.ops import OPS
from workloads.ops.gemm import GEMM_SHAPES


def _qkv_args(model: ModelShape) -> tuple[int, int, int]:
    return model.heads, model.kv_heads, model.head_dim


def _rope(n: Native) -> RoPE:
    model = n.model
    return RoPE(n["positions"], *_qkv_args(model), model.rope_theta)


# ---- compositions (native layouts) ------------------------------------------------------------

def _compose(n: Native, composition: Callable, *args) -> tuple[torch.Tensor, ...]:
    """``composition(*args)``, or its fp8 forward under the cell's recipe."""
    if n.recipe is not None:
        return FP8_FORWARD[composition](n.recipe, *args)
    return composition(*args)


def _producer_consumer(n: Native, w_p: str, w: str, consumer) -> tuple[torch.Tensor, ...]:
    return _compose(n, producer_consumer, n["a"], n["residual"], n[w_p], n["gamma"], n[w], consumer, n.model.eps)


def rmsnorm_linear_run(n: Native) -> Tensors:
    x, z, rstd = _producer_consumer(n, "w_o", "w_c", Linear())
    return {"x": x, "z": z, "rstd": rstd}


def rmsnorm_swiglu_run(n: Native) -> Tensors:
    x, y, rstd = _producer_consumer(n, "w_o", "w_gu", SwiGLU())
    return {"x": x, "y": y, "rstd": rstd}


def rmsnorm_rope_run(n: Native) -> Tensors:
    x, qkv, rstd = _producer_consumer(n, "w_down", "w_qkv", _rope(n))
    return {"x": x, "qkv": qkv, "rstd": rstd}


def rmsnorm_ce_run(n: Native) -> Tensors:
    x, loss, rstd, lse = _producer_consumer(n, "w_down", "w_lm", CrossEntropy(n["target"]))
    return {"x": x, "loss": loss, "rstd": rstd, "lse": lse}


def lm_head_ce_run(n: Native) -> Tensors:
    loss, rstd, lse = _compose(n, norm_consumer, n["x"], n["gamma"], n["w_lm"], CrossEntropy(n["target"]),
                               n.model.eps)
    return {"loss": loss, "rstd": rstd, "lse": lse}


def block_run(n: Native) -> Tensors:
    x, qkv, rstd_mlp, rstd_attn = _compose(n, block, n["a"], n["residual"], n["w_o"], n["gamma_mlp"], n["w_gu"],
                                           n["w_down"], n["gamma_attn"], n["w_qkv"], _rope(n), n.model.eps)
    return {"x": x, "qkv": qkv, "rstd_mlp": rstd_mlp, "rstd_attn": rstd_attn}


def gemm_run(n: Native) -> Tensors:
    return {"out": linear(n["x"], n["w"], recipe=n.recipe)}


# ---- the implementation -----------------------------------------------------------------------

def _row_layout(v: object) -> object:
    """A 2-D tensor (or an fp8 operand's data) in the kernels' row layout (:func:`kernels.coda.align.aligned`: itself
    when its rows meet the 16-byte rule, else a copy with padded rows), so that a timed call copies no input; other
    values as they are."""
    if isinstance(v, fp8.Fp8):
        return fp8.Fp8(aligned(v.data), v.scale)
    return aligned(v) if isinstance(v, torch.Tensor) and v.dim() == 2 else v


DECLARED = (gemm_residual_norm, scaled_linear, gemm_swiglu, gemm_rope, gemm_cross_entropy, dgrad_rmsnorm, dgrad_swiglu)
"""The CODA kernels declared as their epilogues (:mod:`kernels.coda.program`), whose ``binds`` name the ops each
implements alone."""

RECORDER = Recorder()
"""The strategies of the last call of a coda-triton op: its forward and, in autograd modes, its backward."""


class CodaTriton(Implementation):
    """One op as CODA fused GEMM-epilogue Triton kernels (the fixed mainloop + epilogue primitives)."""

    name = "coda-triton"
    label = "fused"
    dtypes = ("fp32", "fp16", "bf16", *fp8.FP8_DTYPES)
    requires = ("triton-dot",)

    def __init__(self, op: str, forward: Callable[[Tensors], Tensors], modes: tuple[str, ...], description: str,
                 grads_in_forward: bool = False):
        self.op, self._forward, self.modes, self.description = op, forward, modes, description
        self.grads_in_forward = grads_in_forward
        self.source = __name__
        self._first_calls = FirstCalls()

    def prepare(self, case: Case) -> Tensors:
        """Canonical -> native, untimed: interleaved gate/up rows, q/k rows in adjacent-pair order; fp8 cells:
        then the GEMM operands quantized under the cell's recipe; last, 2-D tensors in the kernels' row layout."""
        native: Tensors = {k: v for k, v in case.inputs.items() if k not in ("w_gate", "w_up")}
        if "w_gate" in case.inputs:
            native["w_gu"] = layouts.interleave_rows(case.inputs["w_gate"], case.inputs["w_up"])
        if "w_qkv" in case.inputs:
            native["w_qkv"] = layouts.qkv_rows_to_adjacent(case.inputs["w_qkv"], *_qkv_args(case.model))
        # swiglu_dgrad, swiglu_bwd: the saved pre-activation, interleaved as the forward keeps it
        if "gate" in case.inputs:
            native["z_pre"] = layouts.interleave_cols(native.pop("gate"), native.pop("up"))
        for k in ("qkv", "dqkv"):  # rope_bwd: the saved output and its gradient, adjacent pairs as the forward's
            if k in case.inputs:
                native[k] = layouts.qkv_cols_to_adjacent(case.inputs[k], *_qkv_args(case.model))
        native = {k: _row_layout(v) for k, v in case.quantize(native, {"w_gate": "w_gu", "w_up": "w_gu"}).items()}
        self._first_calls.arm((case.model, case.dtype, case.device, case.recipe), case.device)
        return native

    def run(self, native: Native) -> Tensors:
        device = self._first_calls.take()
        if device is not None:  # the shape's first call: its kernels (and the backward's) compiled first
            compared = OPS[self.op].outputs  # the outputs the harness's backward starts from
            precompile_autograd(lambda: {k: v for k, v in self._forward(native).items() if k in compared},
                                native.values(), device)
        RECORDER.start()
        return self._forward(native)

    def describe(self, native: Native) -> str:
        return summary(RECORDER.launches())

    def outputs_to_canonical(self, outputs: Tensors, native: Native) -> Tensors:
        out = dict(outputs)
        if "qkv" in out:
            out["qkv"] = layouts.qkv_cols_to_halfsplit(out["qkv"], *_qkv_args(native.model))
        if "dz_pre" in out:
            out["dgate"], out["dup"] = layouts.deinterleave_cols(out.pop("dz_pre"))
        if "z_pre" in out:
            out["gate"], out["up"] = layouts.deinterleave_cols(out.pop("z_pre"))
        if "dqkv" in native:  # rope_bwd: dz, the gradient of the pre-RoPE qkv, has adjacent pairs too
            out["dz"] = layouts.qkv_cols_to_halfsplit(out["dz"], *_qkv_args(native.model))
        return out

    def grad_outputs_to_native(self, grad_outputs: Tensors, native: Native) -> Tensors:
        out = dict(grad_outputs)
        if "qkv" in out:
            out["qkv"] = layouts.qkv_cols_to_adjacent(out["qkv"], *_qkv_args(native.model))
        return out

    def grads_to_canonical(self, grads: Tensors, native: Native) -> Tensors:
        out = dict(grads)
        if "w_gu" in out:
            out["w_gate"], out["w_up"] = layouts.deinterleave_rows(out.pop("w_gu"))
        if "w_qkv" in out:
            out["w_qkv"] = layouts.qkv_rows_to_halfsplit(out["w_qkv"], *_qkv_args(native.model))
        return out

    def metadata(self) -> dict[str, str]:
        return {"triton": triton.__version__, "torch": torch.__version__}


ALL_MODES = ("fwd", "bwd", "fwd_bwd")
CE_MODES = ("fwd", "fwd_bwd")
"""The CE ops compute the LM head's gradients in the forward (``grads_in_forward``): their ``bwd`` cells are n/a."""
for _op, _fn, _modes, _desc in [
    ("rmsnorm_linear", rmsnorm_linear_run, ALL_MODES, "producer GEMM + residual + norm partials; row-scaled GEMM"),
    ("rmsnorm_swiglu", rmsnorm_swiglu_run, ALL_MODES, "producer GEMM + norm partials; gate/up GEMM + SwiGLU epilogue"),
    ("rmsnorm_rope", rmsnorm_rope_run, ALL_MODES, "producer GEMM + norm partials; QKV GEMM + RoPE epilogue"),
    ("rmsnorm_ce", rmsnorm_ce_run, CE_MODES, "producer GEMM + norm partials; LM-head GEMM + LSE/CE epilogue"),
    ("lm_head_ce", lm_head_ce_run, CE_MODES, "norm statistics pass; LM-head GEMM + LSE/CE epilogue"),
    ("block", block_run, ALL_MODES, "4 fused GEMMs + 2 rstd reductions (CODA block boundary); "
                                    "bwd: RoPE bwd + 3 fused dgrad GEMMs + sums + 5 GEMMs"),
]:
    REGISTRY.add(CodaTriton(_op, _fn, _modes, _desc, grads_in_forward=_modes == CE_MODES))
for _op in GEMM_SHAPES:  # the speed-of-light of the fused kernels
    REGISTRY.add(CodaTriton(_op, gemm_run, ("fwd",), "plain GEMM, CODA mainloop"))
for _host in DECLARED:  # the ops each declared kernel implements alone (its binds): the direct dgrads, the kernel level
    register(_host, CodaTriton.name, CodaTriton)
for _host, _binding in [  # the kernel level of what is not a declared kernel: one host function each
    (norm_input, Binding(("norm_input",), ("h", "rstd"), "norm_input: one pass, h and rstd", model_eps)),
    (swiglu_bwd, Binding(("swiglu_bwd",), ("dz_pre", "zdz"), "swiglu_bwd: elementwise, one pass")),
    (rope_bwd, Binding(("rope_bwd",), ("dz", "zdz"), "rope_bwd: elementwise, one pass", model_rope)),
    (matmul, Binding(("lm_head_wgrad",), ("dw",), "matmul: dz^T y GEMM + loss scale",
                     lambda n: {"a": n["dz"].T, "b": n["y"]})),
]:
    register(_host, CodaTriton.name, CodaTriton, (_binding,))
