"""Plugins that cheat, one per known trick (benchmarking.md, "Verdicts that hold up"): each must get an error row.

All pass the correctness pass (their first call on the correctness inputs is honest) and would look fast or correct
in the timing if only the first call were checked.
"""
import time

import torch
import torch.nn.functional as F

from codabench.registry import register


def _first_result():
    """Computes once, then returns its first result whatever the input (the "77x" plugin)."""
    saved = {}

    def run(x, w):
        if "out" not in saved:
            saved["out"] = F.linear(x, w)
        return {"out": saved["out"]}

    return run


register("gemm_out", "cheat-first-result", dtypes=("fp32",))(_first_result())


def _by_address():
    cache = {}

    def run(x, w):
        key = (x.data_ptr(), w.data_ptr())
        if key not in cache:
            cache[key] = F.linear(x, w)
        return {"out": cache[key]}

    return run


register("gemm_out", "cheat-address-cache", dtypes=("fp32",))(_by_address())


def _by_shape():
    cache = {}

    def run(x, w):
        key = (tuple(x.shape), tuple(w.shape))
        if key not in cache:
            cache[key] = F.linear(x, w)
        return {"out": cache[key].clone()}

    return run


register("gemm_out", "cheat-shape-cache", dtypes=("fp32",))(_by_shape())


def _stops_computing(honest_calls: int):
    state = {"calls": 0, "out": None}

    def run(x, w):
        state["calls"] += 1
        if state["calls"] <= honest_calls or state["out"] is None or state["out"].shape[0] != x.shape[0]:
            state["out"] = F.linear(x, w)
        return {"out": state["out"]}

    return run


register("gemm_out", "cheat-call-count", dtypes=("fp32",))(_stops_computing(3))


class _ShrunkClock:
    """``time.perf_counter`` running at a tenth of the speed."""

    def __init__(self, clock):
        self.clock, self.t0 = clock, clock()

    def __call__(self):
        return self.t0 + (self.clock() - self.t0) / 10


def _slows_the_clock():
    def run(x, w):
        if not isinstance(time.perf_counter, _ShrunkClock):
            time.perf_counter = _ShrunkClock(time.perf_counter)
        return {"out": F.linear(x, w)}

    return run


register("gemm_out", "cheat-clock", dtypes=("fp32",))(_slows_the_clock())


def _slows_the_baseline():
    """Leaves the baselines a slower F.rms_norm (rmsnorm_linear's reference uses it)."""
    def run(x, w):
        original = F.rms_norm

        def slow(*a, **k):
            time.sleep(0.01)
            return original(*a, **k)

        F.rms_norm = slow
        return {"out": F.linear(x, w)}

    return run


register("gemm_out", "cheat-baseline", dtypes=("fp32",))(_slows_the_baseline())


def _side_stream():
    """GPU: computes on a side stream and returns without the calling stream waiting for it."""
    streams, eyes, busy = {}, {}, {}

    def run(x, w):
        if x.device not in streams:
            streams[x.device] = torch.cuda.Stream(x.device)
            busy[x.device] = torch.ones(8192, 8192, device=x.device, dtype=torch.bfloat16)
        s, big = streams[x.device], busy[x.device]
        eye = eyes.setdefault((w.shape[0], x.dtype), torch.eye(w.shape[0], device=x.device, dtype=x.dtype))
        s.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(s):
            out = F.linear(x, w)
            for _ in range(50):  # x @ I is exact: the output is ready only after 50 more GEMMs on the side stream
                out = out @ eye
            # and ~10 ms more (8 x 1.1 TFLOP): far above the host's time to launch them, which the calling stream's
            # events see; with the 50 small GEMMs alone (~0.05 ms each, about their launch time) a cold host could
            # take as long to launch them as the GPU took to run them, and the events saw the whole call
            for _ in range(8):
                torch.mm(big, big)
        return {"out": out}

    return run


register("gemm_out", "cheat-side-stream", dtypes=("bf16",), requires=("cuda",))(_side_stream())
