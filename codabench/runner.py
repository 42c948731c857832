"""Runs the cells of a selection and appends one row per cell as it finishes (per group, with rounds).

Per cell: ``skip_reason`` (n/a or skipped row) -> untimed correctness pass on fresh inputs
(:mod:`codabench.correctness`) -> timing on other inputs (:mod:`codabench.timing`) -> speed-of-light
(:mod:`codabench.ceilings`). With ``--rounds`` > 1 (the GPU default, benchmarking.md: "interleave
providers or repeat rounds") the timed cells of a group take turns over the rounds, followed in each round by
the plain GEMMs of its speed-of-light, so that clock drift during a run falls on a cell, its baselines and its
GEMMs alike; samples are pooled over the rounds and the group's rows are written when its last round ends.
fp8 cells carry the run's recipe (``Case.recipe``: the dtype's scaling and ``--fp8-accum``); once per fp8
group, the cast of the cell's GEMM operands (``fp8.quantize_operands``, the untimed step of every
implementation's ``prepare``) is timed on the timing inputs as a figure of its own (``cast_ms``).
Every failure of an implementation (exception, missing output, wrong shape or dtype, NaN/Inf, input
mutation, out of memory) becomes an error row with a clear message and the run goes on. A broken CUDA
context (e.g. an illegal memory access) cannot be recovered in the same process: the run stops after
writing that cell's row, and ``--resume`` goes on from there.
"""
from __future__ import annotations

import datetime
import gc
import json
import math
import statistics
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from codabench.case import Case
from codabench.ceilings import GemmTimer, measure_ceilings
from codabench.correctness import CHECK_SEED, CheckOutcome, GroupReference, build_reference, check_impl
from codabench.env import collect_env, gpu_state, provider_metadata
from codabench.execute import forward_shapes, timed_call, uses_autograd
from codabench.matrix import PLUGIN_OP, SPEED_BASELINE, Cell, Selection, build_cells, groups, shard
from codabench.progress import Progress
from codabench.registry import Implementation, Registry, Tensors
from codabench import results as tables
from codabench.timing import Timing, TimingConfig, measure, measure_graph, per_round
from kernels.torch_baselines import TorchEager
from workloads import fp8
from workloads.models import ModelShape, get_model
from workloads.op import Gemm
from workloads.ops import OPS

TIMING_SEED = 0
TIMING_GRAD_SEED = 7
MAX_GRAPH_SETS = 8
CAST_REPS = 5
"""Samples of an fp8 group's cast time (a cheap side figure, not a cell's timing)."""


class RunExists(Exception):
    """The output directory already holds results and --resume was not given."""


class DeviceLost(Exception):
    """The CUDA context is unusable after a cell's failure; resume in a new process."""


@dataclass
class RunConfig:
    out_dir: Path
    selection: Selection
    device: torch.device
    suite: str = "custom"
    tokens: int | None = None
    vocab: int | None = None
    check_tokens: int | None = None
    """Tokens of the correctness pass (default: the timing's)."""
    timing: TimingConfig = field(default_factory=TimingConfig)
    cuda_graph: bool = False
    resume: bool = False
    shard: tuple[int, int] | None = None
    cooldown_s: float = 0.05
    """Pause between cells on the GPU."""
    show_progress: bool = True
    fp8_accum: str = "fast"
    """fp8 tensor-core accumulation of every fp8 cell (``--fp8-accum``): ``fast`` or ``promoted``."""


def describe_exception(e: BaseException) -> str:
    """``Type: first line of the message (file:line of the innermost frame)``."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    prefix = "out of memory: " if isinstance(e, torch.cuda.OutOfMemoryError) else ""
    return f"{prefix}{type(e).__name__}: {msg}{where}"[:600]


def status_of_reason(reason: str) -> str:
    return "n/a" if reason.startswith("n/a") else "skipped"


def cast_time(case: Case, cfg: TimingConfig) -> float:
    """Median ms of quantizing an fp8 case's GEMM operands (``fp8.quantize_operands`` on its canonical inputs)."""
    op, rec = case.op, case.recipe
    cfg = replace(cfg, warmup=1, warmup_ms=0.0, reps=CAST_REPS)
    return measure(lambda _: fp8.quantize_operands(case.inputs, op.fp8_operands, rec), None, case.device, cfg).median


@dataclass
class _Pending:
    """One cell on its way to its results row: the row so far, its error rows, its timing (pooled over rounds)."""

    cell: Cell
    row: dict[str, Any]
    planned_run: bool
    err_rows: list[dict[str, Any]] = field(default_factory=list)
    timing: Timing | None = None
    samples: dict[str, Any] | None = None


