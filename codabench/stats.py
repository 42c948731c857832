"""Confidence intervals and verdicts of speed ratios: the one definition used by the report and by ``compare``.

A speed ratio compares the median times of two timings, ``ratio = median(ref) / median(cell)`` over each one's
pooled samples (> 1: the cell is faster than the reference). Its 95% interval is the union of two intervals:

1. **Within rounds: a bootstrap of the ratio of medians.** Each of :data:`BOOT` replicates resamples every timing
   round of both timings with replacement (rounds kept as strata, so each round keeps its weight) and takes the ratio
   of the pooled medians; the interval runs from the 2.5th to the 97.5th percentile. The two cells of a group ran
   their rounds interleaved (round r of one beside round r of the other), so a drift common to a round cancels in
   the ratio; between runs (``compare``) the rounds are resampled the same way, run by run. The bootstrap assumes
   nothing about the shape of the noise (GPU times are skewed, with occasional slow samples).
2. **Between rounds: Student's t on the per-round log ratios** (two rounds or more). The bootstrap holds the rounds
   fixed, so it misses drift that falls on one cell's round and not on the other's (clock or temperature changes
   that affect a memory-bound and a compute-bound kernel differently, other tenants). On the committed H200 run
   (3 rounds x 7 samples) the per-round ratio of a cell to torch-compile varies by 2.1% (median over the cells of
   the standard deviation of its log) where the noise within rounds explains 1.2%. With R rounds that spread is
   known from R values only, hence t with R - 1 degrees of freedom (4.30 for 3 rounds; a bootstrap over 3 rounds has
   10 distinct resamples and cannot express that uncertainty). Paired (one run, same rounds): ``d_r = log(median(ref_r) /
   median(cell_r))``, half-width ``t(R-1) sd(d) / sqrt(R)``. Unpaired (two runs, ``compare``): Welch's interval of the
   difference of the mean per-round log medians. The interval is ``ratio * exp(+-half-width)``.

The union keeps the more cautious bound on each side. In simulations of runs with 3 rounds x 7 samples, 1.2%
within-round noise and 0-2% round-to-round drift, the within-round bootstrap alone called 4-53% of equal pairs
faster or slower; the union 1-5%. With one round only the bootstrap is left: it knows nothing of drift between
rounds or runs. More rounds narrow part 2 (t falls from 4.30 at 3 rounds to 2.78 at 5).

A verdict comes from where the interval lies: above 1 the cell is ``faster``, below 1 ``slower``, across 1 a
``tie`` (``same`` between runs). No interval, and ``n/a`` (``unknown`` between runs), for CPU wall times (not
performance figures), for fewer than :data:`MIN_SAMPLES` samples, and between runs for a run of one round. Every replicate's random numbers come from a
generator seeded by :data:`SEED` and the cell's key, so a report rebuilt from the same samples is identical.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import pandas as pd

from codabench.matrix import SPEED_BASELINE
from codabench.results import KEY
from codabench.timing import CPU_WALL

BOOT = 2000
"""Bootstrap replicates per timing."""
LEVEL = 0.95
SEED = 18
MIN_SAMPLES = 5
"""Fewer samples than this give no interval (a median of so few carries no spread to resample)."""

_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
"""Student's t, 97.5th percentile, for 1..30 degrees of freedom (more: the value for 30, slightly cautious)."""


def t975(dof: float) -> float:
    """Student's t quantile for a two-sided 95% interval; a fractional (Welch) dof is rounded down."""
    return _T975[min(max(int(dof), 1), len(_T975)) - 1]


class Timed:
    """The samples of one timed cell, by timing round.

    ``key`` seeds its bootstrap: give each timing of a comparison its own (e.g. the cell's key and the run)."""

    def __init__(self, rounds: Sequence[Sequence[float]], timing: str, key: str):
        self.rounds = [np.asarray(r, dtype=np.float64) for r in rounds if len(r)]
        self.timing, self.key = timing, key
        self.n = sum(len(r) for r in self.rounds)

    @property
    def usable(self) -> bool:
        """Samples that can carry an interval: a performance timing with at least MIN_SAMPLES samples."""
        return self.timing != CPU_WALL and self.n >= MIN_SAMPLES

    @cached_property
    def median(self) -> float:
        return float(np.median(np.concatenate(self.rounds)))

    @cached_property
    def round_log_medians(self) -> np.ndarray:
        return np.log([np.median(r) for r in self.rounds])

    @cached_property
    def boot_medians(self) -> np.ndarray:
        """BOOT bootstrap replicates of the pooled median, each round resampled within itself (one gather)."""
        pooled = np.concatenate(self.rounds)
        sizes = np.array([len(r) for r in self.rounds])
        starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
        rng = np.random.default_rng([SEED, zlib.crc32(self.key.encode())])
        picks = starts + (rng.random((BOOT, self.n)) * np.repeat(sizes, sizes)).astype(np.int64)
        return np.median(pooled[picks], axis=1)


