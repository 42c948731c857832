"""Implementations of ops and their registration.

An implementation computes one op in its own ("native") layout. The harness calls, per cell::

    native = prepared(impl, case)          # untimed: impl.prepare(case) (weight permutation, quantization, tables)
    out    = impl.run(native)              # timed (forward; autograd graph when grads are on)
    impl.outputs_to_canonical(out, native) # untimed, for comparison
    impl.grad_outputs_to_native(dy, native), impl.grads_to_canonical(grads, native)   # untimed
    # the three conversions may only move values (rename, reorder, split: codabench.execute.moved)
    impl.describe(native)                  # after the timed calls: how it ran them (the strategy column)

Register a plain function (it is ``run``, called with the native tensors as keywords)::

    @register("gemm_out", "my-gemm", modes=("fwd",), dtypes=("bf16",))
    def my_gemm(x, w):
        return {"out": x @ w.T}

or decorate a subclass of :class:`Implementation` to override any step. ``native`` is a :class:`Native`: the dict
``prepare`` returned, with the cell's :class:`codabench.case.Context` as attributes (``native.model``,
``native.recipe``, ``native.mm``), so that what a call knows of its cell never rides among its inputs.
:mod:`codabench.discovery` finds the modules that register them (entry points, ``--plugin`` files); a module that fails to import (or registers an op
that does not exist) is recorded in ``load_errors``.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from codabench import guard
from codabench.case import Case, Context
from workloads.fp8 import Recipe, TorchGemms
from workloads.models import ModelShape
from workloads.op import DTYPES, MODES
from workloads.ops import OPS

TUNE_ENV = "CODABENCH_TUNE"
"""Set to ``1`` by the run command's ``--tune`` (the worker inherits it): an implementation may then tune on the
cell's data (autotuning, measured choices) and keep what it learns for later runs; unset, it picks without
measuring, so that its first result comes fast."""

Tensors = dict[str, Any]
"""Named tensors; an implementation's native dict may also carry values of its own (a built model, a table), which
the harness leaves alone."""


class Native(dict):
    """The native inputs of one call (what ``prepare`` returned; a dict, as ``run`` always took them) and the cell's
    :class:`codabench.case.Context` (``context``, and its fields as attributes). The harness builds it
    (:func:`prepared`); a new dict of the same call's inputs (fresh autograd leaves) keeps the context
    (:meth:`with_inputs`)."""

    def __init__(self, inputs: Mapping[str, Any], context: Context):
        super().__init__(inputs)
        self.context = context

    def with_inputs(self, inputs: Mapping[str, Any]) -> Native:
        return Native(inputs, self.context)

    @property
    def model(self) -> ModelShape:
        return self.context.model

    @property
    def recipe(self) -> Recipe | None:
        """The cell's fp8 recipe (None: not an fp8 cell)."""
        return self.context.recipe

    @property
    def mm(self) -> TorchGemms:
        """The GEMMs of the op's PyTorch composition in this cell (:attr:`codabench.case.Case.mm`)."""
        return self.context.mm


def prepared(impl: Implementation, case: Case) -> Native:
    """``impl.prepare(case)`` with the cell's context: what ``run`` is called with."""
    return Native(impl.prepare(case), case.context)


class FirstCalls:
    """Which shapes an implementation has run: :meth:`Implementation.prepare` runs before every timed call (new inputs
    each time), so one-time work for a shape's first ``run`` (compiling its kernels first, say) is armed at that
    shape's first ``prepare`` alone: ``arm(key, device)`` there, ``take()`` in ``run`` (the device, once; else None)."""

    def __init__(self) -> None:
        self._seen: set[Any] = set()
        self._armed: Any = None

    def arm(self, key: Any, device: Any) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self._armed = device

    def take(self) -> Any:
        device, self._armed = self._armed, None
        return device


