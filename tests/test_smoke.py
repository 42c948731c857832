"""The README's first command on this machine: ``python run_bench.py`` runs the smoke suite end to end.

Without a GPU it must pick the CPU and the Triton interpreter by itself and produce a complete report
with correctness filled for every implementation that can run here. On a 2-core machine with cold
torch.compile caches it took 436 s (2026-11-27, before the LoRA variants left it), most of it the interpreted
CODA kernels (their correctness passes and the checks of each timed call) and torch.compile's first graphs;
the timeout below only stops a hang.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from codabench.results import load_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default suite on a GPU machine is the quick suite")
@pytest.mark.slow
@pytest.mark.long
def test_default_command_runs_the_smoke_suite_on_the_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TORCHINDUCTOR_CACHE_DIR")}
    out = tmp_path / "reports" / "smoke"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "run_bench.py", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    elapsed = time.monotonic() - t0
    print(f"smoke suite: {elapsed:.0f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Triton interpreter" in proc.stderr
    # a quiet console: no backend-discovery warnings of Liger, no CUDA-runtime warning of torch on the CPU, no numpy
    # overflow warning of the interpreter (the example's GELU sigmoid at large |x|)
    assert "could not be imported" not in proc.stderr and "No CUDA runtime" not in proc.stderr, proc.stderr[:3000]
    assert "overflow encountered" not in proc.stderr, proc.stderr[:3000]
    df, _, _ = load_run(out)  # note: plain pd.read_csv would read the status "n/a" as NaN
    assert (out / "report.html").stat().st_size > 10_000 and (out / "errors.csv").exists()
    errors = df[df["status"] == "error"]
    assert errors.empty, errors[["op", "impl", "mode", "message"]].to_string()
    assert set(df["status"]) <= {"ok", "n/a", "skipped"}
    ok = df[df["status"] == "ok"]
    assert ok["correct"].map(lambda v: isinstance(v, bool)).all() and ok["rel_err"].notna().all()
    assert (ok["timing"] == "cpu-wall").all()
    eager = ok[ok["impl"] == "torch-eager"]
    ops = set(df["op"])
    assert set(eager["op"]) == ops and (eager["correct"] == True).all()  # noqa: E712  # every op, every mode, checked against fp64
    assert set(ok[ok["impl"] == "torch-compile"]["op"]) == ops
    assert (out.parent / ".cache" / "torchinductor").is_dir()
