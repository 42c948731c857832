"""``python -m codabench compare RUN_A RUN_B``: speed and error changes of two runs, cell by cell.

``delta_pct = 100 (median_B - median_A) / median_A`` (negative: B is faster), with its 95% interval
``delta_lo_pct``/``delta_hi_pct`` and ``verdict``: ``faster``/``slower`` (B against A) when the interval excludes
0, ``same`` when it includes it, ``unknown`` without an interval (CPU wall times, too few samples, a run with one
timing round, a cell not timed in both). The interval is :func:`codabench.stats.ratio` on the two runs' samples,
unpaired. ``err_x = rel_err_B / rel_err_A``.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from codabench import results as tables
from codabench.matrix import PLUGIN_OP
from codabench.results import load_run
from codabench.stats import Timed, ratio

NUM = ["median_ms", "p20_ms", "p80_ms", "rel_err"]
VERDICTS = {"faster": "faster", "slower": "slower", "tie": "same"}
"""Between runs a tie reads ``same``."""


def compare(run_a: str | Path, run_b: str | Path) -> pd.DataFrame:
    """One row per cell of either run: both runs' figures (suffixes ``_a``, ``_b``), the change and its verdict."""
    runs = []
    for side, run in (("a", Path(run_a)), ("b", Path(run_b))):
        df, _, env = load_run(run)
        rounds = tables.sample_rounds(run, env)
        df = df[df["op"] != PLUGIN_OP][tables.KEY + ["status", "correct", "timing"] + NUM].copy()
        df["rounds"] = [rounds.get(k, []) for k in df[tables.KEY].itertuples(index=False, name=None)]
        runs.append(df)
    m = runs[0].merge(runs[1], on=tables.KEY, how="outer", suffixes=("_a", "_b"))
    for c in NUM:
        for s in ("_a", "_b"):
            m[c + s] = pd.to_numeric(m[c + s], errors="coerce")
    m["delta_pct"] = 100 * (m["median_ms_b"] - m["median_ms_a"]) / m["median_ms_a"]
    lo, hi, verdict = [], [], []
    for _, r in m.iterrows():
        x = _change(r)
        lo.append(None if x is None else 100 * (1 / x.hi - 1))
        hi.append(None if x is None else 100 * (1 / x.lo - 1))
        verdict.append("unknown" if x is None else VERDICTS[x.verdict])
    m["delta_lo_pct"], m["delta_hi_pct"], m["verdict"] = lo, hi, verdict
    m["err_x"] = m["rel_err_b"] / m["rel_err_a"]
    for s in ("_a", "_b"):
        m["status" + s] = m["status" + s].fillna("missing")
    return m.drop(columns=["rounds_a", "rounds_b"])


def _change(r: pd.Series):
    """B's speed against A's (median_A / median_B) with its interval; None where there is none."""
    if not (r["status_a"] == r["status_b"] == "ok") or pd.isna(r["delta_pct"]):
        return None
    key = "|".join(str(r[k]) for k in tables.KEY)
    a = Timed(r["rounds_a"], str(r["timing_a"]), key + "|A")
    b = Timed(r["rounds_b"], str(r["timing_b"]), key + "|B")
    return ratio(a, b, paired=False, value=r["median_ms_a"] / r["median_ms_b"])


def format_compare(m: pd.DataFrame) -> str:
    """A plain-text table, one line per cell, plus a one-line summary."""
    def f(v, spec):
        return "" if pd.isna(v) else format(v, spec)

    lines = [f"{'op':16} {'impl':16} {'model':10} {'mode':8} {'dtype':7} {'A ms':>9} {'B ms':>9} {'delta':>8} "
             f"{'95% interval':>17} {'verdict':7} {'A err':>9} {'B err':>9} {'err x':>7}  A -> B"]
    for _, r in m.iterrows():
        delta = f(r["delta_pct"], "+.1f") + ("%" if not pd.isna(r["delta_pct"]) else "")
        interval = "" if pd.isna(r["delta_lo_pct"]) else f"[{r['delta_lo_pct']:+.1f}, {r['delta_hi_pct']:+.1f}]"
        status = f"{_status(r['status_a'], r['correct_a'])} -> {_status(r['status_b'], r['correct_b'])}"
        lines.append(f"{r['op']:16} {r['impl']:16} {r['model']:10} {r['mode']:8} {r['dtype']:7} "
                     f"{f(r['median_ms_a'], '.4g'):>9} {f(r['median_ms_b'], '.4g'):>9} {delta:>8} {interval:>17} "
                     f"{r['verdict']:7} {f(r['rel_err_a'], '.2e'):>9} {f(r['rel_err_b'], '.2e'):>9} "
                     f"{f(r['err_x'], '.2f'):>7}  {status}")
    both = m.dropna(subset=["delta_pct"])
    counts = m["verdict"].value_counts()
    lines.append(f"{len(m)} cells, {len(both)} timed in both; B vs A: "
                 + ", ".join(f"{counts.get(v, 0)} {v}" for v in ("faster", "slower", "same", "unknown")))
    return "\n".join(lines)


def _status(status, correct) -> str:
    if status != "ok":
        return str(status)
    return {True: "pass", False: "FAIL"}.get(correct, "ok")
