"""The harness's own references to its clocks, torch functions and code, taken before any plugin loads.

A plugin could make itself look fast or correct by replacing what the harness relies on: ``time.perf_counter``
returning less, ``torch.cuda.Event.elapsed_time`` scaled down, ``torch.equal`` always True, ``F.rms_norm`` made cheap
so that the PyTorch baselines slow down, the harness's own bound clock (``codabench.timing.perf_counter``) or a
function of the harness given another ``__code__``, a trace or profile hook that runs inside the timed region.
:func:`snapshot` (called before the first plugin import) records, and precomputes the list it watches:

- every callable attribute of the modules and classes in :data:`GUARDED`, and the names in :data:`HOOK_FUNCTIONS`;
- every module under ``codabench.`` and ``workloads.`` loaded at that time (:func:`harness_module`): the identity of
  each of its globals (and a global added later under a builtin's name, which would shadow it), each method,
  property and other callable of the classes it defines (not their data: class-level caches change as they should), and for each function or method it defines its ``__code__``, ``__defaults__``,
  ``__kwdefaults__`` and closure cell contents;
- the contents of every table of those modules (each module-level dict, list and set, and those nested in them:
  the pass rule's floors, the t quantiles, the op catalogue ``OPS``): each entry's identity, none removed or
  replaced (a dict may gain entries: an op a plugin adds to ``OPS`` is its own);
- every op of the catalogue (:data:`workloads.ops.OPS`): its class and its attributes, and every attribute, data
  included, of each class of the harness it derives from (what an op computes, returns and compares: a
  ``reference`` set on the op or its class would move the float64 reference, PyTorch's results and the error
  allowed, all at once);
- the ``sys.modules`` entry of each of those modules, every name of ``builtins``, and the trace and profile hooks
  (``sys.gettrace()``, ``sys.getprofile()``, ``threading.gettrace()``, ``threading.getprofile()``);
- the process-wide state that changes what or how fast every later call computes: the environment variables
  that configure the stack (:func:`_environ_changes`: none the run started with changed or removed, none added that
  decides what runs, such as ``TRITON_INTERPRET``, which decides whether Triton kernels run at all), and
  (:data:`PROCESS_STATE`) torch's: the torch-function and dispatch mode stacks (a mode left entered sees every torch call of every cell, the float64
  reference's too), the global ``nn.Module`` hooks, the default dtype, the intra-op threads, the float32 matmul
  precision and the TF32 and reduced-precision flags, cuDNN's and oneDNN's switches, deterministic algorithms,
  autograd's anomaly detection, the Python signal handlers and the interval timers (a handler runs the plugin's code
  inside or after any later call), and the computing kernels of torch's own ops (:func:`_replaced_kernels`): read from the dispatcher itself for the ops
  the references and baselines compute with (:data:`KERNEL_GEMMS`, :data:`KERNEL_OPS`), so that a kernel registered
  over one of torch's is seen however it came there (``torch.library``, ``torch._C._dispatch_library``, a compiled
  extension), and through ``torch.library`` for every other op; and the dispatch keys that hold a backend fallback
  (:func:`_fallbacks`: a fallback registered at a computing key, such as CPU, is the kernel of every op without one of
  its own there, and nothing takes it back);
- the registered implementations (:func:`watch_registered`, from :meth:`codabench.registry.Registry.add`): a
  registry's entries are append-only, none removed, replaced or changed, and a name once registered stays taken.

:func:`tampered` lists what now differs, :func:`restore` puts the originals back (so the baselines' times stay true),
:func:`tamper_message` is the error row's text. The harness's own objects that decide a verdict (the group's
reference, the sweeps' members, ...) and, in the sweeps, torch-compile's graphs are held by a :class:`Seal` around
the plugin code that could reach them, checked right after it returns.

What no restore undoes (:func:`lasting`: a kernel registered through ``torch._C`` or a compiled extension, which
holds no handle this module can destroy) ends the process that holds it: the worker is replaced. Discovery checks
after every plugin import (the plugin gets a load error and the originals are restored before the next import; a
plugin whose import left what cannot be restored is imported by no later worker); the worker checks after every
request of every cell (the cell gets an error row). One check costs about a millisecond and a half on a GPU machine's
host (docs/plugins.md): the check inside the timing loops (:func:`verify_clocks`) reads the dispatcher's kernels of
the GEMMs alone, the check after each request and import those of every watched op (about a millisecond more).

Threads are checked apart (:func:`stray_threads`, :func:`own_threads`): a thread that a plugin's import started and
left running its own code, or that runs an implementation's code after a request the worker serves (its correctness
pass, first call, timing), or holds such code as work queued for it, slows every later cell: the check after a
request looks at every thread but the caller's, new or old (a pool made at import, idle then, and handed work by a
call); the plugin gets a load error or the cell an error row, and the worker that holds the thread is replaced. Within
a request that times several implementations in turn (:mod:`codabench.sweep`), the threads are looked at after each
call too (:attr:`Clocks.strays`), outside the timed region: one that a call left runs beside the next call.

The timing loops read their clocks through :func:`private_clocks`, originals recorded by :func:`snapshot`, so that a
replacement in place during a measurement, even one undone before anyone checks, does not reach them::

    def timing_loop(fn, state, n):
        perf_counter, Event, record, elapsed_ms, synchronize, verify, wait, sleep = guard.private_clocks()  # LOCALS
        verify()                               # raises guard.Tampered if anything the loop relies on was replaced
        t0 = perf_counter()
        for _ in range(n):
            fn(state)                          # the plugin runs: it may rebind any module attribute, not our locals
        t1 = perf_counter()
        verify()                               # a rebinding still in place: Tampered, the region does not count
        return (t1 - t0) * 1e3 / n

Bind the callables to local variables at the top of each timing function, before any plugin code runs in it: a
plugin can rebind module attributes and class attributes, not the locals of a running frame. Call ``verify`` (the
same function as :func:`verify_clocks`, bound before the plugin runs) before and after every timed region; the
worker's check after the request restores whatever was replaced.

What this cannot catch is a plugin that edits the records of this module itself in place (its dictionaries and
lists); only a process boundary stops that.
"""
from __future__ import annotations

import builtins
import collections
import contextlib
import csv
import functools
import gc
import hashlib
import json
import math
import os
import queue
import random
import secrets
import signal
import site
import statistics
import sys
import sysconfig
import threading
import time
import types
from typing import Any, Callable, Collection, Iterable, Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F

GUARDED: dict[str, Any] = {
    "time": time, "math": math, "statistics": statistics, "random": random, "random.Random": random.Random,
    "random.SystemRandom": random.SystemRandom, "secrets": secrets, "csv": csv, "csv.DictWriter": csv.DictWriter,
    "json": json, "json.JSONEncoder": json.JSONEncoder, "hashlib": hashlib, "torch": torch, "torch.nn.functional": F,
    "torch.linalg": torch.linalg, "torch.autograd": torch.autograd, "torch.cuda": torch.cuda,
    "torch.cuda.Event": torch.cuda.Event, "torch.cuda.Stream": torch.cuda.Stream, "torch.Tensor": torch.Tensor,
    **{f"{c.__module__}.{c.__qualname__}": c for c in torch.cuda.Event.__mro__[1:-1]},
}
"""Where the harness's clocks, synchronization, comparisons, reference math, random draws (the timing inputs' seeds,
which timed calls are rechecked) and the run folder's writers (csv, json, the digests) live (every callable
attribute, special methods included)."""
HOOK_FUNCTIONS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "sys": (sys, ("settrace", "setprofile", "gettrace", "getprofile")),
    "threading": (threading, ("settrace", "setprofile", "gettrace", "getprofile")),
}
"""The functions that set or show trace and profile hooks (a plugin could hide its hook behind a false getter)."""
HARNESS_PACKAGES = ("codabench", "workloads")


