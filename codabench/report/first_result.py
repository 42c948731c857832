"""Time to first result: what each implementation costs before its first sample, per cell and in all.

A cell's first result comes after its correctness pass at the check shape (``check_s``: its first call there,
compiling, JIT-building, tuning) and its first call at the timed shape (``first_call_s``); both are paid once per
shape and process, by every user of an implementation. :func:`first_result_table` sums them per implementation over
the cells that gave a result (``ok`` rows with either recorded: an error row gave none, however early it failed),
with the per-cell median and the worst cell; ``vs fastest`` is the implementation's total over the smallest total. :func:`first_result_section` is the report's section.
"""
from __future__ import annotations

import html

import pandas as pd

from codabench.report.palette import impl_order

COLUMNS = ["impl", "cells", "total_s", "check_s", "first_call_s", "median_s", "worst_s", "worst_cell", "vs_fastest"]


def first_result_table(results: pd.DataFrame) -> pd.DataFrame:
    """One row per implementation with an ``ok`` cell that recorded ``check_s`` or ``first_call_s`` (:data:`COLUMNS`), in the
    report's implementation order: cells, the sums of both and of each, the per-cell median and worst of their sum
    (with the worst cell's op, model, mode and dtype), and the total over the smallest total."""
    if results.empty or not {"check_s", "first_call_s"} & set(results.columns):
        return pd.DataFrame(columns=COLUMNS)
    df = results.copy()
    for c in ("check_s", "first_call_s"):
        df[c] = pd.to_numeric(df[c], errors="coerce") if c in df else float("nan")
    ok = df["status"] == "ok" if "status" in df else True
    df = df[ok & (df["check_s"].notna() | df["first_call_s"].notna())]
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    df["first_s"] = df["check_s"].fillna(0.0) + df["first_call_s"].fillna(0.0)
    rows = []
    for impl in impl_order(df["impl"]):
        g = df[df["impl"] == impl]
        worst = g.loc[g["first_s"].idxmax()]
        rows.append({"impl": impl, "cells": len(g), "total_s": g["first_s"].sum(), "check_s": g["check_s"].sum(),
                     "first_call_s": g["first_call_s"].sum(), "median_s": g["first_s"].median(),
                     "worst_s": worst["first_s"],
                     "worst_cell": " ".join(str(worst[k]) for k in ("op", "model", "mode", "dtype") if k in worst)})
    table = pd.DataFrame(rows, columns=COLUMNS)
    fastest = table["total_s"].min()
    table["vs_fastest"] = table["total_s"] / fastest if fastest > 0 else float("nan")
    return table


HEADERS = {"impl": "impl", "cells": "cells", "total_s": "first results s", "check_s": "correctness passes s",
           "first_call_s": "first calls s", "median_s": "median per cell s", "worst_s": "worst cell s",
           "worst_cell": "worst cell", "vs_fastest": "x fastest"}


def _cell(v: object, column: str) -> str:
    if isinstance(v, float):
        return "" if pd.isna(v) else f"{v:.2f}" if column == "vs_fastest" else f"{v:.1f}"
    return html.escape(str(v))


def first_result_section(results: pd.DataFrame) -> list[str]:
    """The report's "Time to first result" section (empty when no cell recorded either time)."""
    table = first_result_table(results)
    if table.empty:
        return []
    def cls(c: str) -> str:  # text left, figures right (report.html's CSS)
        return "l" if c in ("impl", "worst_cell") else ""

    head = "".join(f"<th class='{cls(c)}'>{HEADERS[c]}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td class='{cls(c)}'>{_cell(r[c], c)}</td>" for c in COLUMNS) + "</tr>"
                   for _, r in table.iterrows())
    return ["<h2>Time to first result</h2>",
            "<p>What each implementation costs before its first sample, a cost every user pays once per shape and "
            "process: per cell, its correctness pass at the check shape (<code>check_s</code>: the first call there, "
            "compiling, JIT, tuning) plus its first call at the timed shape (<code>first_call_s</code>), over the cells "
            "that gave a result (<code>ok</code>). "
            "<i>x fastest</i>: the total over the smallest total.</p>",
            f"<table class='first-result'><tr>{head}</tr>{body}</table>"]
