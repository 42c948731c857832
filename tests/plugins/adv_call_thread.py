"""Computes honestly, but its first call in each process starts a thread that keeps running its own code after the
call returns: a busy loop beside every later timed call, which would slow the other implementations (until ``STOP``
is set, or for 60 s at most)."""
import threading
import time

import torch.nn.functional as F

from codabench.registry import register

STOP = threading.Event()
_STARTED: list[threading.Thread] = []


def _burn() -> None:
    end = time.monotonic() + 60
    while not STOP.is_set() and time.monotonic() < end:
        sum(range(1000))


@register("gemm_out", "adv-call-thread", dtypes=("fp32",))
def linear(x, w):
    if not _STARTED:
        _STARTED.append(threading.Thread(target=_burn, name="adv-call-burner", daemon=True))
        _STARTED[0].start()
    return {"out": F.linear(x, w)}
