"""Epilogue primitives: small ``@triton.jit`` helpers applied to an fp32 output tile.

A tile is the (BM, BN) block at (off_m, off_n) of an M x N output; ``acc`` is the mainloop's fp32
accumulator (or any fp32 tile derived from it). Elements outside the matrix are zero in ``acc`` and in
tiles read through a descriptor (out-of-bounds reads are zero), which the reductions below rely on;
only the log-sum-exp masks explicitly (exp(0) is not 0). All math is fp32; values are cast to the
destination dtype only when stored. The five kinds (coda-spec.md):

1. elementwise / scale: :func:`scale_cols`, :func:`dequant_scale` (a row scale such as rstd composed with the
   fp8 scales; :func:`dequant` without one), :func:`add_tile`, :func:`rmsnorm_dx` (RMSNorm backward)
2. vector loads broadcast along M or N: :func:`load_rows`, :func:`load_cols`
3. tile load / store: :func:`load_tile`, :func:`store_tile` (+ :func:`cast`); by pointers, for the bandwidth-bound
   kernels that need no descriptor: :func:`load_block`, :func:`store_block` (16-bit pairs as 32-bit words:
   :func:`load_words`)
4. block reductions: row reductions :func:`row_sumsq`, :func:`row_dot`, :func:`row_absmax` (summed or maxed over
   an epilogue's sub-tiles), stored by :func:`store_row_partial` into ``part[M, T]`` (T = number of N tiles),
   and :func:`col_sum_partial` (:func:`store_col_partial`) into ``part[Tm, N]``;
   finished by the kernels of ``kernels/coda/reduce.py`` (deterministic: no atomics)
5. stateful / pairwise: :func:`tile_lse`, :func:`gather_cols`, :func:`split_cols` / :func:`col_subtile`,
   :func:`split_pairs` / :func:`join_pairs` (a Tile input's pairs: :func:`load_pairs`), :func:`silu_mul_pairs`,
   :func:`silu_mul_pairs_bwd`, :func:`rotate_pairs`, :func:`rope_cos_sin` (+ :func:`cos_sin_reduced`)
"""

import triton
import triton.language as tl

from kernels.coda.mainloop import INTERPRET

FAST_TRIG = tl.constexpr(not INTERPRET)
"""cos/sin of reduced angles with the GPU's approximate instructions (libdevice's are ~4x slower in an epilogue)."""
EMULATE_CASTS = tl.constexpr(INTERPRET)
"""Round onto the bf16 / fp8 grid in fp32 before a store: the interpreter's own conversions truncate."""

# 2*pi as A + B + C with A = 201/32 (8 significant bits: k * A is exact for |k| < 2^16), for the
# Cody-Waite reduction of RoPE angles.
TWO_PI_A = tl.constexpr(6.28125)
TWO_PI_B = tl.constexpr(0.0019353071693331003)
TWO_PI_C = tl.constexpr(1.0253131677018246e-11)
INV_TWO_PI = tl.constexpr(0.15915494309189535)

SCALING_NONE, SCALING_PER_TENSOR, SCALING_ROWWISE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
"""The values of the SCALING constexpr of the fp8-capable kernels, picked from the operands' scales in one place
(:func:`kernels.coda.fp8.dequant_args`): no scales; one scalar per operand; one scale per row of A (token) and
one per column of the output (channel)."""


# ---- 0. index and constant tiles, in a Triton kernel or a Gluon one ---------------------------

def _layout(semantic) -> tuple:
    """The layout argument Gluon's semantic takes for a new tile (None: Gluon's AutoLayout, which its uses
    decide); Triton's takes none."""
    return (None,) if "Gluon" in type(semantic).__name__ else ()


@tl.core.builtin
def arange(start, end, _semantic=None):
    """``tl.arange(start, end)``, which the primitives also need inside a Gluon kernel (:mod:`kernels.coda.
    gluon_program`), where a new tile takes the layout that its uses give it."""
    start, end = tl.core._unwrap_if_constexpr(start), tl.core._unwrap_if_constexpr(end)
    return _semantic.arange(start, end, *_layout(_semantic))


