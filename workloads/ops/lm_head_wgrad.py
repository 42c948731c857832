from __future__ import annotations

import torch

from workloads import reference as R
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op


class LMHeadWgrad(Op):
    """The LM head's weight gradient with the loss scale in the epilogue (``matmul(dz^T, y, scale=s)``)::

        dW = s dz^T y        [V, d]

    dz [M, V] the logit gradient (``softmax - onehot``, unscaled), y [M, d] the normalized input of the LM head,
    ``s = scale`` the loss scale (1/M, a device tensor).
    """

    name = "lm_head_wgrad"
    kind = "direct"
    modes = ("bwd",)
    level = "kernel"
    description = "LM-head weight-gradient GEMM x loss scale"
    outputs = ("dw",)

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        m = model.tokens
        return {"dz": mk.normal(m, model.vocab), "y": mk.normal(m, model.hidden),
                "scale": torch.full((1,), 1.0 / m, device=mk.device)}

    def reference(self, inp, model, mm=None):  # no fp8 cells: mm unused
        return {"dw": (R.upcast(inp["dz"].T @ inp["y"]) * inp["scale"]).to(inp["dz"].dtype)}

    def forward_gemms(self, model):
        """The wgrad of the LM head's forward GEMM (M x V x d): dz^T (dz stored [M, V]) times y (stored [M, d])."""
        return [Gemm(model.tokens, model.vocab, model.hidden).backward()[1]]
