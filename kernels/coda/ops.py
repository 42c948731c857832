"""The CODA compositions and weight packing as custom ops (namespace ``coda``): opaque to torch.compile.

Dynamo cannot trace a Triton launch of ours, so every piece the Hugging Face drop-in (:mod:`kernels.coda.hf`) runs
is a ``torch.library.custom_op`` taking only tensors and primitives, with a fake-tensor rule (the exact shapes,
dtypes and strides of its outputs, computed without running it) and, for the differentiable ones, autograd whose
backward calls the backward ops. ``torch.compile(model, fullgraph=True)`` then traces the drop-in's forward and
backward into graphs that call these ops. The computations are those of :mod:`kernels.coda.functions` and
:mod:`kernels.coda.pack`; this module only registers them, and :func:`call` is how those modules' public functions
run them: the op when traced, else its implementation directly.

Forward (differentiable), each returning a flat list: the results, then with ``save`` what backward reads::

    coda::producer_consumer(a, residual, w_p, gamma, w, eps, save, *consumer) -> [x, out, rstd, *side, *saved]
    coda::block(a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w, eps, save, *consumer)
        -> [x, out, rstd_mlp, rstd, *side, (x1, z_pre, *saved)]
    coda::norm_consumer(x, gamma, w, eps, save, *consumer) -> [out, rstd, *side, *saved]
    coda::pack_rows(tensor, row, weights) -> packed

Backward::

    coda::consumer_bwd(grad, saved, w, x, rstd, gamma, dres, w_grad, *consumer) -> (dx, dgamma, dW)   dz in bwd
    coda::rescaled(grad, applied, dx, dgamma, dW) -> (dx, dgamma, dW)   gradients computed in forward, scaled
                                                                          to dloss (traced; eager: in place)
    coda::producer_bwd(dx, a, w_p, w_grad) -> (da, dWp)
    coda::mlp_bwd(dx, w_down, z_pre, w_gu, x1, rstd_mlp, gamma_mlp, down_grad, gu_grad)
        -> (dx1, dW_down, dgamma_mlp, dW_gu)
    coda::mlp_bwd_(dx, ...) -> (dW_down, dgamma_mlp, dW_gu)  the same, dx1 added into dx in place
    coda::unpack_rows(dpacked, tensor, row, sizes) -> [dweight, ...]

A weight gradient whose weight needs none (``ctx.needs_input_grad``: a frozen weight, LoRA's base) is not computed:
its ``*_grad`` flag is False and the op returns an empty tensor in its place; cross-entropy's consumer carries
``weight_grad`` into its forward, which then computes no dW.

``*consumer`` is :data:`kernels.coda.functions.CONSUMER_ARGS` (the kind as a string, its per-row tensor, its
numbers). rstd, the side outputs and the saved tensors are not differentiable. A missing gradient stays None: with
none for the consumer's output, only the residual stream's gradient goes on (no consumer backward); with none at
all, none is computed. An op's outputs never alias its inputs: where a backward hands back a tensor it was given (a
gradient computed in forward, dres), that happens in the autograd formula, outside the ops.

Eager cost: the GPU work is the kernels' own either way. An eager call (not compiling, no dispatch mode) skips the
dispatcher and torch.library's Python autograd wrapper: a differentiable op with an input needing a gradient runs
as :class:`_Eager`, one ``torch.autograd.Function`` made of the op's implementation and the very ``setup_context``
and ``backward`` registered with it (whose backward pieces go through :func:`call` too); otherwise the
implementation runs alone. Host time per call of the public functions, kernels excluded, on this project's shared
2-core CPU: a forward with autograd 0.02-0.05 ms (through the op: 0.12-0.44 ms), without grad 0.01-0.02 ms (0.03-0.05
ms), forward and backward 0.07-0.3 ms (0.36-1.05 ms).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._guards import detect_fake_mode
from torch.library import CustomOpDef, custom_op

from kernels.coda import functions as F
from kernels.coda.align import aligned, empty_rows
from kernels.coda.cross_entropy_bwd import rescale_
from kernels.coda.mainloop import set_scratch_allocator
from kernels.coda.pack import copy_rows

_CONSUMER = ("str kind, Tensor? rows, int heads, int kv_heads, int head_dim, float theta, float[]? inv_freq, "
             "int ignore_index, str reduction, int? chunk_rows, bool weight_grad")
"""The schema of :data:`kernels.coda.functions.CONSUMER_ARGS`, the last arguments of the ops that take a consumer."""
_N_CONSUMER = len(F.CONSUMER_ARGS)


# ---- the ops and their eager calls ------------------------------------------------------------------------

@dataclass
class _Op:
    """A ``coda::`` op's implementation and, for a differentiable one, its autograd (``setup_context`` and
    ``backward`` as ``register_autograd`` takes them)."""

    impl: Callable[..., Any]
    defn: CustomOpDef
    setup: Callable[..., None] | None = None
    backward: Callable[..., Any] | None = None


_OPS: dict[str, _Op] = {}


def _op(name: str, schema: str | None = None, mutates_args: tuple[str, ...] = ()):
    """Registers the decorated function as the custom op ``coda::<name>`` (schema given, or from its annotations),
    and as that op's implementation for :func:`call`."""
    def register(fn: Callable[..., Any]) -> CustomOpDef:
        defn = custom_op(f"coda::{name}", fn, mutates_args=mutates_args, schema=schema)
        _OPS[name] = _Op(fn, defn)
        return defn
    return register