def _mode_stack(length: Callable[[], int], at: Callable[[int], Any]) -> Callable[[], tuple]:
    return lambda: tuple(at(i) for i in range(length()))


def _put_mode_stack(length: Callable[[], int], pop: Callable[[], Any],
                    push: Callable[[Any], None]) -> Callable[[tuple], None]:
    def put(modes: tuple) -> None:
        while length():
            pop()
        for mode in modes:
            push(mode)
    return put


def _global_hooks(module: types.ModuleType, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """A dict of hooks that a module keeps as a global (``torch.nn.modules.module._global_forward_hooks``): the dict
    and its entries, and how to put both back."""
    def get() -> tuple:
        hooks = getattr(module, name)
        return hooks, tuple(hooks.items())

    def put(state: tuple) -> None:
        hooks, items = state
        setattr(module, name, hooks)
        hooks.clear()
        hooks.update(items)
    return get, put


FP32_PRECISIONS = (("generic", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"),
                   ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"))
"""The backends and ops of ``torch.backends.*.fp32_precision`` (TF32, bf16 for float32 math; ``allow_tf32`` reads
them)."""


def _fp32_precision() -> tuple[Callable[[], tuple], Callable[[tuple], None]]:
    """``torch.get_float32_matmul_precision`` (the legacy setting: "mixed" where it raises, once the backends differ)
    and each backend's ``fp32_precision``; put back in that order (the legacy setter sets the backends too)."""
    C = torch._C
    get_legacy, set_legacy = C._get_float32_matmul_precision, C._set_float32_matmul_precision
    get_one, set_one = C._get_fp32_precision_getter, C._set_fp32_precision_setter

    def get() -> tuple:
        try:
            legacy = get_legacy()
        except RuntimeError:
            legacy = "mixed"
        return (legacy, *(get_one(backend, op) for backend, op in FP32_PRECISIONS))

    def put(values: tuple) -> None:
        set_legacy(values[0])
        for (backend, op), value in zip(FP32_PRECISIONS, values[1:]):
            set_one(backend, op, value)
    return get, put


ENVIRON_PREFIXES = ("CODABENCH", "TRITON", "TORCH", "PYTORCH", "CUDA", "CUBLAS", "CUDNN", "NCCL", "NVIDIA", "OMP_",
                    "MKL_", "KMP_", "LD_", "PYTHON")
"""The environment variables that configure the harness, torch, Triton, CUDA and the math libraries, by prefix (not
the others: pytest, for one, sets ``PYTEST_CURRENT_TEST`` around each test). None of those the run started with may
be changed or removed."""
DECIDING_PREFIXES = ("CODABENCH", "TRITON_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE", "CUDA_LAUNCH_BLOCKING")
"""Of those, the ones that decide what the harness and the compilers run (``TRITON_INTERPRET``, the CODA strategy,
torch.compile's switches), which may not be added either. Others may: libraries set defaults of their own at first
use (Inductor's ``CUBLAS_WORKSPACE_CONFIG``, ``TORCH_WARM_POOL``), as they set file locations (names ending in
:data:`LOCATION_SUFFIXES`: ``TRITON_CACHE_DIR``, ``TRITON_PTXAS_PATH``)."""
LOCATION_SUFFIXES = ("_DIR", "_PATH", "_HOME")


def _settings_in_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(ENVIRON_PREFIXES)}


def _environ_changes(recorded: dict[str, str]) -> list[str]:
    """The variables (:data:`ENVIRON_PREFIXES`) changed or removed since ``recorded``, and those added that decide
    what runs (:data:`DECIDING_PREFIXES`, not a location)."""
    now = _settings_in_environ()
    added = [k for k in now if k not in recorded and k.startswith(DECIDING_PREFIXES)
             and not k.endswith(LOCATION_SUFFIXES)]
    return sorted([k for k, v in recorded.items() if now.get(k) != v] + added)


def _put_environ(recorded: dict[str, str], name: str) -> None:
    if name in recorded:
        os.environ[name] = recorded[name]
    else:
        os.environ.pop(name, None)


_SIGNALS = sorted(set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP})
_TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
_getsignal, _signal, _getitimer, _setitimer = signal.getsignal, signal.signal, signal.getitimer, signal.setitimer


def _signal_handlers() -> tuple:
    """The Python handler of every signal: one a plugin installs runs inside, or after, any later call (the work of
    its own call deferred there, or time burnt in another's)."""
    return tuple(_getsignal(s) for s in _SIGNALS)


def _put_signal_handlers(handlers: tuple) -> None:
    for s, h in zip(_SIGNALS, handlers):
        if _getsignal(s) is not h and h is not None:
            _signal(s, h)


def _armed_timers() -> tuple:
    """Which interval timers are armed (a timer's countdown moves, whether it is armed does not)."""
    return tuple(_getitimer(t) != (0.0, 0.0) for t in _TIMERS)


def _put_timers(armed: tuple) -> None:
    for t, was in zip(_TIMERS, armed):
        if not was:
            _setitimer(t, 0.0)


def _process_state() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """label: (getter, setter) of each piece of :data:`PROCESS_STATE`, bound to torch's own functions now (the guard
    is imported before any plugin)."""
    C, nn_module = torch._C, sys.modules["torch.nn.modules.module"]
    state = {
        "torch function modes (a mode is entered)": (
            _mode_stack(C._len_torch_function_stack, C._get_function_stack_at),
            _put_mode_stack(C._len_torch_function_stack, C._pop_torch_function_stack,
                            C._push_on_torch_function_stack)),
        "torch dispatch modes (a mode is entered)": (
            _mode_stack(C._len_torch_dispatch_stack, C._get_dispatch_stack_at),
            _put_mode_stack(C._len_torch_dispatch_stack, lambda: C._pop_torch_dispatch_stack(None),
                            C._push_on_torch_dispatch_stack)),
        "torch.get_default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "torch.get_num_threads": (torch.get_num_threads, torch.set_num_threads),
        "the float32 precision (torch.backends.*.fp32_precision)": _fp32_precision(),
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction": (
            C._get_cublas_allow_fp16_reduced_precision_reduction,
            lambda v: C._set_cublas_allow_fp16_reduced_precision_reduction(*v)),
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction": (
            C._get_cublas_allow_bf16_reduced_precision_reduction,
            lambda v: C._set_cublas_allow_bf16_reduced_precision_reduction(*v)),
        "torch.backends.cudnn.enabled": (C._get_cudnn_enabled, C._set_cudnn_enabled),
        "torch.backends.cudnn.benchmark": (C._get_cudnn_benchmark, C._set_cudnn_benchmark),
        "torch.backends.cudnn.deterministic": (C._get_cudnn_deterministic, C._set_cudnn_deterministic),
        "torch.backends.mkldnn.enabled": (C._get_mkldnn_enabled, C._set_mkldnn_enabled),
        "torch deterministic algorithms": (
            lambda: (C._get_deterministic_algorithms(), C._get_deterministic_algorithms_warn_only()),
            lambda v: C._set_deterministic_algorithms(v[0], warn_only=v[1])),
        "torch.utils.deterministic.fill_uninitialized_memory": (C._get_deterministic_fill_uninitialized_memory,
                                                                C._set_deterministic_fill_uninitialized_memory),
        "torch.autograd.set_detect_anomaly": (
            lambda: (C.is_anomaly_enabled(), C.is_anomaly_check_nan_enabled()), lambda v: C.set_anomaly_enabled(*v)),
        "interval timers (signal.setitimer)": (_armed_timers, _put_timers),  # disarmed before the handlers go back
        "signal handlers (signal.signal)": (_signal_handlers, _put_signal_handlers),
    }
    for name in [n for n in vars(nn_module) if n.startswith("_global_") and n.endswith("_hooks")]:
        state[f"torch.nn.modules.module.{name}"] = _global_hooks(nn_module, name)
    return state


