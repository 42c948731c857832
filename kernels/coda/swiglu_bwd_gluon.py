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
kernel's bit for bit (zdz to rounding of the sums' order). z_pre, dz_pre and y are bf16 (the pair split and the
packing are bf16's); the operands are bf16, or fp8 with per-tensor scales (the dgrad's recipe, workloads/fp8.py:
dx e5m2 [M, d], w_down the transposed view of its K-major (f, d) copy, which fp8 wgmma needs), dequantized by
``dy = acc sa sb`` in the epilogue partition. Gluon has no interpreter: the fused Triton kernel is this kernel's
CPU-tested reference, and the Hopper tests check the two against each other on an H100 or H200.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from kernels.coda.epilogue import SCALING_NONE, SCALING_ROWWISE
from kernels.coda.fp8 import dequant_args
from kernels.coda.mainloop import persistent_grid
from kernels.coda.producer_gluon import LOADER_REGS, local_tiles, thread_barrier, tile_coords, tma_desc, tma_load
from kernels.coda.reduce import finish_row_sum
from workloads.fp8 import Fp8

BM, BN, GROUP_M, SUB_M = 128, 128, 8, 32
K_BYTES = 128
"""Bytes of K per operand tile row (BK = 64 bf16 or 128 fp8 elements): one 128-byte swizzle line, 32 KB a stage."""
MMA_WARPS, EPI_WARPS = 4, 8
MMA_REGS = gl.constexpr(232)
"""Registers per thread: mma 128 x 232 (its accumulator takes 128), loader 128 x 40, epilogue 256 x 120: the
kernel's maxnreg 128 x 512 threads, the SM's 64K."""
MAXNREG = 128


def stages(k_bytes: int) -> int:
    """Operand ring stages for a K of ``k_bytes`` bytes a row: 5 (229 KB of shared memory with the 64 KB accumulator
    buffer) at k_bytes <= 4096, where a tile's mainloop is short; 4 elsewhere. Measured on an H100 at M = 16384
    (PERF_NOTES; ms for 5 against 4 stages): bf16 1B (4096 bytes) 1.076 against 1.148, 7B (8192) 2.749 against
    2.557, 70B 14.05 against 13.57; fp8 7B (4096) 1.514 against 1.595, 70B (8192) 7.57 against 7.14, 1B a tie."""
    return 5 if k_bytes <= 4096 else 4


@gluon.jit
def loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, B_NK: gl.constexpr, GROUP_M: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    TM: gl.constexpr = a_desc.block_type.shape[0]
    TK: gl.constexpr = a_desc.block_type.shape[1]
    TN: gl.constexpr = b_desc.block_type.shape[0] if B_NK else b_desc.block_type.shape[1]
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
            if B_NK:
                tma_load(b_desc, [pid_n * TN, kk * TK], ready.index(slot), b_bufs.index(slot))
            else:
                tma_load(b_desc, [kk * TK, pid_n * TN], ready.index(slot), b_bufs.index(slot))
            p += 1


@gluon.jit
def mma(a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty, M, N, K, B_NK: gl.constexpr,
        INSTR_K: gl.constexpr, W: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    TM: gl.constexpr = a_bufs.type.shape[1]
    TK: gl.constexpr = a_bufs.type.shape[2]
    TN: gl.constexpr = acc_buf.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                         instr_shape=[16, TN, INSTR_K])
    k_tiles = gl.cdiv(K, TK)
    acc = gl.zeros((TM, TN), dtype=gl.float32, layout=acc_layout)
    c = 0
    for i in range(local_tiles(gl.cdiv(M, TM), gl.cdiv(N, TN))):
        for kk in range(k_tiles):
            slot = c % S
            mbarrier.wait(ready.index(slot), (c // S) & 1)
            if B_NK:  # B staged (TN, TK), K-major: fp8 wgmma's layout
                acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, use_acc=kk > 0,
                                    is_async=True)
            else:
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
def ws_dgrad_swiglu_kernel(a_desc, b_desc, z_ptr, dz_ptr, y_ptr, part_ptr, sa_ptr, sb_ptr, M, N, K, stride_p,
                           B_NK: gl.constexpr, SCALED: gl.constexpr, INSTR_K: gl.constexpr, S: gl.constexpr,
                           GROUP_M: gl.constexpr, SUB_M: gl.constexpr, MMA_W: gl.constexpr, num_warps: gl.constexpr):
    TM: gl.constexpr = a_desc.block_type.shape[0]
    TN: gl.constexpr = b_desc.block_type.shape[0] if B_NK else b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [S] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [S] + b_desc.block_type.shape, b_desc.layout)
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
        (epilogue, (acc_buf, acc_ready, acc_empty, z_ptr, dz_ptr, y_ptr, part_ptr, sa_ptr, sb_ptr, M, N, stride_p,
                    SCALED, GROUP_M, SUB_M, num_warps)),
        (mma, (a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty, M, N, K, B_NK, INSTR_K, MMA_W)),
        (loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, B_NK, GROUP_M)),
    ], [MMA_W, 1], [MMA_REGS, LOADER_REGS])


