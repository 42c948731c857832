"""FP8 recipes: what an fp8 cell of the matrix computes, and its PyTorch (``torch._scaled_mm``) GEMMs.

Two dtype names of the matrix, one recipe each, both with dynamic (current) scaling:

    fp8       per-tensor: one scale per GEMM operand (the paper's recipe)
    fp8-row   rowwise: activations one scale per row (token), weights one per output channel

Forward GEMM operands are e4m3 and outputs bf16. Backward (the dgrad ops) quantizes the incoming
gradient to e5m2 (its range) and uses per-tensor scales for both dgrad operands in either recipe:
the forward's per-channel weight scales run along the dgrad's contraction dimension, where no
epilogue can apply them, so a rowwise dgrad would need a second, differently scaled copy of the
weight; one scale per gradient tensor is the usual choice for e5m2.

Scales are dequantization multipliers (``x ~ q * s``) and powers of two::

    s = 2^k, the smallest with amax <= fmax * s       (fmax = 448 for e4m3, 57344 for e5m2)

computed exactly from the bits of ``amax`` (:func:`pow2_scale`; the Triton kernels use the same bit
arithmetic), so every provider picks the same scale, ``x / s`` is exact, and quantizing a tensor that
already lies on the fp8 grid is lossless. The harness rounds each op's GEMM-operand inputs onto the
grid (:func:`round_inputs`): the float64 reference on those inputs is then the exact function every
provider computes, up to how it quantizes its intermediate activations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_EXPONENT = {E4M3: 8, E5M2: 15}
"""fmax = 1.75 * 2^P for both formats (448 and 57344): P per format."""
_MANT_1_75 = 0x600000  # fp32 mantissa bits of 1.75

Role = Literal["act", "weight", "grad", "weight_bwd"]
ROLES: dict[str, tuple[torch.dtype, bool]] = {
    "act": (E4M3, True),          # forward activation: rowwise = one scale per row (token)
    "weight": (E4M3, True),       # nn.Linear weight (N, K): rowwise = one scale per output channel
    "grad": (E5M2, False),        # incoming gradient of a dgrad GEMM: always per-tensor
    "weight_bwd": (E4M3, False),  # weight of a dgrad GEMM: always per-tensor, stored transposed
}
"""Role of a GEMM operand -> (fp8 dtype, whether the rowwise recipe scales it per row)."""


@dataclass(frozen=True)
class Recipe:
    """An fp8 recipe: the scaling granularity and the accumulation mode. It is what code below the matrix's dtype
    names passes around (the providers, the CODA kernels' host functions): the granularity has this one encoding."""

    rowwise: bool
    """Activations one scale per row (token) and weights one per output channel (``fp8-row``), or one scale per
    tensor (``fp8``); see :meth:`rowwise_for`."""
    accum: Literal["fast", "promoted"] = "fast"
    """fp8 tensor-core accumulation: "fast" (Hopper's reduced-precision accumulator throughout, like
    ``use_fast_accum=True``) or "promoted" (partial sums promoted to fp32 every K block)."""

    def rowwise_for(self, role: Role) -> bool:
        """Whether an operand of this role gets one scale per row: activations and weights under a rowwise recipe;
        the dgrad operands always per tensor."""
        return self.rowwise and ROLES[role][1]

    @property
    def label(self) -> str:
        return f"{'rowwise' if self.rowwise else 'per-tensor'} e4m3/e5m2, pow2 dynamic scales, {self.accum} accum"


def promoted(recipe: Recipe | None) -> bool:
    """Whether fp8 partial sums are promoted to fp32 every K block under ``recipe`` (``accum`` "promoted"); plain
    operands (no recipe) are not fp8 and never are. The one reading of a recipe's accumulation mode: the CODA
    mainloop's ``PROMOTE`` and ``torch._scaled_mm``'s ``use_fast_accum`` (its negation) come from it."""
    return recipe is not None and recipe.accum == "promoted"


FP8_DTYPES = ("fp8", "fp8-row")
"""The matrix's fp8 dtype names: per-tensor and rowwise scales (:func:`recipe` maps them to a :class:`Recipe`)."""


def recipe(dtype: str, accum: str = "fast") -> Recipe | None:
    """The recipe of a dtype name (None for fp32/fp16/bf16)."""
    if dtype not in FP8_DTYPES:
        return None
    if accum not in ("fast", "promoted"):
        raise ValueError(f"fp8 accumulation must be 'fast' or 'promoted', got {accum!r}")
    return Recipe(rowwise=dtype == "fp8-row", accum=accum)


class Fp8(NamedTuple):
    """A quantized tensor: ``data`` (fp8) and its dequantization ``scale`` (fp32; shape () or (rows, 1))."""

    data: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale).to(dtype)

    @property
    def T(self) -> Fp8:
        """The transposed view, with the same scale (a per-row scale then runs along the columns)."""
        return Fp8(self.data.T, self.scale)


