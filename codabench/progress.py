"""Progress with an ETA: a tqdm bar on a terminal that can draw it, one plain line per cell otherwise; the run's wall
time at the end.

**ETA.** The cells left to run (n/a and skipped cells take no time) each expect the measured cost of the cells most
like them: the mean seconds of the finished cells of the same implementation, op, model and mode; else of the same
implementation, op and model (the model size sets the cost more than the mode); else of any implementation of the
same op, model and mode; else of the same implementation, op and mode; else of the same implementation; else of
every finished cell. An implementation that has not run yet also pays, once, a cold start:
the mean of the first-call seconds (compile, JIT build, autotuning: ``first_call_s``) of the first cell of each
implementation seen so far. No ETA before the first cell has run.

A cell's cost is the wall time since the row of the cell run before it (or the run's start): with timing rounds a
group's rows are written together at its end, so the first of them carries the group's time (its references, every
implementation's correctness pass and compiles, its rounds) and the others the moments between them; rows of cells
that do not run pass their time on to the next one. The costs add up to the run's time. (Each cell's own seconds, from
the start of its work, left the group's shared work out: on a cold H200 the full suite's ETA said 1.5 minutes after 3
minutes for 36 of 513 cells, with 25 minutes to go.)
"""
from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, TextIO

from codabench.matrix import Cell


def hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def can_draw(stream: TextIO) -> bool:
    """A terminal with a width: a bar can be drawn there. (A pseudo-terminal nobody sized reports 0 columns, and
    ``shutil.get_terminal_size`` then falls back to 80, so the stream's own size is asked.)"""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


def _levels(c: Cell) -> list[tuple]:
    """The keys of the cells like ``c``, most alike first."""
    return [("impl-op-model-mode", c.impl, c.op, c.model, c.mode), ("impl-op-model", c.impl, c.op, c.model),
            ("op-model-mode", c.op, c.model, c.mode), ("impl-op-mode", c.impl, c.op, c.mode), ("impl", c.impl),
            ("all",)]


class Progress:
    def __init__(self, total: int, to_run: Iterable[Cell], stream: TextIO | None = None, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.left = list(to_run)
        """Cells still to run, in order."""
        self.total, self.to_run, self.stream, self.enabled = total, len(self.left), stream or sys.stderr, enabled
        self.clock = clock
        self.start = self.last = clock()
        self.done = self.ran = 0
        self.costs: dict[tuple, list[float]] = defaultdict(list)
        self.cold: dict[str, float] = {}
        """Per implementation seen: the first-call seconds of its first cell."""
        self.first_calls_s = self.checks_s = 0.0
        self.startup_s: dict[str, float] = defaultdict(float)
        """Per implementation: its correctness passes and first calls, summed (what a cold start costs it)."""
        self.bar = None
        if enabled and can_draw(self.stream):
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=self.to_run, file=self.stream, unit="cell", dynamic_ncols=True,
                                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
            except ImportError:
                pass

    def expected(self, cell: Cell) -> float | None:
        """Seconds the cell is expected to take (module docstring), without the cold start; None before any cost."""
        for key in _levels(cell):
            if self.costs.get(key):
                return sum(self.costs[key]) / len(self.costs[key])
        return None

    def eta(self) -> float | None:
        if not self.costs:
            return None
        cold = sum(self.cold.values()) / len(self.cold) if self.cold else 0.0
        unseen = {c.impl for c in self.left} - set(self.cold)
        return sum(self.expected(c) for c in self.left) + cold * len(unseen)

    def update(self, cell: Cell, outcome: str, ran: bool, first_call_s: float | None = None,
               check_s: float | None = None) -> None:
        """A cell's row is written: ``ran`` (it was to run, so it cost time), ``first_call_s`` and ``check_s`` of
        its row."""
        now = self.clock()
        self.done += 1
        if ran:
            cost = max(0.0, now - self.last)
            for key in _levels(cell):
                self.costs[key].append(cost)
            self.cold.setdefault(cell.impl, first_call_s or 0.0)
            self.first_calls_s += first_call_s or 0.0
            self.checks_s += check_s or 0.0
            self.startup_s[cell.impl] += (first_call_s or 0.0) + (check_s or 0.0)
            self.ran += 1
            if cell in self.left:
                self.left.remove(cell)
            self.last = now
        if not self.enabled:
            return
        eta = self.eta()
        eta_text = f"ETA {hms(eta)}" if eta is not None else "ETA ?"
        if self.bar is not None:
            if ran:
                self.bar.update(1)
            self.bar.set_postfix_str(f"{eta_text} | {cell}: {outcome}"[:90])
            return
        print(f"[{self.done:>{len(str(self.total))}}/{self.total}] {cell}: {outcome}"
              f"  (elapsed {hms(now - self.start)}, {eta_text})", file=self.stream, flush=True)

    def finish(self) -> dict[str, Any]:
        """Close the bar, print the run's wall time and return it with its split for env.json: ``wall_s``,
        ``first_calls_s`` (the sum of the cells' first calls at the timed shape: compile, JIT build, autotuning),
        ``checks_s`` (their correctness passes at the check shape: first calls there, the float64 references),
        ``rest_s`` (timing, its checks, the run's own start) and ``startup_s`` (correctness passes and first calls
        per implementation, largest first)."""
        if self.bar is not None:
            self.bar.close()
        wall = self.clock() - self.start
        startup = dict(sorted(self.startup_s.items(), key=lambda kv: -kv[1]))
        times = {"wall_s": wall, "first_calls_s": self.first_calls_s, "checks_s": self.checks_s,
                 "rest_s": max(0.0, wall - self.first_calls_s - self.checks_s), "startup_s": startup}
        if self.enabled:
            print(f"codabench: wall time {hms(wall)} ({hms(self.first_calls_s)} in first calls: compile, JIT, "
                  f"autotune; {hms(self.checks_s)} in correctness passes; {hms(times['rest_s'])} the rest) for "
                  f"{self.ran} cells run", file=self.stream, flush=True)
            if startup:
                print("codabench: correctness passes and first calls by implementation: "
                      + ", ".join(f"{impl} {hms(s)}" for impl, s in startup.items()), file=self.stream, flush=True)
        return times
