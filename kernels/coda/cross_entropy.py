"""LM-head GEMM + RMSNorm row scale + cross-entropy (coda-spec rewrite (d)).

Epilogue of ``logits = rstd[:, None] * (h @ w_lm^T)`` ([M, V]): per N tile t, the row log-sum-exp
``lse_part[m, t]`` over the tile's columns (< V), and the target logit, gathered by the one tile that holds
the target column; the logits tile is written only when gradients are wanted. A finishing kernel then
computes ``lse_m = log sum_t exp(lse_part[m, t])``, ``loss_m = lse_m - logits[m, target_m]`` (0 for
ignored rows), the reduction, and (with_grad) ``dlogits = s * (softmax - onehot)`` in place over the logits (s: an
optional loss scale, a device scalar) plus ``zdz_m = sum_j logits_mj dlogits_mj``
(see :func:`kernels.coda.reduce.finish_cross_entropy`).
Split path (:mod:`kernels.coda.strategy`): the plain GEMM's output c (so the logits are written, also without grad),
then one bandwidth-bound pass over c computing the same per-tile partials (:func:`lse_partials_kernel`), and the
same finishing kernel, which scales c by rstd as it reads it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import (dequant_scale, gather_cols, load_block, load_rows, store_row_partial, store_tile,
                                   tile_lse)
from kernels.coda.gemm import split_matmul
from kernels.coda.launch import FusedGemm
from kernels.coda.mainloop import (INTERPRET, coda_autotune, mainloop, num_tiles, operand_descs, tile_coords,
                                   tile_desc)
from kernels.coda.reduce import check_reduction, finish_cross_entropy, launched_tiles, row_partials
from kernels.coda.strategy import with_split
from workloads.fp8 import Fp8


@triton.jit
def ce_partials(logits, target_ptr, lse_part_ptr, tgt_logit_ptr, off_m, off_n, M, N, stride_p, BM: tl.constexpr,
                BN: tl.constexpr):
    """The epilogue's outputs for a (BM, BN) tile of logits at (off_m, off_n): each row's log-sum-exp over the tile's
    columns into ``lse_part[:, off_n // BN]``, and the target logit from the tile that holds the row's target."""
    store_row_partial(lse_part_ptr, tile_lse(logits, off_n, N, BN), off_m, off_n, M, stride_p, BM, BN)
    rows = off_m + tl.arange(0, BM)
    target = tl.load(target_ptr + rows, mask=rows < M, other=-1)
    tgt_logit, hit = gather_cols(logits, target, off_n, BN)
    tl.store(tgt_logit_ptr + rows, tgt_logit, mask=hit & (rows < M))


@coda_autotune(key=("M", "N", "K", "WITH_GRAD"))
@triton.jit
def gemm_cross_entropy_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                              PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                              BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, rstd_ptr, target_ptr,
                              logits_ptr, lse_part_ptr, tgt_logit_ptr, stride_l, stride_p, WITH_GRAD: tl.constexpr):
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    if WITH_GRAD:
        logits_desc = tile_desc(logits_ptr, M, N, stride_l, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN, PROMOTE)
        rstd = load_rows(rstd_ptr, off_m, M, BM)
        logits = dequant_scale(acc, rstd, sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN, SCALING)
        if WITH_GRAD:
            store_tile(logits_desc, off_m, off_n, logits)
        ce_partials(logits, target_ptr, lse_part_ptr, tgt_logit_ptr, off_m, off_n, M, N, stride_p, BM, BN)


@triton.jit
def lse_partials_kernel(z_ptr, rstd_ptr, target_ptr, lse_part_ptr, tgt_logit_ptr, M, N, stride_z, stride_p,
                        BM: tl.constexpr, BN: tl.constexpr):
    """One (BM, BN) block of the GEMM output c [M, N] per program (grid: row blocks x column blocks; pointer
    accesses), logits ``l = rstd[:, None] * c``: the fused kernel's epilogue outputs (:func:`ce_partials`), from c
    read back instead of the mainloop's registers."""
    off_m, off_n = tl.program_id(0) * BM, tl.program_id(1) * BN
    logits = load_block(z_ptr, stride_z, off_m, off_n, M, N, BM, BN) * load_rows(rstd_ptr, off_m, M, BM)[:, None]
    ce_partials(logits, target_ptr, lse_part_ptr, tgt_logit_ptr, off_m, off_n, M, N, stride_p, BM, BN)


