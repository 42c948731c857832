"""Reports of a run directory: rewrite the CSVs in order, results.json, plots and report.html.

:func:`finalize` only reads the run's files, so it also works after a killed run, after
``--resume`` and after ``merge``; the derived speed columns (speedups, intervals, verdicts:
:func:`codabench.stats.speed_figures`, with env.json's ``timing.same_within``) are recomputed from the rows and
samples.jsonl. It holds the run's lock (:class:`codabench.writer.RunLock`) while it writes, and writes each file whole
or not at all (:func:`codabench.results.write_atomic`): an interrupt leaves each file old or new.
"""
from __future__ import annotations

from pathlib import Path

from codabench import results as tables
from codabench.results import load_run, records
from codabench.stats import read_timed, speed_figures, timing_settings
from codabench.report.html import render
from codabench.report.plots import make_plots
from codabench.writer import RunLock

HTML, JSON, PLOTS = "report.html", "results.json", "plots"


def finalize(run_dir: str | Path, focus: str | None = None) -> Path:
    """Rewrite results.csv/errors.csv sorted, write results.json, the plots and report.html (``focus``: the
    implementation whose verdicts its first screen counts, :func:`codabench.report.html.render`). A run directory that
    another process writes: :class:`codabench.writer.RunLocked`."""
    run_dir = Path(run_dir)
    with RunLock(run_dir):
        df, err, env = load_run(run_dir)
        df = speed_figures(df, read_timed(run_dir, env), timing_settings(env)[1])
        tables.write_csv(run_dir / tables.RESULTS, records(df), tables.RESULT_COLUMNS)
        tables.write_csv(run_dir / tables.ERRORS, records(err), tables.ERROR_COLUMNS)
        samples = {tuple(s[k] for k in tables.KEY): s["samples_ms"]
                   for s in tables.read_samples(run_dir / tables.SAMPLES)}
        rows = records(df)
        for r in rows:
            r["samples_ms"] = samples.get(tuple(r[k] for k in tables.KEY))
        tables.write_json(run_dir / JSON, {"env": env, "results": rows, "errors": records(err)})
        plots = make_plots(df, run_dir / PLOTS, env)
        path = run_dir / HTML
        tables.write_atomic(path, render(df, err, env, plots, run_dir, focus))
    return path
