"""The runner on the CPU: cell isolation (faulty plugins), skip rows, resume, shard + merge, --list."""
import json

import pandas as pd
import pytest

import torch

from codabench.ceilings import GemmTimer
from codabench.correctness import nan_filled_allocations
from codabench.matrix import Cell, build_cells, groups, shard
from codabench.discovery import load_plugin_file
from codabench.registry import register
from codabench.report import finalize
from codabench.results import load_run
from codabench.report.merge import merge
from codabench import measure
from codabench.measure import Measurer
from codabench.writer import RunExists
from codabench.timing import TimingConfig
from harness_helpers import PLUGINS, isolated_registry, make_runner
from workloads.models import get_model

TINY = get_model("tiny")


@pytest.fixture
def registry():
    with isolated_registry() as reg:
        yield reg


def rows_by_impl(run_dir):
    df, err, _ = load_run(run_dir)
    return {r["impl"]: r for _, r in df.iterrows()}, err


def test_faulty_plugins_become_error_rows_and_the_run_goes_on(registry, tmp_path):
    load_plugin_file(PLUGINS / "faulty.py")
    load_plugin_file(PLUGINS / "good.py")
    load_plugin_file(PLUGINS / "broken.py")
    impls = ["torch-eager", "test-good", "test-raises", "test-oom", "test-wrong-shape", "test-wrong-dtype", "test-nan",
             "test-mutates", "test-missing", "test-unwritten", "test-inaccurate", "test-unsupported"]
    make_runner(tmp_path, impls=impls).run()
    rows, err = rows_by_impl(tmp_path)
    expect_error = {
        "test-raises": "RuntimeError: boom from the plugin",
        "test-oom": "correctness run: out of memory: OutOfMemoryError: CUDA out of memory.",
        "test-wrong-shape": f"out has shape ({TINY.tokens}, {TINY.hidden - 1}), expected ({TINY.tokens}, {TINY.hidden})",
        "test-wrong-dtype": "out has dtype torch.float64, expected torch.float32",
        "test-nan": "out has 1 NaN and 0 Inf values",
        "test-mutates": "mutated its input(s) x",
        "test-missing": "missing output 'out'",
        "test-unwritten": "NaN",
    }
    for impl, text in expect_error.items():
        assert rows[impl]["status"] == "error", impl
        assert text in rows[impl]["message"], (impl, rows[impl]["message"])
        assert pd.isna(rows[impl]["median_ms"]), impl  # a broken cell is not timed
    for impl in ("torch-eager", "test-good"):
        assert rows[impl]["status"] == "ok" and rows[impl]["correct"] is True, impl
        assert rows[impl]["median_ms"] > 0 and rows[impl]["timing"] == "cpu-wall"
    bad = rows["test-inaccurate"]
    assert bad["status"] == "ok" and bad["correct"] is False and bad["rel_err"] == pytest.approx(0.01, rel=1e-3)
    assert rows["test-unsupported"]["status"] == "skipped"
    assert "codabench_no_such_module" in rows["test-unsupported"]["message"]
    load = rows[str((PLUGINS / "broken.py").resolve())]
    assert load["status"] == "error" and "broken on purpose" in load["message"]
    # per-output error rows, with PyTorch's own error alongside
    e = err[(err["impl"] == "test-inaccurate") & (err["output"] == "out")].iloc[0]
    assert e["passed"] is False and e["torch_rel_err"] < 1e-5 and e["ratio"] > 100


def test_cpu_correctness_calls_get_nan_filled_allocations():
    """On the CPU, unwritten outputs are found by PyTorch's deterministic fill, and the setting is restored."""
    with nan_filled_allocations():
        assert torch.empty(1000).isnan().all()
        assert torch.empty(4, 8, dtype=torch.float16).isnan().all()
        assert torch.empty(3, dtype=torch.int32).eq(torch.iinfo(torch.int32).max).all()
    assert not torch.are_deterministic_algorithms_enabled()


