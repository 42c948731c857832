"""Runs a selection: the plan (:mod:`codabench.plan`) through the worker (:mod:`codabench.worker`) into the run
directory (:mod:`codabench.writer`), one row per cell.

A group (one op, model, mode and dtype, every implementation) runs in two steps. First each cell alone: its
correctness pass, first call and checks (:meth:`codabench.measure.Measurer.first`); a cell that fails gets its error
row at once. Then the group's checked cells are timed together: interleaved sweeps, each cell and each plain GEMM of
the group's speed-of-light sampled once per sweep in a random order, until every ratio is resolved or the group's
budget is spent (:meth:`codabench.measure.Measurer.sample`, :mod:`codabench.sweep`); samples.jsonl keeps each
sample's sweep and clock, so that :mod:`codabench.stats` pairs the cells sweep by sweep. Where the group's inputs do
not fit in memory together, or its sweeps fail (a hang or a crash in one cell: the worker is replaced), the group
falls back to blocks: ``--rounds`` rounds in which each cell takes a block of samples in turn, each round followed
by the GEMMs; its rows say so (``grain`` = ``round``). The group's rows are written when its sampling ends; with
``--profile``, each of its timed cells is then profiled (:meth:`codabench.measure.Measurer.profile`: profiles.jsonl,
and the Chrome traces of ``--profile-trace``), and a profile that fails is a note in that record, never a row. A request
the worker cannot answer (a timeout, an exit, a signal, a replaced clock) is the cell's error row and the run goes on
in a new worker. A time below the op's physical floor on this GPU is an error row.
"""
from __future__ import annotations

import datetime
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from codabench import plan as planning
from codabench.ceilings import floor_ms, sol_ms
from codabench.config import RunConfig
from codabench.env import command, gpu_state
from codabench.matrix import PLUGIN_OP, Cell, groups
from codabench.measure import CellResult, GroupSamples, RoundResult, own_errors
from codabench.progress import Progress
from codabench.registry import Registry
from codabench.results import KEY
from codabench.timing import CPU_WALL, Timing
from codabench.worker import Failure, InlineWorker, WorkerProcess
from codabench.writer import RunWriter
from workloads import fp8
from workloads.ops import OPS


class DeviceLost(Exception):
    """The CUDA context is unusable (``--inline`` runs only: a worker process is replaced instead)."""


@dataclass
class _Pending:
    """A timed cell on its way to its row: the row so far, its error rows, its rounds."""

    cell: Cell
    row: dict[str, Any]
    err_rows: list[dict[str, Any]]
    rounds: list[RoundResult] = field(default_factory=list)
    """The interleaved sweeps' samples (one entry), or the rounds of the blocks fallback."""


