"""Plain GEMM through the shared mainloop: ``C = s * (A @ B)`` (the speed-of-light kernel).

The optional fp32 scalar ``s`` (a device tensor: a loss scale, an fp8 dequantization scale) is one
epilogue multiply; without it the kernel is the bare GEMM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import scale_scalar, store_tile
from kernels.coda.mainloop import (coda_autotune, mainloop, num_sms, num_tiles, operand, operand_descs,
                                   persistent_grid, tile_coords, tile_desc)


@coda_autotune()
@triton.jit
def gemm_kernel(a_ptr, b_ptr, scale_ptr, c_ptr, M, N, K, stride_a, stride_b, stride_c,
                HAS_SCALE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    c_desc = tile_desc(c_ptr, M, N, stride_c, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), NUM_SMS, flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN)
        if HAS_SCALE:
            acc = scale_scalar(acc, scale_ptr)
        store_tile(c_desc, off_m, off_n, acc)


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """``scale * (a @ b)`` for a (M, K) and b (K, N), each row-major or a transposed row-major view;
    ``scale`` an optional fp32 [1] device tensor."""
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"shape mismatch: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    (a_s, a_t), (b_s, b_t) = operand(a), operand(b)
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, device=a.device, dtype=out_dtype or a.dtype)
    # b (K, N) row-major means B stored (K, N) (B_KN); b = W.T means W stored (N, K).
    gemm_kernel[persistent_grid(M, N, a.device)](
        a_s, b_s, scale, c, M, N, K, a_s.stride(0), b_s.stride(0), c.stride(0),
        HAS_SCALE=scale is not None, A_KM=a_t, B_KN=not b_t, NUM_SMS=num_sms(a.device))
    return c


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with w in nn.Linear layout (N, K)."""
    return matmul(x, w.T)
