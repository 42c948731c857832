"""What the worker does to a cell (runs in the worker process; :mod:`codabench.worker` calls it).

Per cell, :meth:`Measurer.first`: the untimed correctness pass on fresh inputs (:mod:`codabench.correctness`), the
first timing round on other inputs (:mod:`codabench.timing`) with the GPU's clock sampled during it
(:mod:`codabench.clocks`), then the checks that make the time count (:mod:`codabench.verify`: the timed buffers,
refilled, new buffers; on the GPU the calling stream and the events), the peak memory of a call, and the
implementation's account of how it ran (``describe``). Later rounds
(:meth:`Measurer.again`) time the cell again and check the timed buffers once more. :meth:`Measurer.gemms` times the
plain GEMMs of a cell's speed-of-light. The shared state of a group (one op, model, mode and dtype: the float64
reference, PyTorch's results on the verification inputs, the timing's upstream gradients, the fp8 cast time) is
built lazily and dropped when the next group starts.

Every failure of an implementation becomes a result with an error message; a broken CUDA context sets
``device_lost`` so that the worker process is replaced.
"""
from __future__ import annotations

import functools
import gc
import math
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from codabench.case import Case
from codabench.ceilings import GemmTimer, measure_ceilings
from codabench.clocks import ClockSampler, Sampled
from codabench.config import RunConfig
from codabench.correctness import CHECK_SEED, GroupReference, build_reference, check_impl, compared
from codabench.eager import TorchEager
from codabench.env import collect_env, provider_metadata
from codabench.execute import forward_shapes, run_once, timed_call, uses_autograd
from codabench.matrix import Cell
from codabench.registry import Implementation, Registry, Tensors
from codabench.timing import Timing, TimingConfig, measure, measure_graph, per_round
from codabench import verify
from workloads import fp8
from workloads.op import Gemm
from workloads.ops import OPS

TIMING_SEED = 0
TIMING_GRAD_SEED = 7
MAX_GRAPH_SETS = 8
CAST_REPS = 5
"""Samples of an fp8 group's cast time (a cheap side figure, not a cell's timing)."""


def describe_exception(e: BaseException) -> str:
    """``Type: first line of the message (file:line of the innermost frame)``."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    prefix = "out of memory: " if isinstance(e, torch.cuda.OutOfMemoryError) else ""
    return f"{prefix}{type(e).__name__}: {msg}{where}"[:600]


@dataclass
class RoundResult:
    """One timing round of a cell."""

    samples_ms: list[float]
    kind: str
    """``cuda-events``, ``cuda-graph`` or ``cpu-wall``."""
    note: str = ""
    first_call_s: float | None = None
    clocks: Sampled = field(default_factory=Sampled)


@dataclass
class CellResult:
    """The worker's answer to a cell's first request."""

    updates: dict[str, Any]
    """Row fields: errors and pass mark, check_s and setup_s; on failure status and message; else peak_mem_mib,
    min_bytes, cast_ms and the implementation's strategy (:meth:`Implementation.describe`)."""
    err_rows: list[dict[str, Any]] = field(default_factory=list)
    round: RoundResult | None = None
    """The first timing round; None when the cell did not get that far (an error row)."""


def _error(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}


class _Group:
    """The shared, lazily built state of one (op, model, mode, dtype) group."""

    def __init__(self, make_case: Callable[[], Case]):
        self.make_case = make_case
        self._ref: GroupReference | None = None
        self._ref_error: str | None = None
        self.timing_grads: Tensors | None = None
        self.expected: dict[int, verify.Expected] = {}
        """PyTorch's results on the verification inputs, by seed (the timing seed: the timed inputs A)."""
        self.cell_errors: dict[str, dict[str, float | None]] = {}
        """Per implementation: its errors in the correctness pass, by compared output."""
        self.cast_ms: float | None = None
        self.cast_note = ""

    def reference(self) -> GroupReference:
        if self._ref is None and self._ref_error is None:
            try:
                case = self.make_case()
                self._ref = build_reference(case.op, case)
            except Exception as e:
                self._ref_error = describe_exception(e)
        if self._ref_error is not None:
            raise RuntimeError(f"building the float64 reference / PyTorch error failed: {self._ref_error}")
        return self._ref


@dataclass
class _Timed:
    """What a timing round leaves for the checks: the cell's case, its timed native inputs and call."""

    case: Case
    native: Tensors
    grads: Tensors | None
    """Upstream gradients of the timing pass (canonical; autograd modes)."""
    timed: Any
    """The :class:`codabench.execute.Timed` closure, None in CUDA-graph mode."""


