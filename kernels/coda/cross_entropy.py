"""LM-head GEMM + RMSNorm row scale + cross-entropy (coda-spec rewrite (d)).

Epilogue of ``logits = rstd[:, None] * (h @ w_lm^T)`` ([M, V]): per N tile t, the row log-sum-exp
``lse_part[m, t]`` over the tile's columns (< V), and the target logit, gathered by the one tile that holds
the target column; the logits tile is written only when gradients are wanted. A finishing kernel then
computes ``lse_m = log sum_t exp(lse_part[m, t])``, ``loss_m = lse_m - logits[m, target_m]`` (0 for
ignored rows), the reduction, and (with_grad) ``dlogits = s * (softmax - onehot)`` in place over the logits (s: an
optional loss scale, a device scalar) plus ``zdz_m = sum_j logits_mj dlogits_mj``
(see :func:`kernels.coda.reduce.finish_cross_entropy`). Declared as its epilogue (:mod:`kernels.coda.program`): the
tiles' log-sum-exps are its row partials (the kernel does not sub-tile: one per tile), and the target logits a
declared vector its finish reads.
Split path (:mod:`kernels.coda.strategy`): the plain GEMM's output c (so the logits are written, also without grad),
then one bandwidth-bound kernel over its rows (:func:`ce_split_rows_kernel`): an online log-sum-exp, the loss and,
with grad, dlogits written over c by the finishing kernel's own row loop.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels.coda.align import is_aligned
from kernels.coda.epilogue import arange, gather_cols, tile_lse
from kernels.coda.fp8 import result_dtype
from kernels.coda.gemm import split_matmul
from kernels.coda.mainloop import INTERPRET
from kernels.coda.program import Binding, Gemm, Output, Partials, coda
from kernels.coda.reduce import ce_row_grad, check_reduction, finish_cross_entropy, reduce_loss
from workloads.fp8 import Fp8, Recipe


@triton.jit
def cross_entropy(logits, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """The fused kernel's epilogue on the tile of logits (already times rstd): the target logit of each row whose
    target column the tile holds, stored into the vector ``tgt_logit`` (``args``: the target and tgt_logit
    pointers); returns the logits and the tile's per-row log-sum-exp."""
    target_ptr, tgt_logit_ptr = args
    lse = tile_lse(logits, off_n, N, BN)
    rows = off_m + arange(0, BM)
    target = tl.load(target_ptr + rows, mask=rows < M, other=-1)
    tgt_logit, hit = gather_cols(logits, target, off_n, BN)
    tl.store(tgt_logit_ptr + rows, tgt_logit, mask=hit & (rows < M))
    return logits, lse


