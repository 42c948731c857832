"""Liger Kernel baselines: cuBLAS GEMMs (``F.linear``) + Liger's Triton kernels, forward and backward.

Checked against liger-kernel 0.8.5 (its sources: ``liger_kernel/ops/*.py``, ``liger_kernel/backends``).
Each op is composed the way Liger is used in a model, from Liger's autograd Functions:

  producer        ``p = a Wp^T`` (cuBLAS); ``h, x = LigerFusedAddRMSNormFunction(p, residual, gamma)``
                  (``x = residual + p`` is written by the kernel, ``h = rmsnorm(x)``)
  rmsnorm_linear  ``z = h Wc^T``
  rmsnorm_swiglu  ``y = LigerFusedGateUpSiLUMulFunction(h [Wg; Wu]^T)``: one GEMM of width 2f; the
                  gate/up weights are concatenated once in ``prepare`` (untimed)
  rmsnorm_rope    ``qkv = h Wqkv^T``; q and k rotated by ``LigerRopeFunction`` (Hugging Face half-split,
                  the canonical layout, so Wqkv is untouched) with fp32 cos/sin tables built in ``prepare``
                  from the positions (angles in fp64, then cos/sin rounded to fp32)
  rmsnorm_ce      ``loss = LigerFusedLinearCrossEntropyFunction(h, Wlm, target)`` (logits never stored)
  lm_head_ce      ``h = LigerRMSNormFunction(x, gamma)``; loss as above
  block           out-proj -> fused add+RMSNorm -> gate/up GEMM + fused SwiGLU -> down-proj -> fused
                  add+RMSNorm -> QKV GEMM -> RoPE

Implementation pinning: liger 0.8.5 can route its *dispatcher* entry points to a CuTe-DSL
implementation when ``cutlass.cute`` is importable. This module calls the Triton Function classes of
``liger_kernel.ops.<op>`` directly (they are the Triton kernels whatever the dispatcher would pick),
pins the dispatcher anyway with ``liger_kernel.backends.set_impl("nvidia-triton")`` when that API
exists, and records the implementation the dispatcher resolves for each piece in ``metadata()``.

Fused linear cross-entropy computes the gradients inside its forward when its input requires grad,
so the CE ops are compared in ``fwd`` (no grad: a true forward) and ``fwd_bwd``; ``bwd`` alone would
only time the scaling of already computed gradients and is reported n/a (``grads_in_forward``). Weight-gradient
accumulation uses ``accum_dtype=float32``. It calls ``.item()``, so it cannot be captured in a CUDA graph.

Input mutation: no call here writes into a canonical input. Liger's RoPE rotates in place, but only
the copies it makes of the strided q/k views of the freshly computed QKV GEMM output; fused
add+RMSNorm writes new tensors; the RMSNorm backward runs with ``in_place=False``.

Not provided, and why:
  - ``liger-compile``: the composition is cuBLAS GEMMs plus Liger's kernels, with no PyTorch
    elementwise glue left for Inductor to fuse (only the RoPE concat), so a compiled variant would
    measure the same kernels; moreover Dynamo does not trace Liger's kernel launch path under
    ``fullgraph=True`` (seen with torch 2.13 / triton 3.9: it stops at triton's C helper
    ``getenv_bool``), and fused linear CE graph-breaks on ``.item()`` by design.
  - ``rmsnorm_dgrad`` / ``swiglu_dgrad``: Liger has no dgrad-GEMM-plus-epilogue piece; its backward
    kernels run inside its autograd Functions, which the forward ops above exercise.
  - side outputs (rstd, LSE): Liger's Functions keep them internal.

fp8 cells (``fp8``, ``fp8-row``; forward only): "``_scaled_mm`` + Liger's elementwise kernels". Every GEMM
is a ``torch._scaled_mm`` under the cell's recipe (:class:`workloads.fp8.ScaledMMGemms`): the weights and
the op's input activation are quantized in ``prepare``, the intermediate activations (``h``, the SwiGLU
output) inside the timed region. The concatenated gate/up weight is quantized as one tensor: per-tensor,
its scale is the larger of the two weights' scales (an fp8 model with a fused gate/up weight has one
scale too), so the values of the other weight that fall below e4m3's normal range after the rescale
lose bits; rowwise scales are per output channel and concatenate exactly. Fused linear cross-entropy
runs its own bf16 GEMM, so the CE ops compose ``logits = _scaled_mm(h, Wlm)`` with Liger's plain
cross-entropy kernel (``LigerCrossEntropyFunction``) on the logits upcast to fp32, as the reference's
``F.cross_entropy`` does (in bf16 Liger would also accumulate the loss in bf16).
"""
from __future__ import annotations

