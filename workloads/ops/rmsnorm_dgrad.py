from __future__ import annotations

import torch
import torch.nn.functional as F

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op


def _up(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


class RMSNormDgrad(Op):
    """Kernel-level backward: the gate/up dgrad GEMM plus RMSNorm backward.

    With ``y = g * x * r`` and ``z = y W^T``, given ``dz``::

        gy = dz W;  xhat = x r;  c_m = (1/d) sum_j gy_mj g_j xhat_mj
        dx = dres + r (gy g - xhat c);   dgamma = sum_m gy xhat;   y = xhat g (side output, for dW)

    ``rstd`` and ``zdz = <z, dz>`` (= d c by the ZdZ identity) are given as saved statistics, exact
    in fp32; the unfused reference recomputes both from ``x`` and ``gy`` in fp32.
    """

    name = "rmsnorm_dgrad"
    kind = "direct"
    modes = ("bwd",)
    description = "gate/up dgrad GEMM + RMSNorm backward (+ residual grad)"
    outputs = ("dx", "dgamma")
    side_outputs = ("y",)
    consts = ("rstd", "zdz")
    fp8_operands = {"dz": "grad", "w": "weight_bwd"}

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        m, d, n = model.tokens, model.hidden, 2 * model.ffn
        inp = {"dz": mk.normal(m, n), "w": mk.weight(n, d), "x": mk.normal(m, d), "gamma": mk.gamma(d),
               "dres": mk.normal(m, d)}
        return self.derived_inputs(inp, model)

    def derived_inputs(self, inp, model):
        """The saved statistics ``rstd`` and ``zdz`` of the given x, gamma, W and dz, in float64 then fp32."""
        x64 = inp["x"].double()
        r = R.rstd(x64, model.eps)
        z = F.linear(x64 * r[:, None] * inp["gamma"].double(), inp["w"].double())
        return {**inp, "rstd": r.float(), "zdz": (z * inp["dz"].double()).sum(-1).float()}

    def reference(self, inp, model, mm=TORCH_GEMMS):
        gy = _up(mm.dgrad(inp["dz"], inp["w"]))
        x, g = _up(inp["x"]), _up(inp["gamma"])
        r = R.rstd(x, model.eps)[:, None]
        xhat = x * r
        c = (gy * g * xhat).mean(-1, keepdim=True)
        dt = inp["x"].dtype
        dx = _up(inp["dres"]) + r * (gy * g - xhat * c)
        return {"dx": dx.to(dt), "dgamma": (gy * xhat).sum(0).to(dt), "y": (xhat * g).to(dt)}

    def forward_gemms(self, model):
        return [Gemm(model.tokens, model.hidden, 2 * model.ffn, "mk", "kn")]
