"""The CODA compositions and the pieces of their backward, built only from the kernels of this package.

Each composition is a ``coda::`` custom op (:mod:`kernels.coda.ops`: its fake-tensor rule and autograd, whose
backward composes the backward pieces of this module as ops too); the public functions below run them by
:func:`kernels.coda.ops.call`, so that torch.compile traces them as opaque ops while eager calls run the same
implementations and autograd without the dispatcher. A consumer crosses the op boundary as its kind and fields
(:data:`CONSUMER_ARGS`).

Three compositions, each parametrized by the *consumer* GEMM that reads a normalized activation
``rmsnorm(x; gamma) = rstd * (x * gamma)`` (coda-spec rewrite (a)):

    producer_consumer   x = residual + a Wp^T;  out = consumer(rmsnorm(x; gamma) W^T)       (the patterns)
    block               x1 = residual + a Wo^T;  y = SwiGLU(rmsnorm(x1; gamma_mlp) Wgu^T);
                        x = x1 + y Wd^T;  out = consumer(rmsnorm(x; gamma) W^T)           (CODA's block)
    norm_consumer       out = consumer(rmsnorm(x; gamma) W^T) for an x no GEMM produced   (first layer, LM head)

Consumers: :class:`Linear` (z), :class:`SwiGLU` (y), :class:`RoPE` (rotated qkv), :class:`CrossEntropy`
(loss). A consumer's backward yields ``(dz, zdz)``: the gradient of its GEMM output ``z`` and the ZdZ
statistic ``<z, dz>`` (or None, for the plain linear, which keeps no z). Then

    dx, y, dgamma = dgrad_rmsnorm(dz, W, x, rstd, gamma, zdz, dres)       (one fused dgrad GEMM)
    dW = dz^T y;   producer: da = dx Wp, dWp = dx^T a, dresidual = dx       (plain GEMMs, :func:`~kernels.coda.gemm.mm`)

and the block's down-proj dgrad carries the SwiGLU backward (:func:`dgrad_swiglu`). Backward of the
block: 1 elementwise kernel (RoPE) + 3 fused dgrad GEMMs + small sums + 5 plain GEMMs.

Cross-entropy computes its gradients in the forward instead (:attr:`Consumer.grad_in_forward`), as Liger's
fused linear cross-entropy does: the same dgrad and dW for ``dloss = 1``, over chunks of rows, each chunk's as
soon as its dlogits exist (:func:`kernels.coda.cross_entropy_bwd.lm_head_ce_grad`), so that no [M, V] tensor
outlives a chunk. Its backward multiplies them by dloss in place on the device (a no-op when dloss is 1) and adds
dres to dx; the producer's and the block's own GEMMs stay in backward.

fp8 (:mod:`workloads.fp8` recipes) is forward-only: ``FP8_FORWARD`` maps each composition to its forward on
fp8 weights and inputs, each epilogue handing the next GEMM its input already quantized (absmax partials
+ one quantizing pass), with the dequantization folded into every epilogue.

Saved for backward (coda-spec "The block"): the residual streams x (x1), the rstd vectors, the SwiGLU
pre-activation, the rotated qkv (RoPE's output); the linear consumer keeps nothing, and cross-entropy the gradients
dx [M, d], dgamma [d] and dW [V, d] that its forward computed (plus the GEMM inputs a and the weights). h,
y and the pre-RoPE values are recomputed in epilogues; a consumer's output is kept only where its backward reads it
(RoPE's). Cross-entropy's forward holds one [mc, V] chunk buffer while it runs, nothing of size [M, V]. Without grad
(or when no input needs one) nothing is saved and the LM head never writes logits. A weight that needs no gradient
(frozen: LoRA's base weights) gets none computed, in backward or in cross-entropy's forward.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from kernels.coda.cross_entropy import gemm_cross_entropy
from kernels.coda.cross_entropy_bwd import lm_head_ce_grad
from kernels.coda.gemm import mm
from kernels.coda.producer import gemm_residual_norm, norm_input
from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm
from kernels.coda.rope import gemm_rope
from kernels.coda.rope_bwd import rope_bwd
from kernels.coda.scaled_linear import scaled_linear
from kernels.coda.swiglu import gemm_swiglu
from kernels.coda.swiglu_bwd import dgrad_swiglu, swiglu_bwd
from workloads.fp8 import Fp8, Recipe
from workloads.reference import IGNORE_INDEX

Saved = tuple[torch.Tensor, ...]


# ---- consumers ------------------------------------------------------------------------------------

class Consumer:
    """The GEMM ``z = rstd * (h @ W^T)`` on ``h = x * gamma`` and the epilogue op applied to z.

    A consumer crosses the ``coda::`` op boundary (:mod:`kernels.coda.ops`) as its :attr:`kind` and
    :meth:`op_args` (tensors and primitives only), and :func:`consumer_of` builds it back."""

    kind: ClassVar[str]
    """The consumer's name in the ``coda::`` ops: linear, swiglu, rope, cross_entropy."""
    side_outputs: ClassVar[int] = 0
    """How many non-differentiable side outputs :meth:`forward` returns."""
    keeps_output: ClassVar[bool] = False
    """Whether :meth:`backward` reads the forward's output (first of its saved tensors)."""
    grad_in_forward: ClassVar[bool] = False
    """Whether the forward computes the gradients (:meth:`forward_grad`, for a scalar output) instead of
    :meth:`backward` computing dz."""

    def forward(self, h: torch.Tensor | Fp8, w: torch.Tensor | Fp8, rstd: torch.Tensor, save: bool,
                recipe: Recipe | None = None) -> tuple[torch.Tensor, Saved, Saved]:
        """``(output, non-differentiable side outputs, tensors saved for backward besides the output)``; fp8 h and
        w are dequantized in the epilogue (``recipe``: their fp8 recipe, whose accumulation mode the launch reads)."""
        raise NotImplementedError

    def backward(self, grad: torch.Tensor, saved: Saved) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dz, zdz)`` from the output's gradient: the gradient of z and zdz = <z, dz> (None: not known here).
        ``saved``: the output when :attr:`keeps_output`, then what :meth:`forward` saved."""
        raise NotImplementedError

    def forward_grad(self, h: torch.Tensor, w: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                     gamma: torch.Tensor) -> tuple[torch.Tensor, Saved, Saved]:
        """With :attr:`grad_in_forward`: ``(output, side outputs, (dx, dgamma, dW, applied))``, the gradients of
        the normalized input x, of gamma and of W for a unit gradient of the scalar output, and the fp32 [1]
        dloss they carry (:func:`kernels.coda.cross_entropy_bwd.rescale_`)."""
        raise NotImplementedError

    def op_args(self) -> tuple[Any, ...]:
        """The values of :data:`CONSUMER_ARGS` after ``kind``: this consumer's fields, defaults elsewhere."""
        return (None, 0, 0, 0, 0.0, None, IGNORE_INDEX, "mean", None, True)


