"""Crashers and honest plugins in turn (by name: test-1-crash, test-2-honest, test-3-crash, test-4-honest): each
honest cell is the first cell of a new worker process."""
import os

import torch.nn.functional as F

from codabench.registry import register


@register("gemm_out", "test-1-crash", dtypes=("fp32",))
def crash_1(x, w):
    os._exit(5)


@register("gemm_out", "test-2-honest", dtypes=("fp32",))
def honest_2(x, w):
    return {"out": F.linear(x, w)}


@register("gemm_out", "test-3-crash", dtypes=("fp32",))
def crash_3(x, w):
    os._exit(6)


@register("gemm_out", "test-4-honest", dtypes=("fp32",))
def honest_4(x, w):
    return {"out": F.linear(x, w)}
