from __future__ import annotations

from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker
from workloads.ops._consumer import ConsumerOp, consumer_inputs, scaled_gemm


class ScaledLinear(ConsumerOp):
    """The row-scaled consumer GEMM alone (``scaled_linear``), at the gate/up shape (N = 2f)::

        z = rstd[:, None] * (h Wc^T)        (h = x * gamma, rstd of x: = rmsnorm(x; gamma) Wc^T)
    """

    name = "scaled_linear"
    kind = "direct"
    modes = ("fwd",)
    level = "kernel"
    description = "gate/up GEMM + RMSNorm row scale (the consumer kernel)"
    outputs = ("z",)
    fp8_operands = {"h": "act", "w": "weight"}

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        return {**consumer_inputs(mk, model), "w": mk.weight(2 * model.ffn, model.hidden)}

    def reference(self, inp, model, mm=TORCH_GEMMS):
        z, dt = scaled_gemm(inp["h"], inp["w"], inp["rstd"], mm)
        return {"z": z.to(dt)}

    def forward_gemms(self, model):
        return [Gemm(model.tokens, 2 * model.ffn, model.hidden)]