@tl.core.builtin
def full(shape, value, dtype, _semantic=None):
    """``tl.full(shape, value, dtype)`` in a Triton kernel or a Gluon one (as :func:`arange`)."""
    shape = [tl.core._unwrap_if_constexpr(n) for n in tl.core._unwrap_if_constexpr(shape)]
    value, dtype = tl.core._unwrap_if_constexpr(value), tl.core._unwrap_if_constexpr(dtype)
    return _semantic.full(shape, value, dtype, *_layout(_semantic))


@tl.core.builtin
def in_gluon(_semantic=None):
    """Whether the code compiles into a Gluon kernel (a constexpr)."""
    return tl.constexpr(bool(_layout(_semantic)))


@tl.core.builtin
def given(x, _semantic=None):
    """Whether an optional input of a declared kernel, a pointer or a Tile (its descriptor or block), was given: one a
    call gives as None reaches the epilogue as 0 (:mod:`kernels.coda.program`). A constexpr, so that ``if given(x):``
    compiles one branch (a flag found in ``args`` is a value, and its branches are both compiled)."""
    return tl.constexpr(_given(tl.core._unwrap_if_constexpr(x)))


def _given(x: object) -> bool:
    return x.dtype.is_ptr() if isinstance(x, tl.tensor) else not isinstance(x, int)


@tl.core.builtin
def is_pointer(x, _semantic=None):
    """Whether x is a pointer (a constexpr): a value given by its address or already loaded."""
    return tl.constexpr(_is_pointer(x))


def _is_pointer(x: object) -> bool:
    return isinstance(x, tl.tensor) and x.dtype.is_ptr()


@tl.core.builtin
def reads_words(src, _semantic=None):
    """Whether a Tile input's source reads pairs of 16-bit values as 32-bit words (a constexpr): a pointer
    :class:`Block` of bf16 or fp16 (:func:`load_pairs`)."""
    return tl.constexpr(_reads_words(src))


def _reads_words(src: object) -> bool:
    return (isinstance(src, Block) and src.ptr.dtype.element_ty.primitive_bitwidth == 16
            and src.ptr.dtype.element_ty.is_floating())


@tl.core.builtin
def like(x, y, _semantic=None):
    """x in the layout of y, a tile of x's shape: in a Gluon kernel, a layout conversion where they differ (the
    Triton compiler converts by itself)."""
    if _layout(_semantic) and x.type.layout != y.type.layout:
        return _semantic.convert_layout(x, y.type.layout)
    return x


@tl.core.builtin
def laid_out(x, layout, _semantic=None):
    """x, whose layout its uses would decide, in ``layout`` in a Gluon kernel (None: as its uses decide); x in a
    Triton kernel."""
    layout = tl.core._unwrap_if_constexpr(layout)
    if layout is None or not _layout(_semantic):
        return x
    return _semantic.set_auto_layout(x, layout)


if INTERPRET:  # the interpreter runs no Gluon, and puts its own semantic into tl's builtins only: call those
    def arange(start, end):  # noqa: F811
        return tl.arange(start, end)

    def full(shape, value, dtype):  # noqa: F811
        return tl.full(shape, value, dtype)

    def in_gluon():  # noqa: F811
        return False

    def given(x):  # noqa: F811
        return _given(x)

    def is_pointer(x):  # noqa: F811
        return _is_pointer(x)

    def reads_words(src):  # noqa: F811
        return _reads_words(src)

    def like(x, y):  # noqa: F811
        return x

    def laid_out(x, layout):  # noqa: F811
        return x


# ---- 1-2. scales and vector loads -------------------------------------------------------------

@triton.jit
def load_rows(vec_ptr, off_m, M, BM: tl.constexpr):
    """``v[off_m + i]`` for i < BM as fp32 (0 past M): a per-row vector of the tile."""
    rows = off_m + arange(0, BM)
    return tl.load(vec_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)


