"""Plugin of the resolving-power check (benchmarks/resolving_power.py): one plain GEMM, and the same GEMM followed by
planted GPU work of a known share of its time.

``gemm-ref`` and ``gemm-plant-P`` (P in :data:`PLANTED` percent) compute ``out = x W^T`` with ``torch.mm``; the
planted ones then spin on the GPU (``torch.cuda._sleep``) for P% of the GEMM's time. The planted work is calibrated
by measurement at the first call of each shape (untimed: the correctness pass): the GEMM's median time and the spin
kernel's time per cycle, both with CUDA events, so no clock rate is assumed; the cycles scale with the clock as the
GEMM's time does. ``CALIBRATION`` keeps what was measured. On the CPU (the script's own test) the planted work is a
busy wait of P% of the GEMM's measured wall time.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from codabench.registry import register

PLANTED = (0, 1, 2, 5)
CALIBRATION: dict[tuple, dict[str, float]] = {}
SLEEP_CYCLES = 1_000_000


def _events_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _calibration(x: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    key = (tuple(x.shape), tuple(w.shape), x.dtype, x.device.type)
    if key not in CALIBRATION:
        if x.is_cuda:
            gemm_ms = _events_ms(lambda: F.linear(x, w))
            sleep_ms = _events_ms(lambda: torch.cuda._sleep(SLEEP_CYCLES))
            CALIBRATION[key] = {"gemm_ms": gemm_ms, "ms_per_cycle": sleep_ms / SLEEP_CYCLES}
        else:
            t0 = time.perf_counter()
            F.linear(x, w)
            CALIBRATION[key] = {"gemm_ms": (time.perf_counter() - t0) * 1e3, "ms_per_cycle": 0.0}
    return CALIBRATION[key]


def _planted(pct: int):
    def run(x, w):
        cal = _calibration(x, w)
        out = F.linear(x, w)
        if pct:
            if x.is_cuda:
                torch.cuda._sleep(int(pct / 100 * cal["gemm_ms"] / cal["ms_per_cycle"]))
            else:
                t0 = time.perf_counter()
                while (time.perf_counter() - t0) * 1e3 < pct / 100 * cal["gemm_ms"]:
                    pass
        return {"out": out}

    return run


register("gemm_out", "gemm-ref", dtypes=("bf16", "fp32"))(_planted(0))
for _pct in PLANTED:
    register("gemm_out", f"gemm-plant-{_pct}", dtypes=("bf16", "fp32"))(_planted(_pct))