COMPUTE_KEYS = ("CPU", "CUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd",
                "CompositeExplicitAutogradNonFunctional", "Autograd", "AutogradCPU", "AutogradCUDA", "AutogradOther",
                "ADInplaceOrView", "AutocastCPU", "AutocastCUDA", "BackendSelect", "")
"""Dispatch keys whose kernel computes, or decides, an op's values on the ordinary path of a CPU or CUDA tensor ("":
torch.library's default, CompositeImplicitAutograd). Not these: ``Meta``, ``Python``, ``Functionalize`` and the other
keys of fake tensors, tracing and compilation, where libraries register kernels of their own at first use."""
KERNEL_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation", "_scaled_mm", "dot")
"""The aten GEMMs whose kernels the guard reads from the dispatcher, every overload (the ``out=`` ones too: the code
torch.compile generates calls them)."""
KERNEL_OPS = ("rms_norm", "_fused_rms_norm", "softmax", "_softmax", "log_softmax", "_log_softmax",
              "_log_softmax_backward_data", "_softmax_backward_data", "logsumexp", "cross_entropy_loss", "nll_loss",
              "nll_loss_nd", "nll_loss_forward", "nll_loss_backward", "scaled_dot_product_attention",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "mul", "add", "sub", "rsub", "div", "neg", "exp", "pow",
              "rsqrt", "reciprocal", "sigmoid", "silu", "silu_backward", "gelu", "gelu_backward", "cos", "sin",
              "clamp", "sum", "mean", "amax", "_to_copy", "copy_", "clone", "cat", "embedding",
              "embedding_dense_backward")
"""The other aten ops the float64 references and the PyTorch baselines compute with (their norms, softmax, losses,
attention, pointwise math, reductions and copies), every overload but the ``out=`` ones. Reading one op's kernels
costs about 15 us: with the GEMMs, ~90 ops take about a millisecond and a half, read after each request and import
(inside the timing loops, the GEMMs' ~26 alone: :func:`verify_clocks`); every aten op (~3600) would take 50 ms."""
_LIBRARY = sys.modules["torch.library"]
_DUMP = torch._C._dispatch_dump
"""The dispatcher's listing of an op's kernels, bound before any plugin loads."""
_ALL_OPS = torch._C._dispatch_get_all_op_names
_HAS_FALLBACK = torch._C._dispatch_has_backend_fallback
_FALLBACK_KEYS = {name: getattr(torch._C.DispatchKey, name) for name in COMPUTE_KEYS
                  if name in torch._C.DispatchKey.__members__}
"""The dispatch keys of :data:`COMPUTE_KEYS` (the aliases among them hold no fallback: registering one there
registers it at the keys they stand for)."""


def _fallbacks() -> frozenset[str]:
    """The keys of :data:`COMPUTE_KEYS` at which torch's dispatcher holds a backend fallback: the kernel of every op
    that has none of its own there (``torch.library.Library("_", "IMPL").fallback``, or the same through
    ``torch._C``). torch's own (autograd, autocast, ADInplaceOrView, BackendSelect) are there before any plugin; a
    key's fallback cannot be registered twice, so a new one is a new key here."""
    return frozenset(name for name, key in _FALLBACK_KEYS.items() if _HAS_FALLBACK(key))


def _watched_ops() -> list[str]:
    """The overloads (``aten::name.overload``) of :data:`KERNEL_GEMMS` and :data:`KERNEL_OPS` that this torch has."""
    def watched(op: str) -> bool:
        name, _, overload = op.removeprefix("aten::").partition(".")
        return name in KERNEL_GEMMS or (name in KERNEL_OPS and "out" not in overload)
    return sorted(op for op in _ALL_OPS() if op.startswith("aten::") and watched(op))


def _compute_kernels(dump: str) -> list[str]:
    """The lines of an op's ``_dispatch_dump`` that list a kernel of :data:`COMPUTE_KEYS`, the active one and those
    it shadows (``CPU (inactive): ...``): how the kernel was registered, by whom, and what it shadows."""
    return [line for line in dump.splitlines()
            if line.split(":", 1)[0].split(" ", 1)[0].removesuffix("[alias]") in COMPUTE_KEYS]


def _dispatcher_changes(record: dict[str, str], ops: Iterable[str]) -> list[str]:
    """Those of ``ops`` whose computing kernels differ in the dispatcher from ``record`` (op -> its
    ``_dispatch_dump`` then), however the kernel came there: torch.library, ``torch._C._dispatch_library``, a compiled
    extension. A kernel registered over one of torch's leaves torch's listed below it, so that even one that copies
    the original's file and line is seen. A change at the other keys is adopted into ``record`` (the check stays
    cheap)."""
    changed = []
    for op in ops:
        recorded, now = record[op], _DUMP(op)
        if now != recorded:
            if _compute_kernels(now) != _compute_kernels(recorded):
                changed.append(op)
            else:
                record[op] = now
    return changed


def _new_library_kernels(kernels: frozenset[str]) -> list[str]:
    """The computing kernels (``ns/name/key``, :data:`COMPUTE_KEYS`) registered through ``torch.library`` since the
    record (``kernels``: its ``_impls`` then)."""
    return [k for k in getattr(_LIBRARY, "_impls", set()) - kernels if k.rsplit("/", 1)[-1] in COMPUTE_KEYS]


def _library_overrides(kernels: frozenset[str], ops: frozenset[str]) -> list[str]:
    """The ops (``ns::name``) of any namespace that existed at the record (``ops``) given a computing kernel through
    ``torch.library`` since then: the ops the dispatcher is not read for."""
    return [_op_of(k) for k in _new_library_kernels(kernels) if _op_of(k) in ops]


def _op_of(kernel: str) -> str:
    """``ns::name`` of a ``torch.library`` kernel's key (``ns/name/key``)."""
    return "::".join(kernel.split("/")[:2])


def _replaced_kernels(record: _Record, full: bool) -> list[str]:
    """The ops whose computing kernel was replaced since the record: a new kernel of torch's own ops moves what every
    cell computes (a CPU ``aten::mm`` would move every GEMM, the float64 reference's included); a plugin's own ops are
    its own. ``full``: the dispatcher is read for every watched op, else for the GEMMs alone (:func:`verify_clocks`)."""
    read = record.dispatcher if full else record.gemms
    return sorted(set(_dispatcher_changes(record.dispatcher, read))
                  | set(_library_overrides(record.kernels, record.ops)))


def _drop_kernels(ops: list[str], kernels: frozenset[str]) -> None:
    """Destroy the ``torch.library.Library`` objects that registered a computing kernel of ``ops`` since the record
    (``kernels``; not those of torch's own, such as its Meta kernels): torch's kernels are back. One registered
    otherwise (``torch._C._dispatch_library``, a compiled extension) has no handle here, and stays
    (:func:`lasting`)."""
    new = {k for k in _new_library_kernels(kernels) if _op_of(k) in ops}
    for lib in [o for o in gc.get_objects() if issubclass(type(o), _LIBRARY.Library)]:
        if new & set(getattr(lib, "_op_impls", ())):
            lib._destroy()


