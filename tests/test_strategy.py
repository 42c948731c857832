"""Fused or split (kernels/coda/strategy.py): the split paths against the fused ones, the choice (forced, measured,
cached), the record of what ran, and the harness's ``strategy`` column.

The numerics of each split path against float64 are the kernel tests' (test_coda_fwd/bwd/fp8 run every host function
under both strategies); here the two paths are compared with each other: same outputs, dtypes, shapes and layouts.
The choice on a GPU is exercised on the CPU with stand-ins (a fake device, scripted timings); the GPU tests at the end
run the real thing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
import torch

from codabench.case import Case
from codabench.correctness import CHECK_SEED, build_reference, check_impl
from codabench.discovery import load_plugin_file
from codabench.metrics import passes, rel_err
from codabench.registry import REGISTRY
from codabench.report import finalize
from codabench.results import load_run
from harness_helpers import PLUGINS, isolated_registry, make_runner
from kernel_helpers import rand
from kernels import layouts as L
from kernels.coda import plugin  # noqa: F401  (registers coda-triton)
from kernels.coda import strategy as S
from kernels.coda import tuning
from kernels.coda.cross_entropy import gemm_cross_entropy
from kernels.coda.gemm import mm, mm_acc
from kernels.coda.producer import gemm_residual_norm
from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm
from kernels.coda.rope import gemm_rope
from kernels.coda.scaled_linear import scaled_linear
from kernels.coda.swiglu import gemm_swiglu
from kernels.coda.swiglu_bwd import dgrad_swiglu
from workloads.fp8 import Recipe
from workloads.models import get_model
from workloads.ops import OPS

M, K, D, F2, V = 72, 40, 56, 48, 104  # tokens, producer K, hidden, 2 * ffn, vocab: none a multiple of the 32 tile
H, HKV, DH = 2, 1, 8


def calls(dtype: torch.dtype) -> dict[str, tuple]:
    """Every host function with a split path, and arguments that exercise its flags."""
    def r(*shape, seed, scale=1.0, mean=0.0):
        return rand(*shape, dtype=dtype, seed=seed, scale=scale, mean=mean)

    h, rstd = r(M, D, seed=1), rand(M, seed=2).abs() + 0.5
    gamma, x, zdz = r(D, seed=3, scale=0.1, mean=1.0), r(M, D, seed=4), rand(M, seed=5)
    target = torch.randint(0, V, (M,), generator=torch.Generator().manual_seed(6))
    target[::5] = -100
    return {
        "producer": (gemm_residual_norm, (r(M, K, seed=7), r(D, K, seed=8, scale=K ** -0.5), r(M, D, seed=9), gamma,
                                          1e-5), {}),
        "scaled_linear": (scaled_linear, (h, r(F2, D, seed=10, scale=D ** -0.5), rstd), {}),
        "swiglu_save": (gemm_swiglu, (h, r(F2, D, seed=11, scale=D ** -0.5), rstd, True), {}),
        "swiglu": (gemm_swiglu, (h, r(F2, D, seed=11, scale=D ** -0.5), rstd, False), {}),
        "rope": (gemm_rope, (h, r((H + 2 * HKV) * DH, D, seed=12, scale=D ** -0.5), rstd,
                             (torch.arange(M) * 331) % 4096, H, HKV, DH, 10000.0), {}),
        "ce": (gemm_cross_entropy, (h, r(V, D, seed=13, scale=D ** -0.5), rstd, target), {}),
        "ce_grad": (gemm_cross_entropy, (h, r(V, D, seed=13, scale=D ** -0.5), rstd, target),
                    {"reduction": "sum", "with_grad": True}),
        "dgrad_rmsnorm": (dgrad_rmsnorm, (r(M, F2, seed=14), r(F2, D, seed=15, scale=F2 ** -0.5), x, rstd, gamma, zdz,
                                          r(M, D, seed=16)), {"dz_scale": torch.tensor(0.75)}),
        "dgrad_rmsnorm_nores": (dgrad_rmsnorm, (r(M, F2, seed=14), r(F2, D, seed=15, scale=F2 ** -0.5), x, rstd, gamma,
                                                zdz), {"dz_scale": 0.5}),
        "dgrad_swiglu": (dgrad_swiglu, (r(M, D, seed=17), r(D, F2 // 2, seed=18, scale=D ** -0.5),
                                        r(M, F2, seed=19)), {}),
        "mm": (mm, (r(M, K, seed=20), r(K, D, seed=21, scale=K ** -0.5)), {}),
        "mm_transposed": (mm, (r(K, M, seed=22).T, r(K, D, seed=23, scale=K ** -0.5)), {}),
    }


def flat(out) -> list:
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(calls(torch.float32)))
def test_split_path_returns_what_the_fused_path_returns(name, dtype):
    """Same outputs in the same dtypes, shapes and (contiguous) layouts; values equal up to the GEMM's summation order
    in fp32, and up to the rounding of the GEMM output to the dtype (the split path's, as PyTorch's) in fp16."""
    fn, args, kwargs = calls(dtype)[name]
    fused, split = flat(fn.fused(*args, **kwargs)), flat(fn.split(*args, **kwargs))
    assert len(fused) == len(split)
    tol = 2e-6 if dtype == torch.float32 else 3e-3
    for i, (f, s) in enumerate(zip(fused, split)):
        assert (f is None) == (s is None), (name, i)
        if f is None:
            continue
        assert (s.shape, s.dtype, s.stride()) == (f.shape, f.dtype, f.stride()), (name, i)
        assert rel_err(s, f.double()) <= tol, (name, i, rel_err(s, f.double()))


def test_split_dgrad_rmsnorm_adds_into_dres_in_place():
    fn, args, kwargs = calls(torch.float32)["dgrad_rmsnorm"]
    dres = args[6].clone()
    dx, _, _ = fn.split(*args[:6], dres, inplace=True, **kwargs)
    assert dx.data_ptr() == dres.data_ptr()
    torch.testing.assert_close(dx, fn.fused(*args, **kwargs)[0], rtol=1e-5, atol=1e-5)


def test_split_layouts_are_the_fused_ones():
    """Interleaved gate/up columns in z_pre and dz_pre, the adjacent-pair RoPE layout: checked against PyTorch
    on the deinterleaved / half-split views."""
    _, (h, w_gu, rstd, _), _ = calls(torch.float32)["swiglu_save"]
    y, z = gemm_swiglu.split(h, w_gu, rstd, True)
    gate, up = L.deinterleave_cols(z)
    torch.testing.assert_close(gate, rstd[:, None] * (h @ w_gu[0::2].T), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    _, (dx, w_down, z_pre), _ = calls(torch.float32)["dgrad_swiglu"]
    dz_pre, _, _ = dgrad_swiglu.split(dx, w_down, z_pre)
    g, u = (t.clone().requires_grad_() for t in L.deinterleave_cols(z_pre))
    (torch.nn.functional.silu(g) * u).backward(dx @ w_down)
    torch.testing.assert_close(dz_pre, L.interleave_cols(g.grad, u.grad), rtol=1e-5, atol=1e-5)


# ---- the choice -----------------------------------------------------------------------------------------

def test_the_environment_forces_a_strategy_everywhere(monkeypatch):
    fn, args, kwargs = calls(torch.float32)["scaled_linear"]
    for forced in ("split", "fused"):
        monkeypatch.setenv(S.ENV, forced)
        with S.Recorder() as rec:
            fn(*args, **kwargs)
        assert rec.launches() == [("scaled_linear", forced)]
    monkeypatch.setenv(S.ENV, "auto")
    with S.Recorder() as rec:
        fn(*args, **kwargs)
    assert rec.launches() == [("scaled_linear", "fused")]  # auto on the CPU: nothing measured, fused
    monkeypatch.setenv(S.ENV, "fastest")
    with pytest.raises(ValueError, match="CODABENCH_STRATEGY must be fused, split, gluon or auto"):
        fn(*args, **kwargs)


def test_a_bad_forced_strategy_is_one_load_error_of_the_coda_plugins(tmp_path):
    """Not an error row per cell: the plugins that choose paths fail to load, with the one line that says why."""
    env = {**os.environ, "TRITON_INTERPRET": "1", S.ENV: "fastest"}
    out = subprocess.run([sys.executable, "run_bench.py", "--list", "--ops", "gemm_out"],
                         cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    failed = [line for line in out.stdout.splitlines() if "failed to load" in line]
    assert failed and all("CODABENCH_STRATEGY must be fused, split, gluon or auto, got 'fastest'" in line
                          for line in failed), out.stdout
    assert "coda-triton" not in out.stdout
    assert any("kernels.coda.plugin" in line for line in failed)


def _fused(x: torch.Tensor, n: int, inplace: bool = False, eps: float = 1e-5) -> str:
    return "fused"


def _split(x: torch.Tensor, n: int, inplace: bool = False, eps: float = 1e-5) -> str:
    return "split"


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """A stand-in GPU for the chooser: CPU tensors count as on "Test GPU", measurable, timed by ``times`` (per
    candidate, the do_bench medians it returns in turn); ``log`` lists each timed candidate. Tuning is on
    (``--tune``): new keys are measured, not predicted (tests/test_configs.py covers the default)."""
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    monkeypatch.setenv("CODABENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CODABENCH_AUTOTUNE_CACHE", raising=False)
    monkeypatch.delenv(S.ENV, raising=False)
    monkeypatch.setattr(S, "_device", lambda arguments: torch.device("cuda"))
    monkeypatch.setattr(S, "gpu_name", lambda device: "Test GPU")
    monkeypatch.setattr(S, "measurable", lambda device: True)
    state = {"times": {}, "log": []}

    def bench(fn):
        out = fn()
        state["log"].append(out)
        return state["times"][out].pop(0)

    monkeypatch.setattr(S, "bench_ms", bench)
    return state


def test_a_new_key_is_measured_once_chosen_by_the_lower_median_and_cached(gpu):
    seen = []
    dispatch = S.with_split(_split, safe=lambda a: (seen.append(dict(a)), {**a, "inplace": False})[1])(_fused)
    x = torch.zeros(8, 4)
    gpu["times"] = {"fused": [1.0, 1.3, 1.0], "split": [0.9, 0.9, 2.0]}  # medians 1.0 and 0.9
    with S.Recorder() as rec:
        assert dispatch(x, 3, inplace=True) == "split"
    assert gpu["log"] == ["fused", "split"] * S.ROUNDS  # interleaved rounds (after one untimed launch of each)
    # keyed and measured on the safe arguments
    assert seen == [{"x": x, "n": 3, "inplace": True, "eps": 1e-5}] * 2
    assert rec.launches() == [("_fused", "split")]
    assert dispatch(x, 3, inplace=True) == "split" and len(gpu["log"]) == 2 * S.ROUNDS  # known: not measured again
    assert dispatch(x, 3, inplace=False) == "split" and len(gpu["log"]) == 2 * S.ROUNDS  # in place or not: one key
    stored = json.loads(tuning.cache_file("Test GPU").read_text())
    (entry, records), = stored.items()
    assert entry == dispatch.chooser.entry and entry.startswith("strategy:_fused:")
    assert records == {S.call_key({"x": x, "n": 3, "inplace": False, "eps": 1e-5}):
                       {"strategy": "split", "fused_ms": 1.0, "split_ms": 0.9}}
    again = S.Chooser(_fused, _split, dict)  # another process: the file's choice, no timing
    assert again.choose({"x": x, "n": 3, "inplace": False, "eps": 1e-5}) == "split" and len(gpu["log"]) == 2 * S.ROUNDS
    gpu["times"] = {"fused": [1.0] * 3, "split": [0.99] * 3}  # another shape; split 1% faster: a tie, fused
    assert dispatch(torch.zeros(16, 4), 3) == "fused"
    assert len(json.loads(tuning.cache_file("Test GPU").read_text())[entry]) == 2


def test_a_call_key_holds_a_recipe_by_its_accumulation_mode():
    """A recipe argument is keyed by its accumulation mode: the rowwise recipe's dgrad (per-tensor operands, as the
    per-tensor recipe's) has the per-tensor one's key and shares its table entries; promoted accumulation has its
    own."""
    call = {"x": torch.empty(4, 8), "recipe": Recipe(rowwise=False)}
    key = S.call_key(call)
    assert json.loads(key)[-1] == ["recipe", "fast"] and S.call_key({**call, "recipe": Recipe(rowwise=True)}) == key
    assert json.loads(S.call_key({**call, "recipe": Recipe(rowwise=False, accum="promoted")}))[-1] == ["recipe",
                                                                                                      "promoted"]


def test_the_binder_binds_as_inspect_does_and_keeps_its_errors():
    """A host function's call is bound by plain dict work (the dispatch runs at every layer): the same arguments, in
    the signature's order, defaults filled, as ``inspect.Signature.bind`` + ``apply_defaults`` give, for every mix of
    positional and keyword arguments of real host functions; calls it cannot bind get inspect's TypeError."""
    import inspect
    calls = [((1, 2, 3, 4, 5, 6), {}), ((1, 2, 3, 4, 5, 6, 7), {"recipe": None}),
             ((1, 2), {"gamma": 5, "rstd": 4, "x": 3, "zdz": 6, "inplace": True}),
             ((), {"dz": 1, "w": 2, "x": 3, "rstd": 4, "gamma": 5, "zdz": None})]
    for fn in (dgrad_rmsnorm, gemm_residual_norm, dgrad_swiglu, mm):
        sig = inspect.signature(fn.fused)
        bind = S.binder(fn.fused)
        names = list(sig.parameters)
        for args, kwargs in calls + [(tuple(range(len(names))), {})]:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as e:
                with pytest.raises(TypeError, match=str(e)):
                    bind(args, kwargs)
                continue
            bound.apply_defaults()
            got = bind(args, kwargs)
            assert got == bound.arguments and list(got) == list(bound.arguments), (fn.__name__, args, kwargs)
    bind = S.binder(dgrad_rmsnorm.fused)
    for args, kwargs, err in (((1,) * 11, {}, "too many positional"), ((1,), {"dz": 2}, "multiple values"),
                              ((1, 2, 3, 4, 5, 6), {"nope": 1}, "unexpected keyword"), ((1,), {}, "missing")):
        with pytest.raises(TypeError, match=err):
            bind(args, kwargs)


