"""What the worker does to a cell and to a group (runs in the worker process; :mod:`codabench.worker` calls it).

Per cell, :meth:`Measurer.first`: the untimed correctness pass on fresh inputs (:mod:`codabench.correctness`), the
cell's timed call built on other inputs (:mod:`codabench.execute`), its first call timed (``first_call_s``: compile,
JIT, autotuning), then the checks that make its time count (:mod:`codabench.verify`: the same buffers, on the GPU the
calling stream and the events, refilled buffers, new buffers), the peak memory of a call, and the implementation's
account of how it ran (``describe``). The cell's timed call then stays resident for its group.

Per group, :meth:`Measurer.sample`: the resident cells and the plain GEMMs of the group's speed-of-light take turns
sample by sample in interleaved sweeps (:mod:`codabench.sweep`) until every ratio is resolved or the budget is spent.
Every timed call runs on inputs never seen before: before each sweep new canonical inputs are drawn from a seed made
in this process at random (not the constants of the checks), and each cell's timed buffers are refilled in place with
its own native form of them (``prepare``), untimed; so no cache keyed on the inputs' values, addresses or shapes can
answer a timed call. Each timed call's outputs are checked (plain ``torch.Tensor``, the cell's device, no input's
storage), and on :data:`RECHECKS` sweeps drawn at random, plus the last, its outputs are copied on the calling
stream as the call returns and compared with PyTorch's results on that sweep's inputs. A group whose inputs do not fit
in memory together is sampled in blocks instead (:meth:`Measurer.again`, one round of one cell per request), as is a
group whose sweeps failed; its rows say so. A cell whose call in the sweeps leaves a thread running its own code
beside the next calls (:class:`codabench.sweep.LeftThreads`) is an error row, and the group's other cells are sampled
again without it once the thread has ended. With ``--profile``, :meth:`Measurer.profile` then takes each timed cell's
call apart (:mod:`codabench.profile`), after the group's samples and outside any timed region.

The shared state of a group (the float64 reference, PyTorch's results on the verification inputs, the timing's
upstream gradients, the fp8 cast time, the resident cells) is built lazily and dropped when the next group starts.
Every failure of an implementation becomes a result with an error message; a broken CUDA context sets
``device_lost`` so that the worker process is replaced.
"""
from __future__ import annotations

import functools
import gc
import tempfile
import time
import traceback
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from codabench.case import Case
from codabench.ceilings import GemmTimer, gemm_call, measure_ceilings
from codabench.clocks import ClockSampler, Sampled
from codabench.config import RunConfig
from codabench.correctness import (CHECK_SEED, GroupReference, build_reference, check_impl, compared,
                                   nan_filled_allocations)
from codabench.eager import TorchEager
from codabench.env import collect_env, provider_metadata
from codabench.execute import (CellError, Timed, check_outputs, forward_shapes, native_grad_outputs, run_once,
                                timed_call, timed_result, uses_autograd)
from codabench.matrix import SPEED_BASELINE, Cell
from codabench.profile import profile_call
from codabench.registry import Implementation, Registry, Tensors, prepared
from codabench.sweep import Member
from codabench.timing import CUDA_GRAPH, first_call, graph_sets, measure, per_round
from codabench import guard, sweep, verify
from workloads import fp8
from workloads.op import Gemm
from workloads.ops import OPS

TIMING_SEED = 0
TIMING_GRAD_SEED = 7
RECHECKS = 4
"""How many timed calls' outputs are compared with PyTorch's, expected among the first ``min_sweeps`` sweeps (or
among all, when their number is fixed): each call is rechecked or not by a draw made after it returned
(:class:`Rechecks`), so no call can know beforehand whether it will be; past ``min_sweeps``, sweep s is drawn with
probability ``RECHECKS / s``. The last sweep's are compared too (where the number is fixed, its timed call itself,
else one more call on its buffers)."""
MEMBER_PARTS = ("name", "call", "setup", "after", "context", "own", "watch")
"""What a sweep member runs and how: sealed (:class:`codabench.guard.Seal`) over the sweeps, so that no member's call
changes another's (its samples, error and lead change as the sweeps go)."""

