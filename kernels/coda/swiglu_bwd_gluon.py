"""The SwiGLU backward's dgrad GEMM as a warp-specialized Gluon kernel for Hopper (sm_90), its epilogue in a warp
partition of its own: the Gluon path of :func:`kernels.coda.swiglu_bwd.dgrad_swiglu` (:mod:`kernels.coda.strategy`).

The math is the fused kernel's, on the interleaved pre-activation ``z_pre`` [M, 2f] (column 2j = gate_j, 2j+1 = up_j)::

    dy = dx @ w_down,   s = sigmoid(gate),   dgate = dy up s (1 + gate (1 - s)),   dup = dy gate s,
    y = gate s up,      zdz_m = sum_j gate_mj dgate_mj + up_mj dup_mj   (per-tile partials, then one row sum).

The Triton kernel runs each tile's epilogue between two mainloops, and at small K that is a third of its time
(docs/performance.md). Here the schedule of :mod:`kernels.coda.mainloop_gluon` (a loader warp, an MMA
warpgroup, the accumulator handed over in shared memory) with this epilogue partition (8 warps): from ``acc_buf`` in
row sub-tiles (a blocked layout, 16-byte global accesses along the rows), the tile's (gate, up) pairs loaded as int32
words and split by shifts, dz_pre stored as packed bf16 pairs (one ``cvt.rn.bf16x2.f32``), y and the row partials
stored; then the buffer back.

So one tile's epilogue runs beside the next tile's mainloop on two warps per scheduler, which the epilogue of a
single warpgroup could not keep up with (benchmarks/gluon_pingpong_dgrad_swiglu.py). Its results equal the Triton
kernel's bit for bit (zdz to rounding of the sums' order). z_pre, dz_pre and y are bf16 (the pair split and the
packing are bf16's); the operands are bf16, or fp8 with per-tensor scales (the dgrad's recipe, workloads/fp8.py:
dx e5m2 [M, d], w_down the transposed view of its K-major (f, d) copy, which fp8 wgmma needs), dequantized by
``dy = acc sa sb`` in the epilogue partition. Gluon has no interpreter: the fused Triton kernel is this kernel's
CPU-tested reference, and the Hopper tests check the two against each other on an H100 or H200.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from kernels.coda.host import cdiv
from kernels.coda.mainloop_gluon import BN, LOADER_REGS, MMA_REGS, WsGemm, local_tiles, loader, mma, thread_barrier, \
    tile_coords, ws_buffers
from kernels.coda.reduce import finish_row_sum
from workloads.fp8 import Fp8, Recipe, promoted

SUB_M = 32
"""Rows of an epilogue sub-tile."""


@gluon.jit
def swiglu_pairs_bwd(dy, pairs):
    """The SwiGLU backward of fp32 dy given the (gate, up) bf16 pairs of z_pre as uint32 words (gate in the low half):
    the packed (dgate, dup) bf16 words, y in bf16, and the row sums of ``gate dgate + up dup``."""
    gate = (pairs << 16).to(gl.float32, bitcast=True)
    up = (pairs & 0xFFFF0000).to(gl.float32, bitcast=True)
    s = 1.0 / (1.0 + gl.exp(-gate))
    silu = gate * s
    dgate = dy * up * s * (1.0 + gate * (1.0 - s))
    dup = dy * silu
    dz = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [dgate, dup], dtype=gl.int32,
                                   is_pure=True, pack=1)
    return dz, (silu * up).to(gl.bfloat16), gl.sum(gate * dgate + up * dup, axis=1)


@gluon.jit
def epilogue(acc_buf, acc_ready, acc_empty, z_ptr, dz_ptr, y_ptr, part_ptr, sa_ptr, sb_ptr, M, N, stride_p,
             SCALED: gl.constexpr, GROUP_M: gl.constexpr, SUB_M: gl.constexpr, num_warps: gl.constexpr):
    TM: gl.constexpr = acc_buf.type.shape[0]
    TN: gl.constexpr = acc_buf.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    scale = gl.load(sa_ptr) * gl.load(sb_ptr) if SCALED else 1.0  # fp8: dy = acc sa sb
    n_m = gl.cdiv(M, TM)
    n_n = gl.cdiv(N, TN)
    for i in range(local_tiles(n_m, n_n)):
        pid_m, pid_n = tile_coords(i, n_m, n_n, GROUP_M)
        mbarrier.wait(acc_ready, i & 1)
        cols = pid_n * TN + gl.arange(0, TN, layout=gl.SliceLayout(0, layout))
        for r in gl.static_range(TM // SUB_M):
            rows = pid_m * TM + r * SUB_M + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, layout))
            offs = rows.to(gl.int64)[:, None] * N + cols[None, :]  # z_pre and dz_pre as int32 [M, N], y [M, N]
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            pairs = gl.load(z_ptr + offs, mask=mask, other=0).to(gl.uint32, bitcast=True)
            dz, y, zdz = swiglu_pairs_bwd(acc_buf.slice(r * SUB_M, SUB_M).load(layout) * scale, pairs)
            gl.store(dz_ptr + offs, dz, mask=mask)
            gl.store(y_ptr + offs, y, mask=mask)
            gl.store(part_ptr + rows * stride_p + pid_n, zdz, mask=rows < M)
        thread_barrier()  # every warp has read the buffer
        mbarrier.arrive(acc_empty)


@gluon.jit
def ws_dgrad_swiglu_kernel(a_desc, b_desc, sa_ptr, sb_ptr, M, N, K, z_ptr, dz_ptr, y_ptr, part_ptr, stride_p,
                           B_NK: gl.constexpr, SCALED: gl.constexpr, INSTR_K: gl.constexpr, S: gl.constexpr,
                           GROUP_M: gl.constexpr, MMA_W: gl.constexpr, SUB_M: gl.constexpr, num_warps: gl.constexpr):
    a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty = ws_buffers(a_desc, b_desc, S, B_NK)
    gl.warp_specialize([
        (epilogue, (acc_buf, acc_ready, acc_empty, z_ptr, dz_ptr, y_ptr, part_ptr, sa_ptr, sb_ptr, M, N, stride_p,
                    SCALED, GROUP_M, SUB_M, num_warps)),
        (mma, (a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty, M, N, K, B_NK, INSTR_K, MMA_W)),
        (loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, B_NK, GROUP_M)),
    ], [MMA_W, 1], [MMA_REGS, LOADER_REGS])


def ws_dgrad_swiglu(dx: torch.Tensor | Fp8, w_down: torch.Tensor | Fp8, z_pre: torch.Tensor,
                    n_stages: int | None = None, sub_m: int = SUB_M, overwrite: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dz_pre, y, zdz)`` for dx [M, d], w_down [d, f] and bf16 z_pre [M, 2f]: bf16 dx and w_down (d and f multiples
    of 8), or fp8 ones with per-tensor scales, w_down's data the transposed view of a row-major (f, d) tensor (d a
    multiple of 16): TMA rows of 16-byte multiples. ``n_stages`` (default :func:`kernels.coda.mainloop_gluon.stages`
    of K's bytes) and ``sub_m`` (rows of an epilogue sub-tile) for benchmarks; ``overwrite``: dz_pre over z_pre
    (each element stored by the thread that loaded it)."""
    gemm = WsGemm(dx, w_down, "SwiGLU dgrad")
    z_pre = z_pre.contiguous()
    dz_pre = z_pre if overwrite else torch.empty_like(z_pre)
    y = gemm.empty(z_pre.dtype)
    part = torch.empty(gemm.M, cdiv(gemm.N, BN), device=gemm.device, dtype=torch.float32)
    gemm.launch(ws_dgrad_swiglu_kernel, z_pre.view(torch.int32), dz_pre.view(torch.int32), y, part, part.stride(0),
                n_stages=n_stages, SUB_M=sub_m)
    return dz_pre, y, finish_row_sum(part, part.shape[1])


def dgrad_swiglu_gluon(dx: torch.Tensor | Fp8, w_down: torch.Tensor | Fp8, z_pre: torch.Tensor,
                       recipe: Recipe | None = None, overwrite: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kernels.coda.swiglu_bwd.dgrad_swiglu`'s Gluon path (where :func:`kernels.coda.swiglu_bwd.gluon_applies`
    holds): fp8 operands accumulate in Hopper's fast mode only (a recipe with promoted accumulation is not taken)."""
    if promoted(recipe):
        raise ValueError("the Gluon SwiGLU dgrad accumulates fp8 in the fast mode only, not promoted")
    return ws_dgrad_swiglu(dx, w_down, z_pre, overwrite=overwrite)
