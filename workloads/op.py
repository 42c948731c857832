"""The op contract: what every workload in the catalogue defines.

An op is one cell family of the matrix. It generates its inputs in the canonical layout,
holds the unfused reference math, and states the GEMMs it must do (for FLOPs and the
speed-of-light) and the outputs that are compared.

Two kinds of op:
- ``autograd``: ``reference`` is a differentiable forward; the harness derives the modes
  ``fwd`` (no grad), ``bwd`` (backward alone on a fresh graph) and ``fwd_bwd``. Gradients are
  taken w.r.t. every floating input not listed in ``consts``, against random upstream
  gradients (1 for a scalar loss).
- ``direct``: ``reference`` computes the op's outputs directly (e.g. a backward kernel as one
  op); it has exactly one mode, which names what it is (``fwd`` or ``bwd``).

``reference`` does its GEMMs through ``mm`` (:mod:`workloads.fp8`): plain torch by default, or
``torch._scaled_mm`` under an fp8 recipe (the fp8 PyTorch baselines). fp8 cells exist for the
``fwd`` mode and for direct ops; their inputs are those of bf16 with the GEMM operands named in
``fp8_operands`` rounded onto the recipe's fp8 grid (:meth:`Op.inputs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from workloads import fp8
from workloads.models import ModelShape

MODES = ("fwd", "bwd", "fwd_bwd")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16,
          "fp8-row": torch.bfloat16}
"""Dtype name -> dtype of the canonical inputs. fp8 cells (per-tensor ``fp8``, rowwise ``fp8-row``) get
bf16 inputs on the fp8 grid; quantizing them is an implementation's untimed ``prepare`` step."""


@dataclass(frozen=True)
class Gemm:
    """One GEMM ``C[m, n] = A @ B`` with A stored (m, k) or (k, m) and B stored (n, k) or (k, n)."""

    m: int
    n: int
    k: int
    a_layout: Literal["mk", "km"] = "mk"
    b_layout: Literal["nk", "kn"] = "nk"

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def backward(self) -> tuple["Gemm", "Gemm"]:
        """dgrad ``dA = dC @ W`` and wgrad ``dW = dC^T A`` of a forward ``C = A W^T``."""
        return Gemm(self.m, self.k, self.n, "mk", "kn"), Gemm(self.n, self.k, self.m, "km", "kn")