def ws_dgrad_swiglu(dx: torch.Tensor | Fp8, w_down: torch.Tensor | Fp8, z_pre: torch.Tensor,
                    n_stages: int | None = None, sub_m: int = SUB_M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dz_pre, y, zdz)`` for dx [M, d], w_down [d, f] and bf16 z_pre [M, 2f]: bf16 dx and w_down (d and f multiples
    of 8), or fp8 ones with per-tensor scales, w_down's data the transposed view of a row-major (f, d) tensor (d a
    multiple of 16): TMA rows of 16-byte multiples. ``n_stages`` (default :func:`stages` of K's bytes) and ``sub_m``
    (rows of an epilogue sub-tile) for benchmarks."""
    a, b, sa, sb, scaling = dequant_args(dx, w_down)  # sa, sb: placeholders for plain operands
    if scaling == SCALING_ROWWISE.value:
        raise ValueError("the Gluon SwiGLU dgrad takes fp8 operands with per-tensor scales, not rowwise ones")
    scaled = scaling != SCALING_NONE.value
    a, z_pre = a.contiguous(), z_pre.contiguous()
    b_nk = scaled  # fp8: B (f, d), K-major; bf16: B (d, f) as given
    b = b.T.contiguous() if b_nk else b.contiguous()
    M, K = a.shape
    N = b.shape[0] if b_nk else b.shape[1]
    bk = K_BYTES // a.element_size()
    dz_pre = torch.empty_like(z_pre)
    y = torch.empty(M, N, device=a.device, dtype=z_pre.dtype)
    part = torch.empty(M, triton.cdiv(N, BN), device=a.device, dtype=torch.float32)
    grid = persistent_grid(M, N, a.device)({"BM": BM, "BN": BN})
    ws_dgrad_swiglu_kernel[grid](tma_desc(a, [BM, bk]), tma_desc(b, [BN, bk] if b_nk else [bk, BN]),
                                 z_pre.view(torch.int32), dz_pre.view(torch.int32), y, part, sa, sb, M, N, K,
                                 part.stride(0), B_NK=b_nk, SCALED=scaled, INSTR_K=32 // a.element_size(),
                                 S=n_stages or stages(K * a.element_size()), GROUP_M=GROUP_M, SUB_M=sub_m,
                                 MMA_W=MMA_WARPS, num_warps=EPI_WARPS, maxnreg=MAXNREG)
    return dz_pre, y, finish_row_sum(part, part.shape[1])


def dgrad_swiglu_gluon(dx: torch.Tensor | Fp8, w_down: torch.Tensor | Fp8, z_pre: torch.Tensor, promote: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kernels.coda.swiglu_bwd.dgrad_swiglu`'s Gluon path (where :func:`kernels.coda.swiglu_bwd.gluon_applies`
    holds): fp8 operands accumulate in Hopper's fast mode only (``promote`` is not taken)."""
    if promote:
        raise ValueError("the Gluon SwiGLU dgrad accumulates fp8 in the fast mode only, not promoted")
    return ws_dgrad_swiglu(dx, w_down, z_pre)