PROCESS_STATE = _process_state()
"""torch's process-wide state, label: (getter, setter); the environment variables are checked apart
(:func:`_environ_changes`). Grad mode is not in it: the harness sets it around each call itself (the timing loops
check the guard inside ``torch.no_grad()``)."""

_MISSING = object()
_EMPTY = object()
"""An empty closure cell's content."""


def harness_module(name: str) -> bool:
    """A module of the harness itself (``codabench``, ``workloads`` and their submodules), which the guard watches."""
    return any(name == p or name.startswith(p + ".") for p in HARNESS_PACKAGES)


class Tampered(Exception):
    """Something the timing loops rely on was replaced; ``names`` lists what (the message is :func:`tamper_message`)."""

    def __init__(self, names: list[str]):
        Exception.__init__(self, tamper_message(names))  # no super(): its __class__ cell would be one more target
        self.names = names


class _Attr(NamedTuple):
    label: str
    owner: Any
    namespace: Any
    """``vars(owner)``: a module's dict or a class's live mapping proxy."""
    name: str
    original: Any


class _Function(NamedTuple):
    label: str
    fn: types.FunctionType
    code: types.CodeType
    defaults: tuple | None
    kwdefaults: dict | None
    kwitems: tuple
    cells: tuple
    contents: tuple


class _Contents(NamedTuple):
    """The entries of a table of the harness (a dict, list or set), or the namespace of an object or class of the op
    catalogue (``owner``; its ``__class__`` counts as an entry), as recorded."""

    label: str
    container: Any
    owner: Any
    """The object or class whose ``vars()`` ``container`` is (entries are put back with setattr); None: a table."""
    items: tuple
    """(key, value) pairs; a list's keys are its indices, a set's are its values."""
    grows: bool
    """New keys are allowed (a dict of the harness: an entry a plugin adds is its own)."""


class _Registered(NamedTuple):
    """A registered implementation as it was registered: where, and what it runs."""

    label: str
    registry: Any
    """The registry, whose table (``registry.impls``) must still be ``entries``."""
    entries: dict
    """The registry's table, in which ``key`` must still name ``impl``."""
    key: Any
    impl: Any
    cls: type
    methods: frozenset
    """The names of the callables of the classes of its MRO (no instance attribute may shadow one)."""
    held: tuple
    """(name, value) of the callables it held as attributes (a registered function)."""


class _Record:
    """What :func:`snapshot` recorded: the watch list, precomputed so that a check is one pass over flat lists."""

    def __init__(self) -> None:
        self.guarded: list[_Attr] = []
        self.harness: list[_Attr] = []
        self.contents: list[_Contents] = []
        self.process_state: dict[str, Any] = {}
        self.environ: dict[str, str] = {}
        """The environment variables of :data:`ENVIRON_PREFIXES` when recorded."""
        self.kernels: frozenset[str] = frozenset()
        """``torch.library._impls`` (the kernels registered through torch.library) when recorded."""
        self.ops: frozenset[str] = frozenset()
        """The dispatcher's ops (``ns::name``) when recorded."""
        self.fallbacks: frozenset[str] = frozenset()
        """The keys that held a backend fallback when recorded (:func:`_fallbacks`)."""
        self.dispatcher: dict[str, str] = {}
        """The dispatcher's listing of the kernels of each watched op (:func:`_watched_ops`) when recorded."""
        self.gemms: tuple[str, ...] = ()
        """Those of the watched ops that are GEMMs (:data:`KERNEL_GEMMS`)."""
        self.functions: list[_Function] = []
        self.implementations: dict[tuple[int, Any], _Registered] = {}
        """By (id of the registry, key): what each registered implementation runs (:func:`watch_registered`)."""
        self.methods: dict[int, list[_Attr]] = {}
        """By id of the class: the methods of the classes of registered implementations defined outside the harness
        (the harness's own are in ``harness``)."""
        self.modules: list[tuple[str, types.ModuleType, set[str]]] = []
        self.builtins: dict[str, Any] = {}
        self.hooks: tuple = ()
        self.clocks: Clocks | None = None


_RECORD = _Record()


def _callables(owner: Any) -> dict[str, Any]:
    return {name: value for name, value in vars(owner).items() if callable(value) and name != "__class__"}


def _hooks() -> tuple:
    return sys.gettrace(), sys.getprofile(), threading.gettrace(), threading.getprofile()


def _watch_function(out: dict[int, _Function], label: str, fn: Any) -> None:
    fn = getattr(fn, "__func__", fn)  # staticmethod, classmethod, bound method
    if not isinstance(fn, types.FunctionType) or id(fn) in out:
        return
    cells = fn.__closure__ or ()
    kw = fn.__kwdefaults__
    out[id(fn)] = _Function(label, fn, fn.__code__, fn.__defaults__, kw, tuple(kw.items()) if kw else (), cells,
                            tuple(_content(c) for c in cells))


def _content(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _record_harness(record: _Record) -> None:
    record.harness, record.modules = [], []
    functions: dict[int, _Function] = {}
    for modname, module in list(sys.modules.items()):
        if not harness_module(modname) or not isinstance(module, types.ModuleType):
            continue
        names = vars(module)
        record.modules.append((modname, module, set(names)))
        for name, value in list(names.items()):
            record.harness.append(_Attr(f"{modname}.{name}", module, names, name, value))
            if getattr(value, "__module__", None) != modname:
                continue  # imported from elsewhere: its identity is watched here, its insides where it is defined
            if isinstance(value, type):
                for attr, member in list(vars(value).items()):
                    if not (callable(member) or isinstance(member, (property, staticmethod, classmethod))):
                        continue  # class-level data is state (a cache such as TorchCompile._key), not behaviour
                    label = f"{modname}.{value.__qualname__}.{attr}"
                    record.harness.append(_Attr(label, value, vars(value), attr, member))
                    if isinstance(member, property):
                        for accessor in (member.fget, member.fset, member.fdel):
                            _watch_function(functions, label, accessor)
                    else:
                        _watch_function(functions, label, member)
            else:
                _watch_function(functions, f"{modname}.{name}", value)
                _watch_function(functions, f"{modname}.{name}", getattr(value, "__wrapped__", None))
    for label, fn in (("torch.cuda.Event.record", torch.cuda.Event.record),
                      ("torch.cuda.Event.elapsed_time", torch.cuda.Event.elapsed_time),
                      ("torch.cuda.Event.synchronize", torch.cuda.Event.synchronize),
                      ("torch.cuda.synchronize", torch.cuda.synchronize)):
        _watch_function(functions, label, fn)  # the private clocks' Python code
    record.functions = list(functions.values())
    record.contents = _record_contents()


_TABLES = (dict, list, set)


def _entries(container: Any, owner: Any = None) -> tuple:
    """The (key, value) pairs of a table, or of an object's or class's namespace (``owner``), as :class:`_Contents`
    records them."""
    if owner is not None:
        return ((("__class__", type(owner)),) if not isinstance(owner, type) else ()) + tuple(container.items())
    if isinstance(container, dict):
        return tuple(container.items())
    return tuple(enumerate(container)) if isinstance(container, list) else tuple((v, v) for v in container)


def _record_contents() -> list[_Contents]:
    """The tables of the harness's modules (nested ones too) and the op catalogue's objects and classes, each once
    (a table several modules import is labelled by the first: ``workloads`` before ``codabench``)."""
    seen: set[int] = set()
    out: list[_Contents] = []

    def table(label: str, value: Any) -> None:
        if isinstance(value, tuple):
            for i, v in enumerate(value):
                table(f"{label}[{i}]", v)
            return
        if not isinstance(value, _TABLES) or id(value) in seen:
            return
        seen.add(id(value))
        out.append(_Contents(label, value, None, _entries(value), isinstance(value, dict)))
        for key, v in (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list)
                       else ()):
            table(f"{label}[{key!r}]", v)

    def namespace(label: str, owner: Any) -> None:
        if id(owner) not in seen:
            seen.add(id(owner))
            out.append(_Contents(label, vars(owner), owner, _entries(vars(owner), owner), False))

    modules = sorted((m for m in list(sys.modules) if harness_module(m) and m != __name__),
                     key=lambda m: (not m.startswith("workloads"), m))
    for modname in modules:
        for name, value in list(vars(sys.modules[modname]).items()):
            if not name.startswith("__"):
                table(f"{modname}.{name}", value)
    ops = sys.modules.get("workloads.ops")
    for name, op in (vars(ops).get("OPS", {}) if ops is not None else {}).items():
        namespace(f"workloads.ops.OPS[{name!r}]", op)
        for cls in type(op).__mro__:
            if harness_module(cls.__module__):
                namespace(f"{cls.__module__}.{cls.__qualname__}", cls)
    return out


