"""The fixed GEMM mainloop every CODA kernel shares.

A CODA kernel is a short Triton program::

    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN)   # fp32 (BM, BN)
        ...epilogue primitives on acc (kernels/coda/epilogue.py)...

It computes ``C[M, N] = A @ B`` with A stored (M, K) (``A_KM=False``) or (K, M), and B stored (N, K)
(``B_KN=False``, the nn.Linear weight layout: C = A W^T) or (K, N). Operands are loaded through
tensor descriptors (TMA on Hopper; out-of-bounds tiles read as zero), tiles are visited by a
persistent grid of one program per SM (:func:`persistent_grid`) in grouped (L2-friendly) order, and
the accumulator is fp32. Tile configs are autotuned per kernel, keyed by (M, N, K) and the argument
dtypes, with the results cached on disk (:mod:`kernels.coda.tuning`). The same code runs under ``TRITON_INTERPRET=1``.

The kernel's parameters start with the mainloop block (:data:`kernels.coda.launch.MAINLOOP_PARAMS`), which
:class:`kernels.coda.launch.FusedGemm` fills when it launches the kernel.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from kernels.coda import tuning
from kernels.coda.host import cdiv, next_power_of_2

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def num_tiles(M, N, BM: tl.constexpr, BN: tl.constexpr):
    return tl.cdiv(M, BM) * tl.cdiv(N, BN)


@triton.jit
def tile_coords(tile_id, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Offsets (off_m, off_n) of tile ``tile_id``: groups of GROUP_M row-tiles sweep N together."""
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    group = tile_id // (GROUP_M * n_n)
    first_m = group * GROUP_M
    group_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group_m)
    pid_n = (tile_id % (GROUP_M * n_n)) // group_m
    return pid_m * BM, pid_n * BN


@triton.jit
def tile_desc(ptr, rows, cols, stride, B0: tl.constexpr, B1: tl.constexpr):
    """Descriptor over a row-major (rows, cols) matrix with row stride ``stride``, blocks (B0, B1)."""
    return tl.make_tensor_descriptor(ptr, [rows, cols], [stride, 1], [B0, B1])


@triton.jit
def operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr):
    if A_KM:
        a_desc = tile_desc(a_ptr, K, M, stride_a, BK, BM)
    else:
        a_desc = tile_desc(a_ptr, M, K, stride_a, BM, BK)
    if B_KN:
        b_desc = tile_desc(b_ptr, K, N, stride_b, BK, BN)
    else:
        b_desc = tile_desc(b_ptr, N, K, stride_b, BN, BK)
    return a_desc, b_desc


@triton.jit
def mainloop(a_desc, b_desc, off_m, off_n, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             A_KM: tl.constexpr, B_KN: tl.constexpr, PROMOTE: tl.constexpr = False):
    """fp32 accumulator of the (BM, BN) tile at (off_m, off_n): ``sum_k A[m, k] B[k, n]``.

    fp8 operands (both K-major: A (M, K), B (N, K)) accumulate in Hopper's reduced-precision adder over all
    of K ("fast"), or with ``PROMOTE`` are added into the fp32 accumulator every BK ("promoted").
    """
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        if A_KM:
            a = a_desc.load([k * BK, off_m]).T
        else:
            a = a_desc.load([off_m, k * BK])
        if B_KN:
            b = b_desc.load([k * BK, off_n])
        else:
            b = b_desc.load([off_n, k * BK]).T
        if PROMOTE:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
        else:
            acc = tl.dot(a, b, acc)
    return acc


# ---------------------------------------------------------------------------------------------
# Host side: configs, autotuning, launch.

def _config(bm, bn, bk, stages, warps, group_m=8) -> triton.Config:
    return triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": group_m}, num_stages=stages, num_warps=warps)


# Measured on H100 + Triton 3.6 (bench_mainloop.py --sweep, tmp sweeps of the fused kernels; docs/performance.md):
# 128x256x64 and 256x128x64 with 8 warps and 3 stages win on every large bf16 shape; 128x128 wins a few small-K
# weight-gradient shapes. BK = 128: the fp8 configs (128-byte K rows, like bf16's BK = 64); too large for bf16's
# shared memory, which _prune drops. 64 x 64: only for small problems (GPU tests), see _prune. Dropped after
# sweeps: 128x256x32 (was for whole-tile epilogues, superseded by sub-tiling), 128x128x128, 128x64, and two
# programs per SM (128x128 tiles, 2-3 stages: 1.10-3.4x the GEMM against 1.01-1.49x for the best config).
# 128x256 with 4 stages exceeds shared memory, 64x256 crashes Triton 3.6's wgmma lowering, warp
# specialization gave wrong results.
GPU_CONFIGS = [_config(128, 256, 64, 3, 8), _config(256, 128, 64, 3, 8), _config(128, 128, 64, 4, 8),
               _config(128, 128, 64, 5, 4), _config(128, 256, 128, 3, 8), _config(256, 128, 128, 3, 8),
               _config(128, 256, 128, 4, 8), _config(64, 64, 64, 3, 4)]
