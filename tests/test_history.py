"""The results history: runs appended to a SQLite store (once each), listed, a cell's trend, regressions against the
previous run on the same GPU by compare's relative rule (exit codes for CI), a store that cannot be written costing a
warning and never the run, and the export to the PyTorch OSS benchmark format."""
import json
import sqlite3

import numpy as np
import pytest

from codabench import history
from codabench import results as tables
from codabench.cli import main
from codabench.stats import read_timed, speed_figures, timing_settings
from harness_helpers import PLUGINS, isolated_registry
from synthetic_runs import write_run

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


@pytest.fixture
def store(tmp_path, monkeypatch):
    path = tmp_path / "store" / "history.sqlite"
    monkeypatch.setenv(history.ENV_VAR, str(path))
    return path


def make_run(run_dir, gpu=H100, when="2026-11-27T10:00:00+00:00", sha="a" * 40, coda=1.0, clock=1.0, groups=8,
             seed=0, rows=None, sweeps=100):
    """A finished run of ``groups`` gemm_out groups (torch-compile and coda-triton sampled in sweeps, the clock
    drifting 25% across each group, 1% noise) with its speed figures as a report computes them: every time x
    ``clock`` (a whole run on another clock), coda-triton's also x ``coda`` (a real change)."""
    rng = np.random.default_rng(seed)
    cells = {}
    for g in range(groups):
        level = clock * np.linspace(1.0, 1.25, sweeps) * np.exp(rng.normal(0, 0.01, sweeps))
        for impl, base in (("torch-compile", 2.0), ("coda-triton", 1.9 * coda)):
            times = base * level * np.exp(rng.normal(0, 0.01, sweeps))
            cells[("gemm_out", f"m{g}", "fwd", "bf16", impl)] = [[float(t)] for t in times]
    env = {"timestamp": when, "git_sha": sha, "code_tree": "c" * 40, "suite": "quick", "torch": "2.11.0",
           "triton": "3.6.0", "cuda": "13.0", "command": "run_bench.py --suite quick",
           "gpu": {"name": gpu, "memory_gib": 79.2}, "timing": {"same_within": 0.02}}
    write_run(run_dir, cells, rows=rows, env=env, sweeps=True)
    df, _, env = tables.load_run(run_dir)
    df = speed_figures(df, read_timed(run_dir, env), timing_settings(env)[1])
    tables.write_csv(run_dir / tables.RESULTS, tables.records(df), tables.RESULT_COLUMNS)
    return run_dir


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_run_is_appended_once_however_often_it_is_added(tmp_path, store, capsys):
    run = make_run(tmp_path / "a", rows={("gemm_out", "m0", "fwd", "bf16", "coda-triton"):
                                         {"status": "error", "message": "boom", "median_ms": None}})
    assert not store.exists()
    assert history.record_run(run)
    assert main(["history", "add", str(run), str(run)]) == 0
    assert main(["history", "add", str(tmp_path / "a" / ".." / "a")]) == 0  # the same folder by another path
    out = capsys.readouterr().out
    assert out.count("(was there: replaced)") == 3
    with sqlite3.connect(store) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
        assert conn.execute("SELECT count(*) FROM cells").fetchone()[0] == 16
        assert conn.execute("PRAGMA user_version").fetchone()[0] == history.SCHEMA
        row = conn.execute("SELECT id, gpu, suite, git_sha, code_tree, torch, triton, command, same_within "
                           "FROM runs").fetchone()
        cell = conn.execute("SELECT status, message, median_ms, speedup, speedup_lo, speedup_hi, verdict FROM cells "
                            "WHERE model = 'm1' AND impl = 'coda-triton'").fetchone()
        failed = conn.execute("SELECT status, message, median_ms FROM cells WHERE model = 'm0' AND "
                              "impl = 'coda-triton'").fetchone()
    assert row == (f"{run.resolve()}@2026-11-27T10:00:00+00:00", H100, "quick", "a" * 40, "c" * 40, "2.11.0",
                   "3.6.0", "run_bench.py --suite quick", 0.02)
    df, _, _ = tables.load_run(run)
    want = df[(df["model"] == "m1") & (df["impl"] == "coda-triton")].iloc[0]
    assert cell[0] == "ok" and cell[2] == pytest.approx(want["median_ms"]) and cell[6] == want["verdict"]
    assert cell[4] <= cell[3] <= cell[5] and cell[3] == pytest.approx(want["speedup"])
    assert failed == ("error", "boom", None)


