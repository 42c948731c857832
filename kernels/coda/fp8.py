"""FP8 in the CODA kernels: operand scales for the epilogue, and quantizing an epilogue's output.

The recipe is :mod:`workloads.fp8` (per-tensor or rowwise, power-of-two dynamic scales). A GEMM on fp8
operands ``A ~ qa sa`` and ``B ~ qb sb`` computes ``acc = qa @ qb^T`` in the mainloop and dequantizes in the
epilogue, composed with any per-row scale r (RMSNorm's rstd) in the same multiply
(:func:`kernels.coda.epilogue.dequant_scale`)::

    out = acc * (r * sa)[:, None] * sb[None, :]      sa: scalar or [M] (per token), sb: scalar or [N] (per channel)

An activation that an epilogue produces (the normalized input h of the next GEMM, SwiGLU's y) is
quantized from per-(row, N-tile) absmax partials that the same epilogue wrote, so no pass re-reads it
to find its range::

    amax_m = max_t part[m, t]   (rowwise)   or   amax = max_m amax_m   (per tensor)
    s = pow2_scale(amax);   q = fp8(x / s)                     (:func:`quantize_from_partials`)
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.coda.align import aligned, empty_rows
from kernels.coda.epilogue import SCALING_NONE, SCALING_PER_TENSOR, SCALING_ROWWISE, load_tile, store_tile
from kernels.coda.host import cdiv, next_power_of_2
from kernels.coda.mainloop import INTERPRET, tile_desc
from workloads.fp8 import FP8_EXPONENT, Fp8


# ---- host: the dequantization arguments of a GEMM ------------------------------------------------

def split_operand(t: torch.Tensor | Fp8) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(data, scale or None)`` of a plain or quantized operand."""
    return (t.data, t.scale) if isinstance(t, Fp8) else (t, None)


