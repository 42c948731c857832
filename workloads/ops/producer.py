from __future__ import annotations

from typing import Callable, ClassVar

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op
from workloads.ops._producer import producer_inputs


class Producer(Op):
    """The producer kernel alone (``gemm_residual_norm``): a projection GEMM, the residual add and the RMSNorm
    statistics of the new residual stream::

        x = residual + a Wp^T;   h = x * gamma;   rstd = (mean_j x_j^2 + eps)^(-1/2)

    h is gamma times the un-normalized x: the consumer GEMM applies rstd per row (``scaled_linear``).
    """

    kind = "direct"
    modes = ("fwd",)
    level = "kernel"
    outputs = ("x", "h", "rstd")
    fp8_operands = {"a": "act", "w": "weight"}
    k_of: ClassVar[Callable[[ModelShape], int]]
    """K of the projection: its input width."""

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        return producer_inputs(InputMaker(dtype, device, seed), model.tokens, model.hidden, self.k_of(model), "w")

    def reference(self, inp, model, mm=TORCH_GEMMS):
        x = inp["residual"] + mm.linear(inp["a"], inp["w"])
        return {"x": x, "h": x * inp["gamma"], "rstd": R.rstd(x, model.eps)}

    def forward_gemms(self, model):
        return [Gemm(model.tokens, model.hidden, self.k_of(model))]


class ProducerOut(Producer):
    name = "producer_out"
    description = "out-proj GEMM + residual + gamma + rstd (the producer kernel)"
    k_of = staticmethod(lambda m: m.attn_width)


class ProducerDown(Producer):
    name = "producer_down"
    description = "down-proj GEMM + residual + gamma + rstd (the producer kernel)"
    k_of = staticmethod(lambda m: m.ffn)
