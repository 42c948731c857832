"""The untimed correctness pass of a cell (benchmarking.md, "Correctness protocol").

Per (op, model, mode, dtype) group, once: fresh inputs from ``CHECK_SEED`` (the timing uses another
seed; fp8 cells: bf16 with the GEMM operands rounded onto the recipe's fp8 grid, :meth:`Op.inputs`);
the float64 reference (``op.reference`` on float64 copies of those inputs, autograd in float64); and
the error of PyTorch itself: the torch-eager implementation in the cell's dtype, which for fp8 cells
is the composition with its GEMMs through ``torch._scaled_mm`` under the cell's recipe
(:mod:`codabench.eager`). fp8 groups also keep torch-eager's bf16 outputs on the
unrounded bf16 inputs of the same seed (the unquantized computation), and each output's relative error
against them is reported beside the pass rule (``rel_err_vs_bf16``; it does not decide the pass).
Per implementation: the same inputs regenerated, the allocator poisoned with NaN, one call, then
checks for input mutation, missing outputs, shapes, dtypes, NaN/Inf, and the pass rule of
:mod:`codabench.metrics` per output.

Compared outputs: ``fwd`` and direct ops: ``op.outputs`` plus the ``op.side_outputs`` the
implementation returns; ``bwd``: the gradient ``grad_<input>`` of every differentiable input;
``fwd_bwd``: both.

Unwritten outputs: an output the implementation allocates but never fully writes must show up as
NaN. On the GPU, before the call, blocks of the outputs' sizes are allocated, filled with 0xFF bytes
(NaN in every floating format: fp64 down to fp8 e4m3) and freed into the caching allocator (see
:func:`poison_allocator`); this is best effort, as allocations the implementation makes before its
outputs may take the poisoned blocks. On the CPU the C allocator gives no such control (it may hand
back fresh zeroed pages), so the call runs with PyTorch's deterministic fill instead: every
``torch.empty``-family allocation comes back NaN-filled (see :func:`nan_filled_allocations`; on the CPU the worker
runs every request so, :meth:`codabench.measure.Measurer.request`).
"""
from __future__ import annotations

import math
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from codabench import guard
from codabench.case import Case
from codabench.eager import TorchEager
from codabench.execute import CellError, Result, forward_shapes, reference_once, run_once, uses_autograd
from codabench.metrics import ErrorStats, error_ratio, error_stats, passes, tolerance
from codabench.registry import Implementation, Tensors, prepared
from workloads.op import Op

CHECK_SEED = 1001
"""Seed of the correctness inputs; the timing inputs use codabench.measure.TIMING_SEED."""
GRAD_SEED = 1002
"""Seed of the upstream gradients of the correctness pass."""


@dataclass
class OutputCheck:
    output: str
    stats: ErrorStats | None
    torch_rel_err: float | None
    ratio: float | None
    passed: bool
    rel_err_vs_bf16: float | None = None
    """fp8 cells: relative error against the unquantized bf16 computation (None otherwise)."""
    allowed: float | None = None
    """The largest rel_err that passes (:func:`codabench.metrics.tolerance`)."""


