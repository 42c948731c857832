from __future__ import annotations

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op
from workloads.ops._producer import producer, producer_inputs


class RMSNormRoPE(Op):
    """Pattern (c): ``x = residual + a Wd^T``; ``qkv = rope(rmsnorm(x; g) Wqkv^T)`` (RoPE on q and k, half-split)."""

    name = "rmsnorm_rope"
    description = "down-proj + residual + RMSNorm + QKV GEMM + RoPE"
    outputs = ("x", "qkv")
    side_outputs = ("rstd",)
    consts = ("positions",)
    fp8_operands = {"a": "act", "w_down": "weight", "w_qkv": "weight"}

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        inp = producer_inputs(mk, model.tokens, model.hidden, model.ffn, "w_down")
        inp["w_qkv"] = mk.weight(model.qkv_width, model.hidden)
        inp["positions"] = mk.positions(model.tokens, model.seq_len)
        return inp

    def reference(self, inp, model, mm=TORCH_GEMMS):
        x, h, r = producer(inp, "w_down", model.eps, mm)
        qkv = R.qkv_rope(mm.linear(h, inp["w_qkv"]), inp["positions"], model.heads, model.kv_heads,
                         model.head_dim, model.rope_theta)
        return {"x": x, "qkv": qkv, "rstd": r}

    def forward_gemms(self, model):
        m = model.tokens
        return [Gemm(m, model.hidden, model.ffn), Gemm(m, model.qkv_width, model.hidden)]
