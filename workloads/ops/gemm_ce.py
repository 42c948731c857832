from __future__ import annotations

from typing import ClassVar

import torch

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker
from workloads.ops._consumer import ConsumerOp, consumer_inputs, scaled_gemm


class GemmCrossEntropy(ConsumerOp):
    """The LM-head consumer kernel alone (``gemm_cross_entropy``): row-scaled GEMM + log-sum-exp and target-logit
    epilogue, then the cross-entropy finish::

        logits = rstd[:, None] * (h Wlm^T);   lse_m = log sum_j exp(logits_mj)
        loss = mean over the rows m with target_m != -100 of (lse_m - logits_m,target_m)

    (h = x * gamma, rstd of x). Without gradients the logits are never written. :class:`GemmCrossEntropyGrad` also
    writes the logit gradient, unscaled, and its ZdZ::

        dlogits = softmax(logits) - onehot(target)  (zero rows where the target is ignored)
        zdz_m = sum_j logits_mj dlogits_mj
    """

    name = "gemm_ce"
    kind = "direct"
    modes = ("fwd",)
    level = "kernel"
    description = "LM-head GEMM + RMSNorm row scale + LSE / cross-entropy (the consumer kernel, logits never written)"
    outputs = ("loss", "lse")
    fp8_operands = {"h": "act", "w_lm": "weight"}
    halved = ("rstd", "w_lm")
    with_grad: ClassVar[bool] = False

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        return {**consumer_inputs(mk, model), "w_lm": mk.weight(model.vocab, model.hidden),
                "target": mk.targets(model.tokens, model.vocab)}

    def reference(self, inp, model, mm=TORCH_GEMMS):
        logits, dt = scaled_gemm(inp["h"], inp["w_lm"], inp["rstd"], mm)
        target = inp["target"]
        out = {"loss": R.cross_entropy(logits, target), "lse": R.logsumexp(logits)}
        if self.with_grad:
            valid = (target != R.IGNORE_INDEX)[:, None].to(logits.dtype)
            dlogits = torch.softmax(logits, -1).scatter_add(1, target.clamp(min=0)[:, None], -valid) * valid
            out.update(dlogits=dlogits.to(dt), zdz=(logits * dlogits).sum(-1))
        return out

    def forward_gemms(self, model):
        return [Gemm(model.tokens, model.vocab, model.hidden)]


class GemmCrossEntropyGrad(GemmCrossEntropy):
    name = "gemm_ce_grad"
    description = "LM-head GEMM + RMSNorm row scale + cross-entropy, logit gradient and ZdZ written (training)"
    outputs = ("loss", "lse", "dlogits", "zdz")
    with_grad = True
