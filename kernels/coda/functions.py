"""Autograd for the CODA ops, built only from the kernels of this package.

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
pre-activation, the rotated qkv; the linear consumer keeps its output z, and cross-entropy the gradients
dx [M, d], dgamma [d] and dW [V, d] that its forward computed (plus the GEMM inputs a and the weights). h,
y and the pre-RoPE values are recomputed in epilogues. Cross-entropy's forward holds one [mc, V] chunk
buffer and an fp32 [V, d] accumulator while it runs, nothing of size [M, V]. Without grad (or when no input
needs one) nothing is saved and the LM head never writes logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kernels.coda.cross_entropy import gemm_cross_entropy
from kernels.coda.cross_entropy_bwd import lm_head_ce_grad, rescale_
from kernels.coda.gemm import mm
from kernels.coda.mainloop import set_scratch_allocator
from kernels.coda.producer import gemm_residual_norm, norm_input
from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm
from kernels.coda.rope import gemm_rope
from kernels.coda.rope_bwd import rope_bwd
from kernels.coda.scaled_linear import scaled_linear
from kernels.coda.swiglu import gemm_swiglu
from kernels.coda.swiglu_bwd import dgrad_swiglu, swiglu_bwd
from workloads.fp8 import Fp8, Recipe

Saved = tuple[torch.Tensor, ...]


# ---- consumers ------------------------------------------------------------------------------------

class Consumer:
    """The GEMM ``z = rstd * (h @ W^T)`` on ``h = x * gamma`` and the epilogue op applied to z."""

    grad_in_forward: ClassVar[bool] = False
    """Whether the forward computes the gradients (:meth:`forward_grad`, for a scalar output) instead of
    :meth:`backward` computing dz."""

    def forward(self, h: torch.Tensor | Fp8, w: torch.Tensor | Fp8, rstd: torch.Tensor, save: bool,
                promote: bool = False) -> tuple[torch.Tensor, Saved, Saved]:
        """``(output, non-differentiable side outputs, tensors saved for backward)``; fp8 h and w are dequantized
        in the epilogue (``promote``: accumulation mode)."""
        raise NotImplementedError

    def backward(self, grad: torch.Tensor, saved: Saved) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dz, zdz)`` from the output's gradient: the gradient of z and zdz = <z, dz> (None: not known here)."""
        raise NotImplementedError

    def forward_grad(self, h: torch.Tensor, w: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                     gamma: torch.Tensor) -> tuple[torch.Tensor, Saved, Saved]:
        """With :attr:`grad_in_forward`: ``(output, side outputs, (dx, dgamma, dW))``, the gradients of the
        normalized input x, of gamma and of W for a unit gradient of the scalar output."""
        raise NotImplementedError


class Linear(Consumer):
    """``z`` itself (pattern (a), plain row scale); keeps nothing: no ZdZ, which the RMSNorm backward then takes from
    its dgrad output's rows (:func:`kernels.coda.rmsnorm_bwd.rmsnorm_bwd_rows_kernel`, on the split path)."""

    def forward(self, h, w, rstd, save, promote=False):
        return scaled_linear(h, w, rstd, promote), (), ()

    def backward(self, dz, saved):
        return dz, None


class SwiGLU(Consumer):
    """``y_i = silu(z_2i) z_2i+1`` on interleaved gate/up rows of W; keeps the pre-activation z."""

    def forward(self, h, w_gu, rstd, save, promote=False):
        y, z_pre = gemm_swiglu(h, w_gu, rstd, save_preact=save, promote=promote)
        return y, (), (z_pre,) if save else ()

    def backward(self, dy, saved):
        return swiglu_bwd(dy, saved[0])


