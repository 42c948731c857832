"""The tensor descriptors' 16-byte rule, and the row layout that lets every CODA kernel take any shape.

A TMA tensor descriptor (``tl.make_tensor_descriptor``, Gluon's ``TensorDescriptor``) addresses a row-major [m, n]
tensor by its base address and row stride, both multiples of :data:`ALIGN` = 16 bytes, and its logical shape bounds
every tile: reads past it are zeros, writes past it are dropped. A row of n elements of ``e`` bytes meets the rule
when ``n e`` is a multiple of 16: n a multiple of 4 in fp32, 8 in bf16/fp16, 16 in fp8. Real shapes that do not:
Llama-2's vocabulary with a pad token (32001), FFN sizes such as 90, a hidden size of 72 in fp8.

Any [m, n] works once its *storage* rows are padded: the *row layout* puts row i at ``i * row_stride(n, e)``
elements, the stride rounded up to 16 bytes, the padding never read nor written (the descriptor's shape is the
true [m, n]). So the CODA host functions

- allocate every 2-D tensor they hand a kernel, outputs included, by :func:`empty_rows`: a ``[:, :n]`` view of an
  [m, row_stride] buffer, which is a plain contiguous tensor when n already meets the rule (no padding, no cost);
- take every 2-D input by :func:`aligned`: the tensor itself when it is in a row layout with an aligned base and
  stride (every tensor the kernels wrote, and any contiguous aligned one), else one copy into :func:`empty_rows`;
- write in place into a caller's tensor through :func:`aligned` and :func:`written_back`.

The kernels see the true shapes, so results are those of the unpadded math, bit for bit: no zero rows or columns take
part in any sum (an RMSNorm over a padded hidden size would divide by the wrong d; a cross-entropy over padded
logits would add exp(0) terms). Outputs with padding are not contiguous; the ``coda::`` ops' fake-tensor rules
(:mod:`kernels.coda.ops`) give them the same strides, by :func:`empty_rows` too.
"""
from __future__ import annotations

import torch

ALIGN = 16
"""Bytes: the alignment of a tensor descriptor's base address and of its row stride."""


def row_stride(n: int, element_size: int) -> int:
    """Elements from one row to the next in the row layout: ``n`` rounded up to a multiple of ``ALIGN`` bytes of
    ``element_size``-byte elements (n itself when ``n * element_size`` is a multiple of 16)."""
    per = max(1, ALIGN // element_size)
    return -(-n // per) * per


def meets_rule(n: int, element_size: int) -> bool:
    """Whether rows of ``n`` elements of ``element_size`` bytes meet the 16-byte rule as they are (no padding)."""
    return row_stride(n, element_size) == n


def empty_rows(m: int, n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised [m, n] tensor in the row layout: ``empty(m, row_stride(n))[:, :n]`` (contiguous when n meets
    the rule). Also under fake-tensor modes, where it gives the fake rules of the ``coda::`` ops their strides."""
    stride = row_stride(n, dtype.itemsize)
    if stride == n:
        return torch.empty(m, n, dtype=dtype, device=device)
    return torch.empty(m, stride, dtype=dtype, device=device)[:, :n]


def is_aligned(t: torch.Tensor) -> bool:
    """Whether a kernel can address the 2-D t as it is: unit column stride, its base address and row stride
    multiples of 16 bytes."""
    rows, cols = t.stride()
    return cols == 1 and rows * t.element_size() % ALIGN == 0 and t.data_ptr() % ALIGN == 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """The 2-D t when :func:`is_aligned`, else a copy of it in the row layout (:func:`empty_rows`), in the autograd
    graph where t is."""
    return t if is_aligned(t) else empty_rows(*t.shape, dtype=t.dtype, device=t.device).copy_(t)


def written_back(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t, holding what a kernel wrote into ``buf``: ``buf = aligned(t)``, written in place; when that was a copy,
    it is copied back into t (in place into a tensor that is not aligned costs two copies, only then)."""
    if buf is not t:
        t.copy_(buf)
    return t
