"""cuBLAS + PyTorch baselines: the op's own unfused reference math, eager and under torch.compile.

``torch-eager`` is exactly the reference composition (F.linear, F.rms_norm, silu * up, half-split
RoPE, F.cross_entropy) run in the cell's dtype; its error is the "PyTorch error" of the pass rule.
``torch-compile`` is the same function under ``torch.compile(fullgraph=True, dynamic=False)``,
compiled during warm-up (outside the timed region), after ``torch._dynamo.reset()``.
"""
from __future__ import annotations

import dataclasses

import torch

from codabench.case import Case
from codabench.registry import REGISTRY, Implementation, Tensors
from workloads.ops import OPS, Op

COMPILE_MODE = "default"


class TorchEager(Implementation):
    name = "torch-eager"
    label = "baseline"
    dtypes = ("fp32", "fp16", "bf16")
    description = "unfused PyTorch composition, cuBLAS GEMMs, eager"

    def __init__(self, op: Op):
        self.op, self.op_def, self.modes = op.name, op, op.modes
        self.source = __name__

    def prepare(self, case: Case) -> Tensors:
        return {**case.inputs, "model": case.model}

    def run(self, native: Tensors) -> Tensors:
        return self.op_def.reference(native, native["model"])

    def metadata(self):
        return {"torch": torch.__version__}


class TorchCompile(TorchEager):
    name = "torch-compile"
    description = f"unfused PyTorch composition under torch.compile (mode={COMPILE_MODE}, fullgraph)"

    _key: tuple | None = None  # the (op, model, dtype) compiled last, by any instance

    def prepare(self, case: Case) -> Tensors:
        """Compile once per (op, model, dtype): the correctness and timing passes and the modes of one
        configuration share the compiled function (new shapes or grad modes add graphs to it); a new
        configuration starts from ``torch._dynamo.reset()``."""
        key = (self.op, dataclasses.replace(case.model, tokens=0), case.dtype)
        if TorchCompile._key != key:
            torch._dynamo.reset()
            torch._functorch.config.donated_buffer = False
            op, model = self.op_def, case.model
            self._compiled = torch.compile(lambda inp: op.reference(inp, model), fullgraph=True, dynamic=False,
                                           mode=None if COMPILE_MODE == "default" else COMPILE_MODE)
            TorchCompile._key = key
        return dict(case.inputs)

    def run(self, native: Tensors) -> Tensors:
        return self._compiled(native)

    def metadata(self):
        return {"torch": torch.__version__, "compile_mode": COMPILE_MODE}


for _op in OPS.values():
    REGISTRY.add(TorchEager(_op))
    REGISTRY.add(TorchCompile(_op))
