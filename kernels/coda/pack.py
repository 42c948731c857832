"""Packing a model's weights into the CODA layouts, in one kernel each way.

The Hugging Face drop-in (:mod:`kernels.coda.hf`) builds, every forward, the packed weights of each layer from the
model's own parameters (the optimizer updates those between steps), and backward sends the packed weights'
gradients back to them. Each packed row is one row of one source weight::

    packed[i] = weights[t_i][r_i]            (forward)
    dweights[t_i][r_i] = dpacked[i]          (backward: every row of every weight is hit once)

- ``Wqkv``: ``[q_proj; k_proj; v_proj]`` with q/k rows in adjacent RoPE pairs
  (:func:`kernels.layouts.qkv_rows_to_adjacent` of the concatenation);
- ``Wgu``: gate/up rows interleaved (:func:`kernels.layouts.interleave_rows`).

Done with torch ops (cat, an index gather, stack) the two cost ~10 small kernels a layer each way; the index
backward sorts. :func:`pack_rows` is one bandwidth-bound row copy per packed weight and direction.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import layouts as L
from kernels.coda.host import cdiv
from kernels.coda.mainloop import INTERPRET

MAX_SOURCES = 3


@triton.jit
def pack_rows_kernel(packed_ptr, src0_ptr, src1_ptr, src2_ptr, tensor_ptr, row_ptr, R, D, stride_p,
                     UNPACK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (BLOCK_R, BLOCK_D) block of the packed [R, D] tensor (rows ``stride_p`` apart): packed row i is row
    ``row[i]`` of source ``tensor[i]`` (0, 1 or 2; all sources contiguous with D columns). Copies source -> packed,
    or with UNPACK packed -> source."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    t = tl.load(tensor_ptr + rows, mask=rows < R, other=-1)[:, None]
    offs = tl.load(row_ptr + rows, mask=rows < R, other=0).to(tl.int64)[:, None] * D + cols[None, :]
    packed = packed_ptr + rows.to(tl.int64)[:, None] * stride_p + cols[None, :]
    # One access per source, masked to its rows (not a select of pointers: that loses the 16-byte vectors).
    if UNPACK:
        value = tl.load(packed, mask=mask)
        tl.store(src0_ptr + offs, value, mask=mask & (t == 0))
        tl.store(src1_ptr + offs, value, mask=mask & (t == 1))
        tl.store(src2_ptr + offs, value, mask=mask & (t == 2))
    else:
        value = tl.load(src0_ptr + offs, mask=mask & (t == 0), other=0.0)
        value = tl.where(t == 1, tl.load(src1_ptr + offs, mask=mask & (t == 1), other=0.0), value)
        value = tl.where(t == 2, tl.load(src2_ptr + offs, mask=mask & (t == 2), other=0.0), value)
        tl.store(packed, value, mask=mask)


def copy_rows(packed: torch.Tensor, sources: list[torch.Tensor], index: tuple[torch.Tensor, torch.Tensor],
              unpack: bool) -> None:
    """``packed[i] = sources[t_i][r_i]`` for index (t, r), or with ``unpack`` the other way (sources written).
    packed is row-major (the row layout of :mod:`kernels.coda.align`: the kernels' operand as it is), the sources
    contiguous; the index is made so here (a compiled graph may hand over any strides)."""
    R, D = packed.shape
    srcs = sources + [sources[0]] * (MAX_SOURCES - len(sources))
    index = tuple(t.contiguous() for t in index)
    block_r, block_d, warps = (16, 32, 4) if INTERPRET else (8, 512, 4)
    pack_rows_kernel[(cdiv(R, block_r), cdiv(D, block_d))](packed, *srcs, *index, R, D, packed.stride(0),
                                                           UNPACK=unpack, BLOCK_R=block_r,
                                                           BLOCK_D=block_d, num_warps=warps)


def pack_rows(index: tuple[torch.Tensor, torch.Tensor], *weights: torch.Tensor) -> torch.Tensor:
    """The packed tensor of ``weights`` (1 to 3 two-dimensional tensors of one dtype and width) by ``index``
    (int32 source tensor and row of each packed row: :func:`qkv_index`, :func:`gate_up_index`), differentiable: the
    op ``coda::pack_rows`` (:mod:`kernels.coda.ops`, run by its ``call``), whose backward copies each row of
    dpacked back."""
    if not 1 <= len(weights) <= MAX_SOURCES or any(w.dim() != 2 or w.shape[1] != weights[0].shape[1]
                                                   or w.dtype != weights[0].dtype for w in weights):
        raise ValueError(f"pack_rows takes 1 to {MAX_SOURCES} 2-D weights of one width and dtype")
    return ops.call("pack_rows", *index, list(weights))


def _index(order: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor, row) int32 of each packed row, the packed rows being the rows ``order`` of the sources stacked: a
    row's source is the number of sources that end at or before it. (Not ``searchsorted`` on a slice of the
    starts: Inductor's CUDA lowering reads such a slice from its base, one source off; pytorch/pytorch#182343.)"""
    starts = torch.tensor([0, *sizes], device=order.device).cumsum(0)
    tensor = (order[:, None] >= starts[None, 1:]).sum(1)
    return tensor.to(torch.int32), (order - starts[tensor]).to(torch.int32)


@functools.lru_cache(maxsize=None)
def qkv_index(heads: int, kv_heads: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The index of ``Wqkv`` from ``(q_proj, k_proj, v_proj)`` weights: :func:`kernels.layouts.qkv_perm` of their
    concatenation."""
    return _index(L.qkv_perm(heads, kv_heads, head_dim, device),
                  (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))


@functools.lru_cache(maxsize=None)
def gate_up_index(ffn: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The index of ``Wgu`` from ``(gate_proj, up_proj)`` weights: rows g0, u0, g1, u1, ..."""
    i = torch.arange(2 * ffn, device=device)
    return (i % 2).to(torch.int32), (i // 2).to(torch.int32)


# coda::pack_rows, which pack_rows calls (kernels.coda.ops builds it from copy_rows, so it is imported last).
from kernels.coda import ops  # noqa: E402
