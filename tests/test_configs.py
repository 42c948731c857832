"""Configs for shapes never tuned (kernels/coda/configs.py, tuning.predict, strategy.predicted): the nearest tuned
key in log-shape space, configs outside the kernel's list or pruned skipped, the stand-in table of the nearest GPU;
by default nothing is benchmarked or stored; ``--tune`` / CODABENCH_TUNE=1 reaches the tuning code; the tune command
writes the user cache."""
import importlib
import json
import os

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

import codabench.cli as cli
from kernels.coda import configs, precompile, tuning
from kernels.coda import strategy as S
from test_strategy import _fused, _split, gpu  # noqa: F401  (the stand-in GPU fixture)
from test_tuning import CONFIGS, scripted_bench, tuner

A, B = CONFIGS
LAUNCH = {"grid": None, "warmup": False}


def cfg(c: triton.Config) -> dict:
    return {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages}


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """Shipped tables in a temporary folder, an empty user cache, tuning off (the default); ``write(gpu, records)``
    writes the table of ``gpu`` with the kernel records ``records`` (name -> key as JSON -> record)."""
    monkeypatch.setattr(tuning, "TABLES", tmp_path / "tuned")
    monkeypatch.setenv("CODABENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CODABENCH_AUTOTUNE_CACHE", raising=False)
    monkeypatch.delenv("CODABENCH_TUNING_TABLES", raising=False)
    monkeypatch.delenv(tuning.TUNE_ENV, raising=False)

    def write(gpu_name: str, records: dict) -> None:
        path = tuning.table_file(gpu_name)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"gpu": gpu_name, "kernels": records}))

    return write


def test_split_key_separates_integers_from_flags_and_dtypes():
    sig, x = configs.split_key([1024, 4096, 2048, True, "torch.bfloat16"])
    assert sig == json.dumps(["#", "#", "#", True, "torch.bfloat16"]) and x == (10.0, 12.0, 11.0)
    nested = configs.split_key([["h", [16384, 2048], "torch.bfloat16"], ["heads", 32], ["promote", False]])
    assert nested[1] == (14.0, 11.0, 5.0) and "False" not in nested[0] and "false" in nested[0]


def test_nearest_picks_the_closest_key_of_the_same_signature_in_log_space():
    table = {json.dumps([m, 4096, 4096, True, "torch.bfloat16"]): f"m{m}" for m in (1024, 4096, 16384)}
    table[json.dumps([12000, 4096, 4096, False, "torch.bfloat16"])] = "other flag"
    table[json.dumps([12000, 4096, 4096, True, "torch.float16"])] = "other dtype"
    key = [9000, 4096, 4096, True, "torch.bfloat16"]
    assert configs.nearest(key, table) == "m16384"  # log2: 13.1 is nearer 14 than 12; a linear distance says 4096
    assert configs.nearest([2048, 4096, 4096, True, "torch.bfloat16"], table) == "m1024"  # a tie: the first key
    assert configs.nearest([9000, 4096, 4096, False, "torch.bfloat16"], table) == "other flag"
    assert configs.nearest([9000, 4096, 4096, True, "torch.float8_e4m3fn"], table) is None
    assert configs.nearest(key, table, accept=lambda r: r != "m16384") == "m4096"
    assert configs.nearest(key, table, exclude=json.dumps([16384, 4096, 4096, True, "torch.bfloat16"])) == "m4096"


def test_a_new_key_gets_the_nearest_config_in_the_kernels_list_without_benchmarking(tables):
    unknown = {"kwargs": {"BLOCK": 256}, "num_warps": 4, "num_stages": 2}  # left the kernel's list since
    tables("Test GPU", {"_copy": {"[4096]": cfg(B), "[1000000]": unknown, "[64]": cfg(A)}})
    launches = []
    t = tuner()
    t.run = lambda *args, **kwargs: launches.append(t.cache[(args[2],)])
    t._bench = lambda *args, **kwargs: pytest.fail("the default path must not benchmark")
    tuning.attach(t, lambda: "Test GPU")
    t.run(None, None, 5000, **LAUNCH)  # nearest: 4096
    t.run(None, None, 900000, **LAUNCH)  # the nearest entry's config is not in the list: the next nearest, 4096
    t.run(None, None, 100, **LAUNCH)  # nearest: 64
    assert launches == [B, B, A]
    assert not tuning.cache_file("Test GPU").exists()  # predictions are never stored as tuned


