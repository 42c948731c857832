"""The op catalogue: one module per op, each with its math, reference and GEMM list."""
from __future__ import annotations

from workloads.op import Op
from workloads.ops.block import Block
from workloads.ops.gemm import GEMM_OPS
from workloads.ops.gemm_bias_gelu import GemmBiasGelu
from workloads.ops.lm_head_ce import LMHeadCrossEntropy
from workloads.ops.rmsnorm_ce import RMSNormCrossEntropy
from workloads.ops.rmsnorm_dgrad import RMSNormDgrad
from workloads.ops.rmsnorm_linear import RMSNormLinear
from workloads.ops.rmsnorm_rope import RMSNormRoPE
from workloads.ops.rmsnorm_swiglu import RMSNormSwiGLU
from workloads.ops.swiglu_dgrad import SwiGLUDgrad
from workloads.ops.train_step import TrainStep

OPS: dict[str, Op] = {cls.name: cls() for cls in [
    RMSNormLinear, RMSNormSwiGLU, RMSNormRoPE, RMSNormCrossEntropy, LMHeadCrossEntropy,
    RMSNormDgrad, SwiGLUDgrad, Block, *GEMM_OPS, GemmBiasGelu, TrainStep]}


def get_op(name: str) -> Op:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}; known: {', '.join(OPS)}")
    return OPS[name]
