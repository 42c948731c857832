"""The GPU's SM clock, power and temperature sampled by NVML during each cell's kept samples (read only, never set).

A background thread reads NVML every :data:`PERIOD_S` while :meth:`ClockSampler.sampling` is active. Each cell gets
the readings of its kept samples, not of its first call or warm-up, where the GPU may idle at its top clock while a
compiler works (the results' ``sm_clock_min_mhz`` and ``sm_clock_median_mhz``); the run keeps a thinned trace of
(wall time, SM MHz, power W, temperature C) for env.json and the report's clock plot. Without NVML (no GPU, no
``nvidia-ml-py``) nothing is sampled and the columns stay empty.

A cell whose clock fell more than :data:`CLOCK_DIP` below the run's median clock (:func:`clock_dips`) ran on a slower
GPU than its neighbours: the report flags it.
"""
from __future__ import annotations

import threading
import time
from time import perf_counter  # bound at import, as the timing loops' clock (codabench.timing)
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import pandas as pd
import torch

from codabench.env import nvml_handle

PERIOD_S = 0.01
"""100 readings a second at most (an NVML read takes about a millisecond)."""
TRACE_EVERY_S = 0.5
"""Spacing of the run's clock trace (the per-cell samples are kept whole)."""
CLOCK_DIP = 0.10
"""A cell's minimum SM clock this far below the run's median clock is flagged."""


@dataclass
class Sampled:
    """NVML readings of one timed region."""

    sm_mhz: list[float] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    temp_c: list[float] = field(default_factory=list)
    t_s: list[float] = field(default_factory=list)
    """``time.perf_counter()`` of each reading (the clock of the timing loops), to place a sample's clock."""

    def at(self, times_s: "list[float]") -> list[float | None]:
        """The SM clock read nearest in time to each of ``times_s`` (perf_counter seconds); None without readings."""
        if not self.t_s:
            return [None] * len(times_s)
        t, q = np.asarray(self.t_s[:len(self.t_s)]), np.asarray(times_s, dtype=float)  # (t_s is appended last)
        after = np.clip(np.searchsorted(t, q), 0, len(t) - 1)
        before = np.clip(after - 1, 0, len(t) - 1)
        i = np.where(np.abs(t[before] - q) < np.abs(t[after] - q), before, after)
        return [self.sm_mhz[j] for j in i]

    def settled(self, window_s: float, clock_tol: float, power_tol: float) -> bool:
        """The readings of the last ``window_s`` seconds vary by no more than ``clock_tol`` (SM clock) and
        ``power_tol`` (power), each as (max - min) / median; False with fewer than 3 readings in the window."""
        if not self.t_s:
            return False
        n = len(self.t_s)  # appended last by the sampling thread: the other lists hold at least n readings
        t = np.asarray(self.t_s[:n])
        recent = t >= t[-1] - window_s
        if recent.sum() < 3 or t[-1] - t[0] < window_s:
            return False
        for values, tol in ((self.sm_mhz, clock_tol), (self.power_w, power_tol)):
            v = np.asarray(values[:n])[recent]
            if (v.max() - v.min()) > tol * np.median(v):
                return False
        return True


class ClockSampler:
    def __init__(self, device: torch.device):
        self.trace: list[tuple[float, float, float, float]] = []
        """(time.time(), SM MHz, power W, temperature C), one point per TRACE_EVERY_S at most."""
        self._nv = self._handle = None
        if device.type == "cuda":
            try:
                self._nv, self._handle = nvml_handle(device)
            except Exception:  # no NVML: the clock columns stay empty
                self._nv = None

    @property
    def available(self) -> bool:
        return self._nv is not None

    def read(self) -> tuple[float, float, float]:
        """SM MHz, power W, temperature C."""
        nv, h = self._nv, self._handle
        return (float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)), nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))

    @contextmanager
    def sampling(self, into: Sampled) -> Iterator[Sampled]:
        """Append NVML readings to ``into`` every PERIOD_S until the block ends (at least one reading)."""
        if not self.available:
            yield into
            return
        stop = threading.Event()

        def loop():
            while True:
                self._record(into)
                if stop.wait(PERIOD_S):
                    return

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield into
        finally:
            stop.set()
            thread.join()

    def _record(self, into: Sampled) -> None:
        try:
            sm, power, temp = self.read()
        except Exception:
            return
        into.sm_mhz.append(sm)
        into.power_w.append(power)
        into.temp_c.append(temp)
        into.t_s.append(perf_counter())
        now = time.time()
        if not self.trace or now - self.trace[-1][0] >= TRACE_EVERY_S:
            self.trace.append((now, sm, power, temp))


def run_clock_mhz(df: pd.DataFrame) -> float | None:
    """The run's median SM clock: the median of the ok rows' ``sm_clock_median_mhz`` (each cell one vote); None
    without clock readings."""
    med = pd.to_numeric(df.loc[df["status"] == "ok", "sm_clock_median_mhz"], errors="coerce").median()
    return None if pd.isna(med) else float(med)


def clock_dips(df: pd.DataFrame) -> pd.Series:
    """True for the ok rows whose ``sm_clock_min_mhz`` lies more than CLOCK_DIP below :func:`run_clock_mhz`; False
    elsewhere and without clock readings."""
    run = run_clock_mhz(df)
    if run is None:
        return pd.Series(False, index=df.index)
    return (df["status"] == "ok") & (pd.to_numeric(df["sm_clock_min_mhz"], errors="coerce") < (1 - CLOCK_DIP) * run)