def test_a_config_too_large_for_the_gpu_gives_way_to_the_next_that_fits(tables):
    """A config whose binary needs more shared memory than the GPU has (Triton raises OutOfResources loading it,
    before anything runs: the first config of a kernel no table vouches for, on a GPU with less shared memory) is
    replaced for its key by the next config pruning leaves; with none left the error is raised."""
    tables("Test GPU", {"_copy": {"[4096]": cfg(A)}})
    launches, too_large = [], set()
    t = tuner()

    def run(*args, **kwargs):
        c = t.cache[(args[2],)]
        if json.dumps(cfg(c)) in too_large:
            raise OutOfResources(312344, 232448, "shared memory")
        launches.append(c)
        return "ran"

    t.run = run
    t._bench = lambda *args, **kwargs: pytest.fail("the default path must not benchmark")
    tuning.attach(t, lambda: "Test GPU")
    t.run(None, None, 5000, **LAUNCH)  # A predicted and filed for the key (as a dry pass compiles it, loading nothing)
    too_large.add(json.dumps(cfg(A)))
    assert t.run(None, None, 5000, **LAUNCH) == "ran" and launches == [A, B]  # A does not load: B launched
    assert t.cache[(5000,)] == B  # kept for the key: the next launch goes straight to B
    t.run(None, None, 5000, **LAUNCH)
    assert launches == [A, B, B]
    too_large.add(json.dumps(cfg(B)))
    with pytest.raises(OutOfResources):
        t.run(None, None, 6000, **LAUNCH)


def test_a_known_key_launches_the_kernel_as_autotuners_run_would_without_building_its_key_again(tables,
                                                                                                  monkeypatch):
    """A launch whose key has a config goes straight to the kernel's JIT launch with the config's arguments and
    ``best_config`` set (Autotuner.run would build its key from the ~40 arguments again: ~40 us of host time a
    launch); the key is the one Autotuner.run files the launch under (its own run finds it: nothing tuned)."""
    x = torch.zeros(8, dtype=torch.float16)
    key = json.dumps([4096, "torch.float16", "torch.float16"])
    tables("Test GPU", {"_copy": {key: cfg(B)}})
    t = triton.autotune(configs=CONFIGS, key=["N"])(tuner().fn)
    calls = []
    monkeypatch.setattr(t.fn, "run", lambda *args, **kwargs: calls.append((args, kwargs)) or "ran")
    t._bench = lambda *args, **kwargs: pytest.fail("a known key must not be tuned")
    tuning.attach(t, lambda: "Test GPU")
    assert t.run(x, y_ptr=x, N=4096, grid=(1,), warmup=False) == "ran" and cfg(t.best_config) == cfg(B)
    assert calls == [((x,), {"y_ptr": x, "N": 4096, "grid": (1,), "warmup": False, **B.all_kwargs()})]
    t.best_config = None
    assert triton.runtime.autotuner.Autotuner.run(t, x, y_ptr=x, N=4096, grid=(1,), warmup=False) == "ran"
    assert calls[1] == calls[0] and cfg(t.best_config) == cfg(B)


def test_a_pruned_config_is_skipped_and_with_no_neighbour_the_first_left_is_taken(tables):
    tables("Test GPU", {"_copy": {"[4096]": cfg(B), "[64]": cfg(A)}})
    t = triton.autotune(configs=CONFIGS, key=["N"],
                        prune_configs_by={"early_config_prune": lambda configs, nargs, **kw: [A]})(tuner().fn)
    t._bench = lambda *args, **kwargs: pytest.fail("the default path must not benchmark")
    assert tuning.predict(t, (5000,), (None, None, 5000), LAUNCH, "Test GPU") == (A, "predicted")
    assert tuning.predict(tuner(), (5000,), (None, None, 5000), LAUNCH, "Other GPU") == (A, "default")


