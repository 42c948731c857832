"""Anti-cheat checks of a timed cell, in the worker, after its timed calls (benchmarking.md, "Verdicts that hold up").

A cell's time counts only if the calls it timed computed what they claim. The correctness pass checks one untimed
call on other inputs; these checks look at the timed closure itself, at the timing shape, on the native inputs
``A`` that ``prepare`` built from the timing inputs. Each check is one call, so they cost a few calls per cell:

1. *same buffers*: one more call on ``A`` after the timed calls (round after round: calls later in the run); on the
   GPU the same call gives the cell's peak memory;
2. *refilled in place*: ``A``'s tensors are overwritten with the native form of new inputs ``B`` (another seed, every
   floating input x2, an exact scaling that also moves scale-free outputs such as a loss), ``prepare`` is called once
   more on other inputs ``D`` (their native form dropped), then one call on ``A``: a call must compute from what it
   is given, not hand back a result that the untimed ``prepare`` computed and kept (the sweeps call ``prepare`` on
   each sample's inputs just before the call); on the GPU its outputs are copied on the calling stream as soon as
   the call returns, before any synchronization, and those copies are what is compared: outputs still being computed
   on another stream fail;
3. *new buffers*: ``prepare`` on new inputs ``C``, one call.

Each call's outputs (and gradients) must match PyTorch's own results (torch-eager in the cell's dtype) on the same
inputs: ``rel_err(out, torch) <= VERIFY_FACTOR x max(torch's error, the cell's error) + 2 x floor``, errors taken
from the correctness pass against float64. An honest kernel is within its error plus PyTorch's of PyTorch's result;
an output computed from other inputs (a result computed once, a cache keyed on buffer addresses, shapes or call
counts, outputs that stop being computed after the first calls) is O(1) away. New inputs can be worse conditioned
than the correctness pass's (fp8 at a small hidden size: the GEMM's share of a residual sum moves with the values),
so an output beyond that bound gets a second opinion before it fails: PyTorch's own error on the same inputs, against
float64 (:meth:`Expected.torch_error`, computed only then), joins the errors the bound is taken over.

On the GPU one more check, :func:`check_event_time`: the CUDA-event time on the calling stream must not fall far
below the device-synchronized wall time of the same call (work left on a side stream makes the events stop early).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields, is_dataclass, replace

import torch

from codabench.case import Case
from codabench.correctness import compared
from codabench.eager import TorchEager
from codabench.execute import CellError, Timed, reference_once, run_native, run_once
from codabench.metrics import FLOOR, rel_err
from codabench.registry import Implementation, Tensors, prepared
from codabench import guard
from workloads.op import Op

VERIFY_FACTOR = 4.0
REFILL_SEED, FRESH_SEED, DECOY_SEED = 101, 102, 103
"""Seeds of the inputs B (refilled into the timed buffers), C (new buffers) and D (prepared between B's refill and
the call on it: :func:`check_refilled`)."""
STREAM_CALLS = 2
STREAM_SLACK_MS = 0.2
"""Event time may fall short of synchronized wall time by this much plus a quarter of the wall time (launch and
synchronization latency)."""


@dataclass
class Expected:
    """PyTorch's results (compared outputs and gradients, canonical) on one set of inputs, those inputs, and the
    canonical upstream gradients they were computed with (None: no autograd)."""

    case: Case
    outputs: dict[str, torch.Tensor]
    grads: Tensors | None = None
    _torch_err: dict[str, float] | None = field(default=None, repr=False)

    def torch_error(self, mode: str) -> dict[str, float]:
        """PyTorch's error on these inputs against the float64 reference, per compared tensor; computed at the first
        call only. Empty (the check keeps its first bound) when the inputs no longer give :attr:`outputs` (they are
        the timed buffers, refilled since, or a call wrote into them: PyTorch run again must reproduce its results
        bit for bit) or the reference does not fit in memory."""
        if self._torch_err is None:
            op = self.case.op
            self._torch_err = {}
            try:
                again = compared(op, mode, run_once(op, TorchEager(op), self.case, self.grads))
                if all(k in again and torch.equal(again[k].nan_to_num(), v.nan_to_num())
                       for k, v in self.outputs.items()):
                    ref = compared(op, mode, reference_once(op, self.case, self.grads))
                    self._torch_err = {k: rel_err(v, ref[k]) for k, v in self.outputs.items() if k in ref}
            except torch.OutOfMemoryError:
                pass
            if self.case.device.type == "cuda":
                torch.cuda.empty_cache()
        return self._torch_err


def verification_inputs(op: Op, case: Case, seed: int) -> Case:
    """``case`` with new inputs: another seed, rescaled by the op (:meth:`workloads.op.Op.rescaled`: every floating
    input x2, exact in every float format, fp8's grid included), then the op's derived inputs (saved statistics)
    recomputed."""
    inp = op.inputs(case.model, case.dtype, case.device, seed)
    return replace(case, inputs=op.derived_inputs(op.rescaled(inp), case.model))


def refill(dst: object, src: object, where: str = "native") -> None:
    """Copy ``src``'s tensors into ``dst``'s in place (dicts, tuples, lists and dataclasses walked alike)."""
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape or src.dtype != dst.dtype:
            raise CellError(f"prepare() gave {where} another shape or dtype for other inputs of the same shape")
        with torch.no_grad():
            dst.copy_(src)
    elif isinstance(dst, dict):
        for k in dst:
            refill(dst[k], src[k], f"{where}[{k!r}]")
    elif isinstance(dst, (tuple, list)):
        for i, (d, s) in enumerate(zip(dst, src)):
            refill(d, s, f"{where}[{i}]")
    elif is_dataclass(dst) and not isinstance(dst, type):
        for f in fields(dst):
            refill(getattr(dst, f.name), getattr(src, f.name), f"{where}.{f.name}")


def mismatch(op: Op, mode: str, result: dict[str, torch.Tensor], expected: Expected, allowed: dict[str, float]
             ) -> str | None:
    """The first compared tensor of ``result`` that is missing, misshapen or too far from PyTorch's, as a message."""
    for name, ref in expected.outputs.items():
        out = result.get(name)
        if out is None:
            if name in op.side_outputs:
                continue
            return f"{name} is missing"
        if tuple(out.shape) != tuple(ref.shape):
            return f"{name} has shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
        rel, limit, basis = rel_err(out, ref), allowed[name], ""
        if not rel <= limit and rel == rel and name in expected.torch_error(mode):  # the second opinion
            limit = max(limit, bound([expected.torch_error(mode)[name]], expected.case.torch_dtype))
            basis = ", PyTorch's own error on them included"
        if not rel <= limit:  # NaN fails too
            return f"{name} is {rel:.3g} away from PyTorch's result on the same inputs (allowed {limit:.3g}{basis})"
    return None


def bound(errors: list[float | None], dtype: torch.dtype) -> float:
    """How far from PyTorch's result an honest output may be: VERIFY_FACTOR x the largest of ``errors`` (relative
    errors against float64; None and NaN left out) + 2 x the dtype's floor."""
    return VERIFY_FACTOR * max((e for e in errors if e is not None and e == e), default=0.0) + 2 * FLOOR[dtype]


def allowed_error(torch_err: dict[str, float | None], cell_err: dict[str, float | None], dtype: torch.dtype
                  ) -> dict[str, float]:
    """Per compared tensor: :func:`bound` of PyTorch's and the cell's errors in the correctness pass."""
    return {name: bound([torch_err.get(name), cell_err.get(name)], dtype) for name in set(torch_err) | set(cell_err)}


def check_same_buffers(op: Op, impl: Implementation, native: Tensors, mode: str, grads: Tensors | None,
                       expected: Expected, allowed: dict[str, float]) -> tuple[str | None, float | None]:
    """Check 1: one more call on the timed buffers; also the peak memory of that call (GPU, MiB, above what was
    allocated before it: its inputs), else None."""
    synchronize = guard.private_clocks().synchronize
    cuda = expected.case.device.type == "cuda"
    if cuda:
        synchronize(expected.case.device)
        torch.cuda.reset_peak_memory_stats(expected.case.device)
        base = torch.cuda.memory_allocated(expected.case.device)
    result = compared(op, mode, run_native(op, impl, native, mode, grads))
    peak = (torch.cuda.max_memory_allocated(expected.case.device) - base) / 2**20 if cuda else None
    bad = mismatch(op, mode, result, expected, allowed)
    return (f"a timed call's output is wrong: {bad}" if bad else None), peak


def check_refilled(op: Op, impl: Implementation, native: Tensors, mode: str, grads: Tensors | None,
                   expected: Expected, allowed: dict[str, float]) -> str | None:
    """Check 2: the timed buffers refilled in place with the native form of ``expected.case``'s inputs, then
    ``prepare`` on the decoy inputs D (:data:`DECOY_SEED`), then the call; on the GPU the outputs as they stand on the
    calling stream when the call returns. Outputs that match D's results are named as what they are: a result of
    ``prepare`` (:func:`prepared_result`)."""
    synchronize = guard.private_clocks().synchronize
    refill(native, impl.prepare(expected.case))  # the inputs alone: native keeps its context
    decoy = verification_inputs(op, expected.case, DECOY_SEED)
    impl.prepare(decoy)  # the last prepare() before the call is on other inputs than the call's
    device = expected.case.device
    if device.type == "cuda":
        synchronize(device)  # the refill is done before the call starts
    result = compared(op, mode, run_native(op, impl, native, mode, grads))
    if device.type == "cuda":
        on_stream = {k: v.clone() for k, v in result.items()}  # enqueued on the calling stream, no synchronization
        synchronize(device)
        for k, v in result.items():
            if not torch.equal(on_stream[k].nan_to_num(), v.nan_to_num()):
                return (f"{k} was not ready on the calling stream when the call returned (work left on a side "
                        "stream without the calling stream waiting for it)")
        result = on_stream
    bad = mismatch(op, mode, result, expected, allowed)
    if bad is None:
        return None
    if prepared_result(op, mode, result, decoy, expected.grads, allowed):
        return ("outputs are computed in prepare(), not in the timed call: with the timed buffers refilled in place "
                "and prepare() then called on other inputs, the call returned the results of those other inputs "
                "(prepare is untimed: it may change layouts or quantize, never compute the outputs)")
    return (f"outputs do not follow the inputs: with the timed buffers refilled in place with new values, {bad} "
            "(a result reused, or cached by buffer address, shape or call count?)")


def prepared_result(op: Op, mode: str, result: dict[str, torch.Tensor], decoy: Case, grads: Tensors | None,
                    allowed: dict[str, float]) -> bool:
    """Whether ``result`` is PyTorch's result on the ``decoy`` inputs, within ``allowed``: what a call returns when
    it hands back what the last ``prepare`` computed."""
    theirs = Expected(decoy, compared(op, mode, run_once(op, TorchEager(op), decoy, grads)), grads)
    return mismatch(op, mode, result, theirs, allowed) is None


def check_new_buffers(op: Op, impl: Implementation, mode: str, grads: Tensors | None, expected: Expected,
                      allowed: dict[str, float]) -> str | None:
    """Check 3: a fresh ``prepare`` on ``expected.case``'s inputs."""
    native = prepared(impl, expected.case)
    bad = mismatch(op, mode, compared(op, mode, run_native(op, impl, native, mode, grads)), expected, allowed)
    return f"outputs are wrong on new input buffers: {bad}" if bad else None


def check_event_time(timed: Timed, device: torch.device) -> str | None:
    """GPU: CUDA-event time of the timed closure on the calling stream vs its device-synchronized wall time."""
    perf_counter, Event, record, elapsed_ms, synchronize, verify, *_ = guard.private_clocks()
    events, walls = [], []
    for _ in range(STREAM_CALLS):
        state = timed.setup() if timed.setup else None
        synchronize(device)
        start, end = Event(enable_timing=True), Event(enable_timing=True)
        t0 = perf_counter()
        record(start)
        with timed.context:
            timed.fn(state)
        record(end)
        synchronize(device)
        walls.append((perf_counter() - t0) * 1e3)
        events.append(elapsed_ms(start, end))
    verify()
    ev, wall = statistics.median(events), statistics.median(walls)
    if wall - ev > STREAM_SLACK_MS + 0.25 * wall:
        return (f"the calling stream's events saw {ev:.3g} ms of a call that takes {wall:.3g} ms with the device "
                "synchronized: work left on another stream")
    return None
