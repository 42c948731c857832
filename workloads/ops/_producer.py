"""The producer half shared by the four patterns: ``x = residual + a @ Wp^T``, then RMSNorm."""
from __future__ import annotations

import torch

from workloads import reference as R
from workloads.fp8 import TORCH_GEMMS, TorchGemms
from workloads.op import InputMaker


def producer_inputs(mk: InputMaker, m: int, d: int, k: int, w_name: str) -> dict[str, torch.Tensor]:
    return {"a": mk.normal(m, k), "residual": mk.normal(m, d), w_name: mk.weight(d, k), "gamma": mk.gamma(d)}


def producer(inp: dict[str, torch.Tensor], w_name: str, eps: float, mm: TorchGemms = TORCH_GEMMS
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the new residual stream x, the normalized h = rmsnorm(x; gamma) and rstd(x)."""
    x = inp["residual"] + mm.linear(inp["a"], inp[w_name])
    return x, R.rmsnorm(x, inp["gamma"], eps), R.rstd(x, eps)
