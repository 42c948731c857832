"""What a run will do: the cells of its selection (its shard), each with a planned status.

A planned status is ``run``, or the row a cell gets without running: ``n/a: ...`` (the implementation has no such
mode or dtype), ``skipped: ...`` (it cannot run here, or the suite leaves it out) or ``error: ...``.
"""
from __future__ import annotations

from codabench.case import Case
from codabench.config import RunConfig
from codabench.matrix import Cell, build_cells, shard
from codabench.registry import Registry
from workloads.ops import OPS

RUN = "run"


def cells(cfg: RunConfig, registry: Registry) -> list[Cell]:
    """The selection's cells, grouped, in the order they are measured (only the run's shard)."""
    out = build_cells(cfg.selection, registry)
    return shard(out, *cfg.shard) if cfg.shard else out


def status_of(reason: str) -> str:
    """The row status of a planned reason (``n/a: ...`` -> ``n/a``)."""
    return reason.split(":", 1)[0]


def planned_status(cfg: RunConfig, registry: Registry, cell: Cell) -> str:
    """``run``, or why the cell does not run (its row's status and message)."""
    allowed = cfg.selection.impl_modes.get(cell.impl)
    if allowed == ():
        return f"skipped: the {cfg.suite} suite leaves {cell.impl} out (give --impls to run it)"
    if allowed is not None and OPS[cell.op].kind == "autograd" and cell.mode not in allowed:
        return (f"skipped: the {cfg.suite} suite runs {cell.impl} only in {'/'.join(allowed)} mode "
                "(give --modes or --impls to run every mode)")
    stub = Case(OPS[cell.op], cfg.model(cell.model), cell.mode, cell.dtype, cfg.device, {}, cfg.fp8_accum)
    undefined = stub.op.na_reason(stub.model)
    if undefined:
        return undefined
    try:
        reason = registry.get(cell.op, cell.impl).skip_reason(stub)
    except Exception as e:
        return f"error: skip_reason raised {type(e).__name__}: {e}"
    return implementation_reason(reason)


def implementation_reason(reason: object) -> str:
    """The planned status of what an implementation's ``skip_reason`` returned: :data:`RUN` for None or "", the
    reason where it names its status (``n/a: ...``, ``skipped: ...``), ``skipped: <reason>`` for any other text (it
    cannot run here: the reason is the row's message, never its status), an error for anything but text."""
    if reason is None or reason == "":
        return RUN
    if not isinstance(reason, str):
        return f"error: skip_reason returned {type(reason).__name__} {reason!r}, not a str or None"
    return reason if status_of(reason) in ("n/a", "skipped") else f"skipped: {reason}"


def plan(cfg: RunConfig, registry: Registry) -> list[tuple[Cell, str]]:
    """Each cell of the run with its planned status."""
    return [(c, planned_status(cfg, registry, c)) for c in cells(cfg, registry)]