@triton.jit
def ce_split_rows_kernel(c_ptr, stride_c, V, rstd_ptr, target_ptr, lse_ptr, loss_ptr, zdz_ptr, scale_ptr, ignore_index,
                         WITH_GRAD: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_V: tl.constexpr):
    """The split path's one pass over row m of the GEMM output c [M, V] (one program per row), logits
    ``l = rstd[m] * c[m]``: an online log-sum-exp over BLOCK_V-column blocks (a running max and a rescaled running
    sum), ``lse``, ``loss = lse - l[target]`` (0 if ignored); WITH_GRAD: the row overwritten with ``dlogits`` and
    ``zdz`` (:func:`kernels.coda.reduce.ce_row_grad`, a second read of the row)."""
    m = tl.program_id(0).to(tl.int64)
    row = c_ptr + m * stride_c
    r = tl.load(rstd_ptr + m)
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.full((), 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        logit = tl.load(row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * r
        new_max = tl.maximum(run_max, tl.max(logit, axis=0))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(logit - new_max), axis=0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    target = tl.load(target_ptr + m)
    valid = target != ignore_index
    # A target outside [0, V) reads nothing (its logit counts as 0), as the fused kernel's gather finds no tile.
    tgt_logit = tl.load(row + target, mask=valid & (target >= 0) & (target < V), other=0.0).to(tl.float32) * r
    tl.store(lse_ptr + m, lse)
    tl.store(loss_ptr + m, tl.where(valid, lse - tgt_logit, 0.0))
    if WITH_GRAD:
        s = tl.load(scale_ptr) if HAS_SCALE else 1.0
        tl.store(zdz_ptr + m, ce_row_grad(row, V, lse, target, valid, r, s, BLOCK_V))


ROWS_CONFIG = (2048, 4)
"""(BLOCK_V, num_warps) of :func:`ce_split_rows_kernel` on the GPU. Swept on an H200 (4096 x 128256 and 16384 x 32768,
bf16; BLOCK_V 2048-8192, 4-16 warps, 2 to 64 programs per SM looping over rows, 1-3 pipeline stages): with grad
0.96 ms (3 GB moved, ~3.2 TB/s), without 0.29-0.31 ms (~3.5 TB/s). Fewer programs, which would find a row in L2 on
its second read, were slower (too few bytes in flight: 1.0-3.5 ms), and pipelining did not help."""


def gemm_cross_entropy_split(h: torch.Tensor | Fp8, w_lm: torch.Tensor | Fp8, rstd: torch.Tensor,
                             target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                             with_grad: bool = False, recipe: Recipe | None = None, out: torch.Tensor | None = None,
                             grad_scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`gemm_cross_entropy` split: ``c = h @ w_lm.T`` (:func:`kernels.coda.gemm.split_matmul`, into ``out``
    when given with grad), then one pass of :func:`ce_split_rows_kernel` over c (lse, per-row losses; with grad
    dlogits in place over c and zdz), and the loss's reduction."""
    check_reduction(reduction)
    z = split_matmul(h, w_lm.T, recipe, out if with_grad else None)
    M, V = z.shape
    target = target.contiguous()
    block_v, warps = (32, 4) if INTERPRET else ROWS_CONFIG
    lse = torch.empty(M, device=z.device, dtype=torch.float32)
    loss_rows = torch.empty_like(lse)
    zdz = torch.empty_like(lse) if with_grad else None
    ce_split_rows_kernel[(M,)](z, z.stride(0), V, rstd, target, lse, loss_rows, zdz if with_grad else lse,
                               grad_scale if grad_scale is not None else lse, ignore_index, WITH_GRAD=with_grad,
                               HAS_SCALE=grad_scale is not None, BLOCK_V=block_v, num_warps=warps)
    loss = reduce_loss(loss_rows, target, ignore_index, reduction)
    return (loss, lse, z, zdz) if with_grad else (loss, lse, None, None)


def _finish(arguments: dict, gemm: Gemm, outputs: list, partials: Partials) -> tuple:
    [logits], [target] = outputs, gemm.inputs
    loss, lse, zdz = finish_cross_entropy(partials.ss, partials.n_tiles, partials.vectors["tgt_logit"], target,
                                          arguments["ignore_index"], arguments["reduction"], logits,
                                          arguments["grad_scale"])
    return loss, lse, logits, zdz


@coda(cross_entropy, outputs=(Output("logits", when="with_grad"),), inputs=("target_ptr",), vectors=("tgt_logit",),
      row_scale="rstd", row_sum=True, finish=_finish, split=gemm_cross_entropy_split,
      binds=(Binding(("gemm_ce",), ("loss", "lse"), "gemm_cross_entropy: GEMM + row scale + LSE partials; CE finish"),
             Binding(("gemm_ce_grad",), ("loss", "lse", "dlogits", "zdz"),
                     "gemm_cross_entropy: GEMM + row scale + logits + LSE partials; CE finish writing dlogits in "
                     "place and ZdZ", lambda n: {"with_grad": True})))
def gemm_cross_entropy(h: torch.Tensor | Fp8, w_lm: torch.Tensor | Fp8, rstd: torch.Tensor, target: torch.Tensor,
                       ignore_index: int = -100, reduction: str = "mean", with_grad: bool = False,
                       recipe: Recipe | None = None, out: torch.Tensor | None = None,
                       grad_scale: torch.Tensor | None = None) -> Gemm:
    """``(loss, lse, dlogits, zdz)`` of ``CE(rstd[:, None] * (h @ w_lm.T), target)``.

    loss: fp32 scalar ("mean" over non-ignored rows, or "sum"); lse: fp32 [M]. With ``with_grad``:
    dlogits [M, V] in h's dtype, ``s * (softmax - onehot)`` (zero rows where ignored; s: ``grad_scale``, an fp32
    one-element device tensor such as the loss scale of :func:`kernels.coda.cross_entropy_bwd.ce_grad_scale`, or
    1), written into ``out`` when given (a row-major [M, V] buffer in h's dtype, its base and row stride multiples of
    16 bytes as :func:`kernels.coda.align.empty_rows` makes them, which a caller going over chunks of rows reuses),
    and zdz fp32 [M] = ``sum_j logits_mj dlogits_mj``; otherwise the logits are never written and both are None.
    """
    gemm = Gemm(h, w_lm.T, recipe, row_scale=rstd)
    (M, V), dtype = gemm.shape, result_dtype(h.data if isinstance(h, Fp8) else h)
    if out is not None and (out.shape != (M, V) or out.dtype != dtype or not is_aligned(out)):
        raise ValueError(f"out must be a row-major {(M, V)} {dtype} tensor with 16-byte aligned rows "
                         f"(kernels.coda.align.empty_rows), got {tuple(out.shape)}, {out.dtype}")
    return replace(gemm, inputs=(target.contiguous(),), outputs={} if out is None else {"logits": out})
