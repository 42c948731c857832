"""Worked example (docs/writing-kernels.md): ``out = gelu_tanh(x W^T + b)`` as one CODA kernel."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from codabench.registry import register
from kernels.coda.epilogue import load_cols, store_tile
from kernels.coda.mainloop import (coda_autotune, mainloop, num_tiles, operand_descs, persistent_grid,
                                   tile_coords, tile_desc)


@triton.jit
def gelu_tanh(u):
    """``0.5 u (1 + tanh(c (u + 0.044715 u^3)))`` = ``u sigmoid(2 c (u + 0.044715 u^3))``, c = sqrt(2/pi)."""
    return u * tl.sigmoid(1.5957691216057308 * (u + 0.044715 * u * u * u))


@coda_autotune()
@triton.jit
def gemm_bias_gelu_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    x_desc, w_desc = operand_descs(x_ptr, w_ptr, M, N, K, stride_x, stride_w, BM, BN, BK, False, False)
    out_desc = tile_desc(out_ptr, M, N, stride_out, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(x_desc, w_desc, off_m, off_n, K, BM, BN, BK, False, False)  # fp32 (BM, BN) tile of x W^T
        acc += load_cols(b_ptr, off_n, N, BN)[None, :]                              # bias: a column vector
        store_tile(out_desc, off_m, off_n, gelu_tanh(acc))                          # activation, cast, store


@register("gemm_bias_gelu", "coda-example", modes=("fwd",), dtypes=("fp32", "fp16", "bf16"),
          requires=("triton",), label="fused")
def gemm_bias_gelu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> dict[str, torch.Tensor]:
    """GEMM + bias + GELU in one kernel (fused epilogue)."""
    x, w = x.contiguous(), w.contiguous()
    (M, K), N = x.shape, w.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    gemm_bias_gelu_kernel[persistent_grid(M, N, x.device)](
        x, w, bias, out, M, N, K, x.stride(0), w.stride(0), out.stride(0))
    return {"out": out}
