"""``torch.compile`` of the patched Hugging Face model, and the ``coda::`` custom ops it traces (kernels.coda.ops).

CPU, Triton interpreter, fp32, the tiny models of ``test_hf``; ``backend="aot_eager"`` (AOTAutograd's forward and
backward graphs run by eager torch: no C++ compiler needed). The compiled model must trace into one graph
(``fullgraph=True``) that calls the CODA ops, and give the eager patched model's loss and gradients, and the
unpatched model's under the suite's error rule. Eager calls of the public functions run the ops' implementations
and autograd without the dispatcher (``ops.call``), with the ops' own results.
"""
from __future__ import annotations

import copy

import pytest
import torch

from kernels.coda import ops
from kernels.coda.functions import CrossEntropy, Linear, RoPE, SwiGLU
from kernels.coda.hf import apply_coda

from kernel_helpers import launches
from test_hf import FUSED, assert_close_to, assert_passes, batch, loss_and_grads, tiny

pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")

CODA_OPS = {"coda.norm_consumer", "coda.block", "coda.pack_rows"}
"""Ops the tiny Llama's forward graph must call (two layers: the first norm + QKV, two blocks, packed weights)."""


def compiled(model: torch.nn.Module, graphs: list) -> torch.nn.Module:
    """``torch.compile(model, backend="aot_eager", fullgraph=True)``, each Dynamo graph's call targets appended to
    ``graphs``."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return aot_eager(gm, example_inputs)

    return torch.compile(model, backend=backend, fullgraph=True)


def test_compiled_fullgraph_gives_the_eager_and_unpatched_loss_and_gradients():
    """One graph, which calls the CODA ops and reads the packing indices (computing none); its forward and backward
    run the fused kernels; the loss and every parameter gradient equal the eager patched model's (up to the order of
    the tied embedding's two sums) and pass the suite's rule against the unpatched model in float64, as the eager
    patched model does."""
    torch._dynamo.reset()
    model = tiny()
    ids, mask, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    loss64, grads64, _ = loss_and_grads(copy.deepcopy(model).double(), **inputs)
    loss32, grads32, _ = loss_and_grads(model, **inputs)
    apply_coda(model)
    eager_loss, eager_grads, _ = loss_and_grads(model, **inputs)
    eager_grads = {n: g.clone() for n, g in eager_grads.items()}
    graphs: list = []
    with launches() as names:
        loss, _, out = loss_and_grads(compiled(model, graphs), **inputs)
    grads = {n: p.grad for n, p in model.named_parameters()}  # the compiled wrapper's names have a prefix
    assert len(graphs) == 1 and CODA_OPS <= {t.removesuffix(".default") for t in graphs[0]}, graphs
    # the packing indices are the plan's, made eagerly: the graph reads them and computes none (no searchsorted,
    # no cumsum), so no compiler generates code for them
    assert not {t for t in graphs[0] if "searchsorted" in t or "cumsum" in t}, sorted(graphs[0])
    assert out.logits is None and FUSED <= set(names), sorted(set(names))
    assert set(grads) == set(grads64) and all(g is not None for g in grads.values())
    assert_close_to("loss", loss, eager_loss, 1e-6)
    assert_passes("loss", loss, loss32, loss64)
    for name in grads64:
        assert_close_to(name, grads[name], eager_grads[name], 1e-6)
        assert_passes(name, grads[name], grads32[name], grads64[name])


def test_compiled_logits_and_a_bad_label():
    """Without labels the compiled graph returns the eager patched logits; a label out of range fails the compiled
    graph's assertion (a RuntimeError naming it) instead of the eager IndexError: a graph cannot branch on values."""
    torch._dynamo.reset()
    model = apply_coda(tiny())
    ids, mask, labels = batch()
    graphs: list = []
    fast = compiled(model, graphs)
    with torch.no_grad():
        assert_close_to("logits", fast(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                        1e-6)
        labels[0, 7] = 300
        with pytest.raises(RuntimeError, match=r"a target is out of bounds: not -100 nor in \[0, 256\)"):
            fast(ids, attention_mask=mask, labels=labels)
    assert len(graphs) == 2  # logits, loss: one graph each


# ---- opcheck: each op's schema, fake-tensor rule, autograd registration and AOT tracing ----------------------

M, D, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 16, 32, 2, 1, 8, 16, 48


def rand(*shape: int, seed: int, scale: float = 0.3, grad: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return t.requires_grad_(grad)


def consumer(kind: str):
    """(consumer, its weight's rows)."""
    target = torch.randint(0, VOCAB, (M,), generator=torch.Generator().manual_seed(9))
    target[::4] = -100
    return {"linear": (Linear(), 24), "swiglu": (SwiGLU(), 2 * FFN),
            "rope": (RoPE(torch.arange(M) % 5, HEADS, KV_HEADS, HEAD_DIM, 10000.0, (1.0, 0.5, 0.25, 0.125)),
                     (HEADS + 2 * KV_HEADS) * HEAD_DIM),
            "cross_entropy": (CrossEntropy(target, chunk_rows=8), VOCAB)}[kind]


def op_args(c) -> tuple:
    return (c.kind, *c.op_args())


def gamma(seed: int, grad: bool = True) -> torch.Tensor:
    return (1 + rand(D, seed=seed, scale=0.1)).requires_grad_(grad)


@pytest.mark.parametrize("kind", ["linear", "swiglu", "rope", "cross_entropy"])
def test_opcheck_forward_ops(kind):
    c, n = consumer(kind)
    a, res, w_p, w = rand(M, 24, seed=1, grad=True), rand(M, D, seed=2, grad=True), rand(D, 24, seed=3, grad=True), \
        rand(n, D, seed=4, grad=True)
    torch.library.opcheck(ops.producer_consumer, (a, res, w_p, gamma(5), w, 1e-5, True, *op_args(c)))
    torch.library.opcheck(ops.norm_consumer, (res, gamma(5), w, 1e-5, True, *op_args(c)))
    torch.library.opcheck(ops.norm_consumer, (res.detach(), gamma(5, False), w.detach(), 1e-5, False, *op_args(c)))
    if kind in ("rope", "cross_entropy"):  # the block's two consumers in the drop-in
        w_o, w_gu, w_down = rand(D, 24, seed=6, grad=True), rand(2 * FFN, D, seed=7, grad=True), \
            rand(D, FFN, seed=8, grad=True)
        torch.library.opcheck(ops.block, (a, res, w_o, gamma(10), w_gu, w_down, gamma(11), w, 1e-5, True,
                                          *op_args(c)))


@pytest.mark.parametrize("kind", ["linear", "swiglu", "rope"])
def test_opcheck_consumer_bwd(kind):
    c, n = consumer(kind)
    x, w, g = rand(M, D, seed=1), rand(n, D, seed=2), gamma(3, False)
    out, rstd, *saved = ops.norm_consumer(x, g, w, 1e-5, True, *op_args(c))
    kept = [out] if c.keeps_output else []
    grad = rand(*out.shape, seed=4)
    for dres, w_grad in ((None, True), (rand(M, D, seed=5), True), (None, False)):
        torch.library.opcheck(ops.consumer_bwd, (grad, kept + saved, w, x, rstd, g, dres, w_grad, *op_args(c)))


def test_opcheck_backward_pieces_and_packing():
    c, _ = consumer("cross_entropy")
    x, w, g = rand(M, D, seed=1), rand(VOCAB, D, seed=2), gamma(3, False)
    _, _, _, dx, dgamma, dw, applied = ops.norm_consumer(x, g, w, 1e-5, True, *op_args(c))
    torch.library.opcheck(ops.rescaled, (torch.tensor(3.0), applied, dx, dgamma, dw))
    dx, a, w_p = rand(M, D, seed=4), rand(M, 24, seed=5), rand(D, 24, seed=6)
    for w_grad in (True, False):  # a weight that needs no gradient gets an empty one
        torch.library.opcheck(ops.producer_bwd, (dx, a, w_p, w_grad))
    mlp = (dx, rand(D, FFN, seed=7), rand(M, 2 * FFN, seed=8), rand(2 * FFN, D, seed=9), rand(M, D, seed=10),
           rand(M, seed=11, scale=0.1) + 1, gamma(12, False))
    for w_grads in ((True, True), (False, True), (True, False)):
        torch.library.opcheck(ops.mlp_bwd, (*mlp, *w_grads))
        torch.library.opcheck(ops.mlp_bwd_, (*mlp, *w_grads))
    from kernels.coda.pack import qkv_index

    index = qkv_index(HEADS, KV_HEADS, HEAD_DIM, torch.device("cpu"))
    weights = [rand(HEADS * HEAD_DIM, D, seed=13, grad=True), rand(HEAD_DIM, D, seed=14, grad=True),
               rand(HEAD_DIM, D, seed=15, grad=True)]
    torch.library.opcheck(ops.pack_rows, (*index, weights))
    torch.library.opcheck(ops.unpack_rows, (rand(32, D, seed=16), *index, [16, 8, 8]))


def test_a_misaligned_operand_is_copied_inside_the_op():
    """Views off the 16-byte alignment the tensor descriptors need (offset by one fp32 element: a parameter in
    safetensors' mmap, a flat buffer) give the aligned operands' results and gradients: the kernels' host functions
    inside the op copy them (kernels.coda.align), since a caller traced by torch.compile cannot read a data pointer."""
    c, n = consumer("rope")
    x, g, w = rand(M, D, seed=1), gamma(2, False), rand(n, D, seed=3)
    results = []
    for offset in (0, 1):
        views = [torch.cat([t.new_zeros(offset), t.reshape(-1)])[offset:].view(t.shape).requires_grad_()
                 for t in (x, g, w)]
        assert (views[0].data_ptr() % 16 != 0) == bool(offset)
        out = ops.norm_consumer(*views, 1e-5, True, *op_args(c))[0]
        out.backward(torch.ones_like(out))
        results.append([out.detach()] + [v.grad for v in views])
    for ours, aligned in zip(*results):
        assert torch.equal(ours, aligned)


def test_packing_reads_an_index_of_any_strides():
    """pack_rows / unpack_rows with their int32 index as strided views (as a compiled graph may pass them) give the
    contiguous index's results."""
    from kernels.coda.pack import qkv_index

    tensor, row = qkv_index(HEADS, KV_HEADS, HEAD_DIM, torch.device("cpu"))
    strided = [torch.stack([t, -t], dim=1)[:, 0] for t in (tensor, row)]  # stride 2
    assert all(s.stride() == (2,) and torch.equal(s, t) for s, t in zip(strided, (tensor, row)))
    weights = [rand(HEADS * HEAD_DIM, D, seed=13), rand(HEAD_DIM, D, seed=14), rand(HEAD_DIM, D, seed=15)]
    packed = ops.pack_rows(tensor, row, weights)
    assert torch.equal(ops.pack_rows(*strided, weights), packed)
    grads = ops.unpack_rows(packed, tensor, row, [w.shape[0] for w in weights])
    assert all(torch.equal(g, w) for g, w in zip(grads, weights))
    assert all(torch.equal(a, b) for a, b in zip(ops.unpack_rows(packed, *strided, [16, 8, 8]), grads))


# ---- eager calls: the ops' implementation and autograd without the dispatcher ---------------------------------

def profiled_ops(fn) -> set[str]:
    """The ``coda::`` ops that the dispatcher records while ``fn()`` runs."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.function_events if e.name.startswith("coda::")}


def eager_cases():
    """(name, the public function's call, the op's call with its results alone, the differentiable inputs) of each
    composition on each consumer of the drop-in, and of the weight packing (a list input)."""
    from kernels.coda import functions as F
    from kernels.coda.pack import pack_rows, qkv_index

    for kind in ("linear", "swiglu", "rope", "cross_entropy"):
        c, n = consumer(kind)
        a, res, w_p, w = (rand(M, 24, seed=1, grad=True), rand(M, D, seed=2, grad=True),
                          rand(D, 24, seed=3, grad=True), rand(n, D, seed=4, grad=True))
        g, side = gamma(5), c.side_outputs
        yield (f"producer_consumer {kind}", lambda: F.producer_consumer(a, res, w_p, g, w, c, 1e-5),
               lambda: ops.producer_consumer(a, res, w_p, g, w, 1e-5, True, *op_args(c))[:3 + side],
               [a, res, w_p, g, w])
        yield (f"norm_consumer {kind}", lambda: F.norm_consumer(res, g, w, c, 1e-5),
               lambda: ops.norm_consumer(res, g, w, 1e-5, True, *op_args(c))[:2 + side], [res, g, w])
        if kind in ("rope", "cross_entropy"):
            w_o, w_gu, w_down, g2 = (rand(D, 24, seed=6, grad=True), rand(2 * FFN, D, seed=7, grad=True),
                                     rand(D, FFN, seed=8, grad=True), gamma(9))
            yield (f"block {kind}", lambda: F.block(a, res, w_o, g2, w_gu, w_down, g, w, c, 1e-5),
                   lambda: ops.block(a, res, w_o, g2, w_gu, w_down, g, w, 1e-5, True, *op_args(c))[:4 + side],
                   [a, res, w_o, g2, w_gu, w_down, g, w])
    index = qkv_index(HEADS, KV_HEADS, HEAD_DIM, torch.device("cpu"))
    weights = [rand(HEADS * HEAD_DIM, D, seed=13, grad=True), rand(HEAD_DIM, D, seed=14, grad=True),
               rand(HEAD_DIM, D, seed=15, grad=True)]
    yield "pack_rows", lambda: (pack_rows(index, *weights),), lambda: [ops.pack_rows(*index, weights)], weights


def outputs_and_grads(call, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The call's results and the inputs' gradients of a weighted sum of its differentiable results (weights of
    seed 20; a scalar loss's 3.0, so that the gradients computed in forward are rescaled)."""
    out = call()
    diff = [t for t in out if t.requires_grad]
    weights = [torch.full_like(t, 3.0) if t.dim() == 0 else rand(*t.shape, seed=20) for t in diff]
    grads = torch.autograd.grad(diff, inputs, weights, allow_unused=True)
    return [t.detach() for t in out] + list(grads)


def test_eager_calls_skip_the_dispatcher_and_give_the_ops_results():
    """The public functions (kernels.coda.functions, pack_rows), called eagerly with grad, run the ops'
    implementation and registered autograd without the dispatcher: no ``coda::`` op recorded in their forward and
    backward (the ops called directly are recorded, the check can fail), their results made by the eager adapter;
    and they give exactly the ops' results and gradients."""
    for name, public, op, inputs in eager_cases():
        recorded = profiled_ops(lambda: outputs_and_grads(op, inputs))
        assert name.split()[0] in {n.removeprefix("coda::") for n in recorded}, (name, recorded)
        assert not profiled_ops(lambda: outputs_and_grads(public, inputs)), name
        assert type(public()[0].grad_fn) is ops._Eager._backward_cls, name
        for ours, theirs in zip(outputs_and_grads(public, inputs), outputs_and_grads(op, inputs), strict=True):
            assert (ours is None) == (theirs is None) and (ours is None or torch.equal(ours, theirs)), name


def test_eager_calls_without_grad_and_traced_calls():
    """Without grad an eager call runs the implementation alone (no op recorded, no autograd); under a dispatch mode
    (fake tensors here; make_fx, opcheck) the public function calls the op, whose fake-tensor rule gives the
    shapes without running a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kernels.coda.functions import norm_consumer

    c, n = consumer("rope")
    x, g, w = rand(M, D, seed=1), gamma(2, False), rand(n, D, seed=3)
    with torch.no_grad():
        assert not profiled_ops(lambda: norm_consumer(x, g, w, c, 1e-5))
        out, rstd = norm_consumer(x, g, w, c, 1e-5)
    assert out.grad_fn is None and out.shape == (M, n) and rstd.shape == (M,)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (x, g, w, c.positions)]
        c = RoPE(fake[3], HEADS, KV_HEADS, HEAD_DIM, 10000.0, c.inv_freq)
        assert [t.shape for t in norm_consumer(*fake[:3], c, 1e-5)] == [out.shape, rstd.shape]
