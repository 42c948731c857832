"""Plain GEMMs of the block, one op per shape: the speed-of-light of the fused kernels."""
from __future__ import annotations

from typing import Callable

from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op

# op name -> (N, K) as functions of the model
GEMM_SHAPES: dict[str, Callable[[ModelShape], tuple[int, int]]] = {
    "gemm_qkv": lambda s: (s.qkv_width, s.hidden),
    "gemm_out": lambda s: (s.hidden, s.attn_width),
    "gemm_gate_up": lambda s: (2 * s.ffn, s.hidden),
    "gemm_down": lambda s: (s.hidden, s.ffn),
    "gemm_lm_head": lambda s: (s.vocab, s.hidden),
}


class PlainGemm(Op):
    """``out = x W^T`` with x (M, K) and W (N, K), nn.Linear layout."""

    kind = "direct"
    modes = ("fwd",)
    outputs = ("out",)
    fp8_operands = {"x": "act", "w": "weight"}
    shape: Callable[[ModelShape], tuple[int, int]]

    def make_inputs(self, model, dtype, device, seed):
        n, k = self.shape(model)
        mk = InputMaker(dtype, device, seed)
        return {"x": mk.normal(model.tokens, k), "w": mk.weight(n, k)}

    def reference(self, inp, model, mm=TORCH_GEMMS):
        return {"out": mm.linear(inp["x"], inp["w"])}

    def forward_gemms(self, model):
        n, k = self.shape(model)
        return [Gemm(model.tokens, n, k)]


def _gemm_op(name: str, shape) -> type[PlainGemm]:
    return type(f"Gemm_{name}", (PlainGemm,), {"name": name, "shape": staticmethod(shape),
                                                 "description": f"plain GEMM, {name[5:]} shape"})


GEMM_OPS = [_gemm_op(n, s) for n, s in GEMM_SHAPES.items()]
