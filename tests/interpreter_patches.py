"""The Triton interpreter without its repeated patching of ``triton.language`` inside a launch, for the tests.

Each launch in the interpreter (``GridExecutor.__call__``) patches the ``triton.language`` modules the kernel's
globals hold (every builtin wrapped for the interpreter, ``range`` and the tensor's methods replaced) and restores
them when the launch ends. Each call of a nested ``@triton.jit`` function inside it (an epilogue primitive, a
mainloop helper: the CODA kernels are made of them) patches the modules of *its* globals again. When those are
modules already patched since the launch began, that is a no-op (a wrapped builtin is not a builtin, so nothing is
wrapped twice; the other attributes get the same replacements), but it walks every member of the modules each time:
~1 ms a call, hundreds of calls a launch of a CODA kernel (half its time at a test's shapes).

:func:`install` skips exactly that case. Every other call patches as before, and the launch's own patching and
restoring are untouched, so the kernels compute the same values (tests/test_interpreter.py compares them with the
unpatched interpreter's, bit for bit). ``tests/conftest.py`` installs it in each test process: the default run took
1724 s of CPU against 2090 (the HF drop-in's and the kernels' tests, which launch kernels in the test process, 35-40%
less each). The harness's worker processes, and so the runs a test starts, keep Triton's interpreter as it ships:
a whole run on the CPU spends its time elsewhere (the smoke suite: 363 s with it, 351 without). Where this Triton's
interpreter lacks the internals it relies on, it changes nothing (the tests are slower, not different);
``CODABENCH_INTERPRETER_PATCH=0`` leaves the interpreter as Triton ships it.
"""
from __future__ import annotations

import inspect
import os
import threading
import weakref
from typing import Any


ENV = "CODABENCH_INTERPRETER_PATCH"


def install() -> bool:
    """Patch the interpreter of this process (once, unless ``CODABENCH_INTERPRETER_PATCH=0``); whether it is
    patched."""
    if os.environ.get(ENV) == "0":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid_executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if grid_executor is None or patch_lang is None or scope_cls is None:
        return False
    if getattr(patch_lang, "skips_repeats", False):
        return True
    launches = threading.local()
    modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a function -> its language modules

    def languages(fn: Any) -> frozenset[int]:
        found = modules.get(fn)
        if found is None:
            found = modules[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return found

    def patch_once(fn: Any):
        stack = getattr(launches, "stack", None)
        if not stack:
            return patch_once.original(fn)
        launch = stack[-1]  # [the launch's kernel, the modules patched since it began (None: not yet)]
        if launch[1] is None and fn is launch[0]:  # the launch's own patching
            launch[1] = languages(fn)
            return patch_once.original(fn)
        if launch[1] is not None and languages(fn) <= launch[1]:
            return scope_cls()  # nothing to patch: an empty scope
        scope = patch_once.original(fn)  # Triton's own patching (an attribute: the tests count its calls)
        if launch[1] is not None:
            launch[1] = launch[1] | languages(fn)
        return scope

    run_launch = grid_executor.__call__

    def tracked_launch(self, *args: Any, **kwargs: Any) -> Any:
        stack = launches.__dict__.setdefault("stack", [])
        stack.append([self.fn, None])
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            stack.pop()

    patch_once.skips_repeats = True
    patch_once.original, tracked_launch.original = patch_lang, run_launch
    interpreter._patch_lang = patch_once
    grid_executor.__call__ = tracked_launch
    return True