@dataclass(frozen=True, eq=False)
class RoPE(Consumer):
    """Packed qkv with RoPE on q and k (adjacent-pair layout); keeps the rotated qkv.

    Frequencies ``theta^(-2i/dh)``, or the dh/2 values ``inv_freq`` of a scaled RoPE when given.
    """

    positions: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    theta: float
    inv_freq: tuple[float, ...] | None = None

    def forward(self, h, w_qkv, rstd, save, promote=False):
        qkv = gemm_rope(h, w_qkv, rstd, self.positions, self.heads, self.kv_heads, self.head_dim, self.theta,
                        promote, self.inv_freq)
        return qkv, (), (qkv,) if save else ()

    def backward(self, dqkv, saved):
        return rope_bwd(dqkv, saved[0], self.positions, self.heads, self.kv_heads, self.head_dim, self.theta,
                        self.inv_freq)


@dataclass(frozen=True, eq=False)
class CrossEntropy(Consumer):
    """Cross-entropy loss of the logits z (side output: lse). Without grad the logits are never written; with
    grad the forward computes dx, dgamma and dW over chunks of ``chunk_rows`` rows (default:
    :func:`kernels.coda.cross_entropy_bwd.ce_chunk_rows`) and keeps those."""

    target: torch.Tensor
    ignore_index: int = -100
    reduction: str = "mean"
    chunk_rows: int | None = None

    grad_in_forward: ClassVar[bool] = True

    def forward(self, h, w_lm, rstd, save, promote=False):
        loss, lse, _, _ = gemm_cross_entropy(h, w_lm, rstd, self.target, self.ignore_index, self.reduction,
                                             promote=promote)
        return loss, (lse,), ()

    def forward_grad(self, h, w_lm, x, rstd, gamma):
        loss, lse, *grads = lm_head_ce_grad(h, w_lm, x, rstd, gamma, self.target, self.ignore_index,
                                            self.reduction, self.chunk_rows)
        applied = torch.ones(1, device=h.device, dtype=torch.float32)  # the dloss the saved gradients carry
        return loss, (lse,), (*grads, applied)


# ---- backward pieces -------------------------------------------------------------------------------

def _consumer_fwd(consumer: Consumer, h: torch.Tensor, w: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                  gamma: torch.Tensor, save: bool) -> tuple[torch.Tensor, Saved, Saved]:
    """The consumer's ``(output, side outputs, saved)``; with ``save``, one that computes its gradients in forward
    does so here and saves them."""
    if save and consumer.grad_in_forward:
        return consumer.forward_grad(h, w, x, rstd, gamma)
    return consumer.forward(h, w, rstd, save)


def _consumer_bwd(consumer: Consumer, grad: torch.Tensor | None, saved: Saved, w: torch.Tensor, x: torch.Tensor,
                  rstd: torch.Tensor, gamma: torch.Tensor, dres: torch.Tensor | None):
    """``(dx, dgamma, dW)`` through the consumer, the RMSNorm backward and the consumer's weight gradient.

    dx includes dres (the incoming residual gradient); with no gradient for the output it is dres itself. The
    gradients a consumer computed in forward (for a unit gradient of its scalar output) are multiplied by grad in
    place (:func:`kernels.coda.cross_entropy_bwd.rescale_`: on the device, untouched when grad is 1, as in a
    training step; no host synchronization, unlike Liger's ``grad_output != 1`` test).
    """
    if grad is None:
        return dres, None, None
    if consumer.grad_in_forward:
        dx, dgamma, dw, applied = saved
        rescale_(grad, applied, dx, dgamma, dw)
        return (dx if dres is None else dres + dx), dgamma, dw
    dz, zdz = consumer.backward(grad.contiguous(), saved)
    dx, y, dgamma = dgrad_rmsnorm(dz, w, x, rstd, gamma, zdz, dres)
    return dx, dgamma, mm(dz.T, y)


def _producer_bwd(dx: torch.Tensor | None, a: torch.Tensor, w_p: torch.Tensor):
    """``(da, dWp)`` of ``x = residual + a Wp^T`` (the residual's gradient is dx itself)."""
    if dx is None:
        return None, None
    return mm(dx, w_p), mm(dx.T, a)


