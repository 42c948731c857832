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
- the ``sys.modules`` entry of each of those modules, every name of ``builtins``, and the trace and profile hooks
  (``sys.gettrace()``, ``sys.getprofile()``, ``threading.gettrace()``, ``threading.getprofile()``).

:func:`tampered` lists what now differs, :func:`restore` puts the originals back (so the baselines' times stay
true), :func:`tamper_message` is the error row's text. Discovery checks after every plugin import (the plugin gets a
load error and the originals are restored before the next import); the worker checks after every request of every
cell (the cell gets an error row). One check costs about a millisecond (``tests/test_guard.py`` bounds it).

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
import math
import statistics
import sys
import threading
import time
import types
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F

GUARDED: dict[str, Any] = {
    "time": time, "math": math, "statistics": statistics, "torch": torch, "torch.nn.functional": F,
    "torch.linalg": torch.linalg, "torch.autograd": torch.autograd, "torch.cuda": torch.cuda,
    "torch.cuda.Event": torch.cuda.Event, "torch.cuda.Stream": torch.cuda.Stream, "torch.Tensor": torch.Tensor,
    **{f"{c.__module__}.{c.__qualname__}": c for c in torch.cuda.Event.__mro__[1:-1]},
}
"""Where the harness's clocks, synchronization, comparisons and reference math live (every callable attribute,
special methods included)."""
HOOK_FUNCTIONS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "sys": (sys, ("settrace", "setprofile", "gettrace", "getprofile")),
    "threading": (threading, ("settrace", "setprofile", "gettrace", "getprofile")),
}
"""The functions that set or show trace and profile hooks (a plugin could hide its hook behind a false getter)."""
HARNESS_PACKAGES = ("codabench", "workloads")

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


class Clocks(NamedTuple):
    """The timing loops' clocks, bound to the originals when :func:`snapshot` ran (before any plugin loaded)."""

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


class _Record:
    """What :func:`snapshot` recorded: the watch list, precomputed so that a check is one pass over flat lists."""

    def __init__(self) -> None:
        self.guarded: list[_Attr] = []
        self.harness: list[_Attr] = []
        self.functions: list[_Function] = []
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


def snapshot(refresh: bool = False) -> None:
    """Record what the guard watches (once per process: later calls keep the first record).

    ``refresh``: record the harness's own modules again as they are now (an ``--inline`` run adopts the patches of
    the test or debugger that runs it; plugins' import-time changes were already undone by discovery); the clocks,
    torch functions, builtins and hooks keep their first record."""
    if _RECORD.clocks is not None:
        if refresh:
            _record_harness(_RECORD)
        return
    import torch._dynamo  # noqa: F401  (on import it wraps torch.manual_seed: settle that before the record)

    _RECORD.guarded = [_Attr(f"{label}.{name}", owner, vars(owner), name, value)
                       for label, owner in GUARDED.items() for name, value in _callables(owner).items()]
    _RECORD.guarded += [_Attr(f"{label}.{name}", owner, vars(owner), name, getattr(owner, name))
                        for label, (owner, names) in HOOK_FUNCTIONS.items() for name in names]
    _RECORD.builtins = {k: v for k, v in vars(builtins).items() if k != "_"}
    _RECORD.hooks = _hooks()
    _RECORD.clocks = Clocks(time.perf_counter, torch.cuda.Event, torch.cuda.Event.record,
                            torch.cuda.Event.elapsed_time, torch.cuda.synchronize, verify_clocks,
                            torch.cuda.Event.synchronize, getattr(torch._C, "_cuda_sleep", torch.cuda._sleep))
    _record_harness(_RECORD)


def _scan() -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, the fix that restores it) of everything that differs from the record."""
    r = _RECORD
    for a in [a for a in r.guarded if a.namespace.get(a.name, _MISSING) is not a.original]:
        yield a.label, lambda a=a: setattr(a.owner, a.name, a.original)
    for a in [a for a in r.harness if a.namespace.get(a.name, _MISSING) is not a.original]:
        yield a.label, lambda a=a: setattr(a.owner, a.name, a.original)
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
    return [label for label, _ in _scan()]


def restore(names: list[str] | None = None) -> list[str]:
    """Put every replaced thing back (only those in ``names``, where given); returns what it put back."""
    fixed = []
    for label, fix in list(_scan()):
        if names is None or label in names:
            fix()
            fixed.append(label)
    return fixed


def private_clocks() -> Clocks:
    """The timing loops' clocks (see the module docstring for how to use them); takes the snapshot if none was."""
    snapshot()
    return _RECORD.clocks


def verify_clocks() -> None:
    """Raise :class:`Tampered` if anything the guard watches was replaced (the originals stay out until the worker's
    check after the request restores them)."""
    bad = tampered()
    if bad:
        raise Tampered(bad)


def listing(names: list[str]) -> str:
    """The first few of ``names`` and how many more: the one way tampering is named in rows and messages."""
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def tamper_message(names: list[str]) -> str:
    """The error row of a cell during which ``names`` were tampered with."""
    return (f"tampered with {listing(names)} (the harness's clocks and torch functions are restored; this cell does "
            "not count)")