def test_a_calls_key_and_paths_are_worked_out_once_per_shape(gpu, monkeypatch):
    """The chooser derives a call's JSON key and its paths once per :func:`shape_key` (shapes, strides, dtypes,
    flags), then looks them up; a transposed tensor of the same shape is another key (a Gluon path's ``applies``
    reads strides)."""
    made = []
    real = S.call_key
    monkeypatch.setattr(S, "call_key", lambda arguments: (made.append(1), real(arguments))[1])
    dispatch = S.with_split(_split, gluon=GLUON_WHERE_N_IS_3)(_fused)
    gpu["times"] = {"fused": [1.0] * 3, "split": [2.0] * 3}
    x = torch.zeros(8, 8)
    for _ in range(3):
        assert dispatch(x, 4) == "fused"
    assert len(made) == 1 and len(gpu["log"]) == 2 * S.ROUNDS
    assert S.shape_key({"x": x, "n": 4}) != S.shape_key({"x": x.T, "n": 4})
    assert S.shape_key({"x": x, "eps": 1e-5}) == S.shape_key({"x": x, "eps": 1e-6})  # as call_key: floats left out
    gpu["times"] = {"fused": [1.0] * 3, "split": [2.0] * 3}
    assert dispatch(x.T, 4) == "fused" and len(made) == 2  # same JSON key: the stored choice, not measured again
    assert len(gpu["log"]) == 2 * S.ROUNDS


