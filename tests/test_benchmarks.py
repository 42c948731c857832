"""The GPU-only benchmark experiments still build: benchmarks/gluon_ws_producer.py (Gluon has no interpreter)
compiles for sm_90 here, without a GPU, and fits Hopper's shared memory."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
HOPPER_SMEM = 232448
"""Bytes of shared memory one CTA may use on an H100/H200 (227 KB)."""


def test_gluon_ws_producer_compiles_for_hopper(tmp_path):
    # A process of its own: this one runs Triton's interpreter, whose jit functions (gl.sum's among them) Gluon
    # cannot compile; and an empty cache, so that the kernel is compiled rather than read back.
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(BENCHMARKS / "gluon_ws_producer.py"), "--compile-only"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    shared = dict(re.findall(r"^(producer=\S+ h_from_x16=\S+): compiled for sm_90, (\d+) B", out.stdout, re.M))
    assert set(shared) == {"producer=False h_from_x16=True", "producer=True h_from_x16=True",
                           "producer=True h_from_x16=False"}, out.stdout
    spec = importlib.util.spec_from_file_location("gluon_ws_producer", BENCHMARKS / "gluon_ws_producer.py")
    g = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(g)
    buffers = g.STAGES * (g.BM + g.BN) * g.BK * 2 + g.BM * g.BN * 2  # operand ring and the epilogue's io tile
    for variant, smem in shared.items():
        assert buffers <= int(smem) <= HOPPER_SMEM, (variant, smem)
