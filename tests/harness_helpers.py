"""Shared helpers of the harness tests: registry isolation, small runs on the CPU."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from codabench import guard
from codabench.matrix import Selection
from codabench.discovery import discover
from codabench.registry import REGISTRY
from codabench.config import RunConfig
from codabench.runner import Runner
from codabench.timing import TimingConfig

PLUGINS = Path(__file__).resolve().parent / "plugins"
CPU = torch.device("cpu")


@contextmanager
def isolated_registry():
    """Discover the built-in implementations; undo every registration and plugin load made inside."""
    discover(entry_points=False)
    impls, errors, files = dict(REGISTRY.impls), list(REGISTRY.load_errors), list(REGISTRY.plugin_files)
    modules = set(sys.modules)
    try:
        yield REGISTRY
    finally:
        REGISTRY.impls.clear()
        REGISTRY.impls.update(impls)
        guard.snapshot(refresh=True)  # the guard keeps a registry's entries: it forgets those undone here
        REGISTRY.load_errors[:] = errors
        REGISTRY.plugin_files[:] = files
        for name in set(sys.modules) - modules:  # so the next test imports (and registers) them again
            if name.startswith("codabench_plugin_") or str(getattr(sys.modules[name], "__file__", "")).startswith(
                    str(PLUGINS)):
                del sys.modules[name]


def make_runner(out: Path, ops=("gemm_out",), modes=("fwd", "bwd", "fwd_bwd"), impls=("torch-eager",),
                models=("tiny",), dtypes=("fp32",), device=CPU, timing=None, isolate=True, **kw) -> Runner:
    """A runner over a small selection. ``isolate``: cells in a worker process, which loads the plugin files the
    registry has loaded (inline: for tests that register functions or patch the harness in this process)."""
    sel = Selection(ops=tuple(ops), models=tuple(models), modes=tuple(modes), dtypes=tuple(dtypes),
                    impls=tuple(impls))
    cfg = RunConfig(out_dir=out, selection=sel, device=device, show_progress=False,
                    timing=timing or TimingConfig(), isolate=isolate, plugin_files=tuple(REGISTRY.plugin_files),
                    entry_points=False, **kw)
    return Runner(cfg, REGISTRY)