ROW_BLOCK = (8, 1024, 4)
"""(BM, BN, num_warps) of :func:`lse_partials_kernel` on the GPU: 1024-column blocks, as the other split paths'
bandwidth-bound kernels (PERF_NOTES.md), 32 partials per row at a 32768-token vocabulary."""


def gemm_cross_entropy_split(h: torch.Tensor | Fp8, w_lm: torch.Tensor | Fp8, rstd: torch.Tensor,
                             target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                             with_grad: bool = False, promote: bool = False, out: torch.Tensor | None = None,
                             grad_scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`gemm_cross_entropy` split: ``c = h @ w_lm.T`` (:func:`kernels.coda.gemm.split_matmul`, into ``out``
    when given with grad), the block partials of :func:`lse_partials_kernel`, then the fused path's finish
    (:func:`kernels.coda.reduce.finish_cross_entropy`, scaling c by rstd as it reads it; dlogits in place over c)."""
    check_reduction(reduction)
    z = split_matmul(h, w_lm.T, promote, out if with_grad else None)
    M, V = z.shape
    target = target.contiguous()
    bm, bn, warps = (16, 32, 4) if INTERPRET else ROW_BLOCK
    lse_part = torch.empty(M, triton.cdiv(V, bn), device=z.device, dtype=torch.float32)
    tgt_logit = torch.zeros(M, device=z.device, dtype=torch.float32)
    lse_partials_kernel[(triton.cdiv(M, bm), triton.cdiv(V, bn))](z, rstd, target, lse_part, tgt_logit, M, V,
                                                                  z.stride(0), lse_part.stride(0), BM=bm, BN=bn,
                                                                  num_warps=warps)
    loss, lse, zdz = finish_cross_entropy(lse_part, lse_part.shape[1], tgt_logit, target, ignore_index, reduction,
                                          z if with_grad else None, grad_scale, rstd)
    return (loss, lse, z, zdz) if with_grad else (loss, lse, None, None)


@with_split(gemm_cross_entropy_split)
def gemm_cross_entropy(h: torch.Tensor | Fp8, w_lm: torch.Tensor | Fp8, rstd: torch.Tensor, target: torch.Tensor,
                       ignore_index: int = -100, reduction: str = "mean", with_grad: bool = False,
                       promote: bool = False, out: torch.Tensor | None = None,
                       grad_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(loss, lse, dlogits, zdz)`` of ``CE(rstd[:, None] * (h @ w_lm.T), target)``.

    loss: fp32 scalar ("mean" over non-ignored rows, or "sum"); lse: fp32 [M]. With ``with_grad``:
    dlogits [M, V] in h's dtype, ``s * (softmax - onehot)`` (zero rows where ignored; s: ``grad_scale``, an fp32
    one-element device tensor such as the loss scale of :func:`kernels.coda.cross_entropy_bwd.ce_grad_scale`, or
    1), written into ``out`` when given (a contiguous [M, V] buffer in h's dtype, which a caller going over chunks
    of rows reuses), and zdz fp32 [M] = ``sum_j logits_mj dlogits_mj``; otherwise the logits are never written and
    both are None.
    """
    gemm = FusedGemm(h, w_lm.T, promote)
    M, V = gemm.M, gemm.N
    target = target.contiguous()
    kernel = gemm_cross_entropy_kernel
    lse_part = row_partials(kernel, M, V, gemm.device)
    tgt_logit = torch.zeros(M, device=gemm.device, dtype=torch.float32)
    if out is not None and (out.shape != (M, V) or out.dtype != gemm.out_dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {(M, V)} {gemm.out_dtype} tensor, got {tuple(out.shape)}, "
                         f"{out.dtype}")
    logits = (gemm.empty() if out is None else out) if with_grad else None
    gemm.launch(kernel, rstd_ptr=rstd, target_ptr=target, logits_ptr=logits if with_grad else tgt_logit,
                lse_part_ptr=lse_part, tgt_logit_ptr=tgt_logit, stride_l=logits.stride(0) if with_grad else 0,
                stride_p=lse_part.stride(0), WITH_GRAD=with_grad)
    loss, lse, zdz = finish_cross_entropy(lse_part, launched_tiles(kernel, M, V)[1], tgt_logit, target,
                                          ignore_index, reduction, logits, grad_scale)
    return loss, lse, logits, zdz
