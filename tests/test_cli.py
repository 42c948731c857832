"""The command line: device bootstrap, --list, a small run end to end, merge/compare/report commands."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from codabench.cli import GPU_ROUNDS, main, run_config, run_parser
from codabench.matrix import Selection
from workloads.suites import get_suite
from harness_helpers import PLUGINS, isolated_registry

ROOT = Path(__file__).resolve().parents[1]


def test_bootstrap_sets_the_interpreter_only_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os, sys; from codabench.bootstrap import select_device; d = select_device(); "
            "print(d, os.environ.get('TRITON_INTERPRET'), 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    expected = ["cuda", "None"] if torch.cuda.is_available() else ["cpu", "1"]
    assert out == expected + ["False"]


def test_list_prints_cells_and_statuses(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-below")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    with isolated_registry():
        assert main(["--suite", "smoke", "--ops", "gemm_out,rmsnorm_linear", "--plugin", str(PLUGINS / "broken.py"),
                     "--list", "--no-entry-points", "--out", str(tmp_path / "runs" / "x")]) == 0
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "runs" / ".cache" / "torchinductor")
    out = capsys.readouterr().out
    assert "gemm_out         tiny       fwd      fp32    torch-eager        to run" in out
    assert "skipped: the smoke suite runs torch-compile only in fwd_bwd mode" in out
    assert "broken.py failed to load" in out
    n_cells = sum(1 for line in out.splitlines() if line.startswith(("gemm_out ", "rmsnorm_linear ")))
    assert re.fullmatch(rf"{n_cells} cells: .*\d+ to run.*", out.strip().splitlines()[-1])


def test_small_run_end_to_end_then_report_and_compare(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind")))
    out = tmp_path / "run"
    with isolated_registry():
        code = main(["--ops", "gemm_out", "--impls", "torch-eager,torch-compile,test-good", "--out", str(out),
                     "--plugin", str(PLUGINS / "good.py"), "--reps", "2", "--quiet", "--no-entry-points"])
    assert code == 0
    printed = capsys.readouterr()
    assert "Triton interpreter" in printed.err or torch.cuda.is_available()
    df = pd.read_csv(out / "results.csv")
    assert list(df["impl"]) == ["torch-eager", "torch-compile", "test-good"]
    assert (df["status"] == "ok").all() and df["correct"].all() and (df["n_samples"] == 2).all()
    assert (out / "report.html").exists()
    assert main(["report", str(out)]) == 0
    assert main(["compare", str(out), str(out), "--csv", str(tmp_path / "cmp.csv")]) == 0
    assert "3 cells, 3 timed in both; B vs A: 0 faster, 0 slower, 0 same, 3 unknown" in capsys.readouterr().out
    assert main(["merge", str(tmp_path / "m"), str(out)]) == 0
    assert len(pd.read_csv(tmp_path / "m" / "results.csv")) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without a GPU")
def test_gpu_suites_refuse_to_run_on_the_cpu(tmp_path, capsys):
    with isolated_registry():
        assert main(["--suite", "quick", "--out", str(tmp_path / "q"), "--no-entry-points"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_suites_sampling_defaults_give_way_to_flags(tmp_path):
    """The full suite checks at 2048 tokens and takes 20 samples per cell unless flags say otherwise;
    the other suites check at the timing shape and sample adaptively."""
    def cfg(*flags):
        args = run_parser().parse_args(list(flags))
        suite = get_suite(args.suite)
        return run_config(args, suite, Selection.from_suite(suite), torch.device("cuda"), tmp_path)
    full, quick = cfg("--suite", "full"), cfg("--suite", "quick")
    assert (full.check_tokens, full.timing.reps, full.timing.rounds) == (2048, 20, GPU_ROUNDS)
    assert (quick.check_tokens, quick.timing.reps) == (None, None)
    custom = cfg("--suite", "full", "--check-tokens", "512", "--reps", "7", "--rounds", "1")
    assert (custom.check_tokens, custom.timing.reps, custom.timing.rounds) == (512, 7, 1)
