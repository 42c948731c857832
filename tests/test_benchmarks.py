"""The GPU-only benchmark experiments still build: benchmarks/gluon_ws_producer.py (Gluon has no interpreter)
compiles for sm_90 here, without a GPU, and fits Hopper's shared memory; so do fused CODA kernels launched through
their host wrappers (benchmarks/compare_ptx.py)."""
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


def test_fused_kernels_compile_for_hopper_through_the_launch_helper():
    """benchmarks/compare_ptx.py --compile-only: the guide's example and the fp8 producer, launched by their host
    wrappers through FusedGemm (arguments caught at the autotuner), compile for sm_90 and fit its shared memory."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # the script compiles in a process of its own, empty cache
    out = subprocess.run([sys.executable, str(BENCHMARKS / "compare_ptx.py"), "--compile-only",
                          "--cases", "example-bf16,producer-fp8"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^(\S+) +(\S+) +regs +(\d+) stack (\d+) local (\d+) shared +(\d+) B", out.stdout, re.M)
    assert [r[:2] for r in rows] == [("example-bf16", "gemm_bias_gelu_kernel"),
                                     ("producer-fp8", "gemm_residual_norm_kernel")], out.stdout
    for case, _, regs, stack, local, shared in rows:
        assert 0 < int(regs) <= 255 and int(stack) == int(local) == 0, (case, regs, stack, local)
        assert 0 < int(shared) <= HOPPER_SMEM, (case, shared)
