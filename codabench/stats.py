"""Confidence intervals and verdicts of speed ratios: the one definition used by the report, ``compare``, ``merge``
and the sampling engine's stopping rule.

A speed ratio compares two timed cells, ``ref`` and ``cell``; above 1 the cell is faster. Its 95% interval depends on
how the samples were taken (``grain`` of samples.jsonl):

**Paired sweeps (grain "sample").** Inside a group (one op, model, mode, dtype) every implementation takes one sample
per sweep, in a random order within the sweep, so two samples of one sweep ran back to back on the same clock. The
pairs are joined on their common sweep ids and ``d_s = log(ref_s) - log(cell_s)``; the point estimate is
``exp(median(d))`` (it replaces the ratio of the two medians: a drift of the clock moves both samples of a pair
together and cancels in ``d_s``, whereas the pooled medians keep it). The interval is the union (the more cautious
bound on each side) of

1. the distribution-free interval of the median of ``d`` from its order statistics (binomial, exact for independent
   pairs, whatever the shape of the noise: GPU times are skewed, with occasional slow samples), and
2. a batch-means interval: the pairs, in time order, cut into ``B = min(10, n // 5)`` contiguous batches, Student's
   t with ``B - 1`` degrees of freedom on the batch medians of ``d``. Pairs are not quite independent: a drift that
   moves the two implementations differently (a compute-bound and a bandwidth-bound kernel respond differently to the
   SM clock) or a neighbour's burst spans several sweeps; the batches see it as spread between batch medians.

Fewer than :data:`MIN_PAIRS` common sweeps give no interval. In simulations (``tests/test_stats.py``) of an H100 at
its power cap, the SM clock falling 1980 -> 1485 MHz across a cell and every time scaling with 1/clock, with 1%
multiplicative noise: two identical implementations sampled in contiguous blocks (3 rounds of 7 samples each, in
turn) read 3-7% apart (median 4.7%) and were called slower in 95% of 200 trials; sampled in 150 interleaved sweeps
their paired ratio stayed within 0.5% of 1 (half-width 0.4%) and read ``same`` in 97% of the trials (3% faster or
slower), and a planted 2% difference was ``slower`` in every trial from 100 sweeps on.

**Paired rounds (grain "round"; runs from before sweeps, and groups whose inputs do not fit in memory for
sweeps).** Each cell took a block of samples per round and the sweep id is the round. The point estimate is the ratio
of the pooled medians; the interval is the union of a bootstrap of that ratio (:data:`BOOT` replicates, each round of
each cell resampled within itself) and Student's t on the per-round log ratios of the common rounds (``t(R-1)
sd / sqrt(R)``), which carries the drift that falls on one cell's round and not on the other's (on the committed H200
run, 3 rounds x 7 samples, the per-round ratio varies by 2.1% where the noise within rounds explains 1.2%).

**Unpaired (two runs, ``compare``).** Nothing pairs a sample of one run with a sample of another. Each timing is cut
into blocks, its rounds (grain "round") or the same contiguous batches as above (grain "sample"); the interval is the
union of the bootstrap within blocks and Welch's t interval of the difference of the mean per-block log medians. Each
side needs two blocks or more: drift between runs shows only in the spread between blocks.

**Verdicts** (:meth:`Ratio.verdict`): ``faster`` when the interval lies above 1, ``slower`` below 1, ``same`` when it
lies wholly inside the equivalence margin ``[1 / (1 + m), 1 + m]`` (``m`` = :data:`SAME_WITHIN`, env.json's
``timing.same_within``: two one-sided tests), else ``unresolved`` (the interval contains 1 and reaches beyond the
margin: the samples cannot tell). No interval, ``n/a``, for CPU wall times (not performance figures), for fewer than
:data:`MIN_SAMPLES` samples or :data:`MIN_PAIRS` pairs. The bootstrap's random numbers come from a generator seeded by
:data:`SEED` and the cell's key, so a report rebuilt from the same samples is identical.
"""
from __future__ import annotations

import math
import sys
import zlib
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from codabench import results as tables
from codabench.matrix import SPEED_BASELINE
from codabench.results import KEY
from codabench.timing import CPU_WALL