@dataclass(frozen=True)
class Ratio:
    """``value = median(ref) / median(cell)`` with its 95% interval [lo, hi]."""

    value: float
    lo: float
    hi: float

    @property
    def verdict(self) -> str:
        """``faster``/``slower`` when the interval lies above/below 1, else ``tie``."""
        return "faster" if self.lo > 1 else "slower" if self.hi < 1 else "tie"


def ratio(ref: Timed, cell: Timed, paired: bool, value: float | None = None) -> Ratio | None:
    """The speed ratio of ``cell`` against ``ref`` and its interval (module docstring).

    ``paired``: the two ran interleaved, round r beside round r (one group of one run); else they come from two runs,
    and each needs two rounds or more, since drift between runs shows only in the spread between rounds (two
    single-round H100 runs of the same baseline code: the bootstrap alone called 67 of 144 cells faster or slower).
    None when that is missing or either timing is not :attr:`Timed.usable`. ``value``: the point estimate when the
    caller has it from the medians it reports (else the samples')."""
    if not (ref.usable and cell.usable) or (not paired and min(len(ref.rounds), len(cell.rounds)) < 2):
        return None
    value = ref.median / cell.median if value is None else value
    q = 100 * (1 - LEVEL) / 2
    lo, hi = np.percentile(ref.boot_medians / cell.boot_medians, [q, 100 - q])
    half = _between_rounds(ref, cell, paired)
    return Ratio(value, min(lo, value * math.exp(-half), value), max(hi, value * math.exp(half), value))


def _between_rounds(ref: Timed, cell: Timed, paired: bool) -> float:
    """Half-width, in log ratio, of the t interval over rounds; 0 with fewer than two rounds on a side."""
    a, b = ref.round_log_medians, cell.round_log_medians
    if paired and len(a) == len(b) >= 2:
        d = a - b
        return t975(len(d) - 1) * float(np.std(d, ddof=1)) / math.sqrt(len(d))
    if len(a) < 2 or len(b) < 2:
        return 0.0
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    if va + vb == 0:
        return 0.0
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))  # Welch-Satterthwaite
    return t975(dof) * math.sqrt(va + vb)


def speed_figures(df: pd.DataFrame, rounds: dict[tuple, list[list[float]]]) -> pd.DataFrame:
    """The run's rows with the derived speed columns filled (all recomputed; ``rounds``: each cell's samples by
    timing round, keyed (op, model, mode, dtype, impl)).

    Within each group (op, model, mode, dtype), for every ``ok`` row: ``speedup`` = torch-compile median / this median
    with ``speedup_lo``/``speedup_hi``; ``vs_best`` = the median of the fastest *other* ok implementation whose
    outputs were not judged wrong (``correct`` False), over this median, with ``vs_best_lo``/``vs_best_hi`` and
    ``verdict`` against it (``n/a`` without one, or without an interval). The point figures come from ``median_ms``,
    the intervals from the samples, paired by round (:func:`ratio`).

    The fastest other is picked by its median, and the interval is that pair's. Where several others lie within
    noise of each other the pick among them is a coin toss, but the verdict stays sound: ``faster`` means faster
    than the one with the lowest median (so, within noise, than all), ``slower`` means slower than that one (not
    necessarily than each of the others), and a cell within noise of it is a ``tie``."""
    med = pd.to_numeric(df["median_ms"], errors="coerce").to_numpy()
    keys = [tuple(map(str, k)) for k in df[KEY].itertuples(index=False)]  # (op, model, mode, dtype, impl)
    ok = ((df["status"] == "ok").to_numpy() & (med > 0))
    may_lead = [c is not False for c in df["correct"]]
    timing = df["timing"].astype(str).tolist()
    out = {c: [math.nan] * len(df) for c in ("speedup", "speedup_lo", "speedup_hi", "vs_best", "vs_best_lo",
                                             "vs_best_hi")}
    out["verdict"] = [None] * len(df)
    groups: dict[tuple, list[int]] = {}
    for i in np.flatnonzero(ok):
        groups.setdefault(keys[i][:4], []).append(int(i))
    timed = {i: Timed(rounds.get(keys[i], []), timing[i], "|".join(keys[i])) for g in groups.values() for i in g}

    def put(prefix: str, i: int, ref: int) -> str:
        out[prefix][i] = med[ref] / med[i]
        r = ratio(timed[ref], timed[i], True, out[prefix][i])  # ref == i (torch-compile itself): exactly [1, 1]
        if r is None:
            return "n/a"
        out[prefix + "_lo"][i], out[prefix + "_hi"][i] = r.lo, r.hi
        return r.verdict

    for members in groups.values():
        base = [i for i in members if keys[i][4] == SPEED_BASELINE]
        for i in members:
            if base:
                put("speedup", i, base[0])
            others = [j for j in members if j != i and may_lead[j]]
            out["verdict"][i] = put("vs_best", i, min(others, key=lambda j: med[j])) if others else "n/a"
    return df.assign(**out)
