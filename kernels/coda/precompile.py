"""Compile a step's Triton kernels in parallel before its first run.

A cold first step is compile-bound: on an H100 the first training step of 4 Llama-3.2-1B layers at 16384 tokens
spent ~17 of ~20 s compiling ~15 kernels one after the other (docs/performance.md), LLVM in-process and
ptxas as a subprocess, while 15 of the node's 16 cores idled. :func:`precompile` runs the step once as a *dry
pass*: every Triton launch inside it hands its compile to a pool of threads and returns without running
(Triton's async compile mode, each launch turned into a warm-up), so nothing the step's Triton kernels would
write is written and its results are garbage. Then it waits for the compiles (Triton releases the GIL in its
LLVM passes, and ptxas and the launcher builds are subprocesses) and builds the kernels' launchers the same way.
The real first step then finds every kernel compiled::

    precompile(lambda: torch.autograd.grad(model(**batch).loss, params), device)   # garbage, discarded
    loss = model(**batch).loss; loss.backward()                                   # compiles nothing

By default nothing is measured on the way: an autotuning key with no cached or shipped config gets its predicted
config (:func:`kernels.coda.tuning.predict`) and a fused-or-split choice not made yet its predicted path
(:mod:`kernels.coda.strategy`), so the dry pass goes through the whole step and compiles exactly the binaries the
real step will launch, all at once. With tuning on (``CODABENCH_TUNE=1``), where going on would need a measurement
on real data, the dry pass does not measure: a choice not made yet compiles the fused path without choosing
(:func:`skipped`), and an untuned key ends the dry pass there (:func:`untuned` raises :class:`Untuned`, which
:func:`precompile` catches: what follows may depend on the config the launch would have used). The real step then
tunes and chooses those, compiling every candidate config one after the other.

The step must have no lasting effect besides its results: no optimizer step, no ``.backward()`` into parameters
(``torch.autograd.grad`` leaves ``.grad`` alone). The dry pass is process-wide (Triton's launch path is patched
for its duration, because the autograd engine runs the backward on threads of its own): run no other Triton work
beside it. On a CPU (the Triton interpreter) there is nothing to compile, and ``step`` is not called; nor with
``CODABENCH_PRECOMPILE=0``.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Callable, Iterable, Iterator

import torch
from triton.runtime import _async_compile, driver
from triton.runtime.jit import JITFunction

ENV = "CODABENCH_PRECOMPILE"
"""``CODABENCH_PRECOMPILE=0`` turns :func:`precompile` into a no-op (the serial first step, for comparison)."""
_DRY = False
"""True during a dry pass (process-wide, read from the autograd engine's threads too)."""
_LOCK = threading.Lock()


class Untuned(Exception):
    """A dry pass reached a launch whose autotuning key has no config yet: the pass ends there."""


@dataclass(frozen=True)
class Precompiled:
    """What a dry pass did: ``kernels`` compiles submitted, in ``seconds`` (wall, the wait included); ``skipped``:
    the choices it left to the real step (:func:`skipped`); ``stopped``: the untuned launch it ended at, or None;
    ``reason``: why nothing was done, or None."""

    kernels: int
    seconds: float
    skipped: tuple[str, ...] = ()
    stopped: str | None = None
    reason: str | None = None


_SKIPPED: list[str] = []


def skipped(what: str) -> bool:
    """Called where a host function is about to measure its paths (fused, split, gluon) on its data: in a dry pass,
    whose data is garbage, note ``what`` as left to the real step and return True; otherwise return False."""
    if _DRY:
        _SKIPPED.append(what)
    return _DRY


def untuned(what: str) -> None:
    """Called where a launch is about to tune its config on its data: in a dry pass, raise :class:`Untuned`."""
    if _DRY:
        raise Untuned(what)


def dry_pass() -> bool:
    """Whether a dry pass is running (its launches compile only)."""
    return _DRY


def compiles_here(device: torch.device) -> bool:
    """Whether Triton compiles for ``device``: a CUDA device, not the interpreter."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


@contextmanager
def _launches_compile_only(mode: _async_compile.AsyncCompileMode) -> Iterator[None]:
    """Every ``JITFunction.run`` in the block: a warm-up (compile, no launch) under ``mode``, on any thread."""
    global _DRY
    run = JITFunction.run

    def compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        token = _async_compile.active_mode.set(mode)  # the mode is a context variable: set it on this thread too
        try:
            return run(self, *args, grid=grid, warmup=True, **kwargs)
        finally:
            _async_compile.active_mode.reset(token)

    JITFunction.run, _DRY = compile_only, True
    try:
        yield
    finally:
        JITFunction.run, _DRY = run, False


def _build_launcher(kernel: Any) -> None:
    """Build (into Triton's on-disk cache) the launcher ``kernel``'s first launch would build."""
    driver.active.launcher_cls(kernel.src, kernel.metadata)


def precompile(step: Callable[[], Any], device: torch.device, workers: int | None = None) -> Precompiled:
    """Run ``step`` once as a dry pass (module docstring) on ``workers`` threads (default: one per core, at most
    32), and wait until what it launched is compiled. Returns what was done; ``step``'s results are dropped."""
    if os.environ.get(ENV, "1") == "0":
        return Precompiled(0, 0.0, reason=f"turned off by {ENV}=0")
    if not compiles_here(device):
        return Precompiled(0, 0.0, reason="nothing to compile on " + ("the interpreter" if device.type == "cuda"
                                                                     else device.type))
    workers = workers or min(32, os.cpu_count() or 1)
    t0, stopped = perf_counter(), None
    with _LOCK, ThreadPoolExecutor(workers, thread_name_prefix="coda-compile") as pool:
        with _async_compile.AsyncCompileMode(pool, ignore_errors=True) as mode:
            _SKIPPED.clear()
            with _launches_compile_only(mode), torch.cuda.device(device):
                try:
                    step()
                except Untuned as stop:  # (raised in the autograd engine's thread, it reaches us as itself)
                    stopped = str(stop)
            pending = dict(mode.future_kernels)
        # a failed compile is left to the real launch, which raises it where it belongs
        kernels = [k for k in (f.result(ignore_errors=True) for f in pending.values()) if k is not None]
        wait([pool.submit(_build_launcher, k) for k in kernels])  # one that fails is built again at the launch
    torch.cuda.synchronize(device)
    return Precompiled(len(pending), perf_counter() - t0, tuple(_SKIPPED), stopped)


def precompile_autograd(forward: Callable[[], Any], inputs: Iterable[torch.Tensor], device: torch.device) -> Precompiled:
    """:func:`precompile` of ``forward()`` and its backward: the gradients, by ``torch.autograd.grad`` (nothing is
    accumulated into ``.grad``) with ones upstream, of every tensor ``forward`` returns that requires grad (a tensor,
    or a dict / tuple of them) with respect to those of ``inputs`` that require grad."""
    inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step() -> None:
        out = forward()
        values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else (out,)
        outs = [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs and inputs:
            torch.autograd.grad(outs, inputs, [torch.ones_like(t) for t in outs], allow_unused=True)

    return precompile(step, device)
