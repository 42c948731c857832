"""``python -m codabench compare RUN_A RUN_B``: speed and error changes of two runs, cell by cell.

Two figures of the change of each timed cell, B against A, each with its 95% interval and verdict (``faster`` or
``slower``: B against A beyond noise; ``same``: the interval lies inside the equivalence margin; ``unresolved``: it
holds no change and reaches beyond the margin; ``unknown``: no interval):

- ``delta_pct = 100 (median_B - median_A) / median_A`` (negative: B is faster) with ``delta_lo_pct``/
  ``delta_hi_pct`` and ``verdict``: the samples of two runs cannot be paired, so the interval is
  :func:`codabench.stats.ratio` unpaired (``unknown`` for CPU wall times, too few samples, a run with one timing
  round, a cell not timed in both). A clock that ran lower through all of run B shows here as ``slower``.
- ``rel_delta_pct = 100 ((cell_B / base_B) / (cell_A / base_A) - 1)``, base = torch-compile (the
  :data:`~codabench.matrix.SPEED_BASELINE`) of the same group, with ``rel_lo_pct``/``rel_hi_pct`` and
  ``rel_verdict``: each run's paired ratio of the cell to the base, whose samples ran side by side, so a drift
  common to a run's group cancels. The two paired intervals are combined in log space by adding their bounds (the
  widest interval they allow, whatever their dependence). ``unknown`` where either run has no paired interval of the
  cell to the base, and for the base itself.

``same`` uses the smaller ``timing.same_within`` of the two runs. ``err_x = rel_err_B / rel_err_A``. A cell the two
runs timed at different token counts (``tokens``) is no change of one measurement: no delta, its verdicts
``unknown``, and the summary counts such cells.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from codabench import results as tables
from codabench.matrix import PLUGIN_OP, SPEED_BASELINE
from codabench.results import load_run
from codabench.stats import Ratio, Timed, ratio, read_timed, timing_settings
from codabench.timing import CPU_WALL

NUM = ["median_ms", "p20_ms", "p80_ms", "rel_err"]
COMPARE_VERDICTS = ("faster", "slower", "same", "unresolved", "unknown")
"""B against A; ``unknown``: no interval."""


def compare(run_a: str | Path, run_b: str | Path) -> pd.DataFrame:
    """One row per cell of either run: both runs' figures (suffixes ``_a``, ``_b``), the changes and their verdicts
    (module docstring)."""
    runs, timed, margins = [], [], []
    for run in (Path(run_a), Path(run_b)):
        df, _, env = load_run(run)
        timed.append(read_timed(run, env))
        margins.append(timing_settings(env)[1])
        rows = df[df["op"] != PLUGIN_OP]
        runs.append(rows[tables.KEY + ["status", "correct", "timing"] + NUM].assign(
            tokens=pd.to_numeric(rows["tokens"], errors="coerce") if "tokens" in rows else math.nan))
    same_within = min(margins)
    m = runs[0].merge(runs[1], on=tables.KEY, how="outer", suffixes=("_a", "_b"))
    for c in NUM:
        for s in ("_a", "_b"):
            m[c + s] = pd.to_numeric(m[c + s], errors="coerce")
    # a cell timed at two token counts: no delta, nor interval, between the shapes
    m["other_shape"] = m["tokens_a"].notna() & m["tokens_b"].notna() & (m["tokens_a"] != m["tokens_b"])
    m["delta_pct"] = (100 * (m["median_ms_b"] - m["median_ms_a"]) / m["median_ms_a"]).where(~m["other_shape"])
    cols: dict[str, list] = {c: [] for c in ("delta_lo_pct", "delta_hi_pct", "verdict", "rel_delta_pct",
                                             "rel_lo_pct", "rel_hi_pct", "rel_verdict")}
    for _, r in m.iterrows():
        key = tuple(str(r[k]) for k in tables.KEY)
        other = r["other_shape"]
        for prefix, x in (("delta", None if other else _change(r, key, timed)),
                          ("rel", None if other else _relative(r, key, timed))):
            lo, hi, verdict = as_delta(x, same_within)
            cols[prefix + "_lo_pct"].append(lo)
            cols[prefix + "_hi_pct"].append(hi)
            cols["verdict" if prefix == "delta" else "rel_verdict"].append(verdict)
            if prefix == "rel":
                cols["rel_delta_pct"].append(math.nan if x is None else 100 * (1 / x.value - 1))
    m = m.assign(**cols)
    m["err_x"] = m["rel_err_b"] / m["rel_err_a"]
    for s in ("_a", "_b"):
        m["status" + s] = m["status" + s].fillna("missing")
    return m


def as_delta(x: Ratio | None, same_within: float) -> tuple[float, float, str]:
    """A speed ratio of B over A as the interval of the change of time, in %, and its verdict (``unknown`` for
    None)."""
    if x is None:
        return math.nan, math.nan, "unknown"
    return 100 * (1 / x.hi - 1), 100 * (1 / x.lo - 1), x.verdict(same_within)


def _timed(timed: dict, key: tuple[str, ...], side: str, timing) -> Timed | None:
    t = timed.get(key)
    if t is None:
        return None
    return Timed(t.samples, t.sweeps, str(timing), "|".join(key) + "|" + side, t.grain)


def _change(r: pd.Series, key: tuple[str, ...], timed: list[dict]) -> Ratio | None:
    """B's speed against A's (median_A / median_B), unpaired; None where there is no interval."""
    if not (r["status_a"] == r["status_b"] == "ok") or pd.isna(r["delta_pct"]):
        return None
    a, b = _timed(timed[0], key, "A", r["timing_a"]), _timed(timed[1], key, "B", r["timing_b"])
    if a is None or b is None:
        return None
    return ratio(a, b, paired=False, value=r["median_ms_a"] / r["median_ms_b"])


def _relative(r: pd.Series, key: tuple[str, ...], timed: list[dict]) -> Ratio | None:
    """B's speed relative to its torch-compile over A's: (base_B / cell_B) / (base_A / cell_A) from each run's paired
    ratio, the log bounds added; None without both paired ratios, and for the base itself."""
    if key[4] == SPEED_BASELINE or not (r["status_a"] == r["status_b"] == "ok"):
        return None
    base_key = key[:4] + (SPEED_BASELINE,)
    per_run = []
    for side, t, timing in (("A", timed[0], r["timing_a"]), ("B", timed[1], r["timing_b"])):
        base, cell = _timed(t, base_key, side, timing), _timed(t, key, side, timing)
        x = ratio(base, cell, paired=True) if base is not None and cell is not None else None
        if x is None:
            return None
        per_run.append(x)
    return relative_change(*per_run)


def relative_change(a: Ratio, b: Ratio) -> Ratio:
    """B's speed relative to its base over A's, from each run's paired ratio of the cell to the base (``base / cell``,
    as :func:`codabench.stats.ratio` and results.csv's ``speedup`` columns give it): the values divided, the log
    bounds added (the widest interval the two allow, whatever their dependence)."""
    return Ratio(b.value / a.value, b.lo / a.hi, b.hi / a.lo)


def format_compare(m: pd.DataFrame) -> str:
    """A plain-text table, one line per cell, plus a summary line per delta."""
    def f(v, spec):
        return "" if pd.isna(v) else format(v, spec)

    def interval(lo, hi):
        return "" if pd.isna(lo) else f"[{lo:+.1f}, {hi:+.1f}]"

    lines = [f"{'op':16} {'impl':16} {'model':10} {'mode':8} {'dtype':7} {'A ms':>9} {'B ms':>9} {'delta':>8} "
             f"{'95% interval':>17} {'verdict':10} {'rel delta':>9} {'95% interval':>17} {'rel verdict':11} "
             f"{'A err':>9} {'B err':>9} {'err x':>7}  A -> B"]
    for _, r in m.iterrows():
        delta = f(r["delta_pct"], "+.1f") + ("%" if not pd.isna(r["delta_pct"]) else "")
        rel = f(r["rel_delta_pct"], "+.1f") + ("%" if not pd.isna(r["rel_delta_pct"]) else "")
        status = f"{_status(r['status_a'], r['correct_a'])} -> {_status(r['status_b'], r['correct_b'])}"
        lines.append(f"{r['op']:16} {r['impl']:16} {r['model']:10} {r['mode']:8} {r['dtype']:7} "
                     f"{f(r['median_ms_a'], '.4g'):>9} {f(r['median_ms_b'], '.4g'):>9} {delta:>8} "
                     f"{interval(r['delta_lo_pct'], r['delta_hi_pct']):>17} {r['verdict']:10} {rel:>9} "
                     f"{interval(r['rel_lo_pct'], r['rel_hi_pct']):>17} {r['rel_verdict']:11} "
                     f"{f(r['rel_err_a'], '.2e'):>9} {f(r['rel_err_b'], '.2e'):>9} {f(r['err_x'], '.2f'):>7}  {status}")
    both = m.dropna(subset=["delta_pct"])

    def counts(column: str) -> str:
        c = m[column].value_counts()
        return ", ".join(f"{c.get(v, 0)} {v}" for v in COMPARE_VERDICTS)

    other = int(m["other_shape"].sum())
    lines.append(f"{len(m)} cells, {len(both)} timed in both; B vs A: {counts('verdict')}"
                 + (f"; {other} timed at different token counts, not compared" if other else ""))
    lines.append(f"relative to each run's {SPEED_BASELINE}: {counts('rel_verdict')}")
    if (m[["timing_a", "timing_b"]] == CPU_WALL).any(axis=None):
        lines.append(f"{CPU_WALL} times (the Triton interpreter on the CPU) are not performance figures: their deltas "
                     "get no verdict")
    return "\n".join(lines)


def _status(status, correct) -> str:
    if status != "ok":
        return str(status)
    return {True: "pass", False: "FAIL"}.get(correct, "ok")