"""The tile configs of :func:`gemm_configs` on a GPU."""


def gemm_configs(min_bn: int = 16) -> list[triton.Config]:
    """The tile configs the autotuner tries; one small config under the interpreter.

    ``min_bn`` lets a kernel whose epilogue needs whole column groups in a tile (a RoPE head) ask for
    BN >= min_bn.
    """
    if INTERPRET:
        return [_config(32, max(32, min_bn), 32, 1, 4, group_m=2)]
    return [c for c in GPU_CONFIGS if c.kwargs["BN"] >= min_bn]


def subtiled_configs(subtiles: Sequence[int] = (2, 4), min_cols: int = 16) -> list[triton.Config]:
    """:func:`gemm_configs` crossed with ``EPI_SUB``, the number of column sub-tiles the epilogue works on.

    An epilogue that loads and stores several extra tiles handles the (BM, BN) tile as EPI_SUB sub-tiles of
    BN / EPI_SUB columns (:func:`kernels.coda.epilogue.col_subtile`): fewer live registers and smaller TMA
    staging buffers, so the large 128x256x64 tile still fits in shared memory (H100, Triton 3.6: the whole-tile
    RMSNorm-backward epilogue needs 280 KB there). Sub-tiles under ``min_cols`` are skipped. The interpreter
    gets the first config only: list a value > 1 first so that CPU tests take the sub-tiled path.
    """
    cfgs = [triton.Config({**c.kwargs, "EPI_SUB": s}, num_stages=c.num_stages, num_warps=c.num_warps)
            for c in gemm_configs() for s in subtiles if c.kwargs["BN"] // s >= min_cols]
    return cfgs[:1] if INTERPRET else cfgs


MAINLOOP_SMEM = 200 * 1024
"""Shared memory the mainloop's operand stages may take (of Hopper's 227 KB), the rest is the epilogue's."""


def _prune(configs, named_args, **kwargs):
    """Drop configs whose operand stages overflow shared memory for the operands' element size, tiles much
    larger than the problem, and the small 64 x 64 tile unless the problem is small too; if nothing is left
    (tiny test shapes), the smallest tile that fits. Those with 128-byte K rows come first."""
    m, n = named_args["M"], named_args["N"]
    elt = next(v for v in named_args.values() if isinstance(v, torch.Tensor)).element_size()

    def fits(c):
        return INTERPRET or c.num_stages * (c.kwargs["BM"] + c.kwargs["BN"]) * c.kwargs["BK"] * elt <= MAINLOOP_SMEM

    def area(c):
        return c.kwargs["BM"] * c.kwargs["BN"]

    keep = [c for c in configs if fits(c) and c.kwargs["BM"] <= max(64, next_power_of_2(m))
            and c.kwargs["BN"] <= max(64, next_power_of_2(n)) and (area(c) > 64 * 64 or min(m, n) < 128)]
    # K rows of 128 bytes first (BK = 64 for 16-bit operands, 128 for fp8): the tuned winner of nearly every shipped
    # key, so a key no table vouches for (a GPU without one) starts from it, not from a 16-bit config in fp8
    keep.sort(key=lambda c: c.kwargs["BK"] * elt != 128)
    return keep or [min((c for c in configs if fits(c)), key=area, default=configs[0])]


def coda_autotune(key: Sequence[str] = ("M", "N", "K"), configs: list[triton.Config] | None = None,
                  restore_value: Sequence[str] = ()) -> Callable:
    """``triton.autotune`` over :func:`gemm_configs`, its winners cached on disk per GPU model and Triton
    version (:mod:`kernels.coda.tuning`).

    ``restore_value`` names outputs a kernel read-modify-writes (so tuning runs don't corrupt them).
    """
    autotune = triton.autotune(configs=configs or gemm_configs(), key=list(key),
                               prune_configs_by={"early_config_prune": _prune}, restore_value=list(restore_value))
    return lambda fn: tuning.attach(autotune(fn), lambda: torch.cuda.get_device_name(torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The device's SM count (4 on the CPU: the interpreter's programs); asked at every launch, so cached."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_grid(M: int, N: int, device: torch.device):
    """Grid of min(#SMs, #tiles) programs for the autotuned tile shape (kernels stride by ``tl.num_programs(0)``)."""
    sms = num_sms(device)
    return lambda meta: (min(sms, cdiv(M, meta["BM"]) * cdiv(N, meta["BN"])),)


def _alloc(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def set_scratch_allocator() -> None:
    """Install the scratch allocator for the descriptors built inside kernels, in the calling thread.

    Triton keeps the allocator in a context variable: threads that did not import this module (autograd's
    backward threads on the GPU) start without one, so backward passes call this first.
    """
    if not INTERPRET and torch.cuda.is_available():
        triton.set_allocator(_alloc)


set_scratch_allocator()


def operand(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 2-D operand as (storage, transposed): a row-major tensor or the .T view of one."""
    if t.stride(-1) == 1:
        return t, False
    if t.stride(0) == 1:
        return t.T, True
    raise ValueError("GEMM operands must be row-major or the transpose of a row-major tensor")
