"""Cells in a worker process: hangs, exits and crashes cost one row; cheats are caught before a time counts."""
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from codabench import guard
from codabench import worker as worker_module
from codabench.case import Case
from codabench.ceilings import floor_ms
from codabench.config import RunConfig
from codabench.matrix import Cell, Selection
from codabench.measure import RoundResult
from codabench.discovery import load_plugin_file, plugin_module_name
from codabench.results import load_run
from codabench import plan as planning
from codabench.runner import Runner, _Pending
from codabench.worker import WORKER_MAIN, WorkerProcess
from codabench.writer import RunExists
from harness_helpers import CPU, PLUGINS, isolated_registry, make_runner

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def registry():
    with isolated_registry() as reg:
        yield reg


def rows(run_dir):
    df, _, _ = load_run(run_dir)
    return {r["impl"]: r for _, r in df.iterrows()}


@pytest.mark.slow
def test_hangs_exits_and_crashes_cost_one_row_each(registry, tmp_path):
    load_plugin_file(PLUGINS / "crashers.py")
    load_plugin_file(PLUGINS / "good.py")
    impls = ["torch-eager", "test-exits-later", "test-good", "test-hangs", "test-os-exit", "test-segfault",
             "test-sys-exit"]
    runner = make_runner(tmp_path, modes=("fwd",), impls=impls, cell_timeout_s=8)
    assert [c.impl for c in runner.cells] == impls  # baselines first, then by name: good cells after crashes
    runner.run()
    got = rows(tmp_path)
    expect = {"test-hangs": "timed out after 8 s", "test-sys-exit": "exited with code 3",
              "test-os-exit": "exited with code 1", "test-segfault": "killed by SIGSEGV",
              "test-exits-later": "exited with code 4"}
    for impl, text in expect.items():
        assert got[impl]["status"] == "error" and text in got[impl]["message"], (impl, got[impl]["message"])
    for impl in ("torch-eager", "test-good"):  # test-good runs in a new worker after test-exits-later's crash
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, impl
    assert (tmp_path / "env.json").exists()


def test_what_a_call_raises_is_its_row_whatever_it_is(registry, tmp_path):
    """A KeyboardInterrupt a plugin raises (the worker ignores SIGINT: Ctrl-C reaches the parent alone) is that
    cell's error, not a worker "killed by SIGINT"; an exception whose message cannot be made is still named."""
    load_plugin_file(PLUGINS / "crashers.py")
    impls = ["torch-eager", "test-keyboard-interrupt", "test-unprintable-error"]
    make_runner(tmp_path, modes=("fwd",), impls=impls).run()
    got = rows(tmp_path)
    interrupt = got["test-keyboard-interrupt"]
    assert interrupt["status"] == "error" and "KeyboardInterrupt: from the plugin" in interrupt["message"]
    assert "killed" not in interrupt["message"], interrupt["message"]
    unprintable = got["test-unprintable-error"]
    assert unprintable["status"] == "error" and ("_Unprintable: (its message could not be made: __str__ raised "
                                                 "ValueError)") in unprintable["message"], unprintable["message"]
    assert got["torch-eager"]["status"] == "ok"


def test_a_replaced_worker_keeps_the_other_cells_verdicts(registry, tmp_path):
    """test-inaccurate (1% off: ok, FAIL) is checked before test-sys-exit takes the worker down; its group is sampled
    in a new worker, which must still allow for its own error in the correctness pass (from the parent's record),
    not call it a cheat."""
    load_plugin_file(PLUGINS / "crashers.py")
    load_plugin_file(PLUGINS / "faulty.py")
    impls = ["torch-eager", "test-inaccurate", "test-sys-exit"]
    runner = make_runner(tmp_path, modes=("fwd",), impls=impls)
    assert [c.impl for c in runner.cells] == impls
    runner.run()
    got = rows(tmp_path)
    assert got["test-sys-exit"]["status"] == "error" and "exited with code 3" in got["test-sys-exit"]["message"]
    off = got["test-inaccurate"]
    assert off["status"] == "ok" and off["correct"] is False and off["n_samples"] > 0, off["message"]
    assert got["torch-eager"]["status"] == "ok" and got["torch-eager"]["correct"] is True


