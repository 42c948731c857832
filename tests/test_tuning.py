"""The on-disk autotuning cache (kernels/coda/tuning.py): keyed by GPU model, Triton version, kernel source,
shape and dtypes; stale or foreign entries are ignored."""
import json

import pytest
import triton
import triton.language as tl

from kernels.coda import tuning

CONFIGS = [triton.Config({"BLOCK": 32}, num_warps=4, num_stages=2), triton.Config({"BLOCK": 64}, num_warps=8, num_stages=3)]


@triton.jit
def _copy(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)


@triton.jit
def _copy_edited(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)


def tuner(fn=_copy, configs=CONFIGS):
    return triton.autotune(configs=configs, key=["N"])(fn)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """An empty cache, and tuning on (``--tune``): these tests tune; tests/test_configs.py covers the default."""
    monkeypatch.setenv("CODABENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CODABENCH_AUTOTUNE_CACHE", raising=False)
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    return tmp_path


KEY = (4096, "torch.bfloat16", True)


def test_round_trip_restores_the_winner_under_its_exact_key(cache_dir):
    path = tuning.cache_file("NVIDIA H100 80GB HBM3")
    assert path.parent == cache_dir / "autotune" and "H100" in path.name and triton.__version__ in path.name
    t = tuner()
    t.cache[KEY] = CONFIGS[1]
    tuning.store(t, [KEY], path)
    fresh = tuner()
    assert tuning.load(fresh, path) == 1
    assert fresh.cache == {KEY: CONFIGS[1]}  # the tuple key with its int, str and bool survives JSON


def test_cache_file_follows_the_environment_after_it_was_asked_for(cache_dir, tmp_path, monkeypatch):
    """The path is built once per environment (every strategy choice asks for it), not once per process."""
    first = tuning.cache_file("NVIDIA H200")
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("CODABENCH_CACHE_DIR", str(other))
    assert tuning.cache_file("NVIDIA H200") == other / "autotune" / first.name
    monkeypatch.delenv("CODABENCH_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.cache_file("NVIDIA H200") == tmp_path / "home" / ".cache" / "codabench" / "autotune" / first.name
    monkeypatch.setenv("CODABENCH_CACHE_DIR", str(cache_dir))
    assert tuning.cache_file("NVIDIA H200") == first


def test_other_gpu_other_kernel_source_and_unknown_configs_are_not_used(cache_dir):
    h100, h200 = tuning.cache_file("NVIDIA H100 80GB HBM3"), tuning.cache_file("NVIDIA H200")
    assert h100 != h200
    t = tuner()
    t.cache[KEY] = CONFIGS[1]
    tuning.store(t, [KEY], h100)
    assert tuning.load(tuner(), h200) == 0
    edited = tuner(_copy_edited)
    assert tuning.kernel_id(edited) != tuning.kernel_id(t)
    assert tuning.load(edited, h100) == 0
    assert tuning.load(tuner(configs=[CONFIGS[0], triton.Config({"BLOCK": 128}, num_warps=4)]), h100) == 0


def test_store_merges_with_the_file_and_survives_a_corrupt_one(cache_dir):
    path = tuning.cache_file("gpu")
    a, b = tuner(), tuner(_copy_edited)
    a.cache[KEY] = CONFIGS[0]
    b.cache[(8192,)] = CONFIGS[1]
    tuning.store(a, [KEY], path)
    tuning.store(b, [(8192,)], path)
    assert set(json.loads(path.read_text())) == {tuning.kernel_id(a), tuning.kernel_id(b)}
    path.write_text("{not json")
    tuning.store(a, [KEY], path)
    assert tuning.load(tuner(), path) == 1


def test_attach_tunes_before_the_launch_then_stores_and_reloads(cache_dir):
    a, b = CONFIGS
    order = []
    t = tuner()
    t.run = lambda *args, **kwargs: order.append(("launch", t.cache.get(t_key)))
    t._bench = lambda *args, config, **kwargs: order.append(("bench", config)) or [1.0 if config is b else 1.05]
    tuning.attach(t, lambda: "Test GPU")
    t_key = tuning.tuning_key(t, (None, None, 1024), {"grid": None, "warmup": False})
    assert t_key == (1024,)
    t.run(None, None, 1024, grid=None, warmup=False)
    # one pass over both configs, three interleaved refining rounds (both within 10%), then one launch with the pick
    assert order == [("bench", a), ("bench", b)] + [("bench", a), ("bench", b)] * tuning.REFINE_ROUNDS + [("launch", b)]
    path = tuning.cache_file("Test GPU")
    assert json.loads(path.read_text())[tuning.kernel_id(t)] == {
        "[1024]": {"kwargs": {"BLOCK": 64}, "num_warps": 8, "num_stages": 3}}
    again = tuner()
    again.run = lambda *args, **kwargs: None
    again._bench = scripted_bench({})  # must not tune: the pick comes from the file
    tuning.attach(again, lambda: "Test GPU")
    assert not again.cache  # nothing read before the first launch
    again.run(None, None, 1024, grid=None, warmup=False)
    assert again.cache == {(1024,): b}


def test_single_config_kernels_are_left_alone_and_the_cache_can_be_disabled(cache_dir, monkeypatch):
    single = tuner(configs=CONFIGS[:1])
    run = single.run
    assert tuning.attach(single, lambda: "gpu").run == run
    monkeypatch.setenv("CODABENCH_AUTOTUNE_CACHE", "0")
    t = tuner()
    t.run = lambda *args, **kwargs: None
    t._bench = lambda *args, config, **kwargs: [1.0]
    tuning.attach(t, lambda: "gpu")
    t.run(None, None, 8, grid=None, warmup=False)
    assert t.cache[(8,)] in CONFIGS and not (cache_dir / "autotune").exists()


def scripted_bench(times):
    """A stand-in for Autotuner._bench: each config's successive (median, p20, p80) times from ``times``."""
    seq = {c: iter(v) for c, v in times.items()}
    return lambda *args, config, **kwargs: [next(seq[config]), 0.0, 0.0]


def test_refine_keeps_the_lowest_median_of_interleaved_rounds():
    a, b, slow = (triton.Config({"BLOCK": n}, num_warps=4) for n in (32, 64, 128))
    t = tuner(configs=[a, b, slow])
    t._bench = scripted_bench({a: [1.05, 1.04, 1.06], b: [1.0, 0.99, 1.2]})
    first_pass = {a: [0.98, 0.9, 1.0], b: [1.01, 0.9, 1.1], slow: [1.5, 1.4, 1.6]}
    assert tuning.refine(t, first_pass, (), {}) is b  # slow (> 10% off) is not re-timed: the script has no times for it


def test_refine_leaves_a_clear_winner_alone():
    a, b = CONFIGS
    t = tuner()
    t._bench = scripted_bench({})  # would raise if called
    assert tuning.refine(t, {a: 1.0, b: 1.2}, (), {}) is a


def test_concurrent_stores_lose_no_entry(cache_dir):
    """Shards on the GPUs of one host store into the same file at once; every winner must survive."""
    from concurrent.futures import ThreadPoolExecutor
    path = tuning.cache_file("gpu")

    def writer(w):
        t = tuner()
        for i in range(25):
            t.cache[(w, i)] = CONFIGS[i % 2]
            tuning.store(t, [(w, i)], path)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(writer, range(8)))
    fresh = tuner()
    assert tuning.load(fresh, path) == 8 * 25


