"""LM-head GEMM + RMSNorm row scale + cross-entropy (coda-spec rewrite (d)).

Epilogue of ``logits = rstd[:, None] * (h @ w_lm^T)`` ([M, V]): per N tile t, the row log-sum-exp
``lse_part[m, t]`` over the tile's columns (< V), and the target logit, gathered by the one tile that holds
the target column; the logits tile is written only when gradients are wanted. A finishing kernel then
computes ``lse_m = log sum_t exp(lse_part[m, t])``, ``loss_m = lse_m - logits[m, target_m]`` (0 for
ignored rows), the reduction, and (with_grad) ``dlogits = softmax - onehot`` in place over the logits plus
``zdz_m = sum_j logits_mj dlogits_mj`` (see :func:`kernels.coda.reduce.finish_cross_entropy`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import dequant_scale, gather_cols, load_rows, store_row_partial, store_tile, tile_lse
from kernels.coda.fp8 import dequant_args, result_dtype
from kernels.coda.mainloop import (coda_autotune, mainloop, num_tiles, operand, operand_descs,
                                   persistent_grid, tile_coords, tile_desc)
from kernels.coda.reduce import finish_cross_entropy, launched_tiles, row_partials
from workloads.fp8 import Fp8


@coda_autotune(key=("M", "N", "K", "WITH_GRAD"))
@triton.jit
def gemm_cross_entropy_kernel(h_ptr, w_ptr, sa_ptr, sb_ptr, rstd_ptr, target_ptr, logits_ptr, lse_part_ptr,
                              tgt_logit_ptr, M, N, K, stride_h, stride_w, stride_l, stride_p, WITH_GRAD: tl.constexpr,
                              SCALING: tl.constexpr, PROMOTE: tl.constexpr,
                              A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                              BK: tl.constexpr, GROUP_M: tl.constexpr):
    a_desc, b_desc = operand_descs(h_ptr, w_ptr, M, N, K, stride_h, stride_w, BM, BN, BK, A_KM, B_KN)
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


def gemm_cross_entropy(h: torch.Tensor | Fp8, w_lm: torch.Tensor | Fp8, rstd: torch.Tensor, target: torch.Tensor,
                       ignore_index: int = -100, reduction: str = "mean", with_grad: bool = False,
                       promote: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(loss, lse, dlogits, zdz)`` of ``CE(rstd[:, None] * (h @ w_lm.T), target)``.

    loss: fp32 scalar ("mean" over non-ignored rows, or "sum"); lse: fp32 [M]. With ``with_grad``:
    dlogits [M, V] in h's dtype, ``softmax - onehot`` (zero rows where ignored, not yet multiplied by the
    loss scale), and zdz fp32 [M] = ``sum_j logits_mj dlogits_mj``; otherwise the logits are never written
    and both are None.
    """
    h, w_lm, sa, sb, scaling = dequant_args(h, w_lm)
    M, K = h.shape
    V = w_lm.shape[0]
    (a_s, a_t), (w_s, w_t) = operand(h), operand(w_lm.T)
    target = target.contiguous()
    kernel = gemm_cross_entropy_kernel
    lse_part = row_partials(kernel, M, V, h.device)
    tgt_logit = torch.zeros(M, device=h.device, dtype=torch.float32)
    logits = torch.empty(M, V, device=h.device, dtype=result_dtype(h)) if with_grad else None
    kernel[persistent_grid(M, V, h.device)](
        a_s, w_s, sa, sb, rstd, target, logits if with_grad else tgt_logit, lse_part, tgt_logit, M, V, K,
        a_s.stride(0), w_s.stride(0), logits.stride(0) if with_grad else 0, lse_part.stride(0),
        WITH_GRAD=with_grad, SCALING=scaling, PROMOTE=promote, A_KM=a_t, B_KN=not w_t)
    loss, lse, zdz = finish_cross_entropy(lse_part, launched_tiles(kernel, M, V)[1], tgt_logit, target,
                                          ignore_index, reduction, logits)
    return loss, lse, logits, zdz