CONSUMER_ARGS = ("kind", "rows", "heads", "kv_heads", "head_dim", "theta", "inv_freq", "ignore_index", "reduction",
                 "chunk_rows", "weight_grad")
"""A consumer as arguments of a ``coda::`` op: :attr:`Consumer.kind`, the per-row tensor (RoPE's positions,
cross-entropy's targets), RoPE's fields, cross-entropy's fields."""


class Linear(Consumer):
    """``z`` itself (pattern (a), plain row scale); keeps nothing: no ZdZ, which the RMSNorm backward then takes from
    its dgrad output's rows (:func:`kernels.coda.rmsnorm_bwd.dgrad_rmsnorm`'s split path)."""

    kind = "linear"

    def forward(self, h, w, rstd, save, recipe=None):
        return scaled_linear(h, w, rstd, recipe), (), ()

    def backward(self, dz, saved):
        return dz, None


class SwiGLU(Consumer):
    """``y_i = silu(z_2i) z_2i+1`` on interleaved gate/up rows of W; keeps the pre-activation z."""

    kind = "swiglu"

    def forward(self, h, w_gu, rstd, save, recipe=None):
        y, z_pre = gemm_swiglu(h, w_gu, rstd, save_preact=save, recipe=recipe)
        return y, (), (z_pre,) if save else ()

    def backward(self, dy, saved):
        return swiglu_bwd(dy, saved[0])