def test_a_shipped_table_choice_serves_a_key_the_cache_lacks(gpu, tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "TABLES", tmp_path / "tuned")
    x = torch.zeros(8, 4)
    shipped, cached = ({"x": x, "n": n, "inplace": False, "eps": 1e-5} for n in (3, 4))
    chooser = S.Chooser(_fused, _split, dict)
    table = tuning.table_file("Test GPU")
    table.parent.mkdir()
    name = chooser.entry.rsplit(":", 1)[0]  # "strategy:_fused": tables are keyed by name, not source hash
    table.write_text(json.dumps({"kernels": {name: {S.call_key(shipped): {"strategy": "split"},
                                                    S.call_key(cached): {"strategy": "split"}}}}))
    tuning.store_entries(tuning.cache_file("Test GPU"), chooser.entry, {S.call_key(cached): {"strategy": "fused"}})
    assert chooser.choose(shipped) == "split" and chooser.choose(cached) == "fused" and not gpu["log"]
    monkeypatch.setenv("CODABENCH_TUNING_TABLES", "0")
    gpu["times"] = {"fused": [1.0] * 3, "split": [2.0] * 3}
    assert S.Chooser(_fused, _split, dict).choose(shipped) == "fused" and gpu["log"]  # measured, table off


@pytest.mark.parametrize("host", [dgrad_swiglu, dgrad_rmsnorm, gemm_residual_norm, gemm_swiglu, gemm_rope,
                                  scaled_linear, gemm_cross_entropy, mm, mm_acc])
