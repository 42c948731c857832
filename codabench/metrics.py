"""Error metrics and the pass rule (coda-spec.md, "Acceptance for numerical error").

For an output ``y`` and its float64 reference ``r`` (both flattened):

    rel_err = ||y - r||_F / ||r||_F        (||y - r||_F when ||r||_F = 0)
    max_abs = max_i |y_i - r_i|
    cosine  = <y, r> / (||y|| ||r||)       (1 when both are zero)

An output passes when it is finite and ``rel_err <= 2 * torch_rel_err + FLOOR[dtype]``, where
``torch_rel_err`` is the error of the plain PyTorch (torch-eager) computation of the same output
in the same dtype. The floor keeps outputs that PyTorch computes exactly (e.g. a copy) from
demanding bit-exactness: about a quarter of the dtype's unit roundoff for 16-bit types, and 1e-6
for fp32. NaN or Inf never passes.

fp8 cells (``fp8`` per-tensor, ``fp8-row`` rowwise): ``r`` is the float64 reference on the inputs
rounded onto the recipe's fp8 grid, and ``torch_rel_err`` is the error of the torch-eager composition
with ``torch._scaled_mm`` GEMMs under the same recipe, which quantizes its intermediate activations
the same way. The floor is bf16's (fp8 cells' outputs are bf16). The error against the unquantized
bf16 computation is reported beside it (:mod:`codabench.correctness`), not judged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOOR = {"fp32": 1e-6, "fp16": 1e-4, "bf16": 1e-3, "fp8": 1e-3, "fp8-row": 1e-3}
TOLERANCE_FACTOR = 2.0


@dataclass(frozen=True)
class ErrorStats:
    rel_err: float
    max_abs: float
    cosine: float
    n_nan: int = 0
    n_inf: int = 0

    @property
    def finite(self) -> bool:
        return self.n_nan == 0 and self.n_inf == 0


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """Metrics of ``out`` against ``ref`` (same shape), computed in float64."""
    y = out.detach().to(torch.float64).flatten()
    r = ref.detach().to(torch.float64).flatten().to(y.device)
    n_nan = int(torch.isnan(y).sum())
    n_inf = int(torch.isinf(y).sum())
    if n_nan or n_inf:
        return ErrorStats(math.nan, math.nan, math.nan, n_nan, n_inf)
    diff = y - r
    dnorm, rnorm, ynorm = (float(torch.linalg.vector_norm(t)) for t in (diff, r, y))
    rel = dnorm / rnorm if rnorm > 0 else dnorm
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    if rnorm > 0 and ynorm > 0:
        cosine = float(torch.dot(y, r)) / (ynorm * rnorm)
    else:
        cosine = 1.0 if rnorm == ynorm else 0.0
    return ErrorStats(rel, max_abs, cosine)


def error_ratio(rel_err: float, torch_rel_err: float | None) -> float | None:
    """``rel_err / torch_rel_err``; 1 when both are 0, inf when only PyTorch's is 0, None when unknown."""
    if torch_rel_err is None or math.isnan(torch_rel_err) or math.isnan(rel_err):
        return None
    if torch_rel_err == 0:
        return 1.0 if rel_err == 0 else math.inf
    return rel_err / torch_rel_err


def passes(stats: ErrorStats, torch_rel_err: float | None, dtype: str) -> bool:
    """The pass rule above; without a PyTorch error to compare with, only the floor is allowed."""
    if not stats.finite:
        return False
    allowed = FLOOR[dtype]
    if torch_rel_err is not None and math.isfinite(torch_rel_err):
        allowed += TOLERANCE_FACTOR * torch_rel_err
    return stats.rel_err <= allowed
