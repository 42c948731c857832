"""The guard: what it watches (the harness's own modules too), what it restores, its cost, and the private clocks."""
import builtins
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest
import torch

import codabench.metrics
import codabench.registry
import codabench.stats
import codabench.timing
from codabench import guard, sweep
from codabench.clocks import ClockSampler
from codabench.discovery import load_plugin_file
from codabench.eager import TorchEager
from codabench.results import load_run
from codabench.timing import TimingConfig
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from workloads.ops import OPS
from harness_helpers import PLUGINS, isolated_registry, make_runner


@pytest.fixture(autouse=True)
def recorded():
    """A snapshot taken, and nothing left replaced by a test that fails half-way."""
    guard.snapshot()
    assert guard.tampered() == []
    yield
    guard.restore()


class OneRead:
    """The tester's cheat: a clock that returns a tenth of the time elapsed since it was put in, only when read from
    the timing loop, and (``persistent`` False) puts the original back after that one read, so that nothing is
    left for a check after the region to see."""

    def __init__(self, owner, name: str, loop_name: str, persistent: bool):
        self.owner, self.name, self.loop_name, self.persistent = owner, name, loop_name, persistent
        self.original = getattr(owner, name)
        self.t0 = self.original()
        setattr(owner, name, self)

    def __call__(self):
        now = self.original()
        if sys._getframe(1).f_code.co_name != self.loop_name:
            return now
        if not self.persistent:
            setattr(self.owner, self.name, self.original)
        return self.t0 + (now - self.t0) / 10


def plugin_call(loop_name: str, persistent: bool):
    """A timed call that sleeps 20 ms and, on its first call, puts a OneRead clock in place of ``time.perf_counter``
    and rebinds ``guard.private_clocks``."""
    done = []

    def call():
        if not done:
            done.append(True)
            OneRead(time, "perf_counter", loop_name, persistent)
            guard.private_clocks = lambda: pytest.fail("the loop looked its clocks up again")
        time.sleep(0.02)
    return call


