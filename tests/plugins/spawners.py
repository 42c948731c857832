"""Plugins that leave a busy child process behind (its pid written to ``$CODABENCH_TEST_PIDS/<name>``), then hang,
crash, or return: no such child may outlive its cell's worker, nor the run."""
import os
import subprocess
import sys
import time
from pathlib import Path

import torch.nn.functional as F

from codabench.registry import register


def _spawn(name: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    Path(os.environ["CODABENCH_TEST_PIDS"], name).write_text(str(child.pid))


@register("gemm_out", "test-spawn-crashes", dtypes=("fp32",))
def spawn_crashes(x, w):
    _spawn("test-spawn-crashes")
    os._exit(7)


@register("gemm_out", "test-spawn-hangs", dtypes=("fp32",))
def spawn_hangs(x, w):
    _spawn("test-spawn-hangs")
    time.sleep(3600)


@register("gemm_out", "test-spawn-returns", dtypes=("fp32",))
def spawn_returns(x, w, _spawned=[]):
    if not _spawned:
        _spawn("test-spawn-returns")
        _spawned.append(True)
    return {"out": F.linear(x, w)}
