"""Where a call's time goes: what it runs, under torch.profiler (:func:`profile_call`; ``--profile`` of a run).

On a GPU (CUDA and CPU activity): each GPU activity the call started (kernels, memory copies and sets) by readable
name (:func:`readable`), with its launches per call, its time per call and its share of the call's kernel time (the
sum of all its activities' times); the call's host time (from its start to its return on the host, as the profiler's
CPU side records it: the Python and launch work, and any wait for the GPU inside the call) against its GPU busy time
(the union of its activities' intervals: kernels that overlap on two streams count once); the part of the kernel
time in GEMM kernels (by name, :data:`GEMM`); and the host synchronizations of one call (file:line each, from torch's
CUDA sync debug mode: each lets the GPU run dry while the host catches up, which a median pays and a kernel sum does
not). A call whose host time exceeds its GPU busy time is bound by its launches.

On the CPU there is no GPU activity: the entries are the call's top-level operators, their inclusive times on the host
(``activity`` is ``cpu-ops``, and ``gpu_ms`` and ``gemm_ms`` are None: nothing here is a GPU time). What the host spent
outside any operator (Python, the Triton interpreter's kernels) is the host time less their sum.

Protocol: before each profiled call its untimed setup runs (fresh leaves; a backward cell's forward), then, on the
GPU, the L2 flush of the timing (:func:`codabench.timing.l2_flusher`) and a synchronization, all outside the
profiler; each call is profiled in a session of its own and synchronized before the session ends. One call under
the profiler is discarded first (it warms the call's caches and the profiler's own), then ``calls`` calls are
profiled; every figure is a mean per call. The Chrome trace, on request, is the last profiled call's session.
Nothing here runs inside a timed region: a run profiles a group's cells after its samples (:mod:`codabench.runner`).

Triton's own profiler, proton, is not used: torch.profiler's CUDA activity (CUPTI) names and times every Triton
kernel like any other, beside the PyTorch operators and library kernels of the baselines; proton would be a second
session with its own output format, and what it adds (metrics inside a kernel) is beyond a per-call breakdown.
Event times are read from each event's interval (``time_range``), which every torch version has, rather than from
the aggregate attributes that were renamed (``self_cuda_time_total``, now ``self_device_time_total``).
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function
from torch.profiler import profile as torch_profile

from codabench.execute import Timed
from codabench.timing import l2_flusher

TOP = 15
"""Kernels (or operators) kept by name, by time; the rest are summed into one entry named :data:`OTHER`."""
OTHER = "other"
MARKER = "codabench::call"
"""The profiler range around the profiled call (its host time)."""
MAX_NAME = 160
"""Longer readable names are cut (after the breakdown by full name)."""
GEMM = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|matmul|triton_tem_|dgrad_|scaled_linear|ws_producer", re.IGNORECASE)
"""GPU kernel names that carry a GEMM: the vendor libraries', torch.compile's GEMM templates and CODA's mainloop
kernels (fused epilogues included)."""
TRITON_SUFFIX = re.compile(r"_(?=[0-9dce]*[dce])(?:\d+[dce]*)+$")
"""The argument specialization older Triton versions append to a kernel's name (``_0d1d2de3c``); an index of
torch.compile's (``triton_poi_fused_add_0``) has no letters and stays."""
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "
GPU_KERNELS, CPU_OPS = "gpu-kernels", "cpu-ops"


@dataclass
class Kernel:
    """One kernel name's (or, on the CPU, operator's) part of a call, per call."""

    name: str
    launches: float
    ms: float
    share: float
    """Of the call's kernel time (``Profile.kernel_ms``)."""


@dataclass
class Profile:
    """Where one call's time goes (module docstring); every time in ms per call, a mean over ``calls`` calls."""

    activity: str
    """``gpu-kernels``, or ``cpu-ops`` (no GPU: the entries are host operators, their times host times)."""
    calls: int
    host_ms: float
    """The call's wall time on the host, from its start to its return."""
    gpu_ms: float | None
    """GPU busy time: the union of the call's GPU activity intervals (None on the CPU)."""
    kernel_ms: float
    """Summed time of every entry, those folded into ``other`` included: the denominator of the shares."""
    gemm_ms: float | None
    """The part of ``kernel_ms`` in GEMM kernels (:data:`GEMM`; None on the CPU)."""
    kernels: list[Kernel]
    """The :data:`TOP` entries by time, then ``other`` (the rest summed) where there is a rest."""
    syncs: list[str] | None = None
    """Where one call synchronized the host with the GPU, file:line each (None on the CPU)."""
    note: str = ""
    """What went wrong on the way (the trace's export), or how the figures were taken."""

    def add_note(self, note: str) -> None:
        self.note = "; ".join(n for n in (self.note, note) if n)

    def record(self) -> dict[str, Any]:
        """The profile as a profiles.jsonl record's fields (times to 0.1 us, shares to 0.01%)."""
        out = asdict(self)
        for k in ("host_ms", "gpu_ms", "kernel_ms", "gemm_ms"):
            out[k] = _round(out[k], 4)
        for k in out["kernels"]:
            k.update(launches=_round(k["launches"], 3), ms=_round(k["ms"], 4), share=_round(k["share"], 4))
        return out


