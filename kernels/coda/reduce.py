"""Finishing kernels: turn the per-tile partials written by epilogues into row or column statistics.

Partials are fp32. Row partials are ``part[M, T]`` (one column per N tile of the GEMM that wrote them)
and column partials ``part[Tm, N]`` (one row per M tile). The buffers are allocated for the smallest
tile of the kernel's autotune space (:func:`row_partials`, :func:`col_partials`); the tile the launch
actually used (:func:`launched_tiles`) says how many columns/rows hold data. Every sum runs in a fixed
order, so results are deterministic (no atomics).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.coda.host import cdiv, next_power_of_2


# ---- host helpers: partial buffers --------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def smallest_tile(kernel, axis: str) -> int:
    """The smallest ``axis`` (``"BM"`` or ``"BN"``) over an autotuned kernel's configs (fixed once it is decorated;
    asked at every call of its host function: cached)."""
    return min(c.kwargs[axis] for c in kernel.configs)


def row_partials(kernel, M: int, N: int, device: torch.device) -> torch.Tensor:
    """fp32 ``[M, T_max]`` for the row partials of an autotuned ``kernel`` over N columns."""
    return torch.empty(M, cdiv(N, smallest_tile(kernel, "BN")), device=device, dtype=torch.float32)


def col_partials(kernel, M: int, N: int, device: torch.device) -> torch.Tensor:
    """fp32 ``[Tm_max, N]`` for the column partials of an autotuned ``kernel`` over M rows."""
    return torch.empty(cdiv(M, smallest_tile(kernel, "BM")), N, device=device, dtype=torch.float32)


def launched_tiles(kernel, M: int, N: int) -> tuple[int, int]:
    """(number of M tiles, number of N tiles) of the config the last launch of ``kernel`` used."""
    cfg = kernel.best_config.kwargs
    return cdiv(M, cfg["BM"]), cdiv(N, cfg["BN"])


# ---- RMSNorm: rstd from sums of squares -----------------------------------------------------------

@triton.jit
def rstd_kernel(part_ptr, rstd_ptr, M, T, stride_p, d, eps, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    """``rstd_m = (sum_t part[m, t] / d + eps)^(-1/2)``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_T)
    p = tl.load(part_ptr + rows[:, None].to(tl.int64) * stride_p + cols[None, :],
                mask=(rows < M)[:, None] & (cols < T)[None, :], other=0.0)
    tl.store(rstd_ptr + rows, tl.rsqrt(tl.sum(p, axis=1) / d + eps), mask=rows < M)