def _draw() -> float:
    """A uniform draw in [0, 1)."""
    return int.from_bytes(guard.URANDOM(7), "little") / 2**56


class Rechecks:
    """Which of one cell's timed calls are compared with PyTorch's (:data:`RECHECKS`), each drawn once the call
    returned; ``done``: the sweeps rechecked so far."""

    def __init__(self, first_sweeps: int, fixed: int | None):
        self.first, self.last, self.done = first_sweeps, (fixed - 1 if fixed else None), set()

    def draw(self, sweep: int) -> bool:
        if sweep == self.last or _draw() < RECHECKS / max(sweep + 1, self.first):
            self.done.add(sweep)
            return True
        return False
CAST_REPS = 5
"""Samples of an fp8 group's cast time (a cheap side figure, not a cell's timing)."""
LEFT_THREAD_WAIT_S = 2.0
"""How long a thread that a cell's call left running its own code in the group's sweeps is waited for before the
other cells are sampled again without that cell (:meth:`Measurer._without`)."""


def describe_exception(e: BaseException) -> str:
    """``Type: first line of the message (file:line of the innermost frame)``; a :class:`CellError`, the harness's
    verdict on what the implementation returned or did, without the harness's own line."""
    try:
        text = str(e).strip()
    except Exception as inner:  # a plugin's exception whose __str__ raises: the row is still about that exception
        text = f"(its message could not be made: __str__ raised {type(inner).__name__})"
    msg = text.splitlines()[0] if text else ""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb and not isinstance(e, CellError) else ""
    prefix = "out of memory: " if isinstance(e, torch.cuda.OutOfMemoryError) else ""
    return f"{prefix}{type(e).__name__}: {msg}{where}"[:600]


@dataclass
class RoundResult:
    """The samples of one cell: a round of the blocks fallback, or its share of its group's sweeps."""

    samples_ms: list[float]
    kind: str
    """``cuda-events``, ``cuda-graph`` or ``cpu-wall``."""
    note: str = ""
    first_call_s: float | None = None
    clocks: Sampled = field(default_factory=Sampled)
    sweeps: list[int] | None = None
    """Interleaved sampling: the sweep of each sample (None: a block round)."""
    clock_mhz: list[float | None] | None = None
    """Interleaved sampling: the SM clock at each sample."""
    host_ms: list[float] | None = None
    """Interleaved sampling: the host milliseconds of each sample's call (:attr:`codabench.sweep.Member.host_ms`)."""


@dataclass
class CellResult:
    """The worker's answer to a cell's first request."""

    updates: dict[str, Any]
    """Row fields: errors and pass mark, check_s, setup_s and first_call_s; on failure status and message; else
    peak_mem_mib, min_bytes, cast_ms and the implementation's strategy (:meth:`Implementation.describe`)."""
    err_rows: list[dict[str, Any]] = field(default_factory=list)
    ready: bool = False
    """The cell passed its checks and its timed call is resident for the group's sweeps (or, in a group sampled in
    blocks, may be timed by :meth:`Measurer.again`)."""
    blocks: str = ""
    """Why the group must be sampled in blocks ("" if it need not)."""


@dataclass
class GroupSamples:
    """The worker's answer to a group's sweeps: per cell (by implementation) its samples or its error, the speed-of-
    light GEMMs' samples, and how the sampling went."""

    cells: dict[str, RoundResult | str]
    gemms: dict[Gemm, list[float] | None]
    gemm_note: str
    sampling: dict[str, Any]
    """Row fields: ``grain``, ``n_sweeps``, ``stop``, ``settle_s``, ``settle_mhz``, ``settle_w``."""


def _error(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}


