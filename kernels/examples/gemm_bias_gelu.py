"""Worked example (docs/writing-kernels.md): ``out = gelu_tanh(x W^T + b)`` as one CODA kernel."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from codabench.registry import register
from kernels.coda.epilogue import load_cols, store_tile
from kernels.coda.launch import FusedGemm
from kernels.coda.mainloop import coda_autotune, mainloop, num_tiles, operand_descs, tile_coords, tile_desc


@triton.jit
def gelu_tanh(u):
    """``0.5 u (1 + tanh(c (u + 0.044715 u^3)))`` = ``u sigmoid(2 c (u + 0.044715 u^3))``, c = sqrt(2/pi)."""
    return u * tl.sigmoid(1.5957691216057308 * (u + 0.044715 * u * u * u))


@coda_autotune()
@triton.jit
def gemm_bias_gelu_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                          PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, bias_ptr, out_ptr, stride_out):
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    out_desc = tile_desc(out_ptr, M, N, stride_out, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN)  # fp32 (BM, BN) tile of x W^T
        acc += load_cols(bias_ptr, off_n, N, BN)[None, :]                         # bias: a column vector
        store_tile(out_desc, off_m, off_n, gelu_tanh(acc))                        # activation, cast, store


@register("gemm_bias_gelu", "coda-example", modes=("fwd",), dtypes=("fp32", "fp16", "bf16"),
          requires=("triton-dot",), label="fused")
def gemm_bias_gelu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> dict[str, torch.Tensor]:
    """GEMM + bias + GELU in one kernel (fused epilogue)."""
    gemm = FusedGemm(x, w.T)  # x (M, K) @ w^T, w (N, K): nn.Linear's layout
    out = gemm.empty()
    gemm.launch(gemm_bias_gelu_kernel, bias_ptr=bias, out_ptr=out, stride_out=out.stride(0))
    return {"out": out}
