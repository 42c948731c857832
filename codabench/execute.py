"""How an implementation is called in each mode (docs/running.md, "How a cell is measured").

- ``fwd`` (and the single mode of a ``direct`` op): ``impl.run(native)`` under ``torch.no_grad()``.
- ``fwd_bwd``: the differentiable native tensors become fresh leaves (untimed), then
  ``impl.run`` + ``torch.autograd.backward(outputs, grad_outputs)`` is timed.
- ``bwd``: the forward on fresh leaves is the untimed per-sample setup; the backward alone is
  timed, on a fresh graph every sample.

Differentiable native tensors: floating tensors whose key is in neither ``op.consts`` nor
``impl.native_consts``. Gradients are read from the leaves' ``.grad``.
"""
from __future__ import annotations

import collections
from contextlib import nullcontext
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Iterator

import torch

from codabench import guard
from codabench.case import Case
from codabench.registry import Implementation, Native, Tensors, prepared
from workloads.op import Op


class CellError(Exception):
    """A fault of the implementation under test, reported as the cell's error message."""


def uses_autograd(op: Op, mode: str) -> bool:
    return op.kind == "autograd" and mode in ("bwd", "fwd_bwd")


def differentiable_keys(op: Op, impl: Implementation, native: Tensors) -> list[str]:
    if op.kind != "autograd":
        return []
    return [k for k, v in native.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
            and k not in op.consts and k not in impl.native_consts]


def fresh_leaves(native: Tensors, keys: list[str]) -> Tensors:
    """``native`` with the inputs ``keys`` as new autograd leaves sharing their storage (a :class:`Native` keeps its
    context)."""
    leaves = {k: (v.detach().requires_grad_(True) if k in keys else v) for k, v in native.items()}
    return native.with_inputs(leaves) if isinstance(native, Native) else leaves


def call_run(impl: Implementation, native: Tensors) -> Tensors:
    """``impl.run(native)``, its outputs checked (:func:`check_outputs`)."""
    out = impl.run(native)
    check_outputs(out, native, _device_of(native))
    return out


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``: itself, or inside dicts, lists, tuples and dataclass instances (quantized operands)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif is_dataclass(value) and not isinstance(value, type):
        for f in fields(value):
            yield from _tensors(getattr(value, f.name))


def _device_of(native: Tensors) -> torch.device:
    """The device the inputs are on: an accelerator where any input is (fp8 scales may stay on the CPU)."""
    return next((t.device for t in _tensors(native) if t.device.type != "cpu"), torch.device("cpu"))


def backward(outputs: Tensors, grad_outputs: Tensors) -> None:
    """``torch.autograd.backward`` over the outputs that have an upstream gradient."""
    tensors, grads = [], []
    for k, g in grad_outputs.items():
        if k not in outputs:
            raise CellError(f"output {k!r} missing (needed for backward)")
        if not outputs[k].requires_grad:
            raise CellError(f"output {k!r} does not require grad: the implementation cut the autograd graph "
                            "(one without a backward declares modes=('fwd',))")
        tensors.append(outputs[k])
        grads.append(g)
    torch.autograd.backward(tensors, grads)


def own_copies(tensors: Tensors) -> Tensors:
    """Copies of the tensors of ``tensors`` (other values as they are): the upstream gradients a call's backward gets.
    They are the harness's, shared by every cell of a group, so no call is handed the originals."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}


def check_grad_outputs(given: Tensors, original: Tensors) -> None:
    """A backward must leave the upstream gradients it was given as they were (``given``, copies of ``original``):
    one that writes into them (an in-place ``mul_`` or ``zero_`` of its ``grad_output``, an output written over it)
    would corrupt its caller's tensors. Raises :class:`CellError` naming them."""
    written = [k for k, v in original.items() if isinstance(v, torch.Tensor)
               and not torch.equal(given[k].nan_to_num(), v.nan_to_num())]
    if written:
        raise CellError(f"its backward wrote into the upstream gradient(s) of {', '.join(written)} it was given "
                        "(the caller's tensors: compute into a new tensor, or copy before writing in place)")


