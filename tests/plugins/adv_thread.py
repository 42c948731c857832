"""Starts a thread at import that keeps running its own code: a busy loop beside every timed call, which slows the
other implementations (until ``STOP`` is set, or for 60 s at most)."""
import threading
import time

import torch.nn.functional as F

from codabench.registry import register

STOP = threading.Event()


def _burn() -> None:
    end = time.monotonic() + 60
    while not STOP.is_set() and time.monotonic() < end:
        sum(range(1000))


threading.Thread(target=_burn, name="adv-burner", daemon=True).start()


@register("gemm_out", "adv-thread", dtypes=("fp32",))
def linear(x, w):
    return {"out": F.linear(x, w)}
