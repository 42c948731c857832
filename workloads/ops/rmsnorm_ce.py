from __future__ import annotations

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op
from workloads.ops._producer import producer, producer_inputs


class RMSNormCrossEntropy(Op):
    """Pattern (d): ``x = residual + a Wd^T``; ``loss = CE(rmsnorm(x; g) Wlm^T, target)`` (mean, ignore -100)."""

    name = "rmsnorm_ce"
    description = "down-proj + residual + final RMSNorm + LM head + cross-entropy"
    outputs = ("x", "loss")
    side_outputs = ("rstd", "lse")
    consts = ("target",)
    fp8_operands = {"a": "act", "w_down": "weight", "w_lm": "weight"}
    halved = ("w_lm",)

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        inp = producer_inputs(mk, model.tokens, model.hidden, model.ffn, "w_down")
        inp["w_lm"] = mk.weight(model.vocab, model.hidden)
        inp["target"] = mk.targets(model.tokens, model.vocab)
        return inp

    def reference(self, inp, model, mm=TORCH_GEMMS):
        x, h, r = producer(inp, "w_down", model.eps, mm)
        logits = mm.linear(h, inp["w_lm"])
        return {"x": x, "loss": R.cross_entropy(logits, inp["target"]), "rstd": r, "lse": R.logsumexp(logits)}

    def forward_gemms(self, model):
        m = model.tokens
        return [Gemm(m, model.hidden, model.ffn), Gemm(m, model.vocab, model.hidden)]
