from __future__ import annotations

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker
from workloads.ops._consumer import ConsumerOp, consumer_inputs, scaled_gemm


class GemmRoPE(ConsumerOp):
    """The QKV consumer kernel alone (``gemm_rope``): row-scaled GEMM + RoPE epilogue::

        qkv = rope(rstd[:, None] * (h Wqkv^T))      (RoPE on the q and k heads, half-split pairs; v unrotated)

    at each row's position (h = x * gamma, rstd of x).
    """

    name = "gemm_rope"
    kind = "direct"
    modes = ("fwd",)
    level = "kernel"
    description = "QKV GEMM + RMSNorm row scale + RoPE (the consumer kernel)"
    outputs = ("qkv",)
    fp8_operands = {"h": "act", "w_qkv": "weight"}

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        return {**consumer_inputs(mk, model), "w_qkv": mk.weight(model.qkv_width, model.hidden),
                "positions": mk.positions(model.tokens, model.seq_len)}

    def reference(self, inp, model, mm=TORCH_GEMMS):
        z, dt = scaled_gemm(inp["h"], inp["w_qkv"], inp["rstd"], mm)
        qkv = R.qkv_rope(z, inp["positions"], model.heads, model.kv_heads, model.head_dim, model.rope_theta)
        return {"qkv": qkv.to(dt)}

    def forward_gemms(self, model):
        return [Gemm(model.tokens, model.qkv_width, model.hidden)]