def _entry(c: _Contents, key: Any) -> Any:
    """The entry ``key`` of ``c`` now (an object's ``__class__`` included)."""
    if key == "__class__" and c.owner is not None and not isinstance(c.owner, type):
        return type(c.owner)
    return c.container.get(key, _MISSING)


def _changed_entries(c: _Contents) -> list[str]:
    """Labels of the entries of ``c`` that were replaced or removed, and (unless it may grow) of those added."""
    now = c.container
    if isinstance(now, list):
        same = len(now) == len(c.items) and all(a is b for a, (_, b) in zip(now, c.items))
        return [] if same else [f"{c.label} (a list)"]
    if isinstance(now, set):
        return [] if len(now) == len(c.items) and all(v in now for v, _ in c.items) else [f"{c.label} (a set)"]
    bad = [k for k, v in c.items if _entry(c, k) is not v]
    if not c.grows:
        recorded = {k for k, _ in c.items}
        bad += [k for k in list(now) if k not in recorded]
    return [f"{c.label}.{k}" if c.owner is not None else f"{c.label}[{k!r}]" for k in bad]


def _put_entries(c: _Contents) -> None:
    """Put the recorded entries of ``c`` back (and remove the added ones where it may not grow)."""
    now, items = c.container, c.items
    if isinstance(now, list):
        now[:] = [v for _, v in items]
    elif isinstance(now, set):
        now.clear()
        now.update(v for v, _ in items)
    elif c.owner is None:
        for k, v in items:
            now[k] = v
    else:
        recorded = dict(items)
        for k in [k for k in list(now) if k not in recorded]:
            delattr(c.owner, k)
        for k, v in items:
            if _entry(c, k) is not v:
                setattr(c.owner, k, v)


def watch_registered(registry: Any, key: Any, impl: Any) -> None:
    """Record the implementation just registered as ``registry.impls[key]``: where it is and what it runs (its
    entry, its class, its classes' methods and the callables it holds: a registered function). A registry's entries
    are append-only: from now on a change to any of them (the entry removed or replaced, the registry's table
    replaced, the class swapped, a method replaced, or shadowed by an instance attribute) is tampering, and the name
    stays taken (:func:`registered`): no later plugin slows another's calls, changes what they compute, or takes their
    cells out of the run."""
    cls = type(impl)
    for c in cls.__mro__[:-1]:
        if not harness_module(c.__module__) and id(c) not in _RECORD.methods:
            _RECORD.methods[id(c)] = [_Attr(f"{c.__module__}.{c.__qualname__}.{name}", c, vars(c), name, value)
                                      for name, value in _callables(c).items()]
    methods = frozenset(name for c in cls.__mro__[:-1] for name in _callables(c))
    held = tuple((name, value) for name, value in vars(impl).items() if callable(value))
    _RECORD.implementations[(id(registry), key)] = _Registered(f"the registered implementation {key!r}", registry,
                                                               registry.impls, key, impl, cls, methods, held)


def registered(registry: Any, key: Any) -> Any:
    """The implementation recorded as registered under ``key`` in ``registry``, removed since or not; None where
    none was: a name once registered is taken for good."""
    reg = _RECORD.implementations.get((id(registry), key))  # the record holds the registry: its id is its own
    return reg.impl if reg is not None else None


def _record_registered(record: _Record) -> None:
    """Record the registered implementations (those in their registry's table now) and their classes' methods
    again."""
    registered_now = [r for r in record.implementations.values() if r.key in r.registry.impls]
    record.implementations, record.methods = {}, {}
    for r in registered_now:
        watch_registered(r.registry, r.key, r.registry.impls[r.key])


def _changed_implementation(reg: _Registered) -> list[str]:
    """What differs in ``reg`` but its classes' methods (watched per class)."""
    if getattr(reg.registry, "impls", None) is not reg.entries:
        return ["the registry's table of implementations (replaced)"]
    impl = reg.entries.get(reg.key, _MISSING)
    if impl is not reg.impl:
        return [f"{reg.label} ({'removed' if impl is _MISSING else 'replaced'})"]
    state = vars(impl)
    bad = [] if type(impl) is reg.cls else [f"{reg.label}.__class__"]
    bad += [f"{reg.label}.{name}" for name, value in reg.held if state.get(name, _MISSING) is not value]
    if len(state) != len(reg.held):
        held = {name for name, _ in reg.held}
        bad += [f"{reg.label}.{name} (shadows its method)" for name in state if name in reg.methods
                and name not in held]
    return bad


def _put_implementation(reg: _Registered) -> None:
    impl, held = reg.impl, dict(reg.held)
    reg.registry.impls = reg.entries
    reg.entries[reg.key] = impl
    if type(impl) is not reg.cls:
        impl.__class__ = reg.cls
    for name in [n for n in vars(impl) if n in reg.methods and n not in held]:
        delattr(impl, name)
    for name, value in reg.held:
        setattr(impl, name, value)


def _same(a: Any, b: Any) -> bool:
    """A piece of torch's state is as recorded: the same objects (a mode, a hook), or equal plain values."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b or (type(a) is type(b) and type(a) in (bool, int, float, str) and a == b)


def _process_state() -> dict[str, Any]:
    """torch's process-wide state now, by label (:data:`PROCESS_STATE`)."""
    return {label: get() for label, (get, _) in PROCESS_STATE.items()}


def _record_process(record: _Record) -> None:
    """Record torch's process-wide state and the environment variables as they are now."""
    record.process_state = _process_state()
    record.environ = _settings_in_environ()


