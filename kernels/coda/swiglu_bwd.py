"""SwiGLU backward: fused into the down-proj dgrad GEMM, or elementwise (coda-spec, backward rewrites).

The forward kept the interleaved pre-activation ``z_pre`` [M, 2f] (column 2i = gate_i, 2i+1 = up_i) and
computed ``y_i = silu(gate_i) up_i``, ``x = ... + y @ Wd^T``. Given the gradient ``dy`` of y::

    dgate = dy up silu'(gate),   dup = dy silu(gate)        (written interleaved, like z_pre)
    zdz_m = sum_i gate_mi dgate_mi + up_mi dup_mi           (= <z, dz>, the ZdZ the RMSNorm backward needs)

:func:`dgrad_swiglu` gets ``dy = dx @ Wd`` from its own GEMM (the down-proj dgrad) and also writes the
recomputed activation ``y`` for the weight gradient ``dWd = dx^T y``; zdz comes from per-N-tile row
partials and :func:`kernels.coda.reduce.finish_row_sum`. It is declared as its epilogue
(:mod:`kernels.coda.program`: z_pre and dz_pre twice as wide as the GEMM's tile, the row sums returned after the
outputs), which runs on EPI_SUB column sub-tiles (autotuned: 2 or 4), each reading a [BM, 2 * BN / EPI_SUB] tile
of z_pre (:func:`kernels.coda.epilogue.load_pairs`: the split kernel and the Gluon variant, reading bf16 or fp16
z_pre by pointers, take each (gate, up) pair as one 32-bit word). Its split path is the built one (the plain GEMM,
then the epilogue over dy in 2 x 1024 blocks, y over dy), its Gluon path on Hopper the built one too (the epilogue in
a warp partition of its own, beside the next tile's mainloop: :mod:`kernels.coda.gluon_program`), each chosen per
shape. :func:`swiglu_bwd` is the elementwise kernel for a given dy (one pass over dy in wide, short blocks; zdz from
their row partials), the same math (:func:`swiglu_bwd_tile`).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels.coda.align import aligned, empty_rows
from kernels.coda.epilogue import join_pairs, like, load_block, load_pairs, silu_mul_pairs_bwd, split_pairs, \
    store_block, store_row_partial
from kernels.coda.host import cdiv
from kernels.coda.mainloop import INTERPRET, subtiled_configs
from kernels.coda.program import Binding, Gemm, Output, Partials, Tile, coda
from kernels.coda.reduce import finish_row_sum
from workloads.fp8 import Fp8, Recipe, dgrad_weight


@triton.jit
def swiglu_bwd_tile(dy, gate, up, BM: tl.constexpr, BN: tl.constexpr):
    """The SwiGLU backward of a (BM, BN) tile dy, given the (BM, BN) gate and up tiles of the pre-activation: the
    interleaved ``(dgate, dup)`` tile, y, and the tile's row sums of ``gate dgate + up dup``."""
    gate, up = like(gate, dy), like(up, dy)
    dgate, dup, y = silu_mul_pairs_bwd(dy, gate, up)
    return join_pairs(dgate, dup, BM, 2 * BN), y, tl.sum(gate * dgate + up * dup, axis=1)


