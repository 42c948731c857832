"""Experiment (lost, not shipped): the RMSNorm backward's dgrad GEMM as a warp-specialized Gluon kernel for Hopper,
its epilogue in a warp partition of its own (issue 20 item 2: "dgrad_norm at the QKV shape").

    python benchmarks/gluon_epilogue_dgrad_rmsnorm.py                # 1B / 7B / 70B shapes (H100 or H200)
    python benchmarks/gluon_epilogue_dgrad_rmsnorm.py --compile-only  # no GPU needed: compiles each config for sm_90

The math is :func:`kernels.coda.rmsnorm_bwd.dgrad_rmsnorm`'s, for ``y = gamma x rstd`` feeding ``z = y @ W^T``::

    gy = s (dz @ W),   xhat = x rstd,   c = s zdz / d,   dx = dres + rstd (gy gamma - xhat c),   y = xhat gamma,
    dgamma = sum_m gy xhat   (per-M-tile column partials, then one column sum),

on the schedule of the shipped Gluon SwiGLU dgrad (:mod:`kernels.coda.mainloop_gluon`: a loader warp, an MMA
warpgroup on 128 x 128 tiles, the accumulator handed over in shared memory) with this epilogue partition (8 warps):
from ``acc_buf`` in row sub-tiles, x and dres loaded and dx and y stored with 16-byte accesses, each tile's dgamma
partial summed in registers over its sub-tiles. dx and y equal the fused Triton kernel's bit for bit, dgamma to the
order of its sums; bf16 operands, or fp8 with per-tensor scales (dz e5m2, w e4m3 stored K-major).

It lost on an H100 (docs/performance.md, "Gluon"): at the block's two sites and three sizes it ties the
better of the fused and split paths at best (1B QKV fp8, 7B / 70B QKV fp8) and is 2-22% slower elsewhere. The
epilogue here (x, dres, dx, y: 128 KB a tile) is light next to the SwiGLU dgrad's, so hiding it gains little, and the
single MMA warpgroup on 128 x 128 tiles runs the GEMM slower than the fused kernel's 128 x 256 tiles at large K.
It also times the schedule's own GEMM (``ws_gemm``: an epilogue that only stores C) against cuBLAS at these shapes
and at the LM head's forward shape, the GEMM a Gluon cross-entropy path would run: 0.80-0.94x cuBLAS's rate.

Each config is (operand dtype, operand ring stages, rows of an epilogue sub-tile, columns a thread holds); the
default is :func:`kernels.coda.mainloop_gluon.stages` (at most ``MAX_STAGES``), ``SUB_M`` and 8 columns. Each config
is checked against the fused kernel first (dx and y bit for bit).
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
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from gluon_experiment import FUSED, cli, compile_for_hopper, time_paths, ws_consts, ws_types
from kernels.coda import mainloop_gluon as WS
from kernels.coda.mainloop_gluon import (BM, LOADER_REGS, MMA_REGS, WsGemm, loader, local_tiles, mma, thread_barrier,
                                         tile_coords, ws_buffers)
from kernels.coda.reduce import finish_col_sum
from kernels.coda.rmsnorm_bwd import norm_bwd_operands, scale_arg
from workloads.fp8 import Fp8, Recipe, ScaledMMGemms, quantize_as
from workloads.models import PRESETS

SUB_M = 32
"""Rows of an epilogue sub-tile."""
MAX_STAGES = 4
"""Operand ring stages at most: the dgamma partials' cross-warp sum takes 4 KB of shared memory beside the 64 KB
accumulator buffer, so a fifth 32 KB stage no longer fits (Triton 3.6 on an H100: 233600 bytes against 232448)."""


def ring_stages(k_bytes: int) -> int:
    """The experiment's default ring: :func:`kernels.coda.mainloop_gluon.stages` of K's bytes, at most MAX_STAGES."""
    return min(WS.stages(k_bytes), MAX_STAGES)


@gluon.jit
def rmsnorm_rows_bwd(gy, x, rstd, c, gamma):
    """RMSNorm's backward on a sub-tile (:func:`kernels.coda.epilogue.rmsnorm_dx`'s form): ``(dx without dres, y,
    gy xhat)`` from fp32 gy and x, per-row rstd and c, per-column gamma."""
    xhat = x * rstd[:, None]
    dx = rstd[:, None] * (gy * gamma[None, :] - xhat * c[:, None])
    return dx, xhat * gamma[None, :], gy * xhat


@gluon.jit
def epilogue(acc_buf, acc_ready, acc_empty, sa_ptr, sb_ptr, x_ptr, rstd_ptr, gamma_ptr, zdz_ptr, scale_ptr, dres_ptr,
             dx_ptr, y_ptr, dg_ptr, M, N, SCALED: gl.constexpr, HAS_RES: gl.constexpr, HAS_SCALE: gl.constexpr,
             GROUP_M: gl.constexpr, SUB_M: gl.constexpr, VEC: gl.constexpr, num_warps: gl.constexpr):
    TM: gl.constexpr = acc_buf.type.shape[0]
    TN: gl.constexpr = acc_buf.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // TN, TN // VEC], [num_warps, 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    c_scale = 1.0 / N
    s = 1.0
    if HAS_SCALE:
        s = gl.load(scale_ptr).to(gl.float32)
        c_scale = c_scale * s
    deq = gl.load(sa_ptr) * gl.load(sb_ptr) if SCALED else 1.0  # fp8: gy = acc sa sb
    n_m = gl.cdiv(M, TM)
    n_n = gl.cdiv(N, TN)
    for i in range(local_tiles(n_m, n_n)):
        pid_m, pid_n = tile_coords(i, n_m, n_n, GROUP_M)
        cols = pid_n * TN + gl.arange(0, TN, layout=col_l)
        gamma = gl.load(gamma_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
        dg = gl.zeros((TN, ), gl.float32, col_l)
        mbarrier.wait(acc_ready, i & 1)
        for r in gl.static_range(TM // SUB_M):
            rows = pid_m * TM + r * SUB_M + gl.arange(0, SUB_M, layout=row_l)
            offs = rows.to(gl.int64)[:, None] * N + cols[None, :]  # x, dres, dx and y: contiguous [M, N]
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            gy = acc_buf.slice(r * SUB_M, SUB_M).load(layout)
            if SCALED:
                gy = gy * deq
            if HAS_SCALE:
                gy = gy * s
            rstd = gl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
            c = gl.load(zdz_ptr + rows, mask=rows < M, other=0.0) * c_scale
            x = gl.load(x_ptr + offs, mask=mask, other=0.0).to(gl.float32)
            dx, y, gx = rmsnorm_rows_bwd(gy, x, rstd, c, gamma)
            if HAS_RES:
                dx += gl.load(dres_ptr + offs, mask=mask, other=0.0).to(gl.float32)
            gl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            gl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
            dg += gl.sum(gx, axis=0)
        thread_barrier()  # every warp has read the buffer
        mbarrier.arrive(acc_empty)
        gl.store(dg_ptr + pid_m.to(gl.int64) * N + cols, dg, mask=cols < N)


@gluon.jit
def ws_dgrad_rmsnorm_kernel(a_desc, b_desc, sa_ptr, sb_ptr, M, N, K, x_ptr, rstd_ptr, gamma_ptr, zdz_ptr, scale_ptr,
                            dres_ptr, dx_ptr, y_ptr, dg_ptr, B_NK: gl.constexpr, SCALED: gl.constexpr,
                            INSTR_K: gl.constexpr, S: gl.constexpr, GROUP_M: gl.constexpr, MMA_W: gl.constexpr,
                            HAS_RES: gl.constexpr, HAS_SCALE: gl.constexpr, SUB_M: gl.constexpr, VEC: gl.constexpr,
                            num_warps: gl.constexpr):
    a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty = ws_buffers(a_desc, b_desc, S, B_NK)
    gl.warp_specialize([
        (epilogue, (acc_buf, acc_ready, acc_empty, sa_ptr, sb_ptr, x_ptr, rstd_ptr, gamma_ptr, zdz_ptr, scale_ptr,
                    dres_ptr, dx_ptr, y_ptr, dg_ptr, M, N, SCALED, HAS_RES, HAS_SCALE, GROUP_M, SUB_M, VEC,
                    num_warps)),
        (mma, (a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty, M, N, K, B_NK, INSTR_K, MMA_W)),
        (loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, B_NK, GROUP_M)),
    ], [MMA_W, 1], [MMA_REGS, LOADER_REGS])


@gluon.jit
def plain_epilogue(acc_buf, acc_ready, acc_empty, c_ptr, M, N, GROUP_M: gl.constexpr, SUB_M: gl.constexpr,
                   num_warps: gl.constexpr):
    """The schedule's speed of light: C = acc, stored as bf16 from ``acc_buf`` in row sub-tiles."""
    TM: gl.constexpr = acc_buf.type.shape[0]
    TN: gl.constexpr = acc_buf.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // TN, TN // 8], [num_warps, 1], [1, 0])
    n_m = gl.cdiv(M, TM)
    n_n = gl.cdiv(N, TN)
    for i in range(local_tiles(n_m, n_n)):
        pid_m, pid_n = tile_coords(i, n_m, n_n, GROUP_M)
        cols = pid_n * TN + gl.arange(0, TN, layout=gl.SliceLayout(0, layout))
        mbarrier.wait(acc_ready, i & 1)
        for r in gl.static_range(TM // SUB_M):
            rows = pid_m * TM + r * SUB_M + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, layout))
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            c = acc_buf.slice(r * SUB_M, SUB_M).load(layout)
            gl.store(c_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], c.to(gl.bfloat16), mask=mask)
        thread_barrier()
        mbarrier.arrive(acc_empty)