@dataclass
class CheckOutcome:
    checks: list[OutputCheck] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Faults that make the cell an error row (mutation, missing output, shape, dtype, NaN/Inf)."""

    @property
    def correct(self) -> bool:
        return not self.errors and bool(self.checks) and all(c.passed for c in self.checks)

    def failures(self, most: int = 3) -> str:
        """The outputs that fail the error rule, for the row's ``message``: ``out rel_err 1.0e-02 > 3.0e-07 allowed
        (6.9e+04x PyTorch's)``, the first ``most`` of them; "" when none does."""
        bad = [c for c in self.checks if not c.passed]
        text = "; ".join(f"{c.output} rel_err {c.stats.rel_err:.1e} > {c.allowed:.1e} allowed"
                         + (f" ({c.ratio:.3g}x PyTorch's)" if c.ratio is not None else "") for c in bad[:most])
        more = f"; {len(bad) - most} more" if len(bad) > most else ""
        return f"fails the error rule: {text}{more}" if bad else ""

    def worst(self, value: Callable[[OutputCheck], float | None]) -> float | None:
        """The largest finite-or-inf value over the compared outputs (None when there is none)."""
        vals = [value(c) for c in self.checks]
        vals = [v for v in vals if v is not None and not math.isnan(v)]
        return max(vals) if vals else None


@dataclass
class GroupReference:
    """What every cell of one (op, model, mode, dtype) group is compared against."""

    op: Op
    case: Case
    """The group's correctness case, without its inputs (each cell regenerates them)."""
    grad_outputs: Tensors | None
    reference: dict[str, torch.Tensor]
    expected_dtype: dict[str, torch.dtype]
    torch_stats: dict[str, ErrorStats]
    bf16: dict[str, torch.Tensor] | None = None
    """fp8 groups: torch-eager's outputs in bf16 on the unrounded inputs (the unquantized computation)."""

    def fresh_case(self) -> Case:
        """The correctness inputs, regenerated (deterministic seed) so no cell sees another's."""
        c = self.case
        return replace(c, inputs=self.op.inputs(c.model, c.dtype, c.device, CHECK_SEED))


def compared(op: Op, mode: str, result: Result) -> dict[str, torch.Tensor]:
    """The named tensors of ``result`` that are compared in ``mode``."""
    out: dict[str, torch.Tensor] = {}
    if not (uses_autograd(op, mode) and mode == "bwd"):
        out.update({k: v for k, v in result.outputs.items() if k in op.outputs or k in op.side_outputs})
    out.update(result.grads)
    return out


def build_reference(op: Op, case: Case) -> GroupReference:
    """The float64 reference and PyTorch's own error for the group of ``case`` (its inputs: CHECK_SEED), and for
    fp8 groups the unquantized bf16 outputs."""
    eager = TorchEager(op)
    grad_outputs = None
    if uses_autograd(op, case.mode):
        grad_outputs = op.grad_outputs(forward_shapes(op, eager, prepared(eager, case)), GRAD_SEED)
    torch_res = compared(op, case.mode, run_once(op, eager, case, grad_outputs))
    ref = compared(op, case.mode, reference_once(op, case, grad_outputs))
    stats = {k: error_stats(torch_res[k], ref[k]) for k in ref if k in torch_res}
    bf16 = None
    if case.recipe is not None:  # fp8 cells are forward or direct: no upstream gradients
        unrounded = replace(case, dtype="bf16", inputs=op.make_inputs(case.model, torch.bfloat16, case.device,
                                                                      CHECK_SEED))
        bf16 = compared(op, case.mode, run_once(op, eager, unrounded, None))
    return GroupReference(op, replace(case, inputs={}), grad_outputs, ref, {k: v.dtype for k, v in torch_res.items()},
                          stats, bf16)


def poison_allocator(device: torch.device, sizes: list[int]) -> None:
    """Leave NaN (0xFF) blocks in the CUDA caching allocator where outputs of ``sizes`` bytes will land.

    Two blocks of each output size are allocated first: a caching allocator carves them from the
    same best-fit free blocks that the implementation's outputs will be carved from, and freed
    blocks keep their bytes. One large block (both pools emptied first) follows.
    """
    torch.cuda.empty_cache()
    blocks = [torch.full((s,), 255, dtype=torch.uint8, device=device) for s in sizes for _ in range(2)]
    total = max(2 * sum(sizes), 64 * 2**20)
    blocks.append(torch.full((min(total, torch.cuda.mem_get_info(device)[0] // 2),), 255,
                             dtype=torch.uint8, device=device))
    del blocks


@contextmanager
def nan_filled_allocations() -> Iterator[None]:
    """Within the block, ``torch.empty`` and its kin return NaN-filled floats (max-valued integers).

    This is PyTorch's ``fill_uninitialized_memory``, active only while deterministic algorithms are on;
    they are turned on in warn-only mode (an op without a deterministic kernel still runs) and the
    previous settings are restored on exit.
    """
    import torch.utils.deterministic as deterministic
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             deterministic.fill_uninitialized_memory)
    try:
        deterministic.fill_uninitialized_memory = True
        torch.use_deterministic_algorithms(True, warn_only=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        deterministic.fill_uninitialized_memory = saved[2]


def check_impl(group: GroupReference, impl: Implementation) -> CheckOutcome:
    """Run ``impl`` once on fresh correctness inputs and compare every output with the reference."""
    op, case = group.op, group.fresh_case()
    snapshot = {k: v.clone() for k, v in case.inputs.items() if isinstance(v, torch.Tensor)}
    on_gpu = case.device.type == "cuda"
    if on_gpu:
        poison_allocator(case.device, [t.numel() * group.expected_dtype.get(k, t.dtype).itemsize
                                       for k, t in group.reference.items()])
    seal = guard.Seal().add("the group's reference", group)
    with nullcontext() if on_gpu else nan_filled_allocations():
        returned = run_once(op, impl, case, group.grad_outputs)
    broken = seal.broken()
    if broken:
        seal.restore()
        raise CellError(guard.seal_message(broken))
    result = compared(op, case.mode, returned)
    outcome = CheckOutcome()
    mutated = [k for k, v in snapshot.items() if not torch.equal(case.inputs[k], v)]
    if mutated:
        outcome.errors.append(f"mutated its input(s) {', '.join(mutated)}")
    unknown = unknown_outputs(op, returned.outputs)
    if unknown:
        outcome.errors.append(unknown)
    for name, ref in group.reference.items():
        check = _check_output(group, name, result.get(name), ref, case.torch_dtype)
        if isinstance(check, str):
            if check:
                outcome.errors.append(check)
            continue
        outcome.checks.append(check)
        if check.stats is not None and not check.stats.finite:
            outcome.errors.append(f"{name} has {check.stats.n_nan} NaN and {check.stats.n_inf} Inf values"
                                  f"{first_non_finite(result[name])}")
    return outcome


def first_non_finite(out: torch.Tensor) -> str:
    """Where the first NaN or Inf of ``out`` is, for the message (a tail tile or a last row left unwritten shows
    there): ``", the first at [i, j] of (M, N)"``; "" when all are finite."""
    bad = torch.nonzero(~torch.isfinite(out.detach()))
    if not len(bad):
        return ""
    return f", the first at {bad[0].tolist()} of {tuple(out.shape)}"


def unknown_outputs(op: Op, outputs: Tensors) -> str | None:
    """Every tensor an implementation returns must be an output or a side output of its op, by name: a misspelt name
    (``rstdd`` for ``rstd``) would never be compared. Values that are not tensors (a count) are left alone. The
    message names the unknown keys and the valid ones; None when there are none."""
    unknown = [k for k, v in outputs.items() if isinstance(v, torch.Tensor)
               and k not in op.outputs and k not in op.side_outputs]
    if not unknown:
        return None
    side = f"; side outputs: {', '.join(op.side_outputs)}" if op.side_outputs else ""
    return (f"returned {', '.join(map(repr, unknown))}, which {op.name} has no output of that name "
            f"(outputs: {', '.join(op.outputs)}{side})")


def _check_output(group: GroupReference, name: str, out: torch.Tensor | None, ref: torch.Tensor,
                  dtype: torch.dtype) -> OutputCheck | str:
    """An OutputCheck, an error message, or "" for a side output the implementation does not return."""
    if out is None:
        if name in group.op.side_outputs:
            return ""
        return f"missing {'gradient' if name.startswith('grad_') else 'output'} {name!r}"
    if not isinstance(out, torch.Tensor):
        raise CellError(f"output {name!r} is a {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(ref.shape):
        return f"{name} has shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    want = group.expected_dtype.get(name)
    allowed = {want} | ({torch.float32} if name in group.op.side_outputs else set())
    if want is not None and out.dtype not in allowed:
        return f"{name} has dtype {out.dtype}, expected {want}"
    stats = error_stats(out, ref)
    torch_stats = group.torch_stats.get(name)
    torch_rel = torch_stats.rel_err if torch_stats is not None else None
    bf16 = group.bf16.get(name) if group.bf16 is not None else None
    vs_bf16 = error_stats(out, bf16).rel_err if bf16 is not None else None
    return OutputCheck(name, stats, torch_rel, error_ratio(stats.rel_err, torch_rel),
                       passes(stats.rel_err, torch_rel, dtype), vs_bf16, tolerance(torch_rel, dtype))