@dataclass
class _Resident:
    """A checked cell's timed call, held for its group's sweeps: its timing case (inputs A), native buffers and
    upstream gradients; in CUDA-graph mode the captured graphs of its rotating input sets instead."""

    cell: Cell
    impl: Implementation
    case: Case
    native: Tensors
    grads: Tensors | None
    timed: Timed | None
    first_call_s: float | None = None
    graphs: list[tuple[Any, Any, Case]] = field(default_factory=list)
    """CUDA-graph mode: (graph, what the captured call returned, the set's case) per input set."""
    graph_flush: bool = False
    """CUDA-graph mode: the input sets are too small to rotate out of L2 (:func:`graph_sets`): flush between replays."""
    note: str = ""


CellErrors = Mapping[str, float | None]
"""A cell's relative errors in its correctness pass, by compared output (errors.csv's ``output`` and ``rel_err``)."""


def own_errors(err_rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """A cell's :data:`CellErrors` from its error rows (:func:`_error_row`), as the parent keeps them."""
    return {r["output"]: r["rel_err"] for r in err_rows}


class _Group:
    """The shared, lazily built state of one (op, model, mode, dtype) group."""

    def __init__(self, make_case: Callable[[], Case]):
        self.make_case = make_case
        self._ref: GroupReference | None = None
        self._ref_error: str | None = None
        self.timing_grads: Tensors | None = None
        self.expected: dict[int, verify.Expected] = {}
        """PyTorch's results on the verification inputs, by seed (the timing seed: the timed inputs A)."""
        self.cell_errors: dict[str, CellErrors] = {}
        """Per implementation: its errors in the correctness pass, by compared output (set by its correctness pass,
        or, in a worker that replaced a crashed one, from the parent's record: :meth:`Measurer.sample`)."""
        self.cast_ms: float | None = None
        self.cast_note = ""
        self.resident: dict[str, _Resident] = {}
        """The checked cells' timed calls, by implementation, until the group's sweeps."""
        self.blocks = ""
        """Why the group is sampled in blocks ("" while its cells fit in memory together)."""

    def reference(self) -> GroupReference:
        if self._ref is None and self._ref_error is None:
            try:
                case = self.make_case()
                self._ref = build_reference(case.op, case)
            except Exception as e:
                self._ref_error = describe_exception(e)
                if isinstance(e, torch.OutOfMemoryError):
                    self._ref_error += " (--check-tokens N runs the correctness pass at fewer tokens)"
        if self._ref_error is not None:
            raise RuntimeError(f"building the float64 reference / PyTorch error failed: {self._ref_error}")
        return self._ref


class _Fresh:
    """New canonical inputs for each sweep, from a seed drawn in this process at random, shared by the group's cells
    (each refills its timed buffers with its native form of them), and PyTorch's results on them when asked."""

    def __init__(self, make: Callable[[int], Case], expected: Callable[[Case], verify.Expected]):
        self._make, self._expected = make, expected
        self._base = int.from_bytes(guard.URANDOM(5), "little")
        self._sweep: int | None = None
        self._case: Case | None = None
        self._exp: verify.Expected | None = None

    def case(self, sweep: int) -> Case:
        if sweep != self._sweep:
            self._sweep, self._case, self._exp = sweep, self._make(self._base + (sweep % (1 << 20))), None
        return self._case

    def expected(self, sweep: int) -> verify.Expected:
        case = self.case(sweep)
        if self._exp is None:
            self._exp = self._expected(case)
        return self._exp


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

    def request(self) -> AbstractContextManager[None]:
        """What every request runs inside: on the CPU, NaN-filled allocations
        (:func:`codabench.correctness.nan_filled_allocations`), which the correctness pass needs, for the timed calls
        too, so that both run under the same global state and the graphs torch.compile builds in the check serve the
        timed calls (its guards include the deterministic-algorithms flag: a recompile per cell otherwise). The guard
        takes that state as the harness's for the request (:func:`codabench.guard.adopted`)."""
        return guard.adopted(nan_filled_allocations()) if self.device.type == "cpu" else nullcontext()

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
        cfg = replace(per_round(self.cfg.timing), warmup=1, warmup_ms=0.0) if fresh else self.cfg.timing
        out = {g: (self.gemm_timer.samples(g, cell.dtype, cfg) if fresh else self.gemm_timer.cached(g, cell.dtype))
               for g in self._gemms_of(cell)}
        return out, next(iter(self.gemm_timer.failures.values()), "")

    def _gemms_of(self, cell: Cell) -> list[Gemm]:
        return list(dict.fromkeys(OPS[cell.op].gemms(self.cfg.model(cell.model), cell.mode)))

    # ---- a cell ---------------------------------------------------------------------------------------

    def first(self, cell: Cell) -> CellResult:
        """Correctness, the first call and the checks of one cell; ``check_s`` and ``setup_s`` of its row are the
        seconds of its correctness pass and of all of this."""
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
        group.cell_errors[cell.impl] = own_errors(result.err_rows)
        try:
            resident = self._resident(cell, group, impl)
        except torch.cuda.OutOfMemoryError as e:
            if not group.resident:
                return self._failed(CellResult(_error(f"timing run: {describe_exception(e)}")))
            # the group's other cells hold their inputs: let them go, sample the group in blocks, and try again
            group.resident.clear()
            group.blocks = (f"the inputs of the group's cells did not fit in GPU memory together "
                            f"({describe_exception(e)[:120]}): sampled in blocks of rounds, not interleaved")
            self._after_error()
            try:
                resident = self._resident(cell, group, impl)
            except Exception as e2:
                return self._failed(CellResult(_error(f"timing run: {describe_exception(e2)}")))
        except Exception as e:
            return self._failed(CellResult(_error(f"timing run: {describe_exception(e)}")))
        result.updates["first_call_s"] = resident.first_call_s
        try:
            result.updates.update(self._checks(cell, group, impl, resident))
        except Exception as e:
            result.updates.update(_error(f"checks: {describe_exception(e)}"))
            return self._failed(result)
        result.updates.update(cast_ms=group.cast_ms, strategy=_describe(impl, resident.native))
        if result.updates.get("status") == "error":
            return result
        self._capture(resident)
        result.ready = True
        if group.blocks:
            result.blocks = group.blocks
        else:
            group.resident[cell.impl] = resident
        return result

    def _resident(self, cell: Cell, group: _Group, impl: Implementation) -> _Resident:
        """The cell's timed call on the TIMING_SEED inputs, its first call timed (``first_call_s``)."""
        case = self._case(cell, TIMING_SEED)
        self._measure_cast(group, case)
        native, grads, timed = self._timed(cell, group, impl, case)
        with timed.context:
            took = first_call(timed.fn, timed.setup, self.device)
        return _Resident(cell, impl, case, native, grads, timed, took)

    def _timed(self, cell: Cell, group: _Group, impl: Implementation, case: Case
               ) -> tuple[Tensors, Tensors | None, Timed]:
        """The cell's timed call on ``case`` (the timing inputs): its native inputs, the timing's canonical upstream
        gradients (autograd modes, else None) and the call."""
        op = OPS[cell.op]
        grads = self._timing_grads(group, case) if uses_autograd(op, cell.mode) else None
        native = prepared(impl, case)
        grads_native = native_grad_outputs(impl, grads, native) if grads is not None else None
        return native, grads, timed_call(op, impl, native, cell.mode, grads_native)

    def _capture(self, r: _Resident) -> None:
        """CUDA-graph mode (fwd and direct modes): the cell's graphs, captured once its checks are done (they refill
        the timed buffers with other inputs); a note says how it is timed."""
        if not self.cfg.cuda_graph or self.device.type != "cuda":
            return
        if uses_autograd(OPS[r.cell.op], r.cell.mode):
            r.note = "cuda-graph mode covers fwd and direct modes only: timed with events"
            return
        try:
            r.graphs, r.graph_flush = self._graphs(r.impl, r.case, r.native)
            r.note = (f"cuda graph, {len(r.graphs)} rotating input sets" +
                      (", L2 flushed between replays (the sets are smaller than 3x L2)" if r.graph_flush else ""))
        except Exception as e:
            r.note = f"cuda-graph capture failed ({describe_exception(e)}): timed with events"

    def _graphs(self, impl: Implementation, case: Case, native: Tensors) -> tuple[list[tuple[Any, Any, Case]], bool]:
        """CUDA graphs of the cell's call on rotating input sets, each prepared anew, together at least 3x L2
        (:func:`graph_sets`), and whether the replays need an L2 flush too."""
        nbytes = sum(t.numel() * t.element_size() for t in native.values() if isinstance(t, torch.Tensor))
        l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 64 * 2**20
        k, flush = graph_sets(nbytes, l2)
        sets = []
        for i in range(k):
            c = replace(case, inputs=case.op.inputs(case.model, case.dtype, self.device, TIMING_SEED + i))
            sets.append((c, prepared(impl, c)))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(side):
            for _, nat in sets:
                for _ in range(2):
                    impl.run(nat)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graphs = []
        with torch.no_grad():
            for c, nat in sets:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = impl.run(nat)
                graphs.append((g, (out, nat), c))
        torch.cuda.synchronize(self.device)
        return graphs, flush

    def again(self, cell: Cell, own_errors: CellErrors) -> RoundResult:
        """A block round of a cell (the blocks fallback: the cell prepared anew, one warm-up call, its samples), then
        the timed buffers checked once more; raises with the reason when the round fails. ``own_errors``: the cell's
        errors in its correctness pass (:meth:`sample`)."""
        group, impl = self._group_for(cell), self.registry.get(cell.op, cell.impl)
        group.cell_errors[cell.impl] = dict(own_errors)
        later = replace(per_round(self.cfg.timing), warmup=1, warmup_ms=0.0)
        op = OPS[cell.op]
        try:
            case = self._case(cell, TIMING_SEED)
            native, grads, timed = self._timed(cell, group, impl, case)
            sampled = Sampled()
            with timed.context:
                timing = measure(timed.fn, timed.setup, self.device, later,
                                 during=functools.partial(self.clocks.sampling, sampled))
            problem, _ = verify.check_same_buffers(op, impl, native, cell.mode, grads,
                                                   self._expected(cell, group, case, TIMING_SEED),
                                                   self._allowed(cell, group))
        except Exception:
            self._after_error()
            raise
        if problem:
            raise verify.CellError(f"does not count: {problem}")
        note = "; ".join(n for n in (timing.note, group.cast_note) if n)
        return RoundResult(timing.samples_ms, timing.kind, note, timing.first_call_s, sampled)

    def profile(self, cell: Cell, trace: bool) -> tuple[dict[str, Any], str | None]:
        """Where the cell's call spends its time (``--profile``, after its group's samples): its timed call built anew
        on the timing inputs, as a block round builds it, profiled by :func:`codabench.profile.profile_call` with the
        run's L2 flush. Returns the profile's record (:meth:`codabench.profile.Profile.record`) and, with ``trace``,
        the Chrome trace of its last profiled call (JSON text; None without). Raises when the call or the profiler
        fails."""
        group, impl = self._group_for(cell), self.registry.get(cell.op, cell.impl)
        try:
            _, _, timed = self._timed(cell, group, impl, self._case(cell, TIMING_SEED))
            with tempfile.TemporaryDirectory(prefix="codabench-trace-") as tmp:
                path = Path(tmp) / "trace.json" if trace else None
                profiled = profile_call(timed, self.device, flush_l2=self.cfg.timing.flush_l2, trace=path)
                text = path.read_text() if path is not None and path.exists() else None
        except Exception:
            self._after_error()
            raise
        if self.cfg.cuda_graph and self.device.type == "cuda" and not uses_autograd(OPS[cell.op], cell.mode):
            profiled.add_note("profiled as plain calls; the timing replayed CUDA graphs")
        return profiled.record(), text

    # ---- a group's sweeps ------------------------------------------------------------------------------

    def sample(self, cells: list[Cell], own_errors: dict[str, CellErrors]) -> GroupSamples:
        """The interleaved sweeps of a group's checked cells and its speed-of-light GEMMs (module docstring): the
        resident ones, and those a crashed worker took with it, prepared again; the residents are released
        afterwards. ``own_errors``: each cell's errors in its correctness pass, by implementation, as the parent
        recorded them: a worker that replaced a crashed one has not seen them, and the checks of the timed calls
        allow for them (:func:`codabench.verify.allowed_error`)."""
        group = self._group_for(cells[0])
        group.cell_errors.update({impl: dict(errors) for impl, errors in own_errors.items()})
        lost: dict[str, str] = {}
        for c in cells:  # a worker that replaced a crashed one has not seen the group's cells: make them resident
            if c.impl not in group.resident:
                try:
                    group.resident[c.impl] = self._resident(c, group, self.registry.get(c.op, c.impl))
                    self._capture(group.resident[c.impl])
                except Exception as e:
                    lost[c.impl] = describe_exception(e)
        residents = [group.resident[c.impl] for c in cells if c.impl in group.resident]
        group.resident = {}
        fresh = _Fresh(lambda seed: self._case(cells[0], seed),
                       lambda case: self._expected_on(cells[0], group, case))
        timing = self.cfg.timing
        fixed = timing.reps or (timing.cpu_reps if self.device.type != "cuda" else None)  # sweeps known in advance
        first_sweeps = fixed or timing.min_sweeps
        draws = [Rechecks(first_sweeps, fixed) for _ in residents]
        seal = guard.Seal().add_graphs().add("the group's reference", group.reference()).add(
            "the sweep's inputs", fresh, ("_make", "_expected", "_base"))
        members = [self._member(r, group, fresh, d, seal) for r, d in zip(residents, draws)]
        gemm_members = self._gemm_members(cells[0])
        everyone = members + gemm_members
        for m, d in zip(members, draws):
            seal.add(f"{m.name}'s recheck draws", d, ("first", "last"))
        for m in everyone:
            seal.add(f"{m.name}'s sweep member", m, MEMBER_PARTS)
        seal.add("the sweep's members", everyone)
        graph_mode = any(r.graphs for r in residents)
        flush = None if not graph_mode or any(r.graph_flush or not r.graphs for r in residents) else False
        try:
            done = sweep.sample(everyone, self.device, self.cfg.timing, self.clocks, baseline=SPEED_BASELINE,
                                flush_l2=flush, seal=seal)
        except sweep.LeftThreads as left:
            return self._without(left, cells, residents, group, own_errors, lost)
        last = done.n_sweeps - 1
        for r, m, d in zip(residents, members, draws):
            if m.error is None and last not in d.done:
                self._recheck_last(r, m, group, fresh, last)
        if any(m.error for m in members):
            self._after_error()
        cells_out: dict[str, RoundResult | str] = dict(lost)
        for r, m in zip(residents, members):
            if m.error is not None:
                cells_out[m.name] = m.error
            else:
                kind = CUDA_GRAPH if r.graphs else done.kind
                note = "; ".join(n for n in (r.note, group.cast_note) if n)
                cells_out[m.name] = RoundResult(m.samples_ms, kind, note, sweeps=m.sweeps, clock_mhz=m.clock_mhz,
                                              host_ms=m.host_ms)
        gemms = {g: (m.samples_ms if m.error is None else None) for g, m in zip(self._gemms_of(cells[0]), gemm_members)}
        note = next((m.error for m in gemm_members if m.error), "") or next(iter(self.gemm_timer.failures.values()), "")
        sampling = dict(grain="sample", n_sweeps=done.n_sweeps, stop=done.stop, settle_s=done.settle_s,
                        settle_mhz=done.settle_mhz, settle_w=done.settle_w)
        return GroupSamples(cells_out, gemms, note, sampling)

    def _without(self, left: sweep.LeftThreads, cells: list[Cell], residents: list[_Resident], group: _Group,
                 own_errors: dict[str, CellErrors], lost: dict[str, str]) -> GroupSamples:
        """The group's sweeps after a cell's call left a thread running its own code in them
        (:class:`codabench.sweep.LeftThreads`), or dropped torch-compile's graphs (:class:`codabench.sweep.DroppedGraphs`,
        no thread): that cell's error, and the other cells sampled again without it, their
        earlier samples dropped (they ran beside the thread), once the thread has ended; one still alive after
        :data:`LEFT_THREAD_WAIT_S` fails the request (and retires the worker: :func:`codabench.worker.dispatch`)."""
        deadline = time.monotonic() + LEFT_THREAD_WAIT_S
        for t in left.threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        if any(t.is_alive() for t in left.threads):
            raise left
        group.resident = {r.cell.impl: r for r in residents if r.cell.impl != left.member.name}
        rest = [c for c in cells if c.impl in group.resident]
        out = self.sample(rest, own_errors) if rest else GroupSamples({}, {}, "", {})
        out.cells.update({**lost, left.member.name: left.member.error})
        return out

    def _member(self, r: _Resident, group: _Group, fresh: _Fresh, rechecks: Rechecks, seal: guard.Seal) -> Member:
        """A resident cell as a member of the sweeps: fresh inputs refilled before each call, its outputs checked
        after it, and compared with PyTorch's on the recheck sweeps (within the error ``allowed``, which ``seal``
        holds)."""
        impl, dev = r.impl, self.device
        allowed, own = self._allowed(r.cell, group), guard.module_files([impl.source])
        seal.add(f"{r.cell.impl}'s allowed error", allowed)
        if r.graphs:
            turn = iter(range(1 << 62))

            def replay(_):
                g, returned, _case = r.graphs[next(turn) % len(r.graphs)]
                g.replay()
                return returned

            def after_graph(s: int, returned) -> None:
                if rechecks.draw(s):
                    _, _, set_case = next(x for x in r.graphs if x[1] is returned)
                    self._compare(r, returned, self._expected_on(r.cell, group, set_case), allowed, s)

            return Member(r.cell.impl, replay, None, after_graph, own=own)
        timed = r.timed

        def setup(s: int):
            verify.refill(r.native, impl.prepare(fresh.case(s)))  # the inputs alone: r.native keeps its context
            return timed.setup() if timed.setup is not None else None

        def after(s: int, returned) -> None:
            check_outputs(returned[0], returned[1], dev)
            if rechecks.draw(s):
                self._compare(r, returned, fresh.expected(s), allowed, s)

        return Member(r.cell.impl, timed.fn, setup, after, lambda: timed.context, own=own)

    def _compare(self, r: _Resident, returned, expected: verify.Expected, allowed: dict[str, float], s: int) -> None:
        """The outputs a timed call returned, copied on the calling stream as it returns, against PyTorch's."""
        op, mode = OPS[r.cell.op], r.cell.mode
        keys = r.timed.keys if r.timed is not None else []
        result = compared(op, mode, timed_result(op, r.impl, mode, returned, keys))
        snapshot = {k: v.clone() for k, v in result.items()}
        bad = verify.mismatch(op, mode, snapshot, expected, allowed)
        if bad:
            raise CellError(f"does not count: the outputs of a timed call (sweep {s}), rechecked: {bad} (a result "
                            "cached by the inputs' values, or work finished after the call returned?)")

    def _recheck_last(self, r: _Resident, m: Member, group: _Group, fresh: _Fresh, last: int) -> None:
        """One more call on the last sweep's buffers, compared with PyTorch's results on them (adaptive sampling:
        which sweep is the last is known only once it ran)."""
        if r.graphs:
            return
        try:
            timed = r.timed
            with timed.context:
                returned = timed.fn(timed.setup() if timed.setup is not None else None)
            check_outputs(returned[0], returned[1], self.device)
            self._compare(r, returned, fresh.expected(last), self._allowed(r.cell, group), last)
        except Exception as e:
            m.error = describe_exception(e)

    def _gemm_members(self, cell: Cell) -> list[Member]:
        out = []
        for g in self._gemms_of(cell):
            name = f"gemm {g.m}x{g.n}x{g.k}"
            try:
                call = gemm_call(g, cell.dtype, self.device, self.cfg.fp8_accum)
            except Exception as e:
                m = Member(name, lambda _: None, watch=False)
                m.error = f"{type(e).__name__}: {e}".splitlines()[0]
            else:
                m = Member(name, call, context=torch.no_grad, watch=False)
            out.append(m)
        return out

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
        return Case(op, model, cell.mode, cell.dtype, self.device, inputs, self.cfg.fp8_accum, self.cfg.checkpointing)

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
            shapes = forward_shapes(case.op, eager, prepared(eager, case))
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

    def _expected(self, cell: Cell, group: _Group, timing_case: Case, seed: int) -> verify.Expected:
        """PyTorch's (torch-eager's) results on the timing inputs (seed TIMING_SEED) or a verification input set."""
        if seed not in group.expected:
            op = timing_case.op
            case = timing_case if seed == TIMING_SEED else verify.verification_inputs(op, timing_case, seed)
            group.expected[seed] = self._expected_on(cell, group, case)
        return group.expected[seed]

    def _expected_on(self, cell: Cell, group: _Group, case: Case) -> verify.Expected:
        """PyTorch's (torch-eager's) results on ``case``'s inputs, with the timing's upstream gradients."""
        op = case.op
        grads = self._timing_grads(group, case) if uses_autograd(op, cell.mode) else None
        return verify.Expected(case, compared(op, cell.mode, run_once(op, TorchEager(op), case, grads)), grads)

    def _allowed(self, cell: Cell, group: _Group) -> dict[str, float]:
        reference = group.reference()
        torch_err = {k: s.rel_err for k, s in reference.torch_stats.items()}
        return verify.allowed_error(torch_err, group.cell_errors.get(cell.impl, {}), reference.case.torch_dtype)

    def _checks(self, cell: Cell, group: _Group, impl: Implementation, t: _Resident) -> dict[str, Any]:
        """The checks of :mod:`codabench.verify` after the first call, the peak memory and the minimum bytes; an
        error status when a check fails. They leave the timed buffers holding other inputs: each sweep refills
        them anyway."""
        op, mode, dev = OPS[cell.op], cell.mode, self.device
        allowed = self._allowed(cell, group)
        expected_a = self._expected(cell, group, t.case, TIMING_SEED)
        updates: dict[str, Any] = {"min_bytes": _min_bytes(op, t.case, expected_a, t.grads)}

        def same_buffers() -> str | None:
            problem, updates["peak_mem_mib"] = verify.check_same_buffers(op, impl, t.native, mode, t.grads, expected_a,
                                                                         allowed)
            return problem

        checks = [same_buffers]
        if dev.type == "cuda":
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
            "correct": outcome.correct if outcome.checks else None, "message": outcome.failures()}


def _error_row(cell: Cell, c) -> dict[str, Any]:
    return {"op": cell.op, "impl": cell.impl, "model": cell.model, "mode": cell.mode, "dtype": cell.dtype,
            "output": c.output, "rel_err": c.stats.rel_err, "max_abs": c.stats.max_abs, "cosine": c.stats.cosine,
            "torch_rel_err": c.torch_rel_err, "ratio": c.ratio, "rel_err_vs_bf16": c.rel_err_vs_bf16,
            "passed": c.passed}
