"""LM-head GEMM + RMSNorm row scale + cross-entropy (coda-spec rewrite (d)).

Epilogue of ``logits = rstd[:, None] * (h @ w_lm^T)`` ([M, V]): per N tile t, the row log-sum-exp
``lse_part[m, t]`` over the tile's columns (< V), and the target logit, gathered by the one tile that holds
the target column; the logits tile is written only when gradients are wanted. A finishing kernel then
computes ``lse_m = log sum_t exp(lse_part[m, t])``, ``loss_m = lse_m - logits[m, target_m]`` (0 for
ignored rows), the reduction, and (with_grad) ``dlogits = s * (softmax - onehot)`` in place over the logits (s: an
optional loss scale, a device scalar) plus ``zdz_m = sum_j logits_mj dlogits_mj`` (see :func:`kernels.coda.reduce.finish_cross_entropy`).
Split path (:mod:`kernels.coda.strategy`): the plain GEMM's output c (so the logits are written, also without grad),
then one row kernel: an online log-sum-exp over the columns (tile LSEs combined) and the target logit, and with grad
a second pass over the row writing dlogits over c.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import (dequant_scale, gather_cols, load_rows, load_tile, row_dot, store_row_partial,
                                   store_tile, tile_lse)
from kernels.coda.gemm import split_matmul
from kernels.coda.launch import FusedGemm
from kernels.coda.mainloop import (INTERPRET, coda_autotune, mainloop, num_tiles, operand_descs, tile_coords,
                                   tile_desc)
from kernels.coda.reduce import check_reduction, finish_cross_entropy, launched_tiles, reduce_loss, row_partials
from kernels.coda.strategy import with_split
from workloads.fp8 import Fp8


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
        store_row_partial(lse_part_ptr, tile_lse(logits, off_n, N, BN), off_m, off_n, M, stride_p, BM, BN)
        rows = off_m + tl.arange(0, BM)
        target = tl.load(target_ptr + rows, mask=rows < M, other=-1)
        tgt_logit, hit = gather_cols(logits, target, off_n, BN)
        tl.store(tgt_logit_ptr + rows, tgt_logit, mask=hit & (rows < M))


@triton.jit
def log_add_exp(a, b):
    """``log(exp(a) + exp(b))``, elementwise (a and b not both -inf): two log-sum-exps combined."""
    m = tl.maximum(a, b)
    return m + tl.log(tl.exp(a - m) + tl.exp(b - m))


@triton.jit
def cross_entropy_rows_kernel(z_ptr, rstd_ptr, target_ptr, lse_ptr, loss_ptr, zdz_ptr, scale_ptr, M, N, stride_z,
                              ignore_index, WITH_GRAD: tl.constexpr, HAS_SCALE: tl.constexpr, BM: tl.constexpr,
                              BN: tl.constexpr):
    """Rows [pid BM, pid BM + BM) of the GEMM output c [M, N], logits ``l = rstd[:, None] * c``: a first pass finds
    ``lse`` (tile log-sum-exps combined online) and the target logit, so ``loss = lse - l[target]`` (0 if ignored);
    WITH_GRAD, a second pass writes ``dlogits = s * (softmax - onehot(target))`` over c (zero rows where ignored;
    ``s = scale[0]`` when HAS_SCALE, else 1) and ``zdz = sum_j l_j dlogits_j``."""
    off_m = tl.program_id(0) * BM
    z_desc = tile_desc(z_ptr, M, N, stride_z, BM, BN)
    rows = off_m + tl.arange(0, BM)
    rstd = load_rows(rstd_ptr, off_m, M, BM)[:, None]
    target = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index)
    valid = target != ignore_index
    lse = tl.full((BM,), float("-inf"), tl.float32)
    tgt_logit = tl.zeros((BM,), dtype=tl.float32)
    for off_n in range(0, N, BN):
        logits = load_tile(z_desc, off_m, off_n) * rstd
        lse = log_add_exp(lse, tile_lse(logits, off_n, N, BN))
        logit, _ = gather_cols(logits, target, off_n, BN)
        tgt_logit += logit
    tl.store(lse_ptr + rows, lse, mask=rows < M)
    tl.store(loss_ptr + rows, tl.where(valid, lse - tgt_logit, 0.0), mask=rows < M)
    if WITH_GRAD:
        s = tl.load(scale_ptr) if HAS_SCALE else 1.0
        zdz = tl.zeros((BM,), dtype=tl.float32)
        for off_n in range(0, N, BN):
            logits = load_tile(z_desc, off_m, off_n) * rstd
            cols = off_n + tl.arange(0, BN)
            grad = s * (tl.exp(logits - lse[:, None]) - tl.where(cols[None, :] == target[:, None], 1.0, 0.0))
            grad = tl.where(valid[:, None] & (cols < N)[None, :], grad, 0.0)
            store_tile(z_desc, off_m, off_n, grad)
            zdz += row_dot(logits, grad)
        tl.store(zdz_ptr + rows, zdz, mask=rows < M)


def gemm_cross_entropy_split(h: torch.Tensor | Fp8, w_lm: torch.Tensor | Fp8, rstd: torch.Tensor,
                             target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                             with_grad: bool = False, promote: bool = False, out: torch.Tensor | None = None,
                             grad_scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`gemm_cross_entropy` split: ``c = h @ w_lm.T`` (:func:`kernels.coda.gemm.split_matmul`, into ``out``
    when given with grad), then the row kernel :func:`cross_entropy_rows_kernel` (dlogits in place over c) and the
    loss's reduction."""
    check_reduction(reduction)
    z = split_matmul(h, w_lm.T, promote, out if with_grad else None)
    M, V = z.shape
    target = target.contiguous()
    lse, loss_rows = (torch.empty(M, device=z.device, dtype=torch.float32) for _ in range(2))
    zdz = torch.empty(M, device=z.device, dtype=torch.float32) if with_grad else None
    bm, bn = (16, 32) if INTERPRET else (16, 256)
    cross_entropy_rows_kernel[(triton.cdiv(M, bm),)](z, rstd, target, lse, loss_rows, zdz if with_grad else lse,
                                                     grad_scale if grad_scale is not None else lse, M, V, z.stride(0),
                                                     ignore_index, WITH_GRAD=with_grad,
                                                     HAS_SCALE=grad_scale is not None, BM=bm, BN=bn)
    loss = reduce_loss(loss_rows, target, ignore_index, reduction)
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
