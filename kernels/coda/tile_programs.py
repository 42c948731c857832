"""The device programs of a declared CODA kernel (:mod:`kernels.coda.program` builds each kernel's entry, one call
of one of them, from the declaration): :func:`fused_program` (the persistent fused kernel: mainloop, dequantization,
the epilogue on column sub-tiles, outputs through descriptors), :func:`blocks_program` (the split kernel: blocks of the
GEMM output by pointers) and :func:`tile_epilogue` (one tile's epilogue, its pointer stores and partials: the
split kernel's body and the Gluon variant's, :mod:`kernels.coda.gluon_program`). Their constexpr arguments say what
the declaration has: INPUTS, EPILOGUE and TILE its functions, NOUT outputs of COLS / WIDE shapes, which of them a
call STOREs, which output's row sums of squares (SUMSQ_OF) or which row values (ROW_SUM) are kept, which result's
column sums (COL_SUM) and which output's absmax (AMAX_OF, with AMAX)."""
import triton
import triton.language as tl

from kernels.coda.epilogue import cast, col_subtile, col_sum_partial, dequant, dequant_scale, full, load_block, \
    load_rows, row_absmax, row_sumsq, store_block, store_col_partial, store_row_partial, store_tile
from kernels.coda.mainloop import mainloop, num_tiles, operand_descs, tile_coords, tile_desc


