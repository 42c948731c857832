"""Error metrics and the pass rule (coda-spec.md, "Acceptance for numerical error"): the one definition that the
harness, the kernel tests, the CODA model check and the benchmark scripts all use.

For an output ``y`` and its float64 reference ``r`` (both flattened):

    rel_err = ||y - r||_F / ||r||_F        (||y - r||_F when ||r||_F = 0)
    max_abs = max_i |y_i - r_i|
    cosine  = <y, r> / (||y|| ||r||)       (1 when both are zero)

An output passes when it is finite and

    rel_err <= TOLERANCE_FACTOR x torch_rel_err + FLOOR[dtype]         (TOLERANCE_FACTOR = 2)

where ``torch_rel_err`` is the error of the plain PyTorch (torch-eager) computation of the same output in the
same dtype, and ``dtype`` the torch dtype that computation runs in (a cell's :attr:`Case.torch_dtype`). The
floor keeps outputs that PyTorch computes exactly (e.g. a copy) from demanding bit-exactness: about a quarter of
the dtype's unit roundoff for 16-bit types, and 1e-6 for fp32. NaN or Inf never passes.

fp8 cells (``fp8`` per-tensor, ``fp8-row`` rowwise) compute in bf16 (their canonical inputs and outputs), so the
floor is bf16's. ``r`` is the float64 reference on the inputs rounded onto the recipe's fp8 grid, and
``torch_rel_err`` is the error of the torch-eager composition with ``torch._scaled_mm`` GEMMs under the same
recipe, which quantizes its intermediate activations the same way. The error against the unquantized bf16
computation is reported beside it (:mod:`codabench.correctness`), not judged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOOR: dict[torch.dtype, float] = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}
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


def _flat64(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = out.detach().to(torch.float64).flatten()
    return y, ref.detach().to(torch.float64).flatten().to(y.device)


def _relative(dnorm: float, rnorm: float) -> float:
    return dnorm / rnorm if rnorm > 0 else dnorm


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` in float64 (``||out - ref||_F`` when ref is zero; NaN or inf when ``out``
    is not finite)."""
    y, r = _flat64(out, ref)
    return _relative(float(torch.linalg.vector_norm(y - r)), float(torch.linalg.vector_norm(r)))


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """Metrics of ``out`` against ``ref`` (same shape), computed in float64; NaN metrics when ``out`` is not
    finite, with its NaN and Inf counts."""
    y, r = _flat64(out, ref)
    n_nan = int(torch.isnan(y).sum())
    n_inf = int(torch.isinf(y).sum())
    if n_nan or n_inf:
        return ErrorStats(math.nan, math.nan, math.nan, n_nan, n_inf)
    diff = y - r
    dnorm, rnorm, ynorm = (float(torch.linalg.vector_norm(t)) for t in (diff, r, y))
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    if rnorm > 0 and ynorm > 0:
        cosine = float(torch.dot(y, r)) / (ynorm * rnorm)
    else:
        cosine = 1.0 if rnorm == ynorm else 0.0
    return ErrorStats(_relative(dnorm, rnorm), max_abs, cosine)


def error_ratio(rel_err: float, torch_rel_err: float | None) -> float | None:
    """``rel_err / torch_rel_err``; 1 when both are 0, inf when only PyTorch's is 0, None when unknown."""
    if torch_rel_err is None or math.isnan(torch_rel_err) or math.isnan(rel_err):
        return None
    if torch_rel_err == 0:
        return 1.0 if rel_err == 0 else math.inf
    return rel_err / torch_rel_err


def tolerance(torch_rel_err: float | None, dtype: torch.dtype) -> float:
    """The largest ``rel_err`` that passes: ``TOLERANCE_FACTOR x torch_rel_err + FLOOR[dtype]``; the floor alone
    without a (finite) PyTorch error to compare with."""
    allowed = FLOOR[dtype]
    if torch_rel_err is not None and math.isfinite(torch_rel_err):
        allowed += TOLERANCE_FACTOR * torch_rel_err
    return allowed


def passes(rel_err: float, torch_rel_err: float | None, dtype: torch.dtype) -> bool:
    """The pass rule above: ``rel_err`` finite and within :func:`tolerance`."""
    return math.isfinite(rel_err) and rel_err <= tolerance(torch_rel_err, dtype)