class Measurer:
    def __init__(self, cfg: RunConfig, registry: Registry):
        self.cfg, self.registry, self.device = cfg, registry, cfg.device
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # kernels launch on the current device (torchrun: cuda:LOCAL_RANK)
        fp8.recipe(fp8.FP8_DTYPES[0], cfg.fp8_accum)  # an unknown accumulation mode fails here, not per cell
        self.gemm_timer = GemmTimer(self.device, cfg.timing, cfg.fp8_accum)
        self.clocks = ClockSampler(self.device)
        self.device_lost: str | None = None
        self._group_key: tuple | None = None
        self._group: _Group | None = None

    # ---- run-level requests -------------------------------------------------------------------------

    def env(self, impl_names: list[tuple[str, str]]) -> dict[str, Any]:
        """Environment facts (:func:`codabench.env.collect_env`) and, on the GPU, the ceilings measured now."""
        impls = [self.registry.get(op, name) for op, name in impl_names]
        env = collect_env(self.device, impls)
        if self.device.type == "cuda":
            env["ceilings"] = measure_ceilings(self.device, self.cfg.timing, self.cfg.fp8_accum)
        return env

    def providers(self, impl_names: list[tuple[str, str]]) -> dict[str, Any]:
        """Provider metadata again once cells ran: what ``prepare`` learned (JIT warm-up times, resolved backends)."""
        return provider_metadata([self.registry.get(op, name) for op, name in impl_names])

    def clock_trace(self) -> list[tuple[float, float, float, float]]:
        return list(self.clocks.trace)

    def gemms(self, cell: Cell, fresh: bool) -> tuple[dict[Gemm, list[float] | None], str]:
        """Samples of each plain GEMM of the cell's speed-of-light (``fresh``: new samples for this round; else the
        run's first measurement of each), and the reason of the first failure ("" if none)."""
        gemms = OPS[cell.op].gemms(self.cfg.model(cell.model), cell.mode)
        cfg = replace(per_round(self.cfg.timing), warmup=1, warmup_ms=0.0) if fresh else self.cfg.timing
        out = {g: (self.gemm_timer.samples(g, cell.dtype, cfg) if fresh else self.gemm_timer.cached(g, cell.dtype))
               for g in dict.fromkeys(gemms)}
        return out, next(iter(self.gemm_timer.failures.values()), "")

    # ---- a cell ---------------------------------------------------------------------------------------

    def first(self, cell: Cell) -> CellResult:
        """Correctness, the first timing round and the checks of one cell; ``check_s`` and ``setup_s`` of its row
        are the seconds of its correctness pass and of all of this."""
        start = time.perf_counter()
        result = self._first(cell, start)
        result.updates["setup_s"] = time.perf_counter() - start  # error rows too: a cold start is paid either way
        return result

    def _first(self, cell: Cell, start: float) -> CellResult:
        group, impl = self._group_for(cell), self.registry.get(cell.op, cell.impl)
        try:
            outcome = check_impl(group.reference(), impl)
        except Exception as e:
            return self._failed(CellResult(_error(f"correctness run: {describe_exception(e)}")))
        result = CellResult(_errors_of(outcome), [_error_row(cell, c) for c in outcome.checks])
        result.updates["check_s"] = time.perf_counter() - start
        if outcome.errors:
            result.updates.update(_error("; ".join(outcome.errors)))
            return self._failed(result)
        group.cell_errors[cell.impl] = {c.output: c.stats.rel_err for c in outcome.checks}
        try:
            rnd, timed = self._time(cell, group, per_round(self.cfg.timing))
            result.updates.update(self._checks(cell, group, impl, timed))
        except Exception as e:
            result.updates.update(_error(f"timing run: {describe_exception(e)}"))
            return self._failed(result)
        result.updates.update(cast_ms=group.cast_ms, strategy=_describe(impl, timed.native))
        if group.cast_note:
            rnd.note = "; ".join(n for n in (rnd.note, group.cast_note) if n)
        if result.updates.get("status") != "error":
            result.round = rnd
        return result

    def again(self, cell: Cell) -> RoundResult:
        """A later timing round of a cell (compiled, tuned and the GPU busy: one warm-up call), then the timed
        buffers checked once more; raises with the reason when the round fails."""
        group, impl = self._group_for(cell), self.registry.get(cell.op, cell.impl)
        later = replace(per_round(self.cfg.timing), warmup=1, warmup_ms=0.0)
        try:
            rnd, timed = self._time(cell, group, later)
            problem, _ = verify.check_same_buffers(OPS[cell.op], impl, timed.native, cell.mode, timed.grads,
                                                   self._expected(cell, group, timed.case, TIMING_SEED),
                                                   self._allowed(cell, group))
        except Exception:
            self._after_error()
            raise
        if problem:
            raise verify.CellError(f"does not count: {problem}")
        return rnd

    # ---- internals -----------------------------------------------------------------------------------

    def _group_for(self, cell: Cell) -> _Group:
        if cell.group != self._group_key:
            self._group = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._group_key, self._group = cell.group, _Group(lambda: self._case(cell, CHECK_SEED, check=True))
        return self._group

    def _case(self, cell: Cell, seed: int | None, check: bool = False) -> Case:
        op = OPS[cell.op]
        model = self.cfg.model(cell.model, check=check and self.cfg.check_tokens is not None)
        inputs = op.inputs(model, cell.dtype, self.device, seed) if seed is not None else {}
        return Case(op, model, cell.mode, cell.dtype, self.device, inputs, self.cfg.fp8_accum)

    def _failed(self, result: CellResult) -> CellResult:
        self._after_error()
        return result

    def _after_error(self) -> None:
        gc.collect()
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        except Exception as e:
            self.device_lost = f"the CUDA context is unusable ({describe_exception(e)})"

    def _timing_grads(self, group: _Group, case: Case) -> Tensors:
        """Canonical upstream gradients of the timing pass, shaped by PyTorch's own forward (so the implementation
        under test is not run, or compiled, once more just to learn its shapes)."""
        if group.timing_grads is None:
            eager = TorchEager(case.op)
            shapes = forward_shapes(case.op, eager, eager.prepare(case))
            group.timing_grads = case.op.grad_outputs(shapes, TIMING_GRAD_SEED)
        return group.timing_grads

    def _measure_cast(self, group: _Group, case: Case) -> None:
        """The group's fp8 cast time, on the timing inputs; measured by the first timed cell (errors become a note)."""
        if case.recipe is None or group.cast_ms is not None or group.cast_note:
            return
        try:
            cfg = replace(self.cfg.timing, warmup=1, warmup_ms=0.0, reps=CAST_REPS)
            group.cast_ms = measure(lambda _: fp8.quantize_operands(case.inputs, case.op.fp8_operands, case.recipe),
                                    None, case.device, cfg).median
        except Exception as e:
            group.cast_note = f"no cast time: {describe_exception(e)}"

    def _time(self, cell: Cell, group: _Group, cfg: TimingConfig) -> tuple[RoundResult, _Timed]:
        """One timing round on the TIMING_SEED inputs, the clock sampled during its kept samples."""
        op, impl, dev = OPS[cell.op], self.registry.get(cell.op, cell.impl), self.device
        case = self._case(cell, TIMING_SEED)
        self._measure_cast(group, case)
        grads = self._timing_grads(group, case) if uses_autograd(op, cell.mode) else None
        native = impl.prepare(case)
        grads_native = impl.grad_outputs_to_native(grads, native) if grads is not None else None
        sampled = Sampled()
        during = functools.partial(self.clocks.sampling, sampled)  # the clock, over the kept samples
        note = ""
        if self.cfg.cuda_graph and dev.type == "cuda":
            if uses_autograd(op, cell.mode):
                note = "cuda-graph mode covers fwd and direct modes only: timed with events"
            else:
                try:
                    sets = self._graph_sets(impl, case, native)
                    with torch.no_grad():
                        timing = measure_graph(lambda nat: impl.run(nat), sets, dev, cfg, during=during)
                    return _round(timing, sampled), _Timed(case, native, grads, None)
                except Exception as e:
                    note = f"cuda-graph capture failed ({describe_exception(e)}): timed with events"
        timed = timed_call(op, impl, native, cell.mode, grads_native)
        with timed.context:
            timing = measure(timed.fn, timed.setup, dev, cfg, during=during)
        timing.note = note
        return _round(timing, sampled), _Timed(case, native, grads, timed)

    def _graph_sets(self, impl: Implementation, case: Case, native: Tensors) -> list[Tensors]:
        """Prepared input sets to rotate among, together at least 3x L2 (2 to MAX_GRAPH_SETS sets)."""
        nbytes = sum(t.numel() * t.element_size() for t in case.inputs.values() if isinstance(t, torch.Tensor))
        l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 64 * 2**20
        k = min(MAX_GRAPH_SETS, max(2, math.ceil(3 * l2 / max(nbytes, 1))))
        sets = [native]
        for i in range(1, k):
            sets.append(impl.prepare(replace(case, inputs=case.op.inputs(case.model, case.dtype, self.device,
                                                                         TIMING_SEED + i))))
        return sets

    def _expected(self, cell: Cell, group: _Group, timing_case: Case, seed: int) -> verify.Expected:
        """PyTorch's (torch-eager's) results on the timing inputs (seed TIMING_SEED) or a verification input set."""
        if seed not in group.expected:
            op = timing_case.op
            case = timing_case if seed == TIMING_SEED else verify.verification_inputs(op, timing_case, seed)
            grads = self._timing_grads(group, timing_case) if uses_autograd(op, cell.mode) else None
            eager = compared(op, cell.mode, run_once(op, TorchEager(op), case, grads))
            group.expected[seed] = verify.Expected(case, eager)
        return group.expected[seed]

    def _allowed(self, cell: Cell, group: _Group) -> dict[str, float]:
        reference = group.reference()
        torch_err = {k: s.rel_err for k, s in reference.torch_stats.items()}
        return verify.allowed_error(torch_err, group.cell_errors.get(cell.impl, {}), reference.case.torch_dtype)

    def _checks(self, cell: Cell, group: _Group, impl: Implementation, t: _Timed) -> dict[str, Any]:
        """The checks of :mod:`codabench.verify` after the first round, the peak memory and the minimum bytes;
        an error status when a check fails."""
        op, mode, dev = OPS[cell.op], cell.mode, self.device
        allowed = self._allowed(cell, group)
        expected_a = self._expected(cell, group, t.case, TIMING_SEED)
        updates: dict[str, Any] = {"min_bytes": _min_bytes(op, t.case, expected_a, t.grads)}

        def same_buffers() -> str | None:
            problem, updates["peak_mem_mib"] = verify.check_same_buffers(op, impl, t.native, mode, t.grads, expected_a,
                                                                         allowed)
            return problem

        checks = [same_buffers]
        if dev.type == "cuda" and t.timed is not None:
            checks.append(lambda: verify.check_event_time(t.timed, dev))
        checks += [
            lambda: verify.check_refilled(op, impl, t.native, mode, t.grads,
                                          self._expected(cell, group, t.case, verify.REFILL_SEED), allowed),
            lambda: verify.check_new_buffers(op, impl, mode, t.grads,
                                             self._expected(cell, group, t.case, verify.FRESH_SEED), allowed)]
        for check in checks:
            problem = check()
            if problem:
                updates.update(_error(f"does not count: {problem}"))
                self._after_error()
                break
        return updates


