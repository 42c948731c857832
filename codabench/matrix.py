"""The cells of a run: (op, model, mode, dtype, impl), in the order they are measured.

Cells are grouped by (op, model, mode, dtype): a group shares its float64 reference and the
PyTorch error, and is never split across shards. Inside a group the harness's reference baselines
(torch-eager, torch-compile: :mod:`codabench.eager`) come first, then the other implementations by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from codabench.eager import TorchCompile, TorchEager
from codabench.registry import Registry
from workloads.ops import OPS
from workloads.suites import Suite

BASELINE_ORDER = (TorchEager.name, TorchCompile.name)
SPEED_BASELINE = TorchCompile.name
"""Every speedup is against this implementation's median on the same cell (:func:`codabench.stats.speed_figures`)."""
PLUGIN_OP = "(plugin)"
"""``op`` value of the rows that report a plugin that failed to load."""


@dataclass(frozen=True)
class Cell:
    op: str
    model: str
    mode: str
    dtype: str
    impl: str

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (self.op, self.model, self.mode, self.dtype, self.impl)

    @property
    def group(self) -> tuple[str, str, str, str]:
        return (self.op, self.model, self.mode, self.dtype)

    def __str__(self) -> str:
        return f"{self.op} {self.model} {self.mode} {self.dtype} {self.impl}"


@dataclass
class Selection:
    """What to run: a suite narrowed by the command line's filters."""

    ops: tuple[str, ...]
    models: tuple[str, ...]
    modes: tuple[str, ...]
    dtypes: tuple[str, ...]
    impls: tuple[str, ...] | None = None
    impl_modes: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def from_suite(cls, suite: Suite, ops=None, models=None, modes=None, dtypes=None, impls=None) -> "Selection":
        """The suite narrowed by the given filters (None: the suite's; an empty filter selects nothing); explicit
        impls or modes lift ``suite.impl_modes``."""
        def pick(given, default):
            return tuple(given) if given is not None else default

        return cls(ops=pick(ops, suite.op_names()), models=pick(models, suite.models),
                   modes=pick(modes, suite.modes), dtypes=pick(dtypes, suite.dtypes),
                   impls=pick(impls, suite.impls),
                   impl_modes={} if impls is not None or modes is not None else dict(suite.impl_modes))


def _impl_order(name: str) -> tuple[int, str]:
    return (BASELINE_ORDER.index(name) if name in BASELINE_ORDER else len(BASELINE_ORDER), name)


def build_cells(sel: Selection, registry: Registry) -> list[Cell]:
    """Every cell of the selection, grouped; (mode, dtype) pairs an op does not have (:meth:`Op.has_cell`) are
    not cells at all."""
    for name in sel.ops:
        if name not in OPS:
            raise KeyError(f"unknown op {name!r}; known: {', '.join(OPS)}")
    cells = []
    for op_name in sel.ops:
        op = OPS[op_name]
        impls = sorted((i.name for i in registry.for_op(op_name)
                        if sel.impls is None or i.name in sel.impls), key=_impl_order)
        for model in sel.models:
            for mode in sel.modes:
                for dtype in (d for d in sel.dtypes if op.has_cell(mode, d)):
                    cells += [Cell(op_name, model, mode, dtype, impl) for impl in impls]
    return cells


def groups(cells: Iterable[Cell]) -> list[list[Cell]]:
    out: dict[tuple, list[Cell]] = {}
    for c in cells:
        out.setdefault(c.group, []).append(c)
    return list(out.values())


def shard(cells: list[Cell], index: int, count: int) -> list[Cell]:
    """Shard ``index`` (1-based) of ``count``: whole groups, dealt round-robin."""
    if not 1 <= index <= count:
        raise ValueError(f"shard {index}/{count}: need 1 <= I <= N")
    return [c for i, g in enumerate(groups(cells)) if i % count == index - 1 for c in g]


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise ValueError(f"expected I/N (e.g. 1/4), got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"{text}: need 1 <= I <= N")
    return i, n
