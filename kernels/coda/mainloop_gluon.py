"""The warp-specialized Gluon GEMM for Hopper (sm_90) whose epilogue runs in a warp partition of its own, beside the
next tile's mainloop: the schedule of the Gluon variants built from the declared kernels
(:mod:`kernels.coda.gluon_program`) and of an experiment (benchmarks/gluon_epilogue_dgrad_rmsnorm.py). For ``C[M, N] = A @ B``, one persistent
program per SM, three partitions:

- **loader** (1 warp): the operand ring's TMA loads, tile after tile;
- **mma** (4 warps, one warpgroup): each (BM, BN) tile's wgmmas into an fp32 accumulator in its registers, then the
  accumulator into a shared-memory buffer ``acc_buf`` (``acc_ready``), and on to the next tile's mainloop;
- **epilogue** (8 warps, the kernel's own): reads ``acc_buf`` in row sub-tiles, does the kernel's math, then gives
  the buffer back (``acc_empty``).

A kernel is its epilogue partition plus ten lines (``ws_buffers``, ``gl.warp_specialize`` over the epilogue,
:func:`mma` and :func:`loader`); :class:`WsGemm` launches it. The operands are bf16 (B row-major (K, N)) or fp8 with
per-tensor scales (B staged K-major, (N, K), which fp8 wgmma needs), dequantized by the epilogue as ``acc sa sb``.
Gluon has no interpreter: each kernel's fused Triton twin is its CPU-tested reference, and the Hopper tests check the
two against each other on an H100 or H200.
"""
from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from kernels.coda.align import aligned
from kernels.coda.epilogue import SCALING_NONE, SCALING_ROWWISE
from kernels.coda.fp8 import dequant_args, result_dtype
from kernels.coda.mainloop import operand, persistent_grid
from workloads.fp8 import Fp8

# Triton 3.6's names; later versions renamed them (async_load, async_store, barrier).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BM, BN, GROUP_M = 128, 128, 8
K_BYTES = 128
"""Bytes of K per operand tile row (BK = 64 bf16 or 128 fp8 elements): one 128-byte swizzle line, 32 KB a stage."""
MMA_WARPS, EPI_WARPS = 4, 8
MMA_REGS = gl.constexpr(232)
"""Registers per thread: mma 128 x 232 (its accumulator takes 128), loader 128 x 40, epilogue 256 x 120: the
kernel's maxnreg 128 x 512 threads, the SM's 64K."""
MAXNREG = 128
LOADER_REGS = gl.constexpr(40)
"""Registers per thread of the loader partition (one warp, TMA issue only)."""


def stages(k_bytes: int) -> int:
    """Operand ring stages for a K of ``k_bytes`` bytes a row: 5 (229 KB of shared memory with the 64 KB accumulator
    buffer) at k_bytes <= 4096, where a tile's mainloop is short; 4 elsewhere. Measured with the SwiGLU dgrad on an
    H100 at M = 16384 (docs/performance.md; ms for 5 against 4 stages): bf16 1B (4096 bytes) 1.076 against 1.148, 7B (8192)
    2.749 against 2.557, 70B 14.05 against 13.57; fp8 7B (4096) 1.514 against 1.595, 70B (8192) 7.57 against 7.14,
    1B a tie."""
    return 5 if k_bytes <= 4096 else 4


