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
Its results equal the fused Triton kernel's bit for bit (dz_pre, y; zdz to 2e-7). It lost on an H100 (2026-11-26,
benchmarks/PERF_NOTES.md): 1.08-1.58x the fused kernel's time over four configs at 1B, 7B and 70B, while the
producer's plain Gluon GEMM at 128 x 256 ran at cuBLAS's speed or faster: the z_pre and dz_pre tiles leave room in
shared memory for 128 x 128 tiles (3-4 stages) or 128 x 256 with 2 stages, and the epilogue's shared-memory traffic
is not overlapped with the next tile's mainloop.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, also without pip install -e .

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from kernels.coda.producer_gluon import (LOADER_REGS, MAXNREG, RES_AT, local_tiles, send, thread_barrier,
                                         tile_coords, tma_desc, tma_load)
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
def swiglu_pairs_bwd(dy, pairs):
    """The SwiGLU backward of the fp32 tile dy given the (gate, up) bf16 pairs of z_pre as uint32 words (gate in the
    low half): the packed (dgate, dup) words, y, and the tile's row sums of ``gate dgate + up dup``."""
    gate = (pairs << 16).to(gl.float32, bitcast=True)
    up = ((pairs >> 16) << 16).to(gl.float32, bitcast=True)
    s = 1.0 / (1.0 + gl.exp(-gate))
    silu = gate * s
    dgate = dy * up * s * (1.0 + gate * (1.0 - s))
    dup = dy * silu
    lo = dgate.to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.uint32)
    hi = dup.to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.uint32)
    return (lo | (hi << 16)).to(gl.int32, bitcast=True), (silu * up).to(gl.bfloat16), gl.sum(gate * dgate + up * dup,
                                                                                              axis=1)


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
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    z_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    z_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(z_ready, count=1)
    mbarrier.init(z_empty, count=1)
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
    grid = (min(torch.cuda.get_device_properties(dx.device).multi_processor_count,
                triton.cdiv(M, BM) * triton.cdiv(N, bn)), )
    ws_dgrad_swiglu_kernel[grid](tma_desc(dx, [BM, bk]), tma_desc(w_down, [bk, bn]),
                                 tma_desc(z_pre.view(torch.int32), [BM, bn]),
                                 tma_desc(dz_pre.view(torch.int32), [BM, bn]), tma_desc(y, [BM, bn]), part, y, M, N, K,
                                 part.stride(0), S=stages, Y_DIRECT=y_direct, GROUP_M=GROUP_M, num_warps=WARPS,
                                 maxnreg=MAXNREG)
    return dz_pre, y, finish_row_sum(part, part.shape[1])


CONFIGS = [(128, 64, 3, False), (128, 64, 4, True), (256, 64, 2, True), (256, 32, 4, True)]
"""(BN, BK, stages, y from registers) tried; BM = 128."""
SHAPES = {"llama-1b": (16384, 8192, 2048), "llama-7b": (16384, 11008, 4096), "llama-70b": (16384, 28672, 8192)}
"""(M, f, d) of the suite's swiglu_dgrad cells."""


def compile_only() -> dict[str, int]:
    """Compile every config for sm_90 (no GPU needed); shared memory bytes per config."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(block, dtype, name):
        return f"tensordesc<{name}[{block[0]}, {block[1]}],{gl.NVMMASharedLayout.get_default_for(block, dtype)!r}>"

    names = ws_dgrad_swiglu_kernel.arg_names
    shared = {}
    for bn, bk, stages, y_direct in CONFIGS:
        types = [desc([BM, bk], gl.bfloat16, "bf16"), desc([bk, bn], gl.bfloat16, "bf16"),
                 desc([BM, bn], gl.int32, "i32"), desc([BM, bn], gl.int32, "i32"), desc([BM, bn], gl.bfloat16, "bf16"),
                 "*fp32", "*bf16", "i32", "i32", "i32", "i32"]
        consts = {"S": stages, "Y_DIRECT": y_direct, "GROUP_M": GROUP_M, "num_warps": WARPS}
        sig = dict(zip(names, types + ["constexpr"] * len(consts)))
        src = GluonASTSource(ws_dgrad_swiglu_kernel, sig, {(names.index(k), ): v for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS, "maxnreg": MAXNREG})
        shared[f"config={bn},{bk},{stages},{y_direct}"] = k.metadata.shared
    return shared


def bench(models: list[str]) -> None:
    """Per shape: the fused Triton kernel, its split path, each Gluon config, the producer's plain Gluon GEMM and
    cuBLAS (``dx @ w_down``), 3 interleaved ``do_bench`` rounds (L2 flushed), medians; each config checked against
    the fused kernel first."""
    from codabench.metrics import rel_err
    from kernels.coda.producer_gluon import ws_producer
    from kernels.coda.swiglu_bwd import dgrad_swiglu

    torch.manual_seed(0)
    for model in models:
        m, f, d = SHAPES[model]
        dx = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(d, f, device="cuda") * d ** -0.5).to(torch.bfloat16)
        wt, z = w.T.contiguous(), torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16)
        args = {"dx": dx, "w_down": w, "z_pre": z}
        paths = {"fused (Triton)": lambda: dgrad_swiglu.fused(**args), "split": lambda: dgrad_swiglu.split(**args)}
        paths.update({f"gluon {c}": (lambda c=c: dgrad_swiglu_gluon(**args, config=c)) for c in CONFIGS})
        paths.update({"plain Gluon GEMM 128x256": lambda: ws_producer(dx, wt), "cuBLAS GEMM": lambda: dx @ w})
        ref = paths["fused (Triton)"]()
        for c in CONFIGS:
            errs = [rel_err(a, b.double()) for a, b in zip(paths[f"gluon {c}"](), ref)]
            print(f"{model} gluon {c}: rel_err against fused: dz_pre {errs[0]:.1e}, y {errs[1]:.1e}, zdz {errs[2]:.1e}")
        times = {k: [] for k in paths}
        for _ in range(3):
            for k, fn in paths.items():
                times[k].append(triton.testing.do_bench(fn, warmup=25, rep=100))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{model}, M = {m}, f = {f}, d = {d}:")
        fused = med["fused (Triton)"]
        for k, v in med.items():
            print(f"  {k:28} {v:7.3f} ms  {2 * m * f * d / v / 1e9:4.0f} TFLOP/s  {v / fused:.3f}x fused")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = p.parse_args()
    unknown = [m for m in args.models.split(",") if m not in SHAPES]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if args.compile_only:
        for name, smem in compile_only().items():
            print(f"{name}: compiled for sm_90, {smem} B shared memory")
        return 0
    bench(args.models.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
