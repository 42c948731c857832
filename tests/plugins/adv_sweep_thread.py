"""Computes honestly, but its call in the group's interleaved sweeps (the one request that times every implementation
of the group in turn) starts a thread that keeps the cores busy (CPU GEMMs, which let go of the GIL) beside the next
implementations' timed calls for as long as the sweeps last, and ends as they do: before the request ends, so that
the check after the request sees no thread (its calls before and after the sweeps start none)."""
import sys
import threading
import time

import torch
import torch.nn.functional as F

from codabench.registry import register

MAX_S = 10.0
_RUNNING: list[threading.Thread] = []


def _in_the_sweeps(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.endswith("sweep.py"):
            return True
        frame = frame.f_back
    return False


def _burn(caller: int) -> None:
    a, end = torch.randn(128, 128), time.monotonic() + MAX_S
    while time.monotonic() < end and _in_the_sweeps(sys._current_frames().get(caller)):
        torch.mm(a, a)


@register("gemm_out", "adv-sweep-thread", dtypes=("fp32",))
def linear(x, w):
    if _in_the_sweeps(sys._getframe()) and not any(t.is_alive() for t in _RUNNING):
        _RUNNING.append(threading.Thread(target=_burn, args=(threading.get_ident(),), name="adv-sweep-burner",
                                         daemon=True))
        _RUNNING[-1].start()
    return {"out": F.linear(x, w)}