BOOT = 2000
"""Bootstrap replicates per timing (grain "round" and unpaired intervals)."""
LEVEL = 0.95
SEED = 18
MIN_SAMPLES = 5
"""Fewer samples than this give no interval (a median of so few carries no spread to resample)."""
MIN_PAIRS = 10
"""Fewer common sweeps than this give no paired interval (two batches of five at least)."""
MAX_BATCHES, BATCH_MIN = 10, 5
"""Batch means: ``B = min(MAX_BATCHES, n // BATCH_MIN)`` contiguous batches of the samples or pairs in time order."""
PRECISION = 0.01
"""Default target half-width of an interval (env.json ``timing.precision``): sampling stops once every ratio it
watches is this narrow (+-1%)."""
SAME_WITHIN = 0.02
"""Default equivalence margin (env.json ``timing.same_within``): ``same`` needs the interval inside [1/1.02, 1.02]."""
SAMPLE, ROUND = "sample", "round"
"""Grains of samples.jsonl: one sample per cell per sweep, or a block of samples per cell per round."""
VERDICTS = ("faster", "same", "slower", "unresolved")
"""The verdicts of an interval; ``n/a`` where there is none."""
DECIDED = ("faster", "same", "slower")

_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
"""Student's t, 97.5th percentile, for 1..30 degrees of freedom (more: the value for 30, slightly cautious)."""


def t975(dof: float) -> float:
    """Student's t quantile for a two-sided 95% interval; a fractional (Welch) dof is rounded down."""
    return _T975[min(max(int(dof), 1), len(_T975)) - 1]


def timing_settings(env: Mapping[str, Any]) -> tuple[float, float]:
    """(precision, same_within) of a run: env.json's ``timing`` values, or the defaults where absent."""
    timing = env.get("timing") or {}
    return float(timing.get("precision") or PRECISION), float(timing.get("same_within") or SAME_WITHIN)


@lru_cache(maxsize=None)
def median_rank(n: int) -> int:
    """The 0-based rank k such that [x_(k), x_(n-1-k)] of n sorted independent values covers their median with
    probability >= LEVEL (the binomial order-statistic interval); -1 where n is too small for any."""
    j = np.arange(n)
    log_comb = np.concatenate([[0.0], np.cumsum(np.log((n - j) / (j + 1)))])  # log C(n, i), i = 0..n
    cdf = np.cumsum(np.exp(log_comb - n * math.log(2)))
    # the median lies below x_(k) when at most k of the n values fall below it: P(Bin(n, 1/2) <= k) = cdf[k]
    ok = np.flatnonzero(cdf <= (1 - LEVEL) / 2)
    return int(ok[-1]) if len(ok) else -1


def batch_count(n: int) -> int:
    """Contiguous batches for batch means over ``n`` values in time order."""
    return min(MAX_BATCHES, n // BATCH_MIN)


class Timed:
    """The samples of one timed cell, in the order taken, with the sweep (or round, grain "round") of each.

    ``key`` seeds its bootstrap: give each timing of a comparison its own (e.g. the cell's key and the run)."""

    def __init__(self, samples_ms: Sequence[float], sweeps: Sequence[int], timing: str, key: str,
                 grain: str = SAMPLE):
        if len(samples_ms) != len(sweeps):
            raise ValueError(f"{key}: {len(samples_ms)} samples but {len(sweeps)} sweep ids")
        if grain not in (SAMPLE, ROUND):
            raise ValueError(f"{key}: grain {grain!r} is neither {SAMPLE!r} nor {ROUND!r}")
        order = np.argsort(np.asarray(sweeps, dtype=np.int64), kind="stable")  # time order
        self.samples = np.asarray(samples_ms, dtype=np.float64)[order]
        self.sweeps = np.asarray(sweeps, dtype=np.int64)[order]
        if grain == SAMPLE and np.any(np.diff(self.sweeps) == 0):
            raise ValueError(f"{key}: grain 'sample' takes one sample per sweep, but a sweep id repeats")
        self.timing, self.key, self.grain = timing, key, grain
        self.n = len(self.samples)

    @classmethod
    def from_rounds(cls, rounds: Sequence[Sequence[float]], timing: str, key: str) -> "Timed":
        """Samples by round (grain "round", the sweep id being the round's index)."""
        return cls([s for r in rounds for s in r], [i for i, r in enumerate(rounds) for _ in r], timing, key, ROUND)

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], key: str) -> "Timed":
        """One object of samples.jsonl: with ``sweeps`` (and ``grain``, default "sample"), or an older one with its
        ``rounds`` (grain "round"), or older still with only ``samples_ms`` (one round)."""
        timing = str(entry.get("timing") or "")
        if entry.get("sweeps") is not None:
            return cls(entry.get("samples_ms") or [], entry["sweeps"], timing, key, entry.get("grain") or SAMPLE)
        rounds = entry.get("rounds")
        return cls.from_rounds(rounds if rounds is not None else [entry.get("samples_ms") or []], timing, key)

    @property
    def usable(self) -> bool:
        """Samples that can carry an interval: a performance timing with at least MIN_SAMPLES samples."""
        return self.timing != CPU_WALL and self.n >= MIN_SAMPLES

    @cached_property
    def median(self) -> float:
        return float(np.median(self.samples))

    @cached_property
    def blocks(self) -> list[np.ndarray]:
        """The samples by round (grain "round") or in :func:`batch_count` contiguous batches (grain "sample")."""
        if self.grain == ROUND:
            return [self.samples[self.sweeps == s] for s in np.unique(self.sweeps)]
        b = batch_count(self.n)
        return np.array_split(self.samples, b) if b >= 2 else [self.samples]

    @cached_property
    def round_log_medians(self) -> dict[int, float]:
        """log median of each sweep id's samples (grain "round": of each round)."""
        return {int(s): float(np.log(np.median(self.samples[self.sweeps == s]))) for s in np.unique(self.sweeps)}

    @cached_property
    def boot_medians(self) -> np.ndarray:
        """BOOT bootstrap replicates of the pooled median, each block resampled within itself (one gather)."""
        pooled = np.concatenate(self.blocks)
        sizes = np.array([len(r) for r in self.blocks])
        starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
        rng = np.random.default_rng([SEED, zlib.crc32(self.key.encode())])
        picks = starts + (rng.random((BOOT, self.n)) * np.repeat(sizes, sizes)).astype(np.int64)
        return np.median(pooled[picks], axis=1)