def naive_loop(fn, n: int) -> float:
    """A timing loop that reads a module's clock at every use (as codabench.timing did)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def private_loop(fn, n: int) -> tuple[float, guard.Tampered | None]:
    """A timing loop as the guard's docstring prescribes: the private clocks bound to locals, verified around the
    region. Returns the time and what the verification after the region caught."""
    perf_counter, Event, record, elapsed_ms, synchronize, verify, *_ = guard.private_clocks()
    verify()
    t0 = perf_counter()
    for _ in range(n):
        fn()
    t1 = perf_counter()
    try:
        verify()
    except guard.Tampered as caught:
        return t1 - t0, caught
    return t1 - t0, None


@pytest.mark.parametrize("persistent", [False, True])
def test_a_loop_on_private_clocks_is_not_fooled_and_verify_catches_the_rebinding(persistent):
    private_clocks = guard.private_clocks
    try:
        fooled = naive_loop(plugin_call("naive_loop", persistent), 5)
        assert fooled < 0.05, fooled  # the cheat works on a loop that reads module attributes: 0.1 s looks like 0.01
        if not persistent:  # it undid itself: a check after the region sees nothing
            assert "time.perf_counter" not in guard.tampered()
        guard.restore()
        honest, caught = private_loop(plugin_call("private_loop", persistent), 5)
        assert honest >= 0.1, honest  # five sleeps of 20 ms, whatever the plugin rebound during the loop
        names = {"time.perf_counter", "codabench.guard.private_clocks"}  # never read by this loop: still in place
        assert caught is not None and set(caught.names) == names, caught
        assert str(caught).startswith("tampered with ")
        assert set(guard.restore()) == names
        assert time.perf_counter is guard._RECORD.clocks.perf_counter
    finally:
        guard.private_clocks = private_clocks
    again, caught = private_loop(lambda: time.sleep(0.01), 2)
    assert again >= 0.02 and caught is None


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("loop", ["measure", "sweeps"])
def test_the_harness_timing_loops_are_not_fooled(loop, persistent):
    """codabench.timing.measure and codabench.sweep.sample on the CPU, the timed call putting a clock that runs at a
    tenth of the speed in place of time.perf_counter on its first call: the samples stay honest (20 ms sleeps).
    Undone by the last call (nothing left for a check to see), it changed nothing; left in place, the region ends
    with Tampered."""
    cpu, calls = torch.device("cpu"), []
    last = 5 if loop == "measure" else 4  # measure's first call, then its 4 samples; the sweeps' 4 samples

    def call(_):
        calls.append(None)
        if len(calls) == 1:
            calls.append(OneRead(time, "perf_counter", "never", persistent=True))
        elif len(calls) == last + 1 and not persistent:
            time.perf_counter = calls[1].original
        time.sleep(0.02)

    members = [sweep.Member("cheat", call)]
    cfg = TimingConfig(cpu_reps=4)
    run = (lambda: codabench.timing.measure(call, None, cpu, cfg).samples_ms) if loop == "measure" else \
        (lambda: (sweep.sample(members, cpu, cfg, ClockSampler(cpu)), members[0].samples_ms)[1])
    if persistent:
        with pytest.raises(guard.Tampered) as caught:
            run()
        assert caught.value.names == ["time.perf_counter"]
    else:
        samples = run()
        assert len(samples) == 4 and min(samples) >= 19.0, samples  # 2 ms had the slowed clock reached the loop
        assert guard.tampered() == []


def _fake_profile(frame, event, arg):
    return None


def _swap_code():
    codabench.metrics.rel_err.__code__ = _fake_profile.__code__


def _with_closure():
    """A function of the harness that has a closure (the guard watches over a hundred functions), and its first cell's
    label."""
    f = next(f for f in guard._RECORD.functions if f.cells)
    return f, f"{f.label} (closure variable {f.code.co_freevars[0]})"


def _swap_cell():
    _with_closure()[0].cells[0].cell_contents = object()


def _swap_module():
    sys.modules["codabench.timing"] = type(sys)("codabench.timing")


def _shadow_builtin():
    codabench.timing.sorted = lambda *a, **k: []


def _mutate_kwdefaults():
    codabench.registry.register.__kwdefaults__["modes"] = ("fwd",)


def _shadow_registered():
    codabench.registry.Registry().add(TorchEager(OPS["gemm_out"])).run = lambda native: {}


def _remove_registered():
    registry = codabench.registry.Registry()
    registry.add(TorchEager(OPS["gemm_out"]))
    del registry.impls[("gemm_out", "torch-eager")]


def _replace_registry_table():
    registry = codabench.registry.Registry()
    registry.add(TorchEager(OPS["gemm_out"]))
    registry.impls = {}


def _override_aten_kernel():
    global _LIBRARY  # kept alive, as a plugin keeps it; the guard's restore destroys it
    _LIBRARY = torch.library.Library("aten", "IMPL")
    _LIBRARY.impl("mm", lambda a, b: torch.zeros(a.shape[0], b.shape[1]), "CPU")


def _enter_function_mode():
    TorchFunctionMode().__enter__()


def _enter_dispatch_mode():
    TorchDispatchMode().__enter__()


TAMPERING = {
    "a harness global": (lambda: setattr(codabench.timing, "first_call", lambda *a: 0.0),
                         "codabench.timing.first_call"),
    "a harness class attribute": (lambda: setattr(codabench.timing.Timing, "median", property(lambda self: 0.0)),
                                  "codabench.timing.Timing.median"),
    "a harness function's code": (_swap_code, "codabench.metrics.rel_err.__code__"),
    "a harness function's defaults": (lambda: setattr(codabench.timing.measure, "__defaults__", (None, None)),
                                      "codabench.timing.measure.__defaults__"),
    "a harness function's keyword defaults": (_mutate_kwdefaults, "codabench.registry.register.__kwdefaults__"),
    "a closure cell": (_swap_cell, lambda: _with_closure()[1]),  # found once the fixture took the snapshot
    "sys.settrace": (lambda: sys.settrace(_fake_profile), "sys.settrace (a hook is set)"),
    "sys.setprofile": (lambda: sys.setprofile(_fake_profile), "sys.setprofile (a hook is set)"),
    "threading.settrace": (lambda: threading.settrace(_fake_profile), "threading.settrace (a hook is set)"),
    "a builtin": (lambda: setattr(builtins, "sorted", lambda *a, **k: []), "builtins.sorted"),
    "a builtin shadowed in a harness module": (_shadow_builtin, "codabench.timing.sorted (shadows the builtin)"),
    "a harness module in sys.modules": (_swap_module, "sys.modules['codabench.timing']"),
    "a torch function": (lambda: setattr(codabench.timing.torch.cuda, "synchronize", lambda *a: None),
                         "torch.cuda.synchronize"),
    "an entry of a harness table": (lambda: codabench.metrics.FLOOR.__setitem__(torch.float32, 1.0),
                                    "codabench.metrics.FLOOR[torch.float32]"),
    "an element of a harness list": (lambda: codabench.stats._T975.__setitem__(0, 0.0), "codabench.stats._T975 (a list)"),
    "an op of the catalogue replaced": (lambda: OPS.__setitem__("gemm_out", OPS["gemm_qkv"]),
                                        "workloads.ops.OPS['gemm_out']"),
    "an op's method set on the op": (lambda: setattr(OPS["gemm_out"], "reference", lambda *a, **k: {}),
                                     "workloads.ops.OPS['gemm_out'].reference"),
    "an op's class swapped": (lambda: setattr(OPS["gemm_out"], "__class__", type(OPS["gemm_qkv"])),
                              "workloads.ops.OPS['gemm_out'].__class__"),
    "the data of an op's class": (lambda: setattr(type(OPS["gemm_out"]), "outputs", ()),
                                  "workloads.ops.gemm.Gemm_gemm_out.outputs"),
    "a registered implementation's method shadowed": (
        _shadow_registered, "the registered implementation ('gemm_out', 'torch-eager').run (shadows its method)"),
    "a registered implementation removed": (_remove_registered,
                                            "the registered implementation ('gemm_out', 'torch-eager') (removed)"),
    "a registry's table replaced": (_replace_registry_table, "the registry's table of implementations (replaced)"),
    "a kernel of aten": (_override_aten_kernel, "torch's kernel of aten::mm (replaced in its dispatcher)"),
    "an environment variable": (lambda: os.environ.__setitem__("TRITON_INTERPRET", "0"),
                                "os.environ['TRITON_INTERPRET']"),
    "an environment variable that decides what runs, added": (
        lambda: os.environ.__setitem__("CODABENCH_ADDED_BY_A_PLUGIN", "1"), "os.environ['CODABENCH_ADDED_BY_A_PLUGIN']"),
    "a torch function mode": (_enter_function_mode, "torch function modes (a mode is entered)"),
    "a torch dispatch mode": (_enter_dispatch_mode, "torch dispatch modes (a mode is entered)"),
    "torch's default dtype": (lambda: torch.set_default_dtype(torch.float64), "torch.get_default_dtype"),
    "torch's threads": (lambda: torch.set_num_threads(torch.get_num_threads() + 1), "torch.get_num_threads"),
    "the float32 matmul precision": (lambda: torch.set_float32_matmul_precision("medium"),
                                     "the float32 precision (torch.backends.*.fp32_precision)"),
    "oneDNN's fp32 precision": (lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
                                "the float32 precision (torch.backends.*.fp32_precision)"),
    "a global module hook": (lambda: torch.nn.modules.module.register_module_forward_hook(lambda *a: None),
                             "torch.nn.modules.module._global_forward_hooks"),
}


@pytest.mark.parametrize("kind", list(TAMPERING))
def test_the_guard_sees_and_restores(kind):
    tamper, label = TAMPERING[kind]
    label = label() if callable(label) else label
    timing_module, rel_err_code = sys.modules["codabench.timing"], codabench.metrics.rel_err.__code__
    tamper()
    try:
        assert label in guard.tampered(), guard.tampered()
        with pytest.raises(guard.Tampered):
            guard.verify_clocks()
        assert label in guard.restore()
    finally:
        sys.settrace(None), sys.setprofile(None)  # a failed assertion must not leave the hook on pytest
    assert guard.tampered() == []
    assert sys.modules["codabench.timing"] is timing_module and codabench.metrics.rel_err.__code__ is rel_err_code
    assert sys.gettrace() is None and sys.getprofile() is None and threading.gettrace() is None
    assert codabench.registry.register.__kwdefaults__["modes"] is None and not hasattr(codabench.timing, "sorted")
    assert codabench.metrics.FLOOR[torch.float32] == 1e-6 and OPS["gemm_out"].name == "gemm_out"
    assert "reference" not in vars(OPS["gemm_out"]) and type(OPS["gemm_out"]).outputs == ("out",)
    assert torch._C._len_torch_function_stack() == 0 and torch._C._len_torch_dispatch_stack() == 0
    assert torch.get_default_dtype() is torch.float32 and torch.get_float32_matmul_precision() == "highest"
    assert not torch.nn.modules.module._global_forward_hooks
    assert torch.mm(torch.ones(1, 1), torch.ones(1, 1)).item() == 1.0
    meta = torch.empty(2, 2, device="meta")  # torch's own Meta kernels (torch.library's too) were left alone
    assert torch.mm(meta, meta).shape == (2, 2) and torch.floor_divide(meta, 2).shape == (2, 2)


def test_the_state_the_harness_adopts_for_a_request_is_watched_and_put_back():
    """On the CPU each request runs with NaN-filled allocations (deterministic algorithms on), taken as the harness's
    state for it: no tampering by itself, but a plugin that turns it off inside is caught and the state put back;
    after the block the process's own state and record hold again."""
    from codabench.correctness import nan_filled_allocations

    label = "torch deterministic algorithms"
    with guard.adopted(nan_filled_allocations()):
        assert torch.are_deterministic_algorithms_enabled() and guard.tampered() == []
        guard.verify_clocks()
        torch.use_deterministic_algorithms(False)
        assert label in guard.tampered()
        with pytest.raises(guard.Tampered):
            guard.verify_clocks()
        assert label in guard.restore()
        assert torch.are_deterministic_algorithms_enabled()
    assert not torch.are_deterministic_algorithms_enabled() and guard.tampered() == []