def test_the_shipped_strategy_keys_name_every_keyed_parameter_of_their_host_function(host):
    """Every key of a shipped strategy table names its host function's parameters in the signature's order, all of
    them but those :func:`kernels.coda.strategy.call_key` leaves out (floats, tuples): a renamed or an added
    parameter (dgrad_swiglu's ``overwrite``) leaves no entry silently unmatched."""
    import inspect

    params = inspect.signature(host).parameters
    # a float or tuple is never in a key; an optional one (``tuple | None``) is when it is None
    keyed = [n for n, p in params.items() if not any(t in str(p.annotation) for t in ("float", "tuple"))]
    name = f"strategy:{host.__name__}"
    tables = [p for p in tuning.TABLES.glob("*.json") if name in json.loads(p.read_text())["kernels"]]
    assert tables
    for path in tables:
        for key in json.loads(path.read_text())["kernels"][name]:
            names = [p[0] for p in json.loads(key)]
            assert names == [n for n in params if n in names] and set(keyed) <= set(names), (path.name, key)


def test_pick_takes_the_fastest_path_only_beyond_the_margin():
    assert S.pick({"fused": 1.0, "split": 0.97, "gluon": 0.9}) == "gluon"
    assert S.pick({"fused": 1.0, "split": 0.9, "gluon": 0.95}) == "split"
    assert S.pick({"fused": 1.0, "split": 0.99, "gluon": 0.985}) == "fused"  # within the margin: a tie
    assert S.pick({"fused": 1.0, "split": 1.5}) == "fused"


def _gluon(x: torch.Tensor, n: int, inplace: bool = False, eps: float = 1e-5) -> str:
    return "gluon"


GLUON_WHERE_N_IS_3 = S.Gluon(_gluon, lambda arguments: arguments["n"] == 3)


def test_a_gluon_path_is_measured_and_forced_only_where_it_applies(gpu, monkeypatch):
    dispatch = S.with_split(_split, gluon=GLUON_WHERE_N_IS_3)(_fused)
    x = torch.zeros(8, 4)
    gpu["times"] = {"fused": [1.0] * 3, "split": [1.2] * 3, "gluon": [0.9] * 3}
    with S.Recorder() as rec:
        assert dispatch(x, 3) == "gluon"
    assert gpu["log"] == ["fused", "split", "gluon"] * S.ROUNDS and rec.launches() == [("_fused", "gluon")]
    records = tuning.load_entries(tuning.cache_file("Test GPU"), dispatch.chooser.entry)
    assert records[S.call_key({"x": x, "n": 3, "inplace": False, "eps": 1e-5})] == \
        {"strategy": "gluon", "fused_ms": 1.0, "split_ms": 1.2, "gluon_ms": 0.9}
    gpu["log"].clear()
    gpu["times"] = {"fused": [1.0] * 3, "split": [1.2] * 3}
    assert dispatch(x, 4) == "fused" and gpu["log"] == ["fused", "split"] * S.ROUNDS  # n = 4: no Gluon path
    monkeypatch.setenv(S.ENV, "gluon")
    assert dispatch(x, 3) == "gluon" and dispatch(x, 4) == "fused"  # forced where it applies, fused elsewhere


def test_a_call_the_fused_kernel_cannot_take_runs_split_unmeasured_even_when_fused_is_forced(gpu, monkeypatch):
    """dgrad_rmsnorm without a ZdZ: its fused epilogue needs c before the first tile, so only the split path can."""
    dispatch = S.with_split(_split, fuses=lambda arguments: arguments["n"] != 0)(_fused)
    x = torch.zeros(8, 4)
    with S.Recorder() as rec:
        assert dispatch(x, 0) == "split"
    assert gpu["log"] == [] and rec.launches() == [("_fused", "split")]  # nothing measured, and the report says so
    assert not tuning.load_entries(tuning.cache_file("Test GPU"), dispatch.chooser.entry)  # nothing stored
    monkeypatch.setenv(S.ENV, "fused")
    assert dispatch(x, 0) == "split" and dispatch(x, 1) == "fused"


