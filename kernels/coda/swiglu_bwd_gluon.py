"""The SwiGLU backward's dgrad GEMM as a warp-specialized Gluon kernel for Hopper (sm_90), its epilogue in a warp
partition of its own: the Gluon path of :func:`kernels.coda.swiglu_bwd.dgrad_swiglu` (:mod:`kernels.coda.strategy`).

The math is the fused kernel's, on the interleaved pre-activation ``z_pre`` [M, 2f] (column 2j = gate_j, 2j+1 = up_j)::

    dy = dx @ w_down,   s = sigmoid(gate),   dgate = dy up s (1 + gate (1 - s)),   dup = dy gate s,
    y = gate s up,      zdz_m = sum_j gate_mj dgate_mj + up_mj dup_mj   (per-tile partials, then one row sum).

The Triton kernel runs each tile's epilogue between two mainloops, and at small K that is a third of its time
(benchmarks/PERF_NOTES.md). Here three partitions of one persistent program per SM:

- **loader** (1 warp): the operand ring's TMA loads, tile after tile;
- **mma** (4 warps, one warpgroup): each (BM, BN) tile's wgmmas into an fp32 accumulator in its registers, then the
  accumulator into a shared-memory buffer ``acc_buf`` (``acc_ready``), and on to the next tile's mainloop;
- **epilogue** (8 warps): from ``acc_buf`` in row sub-tiles (a blocked layout, 16-byte global accesses along the
  rows), the tile's (gate, up) pairs loaded as int32 words and split by shifts, dz_pre stored as packed bf16 pairs
  (one ``cvt.rn.bf16x2.f32``), y and the row partials stored; then the buffer back (``acc_empty``).

So one tile's epilogue runs beside the next tile's mainloop on two warps per scheduler, which the epilogue of a
single warpgroup could not keep up with (benchmarks/gluon_pingpong_dgrad_swiglu.py). Its results equal the Triton
kernel's bit for bit (zdz to rounding of the sums' order). bf16 only (the pair split and the packing are bf16's);
Gluon has no interpreter: the fused Triton kernel is this kernel's CPU-tested reference, and the Hopper tests check
the two against each other on an H100 or H200.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from kernels.coda.producer_gluon import LOADER_REGS, local_tiles, thread_barrier, tile_coords, tma_desc, tma_load
from kernels.coda.mainloop import persistent_grid
from kernels.coda.reduce import finish_row_sum

BM, BN, BK, GROUP_M, SUB_M = 128, 128, 64, 8, 32
MMA_WARPS, EPI_WARPS = 4, 8
MMA_REGS = gl.constexpr(232)
"""Registers per thread: mma 128 x 232 (its accumulator takes 128), loader 128 x 40, epilogue 256 x 120: the
kernel's maxnreg 128 x 512 threads, the SM's 64K."""
MAXNREG = 128


def stages(K: int) -> int:
    """Operand ring stages: 5 (229 KB of shared memory with the 64 KB accumulator buffer) at K <= 2048, where a tile's
    mainloop is short; 4 elsewhere. Measured on an H100 at M = 16384 (PERF_NOTES): 5 stages 1.094 against 1.132 ms
    at 1B, 4 stages 2.578 against 2.669 at 7B and 13.2 against 14.9 at 70B."""
    return 5 if K <= 2048 else 4


@gluon.jit
def loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    TM: gl.constexpr = a_desc.block_type.shape[0]
    TK: gl.constexpr = a_desc.block_type.shape[1]
    TN: gl.constexpr = b_desc.block_type.shape[1]
    n_m = gl.cdiv(M, TM)
    n_n = gl.cdiv(N, TN)
    k_tiles = gl.cdiv(K, TK)
    p = 0
    for i in range(local_tiles(n_m, n_n)):
        pid_m, pid_n = tile_coords(i, n_m, n_n, GROUP_M)
        for kk in range(k_tiles):
            slot = p % S
            mbarrier.wait(empty.index(slot), ((p // S) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma_load(a_desc, [pid_m * TM, kk * TK], ready.index(slot), a_bufs.index(slot))
            tma_load(b_desc, [kk * TK, pid_n * TN], ready.index(slot), b_bufs.index(slot))
            p += 1


@gluon.jit
def mma(a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty, M, N, K, W: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    TM: gl.constexpr = a_bufs.type.shape[1]
    TK: gl.constexpr = a_bufs.type.shape[2]
    TN: gl.constexpr = b_bufs.type.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                         instr_shape=[16, TN, 16])
    k_tiles = gl.cdiv(K, TK)
    acc = gl.zeros((TM, TN), dtype=gl.float32, layout=acc_layout)
    c = 0
    for i in range(local_tiles(gl.cdiv(M, TM), gl.cdiv(N, TN))):
        for kk in range(k_tiles):
            slot = c % S
            mbarrier.wait(ready.index(slot), (c // S) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot), acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            thread_barrier()  # every warp is done with the previous slot
            mbarrier.arrive(empty.index((c + S - 1) % S), pred=kk > 0)
            c += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        thread_barrier()
        mbarrier.arrive(empty.index((c + S - 1) % S))
        mbarrier.wait(acc_empty, (i & 1) ^ 1)  # the epilogue is done with the previous tile's dy
        acc_buf.store(acc)
        thread_barrier()
        mbarrier.arrive(acc_ready)


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
def epilogue(acc_buf, acc_ready, acc_empty, z_ptr, dz_ptr, y_ptr, part_ptr, M, N, stride_p, GROUP_M: gl.constexpr,
             SUB_M: gl.constexpr, num_warps: gl.constexpr):
    TM: gl.constexpr = acc_buf.type.shape[0]
    TN: gl.constexpr = acc_buf.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
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
            dz, y, zdz = swiglu_pairs_bwd(acc_buf.slice(r * SUB_M, SUB_M).load(layout), pairs)
            gl.store(dz_ptr + offs, dz, mask=mask)
            gl.store(y_ptr + offs, y, mask=mask)
            gl.store(part_ptr + rows * stride_p + pid_n, zdz, mask=rows < M)
        thread_barrier()  # every warp has read the buffer
        mbarrier.arrive(acc_empty)


@gluon.jit
def ws_dgrad_swiglu_kernel(a_desc, b_desc, z_ptr, dz_ptr, y_ptr, part_ptr, M, N, K, stride_p, S: gl.constexpr,
                           GROUP_M: gl.constexpr, SUB_M: gl.constexpr, MMA_W: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    TM: gl.constexpr = a_desc.block_type.shape[0]
    TN: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(dtype, [S] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [S] + b_desc.block_type.shape, b_desc.layout)
    acc_buf = gl.allocate_shared_memory(gl.float32, [TM, TN],
                                        gl.NVMMASharedLayout.get_default_for([TM, TN], gl.float32))
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    acc_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(acc_ready, count=1)
    mbarrier.init(acc_empty, count=1)
    gl.warp_specialize([
        (epilogue, (acc_buf, acc_ready, acc_empty, z_ptr, dz_ptr, y_ptr, part_ptr, M, N, stride_p, GROUP_M, SUB_M,
                    num_warps)),
        (mma, (a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty, M, N, K, MMA_W)),
        (loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M)),
    ], [MMA_W, 1], [MMA_REGS, LOADER_REGS])


def ws_dgrad_swiglu(dx: torch.Tensor, w_down: torch.Tensor, z_pre: torch.Tensor, n_stages: int | None = None,
                    sub_m: int = SUB_M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dz_pre, y, zdz)`` for bf16 dx [M, d], w_down [d, f] and z_pre [M, 2f], d and f multiples of 8 (TMA rows of
    16-byte multiples); ``n_stages`` (default :func:`stages`) and ``sub_m`` (rows of an epilogue sub-tile) for
    benchmarks."""
    dx, w_down, z_pre = dx.contiguous(), w_down.contiguous(), z_pre.contiguous()
    M, K = dx.shape
    N = w_down.shape[1]
    dz_pre = torch.empty_like(z_pre)
    y = torch.empty(M, N, device=dx.device, dtype=dx.dtype)
    part = torch.empty(M, triton.cdiv(N, BN), device=dx.device, dtype=torch.float32)
    grid = persistent_grid(M, N, dx.device)({"BM": BM, "BN": BN})
    ws_dgrad_swiglu_kernel[grid](tma_desc(dx, [BM, BK]), tma_desc(w_down, [BK, BN]), z_pre.view(torch.int32),
                                 dz_pre.view(torch.int32), y, part, M, N, K, part.stride(0), S=n_stages or stages(K),
                                 GROUP_M=GROUP_M, SUB_M=sub_m, MMA_W=MMA_WARPS, num_warps=EPI_WARPS,
                                 maxnreg=MAXNREG)
    return dz_pre, y, finish_row_sum(part, part.shape[1])


def dgrad_swiglu_gluon(dx: torch.Tensor, w_down: torch.Tensor, z_pre: torch.Tensor, promote: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kernels.coda.swiglu_bwd.dgrad_swiglu`'s Gluon path. Plain bf16 operands only
    (:func:`kernels.coda.swiglu_bwd.gluon_applies`): ``promote`` is fp8's."""
    if promote:
        raise ValueError("the Gluon SwiGLU dgrad takes plain bf16 operands, not fp8")
    return ws_dgrad_swiglu(dx, w_down, z_pre)