def _contig(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.contiguous() if t is not None else None


# ---- autograd Functions ----------------------------------------------------------------------------

class ProducerConsumerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, residual, w_p, gamma, w, consumer: Consumer, eps: float, save: bool):
        x, h, rstd = gemm_residual_norm(a, w_p, residual, gamma, eps)
        out, side, saved = _consumer_fwd(consumer, h, w, x, rstd, gamma, save)
        ctx.consumer = consumer
        if save:
            ctx.save_for_backward(a, w_p, gamma, w, x, rstd, *saved)
        ctx.mark_non_differentiable(rstd, *side)
        ctx.set_materialize_grads(False)
        return x, out, rstd, *side

    @staticmethod
    def backward(ctx, dx_out, dout, *_):
        set_scratch_allocator()  # backward may run in autograd's device thread
        a, w_p, gamma, w, x, rstd, *saved = ctx.saved_tensors
        dx, dgamma, dw = _consumer_bwd(ctx.consumer, dout, saved, w, x, rstd, gamma, _contig(dx_out))
        da, dw_p = _producer_bwd(dx, a, w_p)
        return da, dx, dw_p, dgamma, dw, None, None, None


class BlockFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w, consumer: Consumer, eps: float,
                save: bool):
        x1, h1, rstd_mlp = gemm_residual_norm(a, w_o, residual, gamma_mlp, eps)
        y, z_pre = gemm_swiglu(h1, w_gu, rstd_mlp, save_preact=save)
        x, h2, rstd = gemm_residual_norm(y, w_down, x1, gamma, eps)
        out, side, saved = _consumer_fwd(consumer, h2, w, x, rstd, gamma, save)
        ctx.consumer = consumer
        if save:
            ctx.save_for_backward(a, w_o, gamma_mlp, w_gu, w_down, gamma, w, x1, x, rstd_mlp, rstd, z_pre, *saved)
        ctx.mark_non_differentiable(rstd_mlp, rstd, *side)
        ctx.set_materialize_grads(False)
        return x, out, rstd_mlp, rstd, *side

    @staticmethod
    def backward(ctx, dx_out, dout, *_):
        set_scratch_allocator()
        a, w_o, gamma_mlp, w_gu, w_down, gamma, w, x1, x, rstd_mlp, rstd, z_pre, *saved = ctx.saved_tensors
        dres = _contig(dx_out)
        dx, dgamma, dw = _consumer_bwd(ctx.consumer, dout, saved, w, x, rstd, gamma, dres)
        if dx is None:
            return (None,) * 11
        dz_pre, y, zdz = dgrad_swiglu(dx, w_down, z_pre)
        dw_down = mm(dx.T, y)
        # Add into dx in place when it is this function's own buffer, not dres (the consumer had no gradient)
        # nor a gradient saved by the consumer's forward; otherwise into a copy.
        own = all(dx is not t for t in (dres, *saved))
        dx1, y1, dgamma_mlp = dgrad_rmsnorm(dz_pre, w_gu, x1, rstd_mlp, gamma_mlp, zdz, dx, inplace=own)
        dw_gu = mm(dz_pre.T, y1)
        da, dw_o = _producer_bwd(dx1, a, w_o)
        return da, dx1, dw_o, dgamma_mlp, dw_gu, dw_down, dgamma, dw, None, None, None


class NormConsumerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, w, consumer: Consumer, eps: float, save: bool):
        h, rstd = norm_input(x, gamma, eps)
        out, side, saved = _consumer_fwd(consumer, h, w, x, rstd, gamma, save)
        ctx.consumer = consumer
        if save:
            ctx.save_for_backward(x, gamma, w, rstd, *saved)
        ctx.mark_non_differentiable(rstd, *side)
        ctx.set_materialize_grads(False)
        return out, rstd, *side

    @staticmethod
    def backward(ctx, dout, *_):
        set_scratch_allocator()
        x, gamma, w, rstd, *saved = ctx.saved_tensors
        dx, dgamma, dw = _consumer_bwd(ctx.consumer, dout, saved, w, x, rstd, gamma, None)
        return dx, dgamma, dw, None, None, None


# ---- public API --------------------------------------------------------------------------------------

