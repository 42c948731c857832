from __future__ import annotations

from workloads import reference as R
from workloads.models import ModelShape
from workloads.op import InputMaker, Op


class SwiGLUBwd(Op):
    """The elementwise SwiGLU backward (``swiglu_bwd``), for a dy that no GEMM of the kernel produces::

        dgate = dy up silu'(gate);   dup = dy silu(gate);   zdz = sum_i gate_i dgate_i + up_i dup_i

    given the saved pre-activations gate, up [M, f]. No GEMM: no speed-of-light. (Fused into the down-proj dgrad
    GEMM it is ``swiglu_dgrad``.)
    """

    name = "swiglu_bwd"
    kind = "direct"
    modes = ("bwd",)
    level = "kernel"
    description = "SwiGLU backward + ZdZ, elementwise"
    outputs = ("dgate", "dup", "zdz")

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        m, f = model.tokens, model.ffn
        return {"dy": mk.normal(m, f), "gate": mk.normal(m, f), "up": mk.normal(m, f)}

    def reference(self, inp, model, mm=None):  # no GEMM: mm unused
        dt = inp["gate"].dtype
        g, u = R.upcast(inp["gate"]), R.upcast(inp["up"])
        dgate, dup = R.swiglu_backward(R.upcast(inp["dy"]), g, u)
        return {"dgate": dgate.to(dt), "dup": dup.to(dt), "zdz": (g * dgate + u * dup).sum(-1)}

    def forward_gemms(self, model):
        return []