def test_a_resumed_run_keeps_its_first_start_and_replaces_its_entry(tmp_path, store):
    run = make_run(tmp_path / "a")
    history.add_run(run)
    env = tables.read_env(run)
    tables.write_json(run / tables.ENV, {**env, "timestamp": "2026-11-27T12:00:00+00:00", "earlier_sessions": [env]})
    _, _, replaced = history.add_run(run)
    assert replaced
    with history.open_store() as conn:
        assert [r["started_at"] for r in history.runs(conn)] == ["2026-11-27T10:00:00+00:00"]


def test_the_list_is_newest_first_with_gpu_suite_commit_and_cell_counts(tmp_path, store, capsys):
    assert main(["history"]) == 0
    assert "no runs yet" in capsys.readouterr().out
    make_run(tmp_path / "old", when="2026-11-20T08:00:00+00:00", sha="1" * 40)
    make_run(tmp_path / "new", gpu=H200, when="2026-11-27T09:30:00+00:00", sha="2" * 39 + "f-dirty",
             rows={("gemm_out", "m0", "fwd", "bf16", "coda-triton"): {"status": "error", "message": "boom"}})
    assert main(["history", "add", str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    capsys.readouterr()
    assert main(["history"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:4] == ["2026-11-27", "09:30", "NVIDIA", "H200"]
    assert "2222222222-dirty" in lines[1] and lines[1].split()[-4:-1] == ["16", "15", "1"]
    assert lines[2].startswith("2026-11-20 08:00 " + H100) and "1111111111 " in lines[2]
    assert lines[2].split()[-4:-1] == ["16", "16", "0"] and lines[2].endswith(str((tmp_path / "old").resolve()))
    assert lines[-1] == f"2 runs in {store}"
    assert main(["history", "--gpu", H200]) == 0
    assert "2026-11-20" not in capsys.readouterr().out


def test_the_trend_of_a_cell_per_run_on_each_gpu_with_a_plot(tmp_path, store, capsys):
    for i, (gpu, coda) in enumerate(((H100, 1.0), (H100, 0.9), (H200, 1.0))):
        history.add_run(make_run(tmp_path / f"r{i}", gpu=gpu, when=f"2026-11-2{i + 1}T10:00:00+00:00", coda=coda,
                                 seed=i))
    plot = tmp_path / "trend.png"
    assert main(["history", "trend", "--op", "gemm_out", "--impl", "coda-triton", "--model", "m3", "--mode", "fwd",
                 "--dtype", "bf16", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{H100}: gemm_out m3 fwd bf16 coda-triton"
    assert [line.split()[0] for line in out[2:4]] == ["2026-11-21", "2026-11-22"]
    assert out[4] == f"{H200}: gemm_out m3 fwd bf16 coda-triton"
    medians = [float(line.split()[4]) for line in out[2:4]]
    assert medians[1] == pytest.approx(0.9 * medians[0], rel=0.05)  # the faster coda of the second run
    speed = [float(line.split()[7]) for line in out[2:4]]
    assert speed[0] == pytest.approx(2 / 1.9, rel=0.02) and speed[1] == pytest.approx(2 / 1.71, rel=0.02)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    assert out[-1] == f"codabench: plot {plot}"
    assert main(["history", "trend", "--op", "gemm_out", "--impl", "coda-triton"]) == 0  # every model: 8 per GPU
    assert sum(line.startswith((H100, H200)) for line in capsys.readouterr().out.splitlines()) == 16


def test_a_slower_cell_is_a_regression_with_exit_code_1(tmp_path, store, capsys):
    history.add_run(make_run(tmp_path / "a", when="2026-11-26T10:00:00+00:00"))
    history.add_run(make_run(tmp_path / "b", when="2026-11-27T10:00:00+00:00", coda=1.05, seed=1))
    assert main(["history", "--regressions"]) == 1
    out = capsys.readouterr().out
    assert "16 cells; relative to each run's torch-compile: 0 faster, 8 slower, 0 same, 0 unresolved, 8 unknown" in out
    slower = [line.split() for line in out.splitlines() if line.startswith("  slower")]
    assert sorted(s[2] for s in slower) == [f"m{g}" for g in range(8)] and all(s[5] == "coda-triton" for s in slower)
    assert all(4.0 < float(s[10].rstrip("%")) < 6.0 for s in slower)  # +5%
    assert out.splitlines()[-1] == "codabench: 8 cells regressed (exit code 1)"


def test_identical_code_and_a_slower_clock_are_no_regression(tmp_path, store, capsys):
    """An A/A pair (new noise) and a run on a 10% slower clock throughout: the times differ, the speed relative to
    each run's torch-compile does not."""
    history.add_run(make_run(tmp_path / "a", when="2026-11-25T10:00:00+00:00"))
    history.add_run(make_run(tmp_path / "b", when="2026-11-26T10:00:00+00:00", seed=1))
    assert main(["history", "--regressions"]) == 0
    assert ": 0 faster, 0 slower, 8 same, 0 unresolved, 8 unknown" in capsys.readouterr().out
    history.add_run(make_run(tmp_path / "c", when="2026-11-27T10:00:00+00:00", clock=1.10, seed=2))
    assert main(["history", "--regressions", "--gpu", H100]) == 0
    assert "0 slower" in capsys.readouterr().out


def test_the_previous_run_is_on_the_same_gpu_with_the_same_cells(tmp_path, store, capsys):
    history.add_run(make_run(tmp_path / "base", when="2026-11-24T10:00:00+00:00"))
    history.add_run(make_run(tmp_path / "fewer", when="2026-11-25T10:00:00+00:00", coda=0.8, groups=4))
    history.add_run(make_run(tmp_path / "h200", gpu=H200, when="2026-11-26T10:00:00+00:00", coda=0.8))
    history.add_run(make_run(tmp_path / "new", when="2026-11-27T10:00:00+00:00", seed=1))
    assert main(["history", "--regressions"]) == 0
    out = capsys.readouterr().out
    h100 = next(line for line in out.splitlines() if line.startswith(H100))
    assert str((tmp_path / "new").resolve()) in h100 and "against 2026-11-24 10:00" in h100 and "0 slower" in h100
    assert f"{H200}: newest run" in out and "no earlier run on this GPU with the same 16 cells" in out


def test_a_cell_that_breaks_is_named_but_is_not_a_slowdown(tmp_path, store, capsys):
    history.add_run(make_run(tmp_path / "a", when="2026-11-26T10:00:00+00:00"))
    history.add_run(make_run(tmp_path / "b", when="2026-11-27T10:00:00+00:00", seed=1, rows={
        ("gemm_out", "m2", "fwd", "bf16", "coda-triton"): {"correct": False}}))
    assert main(["history", "--regressions"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[:3] for line in out.splitlines() if "no longer ok" in line] == [["no", "longer", "ok"]]
    assert "gemm_out         m2" in out


def test_a_store_that_cannot_take_the_run_costs_a_warning_not_the_run(tmp_path, store, capsys, monkeypatch):
    run = make_run(tmp_path / "a")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    store.parent.mkdir()
    store.write_bytes(b"not a database at all" * 100)  # corrupt
    assert history.record_run(run) is False
    err = one_line(capsys)
    assert err.startswith(f"codabench: warning: {run} not added to the results history (HistoryError: {store}: ")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert main(["history"]) == 2 and "not a database" in one_line(capsys)

    store.unlink()
    history.add_run(run)
    with sqlite3.connect(store) as conn:
        conn.execute("PRAGMA user_version = 99")
    assert history.record_run(run) is False
    assert "a history store of schema 99; this codabench reads schema 1" in one_line(capsys)

    store.unlink()
    history.add_run(run)
    monkeypatch.setattr(history, "LOCK_TIMEOUT_S", 0.05)
    locker = sqlite3.connect(store, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another process writing
    try:
        assert history.record_run(run) is False
        assert "database is locked" in one_line(capsys)
    finally:
        locker.execute("ROLLBACK")
        locker.close()

    monkeypatch.setenv(history.ENV_VAR, str(tmp_path))  # a folder, not a file
    assert history.record_run(run) is False
    assert "unable to open database file" in one_line(capsys)


def test_a_run_appends_itself_unless_told_not_and_its_exit_code_survives_a_bad_store(tmp_path, store, capsys):
    def run(name: str, *flags: str) -> int:
        with isolated_registry():
            return main(["--ops", "gemm_out", "--modes", "fwd", "--dtypes", "fp32", "--models", "tiny", "--impls",
                         "torch-eager,test-good", "--plugin", str(PLUGINS / "good.py"), "--reps", "2", "--quiet",
                         "--no-entry-points", "--inline", "--out", str(tmp_path / name), *flags])

    assert run("one") == 0
    assert run("two", "--no-history") == 0
    with history.open_store() as conn:
        listed = history.runs(conn)
    assert [r["path"] for r in listed] == [str((tmp_path / "one").resolve())]
    assert listed[0]["gpu"] == "cpu" and listed[0]["suite"] == "smoke" and listed[0]["cells"] == 2
    capsys.readouterr()
    assert main(["history", "trend", "--op", "gemm_out", "--impl", "test-good"]) == 0  # CPU wall times: no speed figure
    row = capsys.readouterr().out.splitlines()[-1]
    assert "(cpu wall)" in row and "[" in row  # the p20-p80 spread of the wall times, no speedup or its interval
    assert main(["history", "export", "--format", "pytorch-oss"]) == 0
    names = {r["metric"]["name"] for r in json.loads(capsys.readouterr().out)}
    assert names == {"pass"}
    store.write_bytes(b"garbage" * 200)
    assert run("three") == 0
    err = capsys.readouterr().err
    assert sum("not added to the results history" in line for line in err.splitlines()) == 1
    assert (tmp_path / "three" / "report.html").exists()


def test_export_writes_pytorch_oss_benchmark_records(tmp_path, store, capsys):
    history.add_run(make_run(tmp_path / "old", when="2026-11-26T10:00:00+00:00"))
    history.add_run(make_run(tmp_path / "new", when="2026-11-27T10:00:00+00:00", groups=2, rows={
        ("gemm_out", "m0", "fwd", "bf16", "coda-triton"): {"status": "error", "message": "boom", "median_ms": None},
        ("gemm_out", "m1", "fwd", "bf16", "coda-triton"): {"sol_ms": 1.5, "peak_mem_mib": 12.0}}))
    out = tmp_path / "oss.json"
    assert main(["history", "export", "--format", "pytorch-oss", "--out", str(out)]) == 0  # the newest run
    records = json.loads(out.read_text())
    for r in records:
        assert set(r["benchmark"]) == {"name", "mode", "dtype", "extra_info"} and r["benchmark"]["name"] == "codabench"
        assert r["benchmark"]["mode"] == "inference" and r["benchmark"]["dtype"] == "bf16"
        assert {"name", "type", "backend", "origins", "extra_info"} == set(r["model"])
        assert r["model"]["origins"] == ["codabench"] and r["model"]["name"].startswith("gemm_out/m")
        assert set(r["metric"]) == {"name", "benchmark_values", "target_value", "extra_info"}
        assert all(isinstance(v, float) for v in r["metric"]["benchmark_values"] + [r["metric"]["target_value"]])
        for m in (r["benchmark"]["extra_info"], r["model"]["extra_info"], r["metric"]["extra_info"]):
            assert all(isinstance(v, str) for v in m.values())
        assert r["runners"][0]["gpu_info"] == H100 and r["runners"][0]["avail_gpu_mem_in_gb"] == 79
        assert r["dependencies"]["pytorch"]["version"] == "2.11.0"
    by = {(r["model"]["name"], r["model"]["backend"], r["metric"]["name"]): r["metric"] for r in records}
    assert by[("gemm_out/m0", "coda-triton", "pass")]["benchmark_values"] == [0.0]
    assert by[("gemm_out/m0", "coda-triton", "pass")]["extra_info"]["message"] == "boom"
    assert ("gemm_out/m0", "coda-triton", "latency_ms") not in by
    df, _, _ = tables.load_run(tmp_path / "new")
    m1 = df[(df["model"] == "m1") & (df["impl"] == "coda-triton")].iloc[0]
    latency = by[("gemm_out/m1", "coda-triton", "latency_ms")]
    assert latency["benchmark_values"] == [pytest.approx(m1["median_ms"])] and latency["target_value"] == 1.5
    speed = by[("gemm_out/m1", "coda-triton", "speedup_vs_torch_compile")]
    assert speed["benchmark_values"] == [pytest.approx(m1["speedup"])] and speed["target_value"] == 1.0
    assert float(speed["extra_info"]["lo"]) <= m1["speedup"] <= float(speed["extra_info"]["hi"])
    assert by[("gemm_out/m1", "coda-triton", "peak_memory_mib")]["benchmark_values"] == [12.0]
    assert sum(k[2] == "pass" for k in by) == 4 and len(records) == 4 + 3 + 3 + 1  # pass; latency; speedup (1 for torch-compile); memory
    capsys.readouterr()
    assert main(["history", "export", "--format", "pytorch-oss", str(tmp_path / "old")]) == 0  # by folder, to stdout
    assert len(json.loads(capsys.readouterr().out)) == 16 * 3


@pytest.mark.parametrize("argv, says", [
    (["history", "trend", "--impl", "coda-triton"], "the following arguments are required: --op"),
    (["history", "trend", "--op", "gemm_out", "--impl", "nope"], "no cell of op gemm_out, impl nope"),
    (["history", "trend", "--op", "gemm_out", "--impl", "x", "--mode", "sideways"], "invalid choice: 'sideways'"),
    (["history", "export", "--format", "csv"], "invalid choice: 'csv'"),
    (["history", "export", "--format", "pytorch-oss", "/no/such/run"], "no run '/no/such/run' in the history"),
    (["history", "add", "/no/such/run"], "/no/such/run: no such directory"),
    (["history", "--regressions", "--gpu", "TPU"], "no runs on GPU 'TPU'"),
    (["history", "sideways"], "unrecognized arguments: sideways"),
])
def test_bad_input_gets_one_line_and_exit_2(tmp_path, store, capsys, argv, says):
    history.add_run(make_run(tmp_path / "a", groups=1))
    assert main(argv) == 2
    assert says in one_line(capsys)


def test_a_merge_appends_the_merged_run_in_place_of_its_shards(tmp_path, store, capsys):
    shards = [make_run(tmp_path / f"shard{i}", groups=1, seed=i) for i in range(2)]
    for i, shard in enumerate(shards):  # the shards' cells differ: group m0 and group m1
        df, _, _ = tables.load_run(shard)
        df["model"] = f"m{i}"
        tables.write_csv(shard / tables.RESULTS, tables.records(df), tables.RESULT_COLUMNS)
        samples = [{**s, "model": f"m{i}"} for s in tables.read_samples(shard / tables.SAMPLES)]
        (shard / tables.SAMPLES).write_text("".join(json.dumps(s) + "\n" for s in samples))
        history.add_run(shard)  # as each shard's run does when it finishes
    assert main(["merge", str(tmp_path / "merged"), *map(str, shards)]) == 0
    with history.open_store() as conn:
        (run,) = history.runs(conn)  # the merge replaces its shards: no cell twice
    assert run["path"] == str((tmp_path / "merged").resolve()) and run["cells"] == 4 and run["gpu"] == H100


def test_earlier_runs_a_plugin_rewrites_during_a_run_are_put_back(tmp_path, store, capsys):
    """A plugin that rewrites the store's earlier runs in its call (their torch-eager times tripled): the run puts
    them back as they were before it adds itself, and says so in one warning line; its own row is recorded."""
    def run(name: str, plugin: str, impls: str) -> int:
        with isolated_registry():
            return main(["--ops", "gemm_out", "--modes", "fwd", "--dtypes", "fp32", "--models", "tiny", "--impls",
                         impls, "--plugin", str(PLUGINS / plugin), "--reps", "2", "--quiet", "--no-entry-points",
                         "--inline", "--out", str(tmp_path / name)])

    assert run("one", "good.py", "torch-eager,test-good") == 0
    with history.open_store() as conn:
        before = history.cells(conn, history.runs(conn)[0]["id"])
    capsys.readouterr()
    assert run("two", "adv_rewrites_history.py", "torch-eager,adv-rewrites-history") == 0
    err = capsys.readouterr().err
    assert "1 earlier run(s) of the results history" in err and "put back as they were" in err, err
    with history.open_store() as conn:
        listed = history.runs(conn)
        first = next(r for r in listed if r["path"] == str((tmp_path / "one").resolve()))
        after = history.cells(conn, first["id"])
    assert len(listed) == 2
    assert after["median_ms"].tolist() == before["median_ms"].tolist()
