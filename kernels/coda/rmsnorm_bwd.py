"""dgrad GEMM + RMSNorm backward (coda-spec, backward rewrites).

For ``y = gamma * x * rstd`` (normalized, scaled) feeding ``z = y @ W^T``, given ``dz``::

    gy = s (dz @ W)                                 (the dgrad GEMM; s an optional scalar, e.g. the loss scale)
    xhat = x rstd;   c_m = s zdz_m / d               (ZdZ: zdz_m = <z_m, dz_m>, from whoever produced dz)
    dx = dres + rstd (gy gamma - xhat c)             (added into the incoming residual gradient)
    y  = xhat gamma                                  (recomputed, for the weight gradient dW = dz^T y)
    dgamma = sum_m gy xhat                           (per-M-tile column partials + a finishing sum)

One fused GEMM, declared as its epilogue (:mod:`kernels.coda.program`), writes dx, y and the dgamma partials (the
column sums of gy xhat per M tile); :func:`kernels.coda.reduce.finish_col_sum` sums the partials. dx may overwrite
dres (each tile is read and written by the one program that owns it). rstd and c are loaded once per tile; the
epilogue runs on EPI_SUB column sub-tiles of the accumulator (autotuned: 2 or 4), so the large tile fits in shared
memory next to its TMA staging buffers. Split path (:mod:`kernels.coda.strategy`): gy = dz @ W by the
plain GEMM, then the same epilogue math on whole rows of gy in one bandwidth-bound kernel (y written over gy, dgamma
partials per program). A consumer that produces no ZdZ (a plain linear keeps no z) gets c from the row of gy there,
``c_m = (1/d) sum_j gy_mj gamma_j xhat_mj`` (= s <z_m, dz_m> / d): no extra pass, as the row is in registers; the
fused epilogue cannot, as it needs c before a tile's first column, so a call without zdz takes the split path.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels.coda.align import aligned, empty_rows, written_back
from kernels.coda.epilogue import load_block, load_cols, load_rows, load_tile, rmsnorm_dx, store_block
from kernels.coda.gemm import split_matmul
from kernels.coda.host import cdiv, next_power_of_2
from kernels.coda.mainloop import INTERPRET, num_sms, subtiled_configs
from kernels.coda.program import Binding, Gemm, Output, Partials, Tile, coda
from kernels.coda.reduce import finish_col_sum
from workloads.fp8 import Fp8, Recipe, dgrad_weight


@triton.jit
def rmsnorm_rows(gy, args, off_m, M, N, BM: tl.constexpr):
    """Per tile of gy, before its sub-tiles: gy times the scale, and the epilogue's args: x's and dres's
    descriptors, gamma, HAS_RES, and rstd and c of the tile's rows. ``args``: x's descriptor, the rstd, gamma, zdz
    and scale pointers, dres's descriptor, the flags HAS_RES and HAS_SCALE."""
    x_desc, rstd_ptr, gamma_ptr, zdz_ptr, scale_ptr, dres_desc, HAS_RES, HAS_SCALE = args
    c_scale = 1.0 / N
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
        c_scale = c_scale * scale
        gy = gy * scale
    rstd = load_rows(rstd_ptr, off_m, M, BM)
    c = load_rows(zdz_ptr, off_m, M, BM) * c_scale
    return gy, (x_desc, dres_desc, gamma_ptr, rstd, c, HAS_RES)


