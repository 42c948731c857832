from __future__ import annotations

from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op
from workloads.ops._producer import producer, producer_inputs


class RMSNormLinear(Op):
    """Pattern (a), plain row scale: ``x = residual + a Wo^T``; ``z = rmsnorm(x; g) Wc^T`` (Wc: gate/up width 2f)."""

    name = "rmsnorm_linear"
    description = "out-proj + residual + RMSNorm + gate/up GEMM (plain row scale)"
    outputs = ("x", "z")
    side_outputs = ("rstd",)
    fp8_operands = {"a": "act", "w_o": "weight", "w_c": "weight"}

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        inp = producer_inputs(mk, model.tokens, model.hidden, model.attn_width, "w_o")
        inp["w_c"] = mk.weight(2 * model.ffn, model.hidden)
        return inp

    def reference(self, inp, model, mm=TORCH_GEMMS):
        x, h, r = producer(inp, "w_o", model.eps, mm)
        return {"x": x, "z": mm.linear(h, inp["w_c"]), "rstd": r}

    def forward_gemms(self, model):
        m = model.tokens
        return [Gemm(m, model.hidden, model.attn_width), Gemm(m, 2 * model.ffn, model.hidden)]
