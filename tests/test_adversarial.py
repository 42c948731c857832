"""Plugins that attack what the harness compares against or what the other implementations run on (tests/plugins/
adv_*.py), in a worker process as the command line runs them: each gets the blame, and no verdict it did not earn."""
import sys
import threading

import pandas as pd
import pytest

from codabench import guard
from codabench.discovery import load_plugin_file
from codabench.results import load_run
from codabench.runner import DeviceLost
from codabench.timing import TimingConfig
from codabench.worker import WorkerProcess
from harness_helpers import PLUGINS, isolated_registry, make_runner

IMPORT_ATTACKS = {
    "adv_op_reference.py": ("adv-op-reference", "workloads.ops.OPS['gemm_out'].reference"),
    "adv_function_mode.py": ("adv-function-mode", "torch function modes (a mode is entered)"),
    "adv_pass_floor.py": ("adv-pass-floor", "codabench.metrics.FLOOR[torch.float32]"),
    "adv_aten_kernel.py": ("adv-aten-kernel", "torch's kernel of aten::mm (replaced in its dispatcher)"),
}
"""Plugin file: (its implementation, which returns a wrong output, and what it changes while being imported)."""


@pytest.fixture
def registry():
    with isolated_registry() as reg:
        yield reg
    guard.restore()  # this process imported the plugins too


