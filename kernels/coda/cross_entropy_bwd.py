"""Cross-entropy backward through the LM head, with the loss scale as a scalar epilogue multiplier.

The forward (:func:`kernels.coda.cross_entropy.gemm_cross_entropy`, ``with_grad=True``) already wrote
``dlogits = softmax - onehot`` (unscaled, zero rows where ignored) and ``zdz = <logits, dlogits>``. The
gradient of the logits is ``s * dlogits`` with the loss scale ``s = dloss / n_valid`` ("mean") or
``s = dloss`` ("sum"); s is never applied as a pass over [M, V]:

    dx, y, dgamma = dgrad_rmsnorm(dlogits, W_lm, x, rstd, gamma, zdz, dres, dz_scale=s)
    dW_lm = s * (dlogits^T @ y)               (:func:`kernels.coda.gemm.matmul` with ``scale=s``)

:func:`ce_grad_scale` computes s on the device (no host synchronization).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.reduce import check_reduction


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

