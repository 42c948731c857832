"""Finding the implementations: the harness's reference baselines, then every plugin module.

:func:`discover` fills :data:`codabench.registry.REGISTRY`, in this order:

1. the harness's own torch-eager and torch-compile (:mod:`codabench.eager`; after the plugins again, for the ops
   a plugin added to ``workloads.ops.OPS``);
2. the project's built-in implementations (``kernels/``): the ``codabench.plugins`` entry points that its
   pyproject.toml declares, found like any other plugin's (:func:`builtin_entry_points`);
3. the ``codabench.plugins`` entry points of other installed packages (``entry_points=False``: skipped);
4. plugin files (``--plugin FILE``).

A module that fails to import, exits while being imported, or registers an op that does not exist is recorded in
``REGISTRY.load_errors`` with the file and line at fault (printed on the console and reported as an error row,
never dropped). The harness's references to its clocks, torch functions and own modules are recorded before the
first plugin import (:mod:`codabench.guard`) and checked after each one: a plugin that replaced any of them while
being imported gets a load error naming what it replaced, and the originals are restored before the next import, so
the blame never falls on a later plugin or cell.

Each import can be watched from outside (the cell worker reports them to its parent, :mod:`codabench.worker`): a
``gate`` asked before it may veto it (a reason, recorded as the plugin's load error: its import hung or crashed a
worker before, or left a thread of its own running), and ``done`` hears how many seconds it took and whether it left
such a thread.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import traceback
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Callable, Iterable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the built-in entry points come from the installed metadata
    tomllib = None

from codabench import eager, guard
from codabench.registry import REGISTRY, Registry

ENTRY_POINT_GROUP = "codabench.plugins"
PROJECT = "codabench"
"""The distribution whose entry points are the built-in implementations."""
SOURCE_TREE = Path(__file__).resolve().parents[1]


def builtin_entry_points() -> list[EntryPoint]:
    """The project's own ``codabench.plugins`` entry points.

    Read from the pyproject.toml of the source tree the harness is imported from, when it runs from one (installed
    editable or not: a checkout's pyproject.toml is current where the installed metadata may be stale or absent);
    else, or on Python 3.10 (no tomllib), from the installed distribution's metadata.
    """
    pyproject = SOURCE_TREE / "pyproject.toml"
    if tomllib is not None and pyproject.is_file():
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == PROJECT:
            declared = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
            return [EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in declared.items()]
    return [ep for ep in importlib.metadata.distribution(PROJECT).entry_points if ep.group == ENTRY_POINT_GROUP]


def other_entry_points() -> list[EntryPoint]:
    """The ``codabench.plugins`` entry points of every installed package but this project."""
    return [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            if getattr(ep.dist, "name", None) != PROJECT]


def describe_load_error(exc: BaseException) -> str:
    """One line for a plugin that failed to load: ``Type: message (file:line)``, the line being the innermost frame
    outside the harness and importlib (the plugin's own line where there is one)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "importlib" not in f.filename and Path(f.filename).parent != Path(__file__).parent]
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, SystemExit):
        msg = f"the plugin called sys.exit({exc.code!r}) while being imported"
    return f"{type(exc).__name__}: {msg}{where}"


Gate = Callable[[str], str | None]
"""Asked with a plugin's source before its import: a reason not to import it (its load error), or None."""
Done = Callable[[str, float, str | None], None]
"""Told a plugin's source, the seconds its import took (failed or not) and, where its import left what only a new
process is rid of (threads of its own running, :func:`codabench.guard.own_threads`; a change no restore undoes,
:func:`codabench.guard.lasting`), the load error that says so (a worker is replaced without that plugin)."""


def _record_failure(source: str, exc: BaseException, registered: list[tuple[str, str]]) -> None:
    """Record the failed import of ``source``; the implementations it ``registered`` before failing are withdrawn
    (:meth:`codabench.registry.Registry.withdraw`), and its load error names them."""
    error = describe_load_error(exc)
    if registered:
        REGISTRY.withdraw(registered)
        names = ", ".join(f"{name} ({op})" for op, name in registered)
        error += f"; left out, as registered by a failed import: {names}"
    REGISTRY.load_errors.append((source, error))


def import_tamper_message(names: list[str], kept: list[str]) -> str:
    """The load error of a plugin that replaced ``names`` while being imported (``kept``: those no restore undoes)."""
    done = f"{guard.listing(kept)} cannot be undone in this process" if kept else "the harness restored the originals"
    return f"tampered with {guard.listing(names)} while being imported ({done})"


def _import(source: str, load: Callable[[], None], gate: Gate | None, done: Done | None) -> None:
    """Run ``load`` (one plugin's import) unless ``gate`` vetoes it; a failure, an exit or tampering becomes the
    plugin's load error (and the tampering is undone where it can be; ``done`` hears of what cannot, and of threads
    it left running its own code: the code of the implementations it registered counts as its own, installed as a
    package or not)."""
    reason = gate(source) if gate is not None else None
    if reason is not None:
        REGISTRY.load_errors.append((source, reason))
        return
    clock = guard.private_clocks().perf_counter
    before = set(guard.tampered())  # already changed (by a test or debugger that runs discovery): not this plugin
    threads, keys = guard.running_threads(), set(REGISTRY.impls)
    t0 = clock()
    try:
        load()
    except (Exception, SystemExit) as e:  # a broken plugin (or one that exits) becomes an error row, not a crash
        _record_failure(source, e, [key for key in REGISTRY.impls if key not in keys])
    seconds = clock() - t0
    lasting = []  # the load errors of what only a new process is rid of
    bad = [name for name in guard.tampered() if name not in before]
    if bad:
        guard.restore(bad)
        kept = guard.lasting(bad)
        REGISTRY.load_errors.append((source, import_tamper_message(bad, kept)))
        if kept:
            lasting.append(import_tamper_message(bad, kept))
    own = guard.module_files(impl.source for key, impl in REGISTRY.impls.items() if key not in keys)
    started = guard.own_threads(threads, own)
    if started:
        REGISTRY.load_errors.append((source, guard.threads_message(started, "its import")))
        lasting.append(guard.threads_message(started, "its import"))
    if done is not None:
        done(source, seconds, "; ".join(lasting) or None)


def plugin_module_name(path: Path) -> str:
    """The module name a plugin file is imported under: its stem and a digest of its resolved path, so that
    same-named files of different folders both load."""
    return f"codabench_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def load_plugin_file(path: str | os.PathLike, gate: Gate | None = None, done: Done | None = None) -> None:
    """Import a plugin file (once: a file already imported is left alone); ``gate``, ``done``: see the module. Its
    folder is appended to ``sys.path``, so that it imports the modules beside it by name (``from my_helpers import
    ...``); appended, so a module of a name that is taken (``kernels``, ``codabench``, an installed package) is the
    taken one."""
    guard.snapshot()
    path = Path(path).resolve()
    if str(path) not in REGISTRY.plugin_files:
        REGISTRY.plugin_files.append(str(path))
    mod_name = plugin_module_name(path)
    if mod_name in sys.modules:
        return

    def load() -> None:
        if not path.is_file():
            raise FileNotFoundError(f"no such plugin file: {path}")
        if str(path.parent) not in sys.path:  # modules beside the plugin import by name, after every other place
            sys.path.append(str(path.parent))  # (a module of the harness's or an installed package's name is those)
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise

    _import(str(path), load, gate, done)


def discover(plugin_files: Iterable[str] = (), entry_points: bool = True, gate: Gate | None = None,
             done: Done | None = None) -> Registry:
    """Register every implementation in the order above (``entry_points``: also other packages' plugins; ``gate``,
    ``done``: see the module)."""
    guard.snapshot()
    eager.register(REGISTRY)
    try:
        builtin = builtin_entry_points()
    except importlib.metadata.PackageNotFoundError as e:
        builtin = []
        _record_failure("built-in implementations", e, [])
    for ep in builtin:
        _import(ep.value, ep.load, gate, done)
    if entry_points:
        for ep in other_entry_points():
            _import(f"entry point {ep.name}", ep.load, gate, done)
    for f in plugin_files:
        load_plugin_file(f, gate, done)
    eager.register(REGISTRY)  # the baselines of the ops the plugins added
    return REGISTRY
