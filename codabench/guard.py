"""The harness's own references to the clocks and torch functions it relies on, taken before any plugin loads.

A plugin could make itself look fast or correct by replacing them: ``time.perf_counter`` returning less,
``torch.cuda.Event.elapsed_time`` scaled down, ``torch.equal`` always True, ``F.rms_norm`` made cheap so that the
PyTorch baselines slow down. :func:`snapshot` records every callable attribute of the modules and classes in
:data:`GUARDED` (called before the first plugin import); :func:`tampered` lists the ones that now point elsewhere,
and :func:`restore` puts the originals back, so the baselines' times stay true. The worker checks after every phase
of every cell, and discovery after every plugin import: the culprit gets error rows "tampered with ...".
The timing loops additionally bind their clocks at import (:mod:`codabench.timing`), so even a replacement that is
in place during a measurement does not reach them.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

GUARDED: dict[str, Any] = {
    "time": time, "math": math, "statistics": statistics, "torch": torch, "torch.nn.functional": F,
    "torch.linalg": torch.linalg, "torch.autograd": torch.autograd, "torch.cuda": torch.cuda,
    "torch.cuda.Event": torch.cuda.Event, "torch.cuda.Stream": torch.cuda.Stream, "torch.Tensor": torch.Tensor,
}
"""Where the harness's clocks, synchronization, comparisons and reference math live."""

_ORIGINALS: dict[tuple[str, str], Any] = {}


def _callables(owner: Any) -> dict[str, Any]:
    return {name: value for name, value in vars(owner).items() if callable(value) and not name.startswith("__")}


def snapshot() -> None:
    """Record the guarded callables (once per process; later calls keep the first record)."""
    if _ORIGINALS:
        return
    import torch._dynamo  # noqa: F401  (on import it wraps torch.manual_seed: settle that before the record)

    for label, owner in GUARDED.items():
        for name, value in _callables(owner).items():
            _ORIGINALS[(label, name)] = value


def tampered() -> list[str]:
    """``module.name`` of every recorded callable that has been replaced or deleted since :func:`snapshot`."""
    out = []
    for (label, name), original in _ORIGINALS.items():
        if vars(GUARDED[label]).get(name) is not original:
            out.append(f"{label}.{name}")
    return out


def restore() -> list[str]:
    """Put every replaced callable back; returns what had been replaced."""
    bad = tampered()
    for qualified in bad:
        label, name = qualified.rsplit(".", 1)
        setattr(GUARDED[label], name, _ORIGINALS[(label, name)])
    return bad


def tamper_message(names: list[str]) -> str:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"tampered with {shown} (the harness's clocks and torch functions are restored; this cell does not count)"
