"""Plain GEMM through the shared mainloop: ``C = A @ B``, dequantized (the speed-of-light kernel).

Operands are bf16/fp16/fp32, or both fp8 (:class:`workloads.fp8.Fp8`, per-tensor or rowwise scales,
bf16 out): ``C = (sa sb) * (qa @ qb)``. A lone fp32 scalar ``s`` on plain operands (a device tensor: a
loss scale) is the same epilogue multiply, ``C = s * (A @ B)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import dequant, store_tile
from kernels.coda.launch import FusedGemm
from kernels.coda.mainloop import coda_autotune, mainloop, num_tiles, operand_descs, tile_coords, tile_desc
from workloads.fp8 import Fp8


@coda_autotune()
@triton.jit
def gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, c_ptr, stride_c):
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    c_desc = tile_desc(c_ptr, M, N, stride_c, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN, PROMOTE)
        acc = dequant(acc, sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN, SCALING)
        store_tile(c_desc, off_m, off_n, acc)


def matmul(a: torch.Tensor | Fp8, b: torch.Tensor | Fp8, out_dtype: torch.dtype | None = None,
           scale: torch.Tensor | None = None, promote: bool = False) -> torch.Tensor:
    """``a @ b`` for a (M, K) and b (K, N), each row-major or a transposed row-major view (fp8: a (M, K) and
    b (K, N) as the transpose of an (N, K) tensor, per-channel scales along N); ``scale``: an optional fp32
    one-element device tensor multiplying plain operands; ``promote``: fp8 accumulation mode."""
    gemm = FusedGemm(a, b, promote, scale)
    c = gemm.empty(out_dtype)
    gemm.launch(gemm_kernel, c_ptr=c, stride_c=c.stride(0))
    return c


def linear(x: torch.Tensor | Fp8, w: torch.Tensor | Fp8, promote: bool = False) -> torch.Tensor:
    """``x @ w.T`` with w in nn.Linear layout (N, K); fp8 x, w: scales per tensor or per row of each."""
    return matmul(x, w.T, promote=promote)


def split_matmul(a: torch.Tensor | Fp8, b: torch.Tensor | Fp8, promote: bool = False) -> torch.Tensor:
    """The GEMM of a split path (:mod:`kernels.coda.strategy`): ``a @ b`` by cuBLAS (torch) for plain operands, by
    :func:`matmul` (the mainloop, dequantizing) for fp8 ones; the result rounded to the operands' dtype (bf16 for
    fp8), as PyTorch's unfused code rounds it."""
    if isinstance(a, Fp8):
        return matmul(a, b, promote=promote)
    return a @ b
