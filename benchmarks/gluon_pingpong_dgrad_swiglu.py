"""Experiment (lost, not shipped): the SwiGLU backward's dgrad GEMM as a *ping-pong* warp-specialized Gluon kernel.

    python benchmarks/gluon_pingpong_dgrad_swiglu.py               # times it at the 1B / 7B / 70B shapes (H100/H200)
    python benchmarks/gluon_pingpong_dgrad_swiglu.py --compile-only # no GPU needed: compiles every config for sm_90

The math is :func:`kernels.coda.swiglu_bwd.dgrad_swiglu`'s (and benchmarks/gluon_ws_dgrad_swiglu.py's),

    dy = dx @ w_down,   s = sigmoid(gate),   dgate = dy up s (1 + gate (1 - s)),   dup = dy gate s,
    y = gate s up,      zdz[m, tile_n] = sum_{j in tile_n} gate_mj dgate_mj + up_mj dup_mj,

on the interleaved pre-activation ``z_pre`` [M, 2f]. The cooperative kernel of that experiment lost because each
tile's epilogue ran between two mainloops. Here two consumer warpgroups (4 warps each) own alternate tiles of a
program, each with its own (BM, BN) accumulator, and take turns at the tensor cores: a pair of mbarriers passes the
turn after each mainloop, so one warpgroup's epilogue (global loads of its z_pre pairs, the math, global stores of
dz_pre, y and the row sums) runs while the other's mainloop does. A 1-warp loader partition fills one operand ring
for both, in tile order. The turn also keeps each consumer's ring phases valid: a consumer waits on a stage only
after the other has waited on every earlier one.

Measured on an H100 (docs/performance.md, "Gluon"): bit-exact with the fused Triton kernel (zdz to 2e-7),
but 1.03-1.10x its time at 1B, 1.01x at 7B, 1.02x at 70B (best config, 4 stages, one ring). Its mainloop alone (the
plain GEMM through the same schedule) ran at 0.89-0.98 ms against cuBLAS's 0.85 at 1B, so the epilogue is what is
not hidden: on one warpgroup (4 warps, 128 elements a thread a tile) it takes longer than the other warpgroup's
mainloop, and the two alternate at that pace. Two rings without the turn, and an epilogue without its loads, were no
faster.
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
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from gluon_experiment import (check, cli, compile_for_hopper, desc_type, inputs, reference_paths, swiglu_case,
                              swiglu_pairs_bwd, time_paths)
from kernels.coda.mainloop import persistent_grid
from kernels.coda.mainloop_gluon import (LOADER_REGS, local_tiles, ring_barriers, thread_barrier, tile_coords, tma_desc,
                                         tma_load)
from kernels.coda.reduce import finish_row_sum

BM, GROUP_M, WG = 128, 8, 4
CONSUMER_REGS = gl.constexpr(232)
"""Registers per consumer thread: 2 x 128 x 232 + the loader's warpgroup at 40 x 128 = 64512 of the SM's 64K."""
MAXNREG = 168
FIRST, SECOND = gl.constexpr(0), gl.constexpr(1)
"""The two consumers' ids (CID)."""


