"""A CODA kernel declared once, as its epilogue: from the declaration, the fused kernel, its split kernel, its Gluon
variant and the host function that chooses between them.

An epilogue is a ``@triton.jit`` function of one fp32 tile ``z`` of ``A @ B`` (dequantized, times the row scale
when the kernel has one) that returns the fp32 tiles of its outputs, in the declared order::

    @triton.jit
    def swiglu(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
        return silu_mul_pairs(z, BM, BN), z          # y [M, N / 2], z [M, N]

``args`` is the tuple of the declared ``inputs``: the host call's pointers and scalars, and for a :class:`Tile`
input the descriptor of that [M, N] matrix, blocks of the tile's shape; (off_m, off_n) is the tile's place in the
(M, N) product and (BM, BN) its shape (a column sub-tile of the autotuned tile, when the configs have ``EPI_SUB``).
:func:`coda` binds an epilogue to a host function, whose body only says which GEMM the call is (:class:`Gemm`)::

    @coda(swiglu, outputs=(Output("y", cols=2, fp8="y_fp8"), Output("z", when="save_preact")), row_scale="rstd",
          configs=subtiled_configs((2, 1, 4)))
    def gemm_swiglu(h, w_gu, rstd, save_preact, recipe=None, y_fp8=None) -> Gemm:
        return Gemm(h, w_gu.T, recipe, row_scale=rstd)

Built from it:

- the fused kernel ``<host>_kernel``, autotuned by :func:`kernels.coda.mainloop.coda_autotune` (its key: M, N, K
  and the ``when`` flags): the mainloop block (:data:`kernels.coda.launch.MAINLOOP_PARAMS`), then the row scale,
  the inputs, the outputs and the partials (pointers), their row strides, the flags, every one a parameter of its
  own, so that the tuning key (the argument dtypes, in that order) is what a hand-written kernel of that signature
  had. Its body is one call of :func:`kernels.coda.tile_programs.fused_program`, the same for every kernel;
- the split kernel ``<host>_rows_kernel`` (the split path unless the declaration brings its own): the plain GEMM
  (:func:`kernels.coda.gemm.split_matmul`), then :func:`kernels.coda.tile_programs.blocks_program` over its output
  (``split_block``: one block a program, or blocks of rows a program), calling the SAME epilogue on each and writing
  the first output of the GEMM output's shape and dtype over it, in place;
- the Gluon kernel ``<host>_gluon_kernel`` (:mod:`kernels.coda.gluon_program`, where Triton has Gluon): the same
  epilogue beside the next tile's mainloop on Hopper, the Gluon path unless the declaration brings its own;
- the host function, under :func:`kernels.coda.strategy.with_split` with the three paths,
  and the ops it implements (``binds``): the registry's entries (:func:`register`).
  It returns the outputs (one: the tensor; several: a tuple in the declared order), or what ``finish`` makes of
  them; an output whose ``when`` argument is false is None and not written (all of them may be), one the call
  brings (``Gemm.outputs``) is written in place; an output with ``fp8`` is returned quantized
  (:func:`kernels.coda.fp8.quantize_from_partials`) when that argument holds a :class:`workloads.fp8.Recipe`, from
  the row absmax partials of its stored tiles; an output with ``sumsq`` has the per-N-tile partial sums of squares
  of its fp32 tiles stored (with ``row_sum``, the sums of a row vector the epilogue returns after its outputs
  instead), which ``finish`` turns into the host function's further results, as it does the column sums per M
  tile of a tile the epilogue returns last (``col_sum``). An output or :class:`Tile` input may be ``wide``:
  [M, N * wide], the epilogue's tile of it [BM, BN * wide] (an interleaved pair per column). Flags of the call
  (``flags``) and values loaded once per tile (``tile``) reach the epilogue through its ``args``.
"""
from __future__ import annotations

import functools
import inspect
import linecache
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from codabench.registry import REGISTRY, Implementation, Native, entry
from kernels.coda.align import aligned, empty_rows, is_aligned
from kernels.coda.epilogue import Block
from kernels.coda.fp8 import quantize_from_partials
from kernels.coda.gemm import split_matmul
from kernels.coda.host import cdiv
from kernels.coda.launch import MAINLOOP_PARAMS, FusedGemm
from kernels.coda.mainloop import INTERPRET, coda_autotune, operand, tile_desc
from kernels.coda.reduce import col_partials, launched_tiles, row_partials
from kernels.coda.strategy import Gluon, Recorder, always, binder, hopper, summary, with_split
from kernels.coda.tile_programs import blocks_program, fused_program
from workloads.fp8 import Fp8, Recipe, promoted
from workloads.ops import OPS

try:  # Triton's Gluon for Hopper, which the Gluon variants need (kernels.coda.gluon_program builds on this module:
    # it is imported where a variant is built or run); without it, the fused and split paths only
    import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    HAS_GLUON = True
except ImportError:
    HAS_GLUON = False

MAX_OUTPUTS = 2
"""Outputs an epilogue may declare (the programs spell each one out)."""
SPLIT_BLOCK = (16, 256)
"""(BM, BN) of the built split kernel's blocks on the GPU, unless a declaration names its own (``split_block``; the
interpreter: 16 x 32). Measured on an H200 at M = 16384 (the producer's split path, ms, against the row loop of
16 x 256 descriptor tiles before it): 0.287 / 0.918 / 3.54 at 1B / 7B / 70B against 0.312 / 0.943 / 3.49."""
SplitLaunch = Callable[[int, int, torch.device], tuple[int, int, int, int]]
"""A declaration's launch of its split kernel for a GEMM output [M, N] on a device: (BM, BN, num_warps, programs along
M), each program taking every P-th block of rows (RMSNorm's dgrad: whole rows, its dgamma partials one row a
program)."""
RESERVED = ("gemm_ptr", "stride_gemm", "ss_ptr", "amax_ptr", "cs_ptr", "stride_ss", "stride_amax", "stride_cs",
            "EPI_SUB", "AMAX", "BM", "BN", "LOOP")
"""Parameter names of the built kernels besides the mainloop block, which no input, output or flag may take."""


@dataclass(frozen=True)
class Output:
    """One output of an epilogue: ``name`` [M, N * wide // cols], in the GEMM's output dtype or that of the host
    argument ``like`` (the epilogue's tile of it: [BM, BN * wide // cols], stored at column off_n * wide // cols).
    ``when``: the host function's bool argument that asks for it (None: always). ``fp8``: the host argument that,
    holding a Recipe, asks for it quantized (``role``: its role in that recipe). ``sumsq``: its row sums of squares
    are stored as partials, for the declaration's ``finish``."""

    name: str
    cols: int = 1
    wide: int = 1
    when: str | None = None
    like: str | None = None
    fp8: str | None = None
    role: str = "act"
    sumsq: bool = False


@dataclass(frozen=True)
class Tile:
    """An input matrix [M, N * wide] the epilogue reads tile by tile (a residual; blocks [BM, BN * wide]): the
    kernel gets ``<name>_ptr`` and ``stride_<name>``, the epilogue its descriptor."""

    name: str
    wide: int = 1


@dataclass(frozen=True)
class Partials:
    """The partials a call's kernel stored, for the declaration's ``finish``: ``ss`` [M, >= n_tiles], the row sums
    per N tile (of squares of the ``sumsq`` output, or the ``row_sum`` ones), ``cs`` [>= m_tiles, N], the
    ``col_sum`` column sums per M tile (None: not declared), and the declared ``vectors`` by name."""

    ss: torch.Tensor | None
    n_tiles: int
    cs: torch.Tensor | None
    m_tiles: int
    vectors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Gemm:
    """The GEMM of one host call: ``a @ b`` (:class:`kernels.coda.launch.FusedGemm`'s operands), ``recipe`` the fp8
    operands' recipe (its accumulation mode read at the launch), ``row_scale`` an optional fp32 [M] factor of each
    row (RMSNorm's rstd), ``inputs`` the values of the declared inputs, in order (an [M, N * wide] tensor for a
    :class:`Tile`, taken through :func:`kernels.coda.align.aligned`), ``flags`` the values of the declared flags,
    by name; ``outputs``: outputs the call brings, by name (written in place; of the declared shape and dtype, in
    the row layout of :mod:`kernels.coda.align`), the others are allocated (:func:`kernels.coda.align.empty_rows`)."""

    a: torch.Tensor | Fp8
    b: torch.Tensor | Fp8
    recipe: Recipe | None = None
    row_scale: torch.Tensor | None = None
    inputs: tuple = ()
    flags: Mapping[str, bool] = field(default_factory=dict)
    outputs: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        """(M, N) of ``a @ b``."""
        a, b = (t.data if isinstance(t, Fp8) else t for t in (self.a, self.b))
        return a.shape[0], b.shape[1]

    @property
    def device(self) -> torch.device:
        return (self.a.data if isinstance(self.a, Fp8) else self.a).device


@dataclass(frozen=True)
class Binding:
    """Ops of the catalogue (:mod:`workloads.ops`) that a declared host function implements alone, one call a cell:
    ``ops`` their names; ``results`` the names of the host function's results, in order (a result that is None, not
    asked for, is left out; a None name: never an output); ``args(n)``: the call's arguments that are not the
    cell's native inputs of their names (a constant flag, a model's size, a weight seen another way), from the
    call's :class:`codabench.registry.Native` inputs ``n`` (``n.model`` the cell's model shape); ``modes``: the modes
    it runs (None: the op's); ``description``: the registry's line. A host function's ``recipe`` argument gets the
    cell's fp8 recipe (``n.recipe``)."""

    ops: tuple[str, ...]
    results: tuple[str | None, ...]
    description: str
    args: Callable[[Native], dict[str, Any]] = lambda n: {}
    modes: tuple[str, ...] | None = None

    def run(self, host: Callable) -> Callable[[Native], dict[str, Any]]:
        """The function of a cell's native inputs that calls ``host`` and names its results."""
        params = list(inspect.signature(host).parameters)

        def run(n: Native) -> dict[str, Any]:
            recipe = {"recipe": n.recipe} if "recipe" in params else {}
            out = host(**{**{p: n[p] for p in params if p in n}, **recipe, **self.args(n)})
            out = out if isinstance(out, tuple) else (out,)
            return {k: v for k, v in zip(self.results, out) if k is not None and v is not None}

        return run


# ---- building a declared kernel ------------------------------------------------------------------------------

def _tuple(items: Sequence[str]) -> str:
    return f"({''.join(f'{n}, ' for n in items)})"


@dataclass(frozen=True)
class Declaration:
    """An epilogue with its outputs, inputs, flags, row scale, row and column sums and sub-tiling: what the two
    kernels and the two host paths are built from."""

    epilogue: Callable
    outputs: tuple[Output, ...]
    inputs: tuple[str | Tile, ...]
    call_flags: tuple[str, ...]
    vectors: tuple[str, ...]
    tile: Callable | None
    row_scale: str | None
    row_sum: bool
    col_sum: bool
    subtiled: bool
    split_block: tuple[int, int] | SplitLaunch

    def split_launch(self, M: int, N: int, device: torch.device) -> tuple[int, int, int, int]:
        """(BM, BN, num_warps, programs along M) of the split kernel over a GEMM output [M, N]: the declaration's
        :data:`SplitLaunch`, or its (BM, BN) blocks (the interpreter's: 16 x 32), 4 warps, one block a program."""
        if callable(self.split_block):
            return self.split_block(M, N, device)
        bm, bn = (16, 32) if INTERPRET else self.split_block
        return bm, bn, 4, cdiv(M, bm)

    @functools.cached_property
    def flags(self) -> tuple[str, ...]:
        """The constexpr flags: of the outputs' ``when`` arguments (``save_preact`` -> ``SAVE_PREACT``), then the
        declared ones."""
        return (*(o.when.upper() for o in self.outputs if o.when), *self.call_flags)

    @functools.cached_property
    def col_sum_of(self) -> int:
        """The epilogue's result whose column sums are stored (-1: none): the one after the outputs and row sums."""
        return len(self.outputs) + self.row_sum if self.col_sum else -1

    @functools.cached_property
    def amax_of(self) -> int:
        """The output whose row absmax partials the epilogue can store (-1: none)."""
        return next((i for i, o in enumerate(self.outputs) if o.fp8), -1)

    @functools.cached_property
    def sumsq_of(self) -> int:
        """The output whose row sums of squares the epilogue stores (-1: none)."""
        return next((i for i, o in enumerate(self.outputs) if o.sumsq), -1)

    @functools.cached_property
    def partials(self) -> tuple[str, ...]:
        """The partials' pointers, in order (``ss``: row sums, of squares of the sumsq output or of the epilogue's
        row values; ``amax``); they share one row stride, ``stride_<first>``."""
        return ("ss",) * (self.sumsq_of >= 0 or self.row_sum) + ("amax",) * (self.amax_of >= 0)

    def _pointers(self) -> list[str]:
        return [*([f"{self.row_scale}_ptr"] if self.row_scale else []),
                *(f"{i.name}_ptr" if isinstance(i, Tile) else i for i in self.inputs),
                *(f"{o.name}_ptr" for o in self.outputs)]

    def _strides(self) -> list[str]:
        return [*(f"stride_{i.name}" for i in self.inputs if isinstance(i, Tile)),
                *(f"stride_{o.name}" for o in self.outputs)]

    def names(self) -> list[str]:
        """Every parameter name the declaration chooses."""
        return [*self._pointers(), *self._vectors(), *self._strides(), *self.flags]

    def _vectors(self) -> list[str]:
        return [f"{v}_ptr" for v in self.vectors]

    def _params(self) -> list[str]:
        return [*self._pointers(), *(f"{p}_ptr" for p in self.partials), *(["cs_ptr"] if self.col_sum else []),
                *self._vectors(), *self._strides(),
                *([f"stride_{self.partials[0]}"] if self.partials else []),
                *(["stride_cs"] if self.col_sum else []), *(f"{f}: tl.constexpr" for f in self.flags),
                *(["AMAX: tl.constexpr"] if self.amax_of >= 0 else [])]

    def _body(self, program: str, head: str, unused: str, tail: str) -> list[str]:
        """The entry's one line: the program's call, ``head`` first, ``tail`` last; ``unused``: the parameter that
        stands in for a pointer the declaration has not (the row scale, a partial)."""
        ptr = {p: f"{p}_ptr" if p in self.partials else unused for p in ("ss", "amax")}
        stride = f"stride_{self.partials[0]}" if self.partials else "0"
        cs = "cs_ptr, stride_cs" if self.col_sum else f"{unused}, 0"
        outs = [o.name for o in self.outputs]
        ptrs = [*(f"{i.name}_ptr" if isinstance(i, Tile) else i for i in self.inputs), *self.call_flags,
                *self._vectors()]
        tiles = [f"stride_{i.name}" for i in self.inputs if isinstance(i, Tile)]
        store = ", ".join(o.when.upper() if o.when else "True" for o in self.outputs)
        cols, wide = (", ".join(str(getattr(o, f)) for o in self.outputs) for f in ("cols", "wide"))
        consts = (f"INPUTS, EPILOGUE, TILE, {self.row_scale is not None}, {len(self.outputs)}, ({cols},), ({wide},), "
                  f"({store},), {self.sumsq_of}, {self.row_sum}, {self.col_sum_of}")
        return [f"{program}({head}, {f'{self.row_scale}_ptr' if self.row_scale else unused}, {_tuple(ptrs)}, "
                f"{_tuple(tiles)}, {_tuple([f'{n}_ptr' for n in outs])}, {_tuple([f'stride_{n}' for n in outs])}, "
                f"{ptr['ss']}, {ptr['amax']}, {stride}, {cs}, {consts}, {self.amax_of}, "
                f"{'AMAX' if self.amax_of >= 0 else 'False'}, {tail})"]

    def _scope(self, kernel: str) -> dict[str, Callable]:
        tile = self.tile or triton.jit(self._compile(f"{kernel}_tile", ["z", "args", "off_m", "M", "N",
                                                                         "BM: tl.constexpr"], ["return z, args"], {}))
        return {"EPILOGUE": self.epilogue, "INPUTS": self.inputs_fn(f"{kernel}_inputs"), "TILE": tile}

    def inputs_fn(self, name: str, tile: Callable = tile_desc) -> Callable:
        """``name(args, strides, M, N, BM, BN)``: the epilogue's ``args`` from the kernel's inputs, declared flags
        and vectors, a :class:`Tile`'s pointer replaced by its descriptor (``tile``: or a pointer
        :class:`kernels.coda.epilogue.Block`, or the Gluon program's :func:`kernels.coda.gluon_program.block`; blocks
        (BM, BN * wide); its row stride the next of ``strides``), an input the call gives as None as 0 (which
        :func:`kernels.coda.epilogue.given` tells from a pointer when the kernel compiles)."""
        items, t = [], 0
        for k, i in enumerate((*self.inputs, *self.call_flags, *self.vectors)):
            wide = f"{i.wide} * " if isinstance(i, Tile) and i.wide > 1 else ""
            item = (f"TILE_INPUT(args[{k}], M, {wide}N, strides[{t}], BM, {wide}BN)" if isinstance(i, Tile)
                    else f"args[{k}]")
            items.append(f"0 if args[{k}] is None else {item}" if k < len(self.inputs) else item)
            t += isinstance(i, Tile)
        return triton.jit(self._compile(name, ["args", "strides", "M", "N", "BM: tl.constexpr", "BN: tl.constexpr"],
                                        [f"return {_tuple(items)}"], {"TILE_INPUT": tile}))

    def fused_kernel(self, name: str, configs: list[triton.Config] | None, restore: Sequence[str]) -> Callable:
        """The fused kernel: :data:`MAINLOOP_PARAMS`, then the declaration's parameters; its body
        :func:`kernels.coda.tile_programs.fused_program`; autotuned with the outputs ``restore`` restored between
        runs."""
        first = MAINLOOP_PARAMS.index("SCALING")  # the block's constexprs
        params = [*MAINLOOP_PARAMS[:first], *(f"{p}: tl.constexpr" for p in MAINLOOP_PARAMS[first:]),
                  *self._params(), *(["EPI_SUB: tl.constexpr"] if self.subtiled else [])]
        body = self._body("fused_program", ", ".join(MAINLOOP_PARAMS), "a_ptr", "EPI_SUB" if self.subtiled else "1")
        entry = self._compile(name, params, body, {"fused_program": fused_program, **self._scope(name)})
        return coda_autotune(key=("M", "N", "K", *self.flags), configs=configs,
                             restore_value=[f"{o}_ptr" for o in restore])(triton.jit(entry))

    def rows_kernel(self, name: str) -> Callable:
        """The split kernel over the GEMM output; its body :func:`kernels.coda.tile_programs.blocks_program`."""
        params = ["gemm_ptr", "M", "N", "stride_gemm", *self._params(), "BM: tl.constexpr", "BN: tl.constexpr",
                  "LOOP: tl.constexpr"]
        body = self._body("blocks_program", "gemm_ptr, M, N, stride_gemm", "gemm_ptr", "BM, BN, LOOP")
        scope = {**self._scope(name), "INPUTS": self.inputs_fn(f"{name}_inputs", Block),
                 "blocks_program": blocks_program}
        return triton.jit(self._compile(name, params, body, scope))

    def gluon_kernel(self, name: str) -> Callable:
        """The Gluon variant (:mod:`kernels.coda.gluon_program`): the schedule's operands (descriptors), scales and
        sizes, the declaration's parameters, the schedule's constexprs; its body :func:`kernels.coda.gluon_program.
        gluon_program`."""
        from triton.experimental import gluon
        from kernels.coda.gluon_program import block, gluon_program
        head, consts = "a_desc, b_desc, sa_ptr, sb_ptr, M, N, K", "B_NK, SCALED, INSTR_K, S, GROUP_M, MMA_W, SUB_M"
        params = [*head.split(", "), *self._params(), *(f"{c}: tl.constexpr" for c in consts.split(", ")),
                  "num_warps: tl.constexpr"]
        body = self._body("gluon_program", head, "sa_ptr", f"{consts}, num_warps")
        scope = {**self._scope(name), "INPUTS": self.inputs_fn(f"{name}_inputs", block),
                 "gluon_program": gluon_program}
        return gluon.jit(self._compile(name, params, body, scope))

    def _compile(self, name: str, params: list[str], body: list[str], scope: dict[str, Any]) -> Callable:
        src = f"def {name}({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in body)
        filename = f"<coda:{name}>"  # Triton reads a kernel's source: kept in linecache under this name
        linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
        namespace = {"__name__": __name__, "tl": tl, "tile_desc": tile_desc, **scope}  # Triton reads __module__
        exec(compile(src, filename, "exec"), namespace)
        return namespace[name]


def coda(epilogue: Callable, outputs: Sequence[Output], inputs: Sequence[str | Tile] = (),
         flags: Sequence[str] = (), vectors: Sequence[str] = (), tile: Callable | None = None,
         row_scale: str | None = None, row_sum: bool = False, col_sum: bool = False,
         configs: list[triton.Config] | None = None, split_block: tuple[int, int] | SplitLaunch = SPLIT_BLOCK,
         restore: Sequence[str] = (), finish: Callable[..., tuple] | None = None, split: Callable | None = None,
         gluon: Gluon | None = None, binds: Sequence[Binding] = (),
         safe: Callable[[dict[str, Any]], dict[str, Any]] = dict, fuses: Callable[[dict[str, Any]], bool] = always
         ) -> Callable:
    """Decorate a host function that returns the :class:`Gemm` of its call: it becomes the declared kernel's host
    function (same name and signature; fused, split or Gluon by :func:`kernels.coda.strategy.with_split`), with the
    fused kernel ``<host>_kernel`` as ``.kernel``, the split one ``<host>_rows_kernel`` as ``.rows_kernel`` and the
    :class:`Declaration` as ``.declaration``.

    ``inputs``: the epilogue's extra arguments (``Gemm.inputs``, its ``args``), by parameter name, or :class:`Tile`;
    ``inputs`` the call gives as None reach the epilogue as 0 (:func:`kernels.coda.epilogue.given` tells, when the
    kernel compiles); ``flags``: constexpr flags of the kernels (``Gemm.flags``; part of the tuning key), which the
    epilogue finds after its inputs in ``args`` (as values: a branch on one is compiled both ways, so both must
    compile); ``vectors``: fp32 [M] vectors, zero-filled for each call, whose pointers
    (``<name>_ptr``) the epilogue finds after the flags in ``args`` and writes into (a gathered value per row), and
    ``finish`` reads (``Partials.vectors``); ``tile(z, args, off_m, M, N, BM)``: a ``@triton.jit`` function run once per
    tile of the GEMM output before the epilogue (before the column sub-tiles) that returns the tile and the ``args``
    the epilogue gets on it (what is the same for every sub-tile: row vectors, scalars); ``row_scale``: the name of
    ``Gemm.row_scale`` (the kernel's ``<row_scale>_ptr``), which scales the GEMM's rows before the epilogue;
    ``row_sum``: the epilogue returns, after its outputs, an fp32 [BM] vector of its tile whose sums over each row
    are kept (as partials, like a ``sumsq`` output's); ``col_sum``: it returns after those an fp32 tile whose column
    sums are kept, per M tile (the split kernel: per program along M); ``configs``: the tile configs (``EPI_SUB`` in
    them: the epilogue runs on column sub-tiles); ``split_block``: (BM, BN) of the built split kernel's blocks on
    the GPU, or its :data:`SplitLaunch`; ``restore``: outputs the
    fused kernel may read before writing (given in place), restored between the autotuner's runs;
    ``finish(arguments, gemm, outputs, partials)``: the host function's results from its arguments, its
    :class:`Gemm`, its outputs and the :class:`Partials`; ``split``: a split path of the host function's signature
    and results instead of the built one; ``gluon``: its Gluon path instead of the built one; ``binds``: the ops it
    implements (:class:`Binding`, as ``.binds``: the registry's entries are built from them, :func:`register`);
    ``safe`` and ``fuses``: :func:`kernels.coda.strategy.with_split`'s."""
    decl = Declaration(epilogue, tuple(outputs), tuple(inputs), tuple(flags), tuple(vectors), tile, row_scale,
                       row_sum, col_sum, any("EPI_SUB" in c.kwargs for c in configs or ()),
                       split_block if callable(split_block) else tuple(split_block))
    if not 1 <= len(outputs) <= MAX_OUTPUTS:
        raise ValueError(f"an epilogue declares 1 to {MAX_OUTPUTS} outputs, got {len(outputs)}")
    if not callable(split_block) and (len(decl.split_block) != 2
                                      or any(n < 1 or n & (n - 1) for n in decl.split_block)):
        raise ValueError(f"split_block is (BM, BN), two powers of two, got {split_block!r}")
    if decl.sumsq_of >= 0 and row_sum:
        raise ValueError("an epilogue keeps one kind of row sums: a sumsq output or row_sum")
    if (decl.sumsq_of >= 0 or row_sum or col_sum or bool(vectors)) != (finish is not None):
        raise ValueError("partial sums (a sumsq output, row_sum or col_sum) and vectors go with finish, which turns "
                         "them into results")
    names = decl.names()
    taken = {*MAINLOOP_PARAMS, *RESERVED} & set(names) | {n for n in names if names.count(n) > 1}
    if taken:
        raise ValueError(f"{epilogue.__name__}: names the kernels already use: {sorted(taken)}")

    def deco(host: Callable[..., Gemm]) -> Callable:
        bind = binder(host)
        fused_kernel = decl.fused_kernel(f"{host.__name__}_kernel", configs, restore)
        rows_kernel = decl.rows_kernel(f"{host.__name__}_rows_kernel")

        @functools.wraps(host)
        def fused(*args: Any, **kwargs: Any) -> Any:
            named = bind(args, kwargs)
            return _run_fused(decl, fused_kernel, host(**named), named, finish)

        @functools.wraps(host)
        def built_split(*args: Any, **kwargs: Any) -> Any:
            named = bind(args, kwargs)
            return _run_split(decl, rows_kernel, host(**named), named, finish)

        gluon_kernel = decl.gluon_kernel(f"{host.__name__}_gluon_kernel") if HAS_GLUON else None

        @functools.wraps(host)
        def built_gluon(*args: Any, **kwargs: Any) -> Any:
            named = bind(args, kwargs)
            return _run_gluon(decl, gluon_kernel, host(**named), named, finish)

        signature = inspect.signature(host).replace(return_annotation=Any)  # the outputs, not the declared Gemm
        fused.__signature__ = built_split.__signature__ = built_gluon.__signature__ = signature
        built = gluon_kernel and Gluon(built_gluon, lambda arguments: gluon_applies(host(**arguments), decl))
        dispatch = with_split(split or built_split, safe=safe, gluon=gluon or built, fuses=fuses)(fused)
        dispatch.kernel, dispatch.rows_kernel, dispatch.binds = fused_kernel, rows_kernel, tuple(binds)
        dispatch.declaration = decl
        dispatch.gluon_kernel, dispatch.built_gluon, dispatch.built_split = gluon_kernel, built_gluon, built_split
        return dispatch

    return deco


@dataclass
class _Asked:
    """What one call asks of a declaration: which outputs are stored, and whether the absmax partials are."""

    flags: dict[str, bool]
    stored: list[bool]
    recipe: Recipe | None

    @classmethod
    def of(cls, decl: Declaration, named: dict[str, Any]) -> _Asked:
        flags = {o.when.upper(): bool(named[o.when]) for o in decl.outputs if o.when}
        stored = [not o.when or flags[o.when.upper()] for o in decl.outputs]
        recipe = named[decl.outputs[decl.amax_of].fp8] if decl.amax_of >= 0 else None
        return cls(flags, stored, recipe)

    def kernel_flags(self, decl: Declaration, g: Gemm) -> dict[str, bool]:
        return {**self.flags, **{f: bool(g.flags[f]) for f in decl.call_flags},
                **({"AMAX": self.recipe is not None} if decl.amax_of >= 0 else {})}

    def outputs(self, decl: Declaration, g: Gemm, M: int, N: int, device: torch.device, dtypes: list[torch.dtype],
                reuse: dict[int, torch.Tensor]) -> list[torch.Tensor | None]:
        """The outputs asked for: those the call brings, else those of ``reuse`` (by index), else new
        [M, N * wide // cols] ones in the row layout (:func:`kernels.coda.align.empty_rows`); None for the others
        (a brought one too)."""
        return [None if not s else g.outputs[o.name] if o.name in g.outputs else reuse[i] if i in reuse else
                empty_rows(M, N * o.wide // o.cols, dt, device)
                for i, (o, s, dt) in enumerate(zip(decl.outputs, self.stored, dtypes))]

    def results(self, decl: Declaration, outs: list[torch.Tensor | None], amax: torch.Tensor | None,
                n_tiles: int) -> list[Any]:
        """The outputs asked for (None for the others), the fp8 one quantized."""
        results = []
        for i, (o, t) in enumerate(zip(decl.outputs, outs)):
            if i == decl.amax_of and self.recipe is not None:
                t = quantize_from_partials(t, amax, n_tiles, rowwise=self.recipe.rowwise_for(o.role))
            results.append(t)
        return results


def _inputs(decl: Declaration, g: Gemm) -> tuple:
    """The call's input values for the kernels: a :class:`Tile` through :func:`kernels.coda.align.aligned` (itself
    when in the row layout, else a copy in it), the others (and a None) as given."""
    return tuple(aligned(v) if isinstance(i, Tile) and v is not None else v for i, v in zip(decl.inputs, g.inputs))


def _returned(results: list[Any]) -> Any:
    return results[0] if len(results) == 1 else tuple(results)


def gluon_applies(g: Gemm, decl: Declaration) -> bool:
    """Where a declared kernel's Gluon variant takes a call: a Hopper GPU; a row-major A and a B row-major or the
    transposed view of an (N, K) tensor, both bf16 or fp16 of one dtype, or both fp8 (scales per tensor or per
    row), B transposed, accumulated in the fast mode; both as a TMA descriptor can address them (no copy); every
    row-major matrix of the epilogue (Tile inputs, outputs) with rows short enough that a sub-tile's offsets from
    its corner fit 32 bits (:func:`kernels.coda.epilogue.in_gluon`)."""
    if not _offsets_fit(g, decl):
        return False
    a, b = g.a, g.b
    fp8 = isinstance(a, Fp8) and isinstance(b, Fp8)
    if fp8:
        if promoted(g.recipe):
            return False
        a, b = a.data, b.data
    elif not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
              and a.dtype in (torch.bfloat16, torch.float16)):
        return False
    if a.dim() != 2 or b.dim() != 2 or a.stride(-1) != 1 or (b.stride(-1) != 1 and b.stride(0) != 1):
        return False
    storage, b_nk = operand(b)
    return (b_nk or not fp8) and is_aligned(a) and is_aligned(storage) and hopper(a.device)


def _offsets_fit(g: Gemm, decl: Declaration) -> bool:
    """Whether every [M, N * wide] matrix the Gluon variant's epilogue addresses by pointers (the Tile inputs given,
    the outputs, given or made by :func:`kernels.coda.align.empty_rows` with at most 16 bytes of padding a row) has
    a row stride for which a sub-tile's in-block offsets stay below 2^31 elements."""
    from kernels.coda.gluon_program import SUB_M
    widest = max([o.wide for o in decl.outputs] + [1]) * g.shape[1] + 16
    strides = [t.stride(0) for t in (*g.inputs, *g.outputs.values()) if isinstance(t, torch.Tensor) and t.dim() == 2]
    return max(strides + [widest]) * SUB_M < 2 ** 31


def _run_fused(decl: Declaration, kernel: Callable, g: Gemm, named: dict[str, Any],
               finish: Callable[..., tuple] | None) -> Any:
    gemm = FusedGemm(g.a, g.b, g.recipe)
    return _run_gemm(decl, g, named, finish, gemm, lambda: row_partials(kernel, gemm.M, gemm.N, gemm.device),
                     lambda: col_partials(kernel, gemm.M, gemm.N, gemm.device),
                     lambda args: gemm.launch(kernel, **args), lambda: launched_tiles(kernel, gemm.M, gemm.N))


def _run_gluon(decl: Declaration, kernel: Callable, g: Gemm, named: dict[str, Any],
               finish: Callable[..., tuple] | None) -> Any:
    from kernels.coda.gluon_program import SUB_M
    from kernels.coda.mainloop_gluon import BN, WsGemm
    gemm = WsGemm(g.a, g.b, kernel.__name__, rowwise=True)
    m_tiles, n_tiles = cdiv(gemm.M, SUB_M), cdiv(gemm.N, BN)
    empty = functools.partial(torch.empty, device=gemm.device, dtype=torch.float32)
    return _run_gemm(decl, g, named, finish, gemm, lambda: empty(gemm.M, n_tiles), lambda: empty(m_tiles, gemm.N),
                     lambda args: _launch_gluon(gemm, kernel, args), lambda: (m_tiles, n_tiles))


_STAGES: dict[tuple, int] = {}
"""Per Gluon kernel and launch (K's bytes, the operands' dtype, the flags): the ring stages that fit, once found."""


def _launch_gluon(gemm: Any, kernel: Callable, args: dict[str, Any]) -> None:
    """Launch a Gluon variant with the schedule's ring stages for its K (:func:`kernels.coda.mainloop_gluon.stages`),
    or fewer where the epilogue partition's layout conversions leave too little shared memory (found at the first
    compile of such a launch, then remembered)."""
    from kernels.coda.gluon_program import SUB_M
    from kernels.coda.mainloop_gluon import stages
    k_bytes = gemm.K * gemm.a.element_size()
    key = (kernel, k_bytes, gemm.a.dtype, tuple(sorted((k, v) for k, v in args.items() if isinstance(v, bool))))
    for n in range(_STAGES.get(key, stages(k_bytes)), 1, -1):
        try:
            gemm.launch(kernel, **args, n_stages=n, SUB_M=SUB_M)
        except OutOfResources:
            if n == 2:
                raise
            continue
        _STAGES[key] = n
        return


def _run_gemm(decl: Declaration, g: Gemm, named: dict[str, Any], finish: Callable[..., tuple] | None, gemm: Any,
              rows: Callable[[], torch.Tensor], cols: Callable[[], torch.Tensor],
              launch: Callable[[dict[str, Any]], None], tiles: Callable[[], tuple[int, int]],
              reuse: dict[int, torch.Tensor] | None = None) -> Any:
    """One call of a declared kernel (``gemm``: the GEMM output's ``M``, ``N``, ``device`` and ``out_dtype``; the
    fused and Gluon kernels' operands set up): the outputs (those of ``reuse`` by index: the split path's GEMM
    output, written over), partials (``rows()``: new row partials [M, >= n_tiles], ``cols()``: column ones) and
    vectors allocated, ``launch(args)`` with the declaration's parameters by name, then the results from the
    (m_tiles, n_tiles) that ``tiles()`` gives after the launch."""
    asked = _Asked.of(decl, named)
    M, N = gemm.M, gemm.N
    outs = asked.outputs(decl, g, M, N, gemm.device,
                         [named[o.like].dtype if o.like else gemm.out_dtype for o in decl.outputs], reuse or {})
    # an output not asked for: a placeholder never written (another output, else the row scale or an input)
    inputs = _inputs(decl, g)
    live = next(t for t in (*outs, g.row_scale, *inputs) if isinstance(t, torch.Tensor))
    args = {f"{decl.row_scale}_ptr": g.row_scale} if decl.row_scale else {}
    for i, v in zip(decl.inputs, inputs):
        args.update({f"{i.name}_ptr": v, f"stride_{i.name}": 0 if v is None else v.stride(0)} if isinstance(i, Tile)
                    else {i: v})
    args.update({f"{o.name}_ptr": live if t is None else t for o, t in zip(decl.outputs, outs)})
    args.update({f"stride_{o.name}": 0 if t is None else t.stride(0) for o, t in zip(decl.outputs, outs)})
    ss = rows() if "ss" in decl.partials else None
    amax = (rows() if ss is None else torch.empty_like(ss)) if asked.recipe else None
    parts = {"ss": ss, "amax": amax}
    if decl.partials:  # one not asked for points at one that is, else at the row scale (stride 1), else an output
        spare = next((t for t in (ss, amax, g.row_scale) if t is not None), live)
        args.update({f"{p}_ptr": spare if parts[p] is None else parts[p] for p in decl.partials})
        args[f"stride_{decl.partials[0]}"] = spare.stride(0)
    cs = cols() if decl.col_sum else None
    if cs is not None:
        args.update(cs_ptr=cs, stride_cs=cs.stride(0))
    vectors = {v: torch.zeros(M, device=gemm.device, dtype=torch.float32) for v in decl.vectors}
    args.update({f"{v}_ptr": t for v, t in vectors.items()})
    launch({**args, **asked.kernel_flags(decl, g)})
    m_tiles, n_tiles = tiles()
    results = asked.results(decl, outs, amax, n_tiles)
    return _returned(finish(named, g, results, Partials(ss, n_tiles, cs, m_tiles, vectors)) if finish else results)


def _run_split(decl: Declaration, kernel: Callable, g: Gemm, named: dict[str, Any],
               finish: Callable[..., tuple] | None) -> Any:
    c = split_matmul(g.a, g.b, g.recipe)
    M, N = c.shape
    dtypes = [named[o.like].dtype if o.like else c.dtype for o in decl.outputs]
    inplace = next((i for i, (o, dt) in enumerate(zip(decl.outputs, dtypes))
                    if o.cols == o.wide == 1 and dt == c.dtype and o.name not in g.outputs), -1)
    bm, bn, warps, m_tiles = decl.split_launch(M, N, c.device)
    n_tiles = cdiv(N, bn)
    empty = functools.partial(torch.empty, device=c.device, dtype=torch.float32)
    out = SimpleNamespace(M=M, N=N, device=c.device, out_dtype=c.dtype)
    return _run_gemm(decl, g, named, finish, out, lambda: empty(M, n_tiles), lambda: empty(m_tiles, N),
                     lambda args: kernel[(m_tiles, n_tiles)](c, M, N, c.stride(0), **args, BM=bm, BN=bn,
                                                             LOOP=m_tiles < cdiv(M, bm), num_warps=warps),
                     lambda: (m_tiles, n_tiles), reuse={inplace: c})


class Entry(Implementation):
    """A host function as one op's implementation: ``run`` calls ``call`` (a :class:`Binding`'s run) on the cell's
    native inputs; ``describe`` names the path (fused, split, gluon) each declared kernel of its last call took, the
    report's ``strategy`` column, as for ``coda-triton``."""

    def __init__(self, call: Callable[[Native], dict[str, Any]]):
        self.call = call
        self.recorder = Recorder()

    def run(self, native: Native) -> dict[str, Any]:
        self.recorder.start()
        return self.call(native)

    def describe(self, native: Native) -> str:
        return summary(self.recorder.launches())


def register(host: Callable, name: str, implementation: Callable[..., Any] | None = None,
             binds: Sequence[Binding] | None = None, **registry: Any) -> None:
    """Registry entries of the implementation ``name`` for every op a declared host function binds (``binds``; or
    any host function, with the ``binds`` given here):
    ``implementation(op, run, modes, description)`` makes one (an :class:`codabench.registry.Implementation`; by
    default an :class:`Entry` named by :func:`codabench.registry.entry` with ``registry``'s keywords: dtypes,
    requires, label; its source the declaring module), ``run`` calling the host function (:meth:`Binding.run`)."""
    for b in host.binds if binds is None else binds:
        run = b.run(host)
        for op in b.ops:
            modes = b.modes or OPS[op].modes
            REGISTRY.add(implementation(op, run, modes, b.description) if implementation is not None else
                         entry(Entry(run), op, name, host.__module__, b.description, modes=modes, **registry))
