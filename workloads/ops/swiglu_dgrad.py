from __future__ import annotations

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op


class SwiGLUDgrad(Op):
    """Kernel-level backward: the down-proj dgrad GEMM plus SwiGLU backward and ZdZ.

    Given ``dx`` (gradient of the down-proj output) and the saved pre-activations ``gate, up``::

        da = dx Wd;   dgate = da up silu'(gate);   dup = da silu(gate)
        a = silu(gate) up (side output, for dWd);   zdz = sum_i gate_i dgate_i + up_i dup_i (side output)
    """

    name = "swiglu_dgrad"
    kind = "direct"
    modes = ("bwd",)
    description = "down-proj dgrad GEMM + SwiGLU backward + ZdZ"
    outputs = ("dgate", "dup")
    side_outputs = ("a", "zdz")
    fp8_operands = {"dx": "grad", "w_down": "weight_bwd"}

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        m, d, f = model.tokens, model.hidden, model.ffn
        return {"dx": mk.normal(m, d), "w_down": mk.weight(d, f), "gate": mk.normal(m, f), "up": mk.normal(m, f)}

    def reference(self, inp, model, mm=TORCH_GEMMS):
        dt = inp["gate"].dtype
        da = R.upcast(mm.dgrad(inp["dx"], inp["w_down"]))
        g, u = R.upcast(inp["gate"]), R.upcast(inp["up"])
        dgate, dup = R.swiglu_backward(da, g, u)
        zdz = (g * dgate + u * dup).sum(-1)
        return {"dgate": dgate.to(dt), "dup": dup.to(dt), "a": R.swiglu(g, u).to(dt), "zdz": zdz}

    def forward_gemms(self, model):
        return [Gemm(model.tokens, model.ffn, model.hidden, "mk", "kn")]