@dataclass(frozen=True, eq=False)
class RoPE(Consumer):
    """Packed qkv with RoPE on q and k (adjacent-pair layout); keeps its output, the rotated qkv.

    Frequencies ``theta^(-2i/dh)``, or the dh/2 values ``inv_freq`` of a scaled RoPE when given.
    """

    positions: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    theta: float
    inv_freq: tuple[float, ...] | None = None

    kind: ClassVar[str] = "rope"
    keeps_output: ClassVar[bool] = True

    def forward(self, h, w_qkv, rstd, save, recipe=None):
        qkv = gemm_rope(h, w_qkv, rstd, self.positions, self.heads, self.kv_heads, self.head_dim, self.theta,
                        recipe, self.inv_freq)
        return qkv, (), ()

    def backward(self, dqkv, saved):
        return rope_bwd(dqkv, saved[0], self.positions, self.heads, self.kv_heads, self.head_dim, self.theta,
                        self.inv_freq)

    def op_args(self):
        return (self.positions, self.heads, self.kv_heads, self.head_dim, float(self.theta),
                None if self.inv_freq is None else list(self.inv_freq), IGNORE_INDEX, "mean", None, True)


@dataclass(frozen=True, eq=False)
class CrossEntropy(Consumer):
    """Cross-entropy loss of the logits z (side output: lse). Without grad the logits are never written; with
    grad the forward computes dx, dgamma and dW over chunks of ``chunk_rows`` rows (default:
    :func:`kernels.coda.cross_entropy_bwd.ce_chunk_rows`) and keeps those; dW only with ``weight_grad`` (the
    compositions clear it for a weight that needs no gradient, a frozen LM head: then dW is empty)."""

    target: torch.Tensor
    ignore_index: int = IGNORE_INDEX
    reduction: str = "mean"
    chunk_rows: int | None = None
    weight_grad: bool = True

    kind: ClassVar[str] = "cross_entropy"
    side_outputs: ClassVar[int] = 1
    grad_in_forward: ClassVar[bool] = True

    def forward(self, h, w_lm, rstd, save, recipe=None):
        loss, lse, _, _ = gemm_cross_entropy(h, w_lm, rstd, self.target, self.ignore_index, self.reduction,
                                             recipe=recipe)
        return loss, (lse,), ()

    def forward_grad(self, h, w_lm, x, rstd, gamma):
        loss, lse, *grads = lm_head_ce_grad(h, w_lm, x, rstd, gamma, self.target, self.ignore_index,
                                            self.reduction, self.chunk_rows, self.weight_grad)
        applied = torch.ones(1, device=h.device, dtype=torch.float32)  # the dloss the saved gradients carry
        return loss, (lse,), (*grads, applied)

    def op_args(self):
        return (self.target, 0, 0, 0, 0.0, None, self.ignore_index, self.reduction, self.chunk_rows, self.weight_grad)


class NoConsumer(Consumer):
    """No consumer: the block ends at its residual stream x (a checkpointed layer's input; its output ``out`` and
    ``rstd`` are empty). The block only (:func:`block_forward`)."""

    kind = "none"


CONSUMERS: dict[str, type[Consumer]] = {c.kind: c for c in (Linear, SwiGLU, RoPE, CrossEntropy, NoConsumer)}


class _Recomputing(threading.local):
    active = False
    count = 0


_RECOMPUTING = _Recomputing()