import importlib.metadata
import inspect
import logging
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import torch

from codabench.case import Case
from codabench.registry import REGISTRY, Implementation, Native, Tensors
from kernels import layouts
from workloads import fp8
from workloads import reference as R
from workloads.models import ModelShape

# Liger's backend discovery logs a warning for every backend it cannot import (CuTe-DSL, Ascend, cuTile: 11 lines that
# are no news on a machine without them); the implementation each op resolves to is recorded in env.json instead.
logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)

PINNED_IMPL = "nvidia-triton"
# dispatcher op names of the pieces used here (for the resolved-implementation record)
DISPATCH_OPS = ("fused_add_rms_norm", "rms_norm", "swiglu", "rope", "fused_linear_cross_entropy", "cross_entropy")


@lru_cache(maxsize=None)
def _ops() -> SimpleNamespace:
    """Liger's Triton autograd Functions (imported on first use; the module imports without Liger)."""
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    return SimpleNamespace(add_rms_norm=LigerFusedAddRMSNormFunction, rms_norm=LigerRMSNormFunction,
                           gate_up_swiglu=LigerFusedGateUpSiLUMulFunction, rope=LigerRopeFunction,
                           linear_ce=LigerFusedLinearCrossEntropyFunction, cross_entropy=LigerCrossEntropyFunction)