@contextlib.contextmanager
def adopted(change: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    """Run the block inside ``change``, the harness's own change of torch's process-wide state (the CPU's NaN-filled
    allocations), with the record of that state taken inside it: a plugin that changes it within the block is still
    caught, by the checks around each timed region. ``change`` puts the state back on exit, and the record with it."""
    with change:
        recorded = _RECORD.process_state
        _RECORD.process_state = _process_state()
        try:
            yield
        finally:
            _RECORD.process_state = recorded


def snapshot(refresh: bool = False) -> None:
    """Record what the guard watches (once per process: later calls keep the first record).

    ``refresh``: record the harness's own modules, the registered implementations and the process-wide state again
    as they are now (an ``--inline`` run adopts the patches and settings of the test or debugger that runs it;
    plugins' import-time changes were already undone by discovery); the clocks, torch functions, builtins, hooks and
    kernels keep their first record."""
    if _RECORD.clocks is not None:
        if refresh:
            _record_harness(_RECORD)
            _record_registered(_RECORD)
            _record_process(_RECORD)
        return
    import torch._dynamo  # noqa: F401  (on import it wraps torch.manual_seed: settle that before the record)

    _RECORD.guarded = [_Attr(f"{label}.{name}", owner, vars(owner), name, value)
                       for label, owner in GUARDED.items() for name, value in _callables(owner).items()]
    _RECORD.guarded += [_Attr(f"{label}.{name}", owner, vars(owner), name, getattr(owner, name))
                        for label, (owner, names) in HOOK_FUNCTIONS.items() for name in names]
    _RECORD.builtins = {k: v for k, v in vars(builtins).items() if k != "_"}
    _RECORD.hooks = _hooks()
    _record_process(_RECORD)
    _RECORD.kernels = frozenset(getattr(_LIBRARY, "_impls", ()))
    _RECORD.ops = frozenset(_ALL_OPS())
    _RECORD.fallbacks = _fallbacks()
    _RECORD.dispatcher = {op: _DUMP(op) for op in _watched_ops()}
    _RECORD.gemms = tuple(op for op in _RECORD.dispatcher if op.removeprefix("aten::").partition(".")[0]
                          in KERNEL_GEMMS)
    _RECORD.clocks = Clocks(time.perf_counter, torch.cuda.Event, torch.cuda.Event.record,
                            torch.cuda.Event.elapsed_time, torch.cuda.synchronize, verify_clocks,
                            torch.cuda.Event.synchronize, getattr(torch._C, "_cuda_sleep", torch.cuda._sleep))
    _record_harness(_RECORD)


def _scan(full: bool = True) -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, the fix that restores it) of everything that differs from the record (``full``: see
    :func:`_replaced_kernels`)."""
    r = _RECORD
    methods = [a for attrs in r.methods.values() for a in attrs]
    for a in [a for a in (*r.guarded, *r.harness, *methods) if a.namespace.get(a.name, _MISSING) is not a.original]:
        yield a.label, lambda a=a: setattr(a.owner, a.name, a.original)
    for c in r.contents:
        for label in _changed_entries(c):
            yield label, lambda c=c: _put_entries(c)
    for name in _environ_changes(r.environ):
        yield f"os.environ[{name!r}]", lambda name=name: _put_environ(r.environ, name)
    for label, recorded in r.process_state.items():
        get, put = PROCESS_STATE[label]
        if not _same(get(), recorded):
            yield label, lambda put=put, v=recorded: put(v)
    fallbacks = sorted(_fallbacks() - r.fallbacks)
    if fallbacks:  # no restore: which Library holds it is not known (torch.library does not record a fallback)
        yield (f"torch's dispatcher: a backend fallback at {listing(fallbacks)} (the kernel of every op that has none "
               "of its own there)", _no_restore)
    replaced = _replaced_kernels(r, full)
    if replaced:
        yield (f"torch's kernel of {listing(replaced)} (replaced in its dispatcher)",
               lambda: _drop_kernels(replaced, r.kernels))
    for reg in list(r.implementations.values()):
        for label in _changed_implementation(reg):
            yield label, lambda reg=reg: _put_implementation(reg)
    builtin_names = r.builtins
    for modname, module, names in r.modules:
        if sys.modules.get(modname) is not module:
            yield f"sys.modules[{modname!r}]", lambda m=modname, v=module: sys.modules.__setitem__(m, v)
        ns = vars(module)
        if len(ns) != len(names):
            for added in [k for k in ns.keys() - names if k in builtin_names]:
                yield f"{modname}.{added} (shadows the builtin)", lambda ns=ns, k=added: ns.pop(k, None)
    for f in r.functions:
        fn = f.fn
        if fn.__code__ is not f.code:
            yield f"{f.label}.__code__", lambda f=f: setattr(f.fn, "__code__", f.code)
        if fn.__defaults__ is not f.defaults:
            yield f"{f.label}.__defaults__", lambda f=f: setattr(f.fn, "__defaults__", f.defaults)
        kw = fn.__kwdefaults__
        if kw is not f.kwdefaults or (kw and _changed(tuple(kw.items()), f.kwitems)):
            yield f"{f.label}.__kwdefaults__", lambda f=f: _put_kwdefaults(f)
        for i, (cell, content) in enumerate(zip(f.cells, f.contents)):
            if _content(cell) is not content:
                var = f.code.co_freevars[i] if i < len(f.code.co_freevars) else "?"
                yield f"{f.label} (closure variable {var})", lambda c=cell, v=content: _put_cell(c, v)
    ns = vars(builtins)
    for k in [k for k, v in builtin_names.items() if ns.get(k, _MISSING) is not v]:
        yield f"builtins.{k}", lambda k=k: setattr(builtins, k, builtin_names[k])
    now = _hooks()
    if now != r.hooks:
        for label, was, is_, setter in zip(("sys.settrace", "sys.setprofile", "threading.settrace",
                                            "threading.setprofile"), r.hooks, now,
                                           (sys.settrace, sys.setprofile, threading.settrace, threading.setprofile)):
            if is_ is not was:
                yield f"{label} (a hook is set)", lambda s=setter, v=was: s(v)


URANDOM = os.urandom
"""The operating system's random bytes, bound before any plugin loads: the source of the timing inputs' seeds, the
recheck draws and the conversions' fingerprint keys (nothing a plugin patches or reads tells it the next draw)."""
_WATCHED_CODE: list[types.CodeType] = []
_CACHE_ENTRIES = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
GRAPHS = "torch-compile's graphs"
"""The label of :meth:`Seal.add_graphs`."""


def watch_compiled(code: types.CodeType) -> None:
    """Count torch.compile's graphs of ``code`` (the harness's torch-compile) in :func:`compiled_graphs`."""
    if code not in _WATCHED_CODE:
        _WATCHED_CODE.append(code)


def compiled_graphs() -> int:
    """How many graphs torch.compile holds for the watched code: ``torch._dynamo.reset()`` (or its caches cleared)
    drops them, and torch-compile then compiles again at its next call."""
    return sum(len(_CACHE_ENTRIES(c)) for c in _WATCHED_CODE)