class Runner:
    def __init__(self, cfg: RunConfig, registry: Registry, worker: WorkerProcess | None = None):
        """``worker``: a worker process already spawned (the command line starts it before its own imports); by
        default one is started when the run begins (``cfg.isolate``; else the cells run in this process)."""
        self.cfg, self.registry, self.worker = cfg, registry, worker
        self.cells = planning.cells(cfg, registry)
        fp8.recipe(fp8.FP8_DTYPES[0], cfg.fp8_accum)  # an unknown accumulation mode fails here, not per cell
        self.ceilings: dict[str, Any] = {}

    def plan(self) -> list[tuple[Cell, str]]:
        """Each cell with its planned status: ``run``, ``n/a: ...``, ``skipped: ...``, ``error: ...``."""
        return [(c, planning.planned_status(self.cfg, self.registry, c)) for c in self.cells]

    def run(self):
        cfg = self.cfg
        worker = self.worker or (WorkerProcess(cfg) if cfg.isolate else InlineWorker(cfg, self.registry))
        try:
            writer = RunWriter(cfg.out_dir, cfg.resume, cfg.suite)
        except BaseException:  # e.g. --out holds a run: stop the worker the command line spawned, not orphan it
            worker.close()
            raise
        plan = [(c, s) for c, s in self.plan() if c.key not in writer.done]
        progress = Progress(len(plan), [c for c, s in plan if s == planning.RUN], enabled=cfg.show_progress)
        impls = list(dict.fromkeys((c.op, c.impl) for c in self.cells))
        start = time.time()
        try:
            env = worker.call("env", impls)
            if isinstance(env, Failure):
                env = {"device": cfg.device.type, "env_error": env.message}
            self.ceilings = env.get("ceilings", {})
            env.update(self._run_facts())
            writer.write_env(env, cfg.resume)
            for row in self._load_error_rows():
                if _key(row) not in writer.done:
                    writer.write(row)
            status = dict((c.key, s) for c, s in plan)
            for group in groups(c for c, _ in plan):
                self._run_group(group, status, worker, writer, progress)
                self._check_device(worker)
                providers = worker.call("providers", impls)  # what prepare learned (JIT warm-up, backends)
                if not isinstance(providers, Failure):
                    writer.update_env(providers=providers)
        finally:
            trace = worker.call("clock_trace") if self.cfg.device.type == "cuda" and worker.alive else []
            worker.close()
            try:
                writer.update_env(**progress.finish(),  # wall_s and its split
                                  clock_trace=[] if isinstance(trace, Failure) else
                                  [[round(t - start, 3), *state] for t, *state in trace])
            finally:
                writer.close()
        return cfg.out_dir

    # ---- one group ---------------------------------------------------------------------------------

    def _run_group(self, group: list[Cell], status: dict[tuple, str], worker, writer: RunWriter,
                   progress: Progress) -> None:
        ready: list[_Pending] = []
        blocks = ""
        for cell in group:
            pending = _Pending(cell, self._base_row(cell), [])
            planned = status[cell.key]
            if planned != planning.RUN:
                pending.row.update(status=planning.status_of(planned), message=planned)
                self._write(writer, progress, pending, ran=False)
                continue
            answer = worker.call("first", cell)
            self._check_device(worker)
            if isinstance(answer, Failure):
                pending.row.update(status="error", message=answer.message)
            else:
                assert isinstance(answer, CellResult)
                pending.row.update({k: v for k, v in answer.updates.items() if k != "min_bytes"})
                pending.row["_min_bytes"] = answer.updates.get("min_bytes")
                pending.err_rows = answer.err_rows
                if answer.ready:
                    ready.append(pending)
                    blocks = blocks or answer.blocks
                    continue
            self._write(writer, progress, pending, ran=True)
        if not ready:
            return
        if not blocks:
            # each cell's correctness-pass errors from its row: a replaced worker has not seen them
            answer = worker.call("sample", [p.cell for p in ready],
                                 {p.cell.impl: own_errors(p.err_rows) for p in ready})
            self._check_device(worker)
            if not isinstance(answer, Failure):
                self._sweeps_done(ready, answer, writer, progress)
                self._profile(ready, worker, writer)
                return
            blocks = f"the group's interleaved sampling failed ({answer.message[:200]}): sampled in blocks of rounds"
        self._blocks(ready, blocks, worker, writer, progress)
        self._profile(ready, worker, writer)

    def _profile(self, cells: list[_Pending], worker, writer: RunWriter) -> None:
        """``--profile``: each cell whose row is ok, profiled after its group's samples and rows (a failure, a crash
        or a timeout of the worker included, is the profile's note)."""
        if not self.cfg.profile:
            return
        for p in cells:
            if p.row["status"] != "ok":
                continue
            answer = worker.call("profile", p.cell, self.cfg.profile_trace)
            self._check_device(worker)
            if isinstance(answer, Failure):
                writer.write_profile(p.cell, {"note": f"profiling failed: {answer.message}"})
            else:
                writer.write_profile(p.cell, *answer)

    def _sweeps_done(self, ready: list[_Pending], answer: GroupSamples, writer: RunWriter, progress: Progress) -> None:
        for p in ready:
            got = answer.cells.get(p.cell.impl, "no samples")
            if isinstance(got, str):
                p.row.update(status="error", message=f"timing run: {got}")
            else:
                p.rounds = [got]
                p.row.update(answer.sampling)
                self._finish(p, (answer.gemms, answer.gemm_note))
            self._write(writer, progress, p, ran=True)

    def _blocks(self, cells: list[_Pending], why: str, worker, writer: RunWriter, progress: Progress) -> None:
        """The blocks fallback: ``--rounds`` rounds in which the cells take turns, each taking a block of samples,
        then the group's speed-of-light GEMMs. A cell that fails in a round becomes an error row."""
        first = cells[0].cell
        pooled: dict = {}
        note = ""
        for r in range(max(self.cfg.timing.rounds, 1)):
            for p in cells:
                if r > 0 and not p.rounds:
                    continue
                answer = worker.call("again", p.cell, own_errors(p.err_rows))
                self._check_device(worker)
                if isinstance(answer, Failure):
                    p.rounds = []
                    p.row.update(status="error", message=f"timing run (round {r + 1}): {answer.message}")
                else:
                    p.rounds.append(answer)
            note = self._pool(pooled, self._gemms(worker, first, fresh=True)) or note
        for p in cells:
            if p.rounds:
                p.row.update(grain="round", n_sweeps=len(p.rounds), stop="blocks")
                self._finish(p, (pooled, note), why)
            self._write(writer, progress, p, ran=True)

    @staticmethod
    def _gemms(worker, cell: Cell, fresh: bool) -> tuple[dict, str]:
        answer = worker.call("gemms", cell, fresh)
        return ({}, f"timing the GEMMs failed: {answer.message}") if isinstance(answer, Failure) else answer

    @staticmethod
    def _pool(pooled: dict, answer: tuple[dict, str]) -> str:
        """Add a round's GEMM samples to ``pooled`` (a GEMM that failed once stays None); returns the failure note."""
        samples, note = answer
        for g, s in samples.items():
            old = pooled.get(g, [])
            pooled[g] = None if s is None or old is None else old + s
        return note

    def _check_device(self, worker) -> None:
        if isinstance(worker, InlineWorker) and worker.measurer.device_lost:
            raise DeviceLost(worker.measurer.device_lost + "; rerun with --resume to go on")

    # ---- rows -----------------------------------------------------------------------------------------

    def _finish(self, p: _Pending, gemms: tuple[dict, str], why_blocks: str = "") -> None:
        """A timed cell's row from its samples (its sweeps, or its pooled rounds) and its group's GEMM samples (with
        the note of a GEMM that failed): summary statistics, speed-of-light, ceilings, the physical floor, clocks."""
        samples, note = gemms
        cell, row, op = p.cell, p.row, OPS[p.cell.op]
        model = self.cfg.model(cell.model)
        timing = Timing([s for r in p.rounds for s in r.samples_ms], p.rounds[0].kind)
        median = timing.median
        # the error rule's failures (the correctness pass's message) first, then how the cell was sampled
        notes = list(dict.fromkeys(n for n in [row.get("message"), why_blocks] + [r.note for r in p.rounds] if n))
        sol = sol_ms(samples, op.gemms(model, cell.mode))
        if sol is None and note:
            notes.append("no speed-of-light: " + note)
        flops = op.flops(model, cell.mode)
        tflops = flops / (median * 1e-3) / 1e12
        ceiling = self.ceilings.get("fp8_tflops" if cell.dtype in fp8.FP8_DTYPES else "bf16_tflops")
        min_bytes = row.pop("_min_bytes", None)
        floor = floor_ms(flops, min_bytes, self.ceilings, cell.dtype) if min_bytes else None
        hard_floor = floor_ms(flops, min_bytes, self.ceilings, cell.dtype, slack=True) if min_bytes else None
        clocks = [c for r in p.rounds for c in (r.clock_mhz if r.sweeps is not None else r.clocks.sm_mhz)
                  if c is not None]
        host = [h for r in p.rounds for h in (r.host_ms or [])] if timing.kind != CPU_WALL else []
        row.update(status="ok", message="; ".join(notes), median_ms=median, p20_ms=timing.p20, p80_ms=timing.p80,
                   host_ms=statistics.median(host) if host else None,
                   cv=timing.cv, n_samples=len(timing.samples_ms), timing=timing.kind,
                   tflops=tflops, sol_ms=sol, sol_ratio=median / sol if sol else None,
                   pct_ceiling=100 * tflops / ceiling if isinstance(ceiling, float) and cell.dtype != "fp32" else None,
                   floor_ms=floor, sm_clock_min_mhz=min(clocks) if clocks else None,
                   sm_clock_median_mhz=statistics.median(clocks) if clocks else None)
        if hard_floor is not None and median < hard_floor:
            row.update(status="error", message=(
                f"faster than the hardware allows: {median:.4g} ms, below the floor of {hard_floor:.4g} ms "
                f"({min_bytes / 1e6:.4g} MB at the copy bandwidth, {flops / 1e12:.4g} TFLOP at the GEMM ceiling, "
                "both at datasheet peaks): the timed calls did not do the work"))
        sweeps = p.rounds[0].sweeps if len(p.rounds) == 1 and p.rounds[0].sweeps is not None else None
        p.row["_samples"] = {"timing": timing.kind, "samples_ms": timing.samples_ms,
                             "rounds": [r.samples_ms for r in p.rounds],
                             "grain": "sample" if sweeps is not None else "round",
                             "sweeps": sweeps if sweeps is not None else
                             [i for i, r in enumerate(p.rounds) for _ in r.samples_ms],
                             "clock_mhz": p.rounds[0].clock_mhz if sweeps is not None else None}

    def _write(self, writer: RunWriter, progress: Progress, p: _Pending, ran: bool) -> None:
        row = p.row
        if row["status"] != "ok":  # only an ok cell has a pass mark; errors.csv keeps each output's `passed`
            row["correct"] = None
        row.pop("_min_bytes", None)
        samples = row.pop("_samples", None)
        row.update(finished_at=_now(), **gpu_state(self.cfg.device))
        writer.write(row, p.err_rows if row["status"] != "skipped" else [], samples, p.cell)
        progress.update(p.cell, _outcome(row), ran, row.get("first_call_s"), row.get("check_s"))
        if ran and self.cfg.device.type == "cuda":
            time.sleep(self.cfg.cooldown_s)

    def _base_row(self, cell: Cell) -> dict[str, Any]:
        impl, recipe = self.registry.get(cell.op, cell.impl), fp8.recipe(cell.dtype, self.cfg.fp8_accum)
        return {"op": cell.op, "impl": cell.impl, "model": cell.model, "mode": cell.mode, "dtype": cell.dtype,
                "label": impl.label, "tokens": self.cfg.model(cell.model).tokens,
                "check_tokens": self.cfg.model(cell.model, check=self.cfg.check_tokens is not None).tokens,
                "fp8_recipe": recipe.label if recipe is not None else None, "finished_at": _now()}

    def _run_facts(self) -> dict[str, Any]:
        cfg = self.cfg
        # the command is this process's: the environment comes from the worker process, whose argv is its own
        return dict(command=command(), suite=cfg.suite, run=cfg.out_dir.name,
                    models={m: cfg.model_record(m) for m in cfg.selection.models},
                    shard=list(cfg.shard) if cfg.shard else None,
                    tokens=cfg.tokens, vocab=cfg.vocab, check_tokens=cfg.check_tokens, cuda_graph=cfg.cuda_graph,
                    timing=vars(cfg.timing), fp8_accum=cfg.fp8_accum, cell_timeout_s=cfg.cell_timeout_s,
                    isolated=cfg.isolate, profile=cfg.profile, profile_trace=cfg.profile_trace,
                    fp8_recipes={d: fp8.recipe(d, cfg.fp8_accum).label for d in fp8.FP8_DTYPES
                                 if d in cfg.selection.dtypes},
                    load_errors=[{"source": s, "error": e} for s, e in self.registry.load_errors])

    def _load_error_rows(self) -> list[dict[str, Any]]:
        return [{"op": PLUGIN_OP, "impl": source, "model": "", "mode": "", "dtype": "", "status": "error",
                 "message": f"plugin failed to load: {err}", "finished_at": _now()}
                for source, err in self.registry.load_errors]


def _key(row: dict[str, Any]) -> tuple:
    return tuple(str(row[k]) for k in KEY)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _outcome(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        msg = row["message"]
        return (msg if msg.startswith(row["status"]) else f"{row['status']}: {msg}")[:160]
    ok = {True: "pass", False: "FAIL", None: "?"}[row.get("correct")]
    return f"ok {row['median_ms']:.3f} ms ({row['timing']}), {ok}"