class Recomputation:
    """An activation checkpoint's recomputation (its ``context_fn``'s second context, entered by each recomputation:
    torch's non-reentrant checkpoint, whose recomputed tensors serve one backward and are unpacked once). A block
    without a consumer then skips its down projection, whose output x nothing reads there (the recomputed outputs
    are discarded), and returns x uninitialized; its backward needs only what came before. :func:`recomputations`
    counts the entries."""

    def __enter__(self) -> None:
        self._before, _RECOMPUTING.active = _RECOMPUTING.active, True
        _RECOMPUTING.count += 1

    def __exit__(self, *exc: object) -> None:
        _RECOMPUTING.active = self._before


def recomputations() -> int:
    """How many :class:`Recomputation` contexts this thread has entered: a backward that sees the count change while
    it unpacks its saved tensors got them from a recomputation, its own to overwrite."""
    return _RECOMPUTING.count


def consumer_of(kind: str, rows: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int, theta: float,
                inv_freq: list[float] | None, ignore_index: int, reduction: str, chunk_rows: int | None,
                weight_grad: bool) -> Consumer:
    """The consumer that :data:`CONSUMER_ARGS` describe (the inverse of ``(c.kind, *c.op_args())``)."""
    if kind == RoPE.kind:
        return RoPE(rows, heads, kv_heads, head_dim, theta, None if inv_freq is None else tuple(inv_freq))
    if kind == CrossEntropy.kind:
        return CrossEntropy(rows, ignore_index, reduction, chunk_rows, weight_grad)
    return CONSUMERS[kind]()


# ---- the compositions' forwards and backward pieces (the bodies of the coda:: ops) --------------------
# Each forward returns a flat list: its results, then (with ``save``) what its backward reads that is not an
# input or a result. :mod:`kernels.coda.ops` registers them as custom ops, with their fake-tensor rules and
# autograd, whose backward composes the backward pieces below.

def _consumer_fwd(consumer: Consumer, h: torch.Tensor, w: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                  gamma: torch.Tensor, save: bool) -> tuple[torch.Tensor, Saved, Saved]:
    """The consumer's ``(output, side outputs, saved)``; with ``save``, one that computes its gradients in forward
    does so here and saves them."""
    if save and consumer.grad_in_forward:
        return consumer.forward_grad(h, w, x, rstd, gamma)
    return consumer.forward(h, w, rstd, save)


def producer_consumer_forward(a: torch.Tensor, residual: torch.Tensor, w_p: torch.Tensor, gamma: torch.Tensor,
                              w: torch.Tensor, consumer: Consumer, eps: float, save: bool) -> list[torch.Tensor]:
    """``[x, out, rstd, *side, *consumer's saved]``."""
    x, h, rstd = gemm_residual_norm(a, w_p, residual, gamma, eps)
    out, side, saved = _consumer_fwd(consumer, h, w, x, rstd, gamma, save)
    return [x, out, rstd, *side, *saved]


def block_forward(a: torch.Tensor, residual: torch.Tensor, w_o: torch.Tensor, gamma_mlp: torch.Tensor,
                  w_gu: torch.Tensor, w_down: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor, consumer: Consumer,
                  eps: float, save: bool) -> list[torch.Tensor]:
    """``[x, out, rstd_mlp, rstd, *side]``, then with ``save`` ``[x1, z_pre, *consumer's saved]``."""
    x1, h1, rstd_mlp = gemm_residual_norm(a, w_o, residual, gamma_mlp, eps)
    y, z_pre = gemm_swiglu(h1, w_gu, rstd_mlp, save_preact=save)
    if isinstance(consumer, NoConsumer):  # x = x1 + y Wd^T, unless a recomputation needs only x1 and z_pre
        x = torch.empty_like(x1) if _RECOMPUTING.active else torch.addmm(x1, y, w_down.T)
        out, rstd = (x1.new_empty(0, dtype=torch.float32) for _ in range(2))
        return [x, out, rstd_mlp, rstd, *((x1, z_pre) if save else ())]
    x, h2, rstd = gemm_residual_norm(y, w_down, x1, gamma, eps)
    out, side, saved = _consumer_fwd(consumer, h2, w, x, rstd, gamma, save)
    return [x, out, rstd_mlp, rstd, *side, *((x1, z_pre, *saved) if save else ())]