@triton.jit
def swiglu_dgrad(dy, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """The fused kernel's epilogue: :func:`swiglu_bwd_tile` of dy with the tile of z_pre (descriptor ``args[0]``,
    [BM, 2 BN] at column 2 off_n): (y, dz_pre) and the rows' sums of ``gate dgate + up dup``."""
    gate, up = load_pairs(args[0], off_m, off_n, BM, BN)
    dz, y, zdz = swiglu_bwd_tile(dy, gate, up, BM, BN)
    return y, dz, zdz


def _check_preact(z_pre: torch.Tensor, M: int, f: int) -> None:
    if z_pre.shape != (M, 2 * f):
        raise ValueError(f"z_pre must be the interleaved [M, 2f] = [{M}, {2 * f}] pre-activation, "
                         f"got {tuple(z_pre.shape)}")


@triton.jit
def swiglu_bwd_kernel(dy_ptr, zp_ptr, dzp_ptr, part_ptr, M, N, stride_dy, stride_zp, stride_dzp, stride_p,
                      BM: tl.constexpr, BN: tl.constexpr):
    """One (BM, BN) block of dy per program (grid: row blocks x column blocks): :func:`swiglu_bwd_tile`, read and
    written with pointer accesses (a bandwidth-bound pass: no descriptors, no loop): interleaved (dgate, dup) and
    the block's row partials of ``gate dgate + up dup`` into ``part[:, column block]``."""
    off_m, off_n = tl.program_id(0) * BM, tl.program_id(1) * BN
    gate, up = split_pairs(load_block(zp_ptr, stride_zp, off_m, 2 * off_n, M, 2 * N, BM, 2 * BN), BM, 2 * BN)
    dz, y, part = swiglu_bwd_tile(load_block(dy_ptr, stride_dy, off_m, off_n, M, N, BM, BN), gate, up, BM, BN)
    store_block(dzp_ptr, stride_dzp, off_m, 2 * off_n, M, 2 * N, dz, BM, 2 * BN)
    store_row_partial(part_ptr, part, off_m, off_n, M, stride_p, BM, BN)


ROW_BLOCK = (2, 1024, 4)
"""(BM, BN, num_warps) of the SwiGLU backward's blocks on the GPU (:func:`swiglu_bwd_kernel`, and the split kernel of
:func:`dgrad_swiglu`). Measured on an H200 (M = 16384, f = 8192 / 11008 / 28672): 0.437 / 0.594 / 1.509 ms, ~3.7 TB/s,
where a loop over 8 x 512 blocks of 8 rows per program took 0.580 / 0.792 / 2.019 ms; taller blocks (16 x 256,
32 x 256) were slower still. The split path of dgrad_swiglu (GEMM included, ms; 16 x 256 / 2 x 1024 blocks): 1.39 /
1.24 at 1B, 2.95 / 2.77 at 7B, 13.23 / 12.86 at 70B."""


def swiglu_bwd(dy: torch.Tensor, z_pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dz_pre, zdz)``: SwiGLU backward for a given dy [M, f]; z_pre [M, 2f] interleaved (gate, up).

    dz_pre [M, 2f] (interleaved dgate/dup) is in z_pre's dtype, zdz fp32 [M]. One pass over dy
    (:func:`swiglu_bwd_kernel`), then the row sum of its partials.
    """
    M, N = dy.shape
    _check_preact(z_pre, M, N)
    dy, z_pre = aligned(dy), aligned(z_pre)
    dz_pre = empty_rows(*z_pre.shape, z_pre.dtype, z_pre.device)
    bm, bn, warps = (16, 32, 4) if INTERPRET else ROW_BLOCK
    n_tiles = cdiv(N, bn)
    part = torch.empty(M, n_tiles, device=dy.device, dtype=torch.float32)
    swiglu_bwd_kernel[(cdiv(M, bm), n_tiles)](dy, z_pre, dz_pre, part, M, N, dy.stride(0), z_pre.stride(0),
                                               dz_pre.stride(0), part.stride(0), BM=bm, BN=bn,
                                               num_warps=warps)
    return dz_pre, finish_row_sum(part, n_tiles)


def _kept_preact(arguments: dict) -> dict:
    """A call's arguments for measuring it repeatedly: dz_pre into a new buffer instead of over z_pre."""
    return {**arguments, "overwrite": False}


def _finish(arguments: dict, gemm: Gemm, outputs: list, partials: Partials) -> tuple:
    y, dz_pre = outputs
    return dz_pre, y, finish_row_sum(partials.ss, partials.n_tiles)


@coda(swiglu_dgrad, outputs=(Output("y", like="z_pre"), Output("dzp", wide=2, like="z_pre")), inputs=(Tile("zp", 2),),
      row_sum=True, configs=subtiled_configs(), restore=("dzp",), finish=_finish, split_block=ROW_BLOCK[:2],
      safe=_kept_preact,
      binds=(Binding(("swiglu_dgrad",), ("dz_pre", "a", "zdz"), "down-proj dgrad GEMM + SwiGLU backward + ZdZ partials",
                     lambda n: {"w_down": dgrad_weight(n["w_down"])}),))
def dgrad_swiglu(dx: torch.Tensor | Fp8, w_down: torch.Tensor | Fp8, z_pre: torch.Tensor,
                 recipe: Recipe | None = None, overwrite: bool = False) -> Gemm:
    """``(dz_pre, y, zdz)``: SwiGLU backward of ``dy = dx @ w_down`` fused into that dgrad GEMM.

    dx [M, d] is the gradient of the down-proj output, w_down [d, f] (nn.Linear layout), z_pre [M, 2f] the
    saved interleaved pre-activation. dz_pre [M, 2f] (interleaved dgate/dup) and y = silu(gate) up [M, f]
    are in z_pre's dtype; zdz is fp32 [M]. fp8 dx (e5m2) and w_down (its data a transposed view of the K-major
    (f, d) copy) with per-tensor scales are dequantized in the epilogue (``recipe``: their fp8 recipe, whose
    accumulation mode the launch reads). ``overwrite``: dz_pre is written over z_pre (each tile after its own z_pre
    was read; the autotuner restores it between its runs), for a caller that does not read z_pre again.
    """
    gemm = Gemm(dx, w_down, recipe)
    _check_preact(z_pre, *gemm.shape)
    z_pre = aligned(z_pre)
    return replace(gemm, inputs=(z_pre,), outputs={"dzp": z_pre} if overwrite else {})
