"""Plugins that tamper with the harness itself during their timed calls, each left in place: every one must be an
error row naming what it replaced (the guard restores it before the next cell)."""
import builtins
import secrets
import signal
import sys
import time

import torch
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


@register("gemm_out", "cheat-anomaly-mode", dtypes=("fp32",))
def anomaly_mode(x, w):
    """Leaves autograd's anomaly detection on: every later backward (the baselines') records and checks far more."""
    torch.autograd.set_detect_anomaly(True, check_nan=True)
    return {"out": F.linear(x, w)}


_PENDING = []


def _finish(signum, frame):
    while _PENDING:
        x, w, out = _PENDING.pop()
        torch.matmul(x, w.T, out=out)


@register("gemm_out", "cheat-signal-handler", dtypes=("fp32",))
def signal_handler(x, w):
    """Returns an empty output and finishes it in a SIGALRM handler armed to fire just after the call: no thread,
    no stream, the main thread's own code after the timed region."""
    signal.signal(signal.SIGALRM, _finish)
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _PENDING.append((x, w, out))
    signal.setitimer(signal.ITIMER_REAL, 40e-6)
    return {"out": out}


@register("gemm_out", "cheat-interval-timer", dtypes=("fp32",))
def interval_timer(x, w):
    """Leaves an interval timer armed, whose handler burns time inside whatever call runs when it fires."""
    signal.signal(signal.SIGALRM, lambda *_: time.sleep(2e-4))
    signal.setitimer(signal.ITIMER_REAL, 5e-4, 5e-4)
    return {"out": F.linear(x, w)}


class _Predictable(secrets.SystemRandom):
    def sample(self, population, k, **kw):
        return list(population)[:k]


@register("gemm_out", "cheat-random-source", dtypes=("fp32",))
def random_source(x, w):
    """Makes the random draws of a harness that would use ``secrets.SystemRandom`` at call time predictable."""
    secrets.SystemRandom = _Predictable
    return {"out": F.linear(x, w)}