@gluon.jit
def loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, RINGS: gl.constexpr, GROUP_M: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0] // RINGS
    TM: gl.constexpr = a_desc.block_type.shape[0]
    TK: gl.constexpr = a_desc.block_type.shape[1]
    TN: gl.constexpr = b_desc.block_type.shape[1]
    n_m = gl.cdiv(M, TM)
    n_n = gl.cdiv(N, TN)
    k_tiles = gl.cdiv(K, TK)
    for i in range(local_tiles(n_m, n_n)):
        pid_m, pid_n = tile_coords(i, n_m, n_n, GROUP_M)
        p = (i // RINGS) * k_tiles
        for kk in range(k_tiles):
            slot = (i % RINGS) * S + p % S
            mbarrier.wait(empty.index(slot), ((p // S) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma_load(a_desc, [pid_m * TM, kk * TK], ready.index(slot), a_bufs.index(slot))
            tma_load(b_desc, [kk * TK, pid_n * TN], ready.index(slot), b_bufs.index(slot))
            p += 1


@gluon.jit
def epilogue_rows(acc, off_m, off_n, z_ptr, dz_ptr, y_ptr, part_ptr, M, N, stride_p, pid_n,
                  EPILOGUE: gl.constexpr, EVEN: gl.constexpr, NOLOAD: gl.constexpr):
    """The epilogue of one (rows, TN) accumulator at (off_m, off_n), from and to global memory."""
    layout: gl.constexpr = acc.type.layout
    rows = off_m + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    offs = rows.to(gl.int64)[:, None] * N + cols[None, :]
    mask = None if EVEN else (rows < M)[:, None] & (cols < N)[None, :]
    if EPILOGUE:
        if NOLOAD:  # a diagnostic: the epilogue's math and stores without its loads (wrong results)
            pairs = acc.to(gl.uint32, bitcast=True)
        else:
            pairs = gl.load(z_ptr + offs, mask=mask, other=0 if not EVEN else None).to(gl.uint32, bitcast=True)
        dz, y, zdz = swiglu_pairs_bwd(acc, pairs)
        gl.store(dz_ptr + offs, dz, mask=mask)
        gl.store(y_ptr + offs, y, mask=mask)
        gl.store(part_ptr + rows * stride_p + pid_n, zdz, mask=None if EVEN else rows < M)
    else:
        gl.store(y_ptr + offs, acc.to(gl.bfloat16), mask=mask)


@gluon.jit
def consumer(a_bufs, b_bufs, ready, empty, turn, z_ptr, dz_ptr, y_ptr, part_ptr, M, N, K, stride_p,
             CID: gl.constexpr, RINGS: gl.constexpr, EPILOGUE: gl.constexpr, EVEN: gl.constexpr,
             NOLOAD: gl.constexpr, GROUP_M: gl.constexpr, W: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0] // RINGS
    TM: gl.constexpr = a_bufs.type.shape[1]
    TK: gl.constexpr = a_bufs.type.shape[2]
    TN: gl.constexpr = b_bufs.type.shape[2]
    HM: gl.constexpr = TM // 2
    # Two accumulators of HM rows each (the same wgmmas as one of TM rows): the epilogue takes one at a time, so
    # its z_pre pairs and temporaries sit beside half the tile's registers.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                         instr_shape=[16, TN, 16])
    n_m = gl.cdiv(M, TM)
    n_n = gl.cdiv(N, TN)
    k_tiles = gl.cdiv(K, TK)
    acc0 = gl.zeros((HM, TN), dtype=gl.float32, layout=acc_layout)
    acc1 = gl.zeros((HM, TN), dtype=gl.float32, layout=acc_layout)
    j = 0
    for i in range(CID, local_tiles(n_m, n_n), 2):
        pid_m, pid_n = tile_coords(i, n_m, n_n, GROUP_M)
        # The turn: consumer 0 starts; each passes it on after its mainloop's last stage wait.
        if RINGS == 1:
            mbarrier.wait(turn.index(CID), (j & 1) ^ (1 - CID))
        c = (i // RINGS) * k_tiles
        base = (i % RINGS) * S
        for kk in range(k_tiles):
            slot = base + c % S
            mbarrier.wait(ready.index(slot), (c // S) & 1)
            a = a_bufs.index(slot)
            b = b_bufs.index(slot)
            acc0 = warpgroup_mma(a.slice(0, HM), b, acc0, use_acc=kk > 0, is_async=True)
            acc1 = warpgroup_mma(a.slice(HM, HM), b, acc1, use_acc=kk > 0, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(2, deps=(acc0, acc1))
            thread_barrier()  # every warp is done with the previous slot
            mbarrier.arrive(empty.index(base + (c + S - 1) % S), pred=kk > 0)
            c += 1
        if RINGS == 1:
            mbarrier.arrive(turn.index(1 - CID))
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        thread_barrier()
        mbarrier.arrive(empty.index(base + (c + S - 1) % S))
        epilogue_rows(acc0, pid_m * TM, pid_n * TN, z_ptr, dz_ptr, y_ptr, part_ptr, M, N, stride_p, pid_n, EPILOGUE,
                      EVEN, NOLOAD)
        epilogue_rows(acc1, pid_m * TM + HM, pid_n * TN, z_ptr, dz_ptr, y_ptr, part_ptr, M, N, stride_p, pid_n,
                      EPILOGUE, EVEN, NOLOAD)
        j += 1


@gluon.jit
def pingpong_dgrad_swiglu_kernel(a_desc, b_desc, z_ptr, dz_ptr, y_ptr, part_ptr, M, N, K, stride_p, S: gl.constexpr,
                                 RINGS: gl.constexpr, EPILOGUE: gl.constexpr, EVEN: gl.constexpr,
                                 NOLOAD: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [S] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [S] + b_desc.block_type.shape, b_desc.layout)
    ready, empty = ring_barriers(S)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(turn.index(s), count=1)
    gl.warp_specialize([
        (consumer, (a_bufs, b_bufs, ready, empty, turn, z_ptr, dz_ptr, y_ptr, part_ptr, M, N, K, stride_p, FIRST,
                    RINGS, EPILOGUE, EVEN, NOLOAD, GROUP_M, num_warps)),
        (consumer, (a_bufs, b_bufs, ready, empty, turn, z_ptr, dz_ptr, y_ptr, part_ptr, M, N, K, stride_p, SECOND,
                    RINGS, EPILOGUE, EVEN, NOLOAD, GROUP_M, num_warps)),
        (loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, RINGS, GROUP_M)),
    ], [num_warps, 1], [CONSUMER_REGS, LOADER_REGS])


def dgrad_swiglu_pingpong(dx: torch.Tensor, w_down: torch.Tensor, z_pre: torch.Tensor,
                          config: tuple[int, int, int, int] = (128, 64, 4, 1), epilogue: bool = True,
                          noload: bool = False):
    """``(dz_pre, y, zdz)`` of :func:`kernels.coda.swiglu_bwd.dgrad_swiglu` for bf16 dx [M, d], w_down [d, f], z_pre
    [M, 2f]; ``config``: (BN, BK, stages, rings), BM = 128 per consumer; rings = 2: each consumer its own ring of
    stages / 2 (no turn: the mainloops may overlap). ``epilogue=False``: the plain GEMM ``dx @ w_down`` through the
    same schedule (returned as y), to compare the mainloop with cuBLAS; ``noload``: the epilogue without its z_pre
    loads (a timing diagnostic, wrong results)."""
    bn, bk, stages, rings = config
    dx, w_down, z_pre = dx.contiguous(), w_down.contiguous(), z_pre.contiguous()
    M, K = dx.shape
    N = w_down.shape[1]
    dz_pre = torch.empty_like(z_pre)
    y = torch.empty(M, N, device=dx.device, dtype=dx.dtype)
    part = torch.empty(M, triton.cdiv(N, bn), device=dx.device, dtype=torch.float32)
    grid = persistent_grid(M, N, dx.device)({"BM": BM, "BN": bn})
    pingpong_dgrad_swiglu_kernel[grid](tma_desc(dx, [BM, bk]), tma_desc(w_down, [bk, bn]), z_pre.view(torch.int32),
                                       dz_pre.view(torch.int32), y, part, M, N, K, part.stride(0), S=stages,
                                       RINGS=rings, EPILOGUE=epilogue, EVEN=M % BM == 0 and N % bn == 0,
                                       NOLOAD=noload, GROUP_M=GROUP_M,
                                       num_warps=WG, maxnreg=MAXNREG)
    if not epilogue:
        return y
    return dz_pre, y, finish_row_sum(part, part.shape[1])


CONFIGS = [(128, 64, 4, 1), (128, 64, 6, 2)]
"""(BN, BK, stages, rings) tried; BM = 128 per consumer warpgroup."""


def compile_only() -> dict[str, str]:
    """Compile every config for sm_90 (no GPU needed): shared memory bytes, and ptxas's registers and spills."""
    out = {}
    for bn, bk, stages, rings in CONFIGS:
        for epi in (True, False):
            types = [desc_type([BM, bk]), desc_type([bk, bn]), "*i32", "*i32", "*bf16", "*fp32", "i32", "i32", "i32",
                     "i32"]
            consts = {"S": stages, "RINGS": rings, "EPILOGUE": epi, "EVEN": True, "NOLOAD": False, "GROUP_M": GROUP_M,
                      "num_warps": WG}
            out[f"config={bn},{bk},{stages},{rings} epilogue={epi}"] = compile_for_hopper(
                pingpong_dgrad_swiglu_kernel, types, consts, WG, MAXNREG)
    return out


def bench(model: str) -> None:
    """The fused Triton kernel, its split path, each ping-pong config, its plain GEMM and its epilogue without loads
    (each config checked against the fused kernel first), cuBLAS."""
    from codabench.metrics import rel_err

    args = inputs(model)
    paths = reference_paths(args)
    for c in CONFIGS:
        paths[f"pingpong {c}"] = lambda c=c: dgrad_swiglu_pingpong(**args, config=c)
        paths[f"pingpong GEMM {c}"] = lambda c=c: dgrad_swiglu_pingpong(**args, config=c, epilogue=False)
        paths[f"pingpong no loads {c}"] = lambda c=c: dgrad_swiglu_pingpong(**args, config=c, noload=True)
    ref = paths["fused (Triton)"]()
    gemm = (args["dx"] @ args["w_down"]).double()
    for c in CONFIGS:
        check(f"{model} pingpong {c}", paths[f"pingpong {c}"](), ref)
        print(f"{model} pingpong GEMM {c}: rel_err against cuBLAS {rel_err(paths[f'pingpong GEMM {c}'](), gemm):.1e}")
    time_paths(paths, *swiglu_case(model))


if __name__ == "__main__":
    raise SystemExit(cli(__doc__, compile_only, bench))
