"""Experiment (lost, not shipped): the SwiGLU backward's dgrad GEMM as a warp-specialized Gluon kernel for Hopper.

    python benchmarks/gluon_ws_dgrad_swiglu.py               # times it at the 1B / 7B / 70B shapes (H100 or H200)
    python benchmarks/gluon_ws_dgrad_swiglu.py --compile-only # no GPU needed: compiles every config for sm_90

Issue 20 item 2 asked for :func:`kernels.coda.swiglu_bwd.dgrad_swiglu` with the schedule of
:mod:`kernels.coda.producer_gluon`. The math is the fused kernel's,

    dy = dx @ w_down,   s = sigmoid(gate),   dgate = dy up s (1 + gate (1 - s)),   dup = dy gate s,
    y = gate s up,      zdz[m, tile_n] = sum_{j in tile_n} gate_mj dgate_mj + up_mj dup_mj,

on the interleaved pre-activation ``z_pre`` [M, 2f] (column 2j = gate_j, 2j+1 = up_j): a 1-warp loader partition
issues the operand ring's TMA loads and, during the tile's mainloop, the tile's z_pre into shared memory; the 8-warp
consumer partition issues the wgmmas and runs the epilogue from shared memory. z_pre and dz_pre go through TMA as
int32 [M, f]: each 32-bit word is one (gate, up) pair (gate in the low half), so the consumer reads a pair per
accumulator element in the accumulator's own register layout and splits it with shifts, without reshaping a tile.
Its results equal the fused Triton kernel's bit for bit (dz_pre, y; zdz to 2e-7). It lost on an H100
(docs/performance.md, "Gluon"): 1.08-1.58x the fused kernel's time over four configs at 1B, 7B and 70B, while the
producer's plain Gluon GEMM at 128 x 256 ran at cuBLAS's speed or faster: the z_pre and dz_pre tiles leave room in
shared memory for 128 x 128 tiles (3-4 stages) or 128 x 256 with 2 stages, and the epilogue's shared-memory traffic
is not overlapped with the next tile's mainloop.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, also without pip install -e .
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gluon_experiment, also when loaded by path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from gluon_experiment import (check, cli, compile_for_hopper, desc_type, inputs, reference_paths, swiglu_case,
                              swiglu_pairs_bwd, time_paths)
from kernels.coda.mainloop import persistent_grid
from kernels.coda.mainloop_gluon import (LOADER_REGS, handoff_barriers, local_tiles, ring_barriers, thread_barrier,
                                         tile_coords, tma_desc, tma_load)
from kernels.coda.producer_gluon import MAXNREG, RES_AT, send
from kernels.coda.reduce import finish_row_sum

BM, BN, BK, STAGES, GROUP_M, WARPS = 128, 128, 64, 3, 8, 8


@gluon.jit
def loader(a_desc, b_desc, z_desc, a_bufs, b_bufs, io_z, ready, empty, z_ready, z_empty, M, N, K,
           GROUP_M: gl.constexpr):
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
        off_m = pid_m * TM
        off_n = pid_n * TN
        for kk in range(k_tiles):
            slot = p % S
            mbarrier.wait(empty.index(slot), ((p // S) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma_load(a_desc, [off_m, kk * TK], ready.index(slot), a_bufs.index(slot))
            tma_load(b_desc, [kk * TK, off_n], ready.index(slot), b_bufs.index(slot))
            p += 1
            if kk == min(RES_AT, k_tiles - 1):
                mbarrier.wait(z_empty, (i & 1) ^ 1)
                mbarrier.expect(z_ready, z_desc.block_type.nbytes)
                tma_load(z_desc, [off_m, off_n], z_ready, io_z)


@gluon.jit
def consumer(dz_desc, y_desc, a_bufs, b_bufs, io_z, io_y, ready, empty, z_ready, z_empty, part_ptr, y_ptr, M, N, K,
             stride_p, Y_DIRECT: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    TM: gl.constexpr = a_bufs.type.shape[1]
    TN: gl.constexpr = b_bufs.type.shape[2]
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
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot), acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            thread_barrier()  # both warpgroups are done with the previous slot
            mbarrier.arrive(empty.index((c + S - 1) % S), pred=kk > 0)
            c += 1
            if kk == min(1, k_tiles - 1):
                tma.store_wait(0)  # the previous tile's dz_pre has left io_z (and y io_y): the loader may refill it
                mbarrier.arrive(z_empty, pred=i > 0)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        thread_barrier()
        mbarrier.arrive(empty.index((c + S - 1) % S))
        mbarrier.wait(z_ready, i & 1)
        dz, y, zdz = swiglu_pairs_bwd(acc, io_z.load(acc_layout).to(gl.uint32, bitcast=True))
        rows = off_m + gl.arange(0, TM, layout=gl.SliceLayout(1, acc_layout))
        gl.store(part_ptr + rows.to(gl.int64) * stride_p + pid_n, zdz, mask=rows < M)
        if Y_DIRECT:
            cols = off_n + gl.arange(0, TN, layout=gl.SliceLayout(0, acc_layout))
            gl.store(y_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], y,
                     mask=(rows < M)[:, None] & (cols < N)[None, :])
        else:
            send(io_y, y, y_desc, off_m, off_n)
        send(io_z, dz, dz_desc, off_m, off_n)
    tma.store_wait(0)


@gluon.jit
def ws_dgrad_swiglu_kernel(a_desc, b_desc, z_desc, dz_desc, y_desc, part_ptr, y_ptr, M, N, K, stride_p,
                           S: gl.constexpr, Y_DIRECT: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [S] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [S] + b_desc.block_type.shape, b_desc.layout)
    io_z = gl.allocate_shared_memory(z_desc.dtype, z_desc.block_type.shape, z_desc.layout)
    if Y_DIRECT:
        io_y = io_z  # unused: y leaves from registers
    else:
        io_y = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
    ready, empty = ring_barriers(S)
    z_ready, z_empty = handoff_barriers()
    gl.warp_specialize([
        (consumer, (dz_desc, y_desc, a_bufs, b_bufs, io_z, io_y, ready, empty, z_ready, z_empty, part_ptr, y_ptr, M,
                    N, K, stride_p, Y_DIRECT, GROUP_M, num_warps)),
        (loader, (a_desc, b_desc, z_desc, a_bufs, b_bufs, io_z, ready, empty, z_ready, z_empty, M, N, K, GROUP_M)),
    ], [1], [LOADER_REGS])


def dgrad_swiglu_gluon(dx: torch.Tensor, w_down: torch.Tensor, z_pre: torch.Tensor,
                       config: tuple[int, int, int, bool] = (BN, BK, STAGES, False)
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kernels.coda.swiglu_bwd.dgrad_swiglu`'s results ``(dz_pre, y, zdz)`` by the Gluon kernel, for bf16
    dx [M, d], w_down [d, f] and z_pre [M, 2f] (rows of 16-byte multiples). ``config``: (BN, BK, stages, y stored
    from registers instead of through shared memory and TMA)."""
    bn, bk, stages, y_direct = config
    dx, w_down, z_pre = dx.contiguous(), w_down.contiguous(), z_pre.contiguous()
    M, K = dx.shape
    N = w_down.shape[1]
    dz_pre = torch.empty_like(z_pre)
    y = torch.empty(M, N, device=dx.device, dtype=dx.dtype)
    part = torch.empty(M, triton.cdiv(N, bn), device=dx.device, dtype=torch.float32)
    grid = persistent_grid(M, N, dx.device)({"BM": BM, "BN": bn})
    ws_dgrad_swiglu_kernel[grid](tma_desc(dx, [BM, bk]), tma_desc(w_down, [bk, bn]),
                                 tma_desc(z_pre.view(torch.int32), [BM, bn]),
                                 tma_desc(dz_pre.view(torch.int32), [BM, bn]), tma_desc(y, [BM, bn]), part, y, M, N, K,
                                 part.stride(0), S=stages, Y_DIRECT=y_direct, GROUP_M=GROUP_M, num_warps=WARPS,
                                 maxnreg=MAXNREG)
    return dz_pre, y, finish_row_sum(part, part.shape[1])