@dataclass(frozen=True)
class Ratio:
    """A speed ratio (> 1: the cell is faster than the reference) with its 95% interval [lo, hi]."""

    value: float
    lo: float
    hi: float

    @property
    def half_width(self) -> float:
        """The interval's wider side as a share of the value (0.01: +-1%)."""
        return max(self.hi / self.value - 1, 1 - self.lo / self.value)

    def verdict(self, same_within: float = SAME_WITHIN) -> str:
        """``faster`` (interval above 1), ``slower`` (below 1), ``same`` (inside [1/(1+m), 1+m] for m =
        ``same_within``), else ``unresolved``."""
        if self.lo > 1:
            return "faster"
        if self.hi < 1:
            return "slower"
        return "same" if 1 / (1 + same_within) <= self.lo and self.hi <= 1 + same_within else "unresolved"


def ratio(ref: Timed, cell: Timed, paired: bool, value: float | None = None) -> Ratio | None:
    """The speed ratio of ``cell`` against ``ref`` (> 1: ``cell`` is faster) and its interval (module docstring).

    ``paired``: the two were sampled together (one group of one run): by sweep where both are grain "sample", the
    point estimate then being ``exp(median(log ref_s - log cell_s))`` over common sweeps, else by round, the point
    estimate being the ratio of the medians. Unpaired: two runs. None where either timing is not
    :attr:`Timed.usable`, paired sweeps have fewer than :data:`MIN_PAIRS` in common, or (unpaired) a side has fewer
    than two blocks. ``value`` overrides the point estimate (the interval is widened to hold it)."""
    if not (ref.usable and cell.usable):
        return None
    if paired and ref.grain == cell.grain == SAMPLE:
        r = _paired_sweeps(ref, cell)
    elif paired:
        r = _with_bootstrap(ref, cell, _between_rounds(ref, cell))
    elif min(len(ref.blocks), len(cell.blocks)) < 2:
        return None
    else:
        r = _with_bootstrap(ref, cell, _welch(ref, cell))
    if r is None:
        return None
    if value is None:
        return r
    return Ratio(float(value), min(r.lo, value), max(r.hi, value))


def _paired_sweeps(ref: Timed, cell: Timed) -> Ratio | None:
    _, i, j = np.intersect1d(ref.sweeps, cell.sweeps, assume_unique=True, return_indices=True)
    n = len(i)
    if n < MIN_PAIRS:
        return None
    d = np.log(ref.samples[i]) - np.log(cell.samples[j])  # in time order: intersect1d sorts the sweep ids
    center = float(np.median(d))
    ranked = np.sort(d)
    k = median_rank(n)
    lo, hi = ranked[k], ranked[n - 1 - k]
    batches = np.array([np.median(b) for b in np.array_split(d, batch_count(n))])
    mean, half = float(batches.mean()), t975(len(batches) - 1) * float(batches.std(ddof=1)) / math.sqrt(len(batches))
    lo, hi = min(lo, mean - half, center), max(hi, mean + half, center)
    return Ratio(math.exp(center), math.exp(float(lo)), math.exp(float(hi)))


def _with_bootstrap(ref: Timed, cell: Timed, half: float) -> Ratio:
    """Ratio of the medians; interval: the bootstrap's, united with ``value * exp(+-half)``."""
    value = ref.median / cell.median
    q = 100 * (1 - LEVEL) / 2
    lo, hi = np.percentile(ref.boot_medians / cell.boot_medians, [q, 100 - q])
    return Ratio(float(value), float(min(lo, value * math.exp(-half), value)),
                 float(max(hi, value * math.exp(half), value)))


