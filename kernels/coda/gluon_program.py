"""The Gluon variant of a declared CODA kernel (:mod:`kernels.coda.program`), for Hopper (sm_90): the declared
epilogue in the epilogue partition of the warp-specialized schedule of :mod:`kernels.coda.mainloop_gluon` (a loader
warp, an MMA warpgroup, the accumulator handed over in shared memory), so that one tile's epilogue runs beside the
next tile's mainloop.

The epilogue partition takes each (BM, BN) accumulator in row sub-tiles of ``SUB_M`` rows, the whole tile wide: per
sub-tile the dequantization (with the row scale), then :func:`kernels.coda.tile_programs.tile_epilogue`, as the split
kernel runs it: the declaration's ``tile`` function and epilogue, the outputs stored by pointers and the partials
(row sums per N tile, complete in a whole-width sub-tile; column sums per sub-tile, ``m_tiles`` = M / SUB_M). A
:class:`Tile` input is a pointer :class:`kernels.coda.epilogue.Block` here (:func:`block`), which the epilogue reads
with ``load_tile`` as it reads a descriptor in the fused kernel. The primitives' new tiles take the layout of the
tiles they meet (:func:`kernels.coda.epilogue.arange`).

Gluon has no interpreter: the fused Triton kernel is this variant's CPU-tested reference, and the Hopper tests
check the two against each other on an H100 or H200.
"""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from kernels.coda.epilogue import SCALING_PER_TENSOR, Block, store_col_partial
from kernels.coda.mainloop_gluon import (BN as TILE_N, EPI_WARPS, LOADER_REGS, MMA_REGS, local_tiles, loader, mma,
                                         thread_barrier, tile_coords, ws_buffers)
from kernels.coda.tile_programs import scaled_rows, tile_epilogue

SUB_M = 32
"""Rows of an epilogue sub-tile."""
LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [EPI_WARPS, 1], [1, 0]))
"""The epilogue partition's layout of a sub-tile: each warp a row at a time, 16-byte accesses of fp32 along it."""


