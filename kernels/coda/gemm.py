"""Plain GEMM through the shared mainloop: ``C = A @ B``, dequantized (the speed-of-light kernel).

Operands are bf16/fp16/fp32, or both fp8 (:class:`workloads.fp8.Fp8`, per-tensor or rowwise scales,
bf16 out): ``C = (sa sb) * (qa @ qb)``. A lone fp32 scalar ``s`` on plain operands (a device tensor: a
loss scale) is the same epilogue multiply, ``C = s * (A @ B)``. Accumulating into an existing C,
``C += s * (A @ B)``, the epilogue adds the tile C holds before it stores: an fp32 C sums a GEMM split
over K (a weight gradient over chunks of rows) in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.coda.align import aligned, empty_rows, written_back
from kernels.coda.epilogue import add_tile, col_subtile, dequant, store_tile
from kernels.coda.launch import FusedGemm
from kernels.coda.mainloop import coda_autotune, mainloop, num_tiles, operand_descs, tile_coords, tile_desc
from kernels.coda.strategy import with_split
from workloads.fp8 import Fp8, Recipe


@coda_autotune(key=("M", "N", "K", "ACC"), restore_value=("c_ptr",))
@triton.jit
def gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, c_ptr, stride_c, ACC: tl.constexpr):
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    # Accumulating, the epilogue loads C's tile too: it works on 4 column sub-tiles to fit in shared memory.
    SUB: tl.constexpr = 4 if ACC else 1
    SN: tl.constexpr = BN // SUB
    c_desc = tile_desc(c_ptr, M, N, stride_c, BM, SN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN, PROMOTE)
        acc = dequant(acc, sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN, SCALING)
        for i in tl.static_range(SUB):
            c = col_subtile(acc, i, SUB, BM, BN)
            if ACC:
                c = add_tile(c, c_desc, off_m, off_n + i * SN)
            store_tile(c_desc, off_m, off_n + i * SN, c)


def matmul(a: torch.Tensor | Fp8, b: torch.Tensor | Fp8, out_dtype: torch.dtype | None = None,
           scale: torch.Tensor | None = None, recipe: Recipe | None = None, acc: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``a @ b`` for a (M, K) and b (K, N), each row-major or a transposed row-major view (fp8: a (M, K) and
    b (K, N) as the transpose of an (N, K) tensor, per-channel scales along N); ``scale``: an optional fp32
    one-element device tensor multiplying plain operands; ``recipe``: the fp8 operands' recipe (the launch reads its
    accumulation mode).

    ``acc``: a row-major (M, N) tensor to accumulate into, ``acc += a @ b`` (in acc's dtype), returned;
    otherwise a new (M, N) tensor in ``out_dtype`` (default: the operands' dtype), in the row layout
    (:mod:`kernels.coda.align`).
    """
    gemm = FusedGemm(a, b, recipe, scale)
    if acc is not None and (acc.shape != (gemm.M, gemm.N) or acc.stride(1) != 1):
        raise ValueError(f"acc must be a row-major {(gemm.M, gemm.N)} tensor, got {tuple(acc.shape)}")
    c = gemm.empty(out_dtype) if acc is None else aligned(acc)
    gemm.launch(gemm_kernel, c_ptr=c, stride_c=c.stride(0), ACC=acc is not None)
    return c if acc is None else written_back(c, acc)


def mm_split(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`mm` split: cuBLAS (``torch.matmul``, into the row layout as :func:`mm`'s fused path); a plain GEMM has no
    epilogue to run after it."""
    return split_matmul(a, b)


@with_split(mm_split)
def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of plain operands (bf16/fp16/fp32, layouts as :func:`matmul`), in their dtype: the mainloop, or cuBLAS
    on the shapes where it measures faster (:mod:`kernels.coda.strategy`). The backward's plain GEMMs use it: the
    weight gradients and the producer's input gradient."""
    return matmul(a, b)


def mm_acc_split(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`mm_acc` split: cuBLAS (``torch.mm``, ``torch.addmm`` into ``acc``)."""
    return torch.mm(a, b) if acc is None else torch.addmm(acc, a, b, out=acc)


def _fresh_acc(arguments: dict) -> dict:
    """A call's arguments for measuring it repeatedly: a buffer of its own to accumulate into (its values do not
    change the time)."""
    acc = arguments["acc"]
    return {**arguments, "acc": None if acc is None else torch.empty_like(acc)}


@with_split(mm_acc_split, safe=_fresh_acc)
def mm_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` of plain operands in their dtype, or ``acc += a @ b`` in place (returned), the sum taken in fp32 and
    rounded to acc's dtype once per call: a weight gradient summed over chunks of rows. The mainloop, or cuBLAS
    where it measures faster (:mod:`kernels.coda.strategy`)."""
    return matmul(a, b, acc=acc)


def linear(x: torch.Tensor | Fp8, w: torch.Tensor | Fp8, recipe: Recipe | None = None) -> torch.Tensor:
    """``x @ w.T`` with w in nn.Linear layout (N, K); fp8 x, w: scales per tensor or per row of each."""
    return matmul(x, w.T, recipe=recipe)


def split_matmul(a: torch.Tensor | Fp8, b: torch.Tensor | Fp8, recipe: Recipe | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM of a split path (:mod:`kernels.coda.strategy`): ``a @ b`` by cuBLAS (torch) for plain operands, by
    :func:`matmul` (the mainloop, dequantizing) for fp8 ones; the result rounded to the operands' dtype (bf16 for
    fp8), as PyTorch's unfused code rounds it; written into ``out`` when given, else into a new tensor in the row
    layout (:mod:`kernels.coda.align`) that the split path's row kernel then reads."""
    if isinstance(a, Fp8):
        c = matmul(a, b, recipe=recipe)
        return c if out is None else out.copy_(c)
    return torch.matmul(a, b, out=empty_rows(a.shape[0], b.shape[1], a.dtype, a.device) if out is None else out)
