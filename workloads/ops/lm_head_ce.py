from __future__ import annotations

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op


class LMHeadCrossEntropy(Op):
    """The last piece of a model: ``loss = CE(rmsnorm(x; g) Wlm^T, target)`` (mean, ignore -100)."""

    name = "lm_head_ce"
    description = "final RMSNorm + LM head + cross-entropy"
    outputs = ("loss",)
    side_outputs = ("rstd", "lse")
    consts = ("target",)
    fp8_operands = {"w_lm": "weight"}
    halved = ("w_lm",)

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        return {"x": mk.normal(model.tokens, model.hidden), "gamma": mk.gamma(model.hidden),
                "w_lm": mk.weight(model.vocab, model.hidden), "target": mk.targets(model.tokens, model.vocab)}

    def reference(self, inp, model, mm=TORCH_GEMMS):
        logits = mm.linear(R.rmsnorm(inp["x"], inp["gamma"], model.eps), inp["w_lm"])
        return {"loss": R.cross_entropy(logits, inp["target"]), "rstd": R.rstd(inp["x"], model.eps),
                "lse": R.logsumexp(logits)}

    def forward_gemms(self, model):
        return [Gemm(model.tokens, model.vocab, model.hidden)]