def pow2_scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``2^k``, the smallest power of two with ``amax <= fmax 2^k`` (1 where amax is 0), exactly.

    With ``amax = m 2^E`` (m in [1, 2)) and ``fmax = 1.75 2^P``: ``k = E - P + (m > 1.75)``; the biased
    exponent is clamped to [2, 253] so ``1 / s`` is a normal fp32 number too.
    """
    bits = amax.to(torch.float32).view(torch.int32)
    biased = ((bits >> 23) & 0xFF) - FP8_EXPONENT[fp8_dtype] + ((bits & 0x7FFFFF) > _MANT_1_75).to(torch.int32)
    s = (biased.clamp(2, 253) << 23).view(torch.float32)
    return torch.where(amax > 0, s, torch.ones_like(s))


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype = E4M3, rowwise: bool = False) -> Fp8:
    """Dynamic scaling of a 2-D x: per tensor (scale shape ()) or per row (scale (rows, 1))."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True) if rowwise else xf.abs().amax()
    s = pow2_scale(amax, fp8_dtype)
    return Fp8((xf * (1.0 / s)).to(fp8_dtype), s)


def quantize_as(x: torch.Tensor, role: str, recipe: Recipe) -> Fp8:
    """Quantize an operand of the given role under ``recipe``; a ``weight_bwd`` (K, N) is stored transposed,
    (N, K) row-major, the K-major layout fp8 tensor cores need for the dgrad's second operand."""
    if role == "weight_bwd":
        x = x.t().contiguous()
    return quantize(x, ROLES[role][0], rowwise=recipe.rowwise_for(role))


def dgrad_weight(w: torch.Tensor | Fp8) -> torch.Tensor | Fp8:
    """A dgrad's weight in nn.Linear layout: a ``weight_bwd`` operand is stored transposed (:func:`quantize_as`), so
    its transposed view; a plain weight as it is."""
    return w.T if isinstance(w, Fp8) else w


def round_inputs(inputs: dict[str, torch.Tensor], operands: dict[str, str], recipe: Recipe) -> dict[str, torch.Tensor]:
    """The inputs with each GEMM operand (name -> role) replaced by its dequantized fp8 value (same dtype)."""
    out = dict(inputs)
    for name, role in operands.items():
        out[name] = quantize(inputs[name], ROLES[role][0], recipe.rowwise_for(role)).dequantize(inputs[name].dtype)
    return out


def quantize_operands(inputs: dict, operands: dict[str, str], recipe: Recipe) -> dict:
    """The inputs with each GEMM operand replaced by its :class:`Fp8` (the untimed cast of a provider)."""
    return {k: (quantize_as(v, operands[k], recipe) if k in operands else v) for k, v in inputs.items()}


# ---- the GEMMs of a reference composition ------------------------------------------------------

class TorchGemms:
    """The GEMMs of ``Op.reference`` in the inputs' dtype: ``linear(x, w) = x w^T`` and ``dgrad(dy, w) = dy w``."""

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def dgrad(self, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return dy @ w


SCALED_MM_MIN_CAPABILITY = (8, 9)
"""``torch._scaled_mm`` on CUDA needs fp8 tensor cores: Ada / Hopper and newer."""
SCALED_MM_MULTIPLE = 16
"""``torch._scaled_mm`` takes K and N in multiples of 16 only."""


def mm_size(n: int) -> int:
    """``n`` rounded up to :data:`SCALED_MM_MULTIPLE`."""
    return -(-n // SCALED_MM_MULTIPLE) * SCALED_MM_MULTIPLE


def padded(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """2-D fp8 ``data`` zero-padded to (rows, cols), or ``data`` itself where it has that shape: an operand
    ``torch._scaled_mm`` takes (:func:`mm_size`). Zeros along K add nothing to the products; the output columns of
    zero weight rows are cut off by the caller."""
    if data.shape == (rows, cols):
        return data
    out = torch.zeros(rows, cols, dtype=torch.uint8, device=data.device)
    out[:data.shape[0], :data.shape[1]] = data.view(torch.uint8)
    return out.view(data.dtype)


@dataclass(frozen=True)
class ScaledMMGemms(TorchGemms):
    """The same GEMMs as ``torch._scaled_mm`` under an fp8 recipe, bf16 out.

    Weights come pre-quantized (:func:`quantize_operands`; a ``weight_bwd`` is stored transposed, so
    ``dgrad(dy, w)`` is ``dy @ w``); an activation or gradient given as a plain tensor is quantized here,
    inside the timed region, as a real fp8 pipeline must do with its intermediate activations. Where K or N is not
    a multiple of 16, the operands are zero-padded in the call (:func:`padded`), a copy inside the timed region at
    such shapes only.
    """

    recipe: Recipe

    def _mm(self, x: torch.Tensor | Fp8, w: Fp8, role: str) -> torch.Tensor:
        xq = x if isinstance(x, Fp8) else quantize_as(x, role, self.recipe)
        (n, k), sb = w.data.shape, w.scale
        a, b = padded(xq.data, xq.data.shape[0], mm_size(k)), padded(w.data, mm_size(n), mm_size(k))
        if sb.numel() > 1 and b.shape[0] > n:  # rowwise: the padding rows' scales
            sb = torch.cat([sb, sb.new_ones(b.shape[0] - n, 1)])
        out = torch._scaled_mm(a, b.t(), xq.scale, sb.t(), out_dtype=torch.bfloat16,
                               use_fast_accum=not promoted(self.recipe))
        return out[:, :n] if out.shape[1] > n else out

    def linear(self, x, w):
        return self._mm(x, w, "act")

    def dgrad(self, dy, w):
        return self._mm(dy, w, "grad")


TORCH_GEMMS = TorchGemms()