def norm_consumer_forward(x: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor, consumer: Consumer, eps: float,
                          save: bool) -> list[torch.Tensor]:
    """``[out, rstd, *side, *consumer's saved]``."""
    h, rstd = norm_input(x, gamma, eps)
    out, side, saved = _consumer_fwd(consumer, h, w, x, rstd, gamma, save)
    return [out, rstd, *side, *saved]


def consumer_backward(consumer: Consumer, grad: torch.Tensor, saved: Saved, w: torch.Tensor, x: torch.Tensor,
                      rstd: torch.Tensor, gamma: torch.Tensor, dres: torch.Tensor | None, w_grad: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dx, dgamma, dW)`` through a consumer that computes dz in backward, the RMSNorm backward (dx includes
    dres, the incoming residual gradient) and the consumer's weight gradient (None without ``w_grad``)."""
    dz, zdz = consumer.backward(grad.contiguous(), saved)
    dx, y, dgamma = dgrad_rmsnorm(dz, w, x, rstd, gamma, zdz, dres)
    return dx, dgamma, mm(dz.T, y) if w_grad else None


def producer_backward(dx: torch.Tensor, a: torch.Tensor, w_p: torch.Tensor, w_grad: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(da, dWp)`` of ``x = residual + a Wp^T`` (the residual's gradient is dx itself; dWp None without
    ``w_grad``)."""
    return mm(dx, w_p), mm(dx.T, a) if w_grad else None


def mlp_backward(dx: torch.Tensor, w_down: torch.Tensor, z_pre: torch.Tensor, w_gu: torch.Tensor,
                 x1: torch.Tensor, rstd_mlp: torch.Tensor, gamma_mlp: torch.Tensor, inplace: bool,
                 overwrite: bool = False, w_grads: tuple[bool, bool] = (True, True)
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``(dx1, dW_down, dgamma_mlp, dW_gu)`` of the block's MLP half from dx, the gradient of its output x: the
    down-proj dgrad with the SwiGLU backward (dz_pre over z_pre when ``overwrite``), the gate/up dgrad with the
    RMSNorm backward adding dx (into dx itself when ``inplace``: dx1 is then dx), and the two weight gradients (each
    None where ``w_grads``, for W_down and W_gu, says it is not needed)."""
    dz_pre, y, zdz = dgrad_swiglu(dx, w_down, z_pre, overwrite=overwrite)
    dw_down = mm(dx.T, y) if w_grads[0] else None
    dx1, y1, dgamma_mlp = dgrad_rmsnorm(dz_pre, w_gu, x1, rstd_mlp, gamma_mlp, zdz, dx, inplace=inplace)
    return dx1, dw_down, dgamma_mlp, mm(dz_pre.T, y1) if w_grads[1] else None


# ---- public API --------------------------------------------------------------------------------------
# Each composition is the coda:: op of the same name (kernels.coda.ops): differentiable, opaque to torch.compile;
# run by ops.call (eagerly without the dispatcher).

def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _for_weight(consumer: Consumer, w: torch.Tensor) -> Consumer:
    """The consumer, a gradient-in-forward one told whether its weight needs a gradient (a frozen weight's is not
    computed)."""
    if consumer.grad_in_forward and not (torch.is_grad_enabled() and w.requires_grad):
        return replace(consumer, weight_grad=False)
    return consumer


def _results(out: list[torch.Tensor], n: int, consumer: Consumer) -> tuple[torch.Tensor, ...]:
    """The op's results (its first ``n`` + the consumer's side outputs), without what it saved for backward."""
    return tuple(out[:n + consumer.side_outputs])


def producer_consumer(a: torch.Tensor, residual: torch.Tensor, w_p: torch.Tensor, gamma: torch.Tensor,
                      w: torch.Tensor, consumer: Consumer, eps: float) -> tuple[torch.Tensor, ...]:
    """``(x, out, rstd, *side)``: x = residual + a w_p^T, out = consumer(rmsnorm(x; gamma) w^T)."""
    save = _needs_grad(a, residual, w_p, gamma, w)
    consumer = _for_weight(consumer, w)
    out = ops.call("producer_consumer", a, residual, w_p, gamma, w, eps, save, consumer.kind, *consumer.op_args())
    return _results(out, 3, consumer)


def block(a: torch.Tensor, residual: torch.Tensor, w_o: torch.Tensor, gamma_mlp: torch.Tensor, w_gu: torch.Tensor,
          w_down: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor, consumer: Consumer, eps: float
          ) -> tuple[torch.Tensor, ...]:
    """``(x, out, rstd_mlp, rstd, *side)`` of the CODA block (w_gu interleaved; out = consumer of rmsnorm(x))."""
    save = _needs_grad(a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w)
    consumer = _for_weight(consumer, w)
    out = ops.call("block", a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w, eps, save, consumer.kind,
                               *consumer.op_args())
    return _results(out, 4, consumer)


def norm_consumer(x: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor, consumer: Consumer, eps: float
                  ) -> tuple[torch.Tensor, ...]:
    """``(out, rstd, *side)``: out = consumer(rmsnorm(x; gamma) w^T)."""
    save = _needs_grad(x, gamma, w)
    consumer = _for_weight(consumer, w)
    out = ops.call("norm_consumer", x, gamma, w, eps, save, consumer.kind, *consumer.op_args())
    return _results(out, 2, consumer)


# ---- fp8 forward -------------------------------------------------------------------------------------
# The forwards of producer_consumer, block and norm_consumer (same arguments and results) on fp8 weights and
# GEMM inputs (:class:`workloads.fp8.Fp8`, quantized under ``recipe``); no autograd. Every GEMM dequantizes in
# its epilogue; an epilogue whose output feeds another GEMM (h, SwiGLU's y) also writes its absmax partials,
# and one pass quantizes it (e4m3, per tensor or per row) for that GEMM.

def producer_consumer_fp8(recipe: Recipe, a: Fp8, residual: torch.Tensor, w_p: Fp8, gamma: torch.Tensor, w: Fp8,
                          consumer: Consumer, eps: float) -> tuple[torch.Tensor, ...]:
    x, h, rstd = gemm_residual_norm(a, w_p, residual, gamma, eps, recipe, h_fp8=recipe)
    out, side, _ = consumer.forward(h, w, rstd, False, recipe)
    return x, out, rstd, *side


def block_fp8(recipe: Recipe, a: Fp8, residual: torch.Tensor, w_o: Fp8, gamma_mlp: torch.Tensor, w_gu: Fp8,
              w_down: Fp8, gamma: torch.Tensor, w: Fp8, consumer: Consumer, eps: float) -> tuple[torch.Tensor, ...]:
    x1, h1, rstd_mlp = gemm_residual_norm(a, w_o, residual, gamma_mlp, eps, recipe, h_fp8=recipe)
    y, _ = gemm_swiglu(h1, w_gu, rstd_mlp, save_preact=False, recipe=recipe, y_fp8=recipe)
    x, h2, rstd = gemm_residual_norm(y, w_down, x1, gamma, eps, recipe, h_fp8=recipe)
    out, side, _ = consumer.forward(h2, w, rstd, False, recipe)
    return x, out, rstd_mlp, rstd, *side


def norm_consumer_fp8(recipe: Recipe, x: torch.Tensor, gamma: torch.Tensor, w: Fp8, consumer: Consumer, eps: float
                      ) -> tuple[torch.Tensor, ...]:
    h, rstd = norm_input(x, gamma, eps, h_fp8=recipe)
    out, side, _ = consumer.forward(h, w, rstd, False, recipe)
    return out, rstd, *side


FP8_FORWARD = {producer_consumer: producer_consumer_fp8, block: block_fp8, norm_consumer: norm_consumer_fp8}
"""Each composition -> its fp8 forward (first argument: the recipe)."""


# The coda:: ops that the public functions above call (kernels.coda.ops builds them from this module's pieces, so
# it is imported last).
from kernels.coda import ops  # noqa: E402
