"""Paired, interleaved sampling of a group: every member timed once per sweep, in a random order, until resolved.

A group (one op, model, mode and dtype) has members: the timed calls of its implementations and the plain GEMMs of
its speed-of-light. A *sweep* times each member once, in an order drawn at random for every sweep, each sample with
its own L2 flush. The samples of one sweep are taken back to back, so a change of the GPU's clock (an H100 at its
power cap falls from ~1980 to ~1485 MHz within seconds) falls on both sides of every ratio taken from them
(:mod:`codabench.stats` pairs the samples by sweep); the random order cancels what a fixed order would leave (a
member always sampled after the hottest one).

:func:`sample` runs three phases:

1. **Settle**: warm-up sweeps, untimed, for at least ``warmup_ms`` and then until the NVML readings of the last
   :data:`SETTLE_WINDOW_S` vary by no more than :data:`CLOCK_TOL` (SM clock) and :data:`POWER_TOL` (power), or
   ``settle_max_ms`` has passed; what was reached is recorded (``settle_s``, the clock and power at its end).
   The warm-up also times each member's host side (the wall time from its start event's enqueue to its call's
   return) and sets its *lead* (:func:`codabench.timing.lead_ms`): from then on, each sample's start event is
   enqueued behind a spin kernel (the guard's ``torch._C._cuda_sleep``, its cycles per ms measured once) as long as
   that host time with a margin (at most :data:`codabench.timing.LEAD_MAX_MS`: host time past it is in the sample).
   While the GPU spins, the host enqueues the call's launches, so a sample is the GPU time of the call with its
   launches queued, whether or not the host keeps ahead of the GPU: a short call (a 1B
   fp8 GEMM takes ~0.1 ms) otherwise waits for each sample's untimed refill and its own launches, and its sample
   holds host time. (NVBench's blocking kernel does the same, released by the host; a spin of measured length
   cannot hang.) The lead hides only what the host does before a launch, never GPU work: a call that reads its
   inputs on the host must wait for the GPU, and from then on the sample counts it; each member's host time per
   call is kept (``host_ms``), so a call whose host side outlasts its GPU time is visible.
2. **Sweeps**, in chunks: a chunk (about :data:`CHUNK_S` of GPU time) is enqueued, and the chunk before it is read
   while it runs (the GPU never idles between chunks while the host applies the rule); each sample is its own
   CUDA-event pair. After each chunk, from ``min_sweeps`` on, the watched ratios (each member
   against the run's speed baseline and against the fastest other member) are computed by :func:`codabench.stats.
   ratio`; sampling stops when every interval's half-width is within ``precision`` (``resolved``), when the group's
   budget is spent (``budget``: :func:`group_budget_s`, wall time) or at ``max_sweeps``.
3. **Clocks**: the NVML sampler runs through phases 1-2 (every :data:`codabench.clocks.PERIOD_S`); each sample gets
   the SM clock read nearest to the time the GPU ran it (the synchronized start of the phase plus the events' offset).

The clocks and events are local variables taken from :func:`codabench.guard.private_clocks`, verified before and
after every chunk: a replaced clock or torch function ends the sampling with :class:`codabench.guard.Tampered` (the
worker then restores the originals and the group is timed again in blocks, one cell per request, so that the cell
that did it is the one blamed). A member whose call, set-up or checks raise is dropped from later sweeps with its
error (its cell gets an error row); the other members go on. After each call, outside the timed region, the threads
alive are compared with those before its set-up: a thread it started that is still alive and runs its
implementation's code (:func:`codabench.guard.stray_threads`) would run beside the next members' calls, and ends the
sweeps with :class:`LeftThreads` (the caller samples the others again without that member once the thread is gone).
On the CPU the samples are wall times of ``cpu_reps`` sweeps (no performance figure, no stopping rule).
"""
from __future__ import annotations

import math
import threading
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from codabench import guard, stats
from codabench.clocks import ClockSampler, Sampled
from codabench.timing import CPU_WALL, CUDA_EVENTS, TimingConfig, l2_flusher, lead_ms, spin_cycles_per_ms