def _round(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


def readable(name: str) -> str:
    """A kernel's name for people: no ``void`` and no argument list on a C++ signature, no Triton specialization
    suffix (:data:`TRITON_SUFFIX`), no autograd engine prefix on a backward node's operator."""
    name = name.strip().removeprefix(AUTOGRAD_PREFIX)
    if name.startswith("void ") and name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[5:i]
                break
    return TRITON_SUFFIX.sub("", name)


def profile_call(call: Timed, device: torch.device, calls: int = 3, flush_l2: bool = True,
                 trace: Path | None = None, top: int = TOP) -> Profile:
    """Profile ``call`` (a cell's timed call: its ``setup``, ``fn`` and ``context``) as the module docstring says;
    ``trace``: write the last profiled call's Chrome trace there (a failure to is the profile's note). Raises where
    the call or the profiler fails."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # kineto's start/stop lines on stderr, for every session
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    flusher = l2_flusher(device) if on_gpu and flush_l2 else None
    per_call, last = [], None
    with call.context:
        for i in range(calls + 1):
            state = call.setup() if call.setup is not None else None
            if flusher is not None:
                flusher.flush()
            if on_gpu:
                torch.cuda.synchronize(device)
            with torch_profile(activities=activities) as prof:
                with record_function(MARKER):
                    call.fn(state)
                if on_gpu:
                    torch.cuda.synchronize(device)
            del state
            if i:  # the first session is the warm-up
                per_call.append(_one_call(prof.events(), on_gpu))
                last = prof
        syncs = host_syncs(call, device) if on_gpu else None
    profile = _summary(per_call, on_gpu, top)
    profile.syncs = syncs
    if trace is not None:
        try:
            last.export_chrome_trace(str(trace))
        except Exception as e:
            profile.add_note(f"no trace: {type(e).__name__}: {e}".splitlines()[0])
    return profile


def host_syncs(call: Timed, device: torch.device) -> list[str]:
    """file:line of each host synchronization in one call (torch's CUDA sync debug mode warns at each; autograd's
    backward thread included)."""
    state = call.setup() if call.setup is not None else None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call.fn(state)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@dataclass
class _Call:
    """One profiled call: host time, GPU busy time (us) and per full readable name [us, launches]."""

    host_us: float
    busy_us: float | None
    entries: dict[str, list[float]]


def _us(event) -> float:
    return float(event.time_range.end - event.time_range.start)


def _one_call(events, on_gpu: bool) -> _Call:
    marker = next(e for e in events if e.name == MARKER and e.device_type == DeviceType.CPU)
    if on_gpu:
        chosen = [e for e in events if e.device_type == DeviceType.CUDA and e.name != MARKER
                  and not getattr(e, "is_user_annotation", False)]  # a range's GPU shadow is no kernel
    else:
        chosen = [e for e in events if e.cpu_parent is marker]
    entries: dict[str, list[float]] = {}
    for e in chosen:
        entry = entries.setdefault(readable(e.name), [0.0, 0.0])
        entry[0] += _us(e)
        entry[1] += 1
    busy = _union_us([(e.time_range.start, e.time_range.end) for e in chosen]) if on_gpu else None
    return _Call(_us(marker), busy, entries)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _summary(per_call: list[_Call], on_gpu: bool, top: int) -> Profile:
    n = len(per_call)
    summed: dict[str, list[float]] = {}
    for c in per_call:
        for name, (us, launches) in c.entries.items():
            entry = summed.setdefault(name, [0.0, 0.0])
            entry[0] += us
            entry[1] += launches
    total_ms = sum(us for us, _ in summed.values()) / n / 1e3
    ranked = sorted(summed.items(), key=lambda kv: -kv[1][0])

    def kernel(name: str, us: float, launches: float) -> Kernel:
        ms = us / n / 1e3
        return Kernel(name[:MAX_NAME], launches / n, ms, ms / total_ms if total_ms > 0 else 0.0)

    kernels = [kernel(name, us, k) for name, (us, k) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        kernels.append(kernel(OTHER, sum(us for _, (us, _) in rest), sum(k for _, (_, k) in rest)))
    gemm = sum(us for name, (us, _) in summed.items() if GEMM.search(name)) / n / 1e3 if on_gpu else None
    return Profile(GPU_KERNELS if on_gpu else CPU_OPS, n, sum(c.host_us for c in per_call) / n / 1e3,
                   sum(c.busy_us for c in per_call) / n / 1e3 if on_gpu else None, total_ms, gemm, kernels)