@triton.jit
def rmsnorm_dgrad(gy, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """The fused kernel's epilogue on the (BM, BN) sub-tile gy at (off_m, off_n) (``args``: :func:`rmsnorm_rows`'):
    (dx, y, gy xhat), the last one's column sums the dgamma partials."""
    x_desc, dres_desc, gamma_ptr, rstd, c, HAS_RES = args
    gamma = load_cols(gamma_ptr, off_n, N, BN)
    xhat = load_tile(x_desc, off_m, off_n) * rstd[:, None]
    dx = rmsnorm_dx(gy, xhat, rstd, gamma, c)
    if HAS_RES:
        dx += load_tile(dres_desc, off_m, off_n)
    return dx, xhat * gamma[None, :], gy * xhat


def scale_arg(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A scalar multiplier as the fp32 one-element tensor a kernel loads (None for the constant 1)."""
    if isinstance(scale, torch.Tensor):
        return scale.detach().reshape(1).to(device=device, dtype=torch.float32)
    if scale == 1.0:
        return None
    return torch.full((1,), scale, device=device, dtype=torch.float32)


@triton.jit
def rmsnorm_bwd_rows_kernel(gy_ptr, x_ptr, rstd_ptr, gamma_ptr, zdz_ptr, scale_ptr, dres_ptr, dx_ptr, dg_ptr, M, N,
                            stride_gy, stride_x, stride_dres, stride_dx, stride_dg, HAS_ZDZ: tl.constexpr,
                            HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """The fused kernel's epilogue math over whole rows of the dgrad GEMM's output ``gy = dz @ W`` (a bandwidth-bound
    pass, pointer accesses): program p takes the blocks of BM rows p, p + P, ... (P programs), each row whole (N <= BD
    columns), so ``c = (1/d) sum_j gy_j gamma_j xhat_j`` comes from the row itself when no ZdZ is given (HAS_ZDZ
    false), one read of gy and x either way; writes dx, y over gy, and its dgamma partial ``sum gy xhat`` over its rows
    into ``dg[p]``."""
    gamma = load_cols(gamma_ptr, 0, N, BD)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    dg = tl.zeros((BD,), dtype=tl.float32)
    for off_m in tl.range(tl.program_id(0) * BM, M, tl.num_programs(0) * BM):
        gy = load_block(gy_ptr, stride_gy, off_m, 0, M, N, BM, BD) * scale
        rstd = load_rows(rstd_ptr, off_m, M, BM)
        xhat = load_block(x_ptr, stride_x, off_m, 0, M, N, BM, BD) * rstd[:, None]
        if HAS_ZDZ:
            c = load_rows(zdz_ptr, off_m, M, BM) * (scale / N)
        else:
            c = tl.sum(gy * xhat * gamma[None, :], axis=1) / N
        dx = rmsnorm_dx(gy, xhat, rstd, gamma, c)
        if HAS_RES:
            dx += load_block(dres_ptr, stride_dres, off_m, 0, M, N, BM, BD)
        store_block(dx_ptr, stride_dx, off_m, 0, M, N, dx, BM, BD)
        store_block(gy_ptr, stride_gy, off_m, 0, M, N, xhat * gamma[None, :], BM, BD)
        dg += tl.sum(gy * xhat, axis=0)
    cols = tl.arange(0, BD)
    tl.store(dg_ptr + tl.program_id(0).to(tl.int64) * stride_dg + cols, dg, mask=cols < N)


ROW_BLOCK = (16384, 8, 2)
"""(elements per row block, num_warps, programs per SM) of :func:`rmsnorm_bwd_rows_kernel` on the GPU: BM =
max(1, elements // BD) rows per block. Measured on an H100 (M = 16384, gy given; 36 configs of 2048-16384 elements,
4-16 warps, 2-8 programs per SM): within 1% of the best at every shape, 0.121 ms at the 1B gate/up dgrad without
zdz (the norm_zdz pass and the 2-D block kernel before it: 0.181), 0.235 at 7B (0.341), 0.487 at 70B (0.663); with
zdz 0.121 / 0.235 / 0.466 at the 1B QKV / 7B gate/up / 70B QKV dgrads (0.125 / 0.244 / 0.478)."""


def rows_launch(M: int, N: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BM, BD, num_warps, programs) of :func:`rmsnorm_bwd_rows_kernel` for gy [M, N] (the interpreter: blocks of 8
    rows on its 4 programs, so a program takes several)."""
    bd = next_power_of_2(N)
    elements, warps, per_sm = (8 * bd, 4, 1) if INTERPRET else ROW_BLOCK
    bm = max(1, elements // bd)
    return bm, bd, warps, min(per_sm * num_sms(device), cdiv(M, bm))


def norm_bwd_operands(M: int, N: int, x: torch.Tensor, gamma: torch.Tensor, dres: torch.Tensor | None, inplace: bool,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(x, gamma, res, dx)`` of an RMSNorm dgrad of output [M, N], checked (x [M, N]; ``inplace`` needs dres),
    x aligned for the kernels (:func:`kernels.coda.align.aligned`), gamma contiguous; dx is the aligned dres when
    ``inplace`` (:func:`kernels.coda.align.written_back` then returns the caller's), else a new [M, N] tensor in
    dres's dtype (x's without dres); res is the kernels' residual-gradient operand: the aligned dres, or dx
    standing in for it without one (``HAS_RES`` off)."""
    if x.shape != (M, N):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)} for dz @ w of shape {(M, N)}")
    if inplace and dres is None:
        raise ValueError("inplace=True needs dres")
    x, gamma = aligned(x), gamma.contiguous()
    dres = aligned(dres) if dres is not None else None
    dx = dres if inplace else empty_rows(M, N, (dres if dres is not None else x).dtype, device)
    return x, gamma, (dres if dres is not None else dx), dx


def dgrad_rmsnorm_split(dz: torch.Tensor | Fp8, w: torch.Tensor | Fp8, x: torch.Tensor, rstd: torch.Tensor,
                        gamma: torch.Tensor, zdz: torch.Tensor | None, dres: torch.Tensor | None = None,
                        dz_scale: float | torch.Tensor = 1.0, inplace: bool = False, recipe: Recipe | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dgrad_rmsnorm` split: ``gy = dz @ w`` (:func:`kernels.coda.gemm.split_matmul`), then one pass over whole
    rows of gy (:func:`rmsnorm_bwd_rows_kernel`: c from zdz or from the row, dx, y over gy, dgamma partials) and the
    partials' sum."""
    gy = split_matmul(dz, w, recipe)
    M, N = gy.shape
    x, gamma, res, dx = norm_bwd_operands(M, N, x, gamma, dres, inplace, gy.device)
    bm, bd, warps, programs = rows_launch(M, N, gy.device)
    dg = torch.empty(programs, N, device=gy.device, dtype=torch.float32)
    scale = scale_arg(dz_scale, gy.device)
    rmsnorm_bwd_rows_kernel[(programs,)](
        gy, x, rstd, gamma, zdz if zdz is not None else rstd, scale if scale is not None else rstd, res, dx, dg, M, N,
        gy.stride(0), x.stride(0), res.stride(0), dx.stride(0), dg.stride(0), HAS_ZDZ=zdz is not None,
        HAS_RES=dres is not None, HAS_SCALE=scale is not None, BM=bm, BD=bd, num_warps=warps)
    return (written_back(dx, dres) if inplace else dx), gy, finish_col_sum(dg, programs, gamma.dtype)


def _not_inplace(arguments: dict) -> dict:
    """A call's arguments for measuring it repeatedly: dx into a new buffer instead of into dres (same traffic)."""
    return {**arguments, "inplace": False}


def _cell_args(n: dict) -> dict:
    """A cell's weight in nn.Linear layout and its loss scale (rmsnorm_dgrad_lm; 1 elsewhere)."""
    return {"w": dgrad_weight(n["w"]), "dz_scale": n.get("scale", 1.0)}


def _finish(arguments: dict, gemm: Gemm, outputs: list, partials: Partials) -> tuple:
    dx, y = outputs
    dx = written_back(dx, arguments["dres"]) if arguments["inplace"] else dx
    return dx, y, finish_col_sum(partials.cs, partials.m_tiles, arguments["gamma"].dtype)


@coda(rmsnorm_dgrad, outputs=(Output("dx"), Output("y")),
      inputs=(Tile("x"), "rstd_ptr", "gamma_ptr", "zdz_ptr", "scale_ptr", Tile("dres")), flags=("HAS_RES", "HAS_SCALE"),
      tile=rmsnorm_rows, col_sum=True, configs=subtiled_configs(), restore=("dx",), finish=_finish,
      split=dgrad_rmsnorm_split, safe=_not_inplace, fuses=lambda arguments: arguments["zdz"] is not None,
      binds=(Binding(("rmsnorm_dgrad", "rmsnorm_dgrad_qkv"), ("dx", "y", "dgamma"),
                     "dgrad GEMM + RMSNorm backward epilogue + dgamma partials", _cell_args),
             Binding(("rmsnorm_dgrad_lm",), ("dx", "y", "dgamma"),
                     "dgrad GEMM x loss scale + RMSNorm backward epilogue + dgamma partials", _cell_args)))
def dgrad_rmsnorm(dz: torch.Tensor | Fp8, w: torch.Tensor | Fp8, x: torch.Tensor, rstd: torch.Tensor,
                  gamma: torch.Tensor, zdz: torch.Tensor | None, dres: torch.Tensor | None = None,
                  dz_scale: float | torch.Tensor = 1.0, inplace: bool = False, recipe: Recipe | None = None) -> Gemm:
    """``(dx, y, dgamma)`` of RMSNorm followed by ``z = y @ w.T``, given ``dz`` (see the module docstring).

    dz [M, N'] and w [N', d] (nn.Linear layout of the consumer GEMM); x [M, d] the saved residual stream,
    rstd and zdz fp32 [M] (zdz None: the split path takes c from the rows of gy), gamma [d]. ``dres``
    [M, d] is the incoming residual gradient (None: zero), and ``inplace`` writes dx into it. ``dz_scale`` (float,
    or a one-element tensor read on the device) multiplies dz, and with it gy, dx, dgamma and c; y is not scaled. dx
    has dres's dtype (x's without dres), y dz's, dgamma gamma's.

    fp8 (:class:`workloads.fp8.Fp8`): dz e5m2 and w (its data a transposed view of the K-major (d, N') copy)
    with per-tensor scales, dequantized in the epilogue (``recipe``: their fp8 recipe, whose accumulation mode the
    launch reads); y is then bf16.
    """
    gemm = Gemm(dz, w, recipe)
    x, gamma, res, dx = norm_bwd_operands(*gemm.shape, x, gamma, dres, inplace, gemm.device)
    scale = scale_arg(dz_scale, gemm.device)
    return replace(gemm, inputs=(x, rstd, gamma, zdz, rstd if scale is None else scale, res),
                   flags={"HAS_RES": dres is not None, "HAS_SCALE": scale is not None}, outputs={"dx": dx})
