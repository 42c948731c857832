"""The verdict a reader of a run comes for, in numbers: how many cells of the implementation in focus are faster,
the same, slower or unresolved against the fastest other implementation of their row (the ``verdict`` column,
:func:`codabench.stats.speed_figures`), its biggest wins and losses, and the run's resolving power.

The report's first screen (:mod:`codabench.report.html`) and the reports index (:mod:`codabench.report.index`) both
read them from here. Only timed cells count: ``ok`` rows of the ops (not a plugin's own row), CPU wall times never
(their verdict is ``n/a``).
"""
from __future__ import annotations

from typing import Iterable

import pandas as pd

from codabench.matrix import BASELINE_ORDER, PLUGIN_OP
from codabench.stats import DECIDED, VERDICTS, Ratio

FOCUS = "coda-triton"
"""The implementation counted by default, where the run has it."""
COUNTED = (*VERDICTS, "n/a")
"""The verdicts counted, in the order shown."""
EXTREMES = 3
"""How many of the biggest wins and of the biggest losses are shown."""


def cells(df: pd.DataFrame) -> pd.DataFrame:
    """The timed cells of a run's rows: ``ok``, of an op (not a plugin's own row)."""
    return df[(df["status"] == "ok") & (df["op"] != PLUGIN_OP)]


def focus_impl(ok: pd.DataFrame, impls: Iterable[str], preferred: str = FOCUS) -> str | None:
    """The implementation to count: ``preferred`` where it has a verdict (faster, same, slower, unresolved), else the
    first non-baseline implementation of ``impls`` that has one; None without any."""
    judged = set(ok.loc[ok["verdict"].isin(VERDICTS), "impl"])
    order = [preferred] + [i for i in impls if i not in BASELINE_ORDER]
    return next((i for i in order if i in judged), None)


def verdict_counts(rows: pd.DataFrame) -> dict[str, int]:
    """Each verdict of :data:`COUNTED` and how many of ``rows`` have it (a row without one counts as ``n/a``)."""
    n = rows["verdict"].where(rows["verdict"].isin(VERDICTS), "n/a").value_counts()
    return {v: int(n.get(v, 0)) for v in COUNTED}


def extremes(rows: pd.DataFrame, n: int = EXTREMES) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the ``n`` biggest wins: ``faster`` rows by ``vs_best``, largest first; the ``n`` biggest losses: ``slower``
    rows by ``vs_best``, smallest first)."""
    vs = pd.to_numeric(rows["vs_best"], errors="coerce")
    wins = vs[rows["verdict"] == "faster"].sort_values(ascending=False).head(n)
    losses = vs[rows["verdict"] == "slower"].sort_values().head(n)
    return rows.loc[wins.index], rows.loc[losses.index]


def resolving_power(ok: pd.DataFrame) -> tuple[float | None, float | None]:
    """(median half-width of the vs_best intervals, share of the cells with an interval that are decided: faster,
    same or slower) over ``ok`` rows; None where no row has an interval."""
    judged = ok[ok["verdict"].isin(VERDICTS)]
    if judged.empty:
        return None, None
    hw = [Ratio(*(float(r[c]) for c in ("vs_best", "vs_best_lo", "vs_best_hi"))).half_width
          for _, r in judged.iterrows()]
    return float(pd.Series(hw).median()), float(judged["verdict"].isin(DECIDED).mean())


def ratio_text(value: float | None, lo: float | None, hi: float | None) -> tuple[str, str]:
    """(``1.07×``, ``[1.01, 1.13]``) of a ratio and its interval: two decimals, three where two would not show on
    which side of 1 a bound lies; ``ref`` for a cell against itself; blanks where missing."""
    if value is None:
        return "", ""
    if lo is None or hi is None:
        return f"{value:.2f}×", ""
    if lo == hi == value:
        return f"{value:.2f}×", "ref"
    d = 3 if "1.00" in (f"{lo:.2f}", f"{hi:.2f}") and 1.0 not in (lo, hi) else 2
    return f"{value:.{d}f}×", f"[{lo:.{d}f}, {hi:.{d}f}]"


def headline(df: pd.DataFrame, impl: str | None = None) -> str:
    """One line for a run: the focus implementation's verdict counts per dtype and the median half-width of the
    intervals, e.g. ``coda-triton bf16: 39 faster, 9 same, 9 slower, 12 unresolved of 69; median vs_best half-width
    0.9%``; what the run has instead where no implementation has a verdict."""
    ok = cells(df)
    name = impl or focus_impl(ok, sorted(set(ok["impl"])))
    mine = ok[ok["impl"] == name]
    if name is None or not mine["verdict"].isin(VERDICTS).any():
        n = df["status"].value_counts()
        return "no verdicts (" + ", ".join(f"{v} {k}" for k, v in n.items()) + ")"
    parts = []
    for dtype, g in mine.groupby("dtype", sort=True):
        c = verdict_counts(g)
        parts.append(f"{dtype}: " + ", ".join(f"{c[v]} {v}" for v in VERDICTS)
                     + (f", {c['n/a']} without an interval" if c["n/a"] else "") + f" of {len(g)}")
    hw, _ = resolving_power(ok)
    return f"{name} " + "; ".join(parts) + f"; median vs_best half-width {100 * hw:.1f}%"
