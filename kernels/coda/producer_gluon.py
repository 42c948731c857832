"""The producer GEMM as a warp-specialized Gluon kernel for Hopper (sm_90): the Gluon path of
:func:`kernels.coda.producer.gemm_residual_norm` (:mod:`kernels.coda.strategy`). The math is the fused kernel's,

    x = residual + a @ w^T,   h = bf16(x) * gamma,   ss[m, tile_n] = sum_{j in tile_n} x_mj^2   (rstd from ss),

except that h is computed from the rounded x (one more rounding of h than the Triton kernel's bf16(x_fp32 * gamma):
the fp32 form keeps x, gamma and h live together and spills at the 240 registers a consumer thread gets).
The schedule is one the Triton language cannot express (docs/performance.md):
- a 1-warp loader partition issues every TMA load: the operand ring (S stages) and, during the tile's mainloop,
  the tile's residual into a shared-memory buffer `io`, so the epilogue never waits on global memory;
- the 8-warp consumer partition (two warpgroups, one (BM, BN) fp32 accumulator) issues the wgmmas, releasing
  each operand slot through an mbarrier, then runs the epilogue from `io`: x is written back into `io` and
  sent by TMA, then h, once x has left it.
``H_FROM_X16=False`` (h from the fp32 x) and ``PRODUCER=False`` (the plain GEMM ``C = a @ w^T`` through the same
mainloop) are the variants benchmarks/gluon_ws_producer.py times. Gluon has no interpreter: the fused Triton kernel
is this kernel's CPU-tested reference, and tests/test_gpu.py checks the two against each other on an H100 or H200.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels.coda.align import aligned
from kernels.coda.host import cdiv
from kernels.coda.mainloop import persistent_grid
from kernels.coda.mainloop_gluon import (LOADER_REGS, handoff_barriers, loader, local_tiles, ring_barriers,
                                         thread_barrier, tile_coords, tma_desc, tma_store)
from kernels.coda.reduce import finish_rstd
from workloads.fp8 import Recipe

BM, BN, BK, STAGES, GROUP_M, WARPS = 128, 256, 64, 3, 8, 8
MAXNREG = 168
"""Registers: 12 warps (8 consumers + the loader's warpgroup) x 32 threads x 168 = the SM's 64K; the consumers
take what the loader (40) leaves, 240 each."""
RES_AT = gl.constexpr(2)
"""k-step of a tile after which the loader fetches its residual (the consumer frees `io` at k-step 1)."""


@gluon.jit
def send(io, value, desc, off_m, off_n):
    """Write ``value`` into the staging buffer ``io`` and TMA-store it at (off_m, off_n)."""
    thread_barrier()
    io.store(value)
    fence_async_shared()
    tma_store(desc, [off_m, off_n], io)


@gluon.jit
def consumer(x_desc, h_desc, a_bufs, b_bufs, io, ready, empty, io_ready, io_empty, gamma_ptr, ss_ptr, M, N, K,
             stride_ss, PRODUCER: gl.constexpr, H_FROM_X16: gl.constexpr, GROUP_M: gl.constexpr,
             num_warps: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    TM: gl.constexpr = a_bufs.type.shape[1]
    TN: gl.constexpr = b_bufs.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, TN, 16])
    n_m = gl.cdiv(M, TM)
    n_n = gl.cdiv(N, TN)
    k_tiles = gl.cdiv(K, a_bufs.type.shape[2])
    c = 0
    acc = gl.zeros((TM, TN), dtype=gl.float32, layout=acc_layout)
    for i in range(local_tiles(n_m, n_n)):
        pid_m, pid_n = tile_coords(i, n_m, n_n, GROUP_M)
        off_m = pid_m * TM
        off_n = pid_n * TN
        for kk in range(k_tiles):
            slot = c % S
            mbarrier.wait(ready.index(slot), (c // S) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, use_acc=kk > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            thread_barrier()  # both warpgroups are done with the previous slot
            mbarrier.arrive(empty.index((c + S - 1) % S), pred=kk > 0)
            c += 1
            if PRODUCER and kk == min(1, k_tiles - 1):
                tma.store_wait(0)  # the previous tile's h has left io: the loader may refill it
                mbarrier.arrive(io_empty, pred=i > 0)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        thread_barrier()
        mbarrier.arrive(empty.index((c + S - 1) % S))
        if PRODUCER:
            cols = off_n + gl.arange(0, TN, layout=gl.SliceLayout(0, acc_layout))
            rows = off_m + gl.arange(0, TM, layout=gl.SliceLayout(1, acc_layout))
            mbarrier.wait(io_ready, i & 1)
            x = acc + io.load(acc_layout).to(gl.float32)
            gl.store(ss_ptr + rows * stride_ss + pid_n, gl.sum(x * x, axis=1), mask=rows < M)
            x16 = x.to(io.dtype)
            send(io, x16, x_desc, off_m, off_n)
            if H_FROM_X16:
                h = x16 * gl.load(gamma_ptr + cols, mask=cols < N, other=0.0).to(io.dtype)[None, :]
            else:
                h = (x * gl.load(gamma_ptr + cols, mask=cols < N, other=0.0)[None, :]).to(io.dtype)
            tma.store_wait(0)
            send(io, h, h_desc, off_m, off_n)
        else:
            tma.store_wait(0)
            send(io, acc.to(io.dtype), x_desc, off_m, off_n)
    tma.store_wait(0)


@gluon.jit
def ws_producer_kernel(a_desc, b_desc, res_desc, x_desc, h_desc, gamma_ptr, ss_ptr, M, N, K, stride_ss,
                       PRODUCER: gl.constexpr, H_FROM_X16: gl.constexpr, S: gl.constexpr, GROUP_M: gl.constexpr,
                       num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [S] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [S] + b_desc.block_type.shape, b_desc.layout)
    io = gl.allocate_shared_memory(dtype, x_desc.block_type.shape, x_desc.layout)
    ready, empty = ring_barriers(S)
    io_ready, io_empty = handoff_barriers()
    gl.warp_specialize([
        (consumer, (x_desc, h_desc, a_bufs, b_bufs, io, ready, empty, io_ready, io_empty, gamma_ptr, ss_ptr,
                    M, N, K, stride_ss, PRODUCER, H_FROM_X16, GROUP_M, num_warps)),
        (loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, True, GROUP_M, res_desc, io, io_ready,
                  io_empty, RES_AT if PRODUCER else -1)),
    ], [1], [LOADER_REGS])


def ws_producer(a: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
                gamma: torch.Tensor | None = None, eps: float = 1e-5, h_from_x16: bool = True):
    """``(x, h, rstd)`` for bf16/fp16 a (M, K), w (N, K), residual (M, N) of one dtype, rows of 16-byte multiples;
    without ``residual``, the plain GEMM ``a @ w.T``."""
    a, w = aligned(a), aligned(w)
    M, K = a.shape
    N = w.shape[0]
    producer = residual is not None
    x = torch.empty(M, N, device=a.device, dtype=a.dtype)
    h = torch.empty_like(x) if producer else x
    ss = torch.empty(M, cdiv(N, BN), device=a.device, dtype=torch.float32)
    io = [BM, BN]
    grid = persistent_grid(M, N, a.device)({"BM": BM, "BN": BN})
    # The plain GEMM reads neither residual nor gamma: x and ss stand in for them.
    ws_producer_kernel[grid](tma_desc(a, [BM, BK]), tma_desc(w, [BN, BK]),
                             tma_desc(aligned(residual) if producer else x, io), tma_desc(x, io),
                             tma_desc(h, io),
                             gamma.contiguous() if producer else ss, ss, M, N, K, ss.stride(0), PRODUCER=producer,
                             H_FROM_X16=h_from_x16, S=STAGES, GROUP_M=GROUP_M, num_warps=WARPS, maxnreg=MAXNREG)
    return (x, h, finish_rstd(ss, ss.shape[1], N, eps)) if producer else x


def gemm_residual_norm_gluon(a: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                             eps: float, recipe: Recipe | None = None, h_fp8: Recipe | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kernels.coda.producer.gemm_residual_norm`'s Gluon path: ``(x, h, rstd)``, h = bf16(x) * gamma. Plain
    operands only (:func:`kernels.coda.producer.gluon_applies`): ``recipe`` and ``h_fp8`` are fp8's."""
    if h_fp8 is not None:
        raise ValueError("the Gluon producer takes plain operands, not fp8")
    return ws_producer(a, w, residual, gamma, eps)
