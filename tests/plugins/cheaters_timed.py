"""Cheats that pass every check made on untimed calls and are caught only by how the timed calls run.

- ``cheat-lazy-tensor``: returns a torch.Tensor subclass whose GEMM would run only when the result is first read (on
  a thread, after the timed region); caught by the exact-type check of every call's outputs.
- ``cheat-value-cache``: a cache keyed by 8 sampled values of each input. The checks' refilled and new buffers change
  the sample, so it recomputes for them; timed calls on repeated data would be free. Each sweep refills the timed
  buffers with new values, so it never hits in a timed call (``VALUE_CACHE`` counts hits, for the test).
- ``cheat-duck-output``: returns an object that is no tensor but answers to one (its ``__class__`` says
  ``torch.Tensor``, its attributes run the GEMM when first read); caught by the exact-type check (``type()``).
- ``cheat-work-in-conversion``: ``run`` returns a one-element tensor expanded to the output's shape, and the untimed
  ``outputs_to_canonical`` computes the GEMM from the inputs; caught because a conversion may only move values.
- ``cheat-stale-after-checks``: honest for as many calls as the checks make before the timing (correctness, first
  call, same buffers, refilled, new buffers), then returns its last result; caught by the rechecks of timed calls'
  outputs against PyTorch's on the sweep's new inputs.
"""
import torch
import torch.nn.functional as F

from codabench.registry import Implementation, register

VALUE_CACHE = {"hits": 0, "calls": 0}


class _Lazy(torch.Tensor):
    """A tensor subclass standing for work deferred until the value is read."""


@register("gemm_out", "cheat-lazy-tensor", dtypes=("fp32",))
def lazy(x, w):
    return {"out": F.linear(x, w).as_subclass(_Lazy)}


class _Later:
    """Not a tensor: it says it is one, and computes the GEMM when any attribute is first read."""

    __class__ = torch.Tensor

    def __init__(self, x, w):
        self._args, self._value = (x, w), None

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if self._value is None:
            self._value = F.linear(*self._args)
        return getattr(self._value, name)


@register("gemm_out", "cheat-duck-output", dtypes=("fp32",))
def duck(x, w):
    return {"out": _Later(x, w)}


@register("gemm_out", "cheat-work-in-conversion", dtypes=("fp32",))
class WorkInConversion(Implementation):
    def run(self, native):
        x, w = native["x"], native["w"]
        return {"out": torch.zeros(1, dtype=x.dtype).expand(x.shape[0], w.shape[0])}

    def outputs_to_canonical(self, outputs, native):
        return {"out": F.linear(native["x"], native["w"])}


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
