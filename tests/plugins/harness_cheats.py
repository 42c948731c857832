"""Plugins that tamper with the harness itself during their timed calls, each left in place: every one must be an
error row naming what it replaced (the guard restores it before the next cell)."""
import builtins
import sys

import torch.nn.functional as F

import codabench.metrics
import codabench.guard
from codabench.registry import register


class _ShrunkClock:
    """A clock running at a tenth of the speed of ``clock``."""

    def __init__(self, clock):
        self.clock, self.t0 = clock, clock()

    def __call__(self):
        return self.t0 + (self.clock() - self.t0) / 10


@register("gemm_out", "cheat-harness-clock", dtypes=("fp32",))
def harness_clock(x, w):
    """Rebinds where the timing loops take their clocks (the tester's 4.4x was the timing module's bound clock)."""
    if not getattr(codabench.guard.private_clocks, "shrunk", False):
        real = codabench.guard.private_clocks

        def shrunk():
            clocks = real()
            return clocks._replace(perf_counter=_ShrunkClock(clocks.perf_counter))

        shrunk.shrunk = True
        codabench.guard.private_clocks = shrunk
    return {"out": F.linear(x, w)}


def _no_error(*args, **kwargs):
    return 0.0


@register("gemm_out", "cheat-code-swap", dtypes=("fp32",))
def code_swap(x, w):
    """Gives the harness's error metric the code of a function that reports no error."""
    codabench.metrics.rel_err.__code__ = _no_error.__code__
    return {"out": F.linear(x, w)}


def _slow_profile(frame, event, arg):
    return None


@register("gemm_out", "cheat-profile-hook", dtypes=("fp32",))
def profile_hook(x, w):
    """Leaves a profile hook that runs on every call of everything timed after it (the baselines slow down)."""
    sys.setprofile(_slow_profile)
    return {"out": F.linear(x, w)}


@register("gemm_out", "cheat-builtin", dtypes=("fp32",))
def builtin(x, w):
    """Replaces a builtin the harness's statistics use."""
    original = builtins.sorted
    builtins.sorted = lambda *a, **k: original(*a, **k)
    return {"out": F.linear(x, w)}