@dataclass
class Timed:
    """``setup`` (untimed, per sample) and ``fn`` (timed), for :func:`codabench.timing.measure` and the interleaved
    sweeps of :mod:`codabench.sweep`. ``fn(state)`` returns ``(outputs, leaves)``: what the call returned and the
    tensors it ran on (the fresh leaves, whose ``.grad`` hold the gradients, in autograd modes), for the checks of
    the timed call's own results (:func:`check_outputs`, :func:`timed_result`)."""

    fn: Callable[[Any], tuple[Tensors, Tensors]]
    setup: Callable[[], Any] | None
    context: Any
    """Context to hold around each timed call (no_grad for forward-only modes)."""
    keys: list[str]
    """The differentiable native keys (autograd modes), whose leaves' gradients are compared."""


def timed_call(op: Op, impl: Implementation, native: Tensors, mode: str, grad_outputs_native: Tensors) -> Timed:
    """The timed call of a cell; in autograd modes its backward takes a copy of ``grad_outputs_native`` of its own
    (:func:`own_copies`), so that a backward that writes into its upstream gradients changes no other cell's."""
    if not uses_autograd(op, mode):
        return Timed(lambda _: (impl.run(native), native), None, torch.no_grad(), [])
    keys = differentiable_keys(op, impl, native)
    grad_outputs_native = own_copies(grad_outputs_native)
    if mode == "fwd_bwd":
        def fwd_bwd(leaves):
            out = impl.run(leaves)
            backward(out, grad_outputs_native)
            return out, leaves

        return Timed(fwd_bwd, lambda: fresh_leaves(native, keys), nullcontext(), keys)

    def forward():
        leaves = fresh_leaves(native, keys)
        return impl.run(leaves), leaves

    def bwd(state):
        out, leaves = state
        backward(out, grad_outputs_native)
        return out, leaves

    return Timed(bwd, forward, nullcontext(), keys)


def _storages(native: Tensors) -> dict[int, str]:
    return {t.untyped_storage().data_ptr(): k for k, v in native.items() for t in _tensors(v)
            if t.untyped_storage().nbytes()}


PLAIN_DICTS = (dict, collections.OrderedDict)
"""What a call may return its outputs in: the exact types (a subclass's methods would run when the harness reads it)."""
SIDE_VALUES = (int, float, bool, str, type(None))
"""The exact types a call may return beside its tensors (a count, a note): no subclass, whose methods would run the
implementation's code when the harness reads them."""


def check_outputs(outputs: Any, native: Tensors, device: torch.device) -> None:
    """The outputs of a call must be a plain dict (:data:`PLAIN_DICTS`) with ``str`` keys of plain ``torch.Tensor``
    values (the exact type: a subclass, or an object that answers to the name of one, can defer its work until it is
    first read, after the timed region) or side values of :data:`SIDE_VALUES`, on the cell's device, none sharing
    storage with an input (an input returned, or written into, as the result). Raises :class:`CellError`."""
    if type(outputs) not in PLAIN_DICTS:
        raise CellError(f"run() returned {_type_name(outputs)}, expected a dict of named tensors")
    inputs = _storages(native)
    for k, v in outputs.items():
        if type(k) is not str:
            raise CellError(f"run() returned an output named by a {_type_name(k)}, not a str")
        if type(v) in SIDE_VALUES:
            continue  # a side value (e.g. a count) is not compared
        plain_tensor(f"output {k!r}", v)
        if v.device.type != device.type:
            raise CellError(f"output {k!r} is on {v.device}, expected {device.type}")
        ptr = v.untyped_storage().data_ptr() if v.untyped_storage().nbytes() else None
        if ptr in inputs:
            raise CellError(f"output {k!r} shares its storage with the input {inputs[ptr]!r} (an input returned or "
                            "overwritten as the result, or an output buffer made in the untimed prepare(): allocate "
                            "outputs in run(), or keep a workspace on the implementation object)")