def test_on_the_cpu_the_timed_calls_run_the_graphs_torch_compile_built_in_the_check(registry, tmp_path):
    """Every request runs with NaN-filled allocations on the CPU, the timed calls too: torch.compile's guards include
    the deterministic-algorithms flag that the fill needs, so a check with it on and timed calls with it off compiled
    each graph twice. The setting is the process's own again after the run."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    make_runner(tmp_path, ops=["rmsnorm_linear"], modes=("fwd",), impls=["torch-compile"], isolate=False).run()
    rows, _ = rows_by_impl(tmp_path)
    assert rows["torch-compile"]["status"] == "ok" and rows["torch-compile"]["correct"] is True
    assert counters["stats"]["unique_graphs"] - before == 1
    assert not torch.are_deterministic_algorithms_enabled()


def test_autograd_modes_compare_gradients(registry, tmp_path):
    load_plugin_file(PLUGINS / "faulty.py")
    load_plugin_file(PLUGINS / "good.py")
    make_runner(tmp_path, ops=["rmsnorm_linear"], impls=["test-good-autograd", "test-bad-grad", "test-detached"]).run()
    df, err, _ = load_run(tmp_path)
    get = {(r["impl"], r["mode"]): r for _, r in df.iterrows()}
    for mode in ("fwd", "bwd", "fwd_bwd"):
        assert get[("test-good-autograd", mode)]["correct"] is True, mode
    outputs = set(err[(err["impl"] == "test-good-autograd") & (err["mode"] == "bwd")]["output"])
    assert outputs == {"grad_a", "grad_residual", "grad_w_o", "grad_gamma", "grad_w_c"}  # bwd: gradients only
    outputs = set(err[(err["impl"] == "test-good-autograd") & (err["mode"] == "fwd_bwd")]["output"])
    assert outputs == {"x", "z", "rstd", "grad_a", "grad_residual", "grad_w_o", "grad_gamma", "grad_w_c"}
    bad = err[(err["impl"] == "test-bad-grad") & (err["mode"] == "bwd")].set_index("output")["passed"]
    assert bad["grad_a"] is False and bad["grad_w_o"] is True
    assert get[("test-bad-grad", "bwd")]["status"] == "ok" and get[("test-bad-grad", "bwd")]["correct"] is False
    assert get[("test-bad-grad", "fwd")]["status"] == "n/a"
    det = get[("test-detached", "fwd_bwd")]
    assert det["status"] == "error" and "does not require grad" in det["message"]


def test_resume_after_an_interrupted_run(registry, tmp_path, monkeypatch):
    ops = ["gemm_out", "gemm_down", "rmsnorm_linear"]
    total = len(make_runner(tmp_path, ops=ops).cells)
    calls = []
    original = Measurer.first

    def interrupted(self, cell):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(cell.key)
        return original(self, cell)

    monkeypatch.setattr(Measurer, "first", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_runner(tmp_path, ops=ops, isolate=False).run()
    assert len(load_run(tmp_path)[0]) == 3
    with open(tmp_path / "results.csv", "a") as f:  # a row cut off by the kill
        f.write("gemm_down,torch-eager,ti")
    with pytest.raises(RunExists):
        make_runner(tmp_path, ops=ops).run()

    calls.clear()
    monkeypatch.setattr(Measurer, "first", lambda self, c: (calls.append(c.key), original(self, c))[1])
    make_runner(tmp_path, ops=ops, resume=True, isolate=False).run()
    df, _, env = load_run(tmp_path)
    assert len(calls) == total - 3
    assert len(df) == total and not df.duplicated(["op", "model", "mode", "dtype", "impl"]).any()
    assert (df["status"] == "ok").all()
    assert len(env["earlier_sessions"]) == 1


def test_shards_partition_groups_and_merge(registry, tmp_path):
    ops = ["gemm_out", "gemm_down", "rmsnorm_linear"]
    impls = ["torch-eager", "test-good", "test-flaky"]
    load_plugin_file(PLUGINS / "good.py")
    cells = make_runner(tmp_path / "all", ops=ops, impls=impls).cells
    parts = [shard(cells, i, 2) for i in (1, 2)]
    assert sorted(parts[0] + parts[1], key=str) == sorted(cells, key=str)
    assert not set(parts[0]) & set(parts[1])
    for p in parts:  # whole groups only
        assert {c.group for c in p}.isdisjoint({c.group for c in cells if c not in p})
    with pytest.raises(ValueError):
        shard(cells, 3, 2)
    for i in (1, 2):
        make_runner(tmp_path / f"s{i}", ops=ops, impls=impls, shard=(i, 2)).run()
    merge(tmp_path / "merged", [tmp_path / "s1", tmp_path / "s2"])
    df, err, env = load_run(tmp_path / "merged")
    assert {tuple(r) for r in df[["op", "model", "mode", "dtype", "impl"]].itertuples(index=False)} == \
        {c.key for c in cells}
    assert len(df) == len(cells)
    assert len(env["shards"]) == 2 and env["shards"][0]["shard"] == [1, 2]
    assert env["code_tree"] == env["shards"][0]["code_tree"] == env["shards"][1]["code_tree"] is not None
    assert (tmp_path / "merged" / "report.html").exists()
    html = (tmp_path / "merged" / "report.html").read_text()
    assert "2 shards: " in html and " summed" in html  # the shards' wall times
    with pytest.raises(FileExistsError):
        merge(tmp_path / "merged", [tmp_path / "s1"])


def test_cells_are_grouped_with_baselines_first(registry, tmp_path):
    load_plugin_file(PLUGINS / "good.py")
    runner = make_runner(tmp_path, ops=["gemm_out"], impls=["test-good", "torch-compile", "torch-eager"])
    assert [c.impl for c in runner.cells] == ["torch-eager", "torch-compile", "test-good"]
    assert len(groups(runner.cells)) == 1
    assert all(isinstance(c, Cell) for c in build_cells(runner.cfg.selection, registry))


def test_check_tokens_and_env(registry, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["/somewhere/run_bench.py", "--suite", "smoke"])
    make_runner(tmp_path, ops=["gemm_out"], check_tokens=16).run()  # cells in a worker process
    df, _, env = load_run(tmp_path)
    row = df.iloc[0]
    assert (row["tokens"], row["check_tokens"], row["correct"]) == (TINY.tokens, 16, True)
    assert row[["fp8_recipe", "cast_ms", "rel_err_vs_bf16"]].isna().all()  # fp8 cells only
    assert (df["first_call_s"] > 0).all()  # every timed row has its warm-up figure
    assert env["device"] == "cpu" and env["torch"] and "torch-eager" in env["providers"]
    assert env["command"] == "run_bench.py --suite smoke"  # the run's command, not the worker's ("-c 17")
    assert json.loads((tmp_path / "env.json").read_text())["check_tokens"] == 16
    finalize(tmp_path)


def test_the_code_tree_names_the_code_on_disk_even_under_a_stale_head(tmp_path):
    """env.json's code_tree: the git tree of the files on disk (tracked or not, never ignored ones), equal to the
    tree of the commit that holds them; a copy whose .git is older (a GPU node's) still names the newer commit."""
    import shutil
    import subprocess

    from codabench.env import code_tree

    def git(*args, cwd=tmp_path / "repo"):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                              capture_output=True, text=True).stdout.strip()

    repo = tmp_path / "repo"
    repo.mkdir()
    git("init", "-q")
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    stale = tmp_path / "node"
    shutil.copytree(repo, stale)  # the node's copy: its .git stops at "one"
    assert code_tree(repo) == git("rev-parse", "HEAD^{tree}")
    (repo / "a.py").write_text("x = 2\n")
    (repo / "b.py").write_text("y = 1\n")  # new, not yet added
    (repo / "run.log").write_text("ignored\n")
    on_disk = code_tree(repo)
    assert on_disk != git("rev-parse", "HEAD^{tree}") and git("status", "--porcelain") != ""
    git("add", "-A")
    git("commit", "-qm", "two")
    assert on_disk == git("rev-parse", "HEAD^{tree}")  # the commit that holds these files
    for f in ("a.py", "b.py", "run.log"):
        shutil.copy(repo / f, stale / f)
    assert code_tree(stale) == on_disk and git("rev-parse", "HEAD", cwd=stale) != git("rev-parse", "HEAD")
    assert code_tree(tmp_path / "repo" / ".git" / "..") == on_disk and code_tree(tmp_path / "nogit") is None