@gluon.jit
def ws_gemm_kernel(a_desc, b_desc, sa_ptr, sb_ptr, M, N, K, c_ptr, B_NK: gl.constexpr, SCALED: gl.constexpr,
                   INSTR_K: gl.constexpr, S: gl.constexpr, GROUP_M: gl.constexpr, MMA_W: gl.constexpr,
                   SUB_M: gl.constexpr, num_warps: gl.constexpr):
    a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty = ws_buffers(a_desc, b_desc, S, B_NK)
    gl.warp_specialize([
        (plain_epilogue, (acc_buf, acc_ready, acc_empty, c_ptr, M, N, GROUP_M, SUB_M, num_warps)),
        (mma, (a_bufs, b_bufs, ready, empty, acc_buf, acc_ready, acc_empty, M, N, K, B_NK, INSTR_K, MMA_W)),
        (loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, B_NK, GROUP_M)),
    ], [MMA_W, 1], [MMA_REGS, LOADER_REGS])


def ws_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (bf16 [M, K] and [K, N]) on the schedule, its epilogue only storing C: the schedule's own GEMM."""
    gemm = WsGemm(a, b, "GEMM")
    c = gemm.empty()
    gemm.launch(ws_gemm_kernel, c, n_stages=ring_stages(gemm.K * gemm.a.element_size()), SUB_M=SUB_M)
    return c