def dequant_args(a: torch.Tensor | Fp8, b: torch.Tensor | Fp8
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(a, b, sa, sb, SCALING)`` for the launch of a GEMM: the operands' data and scales, both fp8 or neither.

    SCALING (the value of one of :mod:`kernels.coda.epilogue`'s ``SCALING_*``) follows from the scales the recipe
    gave the operands: per tensor when both are scalars, rowwise when both are vectors (sa one entry per row of
    the output, sb one per column); the scale arguments are placeholders (never read) without fp8.
    """
    (a, sa), (b, sb) = split_operand(a), split_operand(b)
    if (sa is None) != (sb is None):
        raise ValueError("a GEMM takes two fp8 operands (with scales) or none")
    if sa is None:
        return a, b, _ones(a.device), _ones(a.device), SCALING_NONE.value
    if sa.numel() == 1 and sb.numel() == 1:
        return a, b, sa, sb, SCALING_PER_TENSOR.value
    if sa.numel() == 1 or sb.numel() == 1:
        raise ValueError("fp8 operands take per-tensor scales on both sides or rowwise scales on both")
    return a, b, sa.reshape(-1).contiguous(), sb.reshape(-1).contiguous(), SCALING_ROWWISE.value


def scalar_args(scale: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(sa, sb, SCALING)`` for one fp32 scalar multiplier (a loss scale) on a GEMM of plain operands."""
    if scale is None:
        return _ones(device), _ones(device), SCALING_NONE.value
    return scale, _ones(device), SCALING_PER_TENSOR.value


@functools.lru_cache(maxsize=8)
def _ones(device: torch.device) -> torch.Tensor:
    return torch.ones(1, device=device, dtype=torch.float32)


def result_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of a GEMM's outputs: the operand's, bf16 for fp8 operands."""
    return torch.bfloat16 if t.element_size() == 1 else t.dtype


# ---- device: scales and quantization ---------------------------------------------------------------

@triton.jit
def pow2_scale(amax, FP8_EXP: tl.constexpr):
    """``2^k``, the smallest power of two with ``amax <= 1.75 2^(FP8_EXP + k)`` (fmax), 1 where amax is 0;
    bit-exact twin of :func:`workloads.fp8.pow2_scale`."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = ((bits >> 23) & 0xFF) - FP8_EXP + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    biased = tl.where(amax > 0, tl.minimum(tl.maximum(biased, 2), 253), 127)
    return (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_reciprocal(s):
    """``1 / s`` for a power of two s of :func:`pow2_scale`, exact (from its exponent bits)."""
    return ((254 - ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF)) << 23).to(tl.float32, bitcast=True)


BLOCK_MAX_STEP = 1024
"""Block maxima a :func:`quantize_kernel` program reads per step (per tensor): one step up to 64K rows."""


@triton.jit
def scale_kernel(part_ptr, out_ptr, M, T, stride_p, FP8_EXP: tl.constexpr, ROWWISE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    """From the absmax partials ``part[M, T]`` of BLOCK_M rows per program: per row, their scales (``out[M]``); per
    tensor, the block's maximum (``out[pid]``), whose maximum over the blocks :func:`quantize_kernel` takes."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_T)
    p = tl.load(part_ptr + rows[:, None].to(tl.int64) * stride_p + cols[None, :],
                mask=(rows < M)[:, None] & (cols < T)[None, :], other=0.0)
    amax = tl.max(p, axis=1)
    if ROWWISE:
        tl.store(out_ptr + rows, pow2_scale(amax, FP8_EXP), mask=rows < M)
    else:
        tl.store(out_ptr + tl.program_id(0), tl.max(amax, axis=0))


@triton.jit
def quantize_kernel(x_ptr, scale_ptr, block_max_ptr, q_ptr, M, N, n_blocks, stride_x, stride_q, FP8_EXP: tl.constexpr,
                    ROWWISE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLOCK_B: tl.constexpr):
    """Rows [pid BM, pid BM + BM): ``q = x / s`` in q's dtype (exact: s is 2^k). Per row, s from ``scale``; per tensor,
    s = pow2_scale(max of the n_blocks block maxima), which program 0 also stores into ``scale``."""
    off_m = tl.program_id(0) * BM
    x_desc = tile_desc(x_ptr, M, N, stride_x, BM, BN)
    q_desc = tile_desc(q_ptr, M, N, stride_q, BM, BN)
    rows = off_m + tl.arange(0, BM)
    if ROWWISE:
        s = tl.load(scale_ptr + rows, mask=rows < M, other=1.0)[:, None]
    else:
        amax = tl.zeros((BLOCK_B,), dtype=tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            amax = tl.maximum(amax, tl.load(block_max_ptr + b, mask=b < n_blocks, other=0.0))
        s = pow2_scale(tl.max(amax, axis=0), FP8_EXP)
        tl.store(scale_ptr, s, mask=tl.program_id(0) == 0)
    inv = pow2_reciprocal(s)
    for off_n in range(0, N, BN):
        store_tile(q_desc, off_m, off_n, load_tile(x_desc, off_m, off_n) * inv)


def quantize_from_partials(x: torch.Tensor, part: torch.Tensor, n_tiles: int, rowwise: bool,
                           fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> Fp8:
    """Dynamic quantization of x [M, N] given its absmax partials ``part[:, :n_tiles]`` (per row, per N tile):
    bit-identical to :func:`workloads.fp8.quantize`. Two launches: :func:`scale_kernel` (the scales per row, or per
    tensor the maxima of blocks of rows, in parallel), then one pass over x that quantizes it (per tensor, each of
    its programs first takes the maximum of those block maxima: the few hundred values of a 16384-row x). The data
    is in the row layout of :mod:`kernels.coda.align` (N a multiple of 16 or not)."""
    x = aligned(x)
    M, N = x.shape
    q = empty_rows(M, N, fp8_dtype, x.device)
    scale = torch.empty((M, 1) if rowwise else (), device=x.device, dtype=torch.float32)
    block_t = next_power_of_2(n_tiles)
    block_m = max(1, min(64, 4096 // block_t))
    n_blocks = cdiv(M, block_m)
    block_max = scale if rowwise else torch.empty(n_blocks, device=x.device, dtype=torch.float32)  # scale_kernel's out
    exp = FP8_EXPONENT[fp8_dtype]
    scale_kernel[(n_blocks,)](part, block_max, M, n_tiles, part.stride(0), FP8_EXP=exp, ROWWISE=rowwise,
                              BLOCK_M=block_m, BLOCK_T=block_t)
    bm, bn = (16, 32) if INTERPRET else (32, 256)
    quantize_kernel[(cdiv(M, bm),)](x, scale, block_max, q, M, N, n_blocks, x.stride(0), q.stride(0),
                                    FP8_EXP=exp, ROWWISE=rowwise, BM=bm, BN=bn,
                                    BLOCK_B=min(BLOCK_MAX_STEP, next_power_of_2(n_blocks)))
    return Fp8(q, scale)
