"""``python -m codabench compare RUN_A RUN_B``: speed and error deltas of two runs, cell by cell.

``delta_pct = 100 (median_B - median_A) / median_A`` (negative: B is faster). A delta no larger
than the wider of the two p20-p80 spreads is marked ``noise``: benchmarking.md's rule that a
difference smaller than the spread between runs is not a result. ``err_x = rel_err_B / rel_err_A``.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from codabench.matrix import PLUGIN_OP
from codabench import results as tables
from codabench.results import load_run

NUM = ["median_ms", "p20_ms", "p80_ms", "rel_err"]


def compare(run_a: str | Path, run_b: str | Path) -> pd.DataFrame:
    a, _, _ = load_run(Path(run_a))
    b, _, _ = load_run(Path(run_b))
    keep = tables.KEY + ["status", "correct", "timing"] + NUM
    a, b = a[a["op"] != PLUGIN_OP][keep], b[b["op"] != PLUGIN_OP][keep]
    m = a.merge(b, on=tables.KEY, how="outer", suffixes=("_a", "_b"))
    for c in NUM:
        for s in ("_a", "_b"):
            m[c + s] = pd.to_numeric(m[c + s], errors="coerce")
    m["delta_pct"] = 100 * (m["median_ms_b"] - m["median_ms_a"]) / m["median_ms_a"]
    spread = pd.concat([m["p80_ms_a"] - m["p20_ms_a"], m["p80_ms_b"] - m["p20_ms_b"]], axis=1).max(axis=1)
    m["noise"] = (m["median_ms_b"] - m["median_ms_a"]).abs() <= spread
    m["err_x"] = m["rel_err_b"] / m["rel_err_a"]
    for s in ("_a", "_b"):
        m["status" + s] = m["status" + s].fillna("missing")
    return m


def format_compare(m: pd.DataFrame) -> str:
    """A plain-text table, one line per cell, plus a one-line summary."""
    def f(v, spec):
        return "" if pd.isna(v) else format(v, spec)

    lines = [f"{'op':16} {'impl':16} {'model':10} {'mode':8} {'dtype':7} {'A ms':>9} {'B ms':>9} {'delta':>8} "
             f"{'':5} {'A err':>9} {'B err':>9} {'err x':>7}  A -> B"]
    for _, r in m.iterrows():
        delta = f(r["delta_pct"], "+.1f") + ("%" if not pd.isna(r["delta_pct"]) else "")
        status = f"{_verdict(r['status_a'], r['correct_a'])} -> {_verdict(r['status_b'], r['correct_b'])}"
        lines.append(f"{r['op']:16} {r['impl']:16} {r['model']:10} {r['mode']:8} {r['dtype']:7} "
                     f"{f(r['median_ms_a'], '.4g'):>9} {f(r['median_ms_b'], '.4g'):>9} {delta:>8} "
                     f"{'noise' if r['noise'] else '':5} {f(r['rel_err_a'], '.2e'):>9} {f(r['rel_err_b'], '.2e'):>9} "
                     f"{f(r['err_x'], '.2f'):>7}  {status}")
    both = m.dropna(subset=["delta_pct"])
    real = both[~both["noise"]]
    lines.append(f"{len(m)} cells, {len(both)} timed in both; beyond noise: {(real['delta_pct'] < 0).sum()} faster, "
                 f"{(real['delta_pct'] > 0).sum()} slower in B")
    return "\n".join(lines)


def _verdict(status, correct) -> str:
    if status != "ok":
        return str(status)
    return {True: "pass", False: "FAIL"}.get(correct, "ok")