class Implementation:
    """Base class: identity layout conversions, canonical inputs as the native ones."""

    name: str = ""
    op: str = ""
    modes: tuple[str, ...] = ("fwd", "bwd", "fwd_bwd")
    dtypes: tuple[str, ...] = ("fp32", "fp16", "bf16")
    requires: tuple[str, ...] = ()
    """Requirement tokens (:data:`REQUIREMENTS`): ``cuda``, ``sm90``, ``triton`` (GPU or interpreter), ``triton-dot``
    (as ``triton``; its kernels multiply tiles with ``tl.dot``, which the interpreter computes wrongly in bf16),
    ``cpu``, ``pkg:<module>`` (:func:`requirement_missing`)."""
    description: str = ""
    label: str = "baseline"
    """How the report groups it: ``baseline``, ``fused`` (CODA) or ``expert fused``."""
    native_consts: tuple[str, ...] = ()
    """Extra non-differentiable native inputs created by ``prepare`` (tables, scales)."""
    source: str = ""
    grads_in_forward: bool = False
    """Its forward computes the gradients when the inputs require grad (a fused linear cross-entropy): ``bwd`` alone
    would time little more than handing them back, so that cell is n/a and ``fwd_bwd`` is the comparison."""

    def skip_reason(self, case: Case) -> str | None:
        """Why this cell cannot run here, or None. Default: mode, dtype and requirements."""
        if case.mode == "bwd" and self.grads_in_forward:
            return (f"n/a: {self.name} computes the gradients inside the forward; the backward alone only hands "
                    "them back (compare fwd_bwd)")
        if case.mode not in self.modes:
            return f"n/a: {self.name} has no {case.mode} mode"
        if case.dtype not in self.dtypes:
            return f"n/a: {self.name} does not support {case.dtype}"
        for req in self.requires:
            reason = requirement_missing(req, case.device, case.dtype)
            if reason:
                return reason
        return None

    def prepare(self, case: Case) -> Tensors:
        """Canonical inputs -> the native ones ``run`` takes (layouts, quantization), untimed. The harness calls it
        for the correctness pass, the checks, and before every timed call (new inputs each time, refilled into the
        timed buffers): keep it cheap, give the same shapes and dtypes for the same case shape, and arm one-time
        work for the next ``run`` once per shape (:class:`FirstCalls`), not at every call."""
        return dict(case.inputs)

    def run(self, native: Tensors) -> Tensors:
        raise NotImplementedError

    def outputs_to_canonical(self, outputs: Tensors, native: Tensors) -> Tensors:
        return outputs

    def grad_outputs_to_native(self, grad_outputs: Tensors, native: Tensors) -> Tensors:
        return grad_outputs

    def grads_to_canonical(self, grads: Tensors, native: Tensors) -> Tensors:
        return grads

    def metadata(self) -> dict[str, Any]:
        """Provider facts recorded with every result row (package versions, resolved backends)."""
        return {}

    def describe(self, native: Tensors) -> str:
        """How the implementation ran the cell just measured (e.g. each fused kernel's strategy), in a few words: the
        row's ``strategy`` column, shown in the report. Called once per cell, after its first timing round and
        checks, with that round's native inputs; "" says nothing."""
        return ""


class FunctionImplementation(Implementation):
    def __init__(self, fn: Callable[..., Tensors], prepare: Callable[[Case], Tensors] | None = None):
        self._fn, self._prepare = fn, prepare

    def prepare(self, case: Case) -> Tensors:
        return self._prepare(case) if self._prepare else dict(case.inputs)

    def run(self, native: Tensors) -> Tensors:
        return self._fn(**native)


@dataclass
class Registry:
    impls: dict[tuple[str, str], Implementation] = field(default_factory=dict)
    load_errors: list[tuple[str, str]] = field(default_factory=list)
    """(source, one-line message with file:line) for every plugin module that failed to load."""
    plugin_files: list[str] = field(default_factory=list)
    """Every plugin file loaded (resolved paths), so that a worker process can load the same."""
    withdrawn: set[tuple[str, str]] = field(default_factory=set)
    """The keys of implementations whose module failed to import after registering them (:meth:`withdraw`)."""

    def add(self, impl: Implementation) -> Implementation:
        """Register ``impl`` as ``(impl.op, impl.name)``. ValueError with one line: no name or op, an op that does
        not exist, a mode, dtype or requirement the harness does not know (:func:`declaration_error`), or a name
        the op has had (from any module, the same one included: a second registration never replaces the first,
        even once the first was removed from ``impls``). The guard records what it runs and keeps the entry
        (:func:`codabench.guard.watch_registered`)."""
        if not impl.name or not impl.op:
            raise ValueError(f"implementation {impl!r} needs a name and an op")
        if impl.op not in OPS:
            raise ValueError(f"implementation {impl.name!r} registers op {impl.op!r}, which does not exist "
                             f"(ops: {', '.join(OPS)})")
        bad = declaration_error(impl)
        if bad:
            raise ValueError(f"implementation {impl.name!r} of op {impl.op!r}: {bad}")
        key = (impl.op, impl.name)
        old = self.impls.get(key) or guard.registered(self, key)
        if old is not None:
            first, again = _where(old.source), _where(impl.source)
            raise ValueError(f"implementation {impl.name!r} of op {impl.op!r} registered twice: by {first}"
                             + (" (twice)" if again == first else f" and again by {again}")
                             + ("" if key in self.impls else " (after removing the first, which does not free it)")
                             + "; a name must be unique per op")
        self.impls[key] = impl
        guard.watch_registered(self, key, impl)
        return impl

    def withdraw(self, keys: Iterable[tuple[str, str]]) -> None:
        """Leave the implementations of ``keys`` out of every selection (:meth:`for_op`, :meth:`names`): their
        module failed to import after registering them, so, as with any failed import, none of it is used (its
        functions may read globals the failure left undefined). The entries stay, and their names taken, as every
        registered name does."""
        self.withdrawn.update(keys)

    def get(self, op: str, name: str) -> Implementation:
        return self.impls[(op, name)]

    def for_op(self, op: str) -> list[Implementation]:
        return [v for (o, n), v in self.impls.items() if o == op and (o, n) not in self.withdrawn]

    def names(self) -> list[str]:
        return sorted({name for (op, name) in self.impls if (op, name) not in self.withdrawn})


