from __future__ import annotations

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op


class Block(Op):
    """The CODA block boundary (attention excluded, identical for all providers)::

        x1  = residual + a Wo^T                       h1 = rmsnorm(x1; gamma_mlp)
        x   = x1 + (silu(h1 Wg^T) * h1 Wu^T) Wd^T     h2 = rmsnorm(x; gamma_attn)
        qkv = rope(h2 Wqkv^T)                         (the next layer's projections)
    """

    name = "block"
    description = "out-proj .. next QKV + RoPE (CODA block, attention excluded)"
    outputs = ("x", "qkv")
    side_outputs = ("rstd_mlp", "rstd_attn")
    consts = ("positions",)
    fp8_operands = {"a": "act", "w_o": "weight", "w_gate": "weight", "w_up": "weight", "w_down": "weight",
                    "w_qkv": "weight"}

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        m, d, f = model.tokens, model.hidden, model.ffn
        return {"a": mk.normal(m, model.attn_width), "residual": mk.normal(m, d),
                "w_o": mk.weight(d, model.attn_width), "gamma_mlp": mk.gamma(d),
                "w_gate": mk.weight(f, d), "w_up": mk.weight(f, d), "w_down": mk.weight(d, f),
                "gamma_attn": mk.gamma(d), "w_qkv": mk.weight(model.qkv_width, d),
                "positions": mk.positions(m, model.seq_len)}

    def reference(self, inp, model, mm=TORCH_GEMMS):
        eps = model.eps
        x1 = inp["residual"] + mm.linear(inp["a"], inp["w_o"])
        h1 = R.rmsnorm(x1, inp["gamma_mlp"], eps)
        y = R.swiglu(mm.linear(h1, inp["w_gate"]), mm.linear(h1, inp["w_up"]))
        x = x1 + mm.linear(y, inp["w_down"])
        h2 = R.rmsnorm(x, inp["gamma_attn"], eps)
        qkv = R.qkv_rope(mm.linear(h2, inp["w_qkv"]), inp["positions"], model.heads, model.kv_heads,
                         model.head_dim, model.rope_theta)
        return {"x": x, "qkv": qkv, "rstd_mlp": R.rstd(x1, eps), "rstd_attn": R.rstd(x, eps)}

    def forward_gemms(self, model):
        m, d, f = model.tokens, model.hidden, model.ffn
        return [Gemm(m, d, model.attn_width), Gemm(m, 2 * f, d), Gemm(m, d, f), Gemm(m, model.qkv_width, d)]
