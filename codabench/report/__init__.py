"""Reports of a run directory: rewrite the CSVs in order, results.json, plots and report.html.

:func:`finalize` only reads the run's files, so it also works after a killed run, after
``--resume`` and after ``merge``; derived columns (speedup against torch-compile) are recomputed
from the rows themselves.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from codabench.matrix import BASELINE_ORDER, SPEED_BASELINE
from codabench.report import tables
from codabench.report.html import render
from codabench.report.plots import make_plots
from workloads.models import PRESETS
from workloads.op import MODES
from workloads.ops import OPS

HTML, JSON, PLOTS = "report.html", "results.json", "plots"


def _bool_or_none(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v in ("True", "False"):
        return v == "True"
    return None


def load_run(run_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """results and errors (last row per cell kept, sorted), and env.json, of a run directory."""
    run_dir = Path(run_dir)
    df = tables.read_csv(run_dir / tables.RESULTS, tables.RESULT_COLUMNS)
    err = tables.read_csv(run_dir / tables.ERRORS, tables.ERROR_COLUMNS) if (run_dir / tables.ERRORS).exists() \
        else pd.DataFrame(columns=tables.ERROR_COLUMNS)
    env_path = run_dir / tables.ENV
    env = json.loads(env_path.read_text()) if env_path.exists() else {}
    for frame in (df, err):
        for c in tables.KEY:
            if c in frame:
                frame[c] = frame[c].fillna("").astype(str)
    df["correct"] = df["correct"].map(_bool_or_none).astype(object)
    err["passed"] = err["passed"].map(_bool_or_none).astype(object)
    df = df.drop_duplicates(tables.KEY, keep="last")
    err = err.drop_duplicates(tables.KEY + ["output"], keep="last")
    return _sorted(df), _sorted(err), env


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    ops, models = list(OPS), sorted(PRESETS, key=lambda m: (PRESETS[m].hidden, m))

    def rank(values, order):
        return values.map(lambda v: order.index(v) if v in order else len(order))

    keys = pd.DataFrame({
        "op": rank(df["op"], ops), "model": rank(df["model"], models), "mode": rank(df["mode"], list(MODES)),
        "dtype": df["dtype"], "impl": df["impl"].map(lambda i: (BASELINE_ORDER.index(i) if i in BASELINE_ORDER
                                                               else len(BASELINE_ORDER), i))})
    order = sorted(range(len(df)), key=lambda i: tuple(keys.iloc[i]) + (df["impl"].iloc[i],))
    return df.iloc[order].reset_index(drop=True)


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


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as dicts, NaN as None."""
    out = []
    for rec in df.to_dict("records"):
        out.append({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()})
    return out


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