def finish_rstd(part: torch.Tensor, n_tiles: int, d: int, eps: float) -> torch.Tensor:
    """fp32 rstd [M] from the sum-of-squares row partials ``part[:, :n_tiles]`` of a width-d row."""
    M = part.shape[0]
    rstd = torch.empty(M, device=part.device, dtype=torch.float32)
    block_t = next_power_of_2(n_tiles)
    block_m = max(1, min(64, 4096 // block_t))
    rstd_kernel[(cdiv(M, block_m),)](part, rstd, M, n_tiles, part.stride(0), d, eps,
                                     BLOCK_M=block_m, BLOCK_T=block_t)
    return rstd


# ---- row and column sums of partials ---------------------------------------------------------------

@triton.jit
def row_sum_kernel(part_ptr, out_ptr, M, T, stride_p, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    """``out_m = sum_t part[m, t]`` (e.g. ZdZ)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_T)
    p = tl.load(part_ptr + rows[:, None].to(tl.int64) * stride_p + cols[None, :],
                mask=(rows < M)[:, None] & (cols < T)[None, :], other=0.0)
    tl.store(out_ptr + rows, tl.sum(p, axis=1), mask=rows < M)


def finish_row_sum(part: torch.Tensor, n_tiles: int) -> torch.Tensor:
    """fp32 [M]: the sum of the row partials ``part[:, :n_tiles]``."""
    M = part.shape[0]
    out = torch.empty(M, device=part.device, dtype=torch.float32)
    block_t = next_power_of_2(n_tiles)
    block_m = max(1, min(64, 4096 // block_t))
    row_sum_kernel[(cdiv(M, block_m),)](part, out, M, n_tiles, part.stride(0),
                                        BLOCK_M=block_m, BLOCK_T=block_t)
    return out


@triton.jit
def col_sum_kernel(part_ptr, out_ptr, N, T, stride_p, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """``out_n = sum_t part[t, n]`` (e.g. dgamma), summed in blocks of BLOCK_T rows in a fixed order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        p = tl.load(part_ptr + t[:, None].to(tl.int64) * stride_p + cols[None, :],
                    mask=(t < T)[:, None] & (cols < N)[None, :], other=0.0)
        acc += tl.sum(p, axis=0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


def finish_col_sum(part: torch.Tensor, n_tiles: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N] in ``dtype``: the sum of the column partials ``part[:n_tiles, :]``."""
    N = part.shape[1]
    out = torch.empty(N, device=part.device, dtype=dtype)
    col_sum_kernel[(cdiv(N, 128),)](part, out, N, n_tiles, part.stride(0), BLOCK_N=128, BLOCK_T=32)
    return out


# ---- cross-entropy: LSE, loss, dlogits, ZdZ --------------------------------------------------------

@triton.jit
def ce_row_grad(row, V, lse, target, valid, r, s, BLOCK_V: tl.constexpr):
    """Overwrite one row of V values c with ``dlogits = s * (softmax(l) - onehot(target))`` of the logits
    ``l = r * c`` (zeros unless ``valid``), given the row's ``lse``; returns ``zdz = sum_j l_j dlogits_j``."""
    zdz = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        logit = tl.load(row + cols, mask=cols < V, other=0.0).to(tl.float32) * r
        grad = s * (tl.exp(logit - lse) - tl.where(cols == target, 1.0, 0.0))
        grad = tl.where(valid & (cols < V), grad, 0.0)
        tl.store(row + cols, grad.to(row.dtype.element_ty), mask=cols < V)
        zdz += logit * grad
    return tl.sum(zdz, axis=0)


@triton.jit
def ce_rows_kernel(lse_part_ptr, stride_p, T, tgt_logit_ptr, target_ptr, lse_ptr, loss_ptr,
                   logits_ptr, stride_l, V, zdz_ptr, scale_ptr, ignore_index, WITH_GRAD: tl.constexpr,
                   HAS_SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """Row m: ``lse = log sum_t exp(lse_part[m, t])``; ``loss = lse - logit[target]`` (0 if ignored).

    WITH_GRAD: overwrite the logits row with ``dlogits = s * (softmax - onehot(target))`` (zero for an ignored row;
    ``s = scale[0]`` when HAS_SCALE, else 1) and write ``zdz = sum_j logits_j dlogits_j`` (:func:`ce_row_grad`).
    """
    m = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    part = tl.load(lse_part_ptr + m * stride_p + t, mask=t < T, other=float("-inf"))
    p_max = tl.max(part, axis=0)
    lse = p_max + tl.log(tl.sum(tl.exp(part - p_max), axis=0))
    target = tl.load(target_ptr + m)
    valid = target != ignore_index
    tl.store(lse_ptr + m, lse)
    tl.store(loss_ptr + m, tl.where(valid, lse - tl.load(tgt_logit_ptr + m), 0.0))
    if WITH_GRAD:
        s = tl.load(scale_ptr) if HAS_SCALE else 1.0
        tl.store(zdz_ptr + m, ce_row_grad(logits_ptr + m * stride_l, V, lse, target, valid, 1.0, s, BLOCK_V))


@triton.jit
def ce_loss_kernel(loss_rows_ptr, target_ptr, out_ptr, M, ignore_index, MEAN: tl.constexpr,
                   BLOCK: tl.constexpr):
    """One program: ``sum_m loss_m``, divided by the number of non-ignored rows when MEAN."""
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    count = tl.zeros((BLOCK,), dtype=tl.float32)
    for m0 in range(0, M, BLOCK):
        rows = m0 + tl.arange(0, BLOCK)
        total += tl.load(loss_rows_ptr + rows, mask=rows < M, other=0.0)
        target = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index)
        count += tl.where(target != ignore_index, 1.0, 0.0)
    loss = tl.sum(total, axis=0)
    if MEAN:
        loss = loss / tl.sum(count, axis=0)
    tl.store(out_ptr, loss)


def finish_cross_entropy(lse_part: torch.Tensor, n_tiles: int, tgt_logit: torch.Tensor, target: torch.Tensor,
                         ignore_index: int, reduction: str, logits: torch.Tensor | None = None,
                         grad_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss fp32 scalar, lse fp32 [M], zdz fp32 [M] or None) from the LM-head epilogue's outputs.

    ``lse_part[:, :n_tiles]`` are per-N-tile log-sum-exps, ``tgt_logit[m]`` the logit of the target
    (written by the tile that holds it). Given ``logits`` [M, V], it is overwritten in place with
    ``dlogits = s * (softmax - onehot)`` (zero rows where ignored; ``s``: the fp32 one-element ``grad_scale``, or
    1) and the returned ``zdz_m = sum_j logits_mj dlogits_mj``. ``reduction``: "mean" over non-ignored rows
    or "sum" (of the loss; s is the caller's).
    """
    check_reduction(reduction)
    M = lse_part.shape[0]
    dev = lse_part.device
    lse = torch.empty(M, device=dev, dtype=torch.float32)
    loss_rows = torch.empty(M, device=dev, dtype=torch.float32)
    zdz = torch.empty(M, device=dev, dtype=torch.float32) if logits is not None else None
    with_grad = logits is not None
    ce_rows_kernel[(M,)](lse_part, lse_part.stride(0), n_tiles, tgt_logit, target, lse, loss_rows,
                         logits if with_grad else lse, logits.stride(0) if with_grad else 0,
                         logits.shape[1] if with_grad else 0, zdz if with_grad else lse,
                         grad_scale if grad_scale is not None else lse, ignore_index, WITH_GRAD=with_grad,
                         HAS_SCALE=grad_scale is not None, BLOCK_T=next_power_of_2(n_tiles), BLOCK_V=1024)
    return reduce_loss(loss_rows, target, ignore_index, reduction), lse, zdz


def check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def reduce_loss(loss_rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """fp32 scalar: the sum of the per-row losses, divided by the number of non-ignored rows for "mean"."""
    loss = torch.empty((), device=loss_rows.device, dtype=torch.float32)
    ce_loss_kernel[(1,)](loss_rows, target, loss, loss_rows.shape[0], ignore_index, MEAN=reduction == "mean",
                         BLOCK=1024)
    return loss