class Seal:
    """Some of the harness's own objects as they are now: the identity of their attributes (all, or those named) and
    of the entries of the dicts, lists and sets among them. A plugin runs in the process that holds them, and its call
    can reach them by walking up the stack (another implementation's timed call wrapped, the error the pass rule allows
    loosened, its own recheck draw replaced): :meth:`broken` names what differs, checked right after its code returns
    and before the harness reads them again, and :meth:`restore` puts them back."""

    def __init__(self) -> None:
        self._held: list[tuple[str, Any, frozenset[str] | None, dict[str, Any], dict[str, tuple[list, Any]]]] = []
        self._graphs: int | None = None

    def add_graphs(self) -> Seal:
        """Hold torch-compile's graphs too (:func:`compiled_graphs`): none may be dropped (more may come). No restore
        brings them back: the caller stops timing beside the call that dropped them."""
        self._graphs = compiled_graphs()
        return self

    def add(self, label: str, obj: Any, attrs: Iterable[str] | None = None) -> Seal:
        """Hold ``obj``: a dict's or list's entries; else its attributes (those of ``attrs`` only, where given; none
        may be added) and the entries of those that are dicts, lists or sets."""
        if isinstance(obj, (dict, list)):
            self._held.append((label, obj, None, {}, {"": _entries_of(obj)}))
            return self
        now = dict(vars(obj))
        kept = {k: v for k, v in now.items() if attrs is None or k in attrs}
        inner = {k: _entries_of(v) for k, v in kept.items() if type(v) in (dict, list, set)}
        self._held.append((label, obj, frozenset(now), kept, inner))
        return self

    def broken(self) -> list[str]:
        """What differs from what was held (``label.attribute``, :data:`GRAPHS`), or []."""
        out = []
        if self._graphs is not None:
            now = compiled_graphs()
            if now < self._graphs:
                out.append(GRAPHS)
            self._graphs = max(now, self._graphs)
        for label, obj, names, kept, inner in self._held:
            if names is not None:
                now = vars(obj)
                out += [f"{label}.{k}" for k in sorted(now.keys() - names)]
                out += [f"{label}.{k}" for k, v in kept.items() if now.get(k, _MISSING) is not v]
            for k, (ids, _) in inner.items():
                if _entries_of(obj if not k else kept[k])[0] != ids:
                    out.append(f"{label}.{k}" if k else label)
        return list(dict.fromkeys(out))

    def restore(self) -> None:
        """Put back every attribute and entry held (and take away the attributes added)."""
        for _, obj, names, kept, inner in self._held:
            if names is not None:
                for k in vars(obj).keys() - names:
                    delattr(obj, k)
                for k, v in kept.items():
                    setattr(obj, k, v)
            for k, (_, copy) in inner.items():
                c = obj if not k else kept[k]
                c.clear()
                if isinstance(c, list):
                    c.extend(copy)
                else:
                    c.update(copy)


def _entries_of(c: Any) -> tuple[list, Any]:
    """(the identities of a container's entries, a shallow copy of it): a dict's (key, id) pairs, a list's or set's
    ids."""
    if isinstance(c, dict):
        return [(k, id(v)) for k, v in c.items()], dict(c)
    return [id(v) for v in c], type(c)(c)


def seal_message(broken: list[str]) -> str:
    """The error row of a cell whose code changed the harness's own objects (:class:`Seal`)."""
    return (f"changed the harness's own data during its call: {listing(broken)} (code that reached the harness's "
            "frames; put back, this cell does not count)")


def _no_restore() -> None:
    """The fix of what no restore undoes (:func:`lasting` finds it still there)."""


def _changed(items: tuple, original: tuple) -> bool:
    return len(items) != len(original) or any(k1 != k2 or v1 is not v2 for (k1, v1), (k2, v2) in zip(items, original))


def _put_kwdefaults(f: _Function) -> None:
    if f.kwdefaults is not None:
        f.kwdefaults.clear()
        f.kwdefaults.update(f.kwitems)
    f.fn.__kwdefaults__ = f.kwdefaults


def _put_cell(cell: types.CellType, content: Any) -> None:
    if content is _EMPTY:
        del cell.cell_contents
    else:
        cell.cell_contents = content


def tampered() -> list[str]:
    """What has been replaced, deleted, set or swapped since :func:`snapshot` (``module.name``-style labels)."""
    return _labels(_scan())


def _labels(scan: Iterator[tuple[str, Callable[[], None]]]) -> list[str]:
    return list(dict.fromkeys(label for label, _ in scan))  # an op class's method is watched twice


def restore(names: list[str] | None = None) -> list[str]:
    """Put every replaced thing back (only those in ``names``, where given); returns what it put back."""
    fixed = []
    for label, fix in list(_scan()):
        if (names is None or label in names) and label not in fixed:
            fix()
            fixed.append(label)
    return fixed


def private_clocks() -> Clocks:
    """The timing loops' clocks (see the module docstring for how to use them); takes the snapshot if none was."""
    snapshot()
    return _RECORD.clocks


def running_threads() -> set[threading.Thread]:
    """The threads alive now (what :func:`own_threads` compares with)."""
    return set(threading.enumerate())


OWN, LIBRARY, GLUE = "own", "library", "glue"
"""What the code of a file is (:func:`_code_kinds`)."""
THREAD_SAMPLES = 5
THREAD_SAMPLE_S = 0.002
"""A thread that holds a frame of its own below a library's call is looked at this many times, this far apart."""
_sleep = time.sleep


def _roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the standard library's folders, the installed packages' folders): the interpreter's, the site folders, and
    the entries of ``sys.path`` that hold installed distributions (``*.dist-info``: ``pip install --target``); read
    once for each ``sys.path`` (the check after every request looks at the threads there are)."""
    return _roots_of(tuple(sys.path))


@functools.lru_cache(maxsize=8)
def _roots_of(path: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    paths = sysconfig.get_paths()
    packages = [paths[k] for k in ("purelib", "platlib")] + site.getsitepackages()
    for entry in path:
        try:
            if entry and any(name.endswith(".dist-info") for name in os.listdir(entry)):
                packages.append(entry)
        except OSError:
            continue

    def folders(paths: list[str]) -> tuple[str, ...]:
        return tuple({os.path.realpath(p) + os.sep for p in paths})
    return folders([paths["stdlib"], paths["platstdlib"]]), folders(packages)


def _code_kinds(own: tuple[str, ...]) -> Callable[[str], str]:
    """What the code of a file is: :data:`OWN` (an implementation's: outside the standard library and the installed
    packages, or under one of ``own``, its files and package folders, wherever installed), :data:`LIBRARY` (an
    installed package's) or :data:`GLUE` (the standard library's, or code made at run time, ``<string>``: what the
    code that calls it runs, a wait on an event or a queue)."""
    stdlib, packages = _roots()
    kinds: dict[str, str] = {}

    def kind(file: str) -> str:
        if file not in kinds:
            path = os.path.realpath(file)
            kinds[file] = (GLUE if file.startswith("<") else OWN if path.startswith(own)
                           else LIBRARY if path.startswith(packages) else GLUE if path.startswith(stdlib) else OWN)
        return kinds[file]
    return kind


def module_files(modules: Iterable[str]) -> tuple[str, ...]:
    """The code of ``modules`` (an implementation's ``source``), as path prefixes for :func:`own_threads`: each
    module's file, and the folder of the package it is in (its top-level package's, where it has one: the helpers
    beside it). The harness's own modules are not an implementation's."""
    out: set[str] = set()
    for name in modules:
        module = sys.modules.get(name) if name and not harness_module(name) else None
        if getattr(module, "__file__", None):
            out.add(os.path.realpath(module.__file__))
            top = sys.modules.get(name.partition(".")[0])
            if hasattr(top, "__path__") and getattr(top, "__file__", None):
                out.add(os.path.dirname(os.path.realpath(top.__file__)) + os.sep)
    return tuple(out)


def _code_file(fn: Any) -> str | None:
    """The file of the code ``fn`` runs (a function, a method, a ``functools.partial``, a callable object)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None and fn is not None and not isinstance(fn, types.BuiltinFunctionType):
        code = getattr(getattr(type(fn), "__call__", None), "__code__", None)
    return code.co_filename if code is not None else None


def _started_on(thread: threading.Thread, kind: Callable[[str], str]) -> bool:
    """The thread was started to run code of its own: its target, a ``threading.Timer``'s function, or its class's
    ``run``, even while it waits in the standard library (a Timer that has not fired yet)."""
    files = [_code_file(getattr(thread, "_target", None)), _code_file(getattr(thread, "function", None)),
             _code_file(type(thread).run)]
    return any(f is not None and kind(f) == OWN for f in files)


