"""The consumer side of the patterns as the CODA kernels split it: the producer hands on ``h = x * gamma`` and
``rstd`` of the residual stream x, and the consumer GEMM applies rstd per row, ``z = rstd[:, None] * (h W^T)``
(so ``z = rmsnorm(x; gamma) W^T``)."""
from __future__ import annotations

import torch

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS, TorchGemms
from workloads.models import ModelShape
from workloads.op import InputMaker, Op


def consumer_inputs(mk: InputMaker, model: ModelShape) -> dict[str, torch.Tensor]:
    """``h = x * gamma`` (in the cell's dtype) and ``rstd`` (fp32) of a random residual stream x [M, d]."""
    x = mk.normal(model.tokens, model.hidden)
    return {"h": x * mk.gamma(model.hidden), "rstd": R.rstd(x, model.eps)}


class ConsumerOp(Op):
    """An op whose inputs include :func:`consumer_inputs`' pair (``h``, ``rstd``)."""

    halved = ("rstd",)


def scaled_gemm(h: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, mm: TorchGemms = TORCH_GEMMS
                ) -> tuple[torch.Tensor, torch.dtype]:
    """``rstd[:, None] * (h W^T)``: the GEMM in the cell's dtype (``mm``), the row scale in fp32 (fp64 for the
    reference); and the dtype of the GEMM's output, the one the op's outputs take (bf16 for fp8 operands)."""
    z = mm.linear(h, w)
    return R.upcast(z) * rstd[:, None], z.dtype