def test_a_gpu_without_a_table_draws_on_the_nearest_gpus_table(tables):
    tables("NVIDIA H100 80GB HBM3", {"_copy": {"[4096]": cfg(B)}})
    t = tuner()
    args = (None, None, 5000)
    assert tuning.predict(t, (5000,), args, LAUNCH, "NVIDIA H200") == (B, "predicted")  # H200 <- H100
    assert tuning.predict(t, (5000,), args, LAUNCH, "NVIDIA H100 PCIe") == (B, "predicted")  # another H100
    assert tuning.predict(t, (5000,), args, LAUNCH, "NVIDIA A100-SXM4-80GB") == (A, "default")  # no stand-in
    tables("NVIDIA H200", {"_copy": {"[64]": cfg(A)}})  # its own table, however far, comes first
    assert tuning.predict(t, (5000,), args, LAUNCH, "NVIDIA H200") == (A, "predicted")
    assert configs.family("NVIDIA-GH200-480GB") is None and configs.family("NVIDIA H200 NVL") == "H200"


def test_the_users_tuned_keys_are_neighbours_too(tables):
    tables("Test GPU", {"_copy": {"[64]": cfg(A)}})
    t = tuner()
    tuning.store_entries(tuning.cache_file("Test GPU"), tuning.kernel_id(t), {"[8192]": cfg(B)})
    assert tuning.predict(t, (5000,), (None, None, 5000), LAUNCH, "Test GPU") == (B, "predicted")


def test_a_dry_pass_goes_on_past_a_new_key_with_its_predicted_config(tables, monkeypatch):
    tables("Test GPU", {"_copy": {"[4096]": cfg(B)}})
    launches = []
    t = tuner()
    t.run = lambda *args, **kwargs: launches.append(t.cache[(args[2],)])
    tuning.attach(t, lambda: "Test GPU")
    monkeypatch.setattr(precompile, "_DRY", True)
    t.run(None, None, 5000, **LAUNCH)  # no Untuned: the dry pass compiles the predicted config
    assert launches == [B]


def test_tune_env_reaches_the_tuning_code_which_then_benchmarks_and_stores(tables, monkeypatch):
    tables("Test GPU", {"_copy": {"[4096]": cfg(B)}})
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    t = tuner()
    t.run = lambda *args, **kwargs: None
    t._bench = scripted_bench({A: [1.0, 1.0, 1.0, 1.0], B: [2.0]})
    tuning.attach(t, lambda: "Test GPU")
    t.run(None, None, 5000, **LAUNCH)
    assert t.cache[(5000,)] is A  # tuned, not B the prediction
    assert json.loads(tuning.cache_file("Test GPU").read_text())[tuning.kernel_id(t)] == {"[5000]": cfg(A)}


def test_the_run_commands_tune_flag_sets_the_env_the_worker_inherits(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning.TUNE_ENV, raising=False)
    assert not tuning.tuning_on()
    assert cli.main(["--suite", "smoke", "--ops", "gemm_out", "--list", "--out", str(tmp_path / "run")]) == 0
    assert not tuning.tuning_on()
    assert cli.main(["--suite", "smoke", "--ops", "gemm_out", "--list", "--tune", "--out", str(tmp_path / "run")]) == 0
    assert os.environ[tuning.TUNE_ENV] == "1" and tuning.tuning_on()


def test_by_default_a_new_strategy_key_takes_the_nearest_choice_unmeasured(gpu, tables, monkeypatch):
    assert not tuning.tuning_on()  # the tables fixture, set up after the gpu fixture, turned tuning off
    monkeypatch.setattr(S, "measure", lambda candidates: pytest.fail("the default path must not measure"))
    chooser = S.Chooser(_fused, _split, dict)
    near, far = ({"x": torch.zeros(m, 4), "n": 3, "inplace": False, "eps": 1e-5} for m in (1024, 16))
    tables("Test GPU", {chooser.entry.rsplit(":", 1)[0]: {
        S.call_key(near): {"strategy": "split", "fused_ms": 1.0, "split_ms": 0.5},
        S.call_key(far): {"strategy": "fused", "fused_ms": 1.0, "split_ms": 1.5}}})
    assert chooser.choose({**near, "x": torch.zeros(2000, 4)}) == "split"
    assert chooser.choose({**near, "x": torch.zeros(20, 4)}) == "fused"
    assert not tuning.cache_file("Test GPU").exists() and not gpu["log"]
    lone = S.Chooser(_fused, _split, dict)  # no table of its name: fused
    monkeypatch.setattr(lone, "entry", "strategy:nothing:0")
    assert lone.choose(near) == "fused"


