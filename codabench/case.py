"""One cell of the matrix as an implementation sees it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workloads.models import ModelShape
from workloads.op import DTYPES, Op


@dataclass
class Case:
    op: Op
    model: ModelShape
    mode: str
    dtype: str
    """Dtype name: fp32, fp16, bf16 or fp8 (fp8 cells get bf16 canonical inputs)."""
    device: torch.device
    inputs: dict[str, torch.Tensor]
    """Canonical-layout inputs (weights, activations and consts)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
