"""Reports of a run directory: rewrite the CSVs in order, results.json, plots and report.html.

:func:`finalize` only reads the run's files, so it also works after a killed run, after
``--resume`` and after ``merge``; derived columns (speedup against torch-compile) are recomputed
from the rows themselves.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from codabench import results as tables
from codabench.matrix import SPEED_BASELINE
from codabench.results import load_run, records
from codabench.report.html import render
from codabench.report.plots import make_plots

HTML, JSON, PLOTS = "report.html", "results.json", "plots"


def recompute_speedup(df: pd.DataFrame) -> pd.DataFrame:
    """``speedup = torch-compile median / median`` within each (op, model, mode, dtype)."""
    med = pd.to_numeric(df["median_ms"], errors="coerce")
    base = df[(df["impl"] == SPEED_BASELINE) & (df["status"] == "ok")]
    base_med = {tuple(r[k] for k in ("op", "model", "mode", "dtype")): float(r["median_ms"])
                for _, r in base.iterrows()}
    keys = list(zip(df["op"], df["model"], df["mode"], df["dtype"]))
    df["speedup"] = [base_med[k] / m if k in base_med and df["status"].iloc[i] == "ok" and m > 0 else None
                     for i, (k, m) in enumerate(zip(keys, med))]
    return df


def finalize(run_dir: str | Path) -> Path:
    """Rewrite results.csv/errors.csv sorted, write results.json, the plots and report.html."""
    run_dir = Path(run_dir)
    df, err, env = load_run(run_dir)
    df = recompute_speedup(df)
    _rewrite(run_dir / tables.RESULTS, df, tables.RESULT_COLUMNS)
    _rewrite(run_dir / tables.ERRORS, err, tables.ERROR_COLUMNS)
    samples = {tuple(s[k] for k in tables.KEY): s["samples_ms"] for s in tables.read_samples(run_dir / tables.SAMPLES)}
    rows = records(df)
    for r in rows:
        r["samples_ms"] = samples.get(tuple(r[k] for k in tables.KEY))
    tables.write_json(run_dir / JSON, {"env": env, "results": rows, "errors": records(err)})
    plots = make_plots(df, run_dir / PLOTS)
    path = run_dir / HTML
    path.write_text(render(df, err, env, plots, run_dir))
    return path


def _rewrite(path: Path, df: pd.DataFrame, columns: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    w = tables.AppendWriter(tmp, columns)
    w.write(records(df))
    tmp.replace(path)
