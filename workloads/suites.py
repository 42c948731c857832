"""Named suites: which slice of the (op x model x mode x dtype x implementation) matrix to run.

``ops`` of None means every op of the catalogue (of the suite's ``level``, where it has one), as the catalogue holds
when a run is planned: an op a plugin adds to ``workloads.ops.OPS`` is among them. ``impls`` of None means every
registered implementation.
Command-line flags (``--ops``, ``--models``, ``--tokens``...) narrow or override a suite.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from workloads.op import MODES
from workloads.ops import OPS

PATTERN = "pattern"
"""The level of the ops of the quick and full suites (``Op.level``): the fused patterns of the block, its direct
backward ops and plain GEMMs; neither the kernel-level ops (the kernels suite) nor the whole-model steps (train)."""
KERNEL_SUITE_OPS = ("producer_out", "producer_down", "scaled_linear", "gemm_swiglu", "gemm_swiglu_save", "gemm_rope",
                    "gemm_ce", "gemm_ce_grad", "norm_input", "rmsnorm_dgrad", "rmsnorm_dgrad_qkv", "rmsnorm_dgrad_lm",
                    "swiglu_dgrad", "swiglu_bwd", "rope_bwd", "lm_head_wgrad")
"""The ops of the kernels suite, forward then backward: every kernel-level op, and the two pattern-level direct
backward ops that are one CODA kernel each (``rmsnorm_dgrad``: the gate/up dgrad + RMSNorm backward, ``swiglu_dgrad``:
the down-proj dgrad + SwiGLU backward)."""


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    models: tuple[str, ...]
    modes: tuple[str, ...]
    dtypes: tuple[str, ...]
    ops: tuple[str, ...] | None = None
    level: str | None = None
    """With ``ops`` None, the ``Op.level`` of the suite's ops (None: every level)."""
    impls: tuple[str, ...] | None = None
    needs_gpu: bool = True
    impl_modes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per-implementation restriction of the modes of autograd ops (direct ops have one mode; no modes: the
    implementation is left out of the suite); the cells left out become ``skipped`` rows that say why."""
    check_tokens: int | None = None
    """Default of ``--check-tokens``: tokens of the correctness pass (None: the timing shape's)."""
    reps: int | None = None
    """Default of ``--reps``: samples per cell (None: adaptive)."""

    def op_names(self) -> tuple[str, ...]:
        """The suite's ops: ``ops``, else those of the catalogue now (the plugins' included) of its ``level``."""
        if self.ops is not None:
            return self.ops
        return tuple(name for name, op in OPS.items() if self.level is None or op.level == self.level)


SUITES: dict[str, Suite] = {s.name: s for s in [
    # torch.compile on the CPU costs about 20 s once (inductor's compiler probes) plus 2-5 s per graph
    # on 2 cores, cold: compiling every (op, mode) alone took ~80 s. fwd_bwd compiles the forward and
    # backward graphs together, so the smoke suite compiles each autograd op once, in fwd_bwd. The training step's
    # LoRA variants are left out (hf-coda-lora: 48 s of interpreted CODA steps; tests/test_train_step.py runs it).
    Suite("smoke", "model tiny, every op, mode and implementation, fp32; runs on the CPU (Triton interpreter)",
          models=("tiny",), modes=MODES, dtypes=("fp32",), needs_gpu=False,
          impl_modes={"torch-compile": ("fwd_bwd",), "hf-coda-lora": (), "hf-liger-lora": ()}),
    Suite("quick", "llama-7b, bf16, every pattern op, mode and implementation (GPU)",
          models=("llama-7b",), modes=MODES, dtypes=("bf16",), level=PATTERN),
    # 513 cells. The correctness pass runs at 2048 tokens (the pass rule compares with PyTorch's own error on
    # the same inputs) and each cell takes 20 samples, so that a warm run fits in 10 minutes on one GPU.
    Suite("full", "llama-1b/7b/70b x fwd/bwd/fwd_bwd x bf16/fp8 x every implementation (GPU)",
          models=("llama-1b", "llama-7b", "llama-70b"), modes=MODES, dtypes=("bf16", "fp8"), level=PATTERN,
          check_tokens=2048),
    # Each CODA kernel alone against the plain cuBLAS GEMM of its shape (sol_ratio) and the unfused PyTorch math,
    # eager and compiled: 16 ops x 3 models x 3 implementations = 144 cells, all direct (one mode each). As in full,
    # the correctness pass runs at 2048 tokens (the float64 reference of the LM-head ops at M = 16384 and V = 32768
    # would take 4 GiB per [M, V] tensor; the timed buffers are still compared with PyTorch's results at the timed
    # shape) and each cell takes 21 samples (7 in each of the 3 rounds), enough for the intervals of the speedups.
    Suite("kernels", "each CODA kernel alone vs its plain GEMM and the unfused PyTorch math: llama-1b/7b/70b, bf16, "
          "coda-triton, torch-eager, torch-compile (GPU)",
          models=("llama-1b", "llama-7b", "llama-70b"), modes=MODES, dtypes=("bf16",), ops=KERNEL_SUITE_OPS,
          impls=("torch-eager", "torch-compile", "coda-triton"), check_tokens=2048),
    # The training step of issue 19: 4 layers (ModelShape.layers) of Llama-3.2-1B with its 128256-token vocabulary,
    # 2 x 8192 tokens, bf16; every implementation of train_step (hf-eager, hf-compile, hf-liger, hf-coda and the
    # op's own torch-eager / torch-compile). The float64 reference runs at 1024 tokens (the 1B model in float64, its
    # gradients and a 1024 x 128256 logit matrix: about 14 GB).
    Suite("train", "one training step (forward + backward) of a 4-layer llama3-1b, 2 x 8192 tokens, bf16: Hugging "
          "Face eager, + torch.compile, + Liger, + CODA (GPU)",
          models=("llama3-1b",), modes=("fwd_bwd",), dtypes=("bf16",), ops=("train_step",), check_tokens=1024),
]}


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    return SUITES[name]
