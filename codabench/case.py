"""One cell of the matrix as an implementation sees it, and the fp8 steps every implementation shares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workloads import fp8
from workloads.models import ModelShape
from workloads.op import DTYPES, Op


@dataclass(frozen=True)
class Context:
    """What one call of an implementation knows of its cell besides its inputs (:class:`codabench.registry.Native`):
    the model shape, the dtype name, the device, the fp8 recipe (None: not fp8) and the GEMMs of the op's PyTorch
    composition (:attr:`Case.mm`)."""

    model: ModelShape
    dtype: str
    device: torch.device
    recipe: fp8.Recipe | None
    mm: fp8.TorchGemms


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
    checkpointing: bool = False
    """Activation checkpointing in the whole-model training steps (``--checkpointing``)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def recipe(self) -> fp8.Recipe | None:
        """The fp8 recipe of the cell (None for fp32/fp16/bf16): scaling granularity and accumulation mode."""
        return fp8.recipe(self.dtype, self.fp8_accum)

    @property
    def mm(self) -> fp8.TorchGemms:
        """The GEMMs of the op's PyTorch composition (``Op.reference``'s ``mm``) in this cell: ``F.linear`` in the
        inputs' dtype, or ``torch._scaled_mm`` under the cell's fp8 recipe."""
        recipe = self.recipe
        return fp8.ScaledMMGemms(recipe) if recipe is not None else fp8.TORCH_GEMMS

    @property
    def context(self) -> Context:
        """The cell as its calls see it (no inputs: a resident call's context holds no canonical tensor)."""
        return Context(self.model, self.dtype, self.device, self.recipe, self.mm)

    def mm_skip_reason(self) -> str | None:
        """Why :attr:`mm` cannot run here (``torch._scaled_mm`` on a GPU without fp8 tensor cores); None when it can."""
        if self.recipe is None or self.device.type != "cuda":
            return None
        if torch.cuda.get_device_capability(self.device) < fp8.SCALED_MM_MIN_CAPABILITY:
            return "skipped: fp8 (torch._scaled_mm) needs an sm89+ GPU"
        return None

    def quantize(self, native: dict[str, Any], renamed: dict[str, str] | None = None) -> dict[str, Any]:
        """fp8 cells: ``native`` with the op's GEMM operands (``op.fp8_operands``) quantized under the cell's recipe
        (:func:`workloads.fp8.quantize_operands`); other dtypes: ``native`` unchanged.

        ``renamed`` maps a canonical operand to the native tensor built from it (``w_gate``, ``w_up`` ->
        ``w_gate_up``), which is quantized as one tensor in the operand's role.
        """
        recipe = self.recipe
        if recipe is None:
            return native
        roles = {(renamed or {}).get(k, k): role for k, role in self.op.fp8_operands.items()}
        return fp8.quantize_operands(native, roles, recipe)