def _between_rounds(ref: Timed, cell: Timed) -> float:
    """Half-width, in log ratio, of the paired t interval over the common rounds; 0 with fewer than two."""
    a, b = ref.round_log_medians, cell.round_log_medians
    d = np.array([a[s] - b[s] for s in a.keys() & b.keys()])
    if len(d) < 2:
        return 0.0
    return t975(len(d) - 1) * float(np.std(d, ddof=1)) / math.sqrt(len(d))


def _welch(ref: Timed, cell: Timed) -> float:
    """Half-width, in log ratio, of Welch's interval on the difference of the mean per-block log medians."""
    a = np.log([np.median(x) for x in ref.blocks])
    b = np.log([np.median(x) for x in cell.blocks])
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    if va + vb == 0:
        return 0.0
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))  # Welch-Satterthwaite
    return t975(dof) * math.sqrt(va + vb)


def read_timed(run_dir: str | Path, env: Mapping[str, Any]) -> dict[tuple[str, ...], Timed]:
    """Every timed cell of a run directory (samples.jsonl), keyed (op, model, mode, dtype, impl). Objects that carry
    neither ``sweeps`` nor ``rounds`` (the oldest runs) are split into rounds by :func:`codabench.results.
    sample_rounds`. A malformed object (sweep ids that do not match its samples) is left out with one line on
    stderr: its cell gets no interval, the rest of the report is built."""
    run_dir = Path(run_dir)
    legacy = tables.sample_rounds(run_dir, dict(env))
    out = {}
    for s in tables.read_samples(run_dir / tables.SAMPLES):
        key = tuple(str(s[k]) for k in KEY)
        if s.get("sweeps") is None and s.get("rounds") is None:
            s = {**s, "rounds": legacy[key]}
        try:
            out[key] = Timed.from_entry(s, "|".join(key))
        except ValueError as err:
            print(f"codabench: {run_dir / tables.SAMPLES}: {err}; that cell gets no interval", file=sys.stderr)
    return out


def speed_figures(df: pd.DataFrame, samples: Mapping[tuple, Timed | Mapping[str, Any]],
                  same_within: float = SAME_WITHIN) -> pd.DataFrame:
    """The run's rows with the derived speed columns filled (all recomputed; ``samples``: each cell's
    :class:`Timed`, or its samples.jsonl object, keyed (op, model, mode, dtype, impl)).

    Within each group (op, model, mode, dtype), for every ``ok`` row: ``speedup`` = this cell's speed over
    torch-compile's with ``speedup_lo``/``speedup_hi``; ``vs_best`` = its speed over the fastest *other* ok
    implementation whose outputs were not judged wrong (``correct`` False), with ``vs_best_lo``/``vs_best_hi`` and
    ``verdict`` against it (:meth:`Ratio.verdict` with ``same_within``; ``n/a`` without one, or without an interval).
    The point figures: the paired estimate where the group was sampled in sweeps, else the ratio of the rows'
    ``median_ms``; the intervals: :func:`ratio`, paired.

    The fastest other is picked by its median, and the interval is that pair's. Where several others lie within
    noise of each other the pick among them is a coin toss, but the verdict stays sound: ``faster`` means faster
    than the one with the lowest median (so, within noise, than all), ``slower`` means slower than that one (not
    necessarily than each of the others), ``same`` within the margin of it."""
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

    def timed_of(i: int) -> Timed:
        s = samples.get(keys[i])
        if isinstance(s, Timed):
            return s
        return Timed.from_entry({"timing": timing[i], **(s or {})}, "|".join(keys[i]))

    timed = {i: timed_of(i) for g in groups.values() for i in g}

    def put(prefix: str, i: int, ref: int) -> str:
        a, b = timed[ref], timed[i]
        by_medians = med[ref] / med[i]
        r = ratio(a, b, True, None if a.grain == b.grain == SAMPLE else by_medians)  # ref == i: exactly [1, 1]
        out[prefix][i] = by_medians if r is None else r.value
        if r is None:
            return "n/a"
        out[prefix + "_lo"][i], out[prefix + "_hi"][i] = r.lo, r.hi
        return r.verdict(same_within)

    for members in groups.values():
        base = [i for i in members if keys[i][4] == SPEED_BASELINE]
        for i in members:
            if base:
                put("speedup", i, base[0])
            others = [j for j in members if j != i and may_lead[j]]
            out["verdict"][i] = put("vs_best", i, min(others, key=lambda j: med[j])) if others else "n/a"
    return df.assign(**out)
