from __future__ import annotations

import torch.nn.functional as F

from workloads import reference as R
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

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        inp = producer_inputs(mk, model.tokens, model.hidden, model.ffn, "w_down")
        inp["w_qkv"] = mk.weight(model.qkv_width, model.hidden)
        inp["positions"] = mk.positions(model.tokens, model.seq_len)
        return inp

    def reference(self, inp, model):
        x, h, r = producer(inp, "w_down", model.eps)
        qkv = R.qkv_rope(F.linear(h, inp["w_qkv"]), inp["positions"], model.heads, model.kv_heads,
                         model.head_dim, model.rope_theta)
        return {"x": x, "qkv": qkv, "rstd": r}

    def forward_gemms(self, model):
        m = model.tokens
        return [Gemm(m, model.hidden, model.ffn), Gemm(m, model.qkv_width, model.hidden)]