SETTLE_WINDOW_S = 0.25
CLOCK_TOL, POWER_TOL = 0.02, 0.05
"""Settled: the last SETTLE_WINDOW_S of readings within 2% (SM clock) and 5% (power), as (max - min) / median."""
CHUNK_S = 0.1
"""GPU time of the sweeps enqueued between two synchronizations (and two evaluations of the stopping rule)."""
MAX_CHUNK = 64
WARMUP_SWEEP = -1
"""The sweep id of the first warm-up sweep (the next ones count down): set-up and checks see negative ids."""


@dataclass(eq=False)
class Member:
    """One timed thing of a group: ``state = setup(sweep)`` (untimed, before the flush), ``returned = call(state)``
    (timed, inside ``context()``), ``after(sweep, returned)`` (untimed, once the end event is enqueued: checks of
    the returned outputs; raises to fail the member)."""

    name: str
    call: Callable[[Any], Any]
    setup: Callable[[int], Any] | None = None
    after: Callable[[int, Any], None] | None = None
    context: Callable[[], AbstractContextManager] = nullcontext
    watch: bool = True
    """Its ratios decide when sampling stops (the speed-of-light GEMMs do not)."""
    error: str | None = None
    samples_ms: list[float] = field(default_factory=list)
    sweeps: list[int] = field(default_factory=list)
    ran_s: list[float] = field(default_factory=list)
    """perf_counter seconds at which the GPU started each sample (for its clock)."""
    clock_mhz: list[float | None] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)
    """Host milliseconds from each kept sample's start event to its call's return."""
    warm_host_ms: list[float] = field(default_factory=list)
    """The same for the warm-up's calls (they set the lead)."""
    lead_cycles: int = 0
    """The spin enqueued before each sample's start event (module docstring); 0: none."""
    own: tuple[str, ...] | None = None
    """Its implementation's files (:func:`codabench.guard.module_files`): a thread that its set-up or call leaves alive
    running them, or code of its own anywhere, fails it and stops the sweeps (:class:`LeftThreads`); None: not looked
    for (the speed-of-light GEMMs are the harness's)."""

    def timed(self, kind: str) -> stats.Timed:
        return stats.Timed(self.samples_ms, self.sweeps, kind, self.name, grain="sample")


@dataclass
class Sweeps:
    """What :func:`sample` measured: the members (their samples, sweeps, clocks and errors) and how it went."""

    members: list[Member]
    kind: str
    n_sweeps: int
    stop: str
    """``resolved``, ``budget``, ``max_sweeps``, ``cpu`` (CPU wall times: no stopping rule) or ``failed`` (no member
    left)."""
    settle_s: float = 0.0
    """The warm-up's seconds (``settle_max_ms`` when the clock and power did not settle)."""
    settle_mhz: float | None = None
    settle_w: float | None = None


class LeftThreads(Exception):
    """A member's call left threads alive that run its implementation's code (:func:`codabench.guard.stray_threads`):
    they would run beside the next members' timed calls, and may have run beside the samples taken since the last
    check, so the sweeps stop; the member carries its error, ``threads`` are the threads."""

    def __init__(self, member: Member, threads: list[threading.Thread]):
        Exception.__init__(self, member.error)
        self.member, self.threads = member, threads


class DroppedGraphs(LeftThreads):
    """A member's set-up or call dropped torch-compile's graphs (:meth:`codabench.guard.Seal.add_graphs`): torch-compile
    would compile inside its next timed call, so the sweeps stop, and the others are sampled again without the member
    (the warm-up compiles again)."""

    def __init__(self, member: Member):
        LeftThreads.__init__(self, member, [])