def test_defaults_and_locations_a_library_adds_to_the_environment_are_not_tampering(monkeypatch):
    """Libraries set variables of their own at first use (Inductor: ``TORCH_WARM_POOL``, ``CUBLAS_WORKSPACE_CONFIG``,
    ``TRITON_CACHE_DIR`` where unset): added, not deciding what runs, they are left alone; changing one the run
    started with is not."""
    names = ("TORCH_WARM_POOL", "CUBLAS_WORKSPACE_CONFIG", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    guard.snapshot(refresh=True)
    try:
        os.environ.update(TORCH_WARM_POOL="0", CUBLAS_WORKSPACE_CONFIG=":4096:8", TRITON_CACHE_DIR="/tmp/x",
                          TRITON_PTXAS_PATH="/tmp/ptxas")
        assert guard.tampered() == []
        guard.snapshot(refresh=True)
        os.environ["TRITON_CACHE_DIR"] = "/tmp/y"
        assert guard.tampered() == ["os.environ['TRITON_CACHE_DIR']"]
        guard.restore()
        assert os.environ["TRITON_CACHE_DIR"] == "/tmp/x"
    finally:
        for name in names:
            os.environ.pop(name, None)
        guard.snapshot(refresh=True)  # the record without them, before monkeypatch puts the run's values back


def test_own_threads_are_those_started_since_that_run_code_outside_the_libraries():
    """A thread started since the record that runs code of this file counts, and so does a Timer set to run it later
    (waiting in the standard library until then); a thread that waits in the standard library on its own (its
    target is the library's), a Timer of a library's function, and a thread that ended do not."""
    before = guard.running_threads()
    stop = threading.Event()
    waits = threading.Thread(target=stop.wait, name="waits-in-the-library")
    library_timer = threading.Timer(60, print)
    own_timer = threading.Timer(60, lambda: None)
    own_timer.name = "fires-here-later"
    spinning = threading.Thread(target=lambda: [None for _ in iter(lambda: stop.is_set(), True)], name="spins-here")
    for t in (waits, library_timer, own_timer, spinning):
        t.start()
    try:
        assert sorted(guard.own_threads(before)) == ["fires-here-later", "spins-here"]
    finally:
        stop.set(), library_timer.cancel(), own_timer.cancel()
        for t in (waits, library_timer, own_timer, spinning):
            t.join()
    assert guard.own_threads(before) == []


def test_a_thread_whose_own_code_waits_in_a_library_call_is_the_library_s(tmp_path):
    """As FlashInfer's JIT builds (kernels/flashinfer.py: a pool's thread runs a function of the plugin that calls
    into flashinfer, which waits for the compiler): a thread whose own frame only waits for an installed package's
    call is that package's while it does, and the check does not flag it; the same thread back in its own code is
    flagged (a busy loop of its own after that call)."""
    from concurrent.futures import ThreadPoolExecutor

    from filelock import FileLock  # an installed package that waits in its own Python code (a poll with sleeps)

    lock_path, built, stop = str(tmp_path / "build.lock"), threading.Event(), threading.Event()
    held = FileLock(lock_path)
    held.acquire()

    def build():  # a plugin's wrapper around a library's long call, then a loop of its own
        with FileLock(lock_path, thread_local=False):
            pass
        built.set()
        while not stop.is_set():
            pass

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jit-build")
    before = guard.running_threads()
    try:
        pool.submit(build)
        time.sleep(0.2)
        assert not built.is_set() and guard.own_threads(before) == []  # in filelock's wait, though build is below
        held.release()
        assert built.wait(10)
        assert guard.own_threads(before) == ["jit-build_0"]  # out of the library's call, spinning in build
    finally:
        stop.set()
        held.release()
        pool.shutdown(wait=True)


def test_a_plugin_installed_as_a_package_runs_code_of_its_own(tmp_path, monkeypatch):
    """A plugin's files under the installed packages' folders look like a library's; given as the implementation's
    own (guard.module_files of the module its registry entry came from: the file and its package's folder), a
    thread running them counts."""
    package = tmp_path / "site" / "installed_plugin"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("def spin(stop):\n    while not stop.is_set():\n        pass\n")
    (package / "impl.py").write_text("")
    stdlib, packages = guard._roots()
    monkeypatch.setattr(guard, "_roots", lambda: (stdlib, packages + (str(tmp_path / "site") + os.sep,)))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    import installed_plugin.helpers
    import installed_plugin.impl  # noqa: F401  (the module that registers: its package's helpers are its own too)

    stop, before = threading.Event(), guard.running_threads()
    thread = threading.Thread(target=installed_plugin.helpers.spin, args=(stop,), name="installed-spinner")
    thread.start()
    try:
        assert guard.own_threads(before) == []
        own = guard.module_files(["installed_plugin.impl", "codabench.eager"])
        assert str(package) + os.sep in own and not any("codabench" in f for f in own), own
        assert guard.own_threads(before, own) == ["installed-spinner"]
    finally:
        stop.set()
        thread.join()
        for name in ("installed_plugin", "installed_plugin.helpers", "installed_plugin.impl"):
            sys.modules.pop(name, None)


def test_an_old_thread_that_holds_work_of_its_own_counts_and_a_library_s_does_not():
    """Threads that were there before (``before`` empty: every thread): a pool's thread kept in a library call
    (``time.sleep``) with work of this file queued behind it counts, as does a thread waiting on a ``queue.Queue``
    that holds such work; the same with a library's work queued (``print``) does not, nor an idle pool."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    own_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="own-work")
    library_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="library-work")
    for pool in (own_pool, library_pool):
        pool.submit(int).result()  # the pool's thread, idle in the standard library
    waiting = queue.Queue()
    waiting.put(spin)
    joins = threading.Thread(target=waiting.join, name="joins-a-queue")
    try:
        assert not {"own-work_0", "library-work_0"} & set(guard.own_threads(()))
        own_pool.submit(time.sleep, 0.5), own_pool.submit(spin)
        library_pool.submit(time.sleep, 0.5), library_pool.submit(print, end="")
        joins.start()
        time.sleep(0.05)
        found = guard.own_threads(())
        assert "own-work_0" in found and "joins-a-queue" in found and "library-work_0" not in found, found
    finally:
        stop.set()
        waiting.get(), waiting.task_done()
        joins.join()
        for pool in (own_pool, library_pool):
            pool.shutdown(wait=True)


def test_a_backend_fallback_is_seen_and_no_restore_undoes_it():
    """A backend fallback registered at a computing key (CPU: the kernel of every op without a CPU kernel of its
    own): the check sees it (inside the timing loops too), no restore undoes it (``lasting``: the worker is
    replaced), and it is gone with the Library that holds it."""
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(lambda op, *args, **kwargs: op(*args, **kwargs), dispatch_key="CPU")
    label = ("torch's dispatcher: a backend fallback at CPU (the kernel of every op that has none of its own "
             "there)")
    try:
        assert guard.tampered() == [label]
        with pytest.raises(guard.Tampered, match="a backend fallback at CPU"):
            guard.verify_clocks()
        assert guard.restore() == [label] and guard.lasting([label]) == [label]
    finally:
        fallback._destroy()
    assert guard.tampered() == []


def test_what_torch_compile_registers_is_not_tampering():
    """torch.compile (Inductor) registers kernels and fallbacks of its own at first use: none at a computing key of
    the ops the guard reads, and no backend fallback there."""
    fallbacks = guard._fallbacks()
    compiled = torch.compile(lambda x, w: torch.nn.functional.linear(x, w).relu(), fullgraph=True)
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    assert torch.allclose(compiled(x, w), torch.nn.functional.linear(x, w).relu())
    assert guard._fallbacks() == fallbacks and guard.tampered() == []


def test_a_kernel_registered_in_the_dispatcher_directly_is_seen_though_no_restore_undoes_it():
    """Kernels registered through torch._C, not torch.library: one over aten::mm's CPU kernel that copies torch's own
    file and line, one that gives aten::linear (CompositeImplicitAutograd) a CPU kernel of its own. The dispatcher
    lists them (and the one each shadows), the check sees both (the GEMMs also inside the timing loops), no restore
    undoes them (``lasting``: the worker is replaced), and they are gone with the objects that hold them. A kernel at
    a key that computes nothing on a plain tensor (Meta) is not tampering."""
    torch_cpu_mm = torch._C._dispatch_dump("aten::mm").split("\nCPU: registered at ", 1)[1].split(" :: ")[0]
    file, line = torch_cpu_mm.rsplit(":", 1)
    forged = torch._C._dispatch_library("IMPL", "aten", "CPU", file, int(line))
    forged.impl("mm", torch._C.DispatchKey.CPU, lambda a, b: torch.zeros(a.shape[0], b.shape[1]))
    linear = torch._C._dispatch_library("IMPL", "aten", "")
    linear.impl("linear", torch._C.DispatchKey.CPU, lambda x, w, b=None: torch.zeros(x.shape[0], w.shape[0]))
    label = "torch's kernel of aten::linear, aten::mm (replaced in its dispatcher)"
    try:
        assert guard.tampered() == [label]
        with pytest.raises(guard.Tampered, match="aten::mm"):
            guard.verify_clocks()
        assert guard.restore() == [label] and guard.lasting([label]) == [label]
        assert "cannot be undone in this process" in guard.tamper_message([label], [label])
    finally:
        del forged, linear
    assert guard.tampered() == [] and torch.mm(torch.ones(1, 1), torch.ones(1, 1)).item() == 1.0
    meta = torch._C._dispatch_library("IMPL", "aten", "Meta")
    meta.impl("mm", torch._C.DispatchKey.Meta, lambda a, b: a)
    try:
        assert guard.tampered() == []
    finally:
        del meta


def test_the_spin_before_each_sample_is_the_original_builtin_not_a_lookup():
    """The lead's spin runs before each sample's start event (codabench/sweep.py): a ``torch._C._cuda_sleep``
    replaced after the snapshot (to enqueue a plugin's work there, untimed) does not reach the loops. The clocks are
    recorded once per process, so in a new one, where a marker stands in for the CUDA builtin (absent on the CPU)."""
    code = ("import torch\n"
            "from codabench import guard\n"
            "original = lambda cycles: None\n"
            "torch._C._cuda_sleep = original\n"
            "guard.snapshot()\n"
            "torch._C._cuda_sleep = lambda cycles: None\n"
            "assert guard.private_clocks().sleep is original, guard.private_clocks().sleep\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_restore_can_leave_what_it_is_not_asked_to():
    clock = codabench.timing.first_call
    codabench.timing.first_call = lambda *a: 0.0
    builtins.sorted, original = (lambda *a, **k: []), builtins.sorted
    assert guard.restore(["builtins.sorted"]) == ["builtins.sorted"]
    assert builtins.sorted is original and guard.tampered() == ["codabench.timing.first_call"]
    guard.restore()
    assert codabench.timing.first_call is clock


def test_the_check_around_timed_regions_watches_the_harness():
    """verify_clocks (around every timed region) reads the harness's references and functions, and finds them
    unchanged. (What it costs is a figure of docs/plugins.md, not a test: it depends on the machine.)"""
    guard.verify_clocks()
    assert len(guard._RECORD.harness) > 500 and len(guard._RECORD.functions) > 100


def test_cheats_on_the_harness_itself_are_error_rows(tmp_path):
    """Plugins that tamper with the harness during their calls (inline: in this process): each cell is an error row
    naming what was replaced, and the honest cell after them keeps its time."""
    alarm = signal.getsignal(signal.SIGALRM)
    with isolated_registry():
        load_plugin_file(PLUGINS / "harness_cheats.py")
        load_plugin_file(PLUGINS / "good.py")
        impls = ["cheat-builtin", "cheat-code-swap", "cheat-harness-clock", "cheat-profile-hook", "cheat-anomaly-mode",
                 "cheat-signal-handler", "cheat-interval-timer", "cheat-random-source", "test-good"]
        make_runner(tmp_path, modes=("fwd",), impls=impls, isolate=False).run()
    df, _, _ = load_run(tmp_path)
    got = {r["impl"]: r for _, r in df.iterrows()}
    expect = {"cheat-builtin": "builtins.sorted", "cheat-code-swap": "codabench.metrics.rel_err.__code__",
              "cheat-harness-clock": "codabench.guard.private_clocks", "cheat-profile-hook": "sys.setprofile",
              "cheat-anomaly-mode": "set_detect_anomaly", "cheat-signal-handler": "signal handlers",
              "cheat-interval-timer": "interval timers", "cheat-random-source": "secrets.SystemRandom"}
    for impl, text in expect.items():
        assert got[impl]["status"] == "error" and text in got[impl]["message"], (impl, got[impl]["message"])
        assert pd.isna(got[impl]["median_ms"]), impl
    assert got["test-good"]["status"] == "ok" and got["test-good"]["correct"] is True
    assert sys.getprofile() is None and guard.tampered() == []
    assert not torch.is_anomaly_enabled() and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is alarm and secrets.SystemRandom is random.SystemRandom