@lru_cache(maxsize=None)
def _signature(fn: type[torch.autograd.Function]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Argument names of ``fn.forward`` after ctx, and their defaults (inspected once per class)."""
    params = list(inspect.signature(fn.forward).parameters.values())[1:]
    return tuple(p.name for p in params), {p.name: p.default for p in params if p.default is not p.empty}


def _apply(fn: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
    """``fn.apply`` with keyword arguments bound to the positions of ``fn.forward`` (any torch, any Liger)."""
    names, defaults = _signature(fn)
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"{fn.__name__}.forward of this Liger version has no argument(s) {sorted(unknown)}")
    rest = [kwargs[n] if n in kwargs else defaults[n] for n in names[len(args):]]
    return fn.apply(*args, *rest)


@lru_cache(maxsize=None)
def pin_triton() -> dict[str, str]:
    """Pin Liger's dispatcher to Triton (when the API exists); the implementation it resolves per piece."""
    try:
        import liger_kernel.backends as backends
    except ImportError:
        return {"dispatcher": "absent in this liger version (Function classes are Triton)"}
    if not hasattr(backends, "set_impl"):
        return {"dispatcher": "no set_impl in this liger version (Function classes are Triton)"}
    import liger_kernel.functional  # noqa: F401  (declares the dispatcher ops)

    backends.set_impl(PINNED_IMPL)
    resolved = {}
    for op in DISPATCH_OPS:
        try:
            resolved[op] = backends.resolve_impl(op).impl_name
        except Exception as e:  # an op the dispatcher does not know in this version
            resolved[op] = f"unresolved ({type(e).__name__})"
    return resolved


# ---- pieces -----------------------------------------------------------------------------------

def _add_rmsnorm(p: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float):
    """``(h, x)`` with ``x = residual + p`` and ``h = rmsnorm(x; gamma)``."""
    return _apply(_ops().add_rms_norm, p, residual, gamma, eps, casting_mode="llama", in_place=False)


def _linear_ce(h: torch.Tensor, w_lm: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = _apply(_ops().linear_ce, h, w_lm, target, ignore_index=R.IGNORE_INDEX, reduction="mean",
                 accum_dtype=torch.float32)
    return out[0] if isinstance(out, tuple) else out


def _lm_head_loss(n: Native, h: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``h Wlm^T``: fused linear CE, or (fp8) ``_scaled_mm`` logits + Liger's CE kernel."""
    if not isinstance(n["w_lm"], fp8.Fp8):
        return _linear_ce(h, n["w_lm"], n["target"])
    logits = n.mm.linear(h, n["w_lm"]).float()
    return _apply(_ops().cross_entropy, logits, n["target"], None, ignore_index=R.IGNORE_INDEX, reduction="mean")[0]


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin of shape (1, M, dh) in Hugging Face layout (each half repeated), one row per token."""
    ang = R.rope_angles(positions, head_dim, theta, torch.float64)
    cos, sin = ang.cos().float(), ang.sin().float()
    return torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]


def _rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, model: ModelShape) -> torch.Tensor:
    """Half-split RoPE on the q and k parts of a packed (M, q) tensor with ``LigerRopeFunction``.

    Liger wants q as (B, H, S, D) logically with (B, S, H, D) memory: each token is one row of S
    (B = 1, S = M), so the per-token tables above serve any positions.
    """
    m, h, hkv, dh = qkv.shape[0], model.heads, model.kv_heads, model.head_dim
    q, k, v = qkv.split([h * dh, hkv * dh, hkv * dh], -1)
    q, k = q.view(1, m, h, dh).transpose(1, 2), k.view(1, m, hkv, dh).transpose(1, 2)
    q, k = _ops().rope.apply(q, k, cos, sin)
    return torch.cat([q.transpose(1, 2).reshape(m, -1), k.transpose(1, 2).reshape(m, -1), v], -1)


# ---- the ops ----------------------------------------------------------------------------------

# ``mm = n.mm``: the GEMMs, ``F.linear`` or (fp8) ``torch._scaled_mm`` (codabench.case.Case.mm)

def _rmsnorm_linear(n: Native) -> Tensors:
    mm = n.mm
    h, x = _add_rmsnorm(mm.linear(n["a"], n["w_o"]), n["residual"], n["gamma"], n.model.eps)
    return {"x": x, "z": mm.linear(h, n["w_c"])}


def _rmsnorm_swiglu(n: Native) -> Tensors:
    mm = n.mm
    h, x = _add_rmsnorm(mm.linear(n["a"], n["w_o"]), n["residual"], n["gamma"], n.model.eps)
    return {"x": x, "y": _ops().gate_up_swiglu.apply(mm.linear(h, n["w_gate_up"]))}


def _rmsnorm_rope(n: Native) -> Tensors:
    mm = n.mm
    h, x = _add_rmsnorm(mm.linear(n["a"], n["w_down"]), n["residual"], n["gamma"], n.model.eps)
    return {"x": x, "qkv": _rope_qkv(mm.linear(h, n["w_qkv"]), n["cos"], n["sin"], n.model)}


def _rmsnorm_ce(n: Native) -> Tensors:
    h, x = _add_rmsnorm(n.mm.linear(n["a"], n["w_down"]), n["residual"], n["gamma"], n.model.eps)
    return {"x": x, "loss": _lm_head_loss(n, h)}


def _lm_head_ce(n: Native) -> Tensors:
    h = _apply(_ops().rms_norm, n["x"], n["gamma"], n.model.eps, casting_mode="llama", in_place=False)
    return {"loss": _lm_head_loss(n, h)}


def _block(n: Native) -> Tensors:
    eps, mm = n.model.eps, n.mm
    h1, x1 = _add_rmsnorm(mm.linear(n["a"], n["w_o"]), n["residual"], n["gamma_mlp"], eps)
    y = _ops().gate_up_swiglu.apply(mm.linear(h1, n["w_gate_up"]))
    h2, x = _add_rmsnorm(mm.linear(y, n["w_down"]), x1, n["gamma_attn"], eps)
    return {"x": x, "qkv": _rope_qkv(mm.linear(h2, n["w_qkv"]), n["cos"], n["sin"], n.model)}


class Liger(Implementation):
    """One op composed from cuBLAS GEMMs and Liger's Triton kernels."""

    name = "liger"
    label = "baseline"
    dtypes = ("fp32", "fp16", "bf16", *fp8.FP8_DTYPES)
    requires = ("cuda", "pkg:liger_kernel")
    native_consts = ("cos", "sin")

    def __init__(self, op: str, forward, modes: tuple[str, ...], description: str, grads_in_forward: bool = False):
        self.op, self._forward, self.modes, self.description = op, forward, modes, description
        self.grads_in_forward = grads_in_forward
        self.source = __name__

    def skip_reason(self, case: Case) -> str | None:
        return super().skip_reason(case) or case.mm_skip_reason()

    def prepare(self, case: Case) -> Tensors:
        pin_triton()
        _ops()  # import the kernels' modules outside any timed region
        native: Tensors = {k: v for k, v in case.inputs.items() if k not in ("w_gate", "w_up", "positions")}
        if "w_gate" in case.inputs:
            native["w_gate_up"] = layouts.concat_rows(case.inputs["w_gate"], case.inputs["w_up"])
        if "positions" in case.inputs:
            native["cos"], native["sin"] = rope_tables(case.inputs["positions"], case.model.head_dim,
                                                       case.model.rope_theta)
        native = case.quantize(native, {"w_gate": "w_gate_up", "w_up": "w_gate_up"})
        return native

    def run(self, native: Native) -> Tensors:
        return self._forward(native)

    def grads_to_canonical(self, grads: Tensors, native: Native) -> Tensors:
        return split_gate_up_grads(grads)

    def metadata(self) -> dict[str, Any]:
        return {"liger_kernel": importlib.metadata.version("liger_kernel"),
                "liger_entry_points": "liger_kernel.ops.* autograd Functions (Triton)",
                "liger_resolved_impl": pin_triton(), "torch": torch.__version__}


def split_gate_up_grads(grads: Tensors) -> Tensors:
    """Map the gradient of the concatenated gate/up weight back to the two canonical weights."""
    out = dict(grads)
    if "w_gate_up" in out:
        out["w_gate"], out["w_up"] = layouts.split_rows(out.pop("w_gate_up"))
    return out


_ALL = ("fwd", "bwd", "fwd_bwd")
for _op, _fn, _modes, _desc, _in_fwd in [
    ("rmsnorm_linear", _rmsnorm_linear, _ALL, "cuBLAS + Liger fused add+RMSNorm", False),
    ("rmsnorm_swiglu", _rmsnorm_swiglu, _ALL, "cuBLAS + Liger fused add+RMSNorm, fused gate-up SwiGLU", False),
    ("rmsnorm_rope", _rmsnorm_rope, _ALL, "cuBLAS + Liger fused add+RMSNorm, RoPE", False),
    ("rmsnorm_ce", _rmsnorm_ce, ("fwd", "fwd_bwd"), "cuBLAS + Liger fused add+RMSNorm, fused linear cross-entropy",
     True),
    ("lm_head_ce", _lm_head_ce, ("fwd", "fwd_bwd"), "Liger RMSNorm + fused linear cross-entropy", True),
    ("block", _block, _ALL, "cuBLAS + Liger fused add+RMSNorm, fused gate-up SwiGLU, RoPE", False),
]:
    REGISTRY.add(Liger(_op, _fn, _modes, _desc, _in_fwd))