CONFIGS = [(128, 64, 3, False), (128, 64, 4, True), (256, 64, 2, True), (256, 32, 4, True)]
"""(BN, BK, stages, y from registers) tried; BM = 128."""


def compile_only() -> dict[str, str]:
    """Compile every config for sm_90 (no GPU needed): shared memory bytes, and ptxas's registers and spills."""
    out = {}
    for bn, bk, stages, y_direct in CONFIGS:
        types = [desc_type([BM, bk]), desc_type([bk, bn]), desc_type([BM, bn], gl.int32, "i32"),
                 desc_type([BM, bn], gl.int32, "i32"), desc_type([BM, bn]), "*fp32", "*bf16", "i32", "i32", "i32",
                 "i32"]
        consts = {"S": stages, "Y_DIRECT": y_direct, "GROUP_M": GROUP_M, "num_warps": WARPS}
        out[f"config={bn},{bk},{stages},{y_direct}"] = compile_for_hopper(ws_dgrad_swiglu_kernel, types, consts,
                                                                           WARPS, MAXNREG)
    return out


def bench(model: str) -> None:
    """The fused Triton kernel, its split path, each Gluon config (checked against the fused kernel first), the
    producer's plain Gluon GEMM and cuBLAS."""
    from kernels.coda.producer_gluon import ws_producer

    args = inputs(model)
    paths = reference_paths(args)
    paths.update({f"gluon {c}": (lambda c=c: dgrad_swiglu_gluon(**args, config=c)) for c in CONFIGS})
    wt = args["w_down"].T.contiguous()
    paths["plain Gluon GEMM 128x256"] = lambda: ws_producer(args["dx"], wt)
    ref = paths["fused (Triton)"]()
    for c in CONFIGS:
        check(f"{model} gluon {c}", paths[f"gluon {c}"](), ref)
    time_paths(paths, *swiglu_case(model))


if __name__ == "__main__":
    raise SystemExit(cli(__doc__, compile_only, bench))
