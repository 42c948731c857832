"""Timing summaries and the sampling loop (CPU path; the CUDA path is exercised on the GPU node)."""
import time
from contextlib import contextmanager

import pytest
import torch

from codabench.timing import CPU_WALL, Timing, TimingConfig, measure, per_round


def test_summary_statistics():
    t = Timing([5.0, 1.0, 4.0, 2.0, 3.0], "cuda-events")
    assert t.median == 3.0
    assert t.p20 == pytest.approx(1.8)  # linear interpolation between the 1st and 2nd of 5 sorted samples
    assert t.p80 == pytest.approx(4.2)
    assert t.cv == pytest.approx(1.5811388 / 3.0)
    assert t.is_perf
    assert Timing([2.0], CPU_WALL).cv == 0.0
    assert not Timing([2.0], CPU_WALL).is_perf


def test_setup_runs_before_every_sample_and_is_not_timed():
    calls = []

    def setup():
        time.sleep(0.03)
        calls.append("setup")
        return len(calls)

    def fn(state):
        calls.append(("fn", state))

    t = measure(fn, setup, torch.device("cpu"), TimingConfig(cpu_reps=4))
    assert t.kind == CPU_WALL and len(t.samples_ms) == 4
    assert max(t.samples_ms) < 20.0  # the 30 ms setup sleeps are outside the clock
    # one warm-up call, then four samples, each fed the state its own setup returned
    assert [c for c in calls if c != "setup"] == [("fn", i) for i in (1, 3, 5, 7, 9)]


def test_first_call_is_timed_on_its_own():
    """The first call (where compilers, JITs and autotuners do their work) is its own figure, not a sample."""
    calls = []

    def fn(_):
        calls.append(1)
        time.sleep(0.05 if len(calls) == 1 else 0.0)

    t = measure(fn, None, torch.device("cpu"), TimingConfig(cpu_reps=3))
    assert len(calls) == 4 and len(t.samples_ms) == 3
    assert t.first_call_s >= 0.05 and max(t.samples_ms) < 20.0


def test_during_wraps_the_kept_samples_and_not_the_first_call():
    """The clock sampler's context (``during``) sees the kept samples only: a first call that compiles for seconds,
    with the GPU idle at its top clock, must not weigh in the cell's clock."""
    events = []

    @contextmanager
    def during():
        events.append("enter")
        yield
        events.append("exit")

    t = measure(lambda _: events.append("call"), None, torch.device("cpu"), TimingConfig(cpu_reps=3), during=during)
    assert events == ["call", "enter", "call", "call", "call", "exit"] and len(t.samples_ms) == 3


def test_a_round_takes_its_share_of_the_samples():
    cfg = TimingConfig(reps=20, rounds=3)
    r = per_round(cfg)
    assert r.reps == 7 and r.rounds == 3  # 3 x 7 >= 20 samples in all
    adaptive = per_round(TimingConfig(rounds=2))
    assert (adaptive.reps, adaptive.min_reps, adaptive.max_reps) == (None, 10, 100)
    assert adaptive.target_ms == TimingConfig().target_ms / 2
    assert per_round(TimingConfig(reps=5)) == TimingConfig(reps=5)