@triton.constexpr_function
def block_layout(BN):
    """The layout of a (SUB_M, BN) block read by the epilogue partition: :data:`LAYOUT` with BN / TILE_N times as
    many adjacent columns a thread (TILE_N: the accumulator tile's width), so that a block WIDE times as wide as the
    accumulator tile, split into its WIDE interleaved tiles (column WIDE j + i of the block is column j of tile i: the
    pairs of :func:`kernels.coda.epilogue.split_pairs`), lands each of them in LAYOUT itself: no layout conversion.
    (The 32-bit words of a block of 16-bit pairs, :func:`kernels.coda.epilogue.load_pairs`, are as wide as the tile:
    LAYOUT.)"""
    return gl.BlockedLayout([1, 4 * max(BN // TILE_N, 1)], [1, 32], [EPI_WARPS, 1], [1, 0])


@triton.jit
def block(ptr, M, N, stride, BM: tl.constexpr, BN: tl.constexpr):
    """A :class:`Tile` input as the epilogue partition reads it: a pointer :class:`kernels.coda.epilogue.Block` whose
    loads come in :func:`block_layout` (a tile of the epilogue's that no other tile decides the layout of, as a load
    of x that only ever meets row vectors, still gets one), its pairs read as words in that of half its width."""
    return Block(ptr, M, N, stride, BM, BN, block_layout(BN), block_layout(BN // 2))


@gluon.jit
def epilogue_partition(acc_buf, acc_ready, acc_empty, sa_ptr, sb_ptr, M, N, row_ptr, args, in_strides, outs,
                       strides, ss_ptr, amax_ptr, stride_part, cs_ptr, stride_cs, INPUTS: gl.constexpr,
                       EPILOGUE: gl.constexpr, TILE: gl.constexpr, ROW_SCALE: gl.constexpr, NOUT: gl.constexpr,
                       COLS: gl.constexpr, WIDE: gl.constexpr, STORE: gl.constexpr, SUMSQ_OF: gl.constexpr,
                       ROW_SUM: gl.constexpr, COL_SUM: gl.constexpr, AMAX_OF: gl.constexpr, AMAX: gl.constexpr,
                       SCALING: gl.constexpr, GROUP_M: gl.constexpr, SUB_M: gl.constexpr, num_warps: gl.constexpr):
    """Per tile of this program, per row sub-tile of the accumulator: what :func:`kernels.coda.tile_programs.
    fused_program` does per column sub-tile, the partials stored per sub-tile."""
    TM: gl.constexpr = acc_buf.type.shape[0]
    TN: gl.constexpr = acc_buf.type.shape[1]
    n_m = gl.cdiv(M, TM)
    n_n = gl.cdiv(N, TN)
    args = INPUTS(args, in_strides, M, N, SUB_M, TN)
    if SCALING == SCALING_PER_TENSOR:  # the two scalars once, not at each sub-tile
        sa_ptr, sb_ptr = gl.load(sa_ptr), gl.load(sb_ptr)
    for i in range(local_tiles(n_m, n_n)):
        pid_m, pid_n = tile_coords(i, n_m, n_n, GROUP_M)
        off_n = pid_n * TN
        mbarrier.wait(acc_ready, i & 1)
        for r in gl.static_range(TM // SUB_M):
            off_m = pid_m * TM + r * SUB_M
            acc = acc_buf.slice(r * SUB_M, SUB_M).load(LAYOUT)
            z = scaled_rows(acc, row_ptr, sa_ptr, sb_ptr, off_m, off_n, M, N, SUB_M, TN, SCALING, ROW_SCALE)
            sums = tile_epilogue(z, args, off_m, off_n, M, N, outs, strides, ss_ptr, amax_ptr, stride_part,
                                 EPILOGUE, TILE, NOUT, COLS, WIDE, STORE, SUMSQ_OF, ROW_SUM, COL_SUM, AMAX_OF, AMAX,
                                 SUB_M, TN)
            if COL_SUM >= 0:
                store_col_partial(cs_ptr, sums, off_m // SUB_M, off_n, N, stride_cs, TN)
        thread_barrier()  # every warp has read the accumulator
        mbarrier.arrive(acc_empty)


@gluon.jit
def gluon_program(a_desc, b_desc, sa_ptr, sb_ptr, M, N, K, row_ptr, args, in_strides, outs, strides, ss_ptr,
                  amax_ptr, stride_part, cs_ptr, stride_cs, INPUTS: gl.constexpr, EPILOGUE: gl.constexpr,
                  TILE: gl.constexpr, ROW_SCALE: gl.constexpr, NOUT: gl.constexpr, COLS: gl.constexpr,
                  WIDE: gl.constexpr, STORE: gl.constexpr, SUMSQ_OF: gl.constexpr, ROW_SUM: gl.constexpr,
                  COL_SUM: gl.constexpr, AMAX_OF: gl.constexpr, AMAX: gl.constexpr, B_NK: gl.constexpr,
                  SCALED: gl.constexpr, INSTR_K: gl.constexpr, S: gl.constexpr, GROUP_M: gl.constexpr,
                  MMA_W: gl.constexpr, SUB_M: gl.constexpr, num_warps: gl.constexpr):
    """The persistent warp-specialized kernel: :func:`kernels.coda.mainloop_gluon.loader` and
    :func:`kernels.coda.mainloop_gluon.mma` beside :func:`epilogue_partition` (the kernel's own warps); SCALED: the
    operands' scaling mode (:class:`kernels.coda.mainloop_gluon.WsGemm`)."""
    a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty = ws_buffers(a_desc, b_desc, S, B_NK)
    gl.warp_specialize([
        (epilogue_partition, (acc_buf, acc_ready, acc_empty, sa_ptr, sb_ptr, M, N, row_ptr, args, in_strides, outs,
                              strides, ss_ptr, amax_ptr, stride_part, cs_ptr, stride_cs, INPUTS, EPILOGUE, TILE,
                              ROW_SCALE, NOUT, COLS, WIDE, STORE, SUMSQ_OF, ROW_SUM, COL_SUM, AMAX_OF, AMAX,
                              SCALED, GROUP_M, SUB_M, num_warps)),
        (mma, (a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty, M, N, K, B_NK, INSTR_K, MMA_W)),
        (loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, B_NK, GROUP_M)),
    ], [MMA_W, 1], [MMA_REGS, LOADER_REGS])
