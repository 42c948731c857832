"""quack's expert-written fused GEMM epilogues (CuTe-DSL, Hopper+), an optional "expert fused" peer.

Written against quack-kernels 0.6.5 ``quack.gemm_interface`` (the keyword arguments used here are
the same from 0.6.1, the version the paper's code pins, to 0.6.5). The same CODA-style rewrite as
our kernels, hand written, forward only:

  ``x*g, rstd = gemm_rms(a, Wo^T, C=residual, norm_weight=gamma, premult_out=x)``
      one GEMM writes ``x = residual + a Wo^T``, ``x * gamma`` and per-row ``rstd`` (from fp32)
  rmsnorm_linear  ``_, z = gemm_norm_act(x*g, Wc^T, rstd=rstd)``               ``z = rstd * (x g) Wc^T``
  rmsnorm_swiglu  ``_, y = gemm_norm_act(x*g, Wgu^T, rstd=rstd, activation="swiglu")`` with the gate/up
                  rows interleaved once in ``prepare`` (quack's gated epilogues read column pairs)

B operands are (K, N): the transposed views of the nn.Linear weights. ``tuned=True``: the first call
(made in ``prepare``, untimed) autotunes the tile configuration for the shape.

Known problem: with quack 0.6.5, ``gemm_rms`` and ``gemm_norm_act`` raised ``TypeError: epilogue
fn depends on <...> which has no fail-closed semantic key`` under nvidia-cutlass-dsl 4.8.1 and 4.7.1
(H200, 2026-11-22). ``prepare`` turns such a TypeError of that first call into an error naming
both versions, and later cells of the process fail fast with the same message (other errors, e.g.
out of memory, stay per cell).
"""
from __future__ import annotations

import importlib.metadata
from functools import lru_cache
from typing import Any

import torch

from codabench.case import Case
from codabench.registry import REGISTRY, Implementation, Tensors
from kernels import layouts

_FAILURE: str | None = None
"""First failure of a fused epilogue in this process (the message every later cell repeats)."""


def versions() -> dict[str, str]:
    out = {}
    for dist in ("quack-kernels", "nvidia-cutlass-dsl"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def failure_message(e: Exception) -> str:
    """A one-line message naming both package versions and the first line of the error."""
    v = versions()
    first = (str(e).splitlines() or [""])[0]
    return (f"quack {v['quack-kernels']} fused epilogue failed with nvidia-cutlass-dsl {v['nvidia-cutlass-dsl']}: "
            f"{type(e).__name__}: {first} (known for quack 0.6.5 with cutlass-dsl 4.7.1 and 4.8.1; "
            "the paper's code pins quack-kernels 0.6.1)")


@lru_cache(maxsize=None)
def _gemm_interface():
    from quack import gemm_interface

    return gemm_interface


def _producer(n: Tensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x * gamma, rstd, x)`` from one GEMM with the residual add and RMS statistics in its epilogue."""
    x = torch.empty_like(n["residual"])
    xg, rstd = _gemm_interface().gemm_rms(n["a"], n["w_o"].t(), C=n["residual"], norm_weight=n["gamma"],
                                          premult_out=x, eps=n["eps"], tuned=True)
    return xg, rstd, x


def _rmsnorm_linear(n: Tensors) -> Tensors:
    xg, rstd, x = _producer(n)
    _, z = _gemm_interface().gemm_norm_act(xg, n["w_c"].t(), rstd=rstd, activation=None, tuned=True)
    return {"x": x, "z": z, "rstd": rstd}


def _rmsnorm_swiglu(n: Tensors) -> Tensors:
    xg, rstd, x = _producer(n)
    _, y = _gemm_interface().gemm_norm_act(xg, n["w_gate_up_il"].t(), rstd=rstd, activation="swiglu",
                                           tuned=True)
    return {"x": x, "y": y, "rstd": rstd}


class Quack(Implementation):
    """One op as quack's fused GEMM epilogues (forward)."""

    name = "quack"
    label = "expert fused"
    modes = ("fwd",)
    dtypes = ("fp16", "bf16")
    requires = ("sm90", "pkg:quack", "pkg:cutlass")

    def __init__(self, op: str, forward, description: str):
        self.op, self._forward, self.description = op, forward, description
        self.source = __name__

    def prepare(self, case: Case) -> Tensors:
        global _FAILURE
        if _FAILURE:
            raise RuntimeError(_FAILURE)
        native: Tensors = {k: v for k, v in case.inputs.items() if k not in ("w_gate", "w_up")}
        if "w_gate" in case.inputs:
            native["w_gate_up_il"] = layouts.interleave_rows(case.inputs["w_gate"], case.inputs["w_up"])
        native["eps"] = case.model.eps
        try:
            self._forward(native)  # compiles and autotunes for this shape, untimed
        except TypeError as e:  # raised while the CuTe DSL builds the epilogue: a version mismatch
            _FAILURE = failure_message(e)
            raise RuntimeError(_FAILURE) from e
        return native

    def run(self, native: Tensors) -> Tensors:
        return self._forward(native)

    def metadata(self) -> dict[str, Any]:
        return {**versions(), "tuned": True, "torch": torch.__version__}


REGISTRY.add(Quack("rmsnorm_linear", _rmsnorm_linear, "quack gemm_rms + gemm_norm_act (expert fused)"))
REGISTRY.add(Quack("rmsnorm_swiglu", _rmsnorm_swiglu,
                   "quack gemm_rms + gemm_norm_act(swiglu), interleaved gate/up (expert fused)"))