@triton.jit
def _desc(ptr, stride, M, N, COLS: tl.constexpr, WIDE: tl.constexpr, BM: tl.constexpr, SN: tl.constexpr):
    return tile_desc(ptr, M, N * WIDE // COLS, stride, BM, SN * WIDE // COLS)


@triton.jit
def _store(desc, off_m, off_n, COLS: tl.constexpr, WIDE: tl.constexpr, val, amax, ss, ABSMAX: tl.constexpr,
           SUMSQ: tl.constexpr):
    """Store ``val`` at (off_m, off_n * WIDE / COLS); with SUMSQ, ``ss`` plus the row sums of squares of the fp32
    ``val``; with ABSMAX, ``amax`` maxed with the row absmax of what was stored."""
    store_tile(desc, off_m, off_n * WIDE // COLS, val)
    if SUMSQ:
        ss += row_sumsq(val)
    if ABSMAX:
        amax = tl.maximum(amax, row_absmax(cast(val, desc.dtype)))
    return amax, ss


@triton.jit
def _stores(d0, d1, res, off_m, off_n, amax, ss, NOUT: tl.constexpr, COLS: tl.constexpr, WIDE: tl.constexpr,
            STORE: tl.constexpr, AMAX: tl.constexpr, AMAX_OF: tl.constexpr, SUMSQ_OF: tl.constexpr):
    """The epilogue's outputs ``res`` of the tile at (off_m, off_n) stored through d0 and d1 (those STORE asks for;
    None for the others), by :func:`_store`: ``(amax, ss)`` with the row partials of outputs AMAX_OF and SUMSQ_OF."""
    if STORE[0]:
        amax, ss = _store(d0, off_m, off_n, COLS[0], WIDE[0], res[0], amax, ss, AMAX and AMAX_OF == 0, SUMSQ_OF == 0)
    if NOUT > 1:
        if STORE[1]:
            amax, ss = _store(d1, off_m, off_n, COLS[1], WIDE[1], res[1], amax, ss, AMAX and AMAX_OF == 1,
                              SUMSQ_OF == 1)
    return amax, ss


@triton.jit
def _sums(res, ss, cs_ptr, off_m, off_n, N, stride_cs, NOUT: tl.constexpr, ROW_SUM: tl.constexpr,
          COL_SUM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """``ss`` plus (ROW_SUM) the row values the epilogue returned after its NOUT outputs; the column sums of its
    result COL_SUM (-1: none) stored at (off_m / BM, off_n)."""
    if ROW_SUM:
        ss += res[NOUT]
    if COL_SUM >= 0:
        col_sum_partial(cs_ptr, res[COL_SUM], off_m, off_n, N, stride_cs, BM, BN)
    return ss


@triton.jit
def scaled_rows(acc, row_ptr, sa_ptr, sb_ptr, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr,
                SCALING: tl.constexpr, ROW_SCALE: tl.constexpr):
    """The (BM, BN) accumulator tile at (off_m, off_n) dequantized (SCALING) and, with ROW_SCALE, times the row scale
    at ``row_ptr``: the epilogue's ``z``."""
    if ROW_SCALE:
        z = dequant_scale(acc, load_rows(row_ptr, off_m, M, BM), sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN, SCALING)
    else:
        z = dequant(acc, sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN, SCALING)
    return z


@triton.jit
def fused_program(a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                  PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, GROUP_M: tl.constexpr, row_ptr, args, in_strides, outs, strides, ss_ptr,
                  amax_ptr, stride_part, cs_ptr, stride_cs, INPUTS: tl.constexpr, EPILOGUE: tl.constexpr,
                  TILE: tl.constexpr, ROW_SCALE: tl.constexpr, NOUT: tl.constexpr, COLS: tl.constexpr,
                  WIDE: tl.constexpr, STORE: tl.constexpr, SUMSQ_OF: tl.constexpr, ROW_SUM: tl.constexpr,
                  COL_SUM: tl.constexpr, AMAX_OF: tl.constexpr, AMAX: tl.constexpr, EPI_SUB: tl.constexpr):
    """The persistent fused kernel: for each tile, the mainloop, the dequantization (with the row scale), TILE (the
    tile and the epilogue's args on it), then EPILOGUE on each of EPI_SUB column sub-tiles, its outputs stored
    (those STORE asks for) and the column sums of its result COL_SUM (-1: none) stored per M tile; the row partials
    of the tile: sums of squares of output SUMSQ_OF (-1: none) or (ROW_SUM) sums of the row values EPILOGUE returns
    after its outputs, and with AMAX the absmax of output AMAX_OF."""
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    SN: tl.constexpr = BN // EPI_SUB
    args = INPUTS(args, in_strides, M, N, BM, SN)
    d0 = _desc(outs[0], strides[0], M, N, COLS[0], WIDE[0], BM, SN) if STORE[0] else None  # stored outputs'
    d1 = ((_desc(outs[1], strides[1], M, N, COLS[1], WIDE[1], BM, SN) if STORE[1] else None) if NOUT > 1
          else None)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN, PROMOTE)
        z = scaled_rows(acc, row_ptr, sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN, SCALING, ROW_SCALE)
        z, tile_args = TILE(z, args, off_m, M, N, BM)
        ss = tl.zeros((BM,), dtype=tl.float32)
        amax = tl.zeros((BM,), dtype=tl.float32)
        for i in tl.static_range(EPI_SUB):
            off_s = off_n + i * SN
            res = EPILOGUE(col_subtile(z, i, EPI_SUB, BM, BN), tile_args, off_m, off_s, M, N, BM, SN)
            amax, ss = _stores(d0, d1, res, off_m, off_s, amax, ss, NOUT, COLS, WIDE, STORE, AMAX, AMAX_OF, SUMSQ_OF)
            ss = _sums(res, ss, cs_ptr, off_m, off_s, N, stride_cs, NOUT, ROW_SUM, COL_SUM, BM, SN)
        if SUMSQ_OF >= 0 or ROW_SUM:
            store_row_partial(ss_ptr, ss, off_m, off_n, M, stride_part, BM, BN)
        if AMAX:
            store_row_partial(amax_ptr, amax, off_m, off_n, M, stride_part, BM, BN)


@triton.jit
def _put(ptr, stride, off_m, off_n, M, N, COLS: tl.constexpr, WIDE: tl.constexpr, val, amax, part_ptr, stride_part,
         ABSMAX: tl.constexpr, SUMSQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Store output tile ``val`` [BM, BN * WIDE / COLS] by pointers at (off_m, off_n * WIDE / COLS); with SUMSQ its
    row sums of squares (fp32) at ``part[:, off_n / BN]``; with ABSMAX, ``amax`` maxed with the row absmax of what was
    stored."""
    store_block(ptr, stride, off_m, off_n * WIDE // COLS, M, N * WIDE // COLS, val, BM, BN * WIDE // COLS)
    if SUMSQ:
        store_row_partial(part_ptr, row_sumsq(val), off_m, off_n, M, stride_part, BM, BN)
    if ABSMAX:
        amax = tl.maximum(amax, row_absmax(cast(val, ptr.dtype.element_ty)))
    return amax


@triton.jit
def tile_epilogue(z, args, off_m, off_n, M, N, outs, strides, ss_ptr, amax_ptr, stride_part, EPILOGUE: tl.constexpr,
                  TILE: tl.constexpr, NOUT: tl.constexpr, COLS: tl.constexpr, WIDE: tl.constexpr,
                  STORE: tl.constexpr, SUMSQ_OF: tl.constexpr, ROW_SUM: tl.constexpr, COL_SUM: tl.constexpr,
                  AMAX_OF: tl.constexpr, AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The (BM, BN) tile ``z`` at (off_m, off_n) of a GEMM output (an N tile whole: its row partials complete): TILE,
    EPILOGUE, its outputs stored by pointers (those STORE asks for), and its row partials: the row sums (of squares of
    output SUMSQ_OF, or with ROW_SUM of the row values EPILOGUE returns after its outputs) and with AMAX the row
    absmax of output AMAX_OF at ``part[:, off_n / BN]``. Returns the column sums of result COL_SUM (0 without one),
    which the caller stores. The body of the split kernel and of the Gluon variant's epilogue."""
    z, tile_args = TILE(z, args, off_m, M, N, BM)
    res = EPILOGUE(z, tile_args, off_m, off_n, M, N, BM, BN)
    amax = full((BM,), 0.0, tl.float32) if AMAX else 0.0
    if STORE[0]:
        amax = _put(outs[0], strides[0], off_m, off_n, M, N, COLS[0], WIDE[0], res[0], amax, ss_ptr, stride_part,
                    AMAX and AMAX_OF == 0, SUMSQ_OF == 0, BM, BN)
    if NOUT > 1:
        if STORE[1]:
            amax = _put(outs[1], strides[1], off_m, off_n, M, N, COLS[1], WIDE[1], res[1], amax, ss_ptr,
                        stride_part, AMAX and AMAX_OF == 1, SUMSQ_OF == 1, BM, BN)
    if AMAX:
        store_row_partial(amax_ptr, amax, off_m, off_n, M, stride_part, BM, BN)
    if ROW_SUM:
        store_row_partial(ss_ptr, res[NOUT], off_m, off_n, M, stride_part, BM, BN)
    return tl.sum(res[COL_SUM], axis=0) if COL_SUM >= 0 else 0.0


@triton.jit
def _block(c_ptr, M, N, stride_c, row_ptr, args, off_m, off_n, outs, strides, ss_ptr, amax_ptr, stride_part,
           EPILOGUE: tl.constexpr, TILE: tl.constexpr, ROW_SCALE: tl.constexpr, NOUT: tl.constexpr, COLS: tl.constexpr,
           WIDE: tl.constexpr, STORE: tl.constexpr, SUMSQ_OF: tl.constexpr, ROW_SUM: tl.constexpr,
           COL_SUM: tl.constexpr, AMAX_OF: tl.constexpr, AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The (BM, BN) block at (off_m, off_n) of the GEMM output c [M, N] by pointers (its ``z``: c times the row
    scale) through :func:`tile_epilogue`: the column sums of result COL_SUM."""
    z = load_block(c_ptr, stride_c, off_m, off_n, M, N, BM, BN)
    if ROW_SCALE:
        z = z * load_rows(row_ptr, off_m, M, BM)[:, None]
    return tile_epilogue(z, args, off_m, off_n, M, N, outs, strides, ss_ptr, amax_ptr, stride_part, EPILOGUE, TILE,
                         NOUT, COLS, WIDE, STORE, SUMSQ_OF, ROW_SUM, COL_SUM, AMAX_OF, AMAX, BM, BN)


@triton.jit
def blocks_program(c_ptr, M, N, stride_c, row_ptr, args, in_strides, outs, strides, ss_ptr, amax_ptr, stride_part,
                   cs_ptr, stride_cs, INPUTS: tl.constexpr, EPILOGUE: tl.constexpr, TILE: tl.constexpr,
                   ROW_SCALE: tl.constexpr, NOUT: tl.constexpr, COLS: tl.constexpr, WIDE: tl.constexpr,
                   STORE: tl.constexpr, SUMSQ_OF: tl.constexpr, ROW_SUM: tl.constexpr, COL_SUM: tl.constexpr,
                   AMAX_OF: tl.constexpr, AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   LOOP: tl.constexpr):
    """The split kernel: program (p, j) takes the (BM, BN) block (p, j) of the GEMM output c [M, N] (its Tile inputs
    :class:`kernels.coda.epilogue.Block` objects) or, with LOOP, the blocks (p, j), (p + P, j), ... (P programs along
    M), through :func:`_block`; the column sums of result COL_SUM over its blocks are stored at ``cs[p, j BN:]``."""
    off_n = tl.program_id(1) * BN
    args = INPUTS(args, in_strides, M, N, BM, BN)
    if LOOP:
        col_sums = tl.zeros((BN,), dtype=tl.float32)
        for off_m in tl.range(tl.program_id(0) * BM, M, tl.num_programs(0) * BM, num_stages=1):
            sums = _block(c_ptr, M, N, stride_c, row_ptr, args, off_m, off_n, outs, strides, ss_ptr, amax_ptr,
                          stride_part, EPILOGUE, TILE, ROW_SCALE, NOUT, COLS, WIDE, STORE, SUMSQ_OF, ROW_SUM, COL_SUM,
                          AMAX_OF, AMAX, BM, BN)
            if COL_SUM >= 0:
                col_sums += sums
    else:
        col_sums = _block(c_ptr, M, N, stride_c, row_ptr, args, tl.program_id(0) * BM, off_n, outs, strides, ss_ptr,
                          amax_ptr, stride_part, EPILOGUE, TILE, ROW_SCALE, NOUT, COLS, WIDE, STORE, SUMSQ_OF,
                          ROW_SUM, COL_SUM, AMAX_OF, AMAX, BM, BN)
    if COL_SUM >= 0:
        store_col_partial(cs_ptr, col_sums, tl.program_id(0), off_n, N, stride_cs, BN)