def ws_dgrad_rmsnorm(dz: torch.Tensor | Fp8, w: torch.Tensor | Fp8, x: torch.Tensor, rstd: torch.Tensor,
                     gamma: torch.Tensor, zdz: torch.Tensor, dres: torch.Tensor | None = None,
                     dz_scale: float | torch.Tensor = 1.0, inplace: bool = False, n_stages: int | None = None,
                     sub_m: int = SUB_M, vec: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, y, dgamma)`` as :func:`kernels.coda.rmsnorm_bwd.dgrad_rmsnorm` for dz [M, N'] and w [N', d]: bf16 (N'
    and d multiples of 8), or fp8 with per-tensor scales, w's data the transposed view of a row-major (d, N') tensor
    (N' a multiple of 16): TMA rows of 16-byte multiples. ``n_stages`` (default
    :func:`ring_stages` of K's bytes), ``sub_m`` (rows of an
    epilogue sub-tile) and ``vec`` (columns a thread holds) for benchmarks."""
    gemm = WsGemm(dz, w, "RMSNorm dgrad")
    M, N = gemm.M, gemm.N
    x, gamma, res, dx = norm_bwd_operands(M, N, x, gamma, dres, inplace, gemm.device)
    res = res if res is not None else dx  # read only with HAS_RES
    y = gemm.empty()
    dg = torch.empty(triton.cdiv(M, BM), N, device=gemm.device, dtype=torch.float32)
    scale = scale_arg(dz_scale, gemm.device)
    n_stages = n_stages or ring_stages(gemm.K * gemm.a.element_size())
    gemm.launch(ws_dgrad_rmsnorm_kernel, x, rstd, gamma, zdz, scale if scale is not None else rstd,
                res, dx, y, dg, n_stages=n_stages, HAS_RES=dres is not None,
                HAS_SCALE=scale is not None, SUB_M=sub_m, VEC=vec)
    return dx, y, finish_col_sum(dg, dg.shape[0], gamma.dtype)


CONFIGS = [("bf16", 4, 32, 8), ("bf16", 3, 32, 8), ("bf16", 4, 16, 8), ("bf16", 4, 32, 4), ("fp8", 4, 32, 8),
           ("fp8", 3, 32, 8)]
"""(operands, stages, epilogue sub-tile rows, columns a thread holds) timed; BM = BN = 128, BK = 128 bytes."""


def compile_only() -> dict[str, str]:
    """Compile each config for sm_90 (no GPU needed): shared memory bytes, and ptxas's registers and spills."""
    out = {}
    for dtype, stages, sub_m, vec in CONFIGS:
        fp8 = dtype == "fp8"
        types = ws_types(fp8) + ["*bf16", "*fp32", "*bf16", "*fp32", "*fp32", "*bf16", "*bf16", "*bf16", "*fp32"]
        consts = {**ws_consts(fp8, stages), "HAS_RES": True, "HAS_SCALE": False, "SUB_M": sub_m, "VEC": vec}
        out[f"config={dtype},{stages},{sub_m},{vec}"] = compile_for_hopper(ws_dgrad_rmsnorm_kernel, types, consts,
                                                                           WS.EPI_WARPS, WS.MAXNREG)
    return out