class _Group:
    """The shared state of one (op, model, mode, dtype) group: reference and timing gradients (both
    lazy), the medians measured so far, and (fp8) the cast time."""

    def __init__(self, make_case: Callable[[], Case]):
        self.make_case = make_case
        """Builds the correctness case (inputs from CHECK_SEED); called only if a cell of the group runs."""
        self._ref: GroupReference | None = None
        self._error: str | None = None
        self._timing_grads: Tensors | None = None
        self.medians: dict[str, float] = {}
        self.cast_ms: float | None = None
        self.cast_note = ""
        """Why the cast time is missing, when measuring it failed."""
        self.gemm_samples: dict[Gemm, list[float] | None] = {}
        """Runs in rounds: the samples of the plain GEMMs of the group's speed-of-light, pooled over its rounds."""

    def measure_cast(self, timing_case: Case, cfg: TimingConfig) -> None:
        """The group's fp8 cast time, on the timing inputs; measured by the first timed cell (errors become a note)."""
        if timing_case.recipe is None or self.cast_ms is not None or self.cast_note:
            return
        try:
            self.cast_ms = cast_time(timing_case, cfg)
        except Exception as e:
            self.cast_note = f"no cast time: {describe_exception(e)}"

    def timing_grad_outputs(self, timing_case: Case) -> Tensors:
        """Canonical upstream gradients of the timing pass, shaped by PyTorch's own forward (so the
        implementation under test is not run, or compiled, once more just to learn its shapes)."""
        if self._timing_grads is None:
            eager = TorchEager(timing_case.op)
            shapes = forward_shapes(timing_case.op, eager, eager.prepare(timing_case))
            self._timing_grads = timing_case.op.grad_outputs(shapes, TIMING_GRAD_SEED)
        return self._timing_grads

    def reference(self) -> GroupReference:
        if self._ref is None and self._error is None:
            try:
                case = self.make_case()
                self._ref = build_reference(case.op, case)
            except Exception as e:
                self._error = describe_exception(e)
        if self._error is not None:
            raise RuntimeError(f"building the float64 reference / PyTorch error failed: {self._error}")
        return self._ref