def plain_tensor(what: str, v: Any) -> torch.Tensor:
    """``v`` if its type is exactly ``torch.Tensor`` (or ``nn.Parameter``), else :class:`CellError` naming ``what``."""
    if type(v) is not torch.Tensor and type(v) is not torch.nn.Parameter:
        raise CellError(f"{what} is a {_type_name(v)}, not a plain torch.Tensor (a tensor subclass, or an object "
                        "standing in for a tensor, may finish its work after the timed region)")
    return v


def _type_name(v: Any) -> str:
    t = type(v)  # the real type: ``v.__class__`` is whatever the object says
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def moved(hook: str, given: Tensors, result: Any) -> Tensors:
    """The result of a layout conversion of the implementation's (``outputs_to_canonical``, ``grads_to_canonical``,
    ``grad_outputs_to_native``), checked to hold the values it was given, moved and not computed: it may rename,
    reorder, reshape and split tensors and pass others through, never make new values (the conversions run untimed, so
    work done there would not count). The tensors of ``result`` that are not among ``given``'s must hold, as a
    multiset, exactly the values of ``given``'s tensors that are not passed through (:func:`_fingerprint`). Raises
    :class:`CellError`."""
    if type(result) not in PLAIN_DICTS:
        raise CellError(f"its {hook}() returned {_type_name(result)}, expected a dict of named tensors")
    given_ids = {id(v) for v in given.values() if isinstance(v, torch.Tensor)}
    kept = {id(v) for v in result.values() if id(v) in given_ids}
    made = [plain_tensor(f"{hook}()'s {k!r}", v) for k, v in result.items()
            if type(v) not in SIDE_VALUES and id(v) not in given_ids]
    taken = [v for v in given.values() if isinstance(v, torch.Tensor) and id(v) not in kept]
    if made or taken:
        keys = [int.from_bytes(guard.URANDOM(4), "little") % (_P - 1) + 1 for _ in range(4)]
        if _fingerprint(made, keys) != _fingerprint(taken, keys):
            raise CellError(f"its {hook}() returned values it was not given: a layout conversion runs untimed and may "
                            "only move values (rename, reorder, split); compute them in run()")
    return result


_P = (1 << 31) - 1


def _fingerprint(tensors: list[torch.Tensor], keys: list[int]) -> tuple[int, int]:
    """(number of values, a fingerprint of the multiset of their bit patterns) for :func:`moved`: the sum over the
    values, as float64, of ``g (g + k4) mod p``, ``g`` a keyed combination of its bits mod the prime ``p = 2^31 - 1``.
    Equal for the same values in any order, across tensors (a float32 or bf16 value and its float64 have one
    pattern); a value changed, added or dropped changes it but with a chance of 2^-31, and the keys are drawn after the
    conversion ran, so no plugin can aim at a collision. Chunks of 2^24 values keep the memory small."""
    k1, k2, k3, k4 = keys
    size, total = 0, 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        size += flat.numel()
        for part in flat.split(1 << 24):
            b = part.to(torch.float64).view(torch.int64)
            g = ((b & _P) * k1 % _P + ((b >> 31) & _P) * k2 % _P + ((b >> 62) & 3) * k3 % _P) % _P
            total += int((g * (g + k4) % _P).sum())
    return size, total


def timed_result(op: Op, impl: Implementation, mode: str, returned: tuple[Tensors, Tensors], keys: list[str]
                 ) -> "Result":
    """The canonical outputs and gradients of one timed call (what :attr:`Timed.fn` returned)."""
    outputs, leaves = returned
    with torch.no_grad():
        canon_out = canonical_outputs(impl, {k: (v.detach() if isinstance(v, torch.Tensor) else v)
                                             for k, v in outputs.items()}, leaves)
    if not uses_autograd(op, mode):
        return Result(canon_out, {})
    return Result(canon_out, canonical_grads(impl, keys, leaves))