def _left_threads(m: Member, before: set[threading.Thread], clocks: guard.Clocks) -> None:
    """Raise :class:`LeftThreads` where ``m``'s set-up or call (outside the timed region, after it) left a thread
    started since ``before`` alive that runs its code. Costs a look at the thread list where it started none."""
    if clocks.running() <= before:
        return
    left = clocks.strays(before, m.own)
    if left:
        m.error = guard.threads_message([t.name for t in left], "its call in the group's interleaved sweeps")
        raise LeftThreads(m, left)


def _describe(e: BaseException) -> str:
    from codabench.measure import describe_exception  # measure imports this module

    return describe_exception(e)


def _one(m: Member, sweep: int, cpu: bool, flush: Callable[[], None] | None, clocks: guard.Clocks,
         seal: guard.Seal | None = None) -> tuple[tuple[Any, Any] | float, float] | None:
    """Time member ``m`` once: (CUDA events (start, end) on the GPU, wall milliseconds on the CPU; the host
    milliseconds from the start to the call's return); None on error. A thread it left running its code:
    :class:`LeftThreads`. ``seal``: the harness's objects its set-up and call must leave as they were (checked before
    its outputs are: the member fails, and they are put back, before any other member runs)."""
    perf_counter, Event, record = clocks.perf_counter, clocks.Event, clocks.record
    before = clocks.running() if m.own is not None else None
    try:
        state = m.setup(sweep) if m.setup is not None else None
        if cpu:
            with m.context():
                t0 = perf_counter()
                returned = m.call(state)
                took = host = (perf_counter() - t0) * 1e3
        else:
            if flush is not None:
                flush()
            start, end = Event(enable_timing=True), Event(enable_timing=True)
            if m.lead_cycles:
                clocks.sleep(m.lead_cycles)
            with m.context():
                t0 = perf_counter()
                record(start)
                returned = m.call(state)
                host = (perf_counter() - t0) * 1e3
                record(end)
            took = (start, end)
        if before is not None:
            _left_threads(m, before, clocks)
        broken = seal.broken() if seal is not None else []
        if broken:
            seal.restore()
            m.error = guard.seal_message(broken)
            if guard.GRAPHS in broken:
                raise DroppedGraphs(m)
            return None
        if m.after is not None:
            m.after(sweep, returned)
        return took, host
    except LeftThreads:
        raise
    except Exception as e:
        m.error = _describe(e)
        return None


class _Chunks:
    """Chunks of sweeps, enqueued one ahead: on the GPU a chunk's samples are read (waiting for its last event) only
    once the next chunk is enqueued, so the GPU goes on working while the host reads the events and applies the
    stopping rule; between two chunks it never waits for the host. On the CPU each chunk runs to its end at once.

    ``keep``: append the samples to the members (the warm-up keeps none). :meth:`push` and :meth:`drain` raise
    :class:`codabench.guard.Tampered` when a clock or a guarded function was replaced meanwhile: a chunk's samples
    are kept only when the check after it (and after the next chunk's enqueue) passes."""

    def __init__(self, members: list[Member], device: torch.device, flush: Callable[[], None] | None,
                 rng: np.random.Generator, clocks: guard.Clocks, keep: bool = True, seal: guard.Seal | None = None):
        self.members, self.device, self.flush, self.rng, self.clocks, self.keep = (members, device, flush, rng,
                                                                                    clocks, keep)
        self.seal = seal
        self.cpu = device.type != "cuda"
        self.kept = 0
        """Sweeps whose samples are in (kept, or read and dropped with ``keep`` False)."""
        self._pending: tuple[range, list[tuple[Member, int, Any, float]]] | None = None
        if not self.cpu:
            self._base = clocks.Event(enable_timing=True)
            clocks.record(self._base)
            clocks.synchronize(device)
            self._t0 = clocks.perf_counter()

    def push(self, sweeps: range) -> None:
        """Enqueue ``sweeps`` (each member once per sweep, in a random order), then read the chunk before them."""
        self.clocks.verify()
        taken = []
        for s in sweeps:
            for i in self.rng.permutation(len(self.members)):
                m = self.members[i]
                if m.error is None:
                    one = _one(m, s, self.cpu, self.flush, self.clocks, self.seal)
                    if one is not None:
                        taken.append((m, s, *one))
        self.drain()
        self._pending = (sweeps, taken)
        if self.cpu:
            self.drain()

    def drain(self) -> None:
        """Wait for the chunk in flight and read its samples."""
        if self._pending is None:
            return
        (sweeps, taken), self._pending = self._pending, None
        clocks = self.clocks
        if taken and not self.cpu:
            clocks.wait(taken[-1][2][1])
        clocks.verify()
        self.kept += len(sweeps)
        for m, s, took, host in taken:
            if m.error is not None:
                continue
            if not self.keep:
                m.warm_host_ms.append(host)
                continue
            m.sweeps.append(s)
            m.host_ms.append(host)
            if self.cpu:
                m.samples_ms.append(took)
                m.ran_s.append(clocks.perf_counter())
            else:
                m.samples_ms.append(clocks.elapsed_ms(*took))
                m.ran_s.append(self._t0 + clocks.elapsed_ms(self._base, took[0]) / 1e3)


