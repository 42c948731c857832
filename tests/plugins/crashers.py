"""Plugins whose calls hang, exit or crash the process: each must cost one error row, never the run."""
import ctypes
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from codabench.registry import register


@register("gemm_out", "test-hangs", dtypes=("fp32",))
def hangs(x, w):
    time.sleep(3600)


@register("gemm_out", "test-sys-exit", dtypes=("fp32",))
def sys_exit(x, w):
    sys.exit(3)


@register("gemm_out", "test-os-exit", dtypes=("fp32",))
def os_exit(x, w):
    os._exit(1)


@register("gemm_out", "test-segfault", dtypes=("fp32",))
def segfault(x, w):
    ctypes.string_at(0)


@register("gemm_out", "test-keyboard-interrupt", dtypes=("fp32",))
def keyboard_interrupt(x, w):
    raise KeyboardInterrupt("from the plugin")


class _Unprintable(RuntimeError):
    def __str__(self):
        raise ValueError("no text")


@register("gemm_out", "test-unprintable-error", dtypes=("fp32",))
def unprintable_error(x, w):
    raise _Unprintable()


@register("gemm_out", "test-exits-later", dtypes=("fp32",))
def exits_later(x, w, _calls=[0]):
    """Correct on its first calls (the correctness pass), exits during the timing."""
    _calls[0] += 1
    if _calls[0] > 2:
        os._exit(4)
    return {"out": F.linear(x, w)}


@triton.jit
def _poke(ptr, offset):
    tl.store(ptr + offset, 1.0)


@register("gemm_out", "test-illegal-address", dtypes=("bf16",), requires=("cuda",))
def illegal_address(x, w):
    """GPU: a store far outside any allocation; the CUDA context is lost (an illegal memory access)."""
    _poke[(1,)](torch.empty(1, device=x.device, dtype=torch.float32), 1 << 40)
    torch.cuda.synchronize(x.device)
    return {"out": F.linear(x, w)}
