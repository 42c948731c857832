"""Makes a thread pool at import and lets its one thread start there, idle in the standard library (the import check
passes: a thread waiting for work runs no code of the plugin's); then each call hands that old thread a busy loop of
its own, which keeps running after the call returns, beside the next implementations' timed calls (until ``STOP`` is
set, or for 60 s at most). With ``QUEUED`` set, the thread is kept busy in a library call first (``time.sleep``), so
that the busy loop waits in the pool's queue when the call returns: work of its own pending, not yet running."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch.nn.functional as F

from codabench.registry import register

STOP = threading.Event()
QUEUED = threading.Event()
POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adv-pool")
POOL.submit(int).result()  # the pool's thread, started at import, now waits in the standard library


def _burn() -> None:
    end = time.monotonic() + 60
    while not STOP.is_set() and time.monotonic() < end:
        sum(range(1000))


@register("gemm_out", "adv-pool-thread", dtypes=("fp32",))
def linear(x, w):
    if QUEUED.is_set():
        POOL.submit(time.sleep, 0.5)
    POOL.submit(_burn)
    return {"out": F.linear(x, w)}