def test_a_plugin_that_exits_at_import_is_an_error_row(registry, tmp_path):
    load_plugin_file(PLUGINS / "exits_at_import.py")
    load_plugin_file(PLUGINS / "good.py")
    make_runner(tmp_path, modes=("fwd",), impls=["test-good"]).run()
    got = rows(tmp_path)
    assert got["test-good"]["status"] == "ok"
    load = got[str((PLUGINS / "exits_at_import.py").resolve())]
    assert load["status"] == "error" and "SystemExit" in load["message"]


def test_cheats_are_caught_and_honest_cells_keep_their_times(registry, tmp_path):
    load_plugin_file(PLUGINS / "cheaters.py")
    load_plugin_file(PLUGINS / "good.py")
    impls = ["torch-eager", "cheat-address-cache", "cheat-baseline", "cheat-call-count", "cheat-clock",
             "cheat-first-result", "cheat-shape-cache", "test-good"]
    make_runner(tmp_path, modes=("fwd",), impls=impls).run()
    got = rows(tmp_path)
    # the address cache is caught by the refill, or already by the timed buffers when the allocator gave them the
    # address of the correctness pass's freed inputs (the cache then answers with that pass's result)
    expect = {"cheat-first-result": ("a timed call's output is wrong",),
              "cheat-shape-cache": ("a timed call's output is wrong",),
              "cheat-address-cache": ("outputs do not follow the inputs", "a timed call's output is wrong"),
              "cheat-call-count": ("outputs do not follow the inputs",),
              "cheat-clock": ("tampered with time.perf_counter",),
              "cheat-baseline": ("tampered with torch.nn.functional.rms_norm",)}
    for impl, texts in expect.items():
        assert got[impl]["status"] == "error" and any(t in got[impl]["message"] for t in texts), (
            impl, got[impl]["message"])
        assert pd.isna(got[impl]["median_ms"]), impl  # a cheating cell has no time
    for impl in ("torch-eager", "test-good"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, impl
    # test-good ran after both tampering plugins: its time is a real wall time, not a tenth of it (the shrunk clock)
    assert got["test-good"]["median_ms"] > 0.5 * _fastest_call_ms(lambda x, w: F.linear(x, w))


def _fastest_call_ms(fn) -> float:
    """The fastest of 50 wall-clock calls of ``fn`` on gemm_out's tiny inputs, in this process, on one thread (with
    the cores busy, as beside another test process, a multi-threaded call of this size waits milliseconds for its
    threads)."""
    from workloads.models import get_model
    from workloads.ops import OPS

    inp = OPS["gemm_out"].inputs(get_model("tiny"), "fp32", torch.device("cpu"), 0)
    times, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for _ in range(50):
                t0 = time.perf_counter()
                fn(inp["x"], inp["w"])
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return min(times)


def test_the_guard_notices_and_restores_replaced_functions():
    guard.snapshot()
    clock, norm = time.perf_counter, F.rms_norm
    try:
        time.perf_counter = lambda: 0.0
        F.rms_norm = lambda *a, **k: None
        assert set(guard.tampered()) >= {"time.perf_counter", "torch.nn.functional.rms_norm"}
        assert set(guard.restore()) >= {"time.perf_counter", "torch.nn.functional.rms_norm"}
        assert time.perf_counter is clock and F.rms_norm is norm and guard.tampered() == []
    finally:
        time.perf_counter, F.rms_norm = clock, norm


def _config(out: Path, impls: list[str], plugins: list[Path], cell_timeout_s: float) -> RunConfig:
    sel = Selection(ops=("gemm_out",), models=("tiny",), modes=("fwd",), dtypes=("fp32",), impls=tuple(impls))
    return RunConfig(out_dir=out, selection=sel, device=CPU, show_progress=False, cell_timeout_s=cell_timeout_s,
                     plugin_files=tuple(str(p.resolve()) for p in plugins), entry_points=False)


def _alive(pid: int) -> bool:
    """The process runs (a zombie, killed and waiting to be reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _spawned_all_gone(pids: Path, names: set[str]) -> None:
    """The busy children that spawners.py wrote to ``pids`` (one per name) are all gone (within 10 s: reaping)."""
    spawned = {f.name: int(f.read_text()) for f in pids.iterdir()}
    assert spawned.keys() == names
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in spawned.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [name for name, pid in spawned.items() if _alive(pid)]


@pytest.mark.skipif(sys.platform != "linux", reason="process groups, /proc")
def test_plugin_imports_are_blamed_bounded_and_reported_in_every_worker(registry, tmp_path, monkeypatch, capsys):
    """As the command line runs: the worker starts first and this process imports each plugin only once the worker
    did. A plugin that replaces time.perf_counter at import gets the blame (a load error) in every worker, so the
    honest cell that is the first of a new worker (after a crash) passes; an import that hangs is vetoed (an error
    row, the run goes on, this process never imports it); a slow one is reported (stderr, env.json). The busy
    children of the crashed cell and of the honest one die with their worker's process group."""
    monkeypatch.setattr(worker_module, "SLOW_IMPORT_S", 1.0)  # slow_import.py sleeps 1.5 s
    monkeypatch.setenv("CODABENCH_TEST_PIDS", str(tmp_path / "pids"))
    (tmp_path / "pids").mkdir()
    plugins = [PLUGINS / f for f in ("hangs_at_import.py", "patches_at_import.py", "slow_import.py", "spawners.py")]
    impls = ["torch-eager", "test-import-patcher", "test-slow-import", "test-spawn-crashes", "test-spawn-returns"]
    cfg = _config(tmp_path / "run", impls, plugins, cell_timeout_s=6)
    worker = WorkerProcess(cfg)
    worker.spawn()
    for p in plugins:
        load_plugin_file(p, gate=worker.import_verdict)
    assert plugin_module_name(plugins[0].resolve()) not in sys.modules
    Runner(cfg, registry, worker).run()
    got = rows(tmp_path / "run")
    hang, patcher = (str(p.resolve()) for p in plugins[:2])
    assert got[hang]["status"] == "error" and "importing it took more than 6 s" in got[hang]["message"]
    assert got[patcher]["status"] == "error" and (
        "tampered with time.perf_counter while being imported" in got[patcher]["message"])
    assert "exited with code 7" in got["test-spawn-crashes"]["message"]
    for impl in ("torch-eager", "test-import-patcher", "test-slow-import", "test-spawn-returns"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, (impl, got[impl]["message"])
    assert worker.starts == 3  # the first, the one without the hanging plugin, the one after the crash
    assert sorted(source for source, _ in registry.load_errors) == sorted([hang, patcher])  # each once
    slow = str(plugins[2].resolve())
    assert json.loads((tmp_path / "run" / "env.json").read_text())["slow_plugin_imports"].keys() == {slow}
    assert f"plugin {slow} took" in capsys.readouterr().err
    _spawned_all_gone(tmp_path / "pids", {"test-spawn-crashes", "test-spawn-returns"})


@pytest.mark.skipif(sys.platform != "linux", reason="process groups, /proc")
def test_a_cell_that_times_out_takes_what_its_plugin_spawned_with_it(registry, tmp_path, monkeypatch):
    monkeypatch.setenv("CODABENCH_TEST_PIDS", str(tmp_path / "pids"))
    (tmp_path / "pids").mkdir()
    load_plugin_file(PLUGINS / "spawners.py")
    make_runner(tmp_path / "run", modes=("fwd",), impls=["test-spawn-hangs"], cell_timeout_s=6).run()
    assert "timed out after 6 s" in rows(tmp_path / "run")["test-spawn-hangs"]["message"]
    _spawned_all_gone(tmp_path / "pids", {"test-spawn-hangs"})


def test_a_time_below_the_physical_floor_is_an_error(registry, tmp_path):
    """With ceilings of an H100-like GPU, a 7B gemm_out cell claiming 1 us cannot be true."""
    runner = make_runner(tmp_path, models=("llama-7b",), modes=("fwd",), impls=["torch-eager"])
    runner.ceilings = {"copy_gbps": 3000.0, "bf16_tflops": 700.0}
    cell = Cell("gemm_out", "llama-7b", "fwd", "bf16", "torch-eager")
    flops = 2 * 16384 * 4096 * 4096
    assert floor_ms(flops, 1e9, runner.ceilings, "bf16") == pytest.approx(max(1e9 / 3e12, flops / 700e12) * 1e3)
    for median, status in ((0.001, "error"), (0.45, "error"), (0.8, "ok")):  # hard floor 0.49 ms
        p = _Pending(cell, runner._base_row(cell) | {"_min_bytes": 1e9}, [], [RoundResult([median] * 3, "cuda-events")])
        runner._finish(p, ({}, ""))
        assert p.row["status"] == status, (median, p.row["message"])
    assert "faster than the hardware allows" not in p.row["message"]


def test_an_interrupted_request_retires_the_worker_and_the_run_asks_it_nothing_more(registry, tmp_path, monkeypatch):
    """Ctrl-C while the worker computes: its late answer would be read as the answer to the next request (on a GPU
    the run's last request, the clock trace, got a cell's result and the report was lost), so the worker is
    stopped, and the run's closing requests are not sent to a new one."""
    runner = make_runner(tmp_path, ops=["gemm_out"], modes=["fwd"])
    worker = WorkerProcess(runner.cfg)
    assert worker.call("env", []) and worker.alive
    proc = worker._proc

    def interrupted(timeout):
        raise KeyboardInterrupt
    monkeypatch.setattr(worker._conn, "poll", interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.call("env", [])
    assert not worker.alive and proc.poll() is not None

    asked = []

    class Interrupted:
        alive = True

        def call(self, method, *args):
            asked.append(method)
            if method == "first":
                self.alive = False
                raise KeyboardInterrupt
            return {"device": "cuda"} if method == "env" else []

        def close(self):
            pass
    runner = make_runner(tmp_path / "gpu", ops=["gemm_out"], modes=["fwd"])
    runner.cfg = dataclasses.replace(runner.cfg, device=torch.device("cuda"))
    runner.worker = Interrupted()
    runner.plan = lambda: [(c, planning.RUN) for c in runner.cells]  # no GPU here: the cells would be skipped
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    assert asked == ["env", "first"]  # no clock trace asked of a worker that is gone


@pytest.mark.skipif(sys.platform != "linux", reason="signals")
def test_a_refused_run_directory_stops_the_spawned_worker(registry, tmp_path):
    """The command line spawns its worker before the run checks --out: a directory that holds a run (no --resume)
    must stop that worker, not orphan it (it printed a BrokenPipeError traceback seconds after the exit)."""
    make_runner(tmp_path, ops=["gemm_out"], modes=("fwd",)).run()
    runner = make_runner(tmp_path, ops=["gemm_out"], modes=("fwd",))
    worker = WorkerProcess(runner.cfg)
    worker.spawn()
    proc = worker._proc
    runner.worker = worker
    with pytest.raises(RunExists):
        runner.run()
    assert proc.poll() is not None and worker._proc is None


def test_a_worker_whose_parent_is_gone_ends_quietly(registry, tmp_path):
    """A worker whose parent closed the connection before it was ready (or while it waits for a request) exits 0
    without a traceback on the terminal they share."""
    cfg = make_runner(tmp_path, ops=["gemm_out"], modes=("fwd",)).cfg
    ours, theirs = socket.socketpair()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
    proc = subprocess.Popen([sys.executable, "-c", WORKER_MAIN, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                            env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    theirs.close()
    conn = Connection(ours.detach())
    conn.send(cfg)
    conn.close()  # the parent leaves while the worker imports
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        if entry.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_the_worker_and_writes_the_report(tmp_path, signum):
    """SIGINT (Ctrl-C) or SIGTERM (``timeout``, ``kill``, a scheduler) in the middle of a hanging cell: exit 130, the
    finished groups' rows kept (a group's rows are written when its sampling ends), the report written, the worker
    gone with the run."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    proc = subprocess.Popen([sys.executable, "run_bench.py", "--ops", "rmsnorm_linear,gemm_out", "--modes", "fwd",
                             "--impls",
                             "torch-eager,test-hangs", "--plugin", str(PLUGINS / "crashers.py"), "--out", str(out),
                             "--no-entry-points", "--quiet"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120

    def rows_written() -> int:
        path = out / "results.csv"
        return len(path.read_text().splitlines()) - 1 if path.exists() else 0

    while rows_written() < 1:  # torch-eager's row of rmsnorm_linear
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.5)
    time.sleep(2)  # the next cell hangs in the worker
    workers = _children(proc.pid)
    assert workers
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and (out / "report.html").exists()
    assert ("terminated (SIGTERM)" in err) == (signum == signal.SIGTERM), err[-2000:]
    assert rows(out)["torch-eager"]["status"] == "ok"
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")], "the worker outlived the run"


@pytest.mark.parametrize("op_name,dtype,shape", [
    ("gemm_ce_grad", "fp16", "small"), ("gemm_swiglu_save", "fp16", "small"), ("gemm_rope", "fp16", "small"),
    ("gemm_out", "fp16", "small"), ("lm_head_ce", "bf16", "vocab"), ("rmsnorm_ce", "bf16", "vocab")])
def test_the_checks_new_inputs_keep_pytorchs_own_error_within_what_they_allow(op_name, dtype, shape):
    """The anti-cheat checks compare the refilled and new-buffer calls with PyTorch on new inputs and allow
    VERIFY_FACTOR x the errors that the correctness pass measured on the original inputs, plus a floor. So the new
    inputs must not make the problem worse conditioned than that: PyTorch's own error on them stays within
    VERIFY_FACTOR x its error on the original inputs (and within what the checks allow, floor included).
    Doubling a consumer op's saved rstd along with its h made the LM head's logits x8 and PyTorch's fp16 dlogits
    error x20 (an honest coda-triton gemm_ce_grad cell failed on an H100); rstd now halves, as it does for x -> 2x.
    Doubling lm_head_ce's and rmsnorm_ce's LM-head weight with gamma made their logits x4 and PyTorch's lse error,
    from its bf16 logits, ~90x at the real vocabulary (honest fp8 coda-triton cells failed on an H200); w_lm now
    halves."""
    from codabench.metrics import rel_err
    from codabench.verify import REFILL_SEED, VERIFY_FACTOR, allowed_error, verification_inputs
    from workloads.models import get_model
    from workloads.ops import OPS

    op = OPS[op_name]
    model = (get_model("tiny").with_(tokens=512, hidden=128, ffn=256, vocab=2048) if shape == "small"
             else get_model("llama-1b").with_(tokens=256, vocab=32768))
    case = Case(op, model, "fwd", dtype, torch.device("cpu"), op.inputs(model, dtype, "cpu", 0))
    new = verification_inputs(op, case, REFILL_SEED).inputs
    again = op.inputs(model, dtype, "cpu", REFILL_SEED)
    for name in op.halved:  # rstd * h keeps its scale (x -> 2x); the LM head's logits keep theirs
        torch.testing.assert_close(new[name] * 2, again[name], rtol=0, atol=torch.finfo(again[name].dtype).tiny)

    def torch_err(inputs):
        ours = op.reference(inputs, model)
        exact = op.reference({k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}, model)
        return {k: rel_err(ours[k], exact[k]) for k in ours}

    before, after = torch_err(case.inputs), torch_err(new)
    allowed = allowed_error(before, before, case.inputs[next(iter(op.fp8_operands or case.inputs))].dtype)
    for name in before:
        assert after[name] <= allowed[name], (name, before[name], after[name], allowed[name])
        assert after[name] <= VERIFY_FACTOR * before[name] + 1e-5, (name, before[name], after[name])


def test_a_check_beyond_its_first_bound_asks_pytorchs_own_error_on_those_inputs_before_it_fails():
    """The checks allow VERIFY_FACTOR x the correctness pass's errors; new inputs can be worse conditioned (an honest
    fp8 block cell at hidden 576 was 0.0079 from PyTorch's rstd on the refilled inputs, against 0.0071 allowed, on an
    H200). An output beyond that bound is measured against PyTorch's own error on the same inputs (float64 once):
    within VERIFY_FACTOR x that it passes, and an output of other inputs still fails."""
    from codabench.correctness import compared
    from codabench.eager import TorchEager
    from codabench.execute import reference_once, run_once
    from codabench.metrics import rel_err
    from codabench.verify import VERIFY_FACTOR, Expected, allowed_error, mismatch
    from workloads.models import get_model
    from workloads.ops import OPS

    op = OPS["gemm_out"]
    model = get_model("tiny").with_(tokens=256, hidden=512, ffn=256)
    case = Case(op, model, "fwd", "fp16", CPU, op.inputs(model, "fp16", "cpu", 3))
    expected = Expected(case, compared(op, "fwd", run_once(op, TorchEager(op), case, None)))
    exact = compared(op, "fwd", reference_once(op, case, None))["out"]
    torch_err = rel_err(expected.outputs["out"], exact)
    allowed = allowed_error({"out": torch_err / 20}, {"out": torch_err / 20}, torch.float16)  # a better-kept pass
    honest = (exact * (1 + 2 * torch_err)).half()  # off by ~2x PyTorch's error: beyond the first bound, within 4x
    assert rel_err(honest, expected.outputs["out"]) > allowed["out"]
    assert mismatch(op, "fwd", {"out": honest}, expected, allowed) is None
    other = compared(op, "fwd", run_once(op, TorchEager(op), dataclasses.replace(
        case, inputs=op.inputs(model, "fp16", "cpu", 4)), None))
    bad = mismatch(op, "fwd", other, Expected(case, expected.outputs), allowed)
    assert bad is not None and bad.startswith("out is"), bad
    assert float(re.search(r"allowed ([0-9.e+-]+),", bad).group(1)) >= 0.99 * VERIFY_FACTOR * torch_err, bad


def test_no_second_opinion_on_inputs_that_no_longer_give_pytorchs_results():
    """The timed buffers are refilled at every sweep, and a call may write into its inputs: PyTorch's error is taken
    only on inputs that still give the results it is compared with (else every output would be "off" by the change
    of inputs, and the bound with it)."""
    from codabench.correctness import compared
    from codabench.eager import TorchEager
    from codabench.execute import run_once
    from codabench.verify import Expected, allowed_error, mismatch
    from workloads.models import get_model
    from workloads.ops import OPS

    op = OPS["gemm_out"]
    model = get_model("tiny").with_(tokens=64, hidden=64, ffn=64)
    case = Case(op, model, "fwd", "fp32", CPU, op.inputs(model, "fp32", "cpu", 3))
    expected = Expected(case, compared(op, "fwd", run_once(op, TorchEager(op), case, None)))
    first = {"out": expected.outputs["out"].clone()}
    allowed = allowed_error({"out": 1e-7}, {"out": 1e-7}, torch.float32)
    with torch.no_grad():
        case.inputs["x"].mul_(3).add_(1)  # refilled since: the first result no longer follows them
    assert expected.torch_error("fwd") == {}
    assert mismatch(op, "fwd", {"out": first["out"] * 1.5}, expected, allowed).endswith(f"(allowed {allowed['out']:.3g})")
