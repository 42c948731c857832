from __future__ import annotations

from workloads import reference as R
from workloads.models import ModelShape
from workloads.op import InputMaker, Op


class NormInput(Op):
    """The RMSNorm statistics pass of an x that no GEMM produced (``norm_input``: the first layer's input, the LM
    head's input), one pass over x::

        h = x * gamma;   rstd = (mean_j x_j^2 + eps)^(-1/2)

    No GEMM: no speed-of-light.
    """

    name = "norm_input"
    kind = "direct"
    modes = ("fwd",)
    level = "kernel"
    description = "RMSNorm statistics of an input no GEMM produced (h = x * gamma, rstd)"
    outputs = ("h", "rstd")

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        return {"x": mk.normal(model.tokens, model.hidden), "gamma": mk.gamma(model.hidden)}

    def reference(self, inp, model, mm=None):  # no GEMM: mm unused
        return {"h": inp["x"] * inp["gamma"], "rstd": R.rstd(inp["x"], model.eps)}

    def forward_gemms(self, model):
        return []