def test_a_neighbours_times_decide_among_the_paths_the_call_has():
    gluon_won = {"strategy": "gluon", "fused_ms": 1.0, "split_ms": 0.9, "gluon_ms": 0.5}
    assert S.predicted(gluon_won, ("fused", "split", "gluon")) == "gluon"
    assert S.predicted(gluon_won, ("fused", "split")) == "split"  # no gluon here: the next fastest
    assert S.predicted({"strategy": "split"}, ("fused", "split")) == "split"  # no times: its strategy
    assert S.predicted({"strategy": "gluon"}, ("fused", "split")) == "fused"
    assert S.predicted(None, ("fused", "split")) == "fused"


def test_the_tune_command_runs_the_coda_cells_with_tuning_on_into_the_user_cache(tables, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    runs = []

    def run(argv):  # a stand-in for the run command: one new key of a two-config kernel, as its worker would meet it
        runs.append(argv)
        assert "--tune" in argv and "--model" in argv
        monkeypatch.setenv(tuning.TUNE_ENV, "1")  # as the real run command sets it
        t = tuner()
        t.run = lambda *args, **kwargs: None
        t._bench = scripted_bench({A: [2.0], B: [1.0]})
        tuning.attach(t, lambda: "Test GPU")
        t.run(None, None, 12345, **LAUNCH)
        return 0

    monkeypatch.setattr(cli, "main", run)
    tuning.main(["tune", "--model", "mine:hidden=3072,ffn=8192,heads=24,vocab=32000", "--tokens", "16381",
                 "--suites", "full,train", "--out", str(tmp_path / "runs")])
    assert [a[a.index("--impls") + 1] for a in runs] == ["coda-triton", "hf-coda"]
    assert all(a[a.index("--tokens") + 1] == "16381" for a in runs)
    stored = json.loads(tuning.cache_file("Test GPU").read_text())
    assert stored[tuning.kernel_id(tuner())] == {"[12345]": cfg(B)}
    assert "1 new entries" in capsys.readouterr().out


def test_the_tune_command_refuses_without_models_or_a_gpu(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        tuning.main(["tune", "--tokens", "4096"])
    assert e.value.code == 2 and "--model" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        tuning.main(["tune", "--model", "m:hidden=64,ffn=128,heads=2,vocab=100"])
    assert e.value.code == 2 and "no GPU" in capsys.readouterr().err


def test_tuning_runs_tune():
    assert "--tune" in tuning.tuning_run_args("full")


def test_a_config_is_voted_for_by_the_nearest_keys_weighted_by_closeness(tables):
    """The nearest key's config loses to one that two keys almost as near hold; a far majority does not win."""
    tables("Test GPU", {"_copy": {"[4096]": cfg(B), "[3500]": cfg(A), "[3000]": cfg(A)}})
    assert tuning.predict(tuner(), (4000,), (None, None, 4000), LAUNCH, "Test GPU") == (A, "predicted")
    tables("Test GPU", {"_copy": {"[4096]": cfg(B), "[64]": cfg(A), "[32]": cfg(A)}})
    assert tuning.predict(tuner(), (4000,), (None, None, 4000), LAUNCH, "Test GPU") == (B, "predicted")


def test_config_rule_counts_leave_one_out_matches_and_reads_the_strategy_cost_off_the_records():
    from test_benchmarks import load_script

    rule = load_script("config_rule")
    a, b = cfg(A), cfg(B)
    table = {"_copy": {"[64]": a, "[128]": a, "[4096]": b, "[8192]": b, "[100000]": a}}
    [(name, n, predicted, hits)] = rule.agreement(table, None, {"_copy": {rule._config_text(c) for c in (a, b)}})
    assert (name, n, predicted) == ("_copy", 5, 5)
    assert hits["nearest"] == 4 and hits["frequent"] == 2  # 100000: its nearest, 8192, holds b; 4096, 8192: a by 3 to 1
    other = {"_copy": {"[100]": b}}
    [(_, _, _, hits)] = rule.agreement(table, other, {"_copy": {rule._config_text(c) for c in (a, b)}})
    assert hits["nearest"] == 2  # the stand-in table's one key predicts b everywhere
    records = {json.dumps([["x", [m, 64], "torch.bfloat16"]]): {"strategy": s, "fused_ms": 1.0, "split_ms": t}
               for m, s, t in ((1024, "split", 0.5), (2048, "split", 0.6), (65536, "fused", 2.0))}
    [(fn, n, right, geo, worst, fused)] = rule.strategy_costs({"strategy:f": records})
    assert (fn, n, right) == ("f", 3, 2) and worst == pytest.approx(2.0 / 1.0)  # 65536 predicted split from 2048
    assert fused == pytest.approx((2 * 1 / 0.6) ** (1 / 3))


def test_the_check_shape_and_the_timed_shape_share_a_binary_when_their_config_is_the_same():
    """M, N, K are plain arguments of every autotuned CODA kernel (neither constexpr nor excluded from
    specialization), so Triton specializes them only as it specializes any plain integer."""
    from triton.runtime.jit import JITFunction

    modules = [importlib.import_module(f"kernels.coda.{name}") for name in (
        "gemm", "producer", "rope", "swiglu", "swiglu_bwd", "rmsnorm_bwd", "cross_entropy", "scaled_linear")]
    kernels = [v for m in modules for v in (getattr(v, "kernel", v) for v in vars(m).values())  # declared: .kernel
               if isinstance(v, tuning.Autotuner)]
    assert len(kernels) == 8
    for k in kernels:
        fn = k.fn
        while hasattr(fn, "fn"):  # through the interpreter's or Triton's wrapper to the Python function
            fn = fn.fn
        params = {p.name: p for p in JITFunction(fn).params}
        assert all(not params[n].is_constexpr and not params[n].do_not_specialize for n in "MNK"), k


def test_triton_specializes_a_plain_integer_only_on_its_divisibility_by_16():
    """2048 and 16384 tokens compile one binary per config, 16381 another. This reads a private helper of Triton
    (3.6 to 3.9 have it); a release without it is reported as a skip, by name."""
    try:
        from triton.backends import BaseBackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError as e:
        pytest.skip(f"this Triton has no native_specialize_impl ({e}): the specialization rule is not checked")

    def spec(v):
        return native_specialize_impl(BaseBackend, v, False, True, True)

    assert spec(2048) == spec(16384) != spec(16381)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_with_no_table_a_key_starts_from_the_shipped_tables_most_frequent_config_of_its_element_size(dtype):
    """The default config (no tuned neighbour: a GPU without a table) is the first pruning leaves; pruning puts the
    configs with 128-byte K rows first, so it is the config the shipped tables chose most often for operands of that
    size (16-bit: 128x256x64, fp8: 128x256x128; in fp8 a 16-bit config cost 20-27% on an H200)."""
    from kernels.coda.mainloop import GPU_CONFIGS, _prune

    a = torch.empty(0, dtype=dtype)
    first = cfg(_prune(GPU_CONFIGS, {"M": 16384, "N": 4096, "a": a})[0])
    fp8 = dtype.itemsize == 1
    for table in sorted(tuning.TABLES.glob("*.json")):
        chosen = [json.dumps(r, sort_keys=True) for name, records in json.loads(table.read_text())["kernels"].items()
                  if not name.startswith("strategy:") for key, r in records.items() if ("float8" in key) == fp8]
        assert json.dumps(first, sort_keys=True) == max(set(chosen), key=chosen.count), table.name
