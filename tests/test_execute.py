"""Mode semantics: what is timed in fwd, bwd and fwd_bwd, and which tensors get gradients."""
import re

import pytest
import torch

from codabench.case import Case
from codabench.execute import differentiable_keys, fresh_leaves, run_once, timed_call
from codabench.registry import Implementation, Native, prepared
from harness_helpers import CPU
from workloads.models import PRESETS
from workloads.ops import OPS

OP = OPS["rmsnorm_linear"]
TINY = PRESETS["tiny"]


class Counting(Implementation):
    """The reference math, counting forward calls; declares ``gamma`` a native const."""

    name, op = "counting", "rmsnorm_linear"
    native_consts = ("gamma",)

    def __init__(self):
        self.forwards = 0

    def run(self, native):
        self.forwards += 1
        return OP.reference(native, TINY)


def _native():
    return OP.make_inputs(TINY, torch.float32, CPU, 0)


def test_differentiable_keys_exclude_consts_and_native_consts():
    impl, native = Counting(), {**_native(), "scale": 2.0, "idx": torch.arange(3)}
    assert differentiable_keys(OP, impl, native) == ["a", "residual", "w_o", "w_c"]
    assert differentiable_keys(OPS["gemm_out"], impl, {"x": torch.ones(2)}) == []  # direct op: no autograd


def _grad_outputs(native):
    with torch.no_grad():
        out = OP.reference(native, TINY)
    return OP.grad_outputs(out, 3)


def test_bwd_times_the_backward_alone_on_a_fresh_graph():
    impl, native = Counting(), _native()
    timed = timed_call(OP, impl, native, "bwd", _grad_outputs(native))
    states = [timed.setup() for _ in range(2)]
    assert impl.forwards == 2  # the forward is the untimed setup
    for s in states:
        timed.fn(s)  # a second backward through one graph would raise: each sample has its own
    assert impl.forwards == 2
    assert all(not v.requires_grad for v in native.values())  # leaves are fresh detached copies


def test_fwd_bwd_times_forward_and_backward():
    impl, native = Counting(), _native()
    timed = timed_call(OP, impl, native, "fwd_bwd", _grad_outputs(native))
    leaves = timed.setup()
    assert impl.forwards == 0
    timed.fn(leaves)
    assert impl.forwards == 1
    assert leaves["a"].grad is not None and leaves["gamma"].grad is None


def test_fwd_runs_without_grad():
    impl, native = Counting(), _native()
    timed = timed_call(OP, impl, native, "fwd", None)
    with timed.context:
        out, ran_on = timed.fn(timed.setup() if timed.setup else None)
    assert not out["z"].requires_grad and impl.forwards == 1 and ran_on is native


def test_run_once_returns_canonical_gradients():
    case = Case(OP, TINY, "fwd_bwd", "fp32", CPU, _native())
    res = run_once(OP, Counting(), case, _grad_outputs(case.inputs))
    assert set(res.grads) == {"grad_a", "grad_residual", "grad_w_o", "grad_w_c"}
    assert set(res.outputs) == {"x", "z", "rstd"} and not res.outputs["z"].requires_grad


def test_a_call_gets_its_cells_context_beside_its_inputs_not_among_them():
    """The native inputs the harness hands ``run`` are what ``prepare`` returned, with the cell's model, recipe and
    GEMMs as attributes; fresh autograd leaves (the timed fwd_bwd call's) keep them."""
    seen = []

    class Reads(Counting):
        def run(self, native):
            seen.append((sorted(native), native.model, native.recipe, native.mm))
            return super().run(native)

    case = Case(OP, TINY, "fwd_bwd", "fp32", CPU, _native())
    run_once(OP, Reads(), case, _grad_outputs(_native()))
    (keys, model, recipe, mm), = seen
    assert keys == sorted(case.inputs) and model == TINY and recipe is None and mm is case.mm
    native = prepared(Reads(), case)
    leaves = fresh_leaves(native, ["a"])
    assert isinstance(leaves, Native) and leaves.context is native.context and leaves["a"].requires_grad
    assert fresh_leaves(dict(native), ["a"]).keys() == native.keys()  # a plain dict stays one


def test_an_error_names_the_implementations_line_and_a_verdict_on_its_result_none():
    """An exception raised in the implementation names its file and line; the harness's verdict on what a call
    returned (:class:`CellError`) is the verdict alone, not the harness's line that raised it."""
    from codabench.execute import CellError, check_outputs
    from codabench.measure import describe_exception

    with pytest.raises(CellError) as verdict:
        check_outputs(torch.zeros(2), {}, CPU)
    assert describe_exception(verdict.value) == "CellError: run() returned torch.Tensor, expected a dict of named tensors"
    with pytest.raises(KeyError) as fault:
        Counting().run({})
    described = describe_exception(fault.value)
    assert re.fullmatch(r"KeyError: .* \(\w+\.py:\d+\)", described), described
