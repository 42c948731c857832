"""One cell of the matrix as an implementation sees it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workloads import fp8
from workloads.models import ModelShape
from workloads.op import DTYPES, Op


@dataclass
class Case:
    op: Op
    model: ModelShape
    mode: str
    dtype: str
    """Dtype name: fp32, fp16, bf16, fp8 (per-tensor) or fp8-row (rowwise); fp8 cells get bf16 canonical
    inputs with the GEMM operands on the fp8 grid (:meth:`workloads.op.Op.inputs`)."""
    device: torch.device
    inputs: dict[str, torch.Tensor]
    """Canonical-layout inputs (weights, activations and consts)."""
    fp8_accum: str = "fast"
    """fp8 tensor-core accumulation of the run (``--fp8-accum``): ``fast`` or ``promoted``."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def recipe(self) -> fp8.Recipe | None:
        """The fp8 recipe of the cell (None for fp32/fp16/bf16): scaling granularity and accumulation mode."""
        return fp8.recipe(self.dtype, self.fp8_accum)