@triton.jit
def load_cols(vec_ptr, off_n, N, BN: tl.constexpr):
    """``v[off_n + j]`` for j < BN as fp32 (0 past N): a per-column vector of the tile."""
    cols = off_n + arange(0, BN)
    return tl.load(vec_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)


@triton.jit
def scale_cols(acc, vec_ptr, off_n, N, BN: tl.constexpr):
    """``acc[i, j] * v[off_n + j]``: column-vector scale (RMSNorm's ``gamma``, per-channel scales)."""
    return acc * load_cols(vec_ptr, off_n, N, BN)[None, :]


@triton.jit
def dequant_scale(acc, row, sa_ptr, sb_ptr, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr,
                  SCALING: tl.constexpr):
    """``acc * (row sa)[:, None] * sb[None, :]``: a per-row factor ``row`` (BM,) (RMSNorm's rstd, or ones)
    composed with the fp8 dequantization scales of the two GEMM operands (:mod:`kernels.coda.fp8`).

    SCALING_NONE: no scales; SCALING_PER_TENSOR: scalars ``*sa_ptr``, ``*sb_ptr`` (or the scalars themselves, loaded
    once before a loop), folded into the row factor (one multiply per element); SCALING_ROWWISE: ``sa[M]`` per token
    and ``sb[N]`` per output channel.
    """
    if SCALING == SCALING_PER_TENSOR:
        if is_pointer(sa_ptr):
            row = row * (tl.load(sa_ptr) * tl.load(sb_ptr))
        else:  # the scalars themselves, loaded once before a loop
            row = row * (sa_ptr * sb_ptr)
    if SCALING == SCALING_ROWWISE:
        row = row * load_rows(sa_ptr, off_m, M, BM)
        acc = acc * load_cols(sb_ptr, off_n, N, BN)[None, :]
    return acc * row[:, None]


@triton.jit
def dequant(acc, sa_ptr, sb_ptr, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr, SCALING: tl.constexpr):
    """:func:`dequant_scale` for a GEMM without a row scale: ``acc`` itself when SCALING is SCALING_NONE."""
    if SCALING != SCALING_NONE:
        acc = dequant_scale(acc, full((BM,), 1.0, tl.float32), sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN,
                            SCALING)
    return acc


# ---- 3. tile loads and stores -----------------------------------------------------------------

@triton.jit
def load_tile(desc, off_m, off_n):
    """The tile of ``desc`` at (off_m, off_n) as fp32 (zero outside the matrix)."""
    return desc.load([off_m, off_n]).to(tl.float32)


@triton.jit
def add_tile(acc, desc, off_m, off_n):
    """``acc + T`` with T the tile of ``desc`` at (off_m, off_n): residual add."""
    return acc + load_tile(desc, off_m, off_n)


@triton.jit
def store_tile(desc, off_m, off_n, val):
    """Write ``val`` cast to the descriptor's dtype at (off_m, off_n) (rows/cols past the end are dropped)."""
    desc.store([off_m, off_n], cast(val, desc.dtype))


