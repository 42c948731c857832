"""The launch contract of a CODA kernel: the mainloop's block of parameters first, then the epilogue's.

Every fused kernel starts with the same 17 parameters, in this order (:data:`MAINLOOP_PARAMS`)::

    @coda_autotune()
    @triton.jit
    def my_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                  PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  out_ptr, stride_out):              # the epilogue's own parameters
        a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
        ...

for ``C[M, N] = A @ B`` (:mod:`kernels.coda.mainloop`): the operands' storage and row strides, their fp8
dequantization scales and mode (``SCALING``, :func:`kernels.coda.epilogue.dequant`), the fp8 accumulation mode
(``PROMOTE``), the operand layouts (``A_KM``, ``B_KN``) and the tile config the autotuner picks (BM, BN, BK,
GROUP_M). :class:`FusedGemm` fills that block from the two operands and launches any such kernel on the
persistent grid, with the epilogue's arguments by keyword::

    gemm = FusedGemm(x, w.T)                  # x (M, K), w (N, K): C = x @ w^T; fp8 operands are Fp8
    out = gemm.empty()
    gemm.launch(my_kernel, out_ptr=out, stride_out=out.stride(0))

The block is passed by position (the autotuner's pruning reads M, N and A's element size from there), the
epilogue by name; the autotuning key is (the kernel's ``key`` values, then the dtype of every tensor argument).
A kernel declared as its epilogue (:mod:`kernels.coda.program`) is built with this contract and launched this way.
"""
from __future__ import annotations

from typing import Any

import torch
from triton.runtime.autotuner import Autotuner

from kernels.coda.align import aligned, empty_rows
from kernels.coda.fp8 import dequant_args, result_dtype, scalar_args
from kernels.coda.mainloop import operand, persistent_grid
from workloads.fp8 import Fp8, Recipe, promoted

MAINLOOP_PARAMS = ("a_ptr", "b_ptr", "sa_ptr", "sb_ptr", "M", "N", "K", "stride_a", "stride_b", "SCALING",
                   "PROMOTE", "A_KM", "B_KN", "BM", "BN", "BK", "GROUP_M")
"""The leading parameters of every fused kernel, in order."""


class FusedGemm:
    """``C[M, N] = A @ B`` set up for a CODA kernel: the values of its mainloop block.

    ``a`` (M, K) and ``b`` (K, N) are each row-major or the transposed view of a row-major tensor (an
    nn.Linear weight W (N, K) is passed as ``W.T``), both plain or both fp8 (:class:`workloads.fp8.Fp8`,
    scales per tensor or per row of A and per column of C, dequantized in the epilogue; ``recipe``: the fp8
    recipe they were quantized under, whose accumulation mode the launch passes as ``PROMOTE``). ``scale``: an
    optional fp32 one-element device tensor multiplying plain operands (a loss scale), applied by the epilogue's
    dequantization. ``M``, ``N``, ``K``, ``device`` and ``out_dtype``
    (the operands' dtype, bf16 for fp8 operands) size the epilogue's outputs. Any sizes: an operand whose stored rows
    are off the 16-byte rule is copied into the row layout, and :meth:`empty` allocates in it
    (:mod:`kernels.coda.align`).
    """

    def __init__(self, a: torch.Tensor | Fp8, b: torch.Tensor | Fp8, recipe: Recipe | None = None,
                 scale: torch.Tensor | None = None) -> None:
        a, b, self.sa, self.sb, self.scaling = dequant_args(a, b)
        if scale is not None:
            if self.scaling:
                raise ValueError("scale multiplies plain operands; fp8 operands carry their own scales")
            self.sa, self.sb, self.scaling = scalar_args(scale, a.device)
        (self.M, self.K), (k, self.N) = a.shape, b.shape
        if k != self.K:
            raise ValueError(f"shape mismatch: a {tuple(a.shape)} @ b {tuple(b.shape)}")
        (a, self.a_km), (b, b_t) = operand(a), operand(b)
        self.a, self.b = aligned(a), aligned(b)
        self.b_kn = not b_t  # b (K, N) row-major: B stored (K, N); b = W.T: W stored (N, K)
        self.recipe = recipe
        self.device = a.device
        self.out_dtype = result_dtype(a)

    def empty(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised (M, N) output in ``dtype`` (default: :attr:`out_dtype`), in the row layout
        (:func:`kernels.coda.align.empty_rows`)."""
        return empty_rows(self.M, self.N, dtype or self.out_dtype, self.device)

    def launch(self, kernel: Autotuner, **epilogue: Any) -> None:
        """Launch ``kernel`` (its parameters: :data:`MAINLOOP_PARAMS`, then the epilogue's, given by keyword) on
        the persistent grid: one program per SM, each striding over the tiles of C."""
        if tuple(kernel.arg_names[:len(MAINLOOP_PARAMS)]) != MAINLOOP_PARAMS:
            raise TypeError(f"{kernel.base_fn.__name__} does not start with the mainloop block {MAINLOOP_PARAMS}")
        kernel[persistent_grid(self.M, self.N, self.device)](
            self.a, self.b, self.sa, self.sb, self.M, self.N, self.K, self.a.stride(0), self.b.stride(0),
            self.scaling, promoted(self.recipe), self.a_km, self.b_kn, **epilogue)
