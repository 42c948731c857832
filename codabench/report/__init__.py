"""Reports of a run directory: rewrite the CSVs in order, results.json, plots and report.html.

:func:`finalize` only reads the run's files, so it also works after a killed run, after
``--resume`` and after ``merge``; the derived speed columns (speedups, intervals, verdicts:
:func:`codabench.stats.speed_figures`, with env.json's ``timing.same_within``) are recomputed from the rows and
samples.jsonl. It holds the run's lock (:class:`codabench.writer.RunLock`) while it writes, and writes each file whole
or not at all (:func:`codabench.results.write_atomic`): an interrupt leaves each file old or new. It never replaces
a results.json with a poorer one: a folder whose results.csv lost rows its results.json holds (cut short), or whose
errors.csv or env.json went missing, is refused and nothing in it is rewritten (:func:`lost_from_json`); samples
that samples.jsonl lacks are kept from results.json.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from codabench import results as tables
from codabench.results import RunFolderError, load_run, records
from codabench.stats import read_timed, speed_figures, timing_settings
from codabench.report.html import render
from codabench.report.plots import make_plots
from codabench.writer import RunLock

HTML, JSON, PLOTS = "report.html", "results.json", "plots"


def finalize(run_dir: str | Path, focus: str | None = None) -> Path:
    """Rewrite results.csv/errors.csv sorted, write results.json, the plots and report.html (``focus``: the
    implementation whose verdicts its first screen counts, :func:`codabench.report.html.render`). A run directory that
    another process writes: :class:`codabench.writer.RunLocked`; one whose files hold less than its results.json
    (:func:`lost_from_json`): RunFolderError, and nothing is rewritten. A cell's samples that samples.jsonl lacks
    (a folder copied without it) stay in results.json as they were."""
    run_dir = Path(run_dir)
    with RunLock(run_dir):
        df, err, env = load_run(run_dir)
        old = _read_json(run_dir / JSON)
        lost = lost_from_json(old, records(df), records(err), env)
        if lost:
            raise RunFolderError(f"{run_dir / JSON} holds {' and '.join(lost)} that the run's files no longer have "
                                 "(results.csv cut short, or a file deleted?); nothing was rewritten: restore those "
                                 "files, or move results.json out of the folder to report what is left")
        df = speed_figures(df, read_timed(run_dir, env), timing_settings(env)[1])
        tables.write_csv(run_dir / tables.RESULTS, records(df), tables.RESULT_COLUMNS)
        tables.write_csv(run_dir / tables.ERRORS, records(err), tables.ERROR_COLUMNS)
        samples = {_key(r, tables.KEY): r["samples_ms"] for r in _rows(old.get("results")) if r.get("samples_ms")}
        samples.update({_key(s, tables.KEY): s["samples_ms"] for s in tables.read_samples(run_dir / tables.SAMPLES)})
        rows = records(df)
        for r in rows:
            r["samples_ms"] = samples.get(_key(r, tables.KEY))
        tables.write_json(run_dir / JSON, {"env": env, "results": rows, "errors": records(err)})
        plots = make_plots(df, run_dir / PLOTS, env)
        path = run_dir / HTML
        tables.write_atomic(path, render(df, err, env, plots, run_dir, focus))
    return path


def _read_json(path: Path) -> dict[str, Any]:
    """A results.json as written ({} if missing or unreadable: nothing to keep)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}


def _rows(recs: Any) -> list[dict[str, Any]]:
    return [r for r in recs if isinstance(r, dict)] if isinstance(recs, list) else []


def _key(rec: dict[str, Any], columns: list[str]) -> tuple[str, ...]:
    """A row's key as load_run reads it (strings; empty for missing)."""
    return tuple("" if rec.get(c) is None else str(rec.get(c)) for c in columns)


def lost_from_json(old: dict[str, Any], rows: list[dict[str, Any]], errors: list[dict[str, Any]],
                   env: dict[str, Any]) -> list[str]:
    """What a run's results.json (``old``) holds that one rebuilt from the run's files (``rows``, ``errors``,
    ``env``) would not: its rows and error rows by key, and env, in words ([]: nothing)."""
    gone = []
    for one, many, recs, new, columns in (("row", "rows", old.get("results"), rows, tables.KEY),
                                          ("error row", "error rows", old.get("errors"), errors,
                                           tables.KEY + ["output"])):
        n = len({_key(r, columns) for r in _rows(recs)} - {_key(r, columns) for r in new})
        if n:
            gone.append(f"{n} {one if n == 1 else many}")
    return gone + (["env.json's record"] if old.get("env") and not env else [])