def test_a_choice_made_before_the_gluon_path_existed_is_measured_again(gpu):
    x = torch.zeros(8, 4)
    chooser = S.Chooser(_fused, _split, dict, GLUON_WHERE_N_IS_3)
    with_gluon, without = ({"x": x, "n": n, "inplace": False, "eps": 1e-5} for n in (3, 4))
    old = {"strategy": "split", "fused_ms": 1.0, "split_ms": 0.5}  # timed fused and split only
    tuning.store_entries(tuning.cache_file("Test GPU"), chooser.entry,
                         {S.call_key(with_gluon): old, S.call_key(without): old})
    assert chooser.choose(without) == "split" and not gpu["log"]  # its paths were all timed: it serves
    gpu["times"] = {"fused": [1.0] * 3, "split": [0.5] * 3, "gluon": [0.4] * 3}
    assert chooser.choose(with_gluon) == "gluon" and len(gpu["log"]) == 3 * S.ROUNDS
    assert S.serves({"strategy": "split"}, ("fused", "split", "gluon"))  # an untimed record (a table's) serves


def test_mm_runs_the_mainloop_on_the_cpu_and_cublas_when_split(monkeypatch):
    a, b = rand(M, K, seed=1), rand(K, D, seed=2)
    for forced, path in (("fused", "fused"), ("split", "split"), ("gluon", "fused")):  # mm has no Gluon path
        monkeypatch.setenv(S.ENV, forced)
        with S.Recorder() as rec:
            out = mm(a, b)
        assert rec.launches() == [("mm", path)] and rel_err(out, a.double() @ b.double()) < 1e-6


def test_mm_acc_starts_and_accumulates_in_place_on_either_path(monkeypatch):
    """The LM head's weight gradient over two chunks of rows: the first chunk's GEMM, the second added into it in
    place (fp32 sums, one rounding to the accumulator's dtype per call), by the mainloop (fused) or cuBLAS (split)."""
    a1, a2 = rand(K, M, dtype=torch.float16, seed=3), rand(K, M, dtype=torch.float16, seed=4)
    b1, b2 = rand(K, D, dtype=torch.float16, seed=5), rand(K, D, dtype=torch.float16, seed=6)
    want = a1.double().T @ b1.double() + a2.double().T @ b2.double()
    for forced in ("fused", "split"):
        monkeypatch.setenv(S.ENV, forced)
        with S.Recorder() as rec:
            acc = mm_acc(a1.T, b1)
            out = mm_acc(a2.T, b2, acc)
        assert rec.launches() == [("mm_acc", forced)] * 2 and out is acc and acc.dtype == torch.float16
        assert rel_err(acc, want) < 2e-3, forced  # two fp16 roundings (unit roundoff 4.9e-4)


def test_the_key_holds_shapes_dtypes_and_flags_not_floats():
    key = S.call_key({"x": torch.zeros(8, 4, dtype=torch.float16), "n": 3, "flag": True, "none": None,
                      "eps": 1e-5, "freqs": (0.5, 0.25)})
    assert json.loads(key) == [["x", [8, 4], "torch.float16"], ["n", 3], ["flag", True], ["none", None]]


def test_stale_and_foreign_entries_are_ignored(gpu):
    x = torch.zeros(8, 4)
    args = {"x": x, "n": 3, "inplace": False, "eps": 1e-5}
    chooser = S.Chooser(_fused, _split, dict)
    path = tuning.cache_file("Test GPU")
    key = S.call_key(args)
    tuning.store_entries(path, chooser.entry.rsplit(":", 1)[0] + ":0123456789abcdef", {key: {"strategy": "split"}})
    tuning.store_entries(path, chooser.entry, {key: {"strategy": "fastest"}})
    gpu["times"] = {"fused": [1.0] * 3, "split": [2.0] * 3}
    assert chooser.choose(args) == "fused" and gpu["log"]  # measured: neither stored record counts
    assert json.loads(path.read_text())[chooser.entry][key]["strategy"] == "fused"  # the bad record replaced


def test_no_measurement_during_capture_or_tracing_and_no_file_when_the_cache_is_off(gpu, monkeypatch):
    x = torch.zeros(8, 4)
    args = {"x": x, "n": 3, "inplace": False, "eps": 1e-5}
    monkeypatch.setattr(S, "measurable", lambda device: False)
    assert S.Chooser(_fused, _split, dict).choose(args) == "fused" and not gpu["log"]
    assert not tuning.cache_file("Test GPU").exists()  # an unmeasured default is not stored
    monkeypatch.setattr(S, "measurable", lambda device: True)
    monkeypatch.setenv("CODABENCH_AUTOTUNE_CACHE", "0")
    gpu["times"] = {"fused": [2.0] * 3, "split": [1.0] * 3}
    assert S.Chooser(_fused, _split, dict).choose(args) == "split"
    assert not tuning.cache_file("Test GPU").exists()