REGISTRY = Registry()


def _where(source: str) -> str:
    """A registering module for a message: its file where it has one (a ``--plugin`` file's module name is made up)."""
    return getattr(sys.modules.get(source), "__file__", None) or source or "an unnamed module"


def declaration_error(impl: Implementation) -> str | None:
    """What is wrong with ``impl``'s declared modes, dtypes and requirements (a value the harness does not know, with
    the valid ones), or None. A typo would otherwise make every cell ``n/a``, or fail each one."""
    for what, given, known in (("mode", impl.modes, MODES), ("dtype", impl.dtypes, DTYPES),
                               ("requirement", impl.requires, (*REQUIREMENTS, f"{PKG}<module>"))):
        if isinstance(given, str):
            return f"{what}s={given!r} is a string; give a tuple, e.g. ({given!r},)"
        bad = [g for g in given if not (g in known or what == "requirement" and isinstance(g, str)
                                        and g.startswith(PKG) and len(g) > len(PKG))]
        if bad:
            return f"unknown {what}(s) {', '.join(map(repr, bad))} (valid: {', '.join(known)})"
    return None


def register(op: str | Iterable[str], name: str, *, modes: Iterable[str] | None = None,
             dtypes: Iterable[str] | None = None, requires: Iterable[str] | None = None,
             description: str | None = None, label: str | None = None,
             prepare: Callable[[Case], Tensors] | None = None):
    """Register a function or an :class:`Implementation` subclass for one op (or several)."""
    ops = [op] if isinstance(op, str) else list(op)

    def deco(obj):
        for o in ops:
            is_class = isinstance(obj, type) and issubclass(obj, Implementation)
            impl = obj() if is_class else FunctionImplementation(obj, prepare)
            REGISTRY.add(entry(impl, o, name, getattr(obj, "__module__", "") or "",
                               description or impl.description or (obj.__doc__ or "").strip().split("\n")[0],
                               modes=modes, dtypes=dtypes, requires=requires, label=label))
        return obj

    return deco


def entry(impl: Implementation, op: str, name: str, source: str, description: str, *,
          modes: Iterable[str] | None = None, dtypes: Iterable[str] | None = None,
          requires: Iterable[str] | None = None, label: str | None = None) -> Implementation:
    """``impl`` named as the registry's entry ``(op, name)`` from module ``source``, with its description and the
    modes, dtypes, requirements and label given (None: its own)."""
    impl.op, impl.name, impl.source, impl.description = op, name, source, description
    for attr, value in (("modes", modes), ("dtypes", dtypes), ("requires", requires)):
        if value is not None:  # a bare string stays one, for Registry.add to refuse
            setattr(impl, attr, value if isinstance(value, str) else tuple(value))
    if label is not None:
        impl.label = label
    return impl


INTERPRETER_NO_BF16 = "skipped: the Triton interpreter has no bf16 math; run bf16 on a GPU"
"""The row of a ``triton-dot`` implementation's bf16 cell on the CPU: the interpreter's bf16 ``tl.dot`` returns
garbage (relative errors near 1e10), which would read as the kernel's failure."""


REQUIREMENTS = ("cuda", "sm90", "cpu", "triton", "triton-dot")
"""The requirement tokens an implementation may declare (``requires``), besides ``pkg:<module>``
(:func:`requirement_missing` says what each needs)."""
PKG = "pkg:"


def requirement_missing(req: str, device: torch.device, dtype: str | None = None) -> str | None:
    """A skip reason if requirement ``req`` is not met on ``device`` for a cell of ``dtype``, else None."""
    on_gpu = device.type == "cuda"
    if req == "cuda":
        return None if on_gpu else "skipped: needs a CUDA GPU"
    if req == "cpu":
        return None if not on_gpu else "skipped: CPU only"
    if req == "sm90":
        if not on_gpu or torch.cuda.get_device_capability(device)[0] < 9:
            return "skipped: needs a Hopper (sm90+) GPU"
        return None
    if req in ("triton", "triton-dot"):
        if importlib.util.find_spec("triton") is None:
            return "skipped: triton is not installed"
        if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            return "skipped: triton on CPU needs TRITON_INTERPRET=1"
        if req == "triton-dot" and not on_gpu and dtype == "bf16":
            return INTERPRETER_NO_BF16
        return None
    if req.startswith(PKG):
        mod = req[len(PKG):]
        return None if importlib.util.find_spec(mod) is not None else f"skipped: package {mod} is not installed"
    raise ValueError(f"unknown requirement {req!r}")
