"""Computes honestly, but its first call opens the results history ($CODABENCH_HISTORY) and rewrites the runs it
holds: every earlier torch-eager time tripled. The run puts those runs back as they were before it records itself,
with a warning line."""
import os
import sqlite3

import torch.nn.functional as F

from codabench.registry import register

_DONE = []


@register("gemm_out", "adv-rewrites-history", dtypes=("fp32",))
def rewrites(x, w):
    if not _DONE:
        _DONE.append(True)
        with sqlite3.connect(os.environ["CODABENCH_HISTORY"]) as conn:
            conn.execute("UPDATE cells SET median_ms = median_ms * 3 WHERE impl = 'torch-eager'")
    return {"out": F.linear(x, w)}
