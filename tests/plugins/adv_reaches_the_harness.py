"""Plugins whose call walks up the stack into the harness's frames and changes the harness's own objects there: each
must be an error row saying so, with the objects put back before any other implementation runs.

- ``adv-loosens-the-rule``: in its correctness call, finds the group's reference (``check_impl``'s ``group``) and
  makes PyTorch's error 1.0 for every output, so that the pass rule would allow anything; then returns zeros.
- ``adv-slows-a-member``: in a timed call, finds the sweep's members and wraps torch-eager's call in a busy wait of
  2 ms (torch-eager would look slower); computes honestly.
- ``adv-skips-its-checks``: in a timed call, takes its own member's output checks away (``after``) and returns
  zeros from then on.
"""
import dataclasses
import sys
import time

import torch
import torch.nn.functional as F

from codabench.registry import register


def _frames():
    f = sys._getframe(2)
    while f is not None:
        yield f
        f = f.f_back


@register("gemm_out", "adv-loosens-the-rule", dtypes=("fp32",))
def loosens(x, w):
    for f in _frames():
        group = f.f_locals.get("group")
        if f.f_code.co_name == "check_impl" and hasattr(group, "torch_stats"):
            group.torch_stats = {k: dataclasses.replace(s, rel_err=1.0) for k, s in group.torch_stats.items()}
    return {"out": torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype)}


def _members():
    for f in _frames():
        members = getattr(f.f_locals.get("self"), "members", None)
        if f.f_code.co_name == "push" and members is not None:
            return members
    return []


def _slowed(call):
    def slowed(state):
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass
        return call(state)
    return slowed


@register("gemm_out", "adv-slows-a-member", dtypes=("fp32",))
def slows(x, w):
    for m in _members():
        if m.name == "torch-eager":
            m.call = _slowed(m.call)
    return {"out": F.linear(x, w)}


@register("gemm_out", "adv-skips-its-checks", dtypes=("fp32",))
def skips(x, w):
    mine = [m for m in _members() if m.name == "adv-skips-its-checks"]
    for m in mine:
        m.after = None
    if mine:
        return {"out": torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype)}
    return {"out": F.linear(x, w)}