def _runs_own(frame: types.FrameType | None, kind: Callable[[str], str]) -> bool:
    """The innermost frame of the stack that is not glue is the thread's own: its own code is what runs now (a call
    it made into an installed package, such as a JIT build waiting for its compiler, is the package's, for now)."""
    while frame is not None:
        k = kind(frame.f_code.co_filename)
        if k != GLUE:
            return k == OWN
        frame = frame.f_back
    return False


def _holds_own(frame: types.FrameType | None, kind: Callable[[str], str]) -> bool:
    """Some frame of the stack is the thread's own (it may come back to it)."""
    while frame is not None:
        if kind(frame.f_code.co_filename) == OWN:
            return True
        frame = frame.f_back
    return False


def _queued(value: Any) -> Sequence:
    """The items waiting in ``value`` where it is a queue: a ``queue.Queue`` (its ``queue``: a deque, or the list of
    a ``LifoQueue`` or ``PriorityQueue``), a ``queue.SimpleQueue`` (a ``ThreadPoolExecutor``'s: its items are read
    through the garbage collector's view of it, the one way in), a ``collections.deque``; else none."""
    if isinstance(value, queue.Queue):
        return list(value.queue)
    if isinstance(value, queue.SimpleQueue):
        return [item for held in gc.get_referents(value) if isinstance(held, list) for item in held]
    return list(value) if isinstance(value, collections.deque) else ()


def _work(item: Any) -> list[Any]:
    """What a queued work item runs: the item, if it is callable, else the callables it holds (a
    ``concurrent.futures`` work item's ``fn``, a tuple's members)."""
    if callable(item):
        return [item]
    held = item if isinstance(item, tuple) else getattr(item, "__dict__", {}).values()
    return [h for h in held if callable(h)]


def _pending_own(frame: types.FrameType | None, kind: Callable[[str], str]) -> bool:
    """Work of its own waits for the thread: a queue held by a frame of its stack that is glue (a pool's worker
    loop waiting for its next item, or between two) holds an item whose code is the thread's own (:func:`_work`)."""
    while frame is not None:
        if kind(frame.f_code.co_filename) == GLUE:
            for value in list(frame.f_locals.values()):
                for item in _queued(value):
                    if any(kind(f) == OWN for f in map(_code_file, _work(item)) if f is not None):
                        return True
        frame = frame.f_back
    return False


def stray_threads(before: Collection[threading.Thread], own: tuple[str, ...] = ()) -> list[threading.Thread]:
    """The threads, other than the caller's and those in ``before`` (:func:`running_threads`; empty: every thread,
    one that was there before handed work too), that are alive and run code of their own (:func:`_code_kinds`;
    ``own``: the implementation's files, :func:`module_files`): started to run it (:func:`_started_on`), running it
    now (:func:`_runs_own`), or holding it as work that waits for them (:func:`_pending_own`: a pool's queued work
    items), looked at :data:`THREAD_SAMPLES` times over a few milliseconds while some frame of the thread is its own
    but a library's call is what runs. A library's threads (a compile pool, a JIT build that outlives a call, a
    monitor) run the library's code and are not counted."""
    me = threading.current_thread()
    threads = [t for t in threading.enumerate() if t not in before and t is not me and t.is_alive()]
    if not threads:
        return []
    kind = _code_kinds(own)
    found = {t for t in threads if _started_on(t, kind)}
    undecided = [t for t in threads if t not in found]
    for sample in range(THREAD_SAMPLES):
        frames = sys._current_frames()
        found.update(t for t in undecided if _runs_own(frames.get(t.ident), kind)
                     or _pending_own(frames.get(t.ident), kind))
        undecided = [t for t in undecided if t not in found and _holds_own(frames.get(t.ident), kind)]
        if not undecided or sample == THREAD_SAMPLES - 1:
            break
        _sleep(THREAD_SAMPLE_S)
    return [t for t in threads if t in found]


def own_threads(before: Collection[threading.Thread], own: tuple[str, ...] = ()) -> list[str]:
    """The names of :func:`stray_threads` (``before``, ``own``: see there)."""
    return [t.name for t in stray_threads(before, own)]


class Clocks(NamedTuple):
    """The timing loops' clocks and the guard's functions they call, bound to the originals when :func:`snapshot` ran
    (before any plugin loaded)."""

    perf_counter: Callable[[], float]
    """``time.perf_counter``."""
    Event: type
    """``torch.cuda.Event``."""
    record: Callable[..., Any]
    """``torch.cuda.Event.record``: ``record(ev)`` records on the current stream."""
    elapsed_ms: Callable[[Any, Any], float]
    """``torch.cuda.Event.elapsed_time``: ``elapsed_ms(start, end)``."""
    synchronize: Callable[..., None]
    """``torch.cuda.synchronize``: ``synchronize(device)``."""
    verify: Callable[[], None]
    """:func:`verify_clocks`."""
    wait: Callable[[Any], None]
    """``torch.cuda.Event.synchronize``: ``wait(ev)`` returns once the GPU has passed ``ev``."""
    sleep: Callable[[int], None]
    """``torch._C._cuda_sleep`` (what ``torch.cuda._sleep`` looks up when called): ``sleep(cycles)`` enqueues a kernel
    that spins for that many GPU clock cycles. The sweeps enqueue it before each sample's start event: a replacement
    could enqueue a plugin's work there, untimed, so the loops hold the original itself."""
    running: Callable[[], set[threading.Thread]] = running_threads
    """:func:`running_threads`."""
    strays: Callable[..., list[threading.Thread]] = stray_threads
    """:func:`stray_threads`: the interleaved sweeps look, after each call, for a thread it left running its
    implementation's code beside the next calls (:mod:`codabench.sweep`)."""


def threads_message(names: list[str], after: str) -> str:
    """What a plugin that left the threads ``names`` running its own code after ``after`` (its import, the call) is
    told."""
    return (f"left {listing(names)} running its own code after {after} (a thread beside the timed calls slows every "
            "implementation)")


def lasting(names: list[str]) -> list[str]:
    """Those of ``names`` (what :func:`restore` put back) that are still changed: what no restore undoes, such as a
    kernel registered in torch's dispatcher through ``torch._C`` or a compiled extension; only a new process is rid
    of it."""
    return [name for name in tampered() if name in names] if names else []  # nothing put back: no second scan


def verify_clocks() -> None:
    """Raise :class:`Tampered` if anything the guard watches was replaced (the originals stay out until the worker's
    check after the request restores them). Of the dispatcher's kernels it reads the GEMMs' alone, so that this check
    around every timed region stays about a millisecond; the check after the request reads every watched op."""
    bad = _labels(_scan(full=False))
    if bad:
        raise Tampered(bad)


def listing(names: list[str]) -> str:
    """The first few of ``names`` and how many more: the one way tampering is named in rows and messages."""
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


REPLACED = "which is replaced"
"""What becomes of a worker process that holds what no restore undoes (the row of the cell that left it says so)."""


def tamper_message(names: list[str], kept: Sequence[str] = (), fate: str = REPLACED) -> str:
    """The error row of a cell during which ``names`` were tampered with; ``kept``: those that no restore undoes
    (:func:`lasting`), and ``fate``: what becomes of the process that holds them."""
    done = (f"{listing(kept)} cannot be undone in this process, {fate}" if kept else
            "the harness's clocks and torch functions are restored")
    return f"tampered with {listing(names)} ({done}; this cell does not count)"
