from __future__ import annotations

from typing import Callable, ClassVar

import torch

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op


class RMSNormDgrad(Op):
    """Kernel-level backward: the gate/up dgrad GEMM plus RMSNorm backward.

    With ``y = g * x * r`` and ``z = y W^T`` (W: the consumer's weight, N' rows), given ``dz``::

        gy = s dz W;  xhat = x r;  c_m = (1/d) sum_j gy_mj g_j xhat_mj
        dx = dres + r (gy g - xhat c);   dgamma = sum_m gy xhat;   y = xhat g (side output, for dW)

    ``s`` is 1 here and ``dres`` the incoming residual gradient; :class:`RMSNormDgradLM` scales by the loss scale
    instead and has no ``dres``. ``rstd`` and ``zdz = <z, dz>`` (unscaled; ``s zdz / d = c`` by the ZdZ identity) are
    given as saved statistics, exact in fp32; the unfused reference recomputes both from ``x`` and ``gy`` in fp32.
    """

    name = "rmsnorm_dgrad"
    kind = "direct"
    modes = ("bwd",)
    description = "gate/up dgrad GEMM + RMSNorm backward (+ residual grad)"
    outputs = ("dx", "dgamma")
    side_outputs = ("y",)
    consts = ("rstd", "zdz")
    fp8_operands = {"dz": "grad", "w": "weight_bwd"}
    width: ClassVar[Callable[[ModelShape], int]] = staticmethod(lambda m: 2 * m.ffn)
    """N' of the consumer GEMM whose dgrad this is."""
    loss_scaled: ClassVar[bool] = False
    """dz comes from the cross-entropy: ``s`` is the loss scale (an input, ``scale``: 1/M) and there is no dres."""

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        m, d, n = model.tokens, model.hidden, self.width(model)
        inp = {"dz": mk.normal(m, n), "w": mk.weight(n, d), "x": mk.normal(m, d), "gamma": mk.gamma(d)}
        if self.loss_scaled:
            inp["scale"] = torch.full((1,), 1.0 / m, device=mk.device)
        else:
            inp["dres"] = mk.normal(m, d)
        return self.derived_inputs(inp, model)

    def derived_inputs(self, inp, model):
        """The saved statistics ``rstd`` and ``zdz`` of the given x, gamma, W and dz, in float64 then fp32
        (``zdz = <y W^T, dz> = <y, dz W>``, the cheaper side of the identity)."""
        x64 = inp["x"].double()
        r = R.rstd(x64, model.eps)
        y = x64 * r[:, None] * inp["gamma"].double()
        zdz = (y * (inp["dz"].double() @ inp["w"].double())).sum(-1)
        return {**inp, "rstd": r.float(), "zdz": zdz.float()}

    def reference(self, inp, model, mm=TORCH_GEMMS):
        gy = R.upcast(mm.dgrad(inp["dz"], inp["w"]))
        if self.loss_scaled:
            gy = gy * inp["scale"]
        x, g = R.upcast(inp["x"]), R.upcast(inp["gamma"])
        r = R.rstd(x, model.eps)[:, None]
        xhat = x * r
        c = (gy * g * xhat).mean(-1, keepdim=True)
        dt = inp["x"].dtype
        dx = r * (gy * g - xhat * c)
        if not self.loss_scaled:
            dx = R.upcast(inp["dres"]) + dx
        return {"dx": dx.to(dt), "dgamma": (gy * xhat).sum(0).to(dt), "y": (xhat * g).to(dt)}

    def forward_gemms(self, model):
        return [Gemm(model.tokens, model.hidden, self.width(model), "mk", "kn")]


class RMSNormDgradQKV(RMSNormDgrad):
    """:class:`RMSNormDgrad` at the QKV projection's shape (N' = (H + 2 Hkv) dh): the attention norm's backward."""

    name = "rmsnorm_dgrad_qkv"
    level = "kernel"
    description = "QKV dgrad GEMM + RMSNorm backward (+ residual grad)"
    width = staticmethod(lambda m: m.qkv_width)


class RMSNormDgradLM(RMSNormDgrad):
    """:class:`RMSNormDgrad` at the LM head's shape (N' = V): the final norm's backward, where dz is the
    cross-entropy's logit gradient times the loss scale ``s = scale`` (1/M, a device tensor) and no residual
    gradient comes in."""

    name = "rmsnorm_dgrad_lm"
    level = "kernel"
    description = "LM-head dgrad GEMM x loss scale + final RMSNorm backward"
    width = staticmethod(lambda m: m.vocab)
    loss_scaled = True