def canonical_outputs(impl: Implementation, outputs: Tensors, native: Tensors) -> Tensors:
    """``impl.outputs_to_canonical``, checked to move values only (:func:`moved`)."""
    return moved("outputs_to_canonical", outputs, impl.outputs_to_canonical(outputs, native))


def canonical_grads(impl: Implementation, keys: list[str], leaves: Tensors) -> Tensors:
    """The gradients in the leaves' ``.grad`` (each a plain tensor), through ``impl.grads_to_canonical`` (checked to
    move values only), named ``grad_<input>``."""
    grads = {k: plain_tensor(f"the gradient of {k!r}", leaves[k].grad) for k in keys if leaves[k].grad is not None}
    with torch.no_grad():
        canon = moved("grads_to_canonical", grads, impl.grads_to_canonical(grads, leaves))
    return {f"grad_{k}": v for k, v in canon.items()}


def native_grad_outputs(impl: Implementation, grad_outputs: Tensors, native: Tensors) -> Tensors:
    """``impl.grad_outputs_to_native``, checked to move values only (:func:`moved`)."""
    with torch.no_grad():
        return moved("grad_outputs_to_native", grad_outputs, impl.grad_outputs_to_native(grad_outputs, native))


@dataclass
class Result:
    """Canonical outputs and gradients of one untimed call (gradients named ``grad_<input>``)."""

    outputs: Tensors
    grads: Tensors


def run_once(op: Op, impl: Implementation, case: Case, grad_outputs: Tensors | None) -> Result:
    """Prepare and run ``impl`` once on ``case`` in its mode; ``grad_outputs`` canonical (autograd modes)."""
    return run_native(op, impl, prepared(impl, case), case.mode, grad_outputs)


def run_native(op: Op, impl: Implementation, native: Tensors, mode: str, grad_outputs: Tensors | None) -> Result:
    """Run ``impl`` once in ``mode`` on prepared ``native`` inputs (the same buffers, e.g. the timed ones); results in
    canonical layout. The differentiable inputs become fresh leaves that share ``native``'s storage."""
    if not uses_autograd(op, mode):
        with torch.no_grad():
            out = call_run(impl, native)
            return Result(canonical_outputs(impl, out, native), {})
    keys = differentiable_keys(op, impl, native)
    leaves = fresh_leaves(native, keys)
    out = call_run(impl, leaves)
    given = own_copies(grad_outputs)
    backward(out, native_grad_outputs(impl, given, leaves))
    check_grad_outputs(given, grad_outputs)
    outputs = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
    canon_grads = canonical_grads(impl, keys, leaves)
    with torch.no_grad():
        canon_out = canonical_outputs(impl, outputs, leaves)
    return Result(canon_out, canon_grads)


def reference_once(op: Op, case: Case, grad_outputs: Tensors | None) -> Result:
    """``op.reference`` on float64 copies of the case's inputs (autograd in float64)."""
    inp = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for k, v in case.inputs.items()}
    if not uses_autograd(op, case.mode):
        with torch.no_grad():
            return Result(op.reference(inp, case.model), {})
    keys = op.differentiable(case.inputs)
    leaves = fresh_leaves(inp, keys)
    out = op.reference(leaves, case.model)
    backward(out, {k: g.double() for k, g in grad_outputs.items()})
    return Result({k: v.detach() for k, v in out.items()}, {f"grad_{k}": leaves[k].grad for k in keys})


def forward_shapes(op: Op, impl: Implementation, native: Tensors) -> Tensors:
    """The canonical outputs of one untimed forward (no grad): shapes for the timing's upstream grads."""
    with torch.no_grad():
        return impl.outputs_to_canonical(call_run(impl, native), native)
