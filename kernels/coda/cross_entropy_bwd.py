"""Cross-entropy backward through the LM head, with the loss scale as a scalar epilogue multiplier.

The forward (:func:`kernels.coda.cross_entropy.gemm_cross_entropy`, ``with_grad=True``) already wrote
``dlogits = softmax - onehot`` (unscaled, zero rows where ignored) and ``zdz = <logits, dlogits>``. The
gradient of the logits is ``s * dlogits`` with the loss scale ``s = dloss / n_valid`` ("mean") or
``s = dloss`` ("sum"); s is never applied as a pass over [M, V]:

    dx, y, dgamma = dgrad_rmsnorm(dlogits, W_lm, x, rstd, gamma, zdz, dres, dz_scale=s)
    dW_lm = s * (dlogits^T @ y)               (:func:`scaled_matmul`: the mainloop + a scalar epilogue)

:func:`ce_grad_scale` computes s on the device (no host synchronization).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import scale_scalar, store_tile
from kernels.coda.mainloop import (coda_autotune, mainloop, num_sms, num_tiles, operand, operand_descs,
                                   persistent_grid, tile_coords, tile_desc)


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
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    out = torch.empty(1, device=target.device, dtype=torch.float32)
    ce_grad_scale_kernel[(1,)](dloss.reshape(1), target.contiguous(), out, target.numel(), ignore_index,
                               MEAN=reduction == "mean", BLOCK=1024)
    return out


@coda_autotune()
@triton.jit
def scaled_gemm_kernel(a_ptr, b_ptr, scale_ptr, c_ptr, M, N, K, stride_a, stride_b, stride_c,
                       A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    c_desc = tile_desc(c_ptr, M, N, stride_c, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), NUM_SMS, flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN)
        store_tile(c_desc, off_m, off_n, scale_scalar(acc, scale_ptr))


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale * (a @ b)`` in a's dtype: a (M, K), b (K, N) row-major or transposed views; scale fp32 [1]."""
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"shape mismatch: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    (a_s, a_t), (b_s, b_t) = operand(a), operand(b)
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    scaled_gemm_kernel[persistent_grid(M, N, a.device)](
        a_s, b_s, scale, c, M, N, K, a_s.stride(0), b_s.stride(0), c.stride(0),
        A_KM=a_t, B_KN=not b_t, NUM_SMS=num_sms(a.device))
    return c