def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def producer_consumer(a: torch.Tensor, residual: torch.Tensor, w_p: torch.Tensor, gamma: torch.Tensor,
                      w: torch.Tensor, consumer: Consumer, eps: float) -> tuple[torch.Tensor, ...]:
    """``(x, out, rstd, *side)``: x = residual + a w_p^T, out = consumer(rmsnorm(x; gamma) w^T)."""
    save = _needs_grad(a, residual, w_p, gamma, w)
    return ProducerConsumerFn.apply(a, residual, w_p, gamma, w, consumer, eps, save)


def block(a: torch.Tensor, residual: torch.Tensor, w_o: torch.Tensor, gamma_mlp: torch.Tensor, w_gu: torch.Tensor,
          w_down: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor, consumer: Consumer, eps: float
          ) -> tuple[torch.Tensor, ...]:
    """``(x, out, rstd_mlp, rstd, *side)`` of the CODA block (w_gu interleaved; out = consumer of rmsnorm(x))."""
    save = _needs_grad(a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w)
    return BlockFn.apply(a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w, consumer, eps, save)


def norm_consumer(x: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor, consumer: Consumer, eps: float
                  ) -> tuple[torch.Tensor, ...]:
    """``(out, rstd, *side)``: out = consumer(rmsnorm(x; gamma) w^T)."""
    save = _needs_grad(x, gamma, w)
    return NormConsumerFn.apply(x, gamma, w, consumer, eps, save)


# ---- fp8 forward -------------------------------------------------------------------------------------
# The forwards of producer_consumer, block and norm_consumer (same arguments and results) on fp8 weights and
# GEMM inputs (:class:`workloads.fp8.Fp8`, quantized under ``recipe``); no autograd. Every GEMM dequantizes in
# its epilogue; an epilogue whose output feeds another GEMM (h, SwiGLU's y) also writes its absmax partials,
# and one pass quantizes it (e4m3, per tensor or per row) for that GEMM.

def _promote(recipe: Recipe) -> bool:
    return recipe.accum == "promoted"


def producer_consumer_fp8(recipe: Recipe, a: Fp8, residual: torch.Tensor, w_p: Fp8, gamma: torch.Tensor, w: Fp8,
                          consumer: Consumer, eps: float) -> tuple[torch.Tensor, ...]:
    promote = _promote(recipe)
    x, h, rstd = gemm_residual_norm(a, w_p, residual, gamma, eps, promote, h_fp8=recipe)
    out, side, _ = consumer.forward(h, w, rstd, False, promote)
    return x, out, rstd, *side


def block_fp8(recipe: Recipe, a: Fp8, residual: torch.Tensor, w_o: Fp8, gamma_mlp: torch.Tensor, w_gu: Fp8,
              w_down: Fp8, gamma: torch.Tensor, w: Fp8, consumer: Consumer, eps: float) -> tuple[torch.Tensor, ...]:
    promote = _promote(recipe)
    x1, h1, rstd_mlp = gemm_residual_norm(a, w_o, residual, gamma_mlp, eps, promote, h_fp8=recipe)
    y, _ = gemm_swiglu(h1, w_gu, rstd_mlp, save_preact=False, promote=promote, y_fp8=recipe)
    x, h2, rstd = gemm_residual_norm(y, w_down, x1, gamma, eps, promote, h_fp8=recipe)
    out, side, _ = consumer.forward(h2, w, rstd, False, promote)
    return x, out, rstd_mlp, rstd, *side


def norm_consumer_fp8(recipe: Recipe, x: torch.Tensor, gamma: torch.Tensor, w: Fp8, consumer: Consumer, eps: float
                      ) -> tuple[torch.Tensor, ...]:
    h, rstd = norm_input(x, gamma, eps, h_fp8=recipe)
    out, side, _ = consumer.forward(h, w, rstd, False, _promote(recipe))
    return out, rstd, *side


FP8_FORWARD = {producer_consumer: producer_consumer_fp8, block: block_fp8, norm_consumer: norm_consumer_fp8}
"""Each composition -> its fp8 forward (first argument: the recipe)."""