def inputs(model: str, site: str, dtype: str) -> dict:
    """Seeded dgrad_rmsnorm arguments at ``model``'s ``site`` (``qkv`` or ``gate_up``), M = 16384: dz, w, x, dres
    bf16, rstd and zdz fp32; fp8 dz and w as the dgrad's recipe gives them."""
    shape = PRESETS[model]
    m, d = shape.tokens, shape.hidden
    n = shape.qkv_width if site == "qkv" else 2 * shape.ffn
    torch.manual_seed(0)
    dz, w = torch.randn(m, n, device="cuda"), torch.randn(n, d, device="cuda") * n ** -0.5
    if dtype == "fp8":
        recipe = Recipe(rowwise=False)
        dz, w = quantize_as(dz, "grad", recipe), quantize_as(w, "weight_bwd", recipe).T
    else:
        dz, w = dz.to(torch.bfloat16), w.to(torch.bfloat16)
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    return {"dz": dz, "w": w, "x": x, "rstd": torch.rand(m, device="cuda") + 0.5,
            "gamma": (torch.randn(d, device="cuda") * 0.1 + 1).to(torch.bfloat16),
            "zdz": torch.randn(m, device="cuda"), "dres": torch.randn(m, d, device="cuda", dtype=torch.bfloat16),
            "recipe": None}