def watched_pairs(members: list[Member], baseline: str | None) -> list[tuple[Member, Member]]:
    """(reference, member) for every watched member: against the baseline (when it is another member) and against
    the fastest other watched member by median so far."""
    live = [m for m in members if m.error is None and m.watch and m.samples_ms]
    medians = {m.name: float(np.median(m.samples_ms)) for m in live}
    pairs = []
    for m in live:
        refs = [r for r in live if r is not m and r.name == baseline]
        others = [r for r in live if r is not m]
        if others:
            refs.append(min(others, key=lambda r: medians[r.name]))
        pairs += [(r, m) for r in dict.fromkeys(refs)]
    return pairs


def half_widths(members: list[Member], baseline: str | None, kind: str) -> dict[str, float]:
    """Per watched member, the widest half-width of its watched ratios (inf where an interval is missing)."""
    out: dict[str, float] = {}
    for ref, m in watched_pairs(members, baseline):
        r = stats.ratio(ref.timed(kind), m.timed(kind), paired=True)
        out[m.name] = max(out.get(m.name, 0.0), r.half_width if r is not None else math.inf)
    return out


def sample(members: list[Member], device: torch.device, cfg: TimingConfig, nvml: ClockSampler,
           baseline: str | None = None, flush_l2: bool | None = None, seal: guard.Seal | None = None) -> Sweeps:
    """Settle, then sweep ``members`` until their watched ratios are resolved or the budget is spent (module
    docstring). ``flush_l2``: flush before every sample (default ``cfg.flush_l2``; CUDA-graph members rotate input
    sets larger than L2 instead). ``seal``: the harness's objects every member's set-up and call must leave as they
    were (:func:`_one`)."""
    rng, clocks = np.random.default_rng(), guard.private_clocks()  # bound once, before any member runs
    if device.type != "cuda":
        n = max(cfg.reps or cfg.cpu_reps, 1)
        _Chunks(members, device, None, rng, clocks, seal=seal).push(range(n))
        return Sweeps(members, CPU_WALL, n, "cpu" if any(m.error is None for m in members) else "failed")
    flush = l2_flusher(device).flush if (cfg.flush_l2 if flush_l2 is None else flush_l2) else None
    sampled = Sampled()
    with nvml.sampling(sampled):
        settle_s, sweep_s = _settle(members, device, cfg, flush, rng, sampled, nvml.available, clocks, seal)
        _lead(members, device, clocks)
        n, stop, _ = _sweep(members, device, cfg, flush, rng, sweep_s, baseline, clocks, seal)
    for m in members:
        m.clock_mhz = sampled.at(m.ran_s)
    out = Sweeps(members, CUDA_EVENTS, n, stop, settle_s)
    if sampled.t_s:
        at_end = [i for i, t in enumerate(sampled.t_s) if t <= sampled.t_s[0] + settle_s]
        if at_end:
            out.settle_mhz, out.settle_w = sampled.sm_mhz[at_end[-1]], sampled.power_w[at_end[-1]]
    return out


