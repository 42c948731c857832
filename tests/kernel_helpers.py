"""Shared helpers of the CODA kernel tests: seeded inputs, the suite's pass rule on one output, a launch counter."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from codabench.metrics import passes, rel_err
from kernels.coda.reduce import rstd_kernel

DTYPES = [torch.float32, torch.float16]


def rand(*shape: int, dtype=torch.float32, seed: int = 0, scale: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + mean).to(dtype)


def check(name: str, out: torch.Tensor, ref: torch.Tensor, torch_out: torch.Tensor) -> None:
    """``out`` passes the suite's rule (:func:`codabench.metrics.passes`) against the fp64 ``ref``, PyTorch's error
    being that of ``torch_out``; same shape and dtype as torch_out."""
    assert out.shape == ref.shape and out.dtype == torch_out.dtype, (name, out.shape, out.dtype, torch_out.dtype)
    ours, theirs = rel_err(out, ref), rel_err(torch_out, ref)
    assert passes(ours, theirs, torch_out.dtype), f"{name}: {ours:.2e} vs torch {theirs:.2e}"


@contextmanager
def launches() -> Iterator[list[str]]:
    """Names of the Triton kernels launched inside the block (in the interpreter: real launches, no tuning)."""
    names: list[str] = []
    cls = type(rstd_kernel)
    orig = cls.run

    def run(self, *args, **kwargs):
        names.append(self.__name__)
        return orig(self, *args, **kwargs)

    cls.run = run
    try:
        yield names
    finally:
        cls.run = orig