def check(label: str, out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> None:
    """Print whether dx and y equal the fused kernel's and dgamma's relative error against it."""
    from codabench.metrics import rel_err
    same = [torch.equal(a, b) for a, b in zip(out[:2], ref[:2])]
    print(f"{label}: dx {'equal' if same[0] else 'DIFFERS'}, y {'equal' if same[1] else 'DIFFERS'}, dgamma rel_err "
          f"{rel_err(out[2], ref[2].double()):.1e}", flush=True)


def bench(model: str) -> None:
    """Per site and operand dtype: the fused Triton kernel, its split path, each config (checked first), the GEMM
    alone (cuBLAS; ``torch._scaled_mm`` for fp8)."""
    from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm
    for site in ("qkv", "gate_up"):
        for dtype in ("bf16", "fp8"):
            args = inputs(model, site, dtype)
            dz, w = args["dz"], args["w"]
            gemm = ((lambda: ScaledMMGemms(Recipe(rowwise=False)).dgrad(dz, w.T)) if isinstance(dz, Fp8) else
                    (lambda: dz @ w))
            paths = {FUSED: lambda: dgrad_rmsnorm.fused(**args), "split": lambda: dgrad_rmsnorm.split(**args)}
            configs = [c[1:] for c in CONFIGS if c[0] == dtype]
            for s, r, v in configs:
                paths[f"gluon {(s, r, v)}"] = lambda s=s, r=r, v=v: ws_dgrad_rmsnorm(
                    **{k: a for k, a in args.items() if k != "recipe"}, n_stages=s, sub_m=r, vec=v)
            if dtype == "bf16":
                paths["schedule's plain GEMM"] = lambda: ws_gemm(dz, w)
            paths["cuBLAS GEMM"] = gemm
            ref = paths[FUSED]()
            for c in configs:
                check(f"{model} {site} {dtype} gluon {c}", paths[f"gluon {c}"](), ref)
            data = dz.data if isinstance(dz, Fp8) else dz
            (m, n), d = data.shape, args["x"].shape[1]
            print(f"shipped at {model} {site}: {ring_stages(n * data.element_size())} stages, "
                  f"{SUB_M} rows")
            time_paths(paths, f"{model} {site} {dtype}, M = {m}, N' = {n}, d = {d}", 2 * m * n * d)
    lm_head_gemm(model)


def lm_head_gemm(model: str) -> None:
    """The schedule's plain GEMM at the LM head's forward shape (logits = h @ W^T, K = d, N = V), the GEMM a Gluon
    cross-entropy path would run, against cuBLAS (bf16; checked against it first)."""
    shape = PRESETS[model]
    torch.manual_seed(0)
    h = torch.randn(shape.tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
    w_t = (torch.randn(shape.vocab, shape.hidden, device="cuda") * shape.hidden ** -0.5).to(torch.bfloat16).T
    w_kn = w_t.contiguous()  # the schedule's bf16 B: row-major (K, N)
    c = ws_gemm(h, w_kn)
    from codabench.metrics import rel_err
    print(f"{model} LM head: schedule's GEMM rel_err against cuBLAS {rel_err(c, (h @ w_t).double()):.1e}")
    paths = {FUSED: lambda: h @ w_t, "schedule's plain GEMM": lambda: ws_gemm(h, w_kn)}
    time_paths(paths, f"{model} LM head (cuBLAS as 'fused'), M = {shape.tokens}, K = {shape.hidden}, V = "
               f"{shape.vocab}", 2 * shape.tokens * shape.hidden * shape.vocab)


if __name__ == "__main__":
    raise SystemExit(cli(__doc__, compile_only, bench))
