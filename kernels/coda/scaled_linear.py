"""Consumer GEMM with the RMSNorm row scale (coda-spec rewrite (a)): ``z = rstd[:, None] * (h @ w^T)``.

With ``h = x * gamma`` from :mod:`kernels.coda.producer` this is ``rmsnorm(x; gamma) @ w^T``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import scale_rows, store_tile
from kernels.coda.mainloop import (coda_autotune, mainloop, num_sms, num_tiles, operand, operand_descs,
                                   persistent_grid, tile_coords, tile_desc)


@coda_autotune()
@triton.jit
def scaled_linear_kernel(h_ptr, w_ptr, rstd_ptr, z_ptr, M, N, K, stride_h, stride_w, stride_z,
                         A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    a_desc, b_desc = operand_descs(h_ptr, w_ptr, M, N, K, stride_h, stride_w, BM, BN, BK, A_KM, B_KN)
    z_desc = tile_desc(z_ptr, M, N, stride_z, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), NUM_SMS, flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN)
        store_tile(z_desc, off_m, off_n, scale_rows(acc, rstd_ptr, off_m, M, BM))


def scaled_linear(h: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``rstd[:, None] * (h @ w.T)`` in h's dtype; w in nn.Linear layout (N, K), rstd fp32 [M]."""
    (a_s, a_t), (w_s, w_t) = operand(h), operand(w.T)
    M, K = h.shape
    N = w.shape[0]
    z = torch.empty(M, N, device=h.device, dtype=h.dtype)
    scaled_linear_kernel[persistent_grid(M, N, h.device)](
        a_s, w_s, rstd, z, M, N, K, a_s.stride(0), w_s.stride(0), z.stride(0),
        A_KM=a_t, B_KN=not w_t, NUM_SMS=num_sms(h.device))
    return z
