"""Timing loops (benchmarking.md): CUDA events, warm-up, cold L2, many samples; the timing settings of a run.

One sample is ``state = setup(); [flush L2]; [lead]; start.record(); fn(state); end.record()``: the setup
(e.g. the forward pass that a backward-only measurement needs, or fresh autograd leaves) and the L2
flush stay outside the event pair. The *lead* (:func:`lead_ms`) is a GPU spin as long as the call's host time with a
margin (measured in the warm-up): while the GPU spins, the host enqueues the call's launches, so a sample is the GPU
time of the call with its launches queued, even for a call shorter than its own host side. All samples are kept;
the summary is the median, p20/p80 and the
coefficient of variation. On the CPU the loop measures wall time with ``time.perf_counter``; such a
figure checks that the code runs, it is not a performance figure (``Timing.is_perf`` is False).

Every loop reads its clocks and events as local variables from :func:`codabench.guard.private_clocks` (the
originals, recorded before any plugin loaded) and verifies them before and after its timed region: a plugin that
rebinds a clock, even only while the loop runs, reaches neither the loop nor the verdict.

The cells of a group are timed together, sample by sample, by :mod:`codabench.sweep` (which uses this module's
L2 flush and the same private clocks); :func:`measure` times one thing alone: the ceilings, an fp8 cast, a cell of a group
sampled in blocks.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch

from codabench import guard

CUDA_EVENTS, CUDA_GRAPH, CPU_WALL = "cuda-events", "cuda-graph", "cpu-wall"
LEAD_MARGIN, LEAD_PAD_MS, LEAD_MAX_MS = 1.5, 0.02, 2.0
"""A call's lead: LEAD_MARGIN x the 90th percentile of its warm-up calls' host times + LEAD_PAD_MS, at most
LEAD_MAX_MS."""
CALIBRATION_CYCLES = 1_000_000
"""The spin that measures the GPU's spin cycles per ms (about 0.5 ms at 2 GHz)."""


@dataclass
class TimingConfig:
    warmup: int = 3
    """Untimed calls before sampling (the first call also compiles, autotunes, allocates)."""
    warmup_ms: float = 50.0
    """...and at least this much warm-up time (GPU)."""
    reps: int | None = None
    """Samples; None: enough for ``target_ms`` of measured time, within [min_reps, max_reps]."""
    min_reps: int = 20
    max_reps: int = 200
    target_ms: float = 500.0
    cpu_reps: int = 1
    """Samples on the CPU (after one warm-up call), where the figure is only a sanity check: the
    smoke suite spends its time on correctness, not on CPU wall times that mean nothing."""
    flush_l2: bool = True
    rounds: int = 1
    """Blocks fallback only (a group whose inputs do not fit in memory together, or whose interleaved sampling
    failed): rounds in which its cells take turns, each round taking 1/rounds of the samples (:func:`per_round`)."""
    precision: float = 0.01
    """``--precision``: interleaved sweeps (:mod:`codabench.sweep`) stop once every watched ratio's 95% interval is
    within +-precision."""
    same_within: float = 0.02
    """``--same-within``: the equivalence margin of the ``same`` verdict, the whole interval inside [1/(1+m), 1+m]."""
    budget_factor: float = 1.5
    """A group's sampling budget: budget_factor x target_ms of wall time per member, or the time of
    ``budget_sweeps`` sweeps where that is longer (up to ``budget_cap_s``)."""
    budget_sweeps: int = 60
    """Long members (a 70B layer's call takes 20-130 ms) fit only ~20 sweeps into budget_factor x target_ms, and at
    a power cap their per-sweep ratios scatter by 3-5%: the budget stretches to this many sweeps for them."""
    budget_cap_s: float = 20.0
    """The most wall time that the stretch to ``budget_sweeps`` gives one group."""
    min_sweeps: int = 20
    max_sweeps: int = 4000
    settle_max_ms: float = 500.0
    """Warm-up sweeps end when the clock and power settle, or after this long (a GPU at its power cap never settles
    within the tolerances: the pairing, not the warm-up, cancels its clock's moves)."""


