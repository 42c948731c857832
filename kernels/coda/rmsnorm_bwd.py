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
memory next to its TMA staging buffers. Split path (:mod:`kernels.coda.strategy`): gy = dz @ W by the plain GEMM,
then the same epilogue on blocks of whole rows of gy, each program looping over its blocks (:func:`rows_launch`; y
written over gy, dgamma partials per program). A consumer that produces no ZdZ (a plain linear keeps no z) gets c
from the row of gy there, ``c_m = (1/d) sum_j gy_mj gamma_j xhat_mj`` (= s <z_m, dz_m> / d): no extra pass, as the
row is in registers; the fused epilogue cannot, as it needs c before a tile's first column, so a call without zdz
takes the split path.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels.coda.align import aligned, empty_rows, written_back
from kernels.coda.epilogue import Held, given, load_cols, load_rows, load_tile, rmsnorm_dx
from kernels.coda.host import cdiv, next_power_of_2
from kernels.coda.mainloop import INTERPRET, num_sms, subtiled_configs
from kernels.coda.program import Binding, Gemm, Output, Partials, Tile, coda
from kernels.coda.reduce import finish_col_sum
from workloads.fp8 import Fp8, Recipe, dgrad_weight


@triton.jit
def rmsnorm_rows(gy, args, off_m, M, N, BM: tl.constexpr):
    """Per tile of gy, before its sub-tiles: gy times the scale, and the epilogue's args: x's and dres's
    descriptors, gamma, and rstd and c of the tile's rows. ``args``: x's descriptor, the rstd, gamma, zdz and scale
    pointers, dres's descriptor; zdz, scale and dres optional (:func:`kernels.coda.epilogue.given`). Without zdz (only
    in the split kernel, whose blocks are whole rows) c comes from the rows of gy."""
    x_desc, rstd_ptr, gamma_ptr, zdz_ptr, scale_ptr, dres_desc = args
    c_scale = 1.0 / N
    if given(scale_ptr):
        scale = tl.load(scale_ptr).to(tl.float32)
        c_scale = c_scale * scale
        gy = gy * scale
    rstd = load_rows(rstd_ptr, off_m, M, BM)
    if given(zdz_ptr):
        c = load_rows(zdz_ptr, off_m, M, BM) * c_scale
    else:  # x read once: the epilogue's load of it reads the block loaded here
        x = load_tile(x_desc, off_m, 0)
        c = tl.sum(gy * (x * rstd[:, None]) * load_cols(gamma_ptr, 0, N, x_desc.BN)[None, :], axis=1) / N
        x_desc = Held(x)
    return gy, (x_desc, dres_desc, gamma_ptr, rstd, c)


@triton.jit
def rmsnorm_dgrad(gy, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """The fused kernel's epilogue on the (BM, BN) sub-tile gy at (off_m, off_n) (``args``: :func:`rmsnorm_rows`'):
    (dx, y, gy xhat), the last one's column sums the dgamma partials."""
    x_desc, dres_desc, gamma_ptr, rstd, c = args
    gamma = load_cols(gamma_ptr, off_n, N, BN)
    xhat = load_tile(x_desc, off_m, off_n) * rstd[:, None]
    dx = rmsnorm_dx(gy, xhat, rstd, gamma, c)
    if given(dres_desc):
        dx += load_tile(dres_desc, off_m, off_n)
    return dx, xhat * gamma[None, :], gy * xhat


def scale_arg(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A scalar multiplier as the fp32 one-element tensor a kernel loads (None for the constant 1)."""
    if isinstance(scale, torch.Tensor):
        return scale.detach().reshape(1).to(device=device, dtype=torch.float32)
    if scale == 1.0:
        return None
    return torch.full((1,), scale, device=device, dtype=torch.float32)


ROW_BLOCK = (16384, 8, 2)
"""(elements per block of whole rows, num_warps, programs per SM) of the split kernel on the GPU: BM =
max(1, elements // BD) rows per block. Measured on an H100 (M = 16384, gy given; 36 configs of 2048-16384 elements,
4-16 warps, 2-8 programs per SM): within 1% of the best at every shape, 0.121 ms at the 1B gate/up dgrad without
zdz (the norm_zdz pass and the 2-D block kernel before it: 0.181), 0.235 at 7B (0.341), 0.487 at 70B (0.663); with
zdz 0.121 / 0.235 / 0.466 at the 1B QKV / 7B gate/up / 70B QKV dgrads (0.125 / 0.244 / 0.478). The kernel built from
the declaration (the hook reads x once; ``LOOP``) against the hand-written one it replaced, on an H200 (M = 16384,
the gate/up dgrads' row pass, us): 83.0 / 166.0 / 337.8 against 81.8 / 166.3 / 336.4 with zdz at 1B / 7B / 70B,
92.7 / 178.2 / 395.7 against 91.0 / 178.6 / 385.7 without."""


def rows_launch(M: int, N: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BM, BD, num_warps, programs) of the split kernel for gy [M, N]: blocks of whole rows (BD >= N columns), the
    programs looping over them (the interpreter: blocks of 8 rows on its 4 programs, so a program takes several)."""
    bd = next_power_of_2(N)
    elements, warps, per_sm = (8 * bd, 4, 1) if INTERPRET else ROW_BLOCK
    bm = max(1, elements // bd)
    return bm, bd, warps, min(per_sm * num_sms(device), cdiv(M, bm))


def norm_bwd_operands(M: int, N: int, x: torch.Tensor, gamma: torch.Tensor, dres: torch.Tensor | None, inplace: bool,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(x, gamma, dres, dx)`` of an RMSNorm dgrad of output [M, N], checked (x [M, N]; ``inplace`` needs dres),
    x and dres (None stays None) aligned for the kernels (:func:`kernels.coda.align.aligned`), gamma contiguous; dx
    is the aligned dres when ``inplace`` (:func:`kernels.coda.align.written_back` then returns the caller's), else a
    new [M, N] tensor in dres's dtype (x's without dres)."""
    if x.shape != (M, N):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)} for dz @ w of shape {(M, N)}")
    if inplace and dres is None:
        raise ValueError("inplace=True needs dres")
    x, gamma = aligned(x), gamma.contiguous()
    dres = aligned(dres) if dres is not None else None
    dx = dres if inplace else empty_rows(M, N, (dres if dres is not None else x).dtype, device)
    return x, gamma, dres, dx


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
      inputs=(Tile("x"), "rstd_ptr", "gamma_ptr", "zdz_ptr", "scale_ptr", Tile("dres")), tile=rmsnorm_rows,
      col_sum=True, configs=subtiled_configs(), restore=("dx",), finish=_finish, split_block=rows_launch,
      safe=_not_inplace, fuses=lambda arguments: arguments["zdz"] is not None,
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
    x, gamma, dres, dx = norm_bwd_operands(*gemm.shape, x, gamma, dres, inplace, gemm.device)
    return replace(gemm, inputs=(x, rstd, gamma, zdz, scale_arg(dz_scale, gemm.device), dres), outputs={"dx": dx})
