"""The op catalogue: one module per op (or per family of shapes), each with its math, reference and GEMM list."""
from __future__ import annotations

from workloads.op import Op
from workloads.ops.block import Block
from workloads.ops.gemm import GEMM_OPS
from workloads.ops.gemm_bias_gelu import GemmBiasGelu
from workloads.ops.gemm_ce import GemmCrossEntropy, GemmCrossEntropyGrad
from workloads.ops.gemm_rope import GemmRoPE
from workloads.ops.gemm_swiglu import GemmSwiGLU, GemmSwiGLUSave
from workloads.ops.lm_head_ce import LMHeadCrossEntropy
from workloads.ops.lm_head_wgrad import LMHeadWgrad
from workloads.ops.norm_input import NormInput
from workloads.ops.producer import ProducerDown, ProducerOut
from workloads.ops.rmsnorm_ce import RMSNormCrossEntropy
from workloads.ops.rmsnorm_dgrad import RMSNormDgrad, RMSNormDgradLM, RMSNormDgradQKV
from workloads.ops.rmsnorm_linear import RMSNormLinear
from workloads.ops.rmsnorm_rope import RMSNormRoPE
from workloads.ops.rmsnorm_swiglu import RMSNormSwiGLU
from workloads.ops.rope_bwd import RoPEBwd
from workloads.ops.scaled_linear import ScaledLinear
from workloads.ops.swiglu_bwd import SwiGLUBwd
from workloads.ops.swiglu_dgrad import SwiGLUDgrad
from workloads.ops.train_step import TrainStep

OPS: dict[str, Op] = {cls.name: cls() for cls in [
    RMSNormLinear, RMSNormSwiGLU, RMSNormRoPE, RMSNormCrossEntropy, LMHeadCrossEntropy,
    RMSNormDgrad, SwiGLUDgrad, Block, *GEMM_OPS, GemmBiasGelu,
    # the kernel level (Op.level): each CODA kernel's host call alone, forward then backward
    ProducerOut, ProducerDown, ScaledLinear, GemmSwiGLU, GemmSwiGLUSave, GemmRoPE, GemmCrossEntropy,
    GemmCrossEntropyGrad, NormInput, RMSNormDgradQKV, RMSNormDgradLM, SwiGLUBwd, RoPEBwd, LMHeadWgrad,
    TrainStep]}


def get_op(name: str) -> Op:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}; known: {', '.join(OPS)}")
    return OPS[name]