@triton.jit
def _block_ptrs(ptr, stride, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """The pointers and in-bounds mask of the (BM, BN) block at (off_m, off_n) of a row-major [M, N] matrix."""
    if in_gluon():  # the block's corner once, then 32-bit offsets within it (fewer instructions a sub-tile)
        rows, cols = arange(0, BM), arange(0, BN)
        ptrs = ptr + tl.cast(off_m, tl.int64) * stride + off_n + (rows[:, None] * stride + cols[None, :])
        mask = (rows < M - off_m)[:, None] & (cols < N - off_n)[None, :]
    else:
        rows, cols = off_m + arange(0, BM), off_n + arange(0, BN)
        ptrs = ptr + rows[:, None].to(tl.int64) * stride + cols[None, :]
        mask = (rows < M)[:, None] & (cols < N)[None, :]
    return ptrs, mask


@triton.jit
def load_block(ptr, stride, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """:func:`load_tile` by pointer accesses: the (BM, BN) block at (off_m, off_n) of the row-major [M, N] matrix at
    ``ptr`` (row stride ``stride``) as fp32, zero outside the matrix."""
    ptrs, mask = _block_ptrs(ptr, stride, off_m, off_n, M, N, BM, BN)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_words(ptr, stride, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """The (BM, BN / 2) 32-bit words of the (BM, BN) block at (off_m, 2 off_n) of a row-major [M, N] matrix of 16-bit
    values (row stride ``stride``; rows starting at 4-byte boundaries, as :mod:`kernels.coda.align` lays them out),
    zero outside the matrix: each word the pair of columns (2j, 2j + 1), the even one in its low half."""
    words = ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    ptrs, mask = _block_ptrs(words, stride // 2, off_m, off_n, M, N // 2, BM, BN // 2)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def store_block(ptr, stride, off_m, off_n, M, N, val, BM: tl.constexpr, BN: tl.constexpr):
    """:func:`store_tile` by pointer accesses: ``val`` cast to the matrix's dtype (elements outside it dropped)."""
    ptrs, mask = _block_ptrs(ptr, stride, off_m, off_n, M, N, BM, BN)
    tl.store(ptrs, cast(val, ptr.dtype.element_ty), mask=mask)


@tl.core._aggregate
class Block:  # (no `from __future__ import annotations` in this module: an aggregate checks its fields' types)
    """A row-major [M, N] matrix read in (BM, BN) blocks by pointers (:func:`load_block`): a
    :class:`kernels.coda.program.Tile` input of a split kernel, which its epilogue reads with :func:`load_tile` as it
    reads a descriptor in the fused kernel (a descriptor's blocks are at most 256 elements wide; these are not)."""

    ptr: tl.tensor
    M: tl.tensor | tl.constexpr
    N: tl.tensor | tl.constexpr
    stride: tl.tensor | tl.constexpr
    BM: tl.constexpr
    BN: tl.constexpr
    layout: tl.constexpr
    pair_layout: tl.constexpr

    @triton.constexpr_function  # a JIT callable, as a kernel may reference; its arguments come unwrapped
    def __init__(self, ptr, M, N, stride, BM, BN, layout=None, pair_layout=None):  # as mainloop.tile_desc (+ layouts)
        self.ptr, self.BM, self.BN, self.layout = ptr, tl.constexpr(BM), tl.constexpr(BN), tl.constexpr(layout)
        self.pair_layout = tl.constexpr(pair_layout)
        self.M, self.N, self.stride = (v if isinstance(v, tl.tensor) else tl.constexpr(v) for v in (M, N, stride))

    @triton.jit
    def load(self, offsets):
        """The (BM, BN) block at ``offsets`` (row, column), in ``layout`` in a Gluon kernel that gives one."""
        return laid_out(load_block(self.ptr, self.stride, offsets[0], offsets[1], self.M, self.N, self.BM, self.BN),
                        self.layout)

    @triton.jit
    def load_pairs(self, offsets):
        """The block's (even, odd) columns at ``offsets`` (row, pair column) as fp32 tiles, from its 16-bit values
        read as 32-bit words (:func:`load_words`) in ``pair_layout``."""
        words = load_words(self.ptr, self.stride, offsets[0], offsets[1], self.M, self.N, self.BM, self.BN)
        return unpack_pairs(laid_out(words, self.pair_layout), self.ptr.dtype.element_ty)


@tl.core._aggregate
class Held:
    """A block already loaded, which :func:`load_tile` reads again without a load: what a tile hook that needed a
    Tile input's whole block (a split kernel's whole rows) hands its epilogue in that input's place."""

    tile: tl.tensor

    @triton.constexpr_function
    def __init__(self, tile):
        self.tile = tile

    @triton.jit
    def load(self, offsets):
        return self.tile


if INTERPRET:  # the interpreter's jit functions are plain callables, which an aggregate does not take as methods
    class Block:  # noqa: F811
        def __init__(self, ptr, M, N, stride, BM, BN, layout=None, pair_layout=None):
            self.ptr, self.M, self.N, self.stride, self.BM, self.BN = ptr, M, N, stride, BM, BN

        def load(self, offsets):
            return load_block(self.ptr, self.stride, offsets[0], offsets[1], self.M, self.N, self.BM, self.BN)

        def load_pairs(self, offsets):
            words = load_words(self.ptr, self.stride, offsets[0], offsets[1], self.M, self.N, self.BM, self.BN)
            return unpack_pairs(words, self.ptr.dtype.element_ty)

    class Held:  # noqa: F811
        def __init__(self, tile):
            self.tile = tile

        def load(self, offsets):
            return self.tile


@triton.jit
def cast(x, dtype: tl.constexpr):
    """x converted to ``dtype``, rounding to nearest-even (under the interpreter too)."""
    if EMULATE_CASTS:
        x = round_like_gpu(x.to(tl.float32), dtype)
    return x.to(dtype)


@triton.jit
def round_like_gpu(x, dtype: tl.constexpr):
    """fp32 x rounded to nearest-even onto the grid of bf16 / fp8 ``dtype`` (other dtypes: x), in fp32.

    The interpreter converts fp32 to those formats inexactly (truncating); rounding first makes its casts
    exact, as the GPU's are. Not used on the GPU.
    """
    if dtype == tl.bfloat16:
        x = round_to_grid(x, 7, -126)
    elif dtype == tl.float8e4nv:
        x = round_to_grid(x, 3, -6)
    elif dtype == tl.float8e5:
        x = round_to_grid(x, 2, -14)
    return x


@triton.jit
def round_to_grid(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """x rounded to nearest-even on the grid of a format with MANT mantissa bits and smallest normal exponent
    EMIN (fp32 arithmetic: scaling by the unit in the last place is exact)."""
    bits = x.to(tl.int32, bitcast=True)
    ulp = ((tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN) - MANT + 127) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(x) / ulp + 12582912.0) - 12582912.0) * ulp  # 1.5 * 2^23: rounds to an integer, ties to even
    # |r|: where the grid's ulp is below fp32's normal range (bf16 under 2^-119, zero included) the bits above are not
    # the ulp but a negative number; those values round to zero, and zero must keep x's sign (0 -> +0, not -0)
    return tl.where(x < 0, -tl.abs(r), tl.abs(r))  # keeps the sign of values that round to zero


# ---- 4. block reductions ----------------------------------------------------------------------

@triton.jit
def store_row_partial(part_ptr, val, off_m, off_n, M, stride_p, BM: tl.constexpr, BN: tl.constexpr):
    """``part[off_m + i, off_n // BN] = val[i]``: one (row, N-tile) partial; ``part`` has row stride ``stride_p``."""
    rows = off_m + arange(0, BM)
    tl.store(part_ptr + rows.to(tl.int64) * stride_p + off_n // BN, val, mask=rows < M)


@triton.jit
def row_sumsq(x):
    """``sum_j x_ij^2`` per row (RMSNorm's statistics)."""
    return tl.sum(x * x, axis=1)


@triton.jit
def row_dot(a, b):
    """``sum_j a_ij b_ij`` per row (ZdZ)."""
    return tl.sum(a * b, axis=1)


@triton.jit
def row_absmax(x):
    """``max_j |x_ij|`` per row, in fp32 (the amax of an fp8 scale)."""
    return tl.max(tl.abs(x.to(tl.float32)), axis=1)


@triton.jit
def col_sum_partial(part_ptr, x, off_m, off_n, N, stride_p, BM: tl.constexpr, BN: tl.constexpr):
    """Column partials ``part[off_m // BM, n] = sum_{i in tile} x_in`` (e.g. dgamma); row stride ``stride_p``."""
    cols = off_n + arange(0, BN)
    tl.store(part_ptr + (off_m // BM).to(tl.int64) * stride_p + cols, tl.sum(x, axis=0), mask=cols < N)


@triton.jit
def store_col_partial(part_ptr, sums, row, off_n, N, stride_p, BN: tl.constexpr):
    """``part[row, off_n + j] = sums[j]``: one row of column partials already summed (over a program's tiles)."""
    cols = off_n + arange(0, BN)
    tl.store(part_ptr + row.to(tl.int64) * stride_p + cols, sums, mask=cols < N)


# ---- 5. stateful and pairwise transforms ------------------------------------------------------

@triton.jit
def tile_lse(logits, off_n, N, BN: tl.constexpr):
    """Per-row log-sum-exp over the tile's columns < N: ``max_j l_j + log sum_j exp(l_j - max_j l_j)``."""
    cols = off_n + arange(0, BN)
    masked = tl.where((cols < N)[None, :], logits, float("-inf"))
    row_max = tl.max(masked, axis=1)
    return row_max + tl.log(tl.sum(tl.exp(masked - row_max[:, None]), axis=1))


@triton.jit
def gather_cols(x, idx, off_n, BN: tl.constexpr):
    """``(x[i, idx_i - off_n], hit_i)``: per row, the element in column ``idx_i`` if this tile holds it.

    ``hit_i`` is whether the tile holds column ``idx_i``; the value is 0 where it does not.
    """
    cols = off_n + arange(0, BN)
    val = tl.sum(tl.where(cols[None, :] == idx[:, None], x, 0.0), axis=1)
    return val, (idx >= off_n) & (idx < off_n + BN)


@triton.jit
def split_pairs(x, BM: tl.constexpr, BN: tl.constexpr):
    """``(x[:, 0::2], x[:, 1::2])``: the even and odd columns of a (BM, BN) tile, each (BM, BN // 2)."""
    return x.reshape(BM, BN // 2, 2).split()


@triton.jit
def unpack_pairs(w, DTYPE: tl.constexpr):
    """The fp32 (low, high) halves of 32-bit words ``w`` holding pairs of 16-bit DTYPE (bf16 or fp16) values."""
    if DTYPE == tl.bfloat16:
        even = (w << 16).to(tl.float32, bitcast=True)
        odd = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        even = (w & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
        odd = (w >> 16).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def load_pairs(src, off_m, off_n, BM: tl.constexpr, BN: tl.constexpr):
    """``split_pairs`` of the (BM, 2 BN) tile at (off_m, 2 off_n) of a Tile input twice as wide as the accumulator:
    its even and odd columns as fp32 (BM, BN) tiles. A pointer block of 16-bit values reads them as 32-bit words."""
    if reads_words(src):
        even, odd = src.load_pairs([off_m, off_n])
    else:
        even, odd = split_pairs(load_tile(src, off_m, 2 * off_n), BM, 2 * BN)
    return even, odd


@triton.jit
def join_pairs(even, odd, BM: tl.constexpr, BN: tl.constexpr):
    """Inverse of :func:`split_pairs`: the (BM, BN) tile with ``even`` in columns 2i and ``odd`` in 2i+1."""
    return tl.join(even, odd).reshape(BM, BN)


@triton.jit
def silu_mul_pairs(z, BM: tl.constexpr, BN: tl.constexpr):
    """SwiGLU on interleaved (gate, up) columns: ``y[:, i] = silu(z[:, 2i]) z[:, 2i+1]``, shape (BM, BN // 2)."""
    gate, up = split_pairs(z, BM, BN)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def rotate_pairs(z, cos, sin, BM: tl.constexpr, BN: tl.constexpr):
    """Rotate adjacent pairs ``(x, y) = (z[:, 2i], z[:, 2i+1]) -> (x cos_i - y sin_i, y cos_i + x sin_i)``.

    ``cos``/``sin`` are (BM, BN // 2), one angle per pair; ``sin = -sin`` gives the inverse rotation.
    """
    x, y = split_pairs(z, BM, BN)
    return join_pairs(x * cos - y * sin, y * cos + x * sin, BM, BN)


@triton.jit
def rope_cos_sin(pos_ptr, freq_ptr, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """cos and sin, each (BM, BN // 2), of the angles ``pos[m] * f[p]`` of the tile's rows and column pairs.

    ``freq_ptr`` points at the fp32 table [2, N // 2] of :func:`kernels.coda.rope.rope_freq_table`:
    ``f = hi + lo`` with 8 significant bits in ``hi``, so ``pos * hi`` is exact for positions < 2^16;
    the angle is reduced to [-pi, pi] (Cody-Waite, 2 pi in three parts) before cos/sin. Its error is about
    ``1e-7 + pos * f * 2^-31`` radians, against ``pos * f * 2^-24`` for a plain fp32 product; cos/sin add
    < 1e-6 (:func:`cos_sin_reduced`).
    """
    P = N // 2
    pairs = off_n // 2 + arange(0, BN // 2)
    f_hi = tl.load(freq_ptr + pairs, mask=pairs < P, other=0.0)
    f_lo = tl.load(freq_ptr + P + pairs, mask=pairs < P, other=0.0)
    rows = off_m + arange(0, BM)
    pos = tl.load(pos_ptr + rows, mask=rows < M, other=0).to(tl.float32)[:, None]
    a_hi = pos * f_hi[None, :]
    a_lo = pos * f_lo[None, :]
    k = tl.floor((a_hi + a_lo) * INV_TWO_PI + 0.5)
    r = (a_hi - k * TWO_PI_A) - k * TWO_PI_B - k * TWO_PI_C + a_lo
    return cos_sin_reduced(r)


@triton.jit
def cos_sin_reduced(r):
    """``(cos r, sin r)`` for r in [-pi, pi]: ``cos.approx``/``sin.approx`` on the GPU (abs. error < 2^-20.5
    there), exact math under the interpreter."""
    if FAST_TRIG:
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)
    else:
        c = tl.cos(r)
        s = tl.sin(r)
    return c, s


@triton.jit
def split_cols(x, BM: tl.constexpr, BN: tl.constexpr):
    """``(x[:, :BN // 2], x[:, BN // 2:])``: the left and right column halves of a (BM, BN) tile.

    Epilogue sub-tiles: a kernel that loads/stores several extra tiles works on BN / 2 (or BN / 4) columns
    at a time to keep registers and TMA staging buffers small (``EPI_SUB`` of
    :func:`kernels.coda.mainloop.subtiled_configs`).
    """
    return x.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()


@triton.jit
def col_subtile(x, I: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Sub-tile I of S (S in 1, 2, 4): columns [I BN / S, (I + 1) BN / S) of the (BM, BN) tile x.

    An epilogue loops over them with ``for i in tl.static_range(S)``, at column offset ``off_n + i * BN // S``.
    """
    if S == 1:
        sub = x
    else:
        left, right = split_cols(x, BM, BN)
        half = right if I >= S // 2 else left
        if S == 2:
            sub = half
        else:
            quarter_l, quarter_r = split_cols(half, BM, BN // 2)
            sub = quarter_r if I % 2 == 1 else quarter_l
    return sub


# ---- backward primitives ----------------------------------------------------------------------

@triton.jit
def rmsnorm_dx(gy, xhat, rstd, gamma, c):
    """RMSNorm backward of ``y = gamma * xhat``, ``xhat = x * rstd``: ``dx = rstd (gy gamma - xhat c)``.

    ``gy`` is dL/dy, ``rstd`` and ``c = (1/d) sum_j gy_j gamma_j xhat_j`` are per row (BM,), ``gamma`` per
    column (BN,); by the ZdZ identity ``c = <z, dz> / d`` for ``z = y W^T``, so it is known before the tile.
    """
    return rstd[:, None] * (gy * gamma[None, :] - xhat * c[:, None])


@triton.jit
def silu_mul_pairs_bwd(dy, gate, up):
    """SwiGLU backward of ``y = silu(gate) up``: ``(dgate, dup, y)`` with, for ``s = sigmoid(gate)``,

    ``dgate = dy up s (1 + gate (1 - s))`` (silu'(g) = s (1 + g (1 - s))) and ``dup = dy silu(gate)``;
    ``y`` is the recomputed activation. All operands have the same shape (the pair halves of a tile).
    """
    s = tl.sigmoid(gate)
    silu = gate * s
    return dy * up * s * (1.0 + gate * (1.0 - s)), dy * silu, silu * up