class Op:
    """Base class of an op of the catalogue; subclasses fill in the class attributes and methods."""

    name: ClassVar[str]
    kind: ClassVar[Literal["autograd", "direct"]] = "autograd"
    modes: ClassVar[tuple[str, ...]] = MODES
    description: ClassVar[str] = ""
    outputs: ClassVar[tuple[str, ...]] = ()
    """Outputs every implementation must return (canonical layout)."""
    side_outputs: ClassVar[tuple[str, ...]] = ()
    """fp32 side outputs (rstd, LSE, ...) the reference also returns; compared when an implementation returns them."""
    consts: ClassVar[tuple[str, ...]] = ()
    """Inputs that get no gradient (targets, positions, saved statistics)."""
    fp8_operands: ClassVar[dict[str, fp8.Role]] = {}
    """Inputs that are GEMM operands, with their role in an fp8 recipe (no entry: the op has no fp8 cells)."""
    halved: ClassVar[tuple[str, ...]] = ()
    """Floating inputs that :meth:`rescaled` halves where the others double. The checks compare against PyTorch with
    the error allowed at the original scale, so the new inputs must keep the problem as well conditioned: a saved
    statistic stays consistent with its input (rstd = 1 / rms(x) halves when x doubles), and an LM head's weight
    halves so that its logits keep their scale. (Logits x4 sharpened the softmax so much that PyTorch's own error in
    the lse from its bf16 logits grew ~200-fold, past what the checks allow: the fp8 CE cells failed on an H200.)"""
    level: ClassVar[Literal["pattern", "kernel", "model"]] = "pattern"
    """What a cell of the op measures, which decides the suites that hold it (:mod:`workloads.suites`):

    - ``pattern``: a fused pattern of the CODA block as a model calls it (its forward and backward), a direct
      backward op of the block, or a plain GEMM of its shapes: the ``quick`` and ``full`` suites;
    - ``kernel``: one CODA kernel's host call alone at one of the block's shapes (the producer GEMM, a consumer
      epilogue, an elementwise backward): the ``kernels`` suite, which leaves ``quick`` and ``full`` at the level
      a framework sees;
    - ``model``: a step of a whole model (``train_step``): the ``train`` suite and its own report section.
    """

    def make_inputs(self, model: ModelShape, dtype: torch.dtype, device: torch.device | str,
                    seed: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def reference(self, inputs: dict[str, torch.Tensor], model: ModelShape,
                  mm: fp8.TorchGemms = fp8.TORCH_GEMMS) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def inputs(self, model: ModelShape, dtype: str, device: torch.device | str, seed: int) -> dict[str, torch.Tensor]:
        """The canonical inputs of a cell of dtype name ``dtype`` (fp8: bf16 with the operands on the fp8 grid)."""
        inp = self.make_inputs(model, DTYPES[dtype], device, seed)
        rec = fp8.recipe(dtype)
        return self.derived_inputs(fp8.round_inputs(inp, self.fp8_operands, rec), model) if rec is not None else inp

    def rescaled(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inputs at another exact scale, for the new inputs of the anti-cheat checks (:mod:`codabench.verify`):
        each floating input x2, or /2 where named in :attr:`halved` (exact in every float format, fp8's grid
        included, but for fp16 subnormals halved), so that every input changes even where a new seed leaves it as it
        was."""
        return {k: (v / 2 if k in self.halved else v * 2) if isinstance(v, torch.Tensor) and v.is_floating_point()
                else v for k, v in inputs.items()}

    def derived_inputs(self, inputs: dict[str, torch.Tensor], model: ModelShape) -> dict[str, torch.Tensor]:
        """Inputs computed from other inputs (saved statistics), recomputed after fp8 rounding; default: none."""
        return inputs

    def na_reason(self, model: ModelShape) -> str | None:
        """Why the op is not defined at ``model``'s shape (an ``n/a: ...`` reason for each of its cells), or None;
        default: always defined."""
        return None

    def has_cell(self, mode: str, dtype: str) -> bool:
        """Whether the matrix has this (mode, dtype): fp8 covers forward and direct ops with fp8 operands."""
        if mode not in self.modes:
            return False
        if dtype in fp8.FP8_DTYPES:
            return bool(self.fp8_operands) and (self.kind == "direct" or mode == "fwd")
        return True

    def forward_gemms(self, model: ModelShape) -> list[Gemm]:
        raise NotImplementedError

    def gemms(self, model: ModelShape, mode: str) -> list[Gemm]:
        """The plain GEMMs a mode must do: its FLOPs and its speed-of-light."""
        fwd = self.forward_gemms(model)
        if self.kind == "direct" or mode == "fwd":
            return fwd
        bwd = [g for f in fwd for g in f.backward()]
        return bwd if mode == "bwd" else fwd + bwd

    def flops(self, model: ModelShape, mode: str) -> int:
        return sum(g.flops for g in self.gemms(model, mode))

    def differentiable(self, inputs: dict[str, torch.Tensor]) -> list[str]:
        if self.kind == "direct":
            return []
        return [k for k, v in inputs.items() if k not in self.consts and v.is_floating_point()]

    def grad_outputs(self, outputs: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
        """Upstream gradients for the compared outputs: random normal, or 1 for a scalar."""
        gen = torch.Generator(device=next(iter(outputs.values())).device).manual_seed(seed)
        out = {}
        for k in self.outputs:
            v = outputs[k]
            out[k] = torch.ones_like(v) if v.dim() == 0 else torch.randn(
                v.shape, generator=gen, device=v.device, dtype=torch.float32).to(v.dtype)
        return out


class InputMaker:
    """Seeded random tensors on one device: ``x = InputMaker(...); a = x.normal(M, K)``."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str, seed: int):
        self.dtype, self.device = dtype, torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def normal(self, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (t * std + mean).to(self.dtype)

    def weight(self, out_features: int, in_features: int) -> torch.Tensor:
        """nn.Linear layout W[out, in], std 1/sqrt(in) so activations stay O(1)."""
        return self.normal(out_features, in_features, std=in_features ** -0.5)

    def gamma(self, n: int) -> torch.Tensor:
        return self.normal(n, std=0.1, mean=1.0)

    def targets(self, m: int, vocab: int, ignore_frac: float = 0.05) -> torch.Tensor:
        """``m`` class targets in [0, vocab), about ``ignore_frac`` of them -100 (ignored), never the first: a mean
        loss over them has at least one term (a few tokens would otherwise draw all ignored, a NaN loss)."""
        t = torch.randint(0, vocab, (m,), generator=self.gen, device=self.device)
        drop = torch.rand(m, generator=self.gen, device=self.device) < ignore_frac
        drop[0] = False
        return t.masked_fill(drop, -100)

    def positions(self, m: int, seq_len: int) -> torch.Tensor:
        return torch.arange(m, device=self.device) % seq_len