def per_round(cfg: TimingConfig) -> TimingConfig:
    """The share of ``cfg``'s samples (and adaptive sampling budget) that one of its ``rounds`` takes."""
    r = max(cfg.rounds, 1)
    if r == 1:
        return cfg
    return replace(cfg, reps=math.ceil(cfg.reps / r) if cfg.reps is not None else None,
                   min_reps=math.ceil(cfg.min_reps / r), max_reps=math.ceil(cfg.max_reps / r),
                   target_ms=cfg.target_ms / r)


@dataclass
class Timing:
    samples_ms: list[float]
    kind: str
    """``cuda-events``, ``cuda-graph`` or ``cpu-wall``."""
    note: str = ""
    first_call_s: float | None = None
    """Wall seconds of the first call at this shape, synchronized: what compiling, JIT-building and autotuning
    cost before the first result (warm caches make it close to one call)."""

    def extend(self, other: Timing) -> None:
        """Pool the samples of a later round of the same measurement into this one."""
        self.samples_ms.extend(other.samples_ms)

    @property
    def is_perf(self) -> bool:
        return self.kind != CPU_WALL

    @property
    def median(self) -> float:
        return statistics.median(self.samples_ms)

    def quantile(self, q: float) -> float:
        """Linear-interpolation quantile of the samples, q in [0, 1]."""
        s = sorted(self.samples_ms)
        pos = q * (len(s) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    @property
    def p20(self) -> float:
        return self.quantile(0.2)

    @property
    def p80(self) -> float:
        return self.quantile(0.8)

    @property
    def cv(self) -> float:
        """Standard deviation over mean (0 for a single sample)."""
        if len(self.samples_ms) < 2:
            return 0.0
        return statistics.stdev(self.samples_ms) / statistics.mean(self.samples_ms)


@dataclass
class L2Flusher:
    """Writes a buffer twice the size of L2 so that the next kernel starts with a cold cache."""

    device: torch.device
    buf: torch.Tensor = field(init=False)

    def __post_init__(self):
        props = torch.cuda.get_device_properties(self.device)
        l2 = getattr(props, "L2_cache_size", 0) or 64 * 2**20
        self.buf = torch.empty(2 * l2, dtype=torch.uint8, device=self.device)

    def flush(self) -> None:
        self.buf.zero_()


_FLUSHERS: dict[torch.device, L2Flusher] = {}


def l2_flusher(device: torch.device) -> L2Flusher:
    if device not in _FLUSHERS:
        _FLUSHERS[device] = L2Flusher(device)
    return _FLUSHERS[device]


def _n_samples(cfg: TimingConfig, est_ms: float) -> int:
    if cfg.reps is not None:
        return cfg.reps
    n = int(cfg.target_ms / max(est_ms, 1e-3))
    return max(cfg.min_reps, min(cfg.max_reps, n))


During = Callable[[], AbstractContextManager]
"""A context entered around the kept samples alone, not the first call, the warm-up or the pilot samples (the
clock sampler of :mod:`codabench.clocks`: a first call that compiles leaves the GPU idle, at its top clock, for
seconds)."""


def measure(fn: Callable[[Any], Any], setup: Callable[[], Any] | None, device: torch.device,
            cfg: TimingConfig | None = None, during: During = nullcontext) -> Timing:
    """Time ``fn(setup())`` per sample; ``setup`` (may be None) runs untimed before each sample; ``during()`` is
    entered around the kept samples."""
    clocks = guard.private_clocks()  # the loops' clocks as locals: out of a plugin's reach (codabench.guard)
    perf_counter, synchronize, verify = clocks.perf_counter, clocks.synchronize, clocks.verify
    verify()
    cfg = cfg or TimingConfig()
    setup = setup or (lambda: None)
    if device.type != "cuda":
        return _measure_cpu(fn, setup, cfg, during, clocks)
    flusher = l2_flusher(device) if cfg.flush_l2 else None
    first = first_call(fn, setup, device)
    start_warm, calls, host_ms = perf_counter(), 1, []
    while calls < max(cfg.warmup, 1) or ((perf_counter() - start_warm) * 1e3 < cfg.warmup_ms
                                         and calls < 1000):
        state = setup()
        t0 = perf_counter()
        fn(state)
        host_ms.append((perf_counter() - t0) * 1e3)
        synchronize(device)
        calls += 1
    lead = int(lead_ms(host_ms) * spin_cycles_per_ms(device, clocks))
    est = _sample_events(fn, setup, flusher, device, 3, clocks, lead)
    n = _n_samples(cfg, statistics.median(est))
    with during():
        samples = _sample_events(fn, setup, flusher, device, n, clocks, lead)
    verify()
    return Timing(samples, CUDA_EVENTS, first_call_s=first)


def lead_ms(host_ms: list[float]) -> float:
    """The lead in ms of a call whose warm-up calls took ``host_ms`` of host time each (module docstring); 0 without
    any. It hides host time only, never GPU work: a call that reads its inputs on the host waits for the GPU, and
    from then on the sample counts it."""
    if not host_ms:
        return 0.0
    ordered = sorted(host_ms)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return min(LEAD_MAX_MS, LEAD_MARGIN * p90 + LEAD_PAD_MS)


def spin_cycles_per_ms(device: torch.device, clocks: guard.Clocks) -> float:
    """The lead's spin cycles per ms on ``device``: the slope between a spin of :data:`CALIBRATION_CYCLES` and one of
    twice that, after a spin that loads its kernel (a first launch loads the module; a fixed cost would count as
    spinning). Synchronizes."""
    clocks.sleep(1000)
    spans = []
    for cycles in (CALIBRATION_CYCLES, 2 * CALIBRATION_CYCLES):
        start, end = clocks.Event(enable_timing=True), clocks.Event(enable_timing=True)
        clocks.record(start)
        clocks.sleep(cycles)
        clocks.record(end)
        spans.append((start, end))
    clocks.synchronize(device)
    return CALIBRATION_CYCLES / max(clocks.elapsed_ms(*spans[1]) - clocks.elapsed_ms(*spans[0]), 1e-6)


def first_call(fn, setup, device: torch.device) -> float:
    """Seconds of one synchronized call (the first: compilation, JIT builds and autotuning happen here); ``setup``
    (may be None) runs untimed before it."""
    clocks = guard.private_clocks()
    perf_counter, synchronize = clocks.perf_counter, clocks.synchronize
    state = setup() if setup is not None else None
    t0 = perf_counter()
    fn(state)
    if device.type == "cuda":
        synchronize(device)
    return perf_counter() - t0


def _sample_events(fn, setup, flusher: L2Flusher | None, device: torch.device, n: int, clocks: guard.Clocks,
                   lead_cycles: int) -> list[float]:
    Event, record, elapsed_ms, synchronize, sleep = (clocks.Event, clocks.record, clocks.elapsed_ms,
                                                     clocks.synchronize, clocks.sleep)
    starts = [Event(enable_timing=True) for _ in range(n)]
    ends = [Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        state = setup()
        if flusher is not None:
            flusher.flush()
        if lead_cycles:
            sleep(lead_cycles)
        record(starts[i])
        fn(state)
        record(ends[i])
        del state
    synchronize(device)
    return [elapsed_ms(s, e) for s, e in zip(starts, ends)]


def _measure_cpu(fn, setup, cfg: TimingConfig, during: During, clocks: guard.Clocks) -> Timing:
    perf_counter, verify = clocks.perf_counter, clocks.verify
    first = first_call(fn, setup, torch.device("cpu"))  # the warm-up call: compile, first-call allocations
    samples = []
    with during():
        for _ in range(cfg.reps or cfg.cpu_reps):
            state = setup()
            t0 = perf_counter()
            fn(state)
            samples.append((perf_counter() - t0) * 1e3)
    verify()
    return Timing(samples, CPU_WALL, first_call_s=first)


def graph_sets(set_bytes: int, l2_bytes: int, cap: int = 64) -> tuple[int, bool]:
    """CUDA-graph mode: how many input sets to rotate among so that together they are at least 3x L2 (every replay
    then reads memory that the last replays evicted from L2), at least 2; and whether that took more than ``cap``
    sets, in which case the replays are also preceded by an L2 flush (tiny inputs)."""
    need = max(2, math.ceil(3 * l2_bytes / max(set_bytes, 1)))
    return min(need, cap), need > cap