def stub_runs(t):
    """``t`` with its launch and its timing replaced: the launch does nothing, timing fails the test."""
    t.run = lambda *args, **kwargs: None
    t._bench = scripted_bench({})  # raises StopIteration-free KeyError if any config were timed
    return t


@pytest.fixture
def tables(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "TABLES", tmp_path / "tuned")
    return tmp_path / "tuned"


def write_table(tables, gpu, kernel, entries):
    path = tuning.table_file(gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": gpu, "triton": "3.6.0", "kernels": {kernel: entries}}))
    return path


def test_a_shipped_table_serves_keys_the_cache_lacks_and_the_cache_wins(cache_dir, tables):
    a, b = CONFIGS
    write_table(tables, "Test GPU", "_copy", {"[1024]": tuning._config_json(b), "[2048]": tuning._config_json(b)})
    cached = tuner()
    cached.cache[(2048,)] = a
    tuning.store(cached, [(2048,)], tuning.cache_file("Test GPU"))
    t = stub_runs(tuner())
    tuning.attach(t, lambda: "Test GPU")
    t.run(None, None, 1024, grid=None, warmup=False)  # no tuning: the table has the key
    assert t.cache == {(1024,): b, (2048,): a}  # the measured cache entry wins over the table's
    other = stub_runs(tuner())  # another GPU model has no table: it tunes
    other._bench = lambda *args, config, **kwargs: [1.0 if config is a else 2.0]
    tuning.attach(other, lambda: "Other GPU")
    other.run(None, None, 1024, grid=None, warmup=False)
    assert other.cache == {(1024,): a}


def test_table_entries_of_unknown_configs_are_ignored_and_tables_can_be_turned_off(cache_dir, tables, monkeypatch):
    a, b = CONFIGS
    write_table(tables, "Test GPU", "_copy", {"[1024]": {"kwargs": {"BLOCK": 512}, "num_warps": 4, "num_stages": 2},
                                              "[4096]": tuning._config_json(b)})
    t = tuner()
    assert tuning.load_table(t, tuning.table_file("Test GPU")) == 1 and t.cache == {(4096,): b}
    monkeypatch.setenv("CODABENCH_TUNING_TABLES", "0")
    t = stub_runs(tuner())
    t._bench = lambda *args, config, **kwargs: [1.0 if config is a else 2.0]
    tuning.attach(t, lambda: "Test GPU")
    t.run(None, None, 4096, grid=None, warmup=False)
    assert t.cache == {(4096,): a}  # tuned, not taken from the table


def test_export_merges_a_cache_into_the_table_by_kernel_name(cache_dir, tables):
    a, b = CONFIGS
    write_table(tables, "Test GPU", "_copy", {"[1]": tuning._config_json(a), "[2]": tuning._config_json(a)})
    cache = tuning.cache_file("Test GPU")
    t, e = tuner(), tuner(_copy_edited)
    t.cache.update({(2,): b, (3,): b})
    e.cache[(5,)] = a
    tuning.store(t, [(2,), (3,)], cache)
    tuning.store(e, [(5,)], cache)
    table, n = tuning.export(cache)
    assert table == tuning.table_file("Test GPU") and n == 4
    data = json.loads(table.read_text())
    assert data["triton"] == triton.__version__ and data["gpu"] == "Test-GPU"
    assert data["kernels"]["_copy"] == {"[1]": tuning._config_json(a), "[2]": tuning._config_json(b),
                                        "[3]": tuning._config_json(b)}
    assert data["kernels"]["_copy_edited"] == {"[5]": tuning._config_json(a)}
    with pytest.raises(ValueError, match="not a cache file name"):
        tuning.export(cache.with_name("results.json"))


def test_export_command_refuses_a_missing_file_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        tuning.main(["export", str(tmp_path / "nope--triton-3.6.0.json")])
    assert exc.value.code == 2 and capsys.readouterr().err.strip().endswith("no such file")


def test_the_shipped_tables_name_coda_kernels_and_configs_of_their_lists():
    """Every shipped table's kernels are autotuned CODA kernels, every stored config is one of the kernel's configs,
    and every key has the length of the kernel's current tuning key (:func:`tuning.tuning_key`: its ``key`` values,
    then a dtype per pointer argument, less one per pointer input of a declared kernel that a call may leave out:
    None has no dtype), since an entry of another length can never match: the matmul's key gained its ACC flag and
    26 entries of the H100 table went dead unnoticed (compiled mode: the interpreter has one config per kernel, so
    this runs in a subprocess without it)."""
    import os
    import subprocess
    import sys
    script = (
        "import json, sys\n"
        "import kernels.coda.functions, kernels.coda.plugin\n"
        "from triton.runtime.autotuner import Autotuner\n"
        "from kernels.coda import tuning\n"
        "from kernels.coda.program import Tile\n"
        "tuners = {tuning.kernel_name(v): v for m in list(sys.modules.values()) if m and m.__name__.startswith('kernels.')"
        " for v in (getattr(v, 'kernel', v) for v in vars(m).values()) if isinstance(v, Autotuner)}\n"  # declared: .kernel
        "optional = {tuning.kernel_name(v.kernel): sum(isinstance(i, Tile) or i.endswith('_ptr') for i in"
        " v.declaration.inputs) for m in list(sys.modules.values()) if m and m.__name__.startswith('kernels.')"
        " for v in vars(m).values() if hasattr(v, 'declaration')}\n"
        "bad = []\n"
        "for path in sorted(tuning.TABLES.glob('*.json')):\n"
        "    for name, entries in json.loads(path.read_text())['kernels'].items():\n"
        "        if name.startswith('strategy:'): continue\n"
        "        if name not in tuners: bad.append(f'{path.name}: {name} is not a CODA kernel'); continue\n"
        "        known = [tuning._config_json(c) for c in tuners[name].configs]\n"
        "        bad += [f'{path.name}: {name} {k}: config not in its list' for k, c in entries.items() if c not in known]\n"
        "        length = len(tuners[name].keys) + sum(a.endswith('_ptr') for a in tuners[name].arg_names)\n"
        "        shortest = length - optional.get(name, 0)\n"
        "        bad += [f'{path.name}: {name} {k}: not a key of length {shortest} to {length}' for k in entries"
        " if not shortest <= len(json.loads(k)) <= length]\n"
        "print(len(list(tuning.TABLES.glob('*.json'))), 'tables'); print('\\n'.join(bad)); sys.exit(bool(bad))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr

