"""A CODA kernel declared once, as its epilogue: from the declaration, the fused kernel, its split twin and the host
function that chooses between them.

An epilogue is a ``@triton.jit`` function of one fp32 tile ``z`` of ``A @ B`` (dequantized, times the row scale
when the kernel has one) that returns the tiles of its outputs, in the declared order::

    @triton.jit
    def swiglu(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
        return silu_mul_pairs(z, BM, BN), z          # y [M, N / 2], z_pre [M, N]

``args`` is the tuple of the declared ``inputs`` (pointers or scalars of the host call, in order); (off_m, off_n)
is the tile's place in the (M, N) product and (BM, BN) its shape (a column sub-tile of the autotuned tile, when the
configs have ``EPI_SUB``). :func:`coda` binds an epilogue to a host function, whose body only says which GEMM the
call is (:class:`Gemm`)::

    @coda(swiglu, outputs=(Output("y", cols=2, fp8="y_fp8"), Output("z_pre", when="save_preact")),
          configs=subtiled_configs((2, 1, 4)))
    def gemm_swiglu(h, w_gu, rstd, save_preact, promote=False, y_fp8=None):
        return Gemm(h, w_gu.T, promote, row_scale=rstd)

Built from it:

- the fused kernel ``<epilogue>_kernel`` (here ``swiglu_kernel`` unless ``kernel=`` names it), autotuned by
  :func:`kernels.coda.mainloop.coda_autotune`: the mainloop block (:data:`kernels.coda.launch.MAINLOOP_PARAMS`),
  then the row scale, the inputs, the outputs, the absmax partials, their row strides and the flags, every one a
  parameter of its own (so the tuning key, the argument dtypes in that order, is what a hand-written kernel of
  that signature had). Its body is one call of :func:`fused_program`, the same for every kernel;
- the split kernel ``<epilogue>_rows_kernel``: :func:`rows_program` over the plain GEMM's output
  (:func:`kernels.coda.gemm.split_matmul`), calling the SAME epilogue on each tile; its first full-width output is
  written over that output, in place;
- the host function, under :func:`kernels.coda.strategy.with_split` with both paths. It returns the outputs (one:
  the tensor; several: a tuple in the declared order); an output whose ``when`` argument is false is None and not
  written; an output with ``fp8`` is returned quantized (:func:`kernels.coda.fp8.quantize_from_partials`) when
  that argument holds a :class:`workloads.fp8.Recipe`, from the row absmax partials the epilogue stores.
"""
from __future__ import annotations

import functools
import linecache
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import triton
import triton.language as tl

from kernels.coda.epilogue import cast, col_subtile, dequant, dequant_scale, load_rows, load_tile, row_absmax, \
    store_row_partial, store_tile
from kernels.coda.fp8 import quantize_from_partials
from kernels.coda.gemm import split_matmul
from kernels.coda.launch import MAINLOOP_PARAMS, FusedGemm
from kernels.coda.mainloop import INTERPRET, coda_autotune, mainloop, num_tiles, operand_descs, tile_coords, \
    tile_desc
from kernels.coda.reduce import launched_tiles, row_partials
from kernels.coda.strategy import binder, with_split
from workloads.fp8 import Fp8, Recipe

MAX_OUTPUTS = 2
"""Outputs an epilogue may declare (the programs below spell each one out)."""
RESERVED = ("gemm_ptr", "stride_gemm", "amax_ptr", "stride_amax", "EPI_SUB", "AMAX", "BM", "BN")
"""Parameter names of the built kernels besides the mainloop block, which no input, output or flag may take."""


@dataclass(frozen=True)
class Output:
    """One output of an epilogue: ``name`` [M, N // cols] in the GEMM's output dtype. ``when``: the host function's
    bool argument that asks for it (None: always). ``fp8``: the host argument that, holding a Recipe, asks for it
    quantized (its row absmax partials are stored by the epilogue); ``role``: its role in that recipe."""

    name: str
    cols: int = 1
    when: str | None = None
    fp8: str | None = None
    role: str = "act"


@dataclass(frozen=True)
class Gemm:
    """The GEMM of one host call: ``a @ b`` (:class:`kernels.coda.launch.FusedGemm`'s operands), ``promote`` the fp8
    accumulation mode, ``row_scale`` an optional fp32 [M] factor of each row (RMSNorm's rstd), ``inputs`` the values
    of the declared inputs, in order."""

    a: torch.Tensor | Fp8
    b: torch.Tensor | Fp8
    promote: bool = False
    row_scale: torch.Tensor | None = None
    inputs: tuple = ()


# ---- the two programs every declared kernel runs -------------------------------------------------------------

@triton.jit
def _desc(ptr, stride, M, N, COLS: tl.constexpr, BM: tl.constexpr, SN: tl.constexpr):
    return tile_desc(ptr, M, N // COLS, stride, BM, SN // COLS)


@triton.jit
def _store(desc, off_m, off_n, COLS: tl.constexpr, val, amax, TRACK: tl.constexpr):
    """Store ``val`` at (off_m, off_n / COLS); with TRACK, ``amax`` maxed with the row absmax of what was stored."""
    val = cast(val, desc.dtype)
    store_tile(desc, off_m, off_n // COLS, val)
    if TRACK:
        amax = tl.maximum(amax, row_absmax(val))
    return amax


@triton.jit
def fused_program(a_ptr, b_ptr, sa_ptr, sb_ptr, M, N, K, stride_a, stride_b, SCALING: tl.constexpr,
                  PROMOTE: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, GROUP_M: tl.constexpr, row_ptr, args, outs, strides, amax_ptr, stride_amax,
                  EPILOGUE: tl.constexpr, ROW_SCALE: tl.constexpr, NOUT: tl.constexpr, COLS: tl.constexpr,
                  STORE: tl.constexpr, AMAX_OF: tl.constexpr, AMAX: tl.constexpr, EPI_SUB: tl.constexpr):
    """The persistent fused kernel: for each tile, the mainloop, the dequantization (with the row scale), then
    EPILOGUE on each of EPI_SUB column sub-tiles, its outputs stored (those STORE asks for) and, with AMAX, the row
    absmax partial of output AMAX_OF over the tile."""
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    SN: tl.constexpr = BN // EPI_SUB
    if STORE[0]:
        d0 = _desc(outs[0], strides[0], M, N, COLS[0], BM, SN)
    if NOUT > 1:
        if STORE[1]:
            d1 = _desc(outs[1], strides[1], M, N, COLS[1], BM, SN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN, PROMOTE)
        if ROW_SCALE:
            z = dequant_scale(acc, load_rows(row_ptr, off_m, M, BM), sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN,
                              SCALING)
        else:
            z = dequant(acc, sa_ptr, sb_ptr, off_m, off_n, M, N, BM, BN, SCALING)
        amax = tl.zeros((BM,), dtype=tl.float32)
        for i in tl.static_range(EPI_SUB):
            off_s = off_n + i * SN
            res = EPILOGUE(col_subtile(z, i, EPI_SUB, BM, BN), args, off_m, off_s, M, N, BM, SN)
            if STORE[0]:
                amax = _store(d0, off_m, off_s, COLS[0], res[0], amax, AMAX and AMAX_OF == 0)
            if NOUT > 1:
                if STORE[1]:
                    amax = _store(d1, off_m, off_s, COLS[1], res[1], amax, AMAX and AMAX_OF == 1)
        if AMAX:
            store_row_partial(amax_ptr, amax, off_m, off_n, M, stride_amax, BM, BN)


@triton.jit
def rows_program(c_ptr, M, N, stride_c, row_ptr, args, outs, strides, amax_ptr, EPILOGUE: tl.constexpr,
                 ROW_SCALE: tl.constexpr, NOUT: tl.constexpr, COLS: tl.constexpr, STORE: tl.constexpr,
                 AMAX_OF: tl.constexpr, AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The split kernel: rows [pid BM, pid BM + BM) of the GEMM output c [M, N], tile by tile, through EPILOGUE
    (c times the row scale is its ``z``); with AMAX, the row absmax of output AMAX_OF in ``amax[M]``."""
    off_m = tl.program_id(0) * BM
    c_desc = tile_desc(c_ptr, M, N, stride_c, BM, BN)
    if STORE[0]:
        d0 = _desc(outs[0], strides[0], M, N, COLS[0], BM, BN)
    if NOUT > 1:
        if STORE[1]:
            d1 = _desc(outs[1], strides[1], M, N, COLS[1], BM, BN)
    if ROW_SCALE:
        row = load_rows(row_ptr, off_m, M, BM)
    amax = tl.zeros((BM,), dtype=tl.float32)
    for off_n in range(0, N, BN):
        z = load_tile(c_desc, off_m, off_n)
        if ROW_SCALE:
            z = z * row[:, None]
        res = EPILOGUE(z, args, off_m, off_n, M, N, BM, BN)
        if STORE[0]:
            amax = _store(d0, off_m, off_n, COLS[0], res[0], amax, AMAX and AMAX_OF == 0)
        if NOUT > 1:
            if STORE[1]:
                amax = _store(d1, off_m, off_n, COLS[1], res[1], amax, AMAX and AMAX_OF == 1)
    if AMAX:
        rows = off_m + tl.arange(0, BM)
        tl.store(amax_ptr + rows, amax, mask=rows < M)


# ---- building a declared kernel ------------------------------------------------------------------------------

def _entry(name: str, params: Sequence[str], call: str, scope: dict[str, Any]) -> Callable:
    """A kernel ``name(params)`` whose body is ``call``, as a function with source of its own (Triton reads a
    kernel's source; it is kept in :mod:`linecache` under ``<coda:name>``)."""
    src = f"def {name}({', '.join(params)}):\n    {call}\n"
    filename = f"<coda:{name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    exec(compile(src, filename, "exec"), scope)
    return scope[name]


def _tuple(names: Sequence[str]) -> str:
    return f"({''.join(f'{n}, ' for n in names)})"


@dataclass(frozen=True)
class Declaration:
    """An epilogue with its outputs, inputs and row scale: what the two kernels and the two host paths are built
    from."""

    epilogue: Callable
    outputs: tuple[Output, ...]
    inputs: tuple[str, ...]
    row_scale: str | None
    subtiled: bool

    @property
    def flags(self) -> tuple[str, ...]:
        """The constexpr flags of the outputs' ``when`` arguments (``save_preact`` -> ``SAVE_PREACT``)."""
        return tuple(o.when.upper() for o in self.outputs if o.when)

    @property
    def amax_of(self) -> int:
        """The output whose row absmax partials the epilogue can store (-1: none)."""
        return next((i for i, o in enumerate(self.outputs) if o.fp8), -1)

    def _tail(self) -> str:
        """The programs' constexpr arguments after the epilogue, as source."""
        store = ", ".join(o.when.upper() if o.when else "True" for o in self.outputs)
        cols = ", ".join(str(o.cols) for o in self.outputs)
        amax = "AMAX" if self.amax_of >= 0 else "False"
        return f"EPILOGUE, {self.row_scale is not None}, {len(self.outputs)}, ({cols},), ({store},), {self.amax_of}, {amax}"

    def _params(self, ptrs: Sequence[str]) -> list[str]:
        names = [o.name for o in self.outputs]
        amax = self.amax_of >= 0
        return [*([f"{self.row_scale}_ptr"] if self.row_scale else []), *self.inputs, *(f"{n}_ptr" for n in names),
                *(["amax_ptr"] if amax else []), *(f"stride_{n}" for n in names), *ptrs,
                *(f"{f}: tl.constexpr" for f in self.flags), *(["AMAX: tl.constexpr"] if amax else [])]

    def _operands(self, unused: str) -> str:
        """The programs' row scale, inputs, outputs, strides and partials, as source (``unused`` for those the
        kernel lacks)."""
        names = [o.name for o in self.outputs]
        return (f"{f'{self.row_scale}_ptr' if self.row_scale else unused}, {_tuple(self.inputs)}, "
                f"{_tuple([f'{n}_ptr' for n in names])}, {_tuple([f'stride_{n}' for n in names])}, "
                f"{'amax_ptr' if self.amax_of >= 0 else unused}")

    def fused_kernel(self, name: str, configs: list[triton.Config] | None) -> Callable:
        """The fused kernel: :data:`MAINLOOP_PARAMS`, then the row scale, inputs, outputs, partials, strides and
        flags, each a parameter; its body :func:`fused_program`."""
        amax = self.amax_of >= 0
        first_constexpr = MAINLOOP_PARAMS.index("SCALING")
        params = [*MAINLOOP_PARAMS[:first_constexpr], *(f"{p}: tl.constexpr" for p in MAINLOOP_PARAMS[first_constexpr:]),
                  *self._params(["stride_amax"] if amax else []), *(["EPI_SUB: tl.constexpr"] if self.subtiled else [])]
        call = (f"fused_program({', '.join(MAINLOOP_PARAMS)}, {self._operands('a_ptr')}, {'stride_amax' if amax else 0}, "
                f"{self._tail()}, {'EPI_SUB' if self.subtiled else 1})")
        entry = _entry(name, params, call, {"tl": tl, "fused_program": fused_program, "EPILOGUE": self.epilogue})
        return coda_autotune(key=("M", "N", "K", *self.flags), configs=configs)(triton.jit(entry))

    def rows_kernel(self, name: str) -> Callable:
        """The split kernel over the GEMM output ``c``; its body :func:`rows_program`."""
        params = ["gemm_ptr", "M", "N", "stride_gemm", *self._params([]), "BM: tl.constexpr", "BN: tl.constexpr"]
        call = f"rows_program(gemm_ptr, M, N, stride_gemm, {self._operands('gemm_ptr')}, {self._tail()}, BM, BN)"
        return triton.jit(_entry(name, params, call, {"tl": tl, "rows_program": rows_program,
                                                       "EPILOGUE": self.epilogue}))


def coda(epilogue: Callable, outputs: Sequence[Output], inputs: Sequence[str] = (), row_scale: str | None = None,
         configs: list[triton.Config] | None = None) -> Callable:
    """Decorate a host function that returns the :class:`Gemm` of its call: it becomes the declared kernel's host
    function (same name and signature; fused or split by :func:`kernels.coda.strategy.with_split`), with the fused
    kernel ``<host>_kernel`` as ``.kernel`` and the split one ``<host>_rows_kernel`` as ``.rows_kernel``.
    ``inputs``: the names of the epilogue's extra arguments (``Gemm.inputs``, its ``args``); ``row_scale``: the
    name of ``Gemm.row_scale`` (the kernel's ``<row_scale>_ptr``), which scales the GEMM's rows before the
    epilogue; ``configs``: the tile configs (with ``EPI_SUB``
    in them the epilogue runs on column sub-tiles)."""
    if not 1 <= len(outputs) <= MAX_OUTPUTS:
        raise ValueError(f"an epilogue declares 1 to {MAX_OUTPUTS} outputs, got {len(outputs)}")
    if not any(o.cols == 1 for o in outputs):
        raise ValueError("an epilogue declares a full-width output (the split path writes it over the GEMM's)")
    decl = Declaration(epilogue, tuple(outputs), tuple(inputs), row_scale,
                       any("EPI_SUB" in c.kwargs for c in configs or ()))
    names = [*([f"{row_scale}_ptr"] if row_scale else []), *inputs, *decl.flags,
             *(n for o in outputs for n in (f"{o.name}_ptr", f"stride_{o.name}"))]
    taken = {*MAINLOOP_PARAMS, *RESERVED} & set(names) | {n for n in names if names.count(n) > 1}
    if taken:
        raise ValueError(f"{epilogue.__name__}: names the kernels already use: {sorted(taken)}")

    def deco(host: Callable[..., Gemm]) -> Callable:
        bind = binder(host)
        fused_kernel = decl.fused_kernel(f"{host.__name__}_kernel", configs)
        rows_kernel = decl.rows_kernel(f"{host.__name__}_rows_kernel")

        @functools.wraps(host)
        def fused(*args: Any, **kwargs: Any) -> Any:
            named = bind(args, kwargs)
            return _run_fused(decl, fused_kernel, host(**named), named)

        @functools.wraps(host)
        def split(*args: Any, **kwargs: Any) -> Any:
            named = bind(args, kwargs)
            return _run_split(decl, rows_kernel, host(**named), named)

        dispatch = with_split(split)(fused)
        dispatch.kernel, dispatch.rows_kernel = fused_kernel, rows_kernel
        return dispatch

    return deco


@dataclass
class _Asked:
    """What one call asks of a declaration: which outputs are stored, and whether the partials are."""

    flags: dict[str, bool]
    stored: list[bool]
    recipe: Recipe | None

    @classmethod
    def of(cls, decl: Declaration, named: dict[str, Any]) -> _Asked:
        flags = {o.when.upper(): bool(named[o.when]) for o in decl.outputs if o.when}
        stored = [not o.when or flags[o.when.upper()] for o in decl.outputs]
        recipe = named[decl.outputs[decl.amax_of].fp8] if decl.amax_of >= 0 else None
        return cls(flags, stored, recipe)

    def kernel_flags(self, decl: Declaration) -> dict[str, bool]:
        return {**self.flags, **({"AMAX": self.recipe is not None} if decl.amax_of >= 0 else {})}

    def results(self, decl: Declaration, outs: list[torch.Tensor], amax: torch.Tensor | None, n_tiles: int) -> Any:
        """The host function's return: the outputs asked for (None for the others), the fp8 one quantized."""
        results = []
        for i, (o, t, s) in enumerate(zip(decl.outputs, outs, self.stored)):
            if i == decl.amax_of and self.recipe is not None:
                t = quantize_from_partials(t, amax, n_tiles, rowwise=self.recipe.rowwise_for(o.role))
            results.append(t if s else None)
        return results[0] if len(results) == 1 else tuple(results)


def _run_fused(decl: Declaration, kernel: Callable, g: Gemm, named: dict[str, Any]) -> Any:
    asked = _Asked.of(decl, named)
    gemm = FusedGemm(g.a, g.b, g.promote)
    M, N = gemm.M, gemm.N
    outs = [torch.empty(M, N // o.cols, device=gemm.device, dtype=gemm.out_dtype) if s else None
            for o, s in zip(decl.outputs, asked.stored)]
    live = next(t for t in outs if t is not None)  # an output not asked for: this one as a placeholder never written
    args = {f"{decl.row_scale}_ptr": g.row_scale} if decl.row_scale else {}
    args.update(zip(decl.inputs, g.inputs))
    args.update({f"{o.name}_ptr": live if t is None else t for o, t in zip(decl.outputs, outs)})
    args.update({f"stride_{o.name}": 0 if t is None else t.stride(0) for o, t in zip(decl.outputs, outs)})
    amax = row_partials(kernel, M, N, gemm.device) if asked.recipe else None
    if decl.amax_of >= 0:
        part = amax if amax is not None else live if g.row_scale is None else g.row_scale  # unused unless asked
        args.update(amax_ptr=part, stride_amax=part.stride(0))
    gemm.launch(kernel, **args, **asked.kernel_flags(decl))
    return asked.results(decl, outs, amax, launched_tiles(kernel, M, N)[1] if asked.recipe else 0)


def _run_split(decl: Declaration, kernel: Callable, g: Gemm, named: dict[str, Any]) -> Any:
    asked = _Asked.of(decl, named)
    c = split_matmul(g.a, g.b, g.promote)
    M, N = c.shape
    inplace = next(i for i, o in enumerate(decl.outputs) if o.cols == 1)
    outs = [c if i == inplace else torch.empty(M, N // o.cols, device=c.device, dtype=c.dtype)
            for i, o in enumerate(decl.outputs)]
    amax = torch.empty(M, 1, device=c.device, dtype=torch.float32) if asked.recipe else None
    bm, bn = (16, 32) if INTERPRET else (16, 256)
    kernel[(triton.cdiv(M, bm),)](c, M, N, c.stride(0), *([g.row_scale] if decl.row_scale else []), *g.inputs, *outs,
                                  *([c if amax is None else amax] if decl.amax_of >= 0 else []),
                                  *(t.stride(0) for t in outs), **asked.kernel_flags(decl), BM=bm, BN=bn)
    return asked.results(decl, [t if s else None for t, s in zip(outs, asked.stored)], amax, 1)