def test_what_the_harness_compares_against_cannot_be_moved_to_a_wrong_output(registry, tmp_path):
    """Each plugin moves the reference and PyTorch's results (an op's method, a torch function mode, a kernel of
    aten) or the pass rule's floor while being imported, to agree with its wrong output: the change is its load
    error, the originals are back before any cell, so its cell fails the pass rule, and the honest cells
    (torch-eager, test-good) stay correct."""
    for f in [*IMPORT_ATTACKS, "good.py"]:
        load_plugin_file(PLUGINS / f)
    make_runner(tmp_path, modes=("fwd",), impls=["torch-eager", "test-good",
                                                 *(impl for impl, _ in IMPORT_ATTACKS.values())]).run()
    df, _, _ = load_run(tmp_path)
    got = {r["impl"]: r for _, r in df.iterrows()}
    for f, (impl, changed) in IMPORT_ATTACKS.items():
        load_error = got[str((PLUGINS / f).resolve())]
        assert load_error["status"] == "error" and f"tampered with {changed} while being imported" in (
            load_error["message"]), (f, load_error["message"])
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is False, (impl, got[impl]["message"])
    for impl in ("torch-eager", "test-good"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, (impl, got[impl]["rel_err"])


def test_what_the_others_run_cannot_be_slowed(registry, tmp_path):
    """A plugin that gives a baseline's registry entry a slower ``run`` while being imported gets the blame (its load
    error) and the baseline keeps its time; a call that leaves a torch function mode entered (every later torch call,
    the other cells' included, would run through it) is its cell's error row, and the honest cell after it is correct
    and keeps a time."""
    for f in ("adv_slows_a_baseline.py", "adv_slows_others.py", "good.py"):
        load_plugin_file(PLUGINS / f)
    make_runner(tmp_path, modes=("fwd",), impls=["torch-eager", "adv-slows-a-baseline", "adv-slows-others",
                                                 "test-good"]).run()
    df, _, _ = load_run(tmp_path)
    got = {r["impl"]: r for _, r in df.iterrows()}
    load_error = got[str((PLUGINS / "adv_slows_a_baseline.py").resolve())]
    assert "tampered with the registered implementation ('gemm_out', 'torch-eager').run (shadows its method)" in (
        load_error["message"]), load_error["message"]
    assert got["torch-eager"]["status"] == "ok" and got["torch-eager"]["median_ms"] < 25, got["torch-eager"]
    assert got["adv-slows-others"]["status"] == "error" and (
        "tampered with torch function modes (a mode is entered)" in got["adv-slows-others"]["message"])
    assert pd.isna(got["adv-slows-others"]["median_ms"])
    for impl in ("test-good", "adv-slows-a-baseline"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, (impl, got[impl]["message"])


def test_a_plugin_that_leaves_a_thread_running_its_code_is_vetoed(registry, tmp_path):
    """A plugin whose import leaves a thread running its own code (a busy loop beside every timed call) gets a load
    error naming the thread; the worker that imported it is replaced by one that does not import it, so the honest
    cells are timed without it."""
    path = (PLUGINS / "adv_thread.py").resolve()
    load_plugin_file(path)
    next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path)).STOP.set()
    assert any(source == str(path) and "left adv-burner running its own code" in error
               for source, error in registry.load_errors), registry.load_errors
    load_plugin_file(PLUGINS / "good.py")
    make_runner(tmp_path, modes=("fwd",), impls=["torch-eager", "test-good", "adv-thread"]).run()
    df, _, _ = load_run(tmp_path)
    got = {r["impl"]: r for _, r in df.iterrows()}
    assert "started again without this plugin" in got[str(path)]["message"], got[str(path)]["message"]
    assert got.get("adv-thread") is None or got["adv-thread"]["status"] == "error", got["adv-thread"]
    for impl in ("torch-eager", "test-good"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, (impl, got[impl]["message"])


def _run_in_a_worker(tmp_path, impls: list[str], **cfg) -> tuple[dict, WorkerProcess]:
    """The rows by implementation (and load errors by source) of a run of ``impls`` in a worker process, and that
    worker's handle (how many processes it started); ``cfg``: more of the run's settings."""
    runner = make_runner(tmp_path, modes=("fwd",), impls=impls, **cfg)
    runner.worker = WorkerProcess(runner.cfg)
    runner.run()
    df, _, _ = load_run(tmp_path)
    return {r["impl"]: r for _, r in df.iterrows()}, runner.worker


def test_a_thread_a_call_leaves_running_its_code_fails_its_cell_and_dies_with_its_worker(registry, tmp_path):
    """A call that starts a thread of its own which outlives it (a busy loop beside every later timed call): its
    cell is an error row naming the thread, and the worker that ran it is replaced at once, so that the cells after
    it (test-good) run and are timed without the thread."""
    for f in ("adv_call_thread.py", "good.py"):
        load_plugin_file(PLUGINS / f)
    got, worker = _run_in_a_worker(tmp_path, ["torch-eager", "adv-call-thread", "test-good"])
    row = got["adv-call-thread"]
    assert row["status"] == "error" and "left adv-call-burner running its own code after the call" in row["message"]
    assert "it ends with its process, which is replaced" in row["message"] and pd.isna(row["median_ms"])
    assert worker.starts == 2, worker.starts  # the first worker, and the one after the thread's cell
    for impl in ("torch-eager", "test-good"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, (impl, got[impl]["message"])


def test_a_name_once_registered_cannot_be_taken_over(registry, tmp_path):
    """A plugin that takes torch-eager's entry out of the registry and registers a slower implementation under its
    name: the re-registration is refused (its load error), taking the entry out is tampering (a second load error),
    and the entry is back before any cell: torch-eager keeps its time."""
    path = str((PLUGINS / "adv_readds_a_baseline.py").resolve())
    load_plugin_file(path)
    errors = [e for source, e in registry.load_errors if source == path]
    assert any("registered twice" in e and "after removing the first" in e for e in errors), errors
    assert any("tampered with the registered implementation ('gemm_out', 'torch-eager') (removed) while being "
               "imported (the harness restored the originals)" in e for e in errors), errors
    got, _ = _run_in_a_worker(tmp_path, ["torch-eager"])
    assert got[path]["status"] == "error", got[path]
    eager = got["torch-eager"]
    assert eager["status"] == "ok" and eager["correct"] is True and eager["median_ms"] < 25, eager


@pytest.mark.parametrize("plugin, impl, says", [
    ("adv_dispatcher_kernel.py", "adv-dispatcher-kernel", "tampered with torch's kernel of aten::mm (replaced in its "
                                                          "dispatcher)"),
    ("adv_fallback.py", "adv-fallback", "tampered with torch's dispatcher: a backend fallback at CPU"),
])
def test_what_no_restore_undoes_fails_its_cell_and_its_worker_is_replaced(registry, tmp_path, plugin, impl, says):
    """A call that registers a doubled CPU kernel of aten::mm through torch._C (the guard sees it in the dispatcher,
    but cannot take it back), or a backend fallback at the CPU key (a kernel for every op without one of its own
    there, which nothing takes back): its cell is an error row saying so, its worker is replaced at once, and the
    cells after it compute with torch's own kernels (test-good is correct)."""
    for f in (plugin, "good.py"):
        load_plugin_file(PLUGINS / f)
    got, worker = _run_in_a_worker(tmp_path, ["torch-eager", impl, "test-good"])
    row = got[impl]
    assert row["status"] == "error" and says in row["message"] and (
        "cannot be undone in this process, which is replaced" in row["message"]), row["message"]
    assert worker.starts == 2, worker.starts
    for other in ("torch-eager", "test-good"):
        assert got[other]["status"] == "ok" and got[other]["correct"] is True, (other, got[other]["message"])


def test_a_call_that_drops_torch_compiles_graphs_in_the_sweeps_fails_its_cell(registry, tmp_path):
    """``torch._dynamo.reset()`` in every call: in the group's sweeps torch-compile's graphs are gone right after the
    call (it would compile in its next timed call); the cell is an error row saying so, and the others are sampled
    again without it in the same worker (on a GPU after a warm-up, which compiles again). Two sweeps: where the calls
    before the sweeps had dropped the graphs already, the first sweep may run the reset before torch-compile compiles
    again, and the second sees it."""
    for f in ("adv_dynamo_reset.py", "good.py"):
        load_plugin_file(PLUGINS / f)
    got, worker = _run_in_a_worker(tmp_path, ["torch-eager", "torch-compile", "adv-dynamo-reset", "test-good"],
                                   timing=TimingConfig(cpu_reps=2))
    row = got["adv-dynamo-reset"]
    assert row["status"] == "error" and "torch-compile's graphs" in row["message"], row["message"]
    assert worker.starts == 1, worker.starts
    for impl in ("torch-eager", "torch-compile", "test-good"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, (impl, got[impl]["message"])


def _module(path) -> object:
    """The module this process imported from the plugin file ``path``."""
    return next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path.resolve()))


def test_work_handed_to_a_thread_made_at_import_fails_its_cell_and_its_worker_is_replaced(registry, tmp_path):
    """A plugin whose import leaves a pool's thread waiting in the standard library (no code of its own runs: the
    import passes), whose call then hands that old thread a busy loop of its own: the thread was there before the
    request, and runs the implementation's code after it, so the cell is an error row naming it and the worker is
    replaced, and the cells after it (test-good) run without the loop."""
    for f in ("adv_pool_thread.py", "good.py"):
        load_plugin_file(PLUGINS / f)
    try:
        assert not any("adv_pool_thread" in source for source, _ in registry.load_errors), registry.load_errors
        got, worker = _run_in_a_worker(tmp_path, ["torch-eager", "adv-pool-thread", "test-good"])
    finally:
        _module(PLUGINS / "adv_pool_thread.py").POOL.shutdown(wait=False)
    row = got["adv-pool-thread"]
    assert row["status"] == "error" and "left adv-pool_0 running its own code after the call" in row["message"], (
        row["message"])
    assert worker.starts == 2, worker.starts
    for impl in ("torch-eager", "test-good"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, (impl, got[impl]["message"])


def test_a_thread_a_call_leaves_beside_the_others_in_the_interleaved_sweeps_fails_its_cell(registry, tmp_path):
    """A plugin whose call in the group's interleaved sweeps (one request that times every implementation of the
    group, sample by sample) starts a thread that keeps the cores busy beside the next implementations' timed calls
    while the sweeps last, and ends with them, before the request does (so the check after the request sees nothing):
    the thread is seen right after the call that left it, outside the timed region; that cell is an error row naming
    it, and the group's other cells are sampled again without it (in the same worker) and keep their times."""
    for f in ("adv_sweep_thread.py", "good.py"):
        load_plugin_file(PLUGINS / f)
    got, worker = _run_in_a_worker(tmp_path, ["torch-eager", "adv-sweep-thread", "test-good"])
    row = got["adv-sweep-thread"]
    assert row["status"] == "error" and ("left adv-sweep-burner running its own code after its call in the group's "
                                         "interleaved sweeps") in row["message"], row["message"]
    assert pd.isna(row["median_ms"]) and worker.starts == 1, (row["median_ms"], worker.starts)
    for impl in ("torch-eager", "test-good"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, (impl, got[impl]["message"])
        assert got[impl]["median_ms"] > 0 and got[impl]["grain"] == "sample", got[impl]


@pytest.mark.parametrize("plugin, impl, left", [
    ("adv_call_thread.py", "adv-call-thread", "left adv-call-burner running its own code after the call"),
    ("adv_dispatcher_kernel.py", "adv-dispatcher-kernel", "tampered with torch's kernel of aten::mm"),
])
def test_inline_a_call_that_leaves_what_only_a_new_process_is_rid_of_stops_the_run(registry, tmp_path, plugin, impl,
                                                                                  left):
    """--inline (no worker process to replace): a call that leaves a thread running its own code, or a kernel no
    restore undoes, is its cell's error row, saying so; then the run stops with one line, before anything else is
    timed beside the thread or with the kernel (test-good, after it, gets no row: --resume runs it)."""
    for f in (plugin, "good.py"):
        load_plugin_file(PLUGINS / f)
    module = _module(PLUGINS / plugin)
    try:
        with pytest.raises(DeviceLost, match=f"--inline: the run stops, since gemm_out {impl} left in this process"):
            make_runner(tmp_path, modes=("fwd",), impls=["torch-eager", impl, "test-good"], isolate=False).run()
    finally:  # in this process: the thread stopped, the kernel gone with the object that holds it
        getattr(module, "STOP", threading.Event()).set()
        for thread in getattr(module, "_STARTED", []):
            thread.join()
        getattr(module, "_KEPT", []).clear()
    df, _, _ = load_run(tmp_path)
    got = {r["impl"]: r for _, r in df.iterrows()}
    row = got[impl]
    assert row["status"] == "error" and left in row["message"] and (
        "which --inline does not replace: the run times nothing more" in row["message"]), row["message"]
    assert "test-good" not in got, got.keys()
    assert guard.tampered() == []


def test_a_backend_fallback_registered_at_import_vetoes_the_plugin(registry, tmp_path):
    """A plugin whose import registers a backend fallback at the CPU key (imported by the worker only: in this
    process nothing would take it back): its load error says so, and the worker is started again without it, so the
    honest cells are timed without the fallback."""
    load_plugin_file(PLUGINS / "good.py")
    path = str((PLUGINS / "adv_fallback_import.py").resolve())
    registry.plugin_files.append(path)  # the worker imports it; this process does not
    got, worker = _run_in_a_worker(tmp_path, ["torch-eager", "test-good"])
    error = got[path]["message"]
    assert got[path]["status"] == "error" and ("tampered with torch's dispatcher: a backend fallback at CPU" in error
                                               and "while being imported" in error
                                               and "started again without this plugin" in error), error
    assert worker.starts == 2, worker.starts
    for impl in ("torch-eager", "test-good"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, (impl, got[impl]["message"])


def test_a_call_that_changes_the_harnesss_own_objects_fails_its_cell_and_they_are_put_back(registry, tmp_path):
    """Calls that walk up the stack into the harness's frames: one loosens the pass rule in its correctness call,
    one wraps torch-eager's timed call in a busy wait, one takes its own output checks away in the sweeps. Each cell is
    an error row naming what it changed (checked right after its code returns); the objects are put back before any
    other member runs, so torch-eager keeps its time and test-good passes."""
    load_plugin_file(PLUGINS / "adv_reaches_the_harness.py")
    load_plugin_file(PLUGINS / "good.py")
    impls = ["torch-eager", "adv-loosens-the-rule", "adv-slows-a-member", "adv-skips-its-checks", "test-good"]
    make_runner(tmp_path, modes=("fwd",), impls=impls, timing=TimingConfig(cpu_reps=6), isolate=False).run()
    df, _, _ = load_run(tmp_path)
    got = {r["impl"]: r for _, r in df.iterrows()}
    says = {"adv-loosens-the-rule": "the group's reference.torch_stats",
            "adv-slows-a-member": "torch-eager's sweep member.call",
            "adv-skips-its-checks": "adv-skips-its-checks's sweep member.after"}
    for impl, part in says.items():
        row = got[impl]
        assert row["status"] == "error" and "changed the harness's own data" in row["message"] and (
            part in row["message"]), (impl, row["message"])
    for impl in ("torch-eager", "test-good"):
        assert got[impl]["status"] == "ok" and got[impl]["correct"] is True, (impl, got[impl]["message"])
    eager, good = got["torch-eager"]["median_ms"], got["test-good"]["median_ms"]
    assert eager < good + 1.0, (eager, good)  # the same GEMM: not 2 ms slower
