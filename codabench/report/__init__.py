"""Reports of a run directory: rewrite the CSVs in order, results.json, plots and report.html.

:func:`finalize` only reads the run's files, so it also works after a killed run, after
``--resume`` and after ``merge``; the derived speed columns (speedups, intervals, verdicts:
:func:`codabench.stats.speed_figures`, with env.json's ``timing.same_within``) are recomputed from the rows and
samples.jsonl.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from codabench import results as tables
from codabench.results import load_run, records
from codabench.stats import read_timed, speed_figures, timing_settings
from codabench.report.html import render
from codabench.report.plots import make_plots

HTML, JSON, PLOTS = "report.html", "results.json", "plots"


def finalize(run_dir: str | Path) -> Path:
    """Rewrite results.csv/errors.csv sorted, write results.json, the plots and report.html."""
    run_dir = Path(run_dir)
    df, err, env = load_run(run_dir)
    df = speed_figures(df, read_timed(run_dir, env), timing_settings(env)[1])
    _rewrite(run_dir / tables.RESULTS, df, tables.RESULT_COLUMNS)
    _rewrite(run_dir / tables.ERRORS, err, tables.ERROR_COLUMNS)
    samples = {tuple(s[k] for k in tables.KEY): s["samples_ms"] for s in tables.read_samples(run_dir / tables.SAMPLES)}
    rows = records(df)
    for r in rows:
        r["samples_ms"] = samples.get(tuple(r[k] for k in tables.KEY))
    tables.write_json(run_dir / JSON, {"env": env, "results": rows, "errors": records(err)})
    plots = make_plots(df, run_dir / PLOTS, env)
    path = run_dir / HTML
    path.write_text(render(df, err, env, plots, run_dir))
    return path


def _rewrite(path: Path, df: pd.DataFrame, columns: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    w = tables.AppendWriter(tmp, columns)
    w.write(records(df))
    tmp.replace(path)
