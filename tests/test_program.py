"""Declared CODA kernels (kernels/coda/program.py): an epilogue declared outside the package gets a fused kernel and a
split twin that compute the same outputs (optional, fp8, wide and brought outputs, row and column sums, vectors,
flags and per-tile values as declared), bad declarations fail, and the package's declared kernels launch with the
tuning keys their shipped tables hold."""
from __future__ import annotations

import importlib
import inspect
import json

import pytest
import torch
import triton
import triton.language as tl

from codabench.case import Case
from codabench.registry import Native
from benchmarks import compare_ptx
from kernels.coda import configs, tuning
from kernels.coda.epilogue import add_tile, gather_cols, given, join_pairs, load_cols, load_rows, load_tile
from kernels.coda.mainloop import subtiled_configs
from kernels.coda.program import Binding, Gemm, Output, Partials, Tile, coda
from kernels.coda.reduce import finish_col_sum, finish_row_sum
from tests.kernel_helpers import DTYPES, check, launches, rand
from workloads import fp8
from workloads.fp8 import Recipe, quantize
from workloads.models import get_model
from workloads.ops import OPS

M, K, N = 40, 24, 64


@triton.jit
def shift_square(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """(z + c, (z + c)^2 on the even columns): c a column vector."""
    u = z + load_cols(args[0], off_n, N, BN)[None, :]
    even, _ = u.reshape(BM, BN // 2, 2).split()
    return u, even * even


@coda(shift_square, outputs=(Output("u", when="keep_u"), Output("sq", cols=2, fp8="sq_fp8")), inputs=("c_ptr",),
      row_scale="r", configs=subtiled_configs((2, 1)))
def gemm_shift_square(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, c: torch.Tensor, keep_u: bool,
                      sq_fp8: Recipe | None = None) -> Gemm:
    return Gemm(x, w.T, row_scale=r, inputs=(c,))


def _reference(x, w, r, c):
    u = r.double()[:, None] * (x.double() @ w.double().T) + c.double()
    return u, u[:, 0::2] ** 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_declared_kernel_runs_fused_and_split(dtype, strategy):
    x, w = rand(M, K, dtype=dtype, seed=1), rand(N, K, dtype=dtype, seed=2, scale=K ** -0.5)
    r, c = rand(M, seed=3, scale=0.1, mean=1.0), rand(N, dtype=dtype, seed=4)
    with launches() as names:
        u, sq = gemm_shift_square(x, w, r, c, keep_u=True)
        none, sq2 = gemm_shift_square(x, w, r, c, keep_u=False)
    assert names == [f"gemm_shift_square_{'kernel' if strategy == 'fused' else 'rows_kernel'}"] * 2
    assert none is None and torch.equal(sq, sq2)
    u64, sq64 = _reference(x, w, r, c)
    ut = (r[:, None] * (x.float() @ w.float().T) + c.float()).to(dtype)
    check("u", u, u64, ut)
    check("sq", sq, sq64, (ut.float()[:, 0::2] ** 2).to(dtype))


def test_an_fp8_output_is_quantized_from_the_epilogues_partials(strategy):
    x, w = rand(M, K, seed=1), rand(N, K, seed=2, scale=K ** -0.5)
    r, c = rand(M, seed=3, scale=0.1, mean=1.0), rand(N, seed=4)
    for rowwise in (False, True):
        _, sq = gemm_shift_square(x, w, r, c, keep_u=False)
        _, q = gemm_shift_square(x, w, r, c, keep_u=False, sq_fp8=Recipe(rowwise=rowwise))
        want = quantize(sq, rowwise=rowwise)
        assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(q.scale, want.scale)


@triton.jit
def plus_tile(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """z plus the tile of a matrix (descriptor ``args[1]``), times a scalar ``args[0]``."""
    return (args[0] * add_tile(z, args[1], off_m, off_n),)


@coda(plus_tile, outputs=(Output("out", like="res"),), inputs=("alpha", Tile("res")), configs=subtiled_configs((2,)))
def gemm_plus_tile(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, alpha: float) -> Gemm:
    return Gemm(x, w.T, inputs=(alpha, res))


def test_a_tile_input_is_read_by_both_paths_in_its_own_dtype(strategy):
    x, w = rand(M, K, dtype=torch.float16, seed=1), rand(N, K, dtype=torch.float16, seed=2, scale=K ** -0.5)
    res = rand(M, N, seed=5)
    out = gemm_plus_tile(x, w, res, 0.5)
    ref = 0.5 * (x.double() @ w.double().T + res.double())
    check("out", out, ref, 0.5 * ((x @ w.T).float() + res))  # PyTorch's GEMM rounds to fp16, as the split path's


@triton.jit
def pairs_and_sums(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """(t + z on both columns of each pair, z), and the rows' sums of z: t the [M, 2N] tile of ``args[0]``."""
    t = load_tile(args[0], off_m, 2 * off_n)
    return t + join_pairs(z, z, BM, 2 * BN), z, tl.sum(z, axis=1)


def _sums(arguments: dict, gemm: Gemm, outputs: list, partials: Partials) -> tuple:
    return (*outputs, finish_row_sum(partials.ss, partials.n_tiles))


@coda(pairs_and_sums, outputs=(Output("p", wide=2, like="t"), Output("z")), inputs=(Tile("t", wide=2),),
      row_sum=True, configs=subtiled_configs((2,)), finish=_sums)
def gemm_pairs(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Gemm:
    g = Gemm(x, w.T, inputs=(t.contiguous(),))
    assert t.shape == (g.shape[0], 2 * g.shape[1])
    return g


def test_wide_tiles_and_row_sums_of_the_epilogue_in_both_paths(strategy):
    """A [M, 2N] input and output (blocks twice as wide as the GEMM's tile) and the rows' sums of a value the
    epilogue returns, summed over the N tiles by ``finish``."""
    x, w = rand(M, K, dtype=torch.float16, seed=1), rand(N, K, dtype=torch.float16, seed=2, scale=K ** -0.5)
    t = rand(M, 2 * N, seed=6)
    with launches() as names:
        p, z, s = gemm_pairs(x, w, t)
    assert names[0] == f"gemm_pairs_{'kernel' if strategy == 'fused' else 'rows_kernel'}"
    assert p.shape == (M, 2 * N) and p.dtype == torch.float32 and z.dtype == torch.float16 and s.shape == (M,)
    z64 = x.double() @ w.double().T
    zt = (x @ w.T).float()  # PyTorch's GEMM rounds to fp16, as the split path's
    check("p", p, t.double() + z64.repeat_interleave(2, dim=1), t + zt.repeat_interleave(2, dim=1))
    check("z", z, z64, zt.half())
    check("s", s, z64.sum(1), zt.sum(1))


def _sumsq(arguments: dict, gemm: Gemm, outputs: list, partials: Partials) -> tuple:
    return (*outputs, finish_row_sum(partials.ss, partials.n_tiles))


@coda(plus_tile, outputs=(Output("out", sumsq=True),), inputs=("alpha", Tile("res")), configs=subtiled_configs((2,)),
      finish=_sumsq)
def gemm_plus_tile_sumsq(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, alpha: float) -> Gemm:
    return Gemm(x, w.T, inputs=(alpha, res))


def test_the_sums_of_squares_of_an_output_in_both_paths(strategy):
    """A sumsq output without a split path of the declaration's own: the built one keeps the row sums too."""
    x, w, res = rand(M, K, seed=1), rand(N, K, seed=2, scale=K ** -0.5), rand(M, N, seed=5)
    out, ss = gemm_plus_tile_sumsq(x, w, res, 0.5)
    ref = 0.5 * (x.double() @ w.double().T + res.double())
    torch_out = 0.5 * (x @ w.T + res)
    check("out", out, ref, torch_out)
    check("ss", ss, (ref ** 2).sum(1), (torch_out ** 2).sum(1))


@triton.jit
def _scale_rows(z, args, off_m, M, N, BM: tl.constexpr):
    """Once per tile: 2 z, and the epilogue's args with the tile's rows of v loaded."""
    v_ptr, acc, ADD = args
    return 2.0 * z, (load_rows(v_ptr, off_m, M, BM), acc, ADD)


@triton.jit
def add_into(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """(u, u): ``u = z v`` per row, plus the tile of acc with the flag ADD; the second u's column sums are kept."""
    v, acc, ADD = args
    u = z * v[:, None]
    if ADD:
        u = add_tile(u, acc, off_m, off_n)
    return u, u


def _col_sums(arguments: dict, gemm: Gemm, outputs: list, partials: Partials) -> tuple:
    return (*outputs, finish_col_sum(partials.cs, partials.m_tiles))


@coda(add_into, outputs=(Output("out"),), inputs=("v_ptr", Tile("acc")), flags=("ADD",), tile=_scale_rows,
      col_sum=True, configs=subtiled_configs((2,)), restore=("out",), finish=_col_sums,
      fuses=lambda arguments: arguments["fuse"])
def gemm_add_into(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor, acc: torch.Tensor, add: bool,
                  fuse: bool = True) -> Gemm:
    return Gemm(x, w.T, inputs=(v, acc), flags={"ADD": add}, outputs={"out": acc})


@pytest.mark.parametrize("add", [False, True])
def test_flags_a_tile_hook_column_sums_and_an_output_given_in_place(strategy, add):
    """A flag of the call, row values loaded once per tile, column sums finished per M tile, and an output the call
    brings (written in place over an input it reads); ``fuses`` false sends a call to the split path."""
    x, w = rand(M, K, seed=1), rand(N, K, seed=2, scale=K ** -0.5)
    v, acc = rand(M, seed=3, mean=1.0), rand(M, N, seed=4)
    u64 = 2 * (x.double() @ w.double().T) * v.double()[:, None] + (acc.double() if add else 0)
    ut = 2 * (x @ w.T) * v[:, None] + (acc if add else 0)
    with launches() as names:
        out, cs = gemm_add_into(x, w, v, acc, add)
    assert out is acc and names[0] == f"gemm_add_into_{'kernel' if strategy == 'fused' else 'rows_kernel'}"
    check("out", out, u64, ut)
    check("cs", cs, u64.sum(0), ut.sum(0))
    with launches() as names:
        gemm_add_into(x, w, v, acc.clone(), add, fuse=False)
    assert names[0] == "gemm_add_into_rows_kernel"
    assert gemm_add_into.kernel.restore_value == ["out_ptr"] and gemm_add_into.kernel.keys[-1] == "ADD"


def test_the_split_kernels_results_do_not_depend_on_its_block_shape(monkeypatch):
    """The built split kernel at the block shape a declaration names (``split_block``; here taken as on a GPU): one
    block a program, or (a :data:`kernels.coda.program.SplitLaunch`) 2 or 3 programs each looping over every 2nd or
    3rd block of rows; partial blocks at the edges of M = 40 and N = 64, the Tile input, the row values of the tile
    hook and the column sums (per program along M) all as at the interpreter's 16 x 32."""
    from kernels.coda import program
    x, w = rand(M, K, seed=1), rand(N, K, seed=2, scale=K ** -0.5)
    v, acc = rand(M, seed=3, mean=1.0), rand(M, N, seed=4)
    results = []
    looping = (lambda m, n, device: (8, 64, 4, 2), lambda m, n, device: (4, 32, 2, 3))
    for block in ((16, 32), (8, 64), (1, 128), (32, 16), *looping):
        monkeypatch.setattr(program, "INTERPRET", block == (16, 32))
        split = coda(add_into, outputs=(Output("out"),), inputs=("v_ptr", Tile("acc")), flags=("ADD",),
                     tile=_scale_rows, col_sum=True, configs=subtiled_configs((2,)), restore=("out",),
                     finish=_col_sums, split_block=block)(inspect.unwrap(gemm_add_into)).built_split
        with launches() as names:
            out, cs = split(x, w, v, acc.clone(), True)
        assert names[0] == "gemm_add_into_rows_kernel"
        results.append((out, cs))
    (out, cs), *others = results
    u64 = 2 * (x.double() @ w.double().T) * v.double()[:, None] + acc.double()
    check("out", out, u64, 2 * (x @ w.T) * v[:, None] + acc)
    for other_out, other_cs in others:
        assert torch.equal(other_out, out) and torch.allclose(other_cs, cs, rtol=1e-5, atol=1e-5)


@triton.jit
def diagonal(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """(z,), and each row's z[m, m % N] written into the vector ``args[0]`` by the tile that holds it."""
    rows = off_m + tl.arange(0, BM)
    v, hit = gather_cols(z, rows % N, off_n, BN)
    tl.store(args[0] + rows, v, mask=hit & (rows < M))
    return (z,)


def _diagonal(arguments: dict, gemm: Gemm, outputs: list, partials: Partials) -> tuple:
    return (*outputs, partials.vectors["d"])


@coda(diagonal, outputs=(Output("z"),), vectors=("d",), finish=_diagonal)
def gemm_diagonal(x: torch.Tensor, w: torch.Tensor) -> Gemm:
    return Gemm(x, w.T)


@triton.jit
def scaled_shift(z, args, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """(z v + s,): each row times v and plus the tile of s, each only where the call gives it."""
    v_ptr, s = args
    if given(v_ptr):
        z = z * load_rows(v_ptr, off_m, M, BM)[:, None]
    if given(s):
        z = add_tile(z, s, off_m, off_n)
    return (z,)


@coda(scaled_shift, outputs=(Output("z"),), inputs=("v_ptr", Tile("s")))
def gemm_scaled_shift(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor | None, s: torch.Tensor | None) -> Gemm:
    return Gemm(x, w.T, inputs=(v, s))


@pytest.mark.parametrize("v_given", [False, True])
@pytest.mark.parametrize("s_given", [False, True])
def test_an_input_the_call_leaves_out_is_told_apart_when_the_kernel_compiles(strategy, v_given, s_given):
    """A pointer or Tile input given as None reaches the epilogue as 0, and ``given`` says so (a constexpr: the branch
    that reads it is not compiled); given, it is read: in the fused and the split kernel."""
    x, w = rand(M, K, seed=1), rand(N, K, seed=2, scale=K ** -0.5)
    v, s = rand(M, seed=3, mean=1.0), rand(M, N, seed=4)
    z = gemm_scaled_shift(x, w, v if v_given else None, s if s_given else None)
    z64 = (x.double() @ w.double().T) * (v.double()[:, None] if v_given else 1) + (s.double() if s_given else 0)
    check("z", z, z64, (x @ w.T) * (v[:, None] if v_given else 1) + (s if s_given else 0))


def test_a_vector_the_epilogue_scatters_into_reaches_finish_in_both_paths(strategy):
    x, w = rand(M, K, seed=1), rand(N, K, seed=2, scale=K ** -0.5)
    z, d = gemm_diagonal(x, w)
    rows = torch.arange(M)
    assert d.dtype == torch.float32 and torch.equal(d, z.float()[rows, rows % N])


def test_bad_declarations_fail_at_import():
    with pytest.raises(ValueError, match="1 to 2 outputs"):
        coda(shift_square, outputs=())
    with pytest.raises(ValueError, match="go with finish"):
        coda(pairs_and_sums, outputs=(Output("p", wide=2), Output("z")), row_sum=True)
    with pytest.raises(ValueError, match="go with finish"):
        coda(add_into, outputs=(Output("out"),), col_sum=True)
    with pytest.raises(ValueError, match="go with finish"):
        coda(diagonal, outputs=(Output("z"),), vectors=("d",))
    with pytest.raises(ValueError, match="one kind of row sums"):
        coda(pairs_and_sums, outputs=(Output("p", sumsq=True), Output("z")), row_sum=True, finish=_sums)
    with pytest.raises(ValueError, match=r"already use: \['a_ptr', 'stride_a'\]"):
        coda(shift_square, outputs=(Output("a"),))
    for block in ((16, 96), (0, 256), (16,)):
        with pytest.raises(ValueError, match="split_block is"):
            coda(shift_square, outputs=(Output("u"),), inputs=("c_ptr",), split_block=block)


def _tuning_signature(kernel, call) -> str:
    """The signature (:func:`kernels.coda.configs.split_key`) of the autotuning key ``call`` launches ``kernel``
    with: its key arguments, then the dtype of every tensor argument in launch order, as the autotuner builds it."""
    launched = {}

    def run(*args, **kwargs):
        launched.update(zip(kernel.arg_names, args), **kwargs)
        raise compare_ptx._Launched

    orig, kernel.run = kernel.run, run
    try:
        call()
    except compare_ptx._Launched:
        pass
    finally:
        kernel.run = orig
    args = {k: v for k, v in launched.items() if k in kernel.arg_names}
    return configs.split_key([args[k] for k in kernel.keys] + [str(v.dtype) for v in args.values()
                                                               if hasattr(v, "dtype")])[0]


@pytest.mark.parametrize("case", ["producer-bf16", "scaled_linear-bf16", "swiglu-bf16", "rope-bf16",
                                  "cross_entropy-bf16", "swiglu_bwd-bf16", "rmsnorm_bwd-bf16"])
def test_declared_kernels_launch_with_tuning_keys_the_shipped_tables_hold(case):
    """The key's argument dtypes come in the kernel's launch order: a declaration that moved a tensor parameter would
    miss every shipped entry of its kernel. Meta-device calls of benchmarks/compare_ptx.py's cases (rmsnorm_bwd: as
    the kernels suite calls it without dres and scale, and as the training step calls it, with dres)."""
    C = compare_ptx
    _, name, call, _ = C.KERNELS[case.rsplit("-", 1)[0]]
    host = _host(case.rsplit("-", 1)[0])
    calls = [lambda: call(False)]
    if case.startswith("rmsnorm_bwd"):
        args = (C._t(C.M, C.F), C._t(C.F, C.D), C._t(C.M, C.D), C._rstd(), C._t(C.D), C._rstd())
        calls = [lambda: host(*args), lambda: host(*args, C._t(C.M, C.D))]
    for launch in calls:
        sig = _tuning_signature(host.kernel, launch)
        for gpu in ("NVIDIA-H200", "NVIDIA-H100-80GB-HBM3"):
            keys = json.loads((tuning.TABLES / f"{gpu}.json").read_text())["kernels"][name]
            assert any(configs.split_key(json.loads(k))[0] == sig for k in keys), (gpu, sig)


def test_a_binding_calls_its_host_with_the_cells_inputs_and_names_its_results():
    """The op binding: the cell's native inputs reach the host function's parameters of their names (the others
    left out), ``args`` adds or replaces arguments from the inputs and the cell's context, a ``recipe`` parameter
    gets the cell's fp8 recipe, the results are named in order and a None result is dropped."""
    def host(a, b, flag=False, scale=1.0, recipe=None):
        return a + b * scale, a if flag else None, recipe

    def native(inputs: dict, model, dtype: str = "bf16") -> Native:
        case = Case(OPS["gemm_out"], model, "fwd", dtype, torch.device("cpu"), {})
        return Native(inputs, case.context)

    tiny = get_model("tiny")
    run = Binding(("op",), ("sum", "a", "recipe"), "a test",
                  lambda n: {"flag": n.model.layers > 1, "b": 10 * n["b"]}).run(host)
    assert run(native({"a": 1, "b": 2, "unused": 5}, tiny.with_(layers=1))) == {"sum": 21}
    assert run(native({"a": 1, "b": 2}, tiny.with_(layers=2))) == {"sum": 21, "a": 1}
    fp8_cell = run(native({"a": 1, "b": 2}, tiny.with_(layers=1), "fp8"))
    assert fp8_cell["recipe"] == fp8.recipe("fp8", "fast") and "recipe" not in run(native({"a": 1, "b": 2}, tiny))
    assert Binding(("op",), (None, "a"), "").run(lambda a, b: (a, b))(native({"a": 1, "b": 2}, tiny)) == {"a": 2}


DECLARED = [case for case in compare_ptx.KERNELS if case != "gemm"]
"""The declared kernels, by benchmarks/compare_ptx.py's names (its ``gemm`` is the plain mainloop, not declared)."""


def _host(case: str):
    """The declared host function of compare_ptx's kernel ``case`` (the one whose ``.kernel`` it names)."""
    module, name, _, _ = compare_ptx.KERNELS[case]
    return next(v for v in vars(importlib.import_module(module)).values() if getattr(v, "kernel", None)
                and v.kernel.base_fn.__name__ == name)


def test_every_declared_kernel_gets_a_gluon_variant_where_it_applies(monkeypatch):
    """Built from the declaration (:mod:`kernels.coda.gluon_program`): each declared kernel has a Gluon kernel, and it
    is the Gluon path of those that bring no hand-written one; it applies on Hopper to bf16 / fp16 operands (B
    row-major or transposed) and fp8 ones (B transposed, fast accumulation), as TMA can address them."""
    from kernels.coda import program
    from workloads.fp8 import E4M3, Fp8
    for case in DECLARED:
        host = _host(case)
        assert host.gluon_kernel is not None, case
        if case not in ("producer", "swiglu_bwd"):
            assert host.chooser.gluon.function is host.built_gluon, case
    monkeypatch.setattr(program, "hopper", lambda device: True)
    decl = _host("producer").declaration

    def gluon_applies(g: Gemm) -> bool:
        return program.gluon_applies(g, decl)

    a, w = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(48, 32, dtype=torch.bfloat16)
    one = torch.ones(())
    fa, fw = Fp8(torch.empty(64, 32, dtype=E4M3), torch.ones(64, 1)), Fp8(torch.empty(48, 32, dtype=E4M3), one)
    assert gluon_applies(Gemm(a, w.T)) and gluon_applies(Gemm(a, w.T.contiguous()))
    assert gluon_applies(Gemm(a.half(), w.half().T))
    assert gluon_applies(Gemm(fa, fw.T, Recipe(rowwise=True)))
    assert not gluon_applies(Gemm(a.float(), w.float().T))  # no fp32 wgmma here
    assert not gluon_applies(Gemm(a, w.half().T))  # mixed
    assert not gluon_applies(Gemm(fa, fw.T, Recipe(rowwise=True, accum="promoted")))
    assert not gluon_applies(Gemm(fa, Fp8(torch.empty(32, 48, dtype=E4M3), one)))  # fp8 B row-major
    odd = torch.empty(64, 33, dtype=torch.bfloat16)[:, :31]  # rows of 66 bytes: no descriptor without a copy
    assert not gluon_applies(Gemm(odd, torch.empty(48, 31, dtype=torch.bfloat16).T))
    # a Tile input whose rows are so long that a sub-tile's offsets from its corner pass 2^31 elements: not Gluon
    long_rows = torch.empty(64, 48, device="meta").as_strided((64, 48), (2 ** 27, 1))
    assert not gluon_applies(Gemm(a, w.T, inputs=(long_rows,)))
    monkeypatch.setattr(program, "hopper", lambda device: False)
    assert not gluon_applies(Gemm(a, w.T))


def _gluon_case(case: str, operands: str, M: int, D: int, F: int, V: int) -> tuple[tuple, dict]:
    """Seeded GPU arguments of one declared host function's call; ``operands``: "bf16", "fp16" (every tensor in that
    dtype), "fp8-row" or "fp8-tensor" (the forward kernels' operands under that recipe; the dgrads' per tensor, as
    the recipes give them; the other tensors bf16)."""
    from workloads.fp8 import quantize_as
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(M + D)
    half = torch.float16 if operands == "fp16" else torch.bfloat16
    fp8 = operands.removeprefix("fp8-") if operands.startswith("fp8") else None
    r = lambda *s, sc=1.0: (torch.randn(*s, device=dev, generator=g) * sc).to(half)  # noqa: E731
    rec, per_tensor = (Recipe(rowwise=fp8 == "row"), Recipe(rowwise=False)) if fp8 else (None, None)
    act = (lambda t: quantize_as(t.float(), "act", rec)) if fp8 else (lambda t: t)  # noqa: E731
    weight = (lambda t: quantize_as(t.float(), "weight", rec)) if fp8 else (lambda t: t)  # noqa: E731
    grad = (lambda t: quantize_as(t.float(), "grad", per_tensor)) if fp8 else (lambda t: t)  # noqa: E731
    weight_bwd = (lambda t: quantize_as(t.float(), "weight_bwd", per_tensor).T) if fp8 else (lambda t: t)  # noqa: E731
    rstd = torch.rand(M, device=dev, generator=g) + 0.5
    if case == "producer":
        return (act(r(M, F)), weight(r(D, F, sc=F ** -.5)), r(M, D), r(D, sc=.1) + 1, 1e-5, rec), {}
    if case == "scaled_linear":
        return (act(r(M, D)), weight(r(D, D, sc=D ** -.5)), rstd, rec), {}
    if case == "swiglu":
        return (act(r(M, D)), weight(r(2 * F, D, sc=D ** -.5)), rstd, True, rec), {}
    if case == "rope":
        return (act(r(M, D)), weight(r(3 * D, D, sc=D ** -.5)), rstd, torch.arange(M, device=dev) % 4096, D // 128,
                D // 128, 128, 500000.0), {"recipe": rec}
    if case == "cross_entropy":
        target = torch.randint(0, V, (M,), device=dev, generator=g)
        return (act(r(M, D)), weight(r(V, D, sc=D ** -.5)), rstd, target), {"with_grad": True, "recipe": rec}
    if case == "rmsnorm_bwd":
        return ((grad(r(M, F)), weight_bwd(r(F, D, sc=F ** -.5)), r(M, D), rstd, r(D, sc=.1) + 1,
                 torch.randn(M, device=dev, generator=g)), {"dres": r(M, D), "recipe": per_tensor})
    if case == "swiglu_bwd":
        return (grad(r(M, D)), weight_bwd(r(D, F, sc=D ** -.5)), r(M, 2 * F)), {"recipe": per_tensor}
    return (r(M, D), r(F, D, sc=D ** -.5), r(F)), {}


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


gpu_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                reason="needs a Hopper GPU (sm_90): the Gluon variants are written for it")


@gpu_hopper
@pytest.mark.parametrize("shape", [(4096, 2048, 8192, 32000), (1000, 776, 1544, 5003)])
@pytest.mark.parametrize("operands", ["bf16", "fp16", "fp8-row", "fp8-tensor"])
@pytest.mark.parametrize("case", DECLARED)
def test_the_gluon_variant_of_a_declared_kernel_equals_its_fused_kernel_on_hopper(case, operands, shape):
    """Each declared kernel's built Gluon variant against its fused Triton kernel (the CPU-tested reference), bf16,
    fp16 and fp8 operands, at a preset-like shape and at one with partial tiles at every edge: every output the epilogue
    stores bit for bit (the same fp32 tile, the same epilogue, rounded once), the finished sums (rstd, zdz,
    log-sum-exps) to the order of their additions, and what is rounded from them (dlogits, dgamma) to one
    rounding."""
    if (case == "rope" and shape[1] % 128) or (case == "example" and operands.startswith("fp8")):
        pytest.skip("rope needs whole 128-wide heads; the example kernel takes plain operands")
    host = _host(case)
    args, kwargs = _gluon_case(case, operands, *shape)
    ours, ref = _tensors(host.built_gluon(*args, **kwargs)), _tensors(host.fused(*args, **kwargs))
    assert [(t.shape, t.dtype) for t in ours] == [(t.shape, t.dtype) for t in ref]
    for i, (x, y) in enumerate(zip(ours, ref)):
        if x.dtype == torch.float32:  # finished from partials of other tile shapes: sums in another order
            assert ((x.double() - y.double()).norm() / y.double().norm()).item() <= 1e-5, (case, i)
        elif (case, i) in (("cross_entropy", 2), ("rmsnorm_bwd", 2)):  # dlogits, dgamma: from those sums, rounded
            ulp = torch.finfo(x.dtype).smallest_normal * torch.finfo(x.dtype).eps  # a subnormal's (fp16 dlogits)
            assert torch.allclose(x.float(), y.float(), rtol=2 ** -7, atol=ulp), (case, i)
        else:
            assert torch.equal(x, y), (case, i, (x.double() - y.double()).abs().max().item())


def test_a_gluon_variant_launches_with_the_most_ring_stages_that_fit(monkeypatch):
    """The schedule's stages for K (5 at 4096 bytes a row), one fewer at a time while the compile runs out of shared
    memory, the stages that fit remembered for the next call of that launch; out of memory at 2 stages: the error."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from triton.runtime.errors import OutOfResources
    from kernels.coda import program
    monkeypatch.setattr(program, "_STAGES", {})
    tried = []

    class Gemm16:  # a launch whose shared memory fits at ``fits`` stages
        K, a = 2048, torch.empty(1, dtype=torch.bfloat16)

        def __init__(self, fits: int) -> None:
            self.fits = fits

        def launch(self, kernel, n_stages: int, SUB_M: int, **args) -> None:
            tried.append(n_stages)
            if n_stages > self.fits:
                raise OutOfResources(n_stages, self.fits, "shared memory")

    kernel = object()
    program._launch_gluon(Gemm16(3), kernel, {"FLAG": True})
    assert tried == [5, 4, 3]
    tried.clear()
    program._launch_gluon(Gemm16(3), kernel, {"FLAG": True})
    program._launch_gluon(Gemm16(5), kernel, {"FLAG": False})  # another launch of the kernel: its own stages
    assert tried == [3, 5]
    with pytest.raises(OutOfResources):
        program._launch_gluon(Gemm16(1), object(), {})


def test_the_host_arithmetic_is_tritons():
    """kernels/coda/host.py's plain-Python cdiv and next_power_of_2 (triton's are constexpr functions, ~9 us a host
    call) give triton's values."""
    from kernels.coda.host import cdiv, next_power_of_2
    for a in (*range(0, 70), 16381, 16384, 128256, 151936, 2**31 + 5):
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 3, 16, 64, 128, 256):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
