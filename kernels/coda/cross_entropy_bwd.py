"""Cross-entropy through the LM head: the loss and its gradients in one sweep over chunks of rows.

For ``loss = CE(z, target)`` with logits ``z = rstd * (h @ W^T)`` and ``h = x * gamma`` (RMSNorm + LM head),
the gradient of z is ``s * dlogits`` with ``dlogits = softmax(z) - onehot(target)`` (zero rows where ignored)
and the loss scale ``s = dloss / n_valid`` ("mean") or ``s = dloss`` ("sum"); :func:`ce_grad_scale` computes
s on the device (no host synchronization). :func:`lm_head_ce_grad` computes the loss and the gradients for
``dloss = 1`` chunk by chunk (rows ``c`` of ``mc``, :func:`ce_chunk_rows`), so that no [M, V] tensor exists::

    loss_c, lse_c, dlogits_c, zdz_c = gemm_cross_entropy(h_c, W, rstd_c, target_c, "sum", with_grad=True,
                                                         grad_scale=s)     # dlogits_c = s (softmax - onehot)
    dx_c, y_c, dgamma_c = dgrad_rmsnorm(dlogits_c, W, x_c, rstd_c, gamma, zdz_c)
    dW += dlogits_c^T @ y_c                    (:func:`kernels.coda.gemm.mm_acc`: fp32 sums, dW's dtype)

then ``loss = s * sum_c loss_c`` and ``dgamma = sum_c dgamma_c`` (fp32, rounded once at the end). dW is kept in the
weights' dtype: each chunk's product is summed in fp32 and added to it with one rounding, as Liger's fused linear
cross-entropy does: on an H100 the bf16 gradient in 2 and in 8 chunks passes the suite's rule against float64
(tests/test_hf.py), and the fp32 [V, d] accumulator this replaces took 1 GiB at Llama 3's vocabulary (0.5 GiB more
while rounded to dW). Every chunk writes its logits, then dlogits, into the same [mc, V] buffer.
Memory during the sweep: that buffer, dW and dx [M, d]; after it: dx, dgamma, dW.
The compositions' autograd (:mod:`kernels.coda.ops`) keeps those three and multiplies them by dloss in backward,
in place on the device (:func:`rescale_`; nothing moves when dloss is 1; a traced backward scales copies).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.align import aligned, empty_rows
from kernels.coda.cross_entropy import gemm_cross_entropy
from kernels.coda.gemm import mm, mm_acc
from kernels.coda.host import cdiv
from kernels.coda.reduce import check_reduction
from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm

CHUNK_BYTES = 1 << 30
"""The most a chunk's [mc, V] dlogits buffer takes (1 GiB), unless that is under CHUNK_MIN_ROWS rows. On an H100 the
Llama-3.2-1B training step with activation checkpointing (2 x 8192 tokens, V = 128256: 4 chunks) took 115.4 ms at
1956 MiB peak, against 114.3 ms at 2975 MiB with 2 GiB chunks (docs/performance.md)."""
CHUNK_MIN_ROWS = 4096
"""Rows a chunk may always hold, even where their [mc, V] buffer exceeds CHUNK_BYTES. Each chunk's weight-gradient
GEMM reads and writes the whole [V, d] weight gradient (4 V d bytes in bf16) for 2 mc V d FLOPs, and its dgrad GEMM
has (mc / 128) (d / 256) output tiles: both costs grow as mc shrinks, whatever V is. At V = 152064, d = 4096 on an
H200, 3328 rows (5 chunks) took 103.9-104.0 ms against 97.7-100.3 at 4096 (4 chunks, 1.16 GiB; two machines,
docs/performance.md)."""
CHUNK_ALIGN = 256
"""Chunks are a multiple of 256 rows: of every BM of the autotune space, so only the last chunk has a partial tile."""


@triton.jit
def ce_grad_scale_kernel(dloss_ptr, target_ptr, out_ptr, M, ignore_index, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """One program: ``s = dloss / #{m : target_m != ignore_index}`` when MEAN, else ``s = dloss``."""
    s = tl.load(dloss_ptr).to(tl.float32)
    if MEAN:
        count = tl.zeros((BLOCK,), dtype=tl.float32)
        for m0 in range(0, M, BLOCK):
            rows = m0 + tl.arange(0, BLOCK)
            target = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index)
            count += tl.where(target != ignore_index, 1.0, 0.0)
        s = s / tl.sum(count, axis=0)
    tl.store(out_ptr, s)


