"""One colour per implementation, the same in every plot and table of a report.

The implementations of this project have fixed colours; any other (a plugin's) takes the next spare colour in the
alphabetical order of the report's other names, so its colour is the same everywhere in one report.
"""
from __future__ import annotations

from typing import Iterable

from codabench.matrix import BASELINE_ORDER

FIXED = {"torch-eager": "#8c8c8c", "torch-compile": "#222222", "coda-triton": "#1f77b4", "liger": "#ff7f0e",
         "flashinfer": "#2ca02c", "quack": "#9467bd", "coda-example": "#17becf"}
SPARE = ["#d62728", "#8c564b", "#e377c2", "#bcbd22", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94",
         "#f7b6d2", "#dbdb8d", "#9edae5"]


def impl_order(impls: Iterable[str]) -> list[str]:
    """The baselines first (torch-eager, torch-compile), then this project's implementations, then the others
    alphabetically."""
    known = list(BASELINE_ORDER) + [i for i in FIXED if i not in BASELINE_ORDER]
    names = set(impls)
    return [i for i in known if i in names] + sorted(names - set(known))


def impl_colors(impls: Iterable[str]) -> dict[str, str]:
    """A hex colour for each implementation name."""
    others = sorted(set(impls) - set(FIXED))
    return {**{i: FIXED[i] for i in set(impls) & set(FIXED)},
            **{name: SPARE[k % len(SPARE)] for k, name in enumerate(others)}}