def test_measurable_only_on_a_gpu_outside_capture_and_compilation(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert S.measurable(cuda) and not S.measurable(torch.device("cpu"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not S.measurable(cuda)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not S.measurable(cuda)


def test_strategy_entries_share_the_autotuning_file(tmp_path):
    path = tmp_path / "gpu.json"
    tuning.store_entries(path, "some_kernel:abc", {"[1]": {"kwargs": {"BM": 64}, "num_warps": 4, "num_stages": 3}})
    tuning.store_entries(path, "strategy:f:abc", {"[2]": {"strategy": "split"}})
    tuning.store_entries(path, "strategy:f:abc", {"[3]": {"strategy": "fused"}})
    assert tuning.load_entries(path, "strategy:f:abc") == {"[2]": {"strategy": "split"}, "[3]": {"strategy": "fused"}}
    assert tuning.load_entries(path, "some_kernel:abc")["[1]"]["num_warps"] == 4
    assert tuning.load_entries(path, "strategy:g:abc") == {}


# ---- the record -------------------------------------------------------------------------------------------

def test_the_recorder_sees_every_thread_and_restarts():
    fn, args, kwargs = calls(torch.float32)["scaled_linear"]
    rec = S.Recorder()
    rec.start()
    thread = threading.Thread(target=lambda: fn(*args, **kwargs))  # as autograd's backward thread would
    thread.start()
    thread.join()
    assert rec.launches() == [("scaled_linear", "fused")]
    rec.start()
    assert rec.launches() == []
    rec.stop()
    fn(*args, **kwargs)
    assert rec.launches() == []


def test_summary_names_each_function_once_in_order():
    assert S.summary([]) == ""
    launches = [("gemm_residual_norm", "fused"), ("gemm_swiglu", "split"), ("gemm_residual_norm", "split"),
                ("dgrad_rmsnorm", "fused"), ("dgrad_rmsnorm", "fused")]
    assert S.summary(launches) == "residual_norm:fused,split swiglu:split dgrad_rmsnorm:fused"
    many = [("dgrad_rmsnorm", "fused")] * 3 + [("dgrad_rmsnorm", "split")] * 8 + [("dgrad_rmsnorm", "fused")]
    assert S.summary(many) == "dgrad_rmsnorm:fusedx3,splitx8,fused"


# ---- the harness's strategy column ---------------------------------------------------------------------------

@pytest.mark.slow
def test_describe_fills_the_strategy_column_and_the_report(tmp_path, monkeypatch):
    """Each implementation's describe() after its cell's timing, as the row's strategy; a describe() that raises
    keeps the measured row; coda-triton names the path of each kernel of its last call (forward and backward)."""
    monkeypatch.setenv(S.ENV, "split")  # the worker process inherits it
    with isolated_registry():
        load_plugin_file(PLUGINS / "good.py")
        load_plugin_file(PLUGINS / "faulty.py")
        make_runner(tmp_path / "gemm", modes=("fwd",), impls=["torch-eager", "test-describes", "test-describe-fails"]
                    ).run()
        make_runner(tmp_path / "coda", ops=["rmsnorm_swiglu"], modes=("fwd", "bwd"), impls=["coda-triton"]).run()
    df, _, _ = load_run(tmp_path / "gemm")
    rows = df.set_index("impl")
    assert rows.loc["test-describes", "strategy"] == f"gemm:split ({get_model('tiny').tokens} rows)"
    bad = rows.loc["test-describe-fails"]
    assert bad["status"] == "ok" and bad["median_ms"] > 0 and bad["correct"] is True
    assert bad["strategy"].startswith("describe() failed: RuntimeError: no words")
    assert pd.isna(rows.loc["torch-eager", "strategy"])  # says nothing
    coda = load_run(tmp_path / "coda")[0].set_index("mode")["strategy"]
    assert coda["fwd"] == "residual_norm:split swiglu:split"
    assert coda["bwd"] == "residual_norm:split swiglu:split dgrad_rmsnorm:split mm:split"  # mm: cuBLAS
    html = finalize(tmp_path / "gemm").read_text()
    assert "<th class=\"l\">strategy</th>" in html and ">gemm:split (" in html and "describe() failed" in html
    assert "coda-triton names each of its GEMM kernels" in html  # the legend


# ---- GPU ---------------------------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the choice is measured there)")
GPU_OPS = [("rmsnorm_linear", "fwd_bwd"), ("rmsnorm_swiglu", "fwd_bwd"), ("rmsnorm_rope", "fwd_bwd"),
           ("rmsnorm_ce", "fwd_bwd"), ("lm_head_ce", "fwd"), ("block", "fwd_bwd"), ("rmsnorm_dgrad", "bwd"),
           ("swiglu_dgrad", "bwd")]


def passes_the_harness_check_on_the_gpu(op_name: str, mode: str, dtype: str = "bf16") -> str:
    """coda-triton's ``op_name`` in ``mode``, ``dtype`` (bf16 or an fp8 recipe), at a 1B-like shape with 1024 tokens,
    checked by the harness (the pass rule); what it says it ran (``describe``)."""
    op, impl = OPS[op_name], REGISTRY.get(op_name, "coda-triton")
    model = get_model("llama-1b").with_(tokens=1024, vocab=8192)
    case = Case(op, model, mode, dtype, torch.device("cuda"),
                op.make_inputs(model, torch.bfloat16, "cuda", CHECK_SEED))
    outcome = check_impl(build_reference(op, case), impl)
    assert outcome.correct, (outcome.errors, [(c.output, c.stats, c.torch_rel_err) for c in outcome.checks])
    return impl.describe({})


@gpu_only
@pytest.mark.parametrize("op_name,mode", GPU_OPS)
def test_split_and_fused_pass_the_harness_check_in_bf16_on_the_gpu(op_name, mode, strategy):
    """Every op of coda-triton under each strategy: the pass rule, and every kernel took that path (but a call the
    fused kernel cannot take, which runs split: rmsnorm_linear's RMSNorm backward has no ZdZ)."""
    ran = passes_the_harness_check_on_the_gpu(op_name, mode)
    unfusable = {"rmsnorm_linear": {"dgrad_rmsnorm"}}.get(op_name, set())
    took = {name: set(s.split(",")) for name, s in (part.split(":") for part in ran.split())}
    assert ran and all(s == {"split" if name in unfusable else strategy} for name, s in took.items()), ran


@gpu_only
def test_auto_measures_a_choice_on_the_gpu_stores_it_and_a_new_process_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CODABENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CODABENCH_AUTOTUNE_CACHE", raising=False)
    monkeypatch.setenv("CODABENCH_TUNING_TABLES", "0")  # the shipped tables hold this key: measure it here
    monkeypatch.setenv(tuning.TUNE_ENV, "1")  # measuring is opt-in (--tune); without it the key's path is predicted
    monkeypatch.setenv(S.ENV, "auto")
    dev = torch.device("cuda")
    a, w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16), torch.randn(2048, 2048, device=dev,
                                                                                dtype=torch.bfloat16) * 0.02
    res, gamma = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16), torch.ones(2048, device=dev,
                                                                                       dtype=torch.bfloat16)
    with S.Recorder() as rec:
        x, h, rstd = gemm_residual_norm(a, w, res, gamma, 1e-5)
    (name, chosen), = rec.launches()
    records = tuning.load_entries(tuning.cache_file(torch.cuda.get_device_name(dev)), gemm_residual_norm.chooser.entry)
    (key, record), = records.items()
    arguments = {"a": a, "w": w, "residual": res, "gamma": gamma, "eps": 1e-5, "recipe": None, "h_fp8": None}
    paths = gemm_residual_norm.chooser.strategies(arguments)
    assert paths == (("fused", "split", "gluon") if S.hopper(dev) else ("fused", "split"))
    assert record["strategy"] == chosen and all(record[f"{s}_ms"] > 0 for s in paths)
    assert chosen == S.pick({s: record[f"{s}_ms"] for s in paths})
    monkeypatch.setattr(S, "measure", lambda candidates: pytest.fail("a stored choice must not be measured again"))
    fresh = S.Chooser(gemm_residual_norm.fused, gemm_residual_norm.split, dict, gemm_residual_norm.chooser.gluon)
    assert S.call_key(arguments) == key and fresh.choose(arguments) == chosen
    x2, _, _ = gemm_residual_norm(a, w, res, gamma, 1e-5)  # the stored choice, and the same result as the first call
    assert torch.equal(x2, x)
    other = {**arguments, "a": a[:1000]}  # an unknown key while a CUDA graph is captured: fused, nothing measured
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        assert fresh.choose(other) == "fused"


hopper_only = pytest.mark.skipif(not (torch.cuda.is_available() and S.hopper(torch.device("cuda"))),
                                 reason="needs a Hopper GPU (sm_90): the Gluon kernels are written for it")


@hopper_only
@pytest.mark.parametrize("m,n,k", [(2048, 2048, 2048), (1000, 768, 320), (4096, 4096, 1024), (384, 8192, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_producer_matches_its_triton_twin_on_hopper(m, n, k, dtype):
    """The Gluon producer against the fused Triton kernel (its CPU-tested reference) and float64: x and rstd as the
    Triton kernel's (the same fp32 sums, rounded once), h within the pass rule (one more rounding: h = bf16(x) gamma);
    partial tiles at every edge (1000 x 768 x 320), one k-step (K = 64)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(m + n + k)
    a = torch.randn(m, k, device=dev, generator=g).to(dtype)
    w = (torch.randn(n, k, device=dev, generator=g) * k ** -0.5).to(dtype)
    res = torch.randn(m, n, device=dev, generator=g).to(dtype)
    gamma = (torch.randn(n, device=dev, generator=g) * 0.1 + 1).to(dtype)
    args = {"a": a, "w": w, "residual": res, "gamma": gamma, "eps": 1e-5, "recipe": None, "h_fp8": None}
    assert gemm_residual_norm.chooser.strategies(args) == ("fused", "split", "gluon")
    x, h, rstd = gemm_residual_norm.chooser.path("gluon")(**args)
    xt, ht, rstdt = gemm_residual_norm.fused(**args)
    assert (x.shape, x.dtype, h.dtype, rstd.dtype) == (xt.shape, xt.dtype, ht.dtype, rstdt.dtype)
    assert rel_err(x, xt.double()) <= 2e-3 and rel_err(rstd, rstdt.double()) <= 1e-5
    x64 = res.double() + a.double() @ w.double().T
    x_torch = res + torch.nn.functional.linear(a, w)  # PyTorch's unfused bf16: its error sets the bar
    for name, ours, ref, theirs in (("x", x, x64, x_torch), ("h", h, x64 * gamma.double(), x_torch * gamma)):
        assert passes(rel_err(ours, ref), rel_err(theirs, ref), dtype), (name, rel_err(ours, ref), rel_err(theirs, ref))


def swiglu_dgrad_args(dtype: str, m: int, f: int, d: int) -> dict:
    """Seeded dgrad_swiglu arguments on the GPU: bf16 operands, or fp8 ones as the dgrad's recipe gives them (dx e5m2,
    w_down e4m3 stored K-major, per-tensor scales)."""
    from workloads.fp8 import Recipe, quantize_as
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(m + f + d)
    dx, w = torch.randn(m, d, device=dev, generator=g), torch.randn(d, f, device=dev, generator=g) * d ** -0.5
    if dtype == "fp8":
        recipe = Recipe(rowwise=False)
        dx, w = quantize_as(dx, "grad", recipe), quantize_as(w, "weight_bwd", recipe).T
    else:
        dx, w = dx.to(torch.bfloat16), w.to(torch.bfloat16)
    return {"dx": dx, "w_down": w, "z_pre": torch.randn(m, 2 * f, device=dev, generator=g).to(torch.bfloat16),
            "recipe": None}


@hopper_only
@pytest.mark.parametrize("dtype,m,f,d", [(t, *s) for t, k1 in (("bf16", 64), ("fp8", 128))
                                         for s in ((2048, 2048, 2048), (1000, 776, 320), (384, 8192, k1),
                                                   (4096, 5504, 4096))])
def test_gluon_swiglu_dgrad_matches_its_triton_twin_on_hopper(dtype, m, f, d):
    """The Gluon SwiGLU dgrad (the built variant, its epilogue in a warp partition) against the fused Triton kernel,
    its CPU-tested reference, on bf16 operands and on fp8 ones (per-tensor scales, fast accumulation): dz_pre and y
    bit for bit (the same fp32 dy and math, rounded once), zdz to the order of its sums; partial tiles at every edge
    (1000 x 776 x 320), one k-step (d = 128 bytes), the 4-stage ring (d = 4096)."""
    args = swiglu_dgrad_args(dtype, m, f, d)
    assert dgrad_swiglu.chooser.strategies(args) == ("fused", "split", "gluon")
    dz, y, zdz = dgrad_swiglu.chooser.path("gluon")(**args)
    dzt, yt, zdzt = dgrad_swiglu.fused(**args)
    assert (dz.shape, dz.dtype, y.shape, y.dtype, zdz.shape, zdz.dtype) == \
        (dzt.shape, dzt.dtype, yt.shape, yt.dtype, zdzt.shape, zdzt.dtype)
    assert torch.equal(dz, dzt) and torch.equal(y, yt)
    assert rel_err(zdz, zdzt.double()) <= 1e-5


def test_a_gluon_path_is_bound_with_its_kernel_and_missing_where_gluon_cannot_be_imported():
    """The producer binds its Gluon function directly (the other declared kernels, the SwiGLU dgrad among them, their
    built variants); with a Triton without Gluon (here made so in a fresh process) the kernels still import, with no
    Gluon path, and a call has the fused and split paths only, forced gluon running fused."""
    from kernels.coda.producer_gluon import gemm_residual_norm_gluon
    assert gemm_residual_norm.chooser.gluon.function is gemm_residual_norm_gluon
    assert dgrad_swiglu.chooser.gluon.function is dgrad_swiglu.built_gluon
    script = (
        "import sys, torch\n"
        "sys.modules['triton.experimental.gluon'] = None\n"
        "from kernels.coda.producer import gemm_residual_norm\n"
        "from kernels.coda.swiglu_bwd import dgrad_swiglu\n"
        "from kernels.coda.swiglu import gemm_swiglu\n"
        "assert gemm_residual_norm.chooser.gluon is None and dgrad_swiglu.chooser.gluon is None\n"
        "assert gemm_swiglu.chooser.gluon is None and gemm_swiglu.gluon_kernel is None\n"
        "a, w = torch.randn(8, 16), torch.randn(16, 16)\n"
        "args = dict(a=a, w=w, residual=torch.randn(8, 16), gamma=torch.ones(16), eps=1e-5, recipe=None, h_fp8=None)\n"
        "assert gemm_residual_norm.chooser.strategies(args) == ('fused', 'split')\n"
        "assert gemm_residual_norm.chooser.choose(args) == 'fused'\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CODABENCH_STRATEGY": "gluon"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


@hopper_only
@pytest.mark.parametrize("op_name,mode,paths", [("block", "fwd_bwd", ("residual_norm", "dgrad_swiglu")),
                                                ("rmsnorm_linear", "fwd_bwd", ("residual_norm",)),
                                                ("producer_out", "fwd", ("residual_norm",)),
                                                ("swiglu_dgrad", "bwd", ("dgrad_swiglu",))])
def test_the_gluon_path_passes_the_harness_check_on_hopper(op_name, mode, paths, monkeypatch):
    """coda-triton with the Gluon path forced (where it applies: the producers and the SwiGLU dgrad; fused elsewhere),
    bf16, the pass rule."""
    monkeypatch.setenv(S.ENV, "gluon")
    ran = passes_the_harness_check_on_the_gpu(op_name, mode)
    assert all(f"{p}:gluon" in ran for p in paths), ran


@hopper_only
@pytest.mark.parametrize("dtype", ["fp8", "fp8-row"])
def test_the_gluon_swiglu_dgrad_passes_the_harness_check_in_fp8_on_hopper(dtype, monkeypatch):
    """swiglu_dgrad in both fp8 recipes (the dgrad's operands per tensor in either) with the Gluon path forced: the
    pass rule, and the Gluon kernel ran."""
    monkeypatch.setenv(S.ENV, "gluon")
    ran = passes_the_harness_check_on_the_gpu("swiglu_dgrad", "bwd", dtype)
    assert "dgrad_swiglu:gluon" in ran, ran