def ce_grad_scale(dloss: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """fp32 [1]: the loss scale s of the logits gradient ``s * (softmax - onehot)``, computed on the device."""
    check_reduction(reduction)
    out = torch.empty(1, device=target.device, dtype=torch.float32)
    ce_grad_scale_kernel[(1,)](dloss.reshape(1), target.contiguous(), out, target.numel(), ignore_index,
                               MEAN=reduction == "mean", BLOCK=1024)
    return out


RESCALE_BLOCK = 8192
"""Elements per program of :func:`rescale_kernel`."""


@triton.jit
def rescale_kernel(t_ptr, n, cols, stride, grad_ptr, applied_ptr, BLOCK: tl.constexpr):
    """``t *= grad / applied`` over the program's block of the n elements of t, rows of ``cols`` elements ``stride``
    apart (element i at ``(i // cols) stride + i % cols``), read and written only when that factor is not 1 (each
    program loads the two scalars and returns at once otherwise)."""
    f = tl.load(grad_ptr).to(tl.float32) / tl.load(applied_ptr)
    if f != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ptrs = t_ptr + offs // cols * stride + offs % cols
        x = tl.load(ptrs, mask=offs < n)
        tl.store(ptrs, (x.to(tl.float32) * f).to(x.dtype), mask=offs < n)


@triton.jit
def store_scalar_kernel(src_ptr, dst_ptr):
    """``dst[0] = src[0]`` (as fp32): a write autograd does not see (the destination is saved for backward)."""
    tl.store(dst_ptr, tl.load(src_ptr).to(tl.float32))


def rescale_(grad: torch.Tensor, applied: torch.Tensor, *tensors: torch.Tensor) -> None:
    """Gradients computed in the forward for a unit upstream gradient, brought to ``grad`` (a one-element device
    tensor: dloss) in place: each tensor (1-D contiguous, or 2-D row-major with any row stride: the row layout of
    :mod:`kernels.coda.align`) is multiplied by ``grad / applied``, then ``applied := grad`` (fp32 [1], the dloss
    they carry: 1 after the forward). No host synchronization; when the factor is 1 (a training step) the kernels
    only read the two scalars. A second backward (``retain_graph``) rescales by the ratio of the two gradients."""
    g = grad.detach().reshape(1)
    for t in filter(torch.Tensor.numel, tensors):  # an empty one (a gradient not computed) has nothing to scale
        if t.dim() not in (1, 2) or t.stride(-1) != 1:
            raise ValueError("rescale_ takes 1-D contiguous or 2-D row-major tensors")
        cols = t.shape[-1]
        stride = t.stride(0) if t.dim() == 2 else cols
        rescale_kernel[(cdiv(t.numel(), RESCALE_BLOCK),)](t, t.numel(), cols, stride, g, applied,
                                                          BLOCK=RESCALE_BLOCK, num_warps=8)
    store_scalar_kernel[(1,)](g, applied)


def ce_chunk_rows(m: int, v: int, element_size: int) -> int:
    """Rows per chunk of :func:`lm_head_ce_grad`. A chunk holds at most the rows (a multiple of CHUNK_ALIGN) whose
    [rows, v] buffer of ``element_size``-byte elements fits CHUNK_BYTES, or CHUNK_MIN_ROWS where that is more; the m
    rows take the fewest such chunks, spread evenly (rounded up to CHUNK_ALIGN, so only the last chunk has a partial
    tile and none is a small remainder): m itself where one chunk holds them.

    Llama 3 (V = 128256, bf16): 4096 rows (1002 MiB). A chunk's dgrad GEMM, [mc, d] with K = V, then has
    (4096 / 128) x (d / 256) tiles of 128 x 256: 256 for d = 2048, two waves of an H100's 132 SMs; its weight
    gradient GEMM reads and writes the bf16 [V, d] gradient once, 4 bytes per element against 2 mc FLOPs.
    """
    most = max(CHUNK_MIN_ROWS, CHUNK_BYTES // (v * element_size) // CHUNK_ALIGN * CHUNK_ALIGN)
    if m <= most:
        return m
    return cdiv(cdiv(m, cdiv(m, most)), CHUNK_ALIGN) * CHUNK_ALIGN


def lm_head_ce_grad(h: torch.Tensor, w_lm: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor,
                    target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                    chunk_rows: int | None = None, weight_grad: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, lse, dx, dgamma, dW)`` of ``CE(rstd[:, None] * (h @ w_lm.T), target)`` with ``h = x * gamma``
    (see the module docstring): the loss as :func:`kernels.coda.cross_entropy.gemm_cross_entropy` computes it, and
    the gradients of x, gamma and w_lm for ``dloss = 1``, in x's, gamma's and w_lm's dtypes (dx and dW in the row
    layout of :mod:`kernels.coda.align`).

    h, x [M, d]; w_lm [V, d]; rstd fp32 [M]; target [M]. ``chunk_rows``: rows per chunk (default
    :func:`ce_chunk_rows`). Without ``weight_grad`` (a frozen LM head) dW is not computed: an empty tensor.
    """
    M, V = h.shape[0], w_lm.shape[0]
    if x.shape != h.shape:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)} for h {tuple(h.shape)}")
    rows = chunk_rows or ce_chunk_rows(M, V, h.element_size())
    s = ce_grad_scale(torch.ones((), device=h.device, dtype=torch.float32), target, ignore_index, reduction)
    gamma32 = gamma.float()  # dgamma of each chunk in fp32, summed over the chunks before rounding
    buf = empty_rows(min(rows, M), V, h.dtype, h.device)  # any V: a row stride of whole 16 bytes
    dx = empty_rows(*x.shape, x.dtype, x.device).zero_()  # each chunk's dgrad adds its rows in place
    losses, lses, dgammas, dw = [], [], [], None
    for r0 in range(0, M, rows):
        c = slice(r0, min(r0 + rows, M))
        loss, lse, dlogits, zdz = gemm_cross_entropy(h[c], w_lm, rstd[c], target[c], ignore_index, "sum",
                                                     with_grad=True, out=buf[:c.stop - r0], grad_scale=s)
        _, y, dgamma = dgrad_rmsnorm(dlogits, w_lm, x[c], rstd[c], gamma32, zdz, dx[c], inplace=True)
        if weight_grad:
            dw = mm(dlogits.T, y) if dw is None else mm_acc(dlogits.T, y, dw)
        losses.append(loss)
        lses.append(lse)
        dgammas.append(dgamma)
    del buf, dlogits  # the chunk buffer goes before the copies below
    loss = (torch.stack(losses).sum() * s).reshape(())
    dw = aligned(dw.to(w_lm.dtype)) if weight_grad else w_lm.new_empty(0)
    return loss, torch.cat(lses), dx, torch.stack(dgammas).sum(0).to(gamma.dtype), dw
