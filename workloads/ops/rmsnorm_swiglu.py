from __future__ import annotations

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op
from workloads.ops._producer import producer, producer_inputs


class RMSNormSwiGLU(Op):
    """Pattern (b): ``x = residual + a Wo^T``; ``h = rmsnorm(x; g)``; ``y = silu(h Wg^T) * (h Wu^T)``."""

    name = "rmsnorm_swiglu"
    description = "out-proj + residual + RMSNorm + gate/up GEMM + SwiGLU"
    outputs = ("x", "y")
    side_outputs = ("rstd",)
    fp8_operands = {"a": "act", "w_o": "weight", "w_gate": "weight", "w_up": "weight"}

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        inp = producer_inputs(mk, model.tokens, model.hidden, model.attn_width, "w_o")
        inp["w_gate"] = mk.weight(model.ffn, model.hidden)
        inp["w_up"] = mk.weight(model.ffn, model.hidden)
        return inp

    def reference(self, inp, model, mm=TORCH_GEMMS):
        x, h, r = producer(inp, "w_o", model.eps, mm)
        return {"x": x, "y": R.swiglu(mm.linear(h, inp["w_gate"]), mm.linear(h, inp["w_up"])), "rstd": r}

    def forward_gemms(self, model):
        m = model.tokens
        return [Gemm(m, model.hidden, model.attn_width), Gemm(m, 2 * model.ffn, model.hidden)]
