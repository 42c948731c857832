"""``torchrun --nproc-per-node N run_bench.py ...``: the ranks split the cells by groups, rank 0 merges one report."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from codabench.results import load_run
from harness_helpers import PLUGINS

ROOT = Path(__file__).resolve().parents[1]


def test_two_ranks_on_the_cpu_split_the_groups_and_rank_0_merges(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "run_bench.py",
           "--ops", "gemm_out,rmsnorm_linear", "--modes", "fwd", "--impls", "torch-eager,test-good",
           "--plugin", str(PLUGINS / "good.py"), "--out", str(out), "--quiet", "--no-entry-points"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks merged into" in proc.stderr
    ranks = [tmp_path / "run-rank1of2", tmp_path / "run-rank2of2"]
    per_rank = [set(load_run(d)[0]["op"]) for d in ranks]
    assert per_rank == [{"gemm_out"}, {"rmsnorm_linear"}]  # whole groups, dealt as --shard 1/2 and 2/2 deal them
    df, _, env_json = load_run(out)
    assert sorted(zip(df["op"], df["impl"])) == [("gemm_out", "test-good"), ("gemm_out", "torch-eager"),
                                                 ("rmsnorm_linear", "torch-eager")]
    assert (df["status"] == "ok").all() and (out / "report.html").exists()
    assert [Path(d).name for d in env_json["merged_from"]] == [d.name for d in ranks]
    assert [json.loads((d / "env.json").read_text())["shard"] for d in ranks] == [[1, 2], [2, 2]]


def test_a_rank_with_an_error_row_waits_for_the_merge_and_the_run_exits_with_rank_0s_code(tmp_path):
    """torchrun stops every rank as soon as one exits non-zero: rank 1's error row must not take rank 0 down before
    it has merged (seen on 2 H100s)."""
    plugin = tmp_path / "raises_on_rank_1.py"
    plugin.write_text("from codabench.registry import register\n\n"
                      "@register('rmsnorm_linear', 'test-raises-rl', dtypes=('fp32',))\n"
                      "def raises(**inputs):\n    raise RuntimeError('boom on rank 1')\n")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "run_bench.py",
           "--ops", "gemm_out,rmsnorm_linear", "--modes", "fwd", "--impls", "torch-eager,test-raises-rl",
           "--plugin", str(plugin), "--out", str(out), "--quiet", "--no-entry-points"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "2 ranks merged into" in proc.stderr
    # rank 0 left with the run's code, not by a signal (torchrun may still stop rank 1, done but not yet gone)
    assert not re.search(r"rank\s*: 0 \(local_rank: 0\)\s*exitcode\s*: -\d+", proc.stderr), proc.stderr[-3000:]
    df, _, _ = load_run(out)
    assert sorted(zip(df["op"], df["impl"], df["status"])) == [("gemm_out", "torch-eager", "ok"),
                                                               ("rmsnorm_linear", "test-raises-rl", "error"),
                                                               ("rmsnorm_linear", "torch-eager", "ok")]


def test_shard_and_torchrun_together_are_refused(tmp_path):
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    proc = subprocess.run([sys.executable, "run_bench.py", "--shard", "1/2", "--out", str(tmp_path / "x")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--shard and torchrun both split the cells" in proc.stderr
