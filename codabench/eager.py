"""The harness's own PyTorch reference: each op's unfused composition, eager (``torch-eager``) and under
torch.compile (``torch-compile``).

These two are part of what a cell's figures mean, so the harness defines and registers them itself (discovery
adds them before any plugin, :func:`register`): torch-eager's error is "PyTorch's error" of the pass rule
(:mod:`codabench.correctness`) and its results are what the checks of a timed cell compare against
(:mod:`codabench.verify`); torch-compile's median is the reference of every speedup (:mod:`codabench.stats`).

``torch-eager`` is exactly ``op.reference`` (F.linear, F.rms_norm, silu * up, half-split RoPE, F.cross_entropy)
run in the cell's dtype. ``torch-compile`` is the same function under ``torch.compile(fullgraph=True,
dynamic=False)``, compiled during warm-up (outside the timed region), after ``torch._dynamo.reset()``.

fp8 cells (``fp8`` per-tensor, ``fp8-row`` rowwise): ``prepare`` quantizes the op's GEMM operands under the
cell's recipe (untimed, :meth:`Case.quantize`); ``run`` is the same composition with every GEMM a
``torch._scaled_mm`` (:attr:`Case.mm`), which quantizes the intermediate activations (the normalized ``h``, the
SwiGLU output ...) inside the timed region, as an fp8 pipeline must. Inductor compiles ``_scaled_mm`` and the
bit arithmetic of the pow2 scales on the CPU as well (torch 2.13), so torch-compile runs fp8 cells everywhere
that ``_scaled_mm`` runs.
"""
from __future__ import annotations

import dataclasses

import torch

from codabench import guard
from codabench.case import Case
from codabench.registry import Implementation, Native, Registry, Tensors
from workloads import fp8
from workloads.ops import OPS, Op

COMPILE_MODE = "default"


class TorchEager(Implementation):
    name = "torch-eager"
    label = "baseline"
    dtypes = ("fp32", "fp16", "bf16", *fp8.FP8_DTYPES)
    description = "unfused PyTorch composition, cuBLAS GEMMs (fp8: torch._scaled_mm), eager"

    def __init__(self, op: Op):
        self.op, self.op_def, self.modes = op.name, op, op.modes
        self.source = __name__

    def skip_reason(self, case: Case) -> str | None:
        return super().skip_reason(case) or case.mm_skip_reason()

    def prepare(self, case: Case) -> Tensors:
        return case.quantize(dict(case.inputs))

    def run(self, native: Native) -> Tensors:
        return self.op_def.reference(native, native.model, native.mm)

    def metadata(self):
        return {"torch": torch.__version__}


class TorchCompile(TorchEager):
    name = "torch-compile"
    description = f"unfused PyTorch composition under torch.compile (mode={COMPILE_MODE}, fullgraph)"

    _key: tuple | None = None  # the (op, model, dtype, recipe) compiled last, by any instance

    def prepare(self, case: Case) -> Tensors:
        """Compile once per (op, model, dtype, fp8 recipe): the correctness and timing passes and the modes of
        one configuration share the compiled function (new shapes or grad modes add graphs to it); a new
        configuration starts from ``torch._dynamo.reset()``."""
        key = (self.op, dataclasses.replace(case.model, tokens=0), case.dtype, case.recipe)
        if TorchCompile._key != key:
            torch._dynamo.reset()
            torch._functorch.config.donated_buffer = False
            op, model, mm = self.op_def, case.model, case.mm
            graph = lambda inp: op.reference(inp, model, mm)  # noqa: E731
            guard.watch_compiled(graph.__code__)  # the sweeps see a call that drops its graphs
            self._compiled = torch.compile(graph, fullgraph=True, dynamic=False,
                                           mode=None if COMPILE_MODE == "default" else COMPILE_MODE)
            TorchCompile._key = key
        return case.quantize(dict(case.inputs))

    def run(self, native: Native) -> Tensors:
        return self._compiled(dict(native))  # a plain dict: what the graph was traced on, without the context

    def metadata(self):
        return {"torch": torch.__version__, "compile_mode": COMPILE_MODE}


def register(registry: Registry) -> None:
    """torch-eager and torch-compile for every op of the catalogue that does not have them yet: discovery calls it
    before any plugin and again after the plugins, for the ops a plugin added to the catalogue."""
    for op in OPS.values():
        for cls in (TorchEager, TorchCompile):
            if (op.name, cls.name) not in registry.impls:
                registry.add(cls(op))
