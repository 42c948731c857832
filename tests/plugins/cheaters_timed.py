"""Cheats that pass every check made on untimed calls and are caught only by how the timed calls run.

- ``cheat-lazy-tensor``: returns a torch.Tensor subclass whose GEMM would run only when the result is first read (on
  a thread, after the timed region); caught by the exact-type check of every call's outputs.
- ``cheat-value-cache``: a cache keyed by 8 sampled values of each input. The checks' refilled and new buffers change
  the sample, so it recomputes for them; timed calls on repeated data would be free. Each sweep refills the timed
  buffers with new values, so it never hits in a timed call (``VALUE_CACHE`` counts hits, for the test).
- ``cheat-stale-after-checks``: honest for as many calls as the checks make before the timing (correctness, first
  call, same buffers, refilled, new buffers), then returns its last result; caught by the rechecks of timed calls'
  outputs against PyTorch's on the sweep's new inputs.
"""
import torch
import torch.nn.functional as F

from codabench.registry import register

VALUE_CACHE = {"hits": 0, "calls": 0}


class _Lazy(torch.Tensor):
    """A tensor subclass standing for work deferred until the value is read."""


@register("gemm_out", "cheat-lazy-tensor", dtypes=("fp32",))
def lazy(x, w):
    return {"out": F.linear(x, w).as_subclass(_Lazy)}


def _sample_key(*tensors):
    return tuple(tuple(t.reshape(-1)[:: max(t.numel() // 8, 1)][:8].tolist()) for t in tensors)


def _cache(keyed):
    cache = {}

    def run(x, w):
        VALUE_CACHE["calls"] += keyed is _both
        key = keyed(x, w)
        if key in cache:
            VALUE_CACHE["hits"] += keyed is _both
            return {"out": cache[key]}
        cache[key] = F.linear(x, w)
        return {"out": cache[key]}

    return run


def _both(x, w):
    return _sample_key(x, w)


register("gemm_out", "cheat-value-cache", dtypes=("fp32",))(_cache(_both))


def _stale_after(honest_calls):
    state = {"calls": 0, "out": None}

    def run(x, w):
        state["calls"] += 1
        if state["calls"] <= honest_calls:
            state["out"] = F.linear(x, w)
        return {"out": state["out"].clone()}

    return run


register("gemm_out", "cheat-stale-after-checks", dtypes=("fp32",))(_stale_after(5))