def _describe(impl: Implementation, native: Tensors) -> str:
    """The implementation's own account of how it ran the cell (:meth:`Implementation.describe`); a failure is the
    text of the column, never the loss of the measured row."""
    try:
        return str(impl.describe(native) or "")
    except Exception as e:
        return f"describe() failed: {describe_exception(e)}"


def _round(timing: Timing, sampled: Sampled) -> RoundResult:
    return RoundResult(timing.samples_ms, timing.kind, timing.note, timing.first_call_s, sampled)


def _nbytes(t: torch.Tensor, fp8_operand: bool) -> int:
    return t.numel() * (1 if fp8_operand else t.element_size())


def _min_bytes(op, case: Case, expected: verify.Expected, grads: Tensors | None) -> int:
    """The fewest bytes a cell must move: every input read once (fp8 GEMM operands at one byte), every compared
    output and gradient written once, and (autograd modes) the upstream gradients read once."""
    fp8_ops = op.fp8_operands if case.recipe is not None else {}
    total = sum(_nbytes(v, k in fp8_ops) for k, v in case.inputs.items() if isinstance(v, torch.Tensor))
    total += sum(_nbytes(v, False) for v in expected.outputs.values())
    return total + sum(_nbytes(v, False) for v in (grads or {}).values())


def _errors_of(outcome) -> dict[str, Any]:
    return {"rel_err": outcome.worst(lambda c: c.stats.rel_err), "max_abs_err": outcome.worst(lambda c: c.stats.max_abs),
            "err_ratio": outcome.worst(lambda c: c.ratio), "rel_err_vs_bf16": outcome.worst(lambda c: c.rel_err_vs_bf16),
            "correct": outcome.correct if outcome.checks else None}


def _error_row(cell: Cell, c) -> dict[str, Any]:
    return {"op": cell.op, "impl": cell.impl, "model": cell.model, "mode": cell.mode, "dtype": cell.dtype,
            "output": c.output, "rel_err": c.stats.rel_err, "max_abs": c.stats.max_abs, "cosine": c.stats.cosine,
            "torch_rel_err": c.torch_rel_err, "ratio": c.ratio, "rel_err_vs_bf16": c.rel_err_vs_bf16,
            "passed": c.passed}