def test_a_group_whose_sweeps_fail_falls_back_to_rounds_of_blocks(registry, tmp_path, monkeypatch):
    """The blocks fallback: every round times each cell of the group in turn, then the group's speed-of-light GEMMs;
    a cell's samples are pooled over the rounds (and kept per round); a cell that fails in a later round becomes an
    error row; the rows say why the group was not interleaved."""
    load_plugin_file(PLUGINS / "good.py")
    register("gemm_out", "test-flaky", dtypes=("fp32",))(lambda x, w: {"out": torch.nn.functional.linear(x, w)})
    order = []
    again, gemm_samples = Measurer.again, GemmTimer.samples

    def logged_again(self, cell, own_errors):
        order.append(cell.impl)
        if cell.impl == "test-flaky" and order.count(cell.impl) == 2:
            raise RuntimeError("flaky device")
        return again(self, cell, own_errors)

    def no_sweeps(self, cells, own_errors):
        raise RuntimeError("sweeps broke")

    monkeypatch.setattr(Measurer, "again", logged_again)
    monkeypatch.setattr(Measurer, "sample", no_sweeps)
    monkeypatch.setattr(GemmTimer, "samples", lambda self, g, dtype, cfg=None: (order.append("gemm"),
                                                                                gemm_samples(self, g, dtype, cfg))[1])
    runner = make_runner(tmp_path, modes=("fwd",), impls=["torch-eager", "test-good", "test-flaky"],
                         timing=TimingConfig(rounds=3, cpu_reps=2), isolate=False)
    impls = [c.impl for c in runner.cells]
    runner.run()
    assert order == [*impls, "gemm", *impls, "gemm", *[i for i in impls if i != "test-flaky"], "gemm"]
    rows, _ = rows_by_impl(tmp_path)
    for impl in ("torch-eager", "test-good"):
        row = rows[impl]
        assert row["status"] == "ok" and row["n_samples"] == 6 and row["sol_ms"] > 0
        assert row["grain"] == "round" and "sweeps broke" in row["message"] and "blocks" in row["message"]
    assert rows["test-good"]["sol_ratio"] == pytest.approx(rows["test-good"]["median_ms"] / rows["test-good"]["sol_ms"])
    bad = rows["test-flaky"]
    assert bad["status"] == "error" and "round 2" in bad["message"] and "flaky device" in bad["message"]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted(len(s["samples_ms"]) for s in samples) == [6, 6]
    assert all(s["grain"] == "round" and s["sweeps"] == [0, 0, 1, 1, 2, 2] for s in samples)
    assert all([len(r) for r in s["rounds"]] == [2, 2, 2] and sum(s["rounds"], []) == s["samples_ms"] for s in samples)


def test_a_reference_out_of_memory_points_to_check_tokens():
    """A float64 reference that does not fit the GPU (a real vocabulary's logits at the timed tokens) fails the
    group's cells with a message that names the way out: a correctness pass at fewer tokens."""
    def make_case():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.56 GiB.")

    group = measure._Group(make_case)
    for _ in range(2):  # built once: the second cell gets the same error
        with pytest.raises(RuntimeError, match=r"out of memory: .*--check-tokens N runs the correctness pass"):
            group.reference()
