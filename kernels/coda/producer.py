"""Producer GEMM + residual + RMSNorm statistics (coda-spec rewrite (a)).

    x = residual + a @ w^T          (the new residual stream, written in residual's dtype)
    h = x * gamma                   (gamma as a column scale; the consumer GEMM applies rstd per row)
    rstd_m = (sum_j x_mj^2 / d + eps)^(-1/2)

One fused GEMM, declared as its epilogue (:mod:`kernels.coda.program`), writes x, h and per-N-tile partial sums of
squares of the fp32 x (before rounding); :func:`kernels.coda.reduce.finish_rstd` turns them into rstd. On fp8
operands the epilogue first dequantizes, and can write absmax partials of h so that h is quantized for the next fp8
GEMM.
:func:`norm_input` does the same for an x that no GEMM produces (the first layer's input, the LM head's input).
Split path (:mod:`kernels.coda.strategy`): the plain GEMM c = a @ w^T, then the same epilogue over c's tiles.
Gluon path, on Hopper: the warp-specialized kernel of :mod:`kernels.coda.producer_gluon` (h from the rounded x).
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from codabench.registry import Native
from kernels.coda.align import aligned, empty_rows, meets_rule
from kernels.coda.epilogue import add_tile, cast, load_tile, row_absmax, row_sumsq, scale_cols, store_tile
from kernels.coda.fp8 import quantize_from_partials
from kernels.coda.host import cdiv, next_power_of_2
from kernels.coda.mainloop import subtiled_configs, tile_desc
from kernels.coda.program import Binding, Gemm, Output, Partials, Tile, coda
from kernels.coda.reduce import finish_rstd
from kernels.coda.strategy import Gluon, hopper
from workloads.fp8 import Fp8, Recipe

try:  # the Gluon path needs Triton's Gluon; without it (strategy.Gluon) the fused and split paths only
    from kernels.coda.producer_gluon import gemm_residual_norm_gluon
except ImportError:
    gemm_residual_norm_gluon = None


@triton.jit
def residual_norm(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """(x, h): ``x = z + residual`` (the tile of descriptor ``args[0]``) and ``h = x * gamma`` (``args[1]``)."""
    x = add_tile(z, args[0], off_m, off_n)
    return x, scale_cols(x, args[1], off_n, N, BN)


@triton.jit
def norm_input_kernel(x_ptr, gamma_ptr, h_ptr, rstd_ptr, amax_ptr, M, N, stride_x, stride_h, eps,
                      AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Rows [pid BM, pid BM + BM) of x: ``h = x * gamma``, ``rstd = (mean_j x_j^2 + eps)^(-1/2)`` (and
    ``max_j |h_j|``); one pass over the rows."""
    off_m = tl.program_id(0) * BM
    x_desc = tile_desc(x_ptr, M, N, stride_x, BM, BN)
    h_desc = tile_desc(h_ptr, M, N, stride_h, BM, BN)
    ss = tl.zeros((BM,), dtype=tl.float32)
    amax = tl.zeros((BM,), dtype=tl.float32)
    for off_n in range(0, N, BN):
        x = load_tile(x_desc, off_m, off_n)
        ss += row_sumsq(x)
        h = cast(scale_cols(x, gamma_ptr, off_n, N, BN), h_desc.dtype)
        store_tile(h_desc, off_m, off_n, h)
        if AMAX:
            amax = tl.maximum(amax, row_absmax(h))
    rows = off_m + tl.arange(0, BM)
    tl.store(rstd_ptr + rows, tl.rsqrt(ss / N + eps), mask=rows < M)
    if AMAX:
        tl.store(amax_ptr + rows, amax, mask=rows < M)


def gluon_applies(arguments: dict) -> bool:
    """Where the Gluon path (:mod:`kernels.coda.producer_gluon`) applies: a Hopper GPU, plain bf16 or fp16 a, w and
    residual of one dtype, no fp8 h, and rows of a and x that meet the 16-byte rule unpadded (its kernel takes
    contiguous tensors; :mod:`kernels.coda.align`)."""
    a, w, residual = arguments["a"], arguments["w"], arguments["residual"]
    plain = all(isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) and t.dtype == a.dtype
                for t in (a, w, residual))
    return (plain and arguments["h_fp8"] is None and hopper(a.device)
            and all(meets_rule(n, a.element_size()) for n in (a.shape[1], w.shape[0])))


def model_eps(n: Native) -> dict[str, Any]:
    """The RMSNorm epsilon of a cell's model (``n.model``), as a Binding's args."""
    return {"eps": n.model.eps}


def _finish(arguments: dict, gemm: Gemm, outputs: list, partials: Partials) -> tuple:
    return (*outputs, finish_rstd(partials.ss, partials.n_tiles, outputs[0].shape[1], arguments["eps"]))


@coda(residual_norm, outputs=(Output("x", like="residual", sumsq=True), Output("h", like="residual", fp8="h_fp8")),
      inputs=(Tile("res"), "gamma_ptr"), configs=subtiled_configs((2, 1, 4)), finish=_finish,
      gluon=gemm_residual_norm_gluon and Gluon(gemm_residual_norm_gluon, gluon_applies),
      binds=(Binding(("producer_out", "producer_down"), ("x", "h", "rstd"),
                     "gemm_residual_norm: GEMM + residual + gamma + sum-of-squares partials", model_eps),))
def gemm_residual_norm(a: torch.Tensor | Fp8, w: torch.Tensor | Fp8, residual: torch.Tensor, gamma: torch.Tensor,
                       eps: float, recipe: Recipe | None = None, h_fp8: Recipe | None = None) -> Gemm:
    """``(x, h, rstd)``: ``x = residual + a @ w.T`` and ``h = x * gamma`` (residual's dtype), ``rstd`` fp32 [M]
    of x; w in nn.Linear layout (N, K). fp8 a and w (:class:`workloads.fp8.Fp8`) are dequantized in the
    epilogue (``recipe``: their fp8 recipe, whose accumulation mode the launch reads). ``h_fp8``: h returned
    quantized to e4m3 under that recipe (an activation: per tensor or per row) from absmax partials the epilogue
    writes next to the sums of squares."""
    return Gemm(a, w.T, recipe, inputs=(residual, gamma.contiguous()))


def norm_input(x: torch.Tensor, gamma: torch.Tensor, eps: float, h_fp8: Recipe | None = None
               ) -> tuple[torch.Tensor | Fp8, torch.Tensor]:
    """``(h, rstd)`` of an x no GEMM produced: ``h = x * gamma`` (x's dtype), rstd fp32 [M]; one pass over x
    (:func:`norm_input_kernel`). ``h_fp8``: h quantized to e4m3 under that recipe by a second pass, from row maxima
    of the first."""
    x, gamma = aligned(x), gamma.contiguous()
    M, N = x.shape
    h = empty_rows(M, N, x.dtype, x.device)
    rstd = torch.empty(M, device=x.device, dtype=torch.float32)
    amax = torch.empty(M, 1, device=x.device, dtype=torch.float32) if h_fp8 else rstd
    bm, bn = 16, min(256, next_power_of_2(N))
    norm_input_kernel[(cdiv(M, bm),)](x, gamma, h, rstd, amax, M, N, x.stride(0), h.stride(0), eps,
                                      AMAX=h_fp8 is not None, BM=bm, BN=bn)
    if h_fp8:
        h = quantize_from_partials(h, amax, 1, rowwise=h_fp8.rowwise_for("act"))
    return h, rstd