@gluon.jit
def local_tiles(n_m, n_n):
    """How many of the n_m x n_n tiles this program takes (tiles pid, pid + #programs, ...)."""
    return gl.cdiv(n_m * n_n - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def tile_coords(i, n_m, n_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of this program's i-th tile: groups of GROUP_M row-tiles sweep N together (as
    kernels.coda.mainloop). The loader and the consumer walk the same sequence."""
    t = gl.program_id(0) + i * gl.num_programs(0)
    first_m = (t // (GROUP_M * n_n)) * GROUP_M
    group_m = min(n_m - first_m, GROUP_M)
    return first_m + t % group_m, (t % (GROUP_M * n_n)) // group_m


@gluon.jit
def ring_barriers(S: gl.constexpr):
    """``(ready, empty)``: the mbarriers of an S-stage operand ring (a slot's operands landed; a slot free again), each
    initialised for one arrival."""
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return ready, empty


@gluon.jit
def handoff_barriers():
    """``(full, free)``: the pair of mbarriers by which one partition hands a shared-memory buffer to another and gets
    it back, each initialised for one arrival."""
    full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(full, count=1)
    mbarrier.init(free, count=1)
    return full, free


@gluon.jit
def loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, B_NK: gl.constexpr, GROUP_M: gl.constexpr,
           c_desc=None, c_buf=None, c_ready=None, c_empty=None, C_AT: gl.constexpr = -1):
    """The operand ring's TMA loads, tile after tile; with C_AT >= 0 also each tile's (BM, BN) block of ``c_desc``
    (the producer's residual) into ``c_buf`` after the tile's k-step C_AT, once the consumer has freed it
    (``c_empty``; ``c_ready`` when it landed)."""
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
            if C_AT >= 0 and kk == min(C_AT, k_tiles - 1):
                mbarrier.wait(c_empty, (i & 1) ^ 1)
                mbarrier.expect(c_ready, c_desc.block_type.nbytes)
                tma_load(c_desc, [pid_m * TM, pid_n * TN], c_ready, c_buf)


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
        mbarrier.wait(acc_empty, (i & 1) ^ 1)  # the epilogue is done with the previous tile's accumulator
        acc_buf.store(acc)
        thread_barrier()
        mbarrier.arrive(acc_ready)


@gluon.jit
def ws_buffers(a_desc, b_desc, S: gl.constexpr, B_NK: gl.constexpr):
    """The shared memory of the schedule, its barriers initialised: ``(a_bufs, b_bufs, ready, empty, acc_buf,
    acc_ready, acc_empty)``, an S-stage operand ring and one (BM, BN) fp32 accumulator buffer."""
    TM: gl.constexpr = a_desc.block_type.shape[0]
    TN: gl.constexpr = b_desc.block_type.shape[0] if B_NK else b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [S] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [S] + b_desc.block_type.shape, b_desc.layout)
    acc_buf = gl.allocate_shared_memory(gl.float32, [TM, TN],
                                        gl.NVMMASharedLayout.get_default_for([TM, TN], gl.float32))
    ready, empty = ring_barriers(S)
    acc_ready, acc_empty = handoff_barriers()
    return a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty


class WsGemm:
    """``C[M, N] = A @ B`` set up for a kernel of this schedule, the counterpart of :class:`kernels.coda.launch.
    FusedGemm`: ``a`` (M, K) row-major and ``b`` (K, N) row-major or the transposed view of an (N, K) tensor, bf16 or
    fp16, or fp8 (:class:`workloads.fp8.Fp8`) with per-tensor scales, b's data the transposed view of its K-major
    (N, K) copy (``rowwise``: or rowwise ones, for a kernel whose epilogue dequantizes them); ``what`` names the
    kernel in the errors. The launch's ``SCALED`` is the scaling mode (:data:`kernels.coda.epilogue.SCALING_NONE`,
    0, for plain operands). ``M``, ``N``, ``device`` and ``out_dtype`` (the operands'
    dtype, bf16 for fp8) size the epilogue's outputs."""

    def __init__(self, a: torch.Tensor | Fp8, b: torch.Tensor | Fp8, what: str, rowwise: bool = False) -> None:
        a, b, self.sa, self.sb, self.scaling = dequant_args(a, b)  # sa, sb: placeholders for plain operands
        if self.scaling == SCALING_ROWWISE.value and not rowwise:
            raise ValueError(f"the Gluon {what} takes fp8 operands with per-tensor scales, not rowwise ones")
        self.scaled = self.scaling != SCALING_NONE.value
        b, self.b_nk = operand(b)  # b = W.T: B staged (N, K), K-major, as fp8 wgmma needs
        if self.scaled and not self.b_nk:
            raise ValueError(f"the Gluon {what} takes fp8 b as the transposed view of a K-major (N, K) tensor")
        self.a, self.b = aligned(a), aligned(b)
        self.M, self.K = self.a.shape
        self.N = self.b.shape[0] if self.b_nk else self.b.shape[1]
        self.device = self.a.device
        self.out_dtype = result_dtype(a)

    def empty(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised (M, N) output in ``dtype`` (default: :attr:`out_dtype`)."""
        return torch.empty(self.M, self.N, device=self.device, dtype=dtype or self.out_dtype)

    def launch(self, kernel: Any, *epilogue: Any, n_stages: int | None = None, **constexprs: Any) -> None:
        """Launch ``kernel(a_desc, b_desc, sa_ptr, sb_ptr, M, N, K, *epilogue, B_NK, SCALED, INSTR_K, S, GROUP_M,
        MMA_W, **constexprs)`` on the persistent grid with the schedule's warps and registers; ``n_stages`` (default
        :func:`stages` of K's bytes) for benchmarks."""
        bk = K_BYTES // self.a.element_size()
        grid = persistent_grid(self.M, self.N, self.device)({"BM": BM, "BN": BN})
        kernel[grid](tma_desc(self.a, [BM, bk]), tma_desc(self.b, [BN, bk] if self.b_nk else [bk, BN]), self.sa,
                     self.sb, self.M, self.N, self.K, *epilogue, B_NK=self.b_nk, SCALED=self.scaling,
                     INSTR_K=32 // self.a.element_size(), S=n_stages or stages(self.K * self.a.element_size()),
                     GROUP_M=GROUP_M, MMA_W=MMA_WARPS, num_warps=EPI_WARPS, maxnreg=MAXNREG, **constexprs)


GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.int32: gl.int32,
             torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}
"""Gluon's dtype of each tensor dtype a TMA descriptor here takes (int32: packed bf16 pairs, in experiments; fp8: the
SwiGLU dgrad's operands)."""


def tma_desc(t: torch.Tensor, block: list[int]):
    """A host TMA descriptor of ``t`` in ``block`` tiles, with the default NVMMA shared layout for that tile."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[t.dtype]))
