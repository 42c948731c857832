from __future__ import annotations

import torch.nn.functional as F

from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op


class GemmBiasGelu(Op):
    """``out = gelu_tanh(x W^T + b)`` on the up-projection shape (M x f x d): the worked example of
    docs/writing-kernels.md. GELU in its tanh form, ``0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))``.
    """

    name = "gemm_bias_gelu"
    description = "GEMM + bias + GELU (tanh), the example of docs/writing-kernels.md"
    outputs = ("out",)

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        return {"x": mk.normal(model.tokens, model.hidden), "w": mk.weight(model.ffn, model.hidden),
                "bias": mk.normal(model.ffn, std=0.1)}

    def reference(self, inp, model, mm=None):  # no fp8 cells: mm unused
        return {"out": F.gelu(F.linear(inp["x"], inp["w"], inp["bias"]), approximate="tanh")}

    def forward_gemms(self, model):
        return [Gemm(model.tokens, model.ffn, model.hidden)]