def _autograd(name: str, backward: Callable[..., Any], setup: Callable[..., None]) -> None:
    """The autograd of ``coda::<name>``: registered with the op, and the same two functions for :func:`call`'s
    eager path."""
    op = _OPS[name]
    op.defn.register_autograd(backward, setup_context=setup)
    op.setup, op.backward = setup, backward


def _flat(args: tuple[Any, ...]) -> tuple[list[Any], tuple[int | None, ...]]:
    """The arguments with each list of tensors spread in place (autograd sees only tensors that are arguments of
    ``apply``), and each argument's length as spread (None: not spread)."""
    flat: list[Any] = []
    layout: list[int | None] = []
    for a in args:
        spread = isinstance(a, list) and all(isinstance(t, torch.Tensor) for t in a)
        flat += a if spread else [a]
        layout.append(len(a) if spread else None)
    return flat, tuple(layout)


def _nested(flat: tuple[Any, ...] | list[Any], layout: tuple[int | None, ...]) -> list[Any]:
    """The inverse of :func:`_flat`."""
    args, i = [], 0
    for n in layout:
        args.append(flat[i] if n is None else list(flat[i:i + n]))
        i += 1 if n is None else n
    return args


class _Eager(torch.autograd.Function):
    """A differentiable op's eager call without the dispatcher: its implementation, ``setup_context`` and
    ``backward`` as torch.library's autograd runs them (list outputs returned flat and given back to backward as
    one list of gradients; a list input's gradient a list, or None for all of its tensors)."""

    @staticmethod
    def forward(ctx, op: _Op, layout: tuple[int | None, ...], *flat: Any):
        args = _nested(flat, layout)
        out = op.impl(*args)
        op.setup(ctx, tuple(args), out)
        ctx.op, ctx.layout, ctx.listed = op, layout, isinstance(out, list)
        ctx.first_arg = 2  # needs_input_grad counts op and layout first
        return tuple(out) if ctx.listed else out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        result = ctx.op.backward(ctx, list(grads) if ctx.listed else grads[0])
        result = result if isinstance(result, tuple) else (result,)
        flat: list[Any] = [None, None]  # op, layout
        for g, n in zip(result, ctx.layout):
            flat += [g] if n is None else (g if g is not None else [None] * n)
        return tuple(flat)


