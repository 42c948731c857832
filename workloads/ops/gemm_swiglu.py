from __future__ import annotations

from typing import ClassVar

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker
from workloads.ops._consumer import ConsumerOp, consumer_inputs, scaled_gemm


class GemmSwiGLU(ConsumerOp):
    """The gate/up consumer kernel alone (``gemm_swiglu``): row-scaled GEMM + SwiGLU epilogue::

        gate = rstd[:, None] * (h Wg^T);   up = rstd[:, None] * (h Wu^T);   y = silu(gate) up

    (h = x * gamma, rstd of x). :class:`GemmSwiGLUSave` also writes the pre-activations gate and up, which the
    backward needs (training); this one writes y only (inference).
    """

    name = "gemm_swiglu"
    kind = "direct"
    modes = ("fwd",)
    level = "kernel"
    description = "gate/up GEMM + RMSNorm row scale + SwiGLU (the consumer kernel)"
    outputs = ("y",)
    fp8_operands = {"h": "act", "w_gate": "weight", "w_up": "weight"}
    save_preact: ClassVar[bool] = False

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        d, f = model.hidden, model.ffn
        return {**consumer_inputs(mk, model), "w_gate": mk.weight(f, d), "w_up": mk.weight(f, d)}

    def reference(self, inp, model, mm=TORCH_GEMMS):
        gate, dt = scaled_gemm(inp["h"], inp["w_gate"], inp["rstd"], mm)
        up, _ = scaled_gemm(inp["h"], inp["w_up"], inp["rstd"], mm)
        out = {"y": R.swiglu(gate, up).to(dt)}
        if self.save_preact:
            out.update(gate=gate.to(dt), up=up.to(dt))
        return out

    def forward_gemms(self, model):
        return [Gemm(model.tokens, 2 * model.ffn, model.hidden)]


class GemmSwiGLUSave(GemmSwiGLU):
    name = "gemm_swiglu_save"
    description = "gate/up GEMM + RMSNorm row scale + SwiGLU, pre-activations saved (training)"
    outputs = ("y", "gate", "up")
    save_preact = True
