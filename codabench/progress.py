"""Progress with an ETA: a tqdm bar on a terminal, one plain line per cell otherwise.

The ETA counts only cells that will actually run (n/a and skipped cells take no time):
``eta = (mean seconds per run cell so far) x (run cells left)``.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    def __init__(self, total: int, to_run: int, stream: TextIO | None = None, enabled: bool = True):
        self.total, self.to_run, self.stream, self.enabled = total, to_run, stream or sys.stderr, enabled
        self.done = self.ran = 0
        self.run_seconds = 0.0
        self.start = time.monotonic()
        self.bar = None
        if enabled and self.stream.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=to_run, file=self.stream, unit="cell", dynamic_ncols=True)
            except ImportError:
                pass

    def eta(self) -> float | None:
        if not self.ran:
            return None
        return self.run_seconds / self.ran * (self.to_run - self.ran)

    def update(self, label: str, outcome: str, ran: bool, seconds: float) -> None:
        self.done += 1
        if ran:
            self.ran += 1
            self.run_seconds += seconds
        if not self.enabled:
            return
        if self.bar is not None:
            if ran:
                self.bar.update(1)
            self.bar.set_postfix_str(f"{label}: {outcome}"[:60])
            return
        eta = self.eta()
        print(f"[{self.done:>{len(str(self.total))}}/{self.total}] {label}: {outcome}"
              f"  (elapsed {_hms(time.monotonic() - self.start)}, ETA {_hms(eta) if eta is not None else '?'})",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
