"""The figures of the report's training-step section: per ``train_step`` cell, what someone training a model asks.

From a run's rows (:func:`codabench.results.load_run`), for each timed cell of a whole-model op::

    tokens_per_s  = tokens / median_ms x 1000                    (tokens: batch x sequence of the timed step)
    vs_<ref>      = <ref>'s median_ms / this median_ms           (this tokens/s over <ref>'s; > 1: faster)
    peak_gib      = peak_mem_mib / 1024,  mem_vs_<ref> = peak_mem_mib / <ref>'s
    first_step_s  = first_call_s
    loss_rel_err  = the loss's relative error against float64,  grad_rel_err = the worst gradient's (errors.csv)

with ``<ref>`` each of :data:`REFERENCES` that has an ok row in the same (op, model, dtype) group.
"""
from __future__ import annotations

import pandas as pd

from codabench.results import KEY
from workloads.ops import OPS

REFERENCES = ("hf-liger", "hf-eager")
COLUMNS = ["op", "model", "dtype", "impl", "tokens", "median_ms", "tokens_per_s", *[f"vs_{r}" for r in REFERENCES],
           "peak_gib", *[f"mem_vs_{r}" for r in REFERENCES], "first_step_s", "loss_rel_err", "grad_rel_err",
           "correct"]


def train_step_table(results: pd.DataFrame, errors: pd.DataFrame) -> pd.DataFrame:
    """One row per ok cell of a whole-model op (``Op.level`` ``model``), with :data:`COLUMNS`."""
    model_ops = [name for name, op in OPS.items() if op.level == "model"]
    ok = results[results["op"].isin(model_ops) & results["status"].eq("ok")]
    if ok.empty:  # e.g. a run stopped before its first cell finished
        return pd.DataFrame(columns=COLUMNS)
    by_cell = dict(list(errors.groupby(KEY, sort=False)))
    rows = []
    for _, group in ok.groupby(["op", "model", "dtype"], sort=False):
        refs = {r: group[group["impl"] == r].iloc[0] for r in REFERENCES if (group["impl"] == r).any()}
        for _, row in group.iterrows():
            errs = by_cell.get(tuple(row[KEY]), errors.iloc[:0])
            grads = errs[errs["output"].str.startswith("grad_")]["rel_err"]
            out = {k: row[k] for k in ("op", "model", "dtype", "impl", "tokens", "median_ms", "correct")}
            out.update(tokens_per_s=row["tokens"] / row["median_ms"] * 1e3, peak_gib=row["peak_mem_mib"] / 1024,
                       first_step_s=row["first_call_s"],
                       loss_rel_err=errs[errs["output"] == "loss"]["rel_err"].max(),
                       grad_rel_err=grads.max())
            for r in REFERENCES:
                ref = refs.get(r)
                out[f"vs_{r}"] = ref["median_ms"] / row["median_ms"] if ref is not None else None
                out[f"mem_vs_{r}"] = row["peak_mem_mib"] / ref["peak_mem_mib"] if ref is not None else None
            rows.append(out)
    return pd.DataFrame(rows, columns=COLUMNS)