def _settle(members, device, cfg: TimingConfig, flush, rng, sampled: Sampled, nvml: bool, clocks: guard.Clocks,
            seal: guard.Seal | None = None) -> tuple[float, float]:
    """Warm-up sweeps until settled (module docstring); returns (seconds, wall seconds per sweep)."""
    perf_counter = clocks.perf_counter
    t0, sweeps = perf_counter(), 0
    chunks = _Chunks(members, device, flush, rng, clocks, keep=False, seal=seal)
    while True:
        chunks.push(range(WARMUP_SWEEP - sweeps, WARMUP_SWEEP - sweeps + 1))
        sweeps += 1
        spent = perf_counter() - t0
        if (spent * 1e3 >= cfg.warmup_ms and chunks.kept >= max(cfg.warmup, 1) and (
                not nvml or spent * 1e3 >= cfg.settle_max_ms or sampled.settled(SETTLE_WINDOW_S, CLOCK_TOL, POWER_TOL))
                or all(m.error is not None for m in members)):
            chunks.drain()
            spent = perf_counter() - t0
            return spent, spent / sweeps


def _lead(members: list[Member], device: torch.device, clocks: guard.Clocks) -> None:
    """Set each member's lead from its warm-up calls' host times (module docstring)."""
    per_ms = spin_cycles_per_ms(device, clocks)
    for m in members:
        m.lead_cycles = int(lead_ms(m.warm_host_ms) * per_ms)


def group_budget_s(cfg: TimingConfig, members: int, sweep_s: float) -> float:
    """A group's sampling budget in wall seconds: ``budget_factor x target_ms`` per member, stretched to the time of
    ``budget_sweeps`` sweeps (``sweep_s`` each, as the warm-up measured them) up to ``budget_cap_s``."""
    per_member = cfg.budget_factor * cfg.target_ms / 1e3 * members
    return max(per_member, min(cfg.budget_sweeps * sweep_s, cfg.budget_cap_s))


def _sweep(members, device, cfg: TimingConfig, flush, rng, sweep_s: float, baseline: str | None,
           clocks: guard.Clocks, seal: guard.Seal | None = None) -> tuple[int, str, dict[str, float]]:
    """Phase 2: chunks of sweeps until resolved, the budget spent or max_sweeps; (sweeps, stop, half-widths). The
    rule reads the sweeps in (one chunk may be in flight); the chunk in flight when it stops is kept too."""
    kind, perf_counter = CUDA_EVENTS, clocks.perf_counter
    per_chunk = int(min(MAX_CHUNK, max(1, CHUNK_S // max(sweep_s, 1e-6))))
    budget_s = group_budget_s(cfg, len(members), sweep_s)
    t0, sent = perf_counter(), 0
    min_sweeps = cfg.reps or cfg.min_sweeps
    max_sweeps = cfg.reps or cfg.max_sweeps
    chunks = _Chunks(members, device, flush, rng, clocks, seal=seal)

    def stop(reason: str) -> tuple[int, str, dict[str, float]]:
        chunks.drain()
        if all(m.error is not None for m in members):
            return sent, "failed", {}
        return sent, reason, half_widths(members, baseline, kind)

    while True:
        todo = min(per_chunk, max_sweeps - sent) if sent >= min_sweeps else min_sweeps - sent
        if todo:
            chunks.push(range(sent, sent + todo))
            sent += todo
        else:
            chunks.drain()
        if all(m.error is not None for m in members):
            return stop("failed")
        if chunks.kept < min_sweeps:
            continue
        widths = half_widths(members, baseline, kind)
        resolved = bool(widths) and all(w <= cfg.precision for w in widths.values())
        if cfg.reps is None and resolved:
            return stop("resolved")
        if sent >= max_sweeps and chunks.kept >= max_sweeps:
            return stop("resolved" if resolved else "max_sweeps")
        if perf_counter() - t0 >= budget_s:
            return stop("budget")