def _eager() -> bool:
    """Whether a call runs eagerly on real tensors: not traced by torch.compile (Dynamo, AOTAutograd) nor under a
    dispatch mode (fake tensors, make_fx, opcheck), which need the op itself."""
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0


def call(name: str, *args: Any) -> Any:
    """``torch.ops.coda.<name>(*args)``: the op itself when traced; eagerly its implementation, through
    :class:`_Eager` when it is differentiable and an input needs a gradient (the dispatcher and torch.library's
    autograd wrapper left out)."""
    if not _eager():
        return getattr(torch.ops.coda, name)(*args)
    op = _OPS[name]
    if op.backward is None or not torch.is_grad_enabled():
        return op.impl(*args)
    flat, layout = _flat(args)
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
        return op.impl(*args)
    out = _Eager.apply(op, layout, *flat)
    return list(out) if isinstance(out, tuple) else out


def _consumer(args: tuple[Any, ...]) -> F.Consumer:
    return F.consumer_of(*args)


def _kind(args: tuple[Any, ...]) -> type[F.Consumer]:
    return F.CONSUMERS[args[0]]


# ---- fake-tensor rules ------------------------------------------------------------------------------------

def _consumer_fake(kind: type[F.Consumer], h: torch.Tensor, w: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor,
                   save: bool) -> list[torch.Tensor]:
    """The consumer's ``[out, *side, *saved]`` for h [M, d] (its GEMM input, in x's dtype) and w [N, d]."""
    m, n = h.shape[0], w.shape[0]
    if kind is F.CrossEntropy:
        out = [h.new_empty((), dtype=torch.float32), h.new_empty(m, dtype=torch.float32)]
        if save:  # dx, dgamma, dW, applied
            out += [_rows(x, *x.shape), gamma.new_empty(gamma.shape), _rows(w, *w.shape),
                    h.new_empty(1, dtype=torch.float32)]
        return out
    if kind is F.SwiGLU:
        return [_rows(h, m, n // 2)] + ([_rows(h, m, n)] if save else [])
    return [_rows(h, m, n)]  # linear, rope


def _rows(t: torch.Tensor, m: int, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new [m, n] tensor on t's device (t's dtype by default) in the row layout the kernels write
    (:func:`kernels.coda.align.empty_rows`: contiguous unless n is off the 16-byte rule)."""
    return empty_rows(m, n, dtype or t.dtype, t.device)


def _rstd(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(t.shape[0], dtype=torch.float32)


# ---- forward ops ------------------------------------------------------------------------------------------

@_op("producer_consumer",
           schema=f"(Tensor a, Tensor residual, Tensor w_p, Tensor gamma, Tensor w, float eps, bool save, {_CONSUMER})"
                  " -> Tensor[]")
def producer_consumer(a, residual, w_p, gamma, w, eps, save, *consumer):
    return F.producer_consumer_forward(a, residual, w_p, gamma, w, _consumer(consumer), eps, save)


@producer_consumer.register_fake
def _(a, residual, w_p, gamma, w, eps, save, *consumer):
    x = _rows(residual, a.shape[0], w_p.shape[0])
    out, *rest = _consumer_fake(_kind(consumer), x, w, x, gamma, save)
    return [x, out, _rstd(a), *rest]


@_op("block",
           schema=f"(Tensor a, Tensor residual, Tensor w_o, Tensor gamma_mlp, Tensor w_gu, Tensor w_down, "
                  f"Tensor gamma, Tensor w, float eps, bool save, {_CONSUMER}) -> Tensor[]")
def block(a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w, eps, save, *consumer):
    return F.block_forward(a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w, _consumer(consumer), eps, save)


@block.register_fake
def _(a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w, eps, save, *consumer):
    m, kind = a.shape[0], _kind(consumer)
    x = _rows(residual, m, w_o.shape[0])
    if kind is F.NoConsumer:
        out, rstd = (a.new_empty(0, dtype=torch.float32) for _ in range(2))
        return [x, out, _rstd(a), rstd] + ([_rows(x, m, x.shape[1]), _rows(x, m, w_gu.shape[0])] if save else [])
    out, *rest = _consumer_fake(kind, x, w, x, gamma, save)
    side, saved = rest[:kind.side_outputs], rest[kind.side_outputs:]
    own = [_rows(x, m, x.shape[1]), _rows(x, m, w_gu.shape[0])] if save else []  # x1, z_pre
    return [x, out, _rstd(a), _rstd(a), *side, *own, *saved]


@_op("norm_consumer",
           schema=f"(Tensor x, Tensor gamma, Tensor w, float eps, bool save, {_CONSUMER}) -> Tensor[]")
def norm_consumer(x, gamma, w, eps, save, *consumer):
    return F.norm_consumer_forward(x, gamma, w, _consumer(consumer), eps, save)


@norm_consumer.register_fake
def _(x, gamma, w, eps, save, *consumer):
    out, *rest = _consumer_fake(_kind(consumer), _rows(x, x.shape[0], x.shape[1]), w, x, gamma, save)
    return [out, _rstd(x), *rest]


# ---- backward ops -----------------------------------------------------------------------------------------

def _empty_for_none(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A backward op's skipped weight gradient as the op returns it: an empty tensor (a schema's Tensor is not
    optional); :func:`_if_wanted` turns it back into None."""
    return like.new_empty(0) if t is None else t


def _if_wanted(t: torch.Tensor, wanted: bool) -> torch.Tensor | None:
    return t if wanted else None


@_op("consumer_bwd",
           schema=f"(Tensor grad, Tensor[] saved, Tensor w, Tensor x, Tensor rstd, Tensor gamma, Tensor? dres, "
                  f"bool w_grad, {_CONSUMER}) -> (Tensor, Tensor, Tensor)")
def consumer_bwd(grad, saved, w, x, rstd, gamma, dres, w_grad, *consumer):
    set_scratch_allocator()  # backward may run in autograd's device thread
    dx, dgamma, dw = F.consumer_backward(_consumer(consumer), grad, tuple(saved), w, x, rstd, gamma, dres, w_grad)
    return dx, dgamma, _empty_for_none(dw, w)


@consumer_bwd.register_fake
def _(grad, saved, w, x, rstd, gamma, dres, w_grad, *consumer):
    dz = saved[0] if _kind(consumer) is F.SwiGLU else grad  # dz_pre in z_pre's dtype, else in grad's
    m, d = x.shape
    return (_rows(x, m, d, (dres if dres is not None else x).dtype), gamma.new_empty(gamma.shape),
            _rows(dz, w.shape[0], d) if w_grad else w.new_empty(0))


@_op("rescaled")
def rescaled(grad: torch.Tensor, applied: torch.Tensor, dx: torch.Tensor, dgamma: torch.Tensor,
             dw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    set_scratch_allocator()
    out = [t.clone() for t in (dx, dgamma, dw)]
    rescale_(grad, applied.clone(), *out)
    return tuple(out)


@rescaled.register_fake
def _(grad, applied, dx, dgamma, dw):
    return torch.empty_like(dx), torch.empty_like(dgamma), torch.empty_like(dw)


@_op("producer_bwd")
def producer_bwd(dx: torch.Tensor, a: torch.Tensor, w_p: torch.Tensor, w_grad: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    set_scratch_allocator()
    da, dw_p = F.producer_backward(dx, a, w_p, w_grad)
    return da, _empty_for_none(dw_p, w_p)


@producer_bwd.register_fake
def _(dx, a, w_p, w_grad):
    return _rows(dx, dx.shape[0], w_p.shape[1]), _rows(dx, dx.shape[1], a.shape[1]) if w_grad else w_p.new_empty(0)


def _mlp_fake(dx, w_down, z_pre, w_gu, down_grad, gu_grad):
    """``(dW_down, dW_gu)``: dW_down in dx's dtype, dW_gu in z_pre's (the dtype of dz_pre); empty where skipped."""
    return (_rows(dx, dx.shape[1], w_down.shape[1]) if down_grad else w_down.new_empty(0),
            _rows(z_pre, w_gu.shape[0], w_gu.shape[1]) if gu_grad else w_gu.new_empty(0))


@_op("mlp_bwd")
def mlp_bwd(dx: torch.Tensor, w_down: torch.Tensor, z_pre: torch.Tensor, w_gu: torch.Tensor, x1: torch.Tensor,
            rstd_mlp: torch.Tensor, gamma_mlp: torch.Tensor, down_grad: bool, gu_grad: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    set_scratch_allocator()
    dx1, dw_down, dgamma_mlp, dw_gu = F.mlp_backward(dx, w_down, z_pre, w_gu, x1, rstd_mlp, gamma_mlp, inplace=False,
                                                     w_grads=(down_grad, gu_grad))
    return dx1, _empty_for_none(dw_down, w_down), dgamma_mlp, _empty_for_none(dw_gu, w_gu)


@mlp_bwd.register_fake
def _(dx, w_down, z_pre, w_gu, x1, rstd_mlp, gamma_mlp, down_grad, gu_grad):
    dw_down, dw_gu = _mlp_fake(dx, w_down, z_pre, w_gu, down_grad, gu_grad)
    return _rows(dx, *dx.shape), dw_down, gamma_mlp.new_empty(gamma_mlp.shape), dw_gu


@_op("mlp_bwd_", mutates_args=("dx",))
def mlp_bwd_(dx: torch.Tensor, w_down: torch.Tensor, z_pre: torch.Tensor, w_gu: torch.Tensor, x1: torch.Tensor,
             rstd_mlp: torch.Tensor, gamma_mlp: torch.Tensor, down_grad: bool, gu_grad: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    set_scratch_allocator()
    # dx: this backward's own buffer, written in place
    _, dw_down, dgamma_mlp, dw_gu = F.mlp_backward(dx, w_down, z_pre, w_gu, x1, rstd_mlp, gamma_mlp, inplace=True,
                                                   w_grads=(down_grad, gu_grad))
    return _empty_for_none(dw_down, w_down), dgamma_mlp, _empty_for_none(dw_gu, w_gu)


@mlp_bwd_.register_fake
def _(dx, w_down, z_pre, w_gu, x1, rstd_mlp, gamma_mlp, down_grad, gu_grad):
    dw_down, dw_gu = _mlp_fake(dx, w_down, z_pre, w_gu, down_grad, gu_grad)
    return dw_down, gamma_mlp.new_empty(gamma_mlp.shape), dw_gu


# ---- autograd of the forward ops ------------------------------------------------------------------------

def _mark(ctx, output: list[torch.Tensor], differentiable: int) -> None:
    """All but the first ``differentiable`` outputs are not differentiable; a missing gradient stays None."""
    ctx.mark_non_differentiable(*output[differentiable:])
    ctx.set_materialize_grads(False)


def _kept(kind: type[F.Consumer], out: torch.Tensor) -> torch.Tensor:
    """The op's output as its backward keeps it: itself for a consumer whose backward reads it
    (:attr:`~kernels.coda.functions.Consumer.keeps_output`), else an empty stand-in, so that a linear or SwiGLU
    consumer's output is not held until backward."""
    return out if kind.keeps_output else out.new_empty(0)


def _needs(ctx, i: int) -> bool:
    """Whether the op's input i needs a gradient (``ctx.needs_input_grad``, after :class:`_Eager`'s own two)."""
    return ctx.needs_input_grad[getattr(ctx, "first_arg", 0) + i]


def _consumer_grads(ctx, kind: type[F.Consumer], grad: torch.Tensor | None, out: torch.Tensor, saved: list,
                    w, x, rstd, gamma, dres: torch.Tensor | None, w_grad: bool):
    """``(dx, dgamma, dW)`` through the consumer, the RMSNorm backward and the consumer's weight gradient (None
    without ``w_grad``); dx includes dres (the incoming residual gradient), and is dres itself when the output got
    no gradient."""
    if grad is None:
        return dres, None, None
    if kind.grad_in_forward:  # computed in forward for dloss = 1: scaled to grad on the device (a no-op at 1)
        dx, dgamma, dw, applied = saved
        if detect_fake_mode(grad) is not None:
            # Traced (torch.compile, opcheck): scaled copies; a graph writing into its saved tensors would need
            # AOTAutograd to order those writes against their other uses.
            dx, dgamma, dw = torch.ops.coda.rescaled(grad, applied, dx, dgamma, dw)
        else:
            # Eager: in place, by kernels that autograd does not see: a second backward (retain_graph) reads these
            # saved tensors again (rescaled by the ratio of the two gradients), so their versions must not change.
            rescale_(grad, applied, dx, dgamma, dw)
        # dW is empty where the forward computed none (its weight_grad)
        return (dx if dres is None else dres + dx), dgamma, _if_wanted(dw, w_grad)
    kept = [out] if kind.keeps_output else []
    dx, dgamma, dw = call("consumer_bwd", grad, kept + list(saved), w, x, rstd, gamma, dres, w_grad, *ctx.consumer)
    return dx, dgamma, _if_wanted(dw, w_grad)


def _producer_grads(dx: torch.Tensor | None, a: torch.Tensor, w_p: torch.Tensor, w_grad: bool):
    if dx is None:
        return None, None
    da, dw_p = call("producer_bwd", dx, a, w_p, w_grad)
    return da, _if_wanted(dw_p, w_grad)


def _pc_setup(ctx, inputs, output):
    a, residual, w_p, gamma, w, eps, save, *consumer = inputs
    kind = _kind(consumer)
    _mark(ctx, output, 2)
    ctx.consumer = tuple(consumer)
    if save:
        x, out, rstd = output[:3]
        ctx.save_for_backward(a, w_p, gamma, w, x, _kept(kind, out), rstd, *output[3 + kind.side_outputs:])


def _pc_backward(ctx, grads):
    dx_out, dout = grads[0], grads[1]
    a, w_p, gamma, w, x, out, rstd, *saved = ctx.saved_tensors
    dres = None if dx_out is None else dx_out.contiguous()
    dx, dgamma, dw = _consumer_grads(ctx, _kind(ctx.consumer), dout, out, saved, w, x, rstd, gamma, dres,
                                     _needs(ctx, 4))
    da, dw_p = _producer_grads(dx, a, w_p, _needs(ctx, 2))
    return da, dx, dw_p, dgamma, dw, None, None, *(None,) * _N_CONSUMER


_autograd("producer_consumer", _pc_backward, _pc_setup)


def _block_setup(ctx, inputs, output):
    a, residual, w_o, gamma_mlp, w_gu, w_down, gamma, w, eps, save, *consumer = inputs
    kind = _kind(consumer)
    _mark(ctx, output, 2)
    ctx.consumer = tuple(consumer)
    if save:
        x, out, rstd_mlp, rstd = output[:4]
        ctx.save_for_backward(a, w_o, gamma_mlp, w_gu, w_down, gamma, w, x, _kept(kind, out), rstd_mlp, rstd,
                              *output[4 + kind.side_outputs:])


def _block_backward(ctx, grads):
    dx_out, dout = grads[0], grads[1]
    before = F.recomputations()
    a, w_o, gamma_mlp, w_gu, w_down, gamma, w, x, out, rstd_mlp, rstd, x1, z_pre, *saved = ctx.saved_tensors
    recomputed = F.recomputations() != before  # z_pre is this backward's own: dz_pre may go over it
    dres = None if dx_out is None else dx_out.contiguous()
    dx, dgamma, dw = _consumer_grads(ctx, _kind(ctx.consumer), dout, out, saved, w, x, rstd, gamma, dres,
                                     _needs(ctx, 7))
    if dx is None:
        return (None,) * (10 + _N_CONSUMER)
    w_grads = _needs(ctx, 5), _needs(ctx, 4)  # W_down, W_gu
    # Add into dx in place when it is this backward's own buffer, not dres (the consumer had no gradient) nor a
    # gradient saved by the consumer's forward; otherwise into a new tensor.
    own = all(dx is not t for t in (dres, *saved))
    mlp = (dx, w_down, z_pre, w_gu, x1, rstd_mlp, gamma_mlp)
    if recomputed:  # eager only (no recomputation context is entered in a traced graph): the kernels directly
        set_scratch_allocator()
        dx1, dw_down, dgamma_mlp, dw_gu = F.mlp_backward(*mlp, inplace=own, overwrite=True, w_grads=w_grads)
    elif own:
        (dw_down, dgamma_mlp, dw_gu), dx1 = call("mlp_bwd_", *mlp, *w_grads), dx
    else:
        dx1, dw_down, dgamma_mlp, dw_gu = call("mlp_bwd", *mlp, *w_grads)
    dw_down, dw_gu = _if_wanted(dw_down, w_grads[0]), _if_wanted(dw_gu, w_grads[1])
    da, dw_o = _producer_grads(dx1, a, w_o, _needs(ctx, 2))
    return da, dx1, dw_o, dgamma_mlp, dw_gu, dw_down, dgamma, dw, None, None, *(None,) * _N_CONSUMER


_autograd("block", _block_backward, _block_setup)


def _nc_setup(ctx, inputs, output):
    x, gamma, w, eps, save, *consumer = inputs
    kind = _kind(consumer)
    _mark(ctx, output, 1)
    ctx.consumer = tuple(consumer)
    if save:
        ctx.save_for_backward(x, gamma, w, _kept(kind, output[0]), output[1], *output[2 + kind.side_outputs:])


def _nc_backward(ctx, grads):
    x, gamma, w, out, rstd, *saved = ctx.saved_tensors
    dx, dgamma, dw = _consumer_grads(ctx, _kind(ctx.consumer), grads[0], out, saved, w, x, rstd, gamma, None,
                                     _needs(ctx, 2))
    return dx, dgamma, dw, None, None, *(None,) * _N_CONSUMER


_autograd("norm_consumer", _nc_backward, _nc_setup)


# ---- weight packing (kernels.coda.pack) -------------------------------------------------------------------

@_op("pack_rows")
def pack_rows(tensor: torch.Tensor, row: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    weights = [w.contiguous() for w in weights]
    packed = _rows(weights[0], tensor.numel(), weights[0].shape[1])
    copy_rows(packed, weights, (tensor, row), unpack=False)
    return packed


@pack_rows.register_fake
def _(tensor, row, weights):
    return _rows(weights[0], tensor.numel(), weights[0].shape[1])


@_op("unpack_rows")
def unpack_rows(dpacked: torch.Tensor, tensor: torch.Tensor, row: torch.Tensor, sizes: list[int]
                ) -> list[torch.Tensor]:
    set_scratch_allocator()
    grads = [dpacked.new_empty(n, dpacked.shape[1]) for n in sizes]
    copy_rows(aligned(dpacked), grads, (tensor, row), unpack=True)
    return grads


@unpack_rows.register_fake
def _(dpacked, tensor, row, sizes):
    return [dpacked.new_empty(n, dpacked.shape[1]) for n in sizes]


def _pack_setup(ctx, inputs, output):
    tensor, row, weights = inputs
    ctx.index, ctx.sizes = (tensor, row), [w.shape[0] for w in weights]


def _pack_backward(ctx, dpacked):
    return None, None, call("unpack_rows", dpacked, *ctx.index, ctx.sizes)


_autograd("pack_rows", _pack_backward, _pack_setup)