class Runner:
    def __init__(self, cfg: RunConfig, registry: Registry):
        self.cfg, self.registry = cfg, registry
        self.device = cfg.device
        self.cells = build_cells(cfg.selection, registry)
        if cfg.shard:
            self.cells = shard(self.cells, *cfg.shard)
        fp8.recipe(fp8.FP8_DTYPES[0], cfg.fp8_accum)  # an unknown accumulation mode fails here, not per cell
        self.gemm_timer = GemmTimer(self.device, cfg.timing, cfg.fp8_accum)
        self.ceilings: dict[str, Any] = {}

    # ---- the matrix --------------------------------------------------------------------------

    def model(self, name: str, check: bool = False) -> ModelShape:
        m = get_model(name, self.cfg.tokens, self.cfg.vocab)
        return m.with_(tokens=self.cfg.check_tokens) if check else m

    def impl(self, cell: Cell) -> Implementation:
        return self.registry.get(cell.op, cell.impl)

    def skip_reason(self, cell: Cell) -> str | None:
        allowed = self.cfg.selection.impl_modes.get(cell.impl)
        if allowed is not None and OPS[cell.op].kind == "autograd" and cell.mode not in allowed:
            return (f"skipped: the {self.cfg.suite} suite runs {cell.impl} only in "
                    f"{'/'.join(allowed)} mode (give --modes or --impls to run every mode)")
        stub = self._case(cell, self.model(cell.model), {})
        return self.impl(cell).skip_reason(stub)

    def plan(self) -> list[tuple[Cell, str]]:
        """Each cell with its planned status: ``run``, ``n/a: ...``, ``skipped: ...``, ``error: ...``."""
        out = []
        for c in self.cells:
            try:
                out.append((c, self.skip_reason(c) or "run"))
            except Exception as e:
                out.append((c, f"error: skip_reason raised {describe_exception(e)}"))
        return out

    # ---- running -----------------------------------------------------------------------------

    def run(self) -> Path:
        out = self.cfg.out_dir
        out.mkdir(parents=True, exist_ok=True)
        results_path = out / tables.RESULTS
        if results_path.exists() and not self.cfg.resume:
            raise RunExists(f"{out} already holds results: pass --resume to continue it, or another --out")
        done = self._done_keys() if self.cfg.resume else set()
        results = tables.AppendWriter(results_path, tables.RESULT_COLUMNS)
        errors = tables.AppendWriter(out / tables.ERRORS, tables.ERROR_COLUMNS)
        self._write_env(out)

        results.write(r for r in self._load_error_rows() if _key(r) not in done)
        plan = [(c, s) for c, s in self.plan() if c.key not in done]
        progress = Progress(len(plan), sum(s == "run" for _, s in plan), enabled=self.cfg.show_progress)
        try:
            planned = dict((c.key, s) for c, s in plan)
            for group in groups(c for c, _ in plan):
                state = _Group(lambda cell=group[0]: self._check_case(cell))
                in_rounds: list[_Pending] = []
                for cell in group:
                    t0 = time.monotonic()
                    pending = self.run_cell(cell, state, planned[cell.key])
                    if pending.timing is not None and self.cfg.timing.rounds > 1:
                        in_rounds.append(pending)  # written once the group's rounds are done
                        continue
                    self._finish(pending, state)
                    self._write(pending, results, errors, progress, time.monotonic() - t0)
                if in_rounds:
                    t0 = time.monotonic()
                    self._more_rounds(in_rounds, state)
                    for pending in in_rounds:
                        self._finish(pending, state)
                        self._write(pending, results, errors, progress, (time.monotonic() - t0) / len(in_rounds))
                del state
                self._refresh_providers(out)  # per group: a killed run keeps what prepare learned (JIT warm-up)
        finally:
            progress.close()
            self._refresh_providers(out)
        return out

    def _done_keys(self) -> set[tuple]:
        df = tables.read_csv(self.cfg.out_dir / tables.RESULTS, tables.RESULT_COLUMNS)
        return {tuple("" if isinstance(v, float) and math.isnan(v) else str(v) for v in r)
                for r in df[tables.KEY].itertuples(index=False)}

    def _write_env(self, out: Path) -> None:
        impls = [self.impl(c) for c in self.cells]
        env = collect_env(self.device, impls)
        env.update(suite=self.cfg.suite, run=out.name, shard=list(self.cfg.shard) if self.cfg.shard else None,
                   tokens=self.cfg.tokens, vocab=self.cfg.vocab, check_tokens=self.cfg.check_tokens,
                   cuda_graph=self.cfg.cuda_graph, timing=vars(self.cfg.timing), fp8_accum=self.cfg.fp8_accum,
                   fp8_recipes={d: fp8.recipe(d, self.cfg.fp8_accum).label for d in fp8.FP8_DTYPES
                                if d in self.cfg.selection.dtypes},
                   load_errors=[{"source": s, "error": e} for s, e in self.registry.load_errors])
        if self.device.type == "cuda":
            self.ceilings = measure_ceilings(self.device, self.cfg.timing, self.cfg.fp8_accum)
            env["ceilings"] = self.ceilings
        env_path = out / tables.ENV
        if self.cfg.resume and env_path.exists():
            old = json.loads(env_path.read_text())
            env["earlier_sessions"] = old.pop("earlier_sessions", []) + [old]
        tables.write_json(env_path, env)

    def _refresh_providers(self, out: Path) -> None:
        """Provider metadata again once cells ran: what ``prepare`` learned (JIT warm-up times, resolved backends)."""
        env_path = out / tables.ENV
        env = json.loads(env_path.read_text())
        env["providers"] = provider_metadata([self.impl(c) for c in self.cells])
        tables.write_json(env_path, env)

    def _load_error_rows(self) -> list[dict[str, Any]]:
        return [{"op": PLUGIN_OP, "impl": source, "model": "", "mode": "", "dtype": "", "status": "error",
                 "message": f"plugin failed to load: {err.strip().splitlines()[-1]}", "finished_at": _now()}
                for source, err in self.registry.load_errors]

    def _case(self, cell: Cell, model: ModelShape, inputs: dict) -> Case:
        return Case(OPS[cell.op], model, cell.mode, cell.dtype, self.device, inputs, self.cfg.fp8_accum)

    def _check_case(self, cell: Cell) -> Case:
        op, model = OPS[cell.op], self.model(cell.model, check=self.cfg.check_tokens is not None)
        return self._case(cell, model, op.inputs(model, cell.dtype, self.device, CHECK_SEED))

    def _after_error(self, cell: Cell) -> None:
        gc.collect()
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        except Exception as e:
            raise DeviceLost(f"the CUDA context is unusable after cell {cell} ({describe_exception(e)}); "
                             f"its row is written: rerun with --resume to go on") from e

    # ---- one cell ----------------------------------------------------------------------------

    def run_cell(self, cell: Cell, group: _Group, planned: str) -> _Pending:
        """The results row and per-output error rows of one cell, and its first round of timing (None when the
        cell did not get that far: skipped, n/a, or an error row)."""
        row = self._base_row(cell)
        pending = _Pending(cell, row, planned == "run")
        if planned != "run":
            row.update(status="error" if planned.startswith("error") else status_of_reason(planned),
                       message=planned)
            return pending
        impl = self.impl(cell)
        try:
            outcome = check_impl(group.reference(), impl)
        except Exception as e:
            row.update(status="error", message=f"correctness run: {describe_exception(e)}")
            return pending
        pending.err_rows = [self._error_row(cell, c) for c in outcome.checks]
        self._fill_errors(row, outcome)
        if outcome.errors:
            row.update(status="error", message="; ".join(outcome.errors))
            return pending
        try:
            pending.timing = self.time_cell(cell, self.model(cell.model), group)
        except Exception as e:
            row.update(status="error", message=f"timing run: {describe_exception(e)}")
        return pending

    def _more_rounds(self, cells: list[_Pending], group: _Group) -> None:
        """Rounds 2.. of a group's timing: its cells take turns, then its speed-of-light GEMMs (timed in every
        round, round 1 included). A cell that fails in a later round becomes an error row."""
        later = replace(per_round(self.cfg.timing), warmup=1, warmup_ms=0.0)  # compiled, tuned, GPU busy
        first = cells[0].cell
        gemms = OPS[first.op].gemms(self.model(first.model), first.mode)
        for r in range(self.cfg.timing.rounds):
            if r > 0:
                for p in cells:
                    if p.timing is None:
                        continue
                    try:
                        p.timing.extend(self.time_cell(p.cell, self.model(p.cell.model), group, later))
                    except Exception as e:
                        p.timing = None
                        p.row.update(status="error", message=f"timing run (round {r + 1}): {describe_exception(e)}")
                        gc.collect()  # the device check (and DeviceLost) comes when the row is written
            for g in dict.fromkeys(gemms):
                pooled = group.gemm_samples.setdefault(g, [])
                if pooled is not None:
                    new = self.gemm_timer.samples(g, first.dtype, later)
                    group.gemm_samples[g] = None if new is None else pooled + new

    def _sol_ms(self, cell: Cell, model: ModelShape, group: _Group) -> float | None:
        gemms = OPS[cell.op].gemms(model, cell.mode)
        if self.cfg.timing.rounds <= 1:
            return self.gemm_timer.sol_ms(gemms, cell.dtype)
        times = [group.gemm_samples.get(g) for g in gemms]
        return None if not times or any(not t for t in times) else sum(statistics.median(t) for t in times)

    def _finish(self, p: _Pending, group: _Group) -> None:
        """Fill a timed cell's row from its (pooled) timing; sets ``p.samples``."""
        if p.timing is None:
            return
        cell, row, timing, op = p.cell, p.row, p.timing, OPS[p.cell.op]
        model = self.model(cell.model)
        notes = [n for n in (timing.note, group.cast_note) if n]
        group.medians[cell.impl] = timing.median
        sol = self._sol_ms(cell, model, group)
        if sol is None and self.gemm_timer.failures:
            notes.append("no speed-of-light: " + next(iter(self.gemm_timer.failures.values())))
        tflops = op.flops(model, cell.mode) / (timing.median * 1e-3) / 1e12
        ceiling = self.ceilings.get("fp8_tflops" if cell.dtype in fp8.FP8_DTYPES else "bf16_tflops")
        base = group.medians.get(SPEED_BASELINE)
        row.update(status="ok", message="; ".join(notes), median_ms=timing.median, p20_ms=timing.p20,
                   p80_ms=timing.p80, cv=timing.cv, n_samples=len(timing.samples_ms), timing=timing.kind,
                   first_call_s=timing.first_call_s,
                   tflops=tflops, speedup=base / timing.median if base else None, sol_ms=sol,
                   sol_ratio=timing.median / sol if sol else None,
                   pct_ceiling=100 * tflops / ceiling if isinstance(ceiling, float) and cell.dtype != "fp32" else None,
                   cast_ms=group.cast_ms, **gpu_state(self.device))
        p.samples = {"timing": timing.kind, "samples_ms": timing.samples_ms}

    def _write(self, p: _Pending, results: tables.AppendWriter, errors: tables.AppendWriter, progress: Progress,
               seconds: float) -> None:
        p.row["finished_at"] = _now()
        results.write([p.row])
        errors.write(p.err_rows)
        if p.samples is not None:
            tables.append_jsonl(self.cfg.out_dir / tables.SAMPLES, {**dict(zip(tables.KEY, p.cell.key)), **p.samples})
        progress.update(str(p.cell), _outcome(p.row), p.planned_run, seconds)
        if p.row["status"] == "error":
            self._after_error(p.cell)
        elif self.device.type == "cuda" and p.planned_run:
            time.sleep(self.cfg.cooldown_s)

    def time_cell(self, cell: Cell, model: ModelShape, group: _Group, cfg: TimingConfig | None = None) -> Timing:
        """The cell's timing on the TIMING_SEED inputs (and, first timed cell of an fp8 group: the cast time);
        ``cfg``: the timing of this round (default: the first round's share of the run's)."""
        op, impl, dev = OPS[cell.op], self.impl(cell), self.device
        cfg = cfg or per_round(self.cfg.timing)
        case = self._case(cell, model, op.inputs(model, cell.dtype, dev, TIMING_SEED))
        group.measure_cast(case, self.cfg.timing)
        grad_outputs = group.timing_grad_outputs(case) if uses_autograd(op, cell.mode) else None
        native = impl.prepare(case)
        if grad_outputs is not None:
            grad_outputs = impl.grad_outputs_to_native(grad_outputs, native)
        note = ""
        if self.cfg.cuda_graph and dev.type == "cuda":
            if uses_autograd(op, cell.mode):
                note = "cuda-graph mode covers fwd and direct modes only: timed with events"
            else:
                try:
                    with torch.no_grad():
                        return measure_graph(lambda nat: impl.run(nat), self._graph_sets(impl, case, native), dev,
                                             cfg)
                except Exception as e:
                    note = f"cuda-graph capture failed ({describe_exception(e)}): timed with events"
        timed = timed_call(op, impl, native, cell.mode, grad_outputs)
        with timed.context:
            timing = measure(timed.fn, timed.setup, dev, cfg)
        timing.note = note
        return timing

    def _graph_sets(self, impl: Implementation, case: Case, native: dict) -> list[dict]:
        """Prepared input sets to rotate among, together at least 3x L2 (2 to MAX_GRAPH_SETS sets)."""
        nbytes = sum(t.numel() * t.element_size() for t in case.inputs.values() if isinstance(t, torch.Tensor))
        l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 64 * 2**20
        k = min(MAX_GRAPH_SETS, max(2, math.ceil(3 * l2 / max(nbytes, 1))))
        sets = [native]
        for i in range(1, k):
            inputs = case.op.inputs(case.model, case.dtype, self.device, TIMING_SEED + i)
            sets.append(impl.prepare(replace(case, inputs=inputs)))
        return sets

    # ---- rows --------------------------------------------------------------------------------

    def _base_row(self, cell: Cell) -> dict[str, Any]:
        impl, recipe = self.impl(cell), fp8.recipe(cell.dtype, self.cfg.fp8_accum)
        return {"op": cell.op, "impl": cell.impl, "model": cell.model, "mode": cell.mode, "dtype": cell.dtype,
                "label": impl.label, "tokens": self.model(cell.model).tokens,
                "check_tokens": self.model(cell.model, check=self.cfg.check_tokens is not None).tokens,
                "fp8_recipe": recipe.label if recipe is not None else None, "finished_at": _now()}

    @staticmethod
    def _fill_errors(row: dict[str, Any], outcome: CheckOutcome) -> None:
        row.update(rel_err=outcome.worst(lambda c: c.stats.rel_err),
                   max_abs_err=outcome.worst(lambda c: c.stats.max_abs),
                   err_ratio=outcome.worst(lambda c: c.ratio),
                   rel_err_vs_bf16=outcome.worst(lambda c: c.rel_err_vs_bf16),
                   correct=outcome.correct if outcome.checks else None)

    @staticmethod
    def _error_row(cell: Cell, c) -> dict[str, Any]:
        return {"op": cell.op, "impl": cell.impl, "model": cell.model, "mode": cell.mode, "dtype": cell.dtype,
                "output": c.output, "rel_err": c.stats.rel_err, "max_abs": c.stats.max_abs,
                "cosine": c.stats.cosine, "torch_rel_err": c.torch_rel_err, "ratio": c.ratio,
                "rel_err_vs_bf16": c.rel_err_vs_bf16, "passed": c.passed}


def _key(row: dict[str, Any]) -> tuple:
    return tuple(str(row[k]) for k in tables.KEY)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _outcome(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        msg = row["message"]
        return (msg if msg.startswith(row["status"]) else f"{row['status']}: {msg}")[:160]
    ok = {True: "pass", False: "FAIL", None: "?"}[row.get("correct")]
    return f"ok {row['median_ms']:.3f} ms ({row['timing']}), {ok}"
