"""The benchmark scripts. benchmarks/bench_coda.py is a front end of the harness: it runs the kernels suite through
the command line and prints a table from the run's results (here on the CPU, the Triton interpreter and the tiny
model). The GPU-only experiments still build: benchmarks/gluon_ws_producer.py (Gluon has no interpreter) compiles for
sm_90 here, without a GPU, fits Hopper's shared memory and registers its plugin implementations; so do fused CODA
kernels launched through their host wrappers (benchmarks/compare_ptx.py). What the compiler makes of them (registers,
spills, stack and local memory) depends on the Triton release, so benchmarks/check_compiled.py reports it against each
kernel's expectation; the tests here check that it runs and prints its table."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from codabench import results as tables
from codabench.results import load_run
from harness_helpers import isolated_registry
from synthetic_runs import noisy_rounds, write_run

ROOT = Path(__file__).parents[1]
BENCHMARKS = ROOT / "benchmarks"


def script_env(**changes: str) -> dict[str, str]:
    """The environment of a benchmark script run as a subprocess: this checkout's packages first (the script's own
    folder comes first on its sys.path, not the repository root), with ``changes``."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **changes}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- bench_coda.py: the kernels suite through the harness ------------------------------------------------------

@pytest.mark.slow
def test_bench_coda_runs_the_kernels_suite_and_prints_its_table(tmp_path):
    """On the CPU (the interpreter; the suite needs --models and --dtypes there): the ops named by --kernels, without
    torch-compile (--no-compile), each row of the table from results.csv; the checks passed, so exit code 0."""
    env = {k: v for k, v in script_env().items() if k not in ("TRITON_INTERPRET", "TORCHINDUCTOR_CACHE_DIR")}
    out = tmp_path / "run"
    ops = ["producer_out", "gemm_ce_grad", "rmsnorm_dgrad_lm", "rope_bwd", "lm_head_wgrad"]
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_coda.py"), "--models", "tiny", "--dtypes", "fp32",
                           "--kernels", ",".join(ops), "--no-compile", "--out", str(out), "--quiet"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df, _, env_json = load_run(out)
    assert env_json["suite"] == "kernels"
    assert set(df["impl"]) == {"torch-eager", "coda-triton"} and set(df["op"]) == set(ops)
    assert (df["status"] == "ok").all() and (df["correct"] == True).all()  # noqa: E712
    lines = proc.stdout[proc.stdout.index("kernels suite, "):].splitlines()
    rows = {line.split()[1]: line.split() for line in lines if line.startswith("tiny ")}
    assert set(rows) == set(ops) and all(r[2:4] == ["fp32", "coda-triton"] and r[-1] == "pass" for r in rows.values())
    coda = df[df["impl"] == "coda-triton"].set_index("op")
    for op in ops:  # model, op, dtype, impl, ms, GEMM ms, fused/GEMM, vs eager, vs compile, err x torch, pass
        ms, gemm_ms, fused_over_gemm, vs_eager, vs_compile = rows[op][4:9]
        assert float(ms) == round(coda.loc[op, "median_ms"], 4) and vs_eager.endswith("x")  # no interval on the CPU
        if op == "rope_bwd":  # the elementwise kernel has no speed-of-light
            assert gemm_ms == fused_over_gemm == "-"
        else:
            assert float(fused_over_gemm) == round(coda.loc[op, "sol_ratio"], 3) and float(gemm_ms) > 0
        assert vs_compile == "-"  # no torch-compile
    assert lines[-1].startswith("(cpu-wall")


def test_bench_coda_table_of_a_gpu_run(tmp_path):
    """The table of a run with GPU timings: the speedups over eager and compile with their intervals, the
    fused/GEMM ratio, FAIL where the pass rule failed and the message of an error row."""
    bench = load_script("bench_coda")
    rng = np.random.default_rng(0)
    key = ("producer_out", "llama-7b", "fwd", "bf16")
    cells = {(*key, "torch-eager"): noisy_rounds(rng, 2.0), (*key, "torch-compile"): noisy_rounds(rng, 1.2),
             (*key, "coda-triton"): noisy_rounds(rng, 1.0),
             ("rope_bwd", "llama-7b", "bwd", "bf16", "coda-triton"): noisy_rounds(rng, 0.3)}
    rows = {(*key, "coda-triton"): {"sol_ms": 0.95, "sol_ratio": 1.0 / 0.95, "err_ratio": 0.8},
            ("rope_bwd", "llama-7b", "bwd", "bf16", "coda-triton"): {"correct": False, "err_ratio": 3.5}}
    run = write_run(tmp_path / "run", cells, rows=rows)
    tables.AppendWriter(run / tables.RESULTS, tables.RESULT_COLUMNS).write([{
        "op": "gemm_rope", "model": "llama-7b", "mode": "fwd", "dtype": "bf16", "impl": "coda-triton",
        "status": "error", "message": "timed out after 1200 s"}])
    lines = bench.table(run)
    by_op = {line.split()[1]: line for line in lines[1:]}
    producer = by_op["producer_out"].split()
    assert producer[2:4] == ["bf16", "coda-triton"]
    assert producer[4] == f"{np.median([s for r in cells[(*key, 'coda-triton')] for s in r]):.4f}"
    assert producer[5:7] == ["0.9500", f"{1 / 0.95:.3f}"] and producer[-2:] == ["0.80", "pass"]
    eager, compile_ = re.findall(r"(\d+\.\d+)x \[(\d+\.\d+), (\d+\.\d+)\]", by_op["producer_out"])
    assert 1.8 < float(eager[0]) < 2.2 and float(eager[1]) < float(eager[0]) < float(eager[2])
    assert 1.1 < float(compile_[0]) < 1.3 and float(compile_[1]) <= float(compile_[0]) <= float(compile_[2])
    assert by_op["rope_bwd"].split()[-1] == "FAIL" and by_op["rope_bwd"].split()[4:9] == ["{:.4f}".format(
        np.median([s for r in cells[("rope_bwd", "llama-7b", "bwd", "bf16", "coda-triton")] for s in r])), "-", "-",
        "-", "-"]
    assert "error: timed out after 1200 s" in by_op["gemm_rope"]
    assert not any("torch-eager" in line or "torch-compile" in line for line in lines[1:])


def test_bench_coda_flags_become_run_bench_flags():
    bench = load_script("bench_coda")
    args, rest = bench.parse_args(["--models", "llama-7b", "--kernels", "rope_bwd,gemm_ce", "--no-compile",
                                   "--reps", "5", "--impls", "coda-triton"])
    assert bench.run_argv(args, Path("out"), rest) == [
        "--suite", "kernels", "--out", "out", "--models", "llama-7b", "--ops", "rope_bwd,gemm_ce",
        "--impls", "torch-eager,coda-triton", "--reps", "5", "--impls", "coda-triton"]  # a flag given last wins
    args, rest = bench.parse_args(["--tokens", "4096", "--resume"])
    assert bench.run_argv(args, Path("o"), rest) == ["--suite", "kernels", "--out", "o", "--tokens", "4096",
                                                     "--resume"]


# ---- the GPU-only experiments build ----------------------------------------------------------------------------
HOPPER_SMEM = load_script("check_compiled").HOPPER_SMEM


# ---- resolving_power.py: the suite against planted GPU work ------------------------------------------------------

def test_resolving_power_runs_the_suite_and_writes_its_table_summary_and_headline(tmp_path):
    """On the CPU (wall times: no intervals) the script runs its tries through the suite and writes what it found;
    the targets are not judged there, and the headline says so."""
    out = tmp_path / "rp"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "resolving_power.py"), "--tries", "2", "--dtype", "fp32",
                           "--shape", "hidden=64,ffn=128,heads=2,vocab=256", "--tokens", "32", "--out", str(out),
                           "--", "--no-history"], capture_output=True, text=True, timeout=600, env=script_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "target 2% slower in >= 90%: not judged" in done.stdout
    df, _, _ = load_run(out)
    assert sorted(set(df["model"])) == ["rp00", "rp01"] and (df["status"] == "ok").all()
    assert (out / "resolving_power.json").is_file() and (out / "resolving_power.txt").is_file()
    assert (out / "headline.txt").read_text().startswith("resolving power, planted work against gemm-ref over 2 "
                                                         "tries: 0%: 2 n/a; 1%: 2 n/a")


def test_small_model_step_prints_each_variants_step_and_its_distance_from_eager():
    """benchmarks/small_model_step.py without a GPU: HF eager and apply_coda (fp32, the interpreter), one step each,
    a line each, the CODA step's loss and gradient within fp32 rounding of eager's (the compiled variants need a
    GPU)."""
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "small_model_step.py"), "--hidden", "64", "--ffn", "128",
                           "--heads", "2", "--kv-heads", "1", "--vocab", "256", "--layers", "2", "--batch", "1",
                           "--seq", "32", "--steps", "1"], capture_output=True, text=True, timeout=600,
                          env=script_env(CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[1:]}
    assert set(rows) == {"hf-eager", "hf-coda"}, done.stdout
    loss_gap, grad_gap = (abs(float(v)) for v in rows["hf-coda"][-2:])
    assert loss_gap < 1e-5 and grad_gap < 1e-4, done.stdout


def test_the_resolving_power_headline_counts_each_planted_shares_verdicts():
    rp = load_script("resolving_power")
    planted = {0: {"tries": 20, "verdicts": {"same": 19, "faster": 1}, "median_half_width": 0.003},
               2: {"tries": 20, "verdicts": {"slower": 17, "unresolved": 3}, "median_half_width": 0.005}}
    summary = {"planted": planted, "targets": rp.targets(planted)}
    assert rp.headline(summary) == ("resolving power, planted work against gemm-ref over 20 tries: 0%: 19 same, "
                                    "1 faster; 2%: 17 slower, 3 unresolved; median half-width 0.4%; a target MISSED")


def test_gluon_ws_producer_compiles_for_hopper(tmp_path):
    # A process of its own: this one runs Triton's interpreter, whose jit functions (gl.sum's among them) Gluon
    # cannot compile; and an empty cache, so that the kernel is compiled rather than read back.
    env = script_env(TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(BENCHMARKS / "gluon_ws_producer.py"), "--compile-only"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    shared = dict(re.findall(r"^(producer=\S+ h_from_x16=\S+): compiled for sm_90, (\d+) B", out.stdout, re.M))
    assert set(shared) == {"producer=False h_from_x16=True", "producer=True h_from_x16=True",
                           "producer=True h_from_x16=False"}, out.stdout
    with isolated_registry() as registry:  # the module registers its implementations (a plugin file)
        g = load_script("gluon_ws_producer")
        assert {(i.op, i.name) for i in registry.impls.values() if i.source == "gluon_ws_producer"} == \
            {("producer_out", "gluon-ws"), ("producer_out", "gluon-ws-x32"), ("gemm_out", "gluon-ws")}
    buffers = g.STAGES * (g.BM + g.BN) * g.BK * 2 + g.BM * g.BN * 2  # operand ring and the epilogue's io tile
    for variant, smem in shared.items():
        assert buffers <= int(smem) <= HOPPER_SMEM, (variant, smem)


@pytest.mark.slow
def test_gluon_ws_dgrad_swiglu_compiles_for_hopper(tmp_path):
    """The lost Gluon SwiGLU dgrad experiment still builds: every config compiles for sm_90 and its operand ring and
    z_pre / dz_pre tile fit the shared memory."""
    env = script_env(TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(BENCHMARKS / "gluon_ws_dgrad_swiglu.py"), "--compile-only"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.findall(r"^config=(\d+),(\d+),(\d+),\w+: compiled for sm_90, (\d+) B", out.stdout, re.M)
    shared = {(int(bn), int(bk), int(stages)): int(b) for bn, bk, stages, b in found}
    g = load_script("gluon_ws_dgrad_swiglu")
    assert set(shared) == {c[:3] for c in g.CONFIGS}, out.stdout
    bad = subprocess.run([sys.executable, str(BENCHMARKS / "gluon_ws_dgrad_swiglu.py"), "--models", "llama-1b,nope"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--models: unknown nope" in bad.stderr and "Traceback" not in bad.stderr
    for (bn, bk, stages), smem in shared.items():
        buffers = stages * (g.BM + bn) * bk * 2 + g.BM * bn * 4  # operand ring and the int32 z_pre / dz_pre tile
        assert buffers <= smem <= HOPPER_SMEM, (bn, bk, stages, smem)


def test_fused_kernels_compile_for_hopper_through_the_launch_helper():
    """benchmarks/compare_ptx.py --compile-only: the guide's example and the fp8 producer, launched by their host
    wrappers through FusedGemm (arguments caught at the autotuner), compile for sm_90, fit its shared memory, and
    cuobjdump reports their resources (what they are: benchmarks/check_compiled.py)."""
    env = script_env(TRITON_INTERPRET="0")  # the script compiles in a process of its own, empty cache
    out = subprocess.run([sys.executable, str(BENCHMARKS / "compare_ptx.py"), "--compile-only",
                          "--cases", "example-bf16,producer-fp8"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^(\S+) +(\S+) +regs +(\d+) stack (\d+) local (\d+) shared +(\d+) B", out.stdout, re.M)
    assert [r[:2] for r in rows] == [("example-bf16", "gemm_bias_gelu_kernel"),
                                     ("producer-fp8", "gemm_residual_norm_kernel")], out.stdout
    for case, _, regs, _stack, _local, shared in rows:
        assert int(regs) > 0 and 0 < int(shared) <= HOPPER_SMEM, (case, regs, shared)


# ---- tune_tables.py: regenerating a shipped table ------------------------------------------------------------

def test_tune_tables_runs_a_suite_once_or_as_one_shard_per_gpu():
    """One GPU: the suite's CODA cells in one run; N GPUs: N runs at once, shard i/N on GPU i only (whole groups, so
    every shape is tuned once), each writing its own run directory."""
    tune = load_script("tune_tables")
    [(cmd, env)] = tune.shard_commands("full", 1, "/tmp/c")
    assert "--shard" not in cmd and cmd[cmd.index("--impls") + 1] == "coda-triton" and cmd[-1] == "/tmp/c/run-full"
    runs = tune.shard_commands("train", 3, "/tmp/c")
    assert [c[c.index("--shard") + 1] for c, _ in runs] == ["1/3", "2/3", "3/3"]
    assert [e["CUDA_VISIBLE_DEVICES"] for _, e in runs] == ["0", "1", "2"]
    assert len({c[-1] for c, _ in runs}) == 3 and all(c[c.index("--impls") + 1] == "hf-coda" for c, _ in runs)


@pytest.mark.slow
def test_gluon_pingpong_dgrad_swiglu_compiles_for_hopper(tmp_path):
    """The lost ping-pong SwiGLU dgrad experiment still builds: every config, with and without its epilogue, compiles
    for sm_90, its operand ring(s) fit the shared memory, and ptxas reports its registers."""
    env = script_env(TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    script = str(BENCHMARKS / "gluon_pingpong_dgrad_swiglu.py")
    out = subprocess.run([sys.executable, script, "--compile-only"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.findall(r"^config=(\d+),(\d+),(\d+),(\d+) epilogue=(\w+): compiled for sm_90, (\d+) B shared, (.*)$",
                       out.stdout, re.M)
    g = load_script("gluon_pingpong_dgrad_swiglu")
    assert {(tuple(map(int, f[:4])), f[4]) for f in found} == {(c, e) for c in g.CONFIGS for e in ("True", "False")}
    for bn, bk, stages, _rings, _epi, smem, ptxas in found:
        ring = int(stages) * (g.BM + int(bn)) * int(bk) * 2
        assert ring <= int(smem) <= HOPPER_SMEM, (bn, bk, stages, smem)
        assert "registers" in ptxas, ptxas
    bad = subprocess.run([sys.executable, script, "--models", "nope"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--models: unknown nope" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_the_gluon_rmsnorm_dgrad_experiment_compiles_for_hopper(tmp_path):
    """benchmarks/gluon_epilogue_dgrad_rmsnorm.py --compile-only (the lost Gluon RMSNorm dgrad, on the shipped SwiGLU
    dgrad's schedule): every timed config, bf16 and fp8 operands, compiles for sm_90 and fits the shared memory (the
    operand ring, the fp32 accumulator buffer and the dgamma reduction's scratch); whether it spills:
    benchmarks/check_compiled.py."""
    env = script_env(TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    script = str(BENCHMARKS / "gluon_epilogue_dgrad_rmsnorm.py")
    out = subprocess.run([sys.executable, script, "--compile-only"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = {(d, int(s), int(r), int(v)): (int(b), usage) for d, s, r, v, b, usage in re.findall(
        r"^config=(bf16|fp8),(\d+),(\d+),(\d+): compiled for sm_90, (\d+) B shared, (.*)$", out.stdout, re.M)}
    if not torch.cuda.is_available():  # timing here is one line and exit 2, not a traceback
        nogpu = subprocess.run([sys.executable, script, "--models", "llama-1b"], env=env, capture_output=True,
                               text=True, timeout=120)
        assert nogpu.returncode == 2 and "timing needs a Hopper GPU" in nogpu.stderr and "Traceback" not in nogpu.stderr
    bench = load_script("gluon_epilogue_dgrad_rmsnorm")
    WS = bench.WS
    assert set(found) == set(bench.CONFIGS) and {c[0] for c in found} == {"bf16", "fp8"}, out.stdout
    for (_, stages, _, _), (smem, usage) in found.items():
        ring = stages * (WS.BM + WS.BN) * WS.K_BYTES + WS.BM * WS.BN * 4
        assert ring <= smem <= HOPPER_SMEM, (stages, smem)
        assert "registers" in usage and "bytes spill stores" in usage, usage


# ---- check_compiled.py: what the compiler makes of the kernels, reported -----------------------------------------

def test_check_compiled_reports_a_miss_and_fails_only_when_strict(monkeypatch, capsys):
    """A row misses its expectation on what it says (8 bytes of spill, as Triton 3.8 gave the SwiGLU dgrad), on
    what the compiler's report left out, and on shared memory over Hopper's; the table says so and the exit code is
    1 only under --strict. An unknown group or case: an argparse error, exit 2."""
    check = load_script("check_compiled")
    parsed = check.parse_ptxas("0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads; Used 128 registers, "
                               "used 16 barriers")
    assert parsed == {"regs": 128, "spill_stores": 8, "spill_loads": 8, "stack": 0}
    spilled = check.Row("config=bf16,4,32", **parsed, local=None, shared=196848, expect=check.NO_SPILLS)
    assert spilled.misses() == ["spill stores 8", "spill loads 8"]
    assert check.Row("k", None, None, None, 0, 0, 1024, check.NO_LOCAL).misses() == ["regs None"]
    assert check.Row("k", 255, None, None, 0, 0, check.HOPPER_SMEM + 1, check.NO_LOCAL).misses() == [
        f"shared {check.HOPPER_SMEM + 1} B > {check.HOPPER_SMEM}"]
    fine = check.Row("config=bf16,4,16", 128, 442, 498, 336, None, 196848)  # nothing expected: spills reported only
    assert fine.misses() == []
    monkeypatch.setattr(check, "rmsnorm_rows", lambda: [spilled, fine])
    assert check.main(["--groups", "gluon-rmsnorm"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("config=bf16,4,32") and out[2].endswith("MISS: spill stores 8, spill loads 8")
    assert out[3].split()[1:4] == ["128", "442", "498"] and out[3].endswith("ok")
    assert out[-1].startswith("1 of 2 rows meet their expectation")
    assert check.main(["--groups", "gluon-rmsnorm", "--strict"]) == 1
    for bad, says in ((["--groups", "nope"], "--groups: unknown nope"), (["--cases", "nope-bf16"], "--cases: unknown")):
        with pytest.raises(SystemExit) as exit_:
            check.main(bad)
        assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.slow
def test_check_compiled_prints_its_table_for_a_fused_kernel_and_a_built_gluon_variant(tmp_path):
    """The script compiles for sm_90 without a GPU and prints one row per kernel with its resources: the fused kernel
    of each case, and the Gluon variant built from the declared kernel of each case that has one (the SwiGLU dgrad's
    held to no spills; the plain GEMM's case has none); what they are is the compiler's, so only the exit code's
    agreement with the table (--strict) is asserted."""
    env = script_env(TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "check_compiled.py"), "--groups", "fused,gluon",
                           "--cases", "example-bf16,swiglu_bwd-fp8,gemm-bf16", "--strict"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("triton ") and lines[1].split()[:2] == ["kernel", "regs"]
    rows = {" ".join(line.split()[:2]): line for line in lines[2:-1]}
    assert set(rows) == {"example-bf16 gemm_bias_gelu_kernel", "swiglu_bwd-fp8 dgrad_swiglu_kernel",
                         "gemm-bf16 gemm_kernel", "example-bf16 gemm_bias_gelu_gluon_kernel",
                         "swiglu_bwd-fp8 dgrad_swiglu_gluon_kernel"}, proc.stdout
    assert "no spills" in rows["swiglu_bwd-fp8 dgrad_swiglu_gluon_kernel"]
    assert all(re.search(r" (ok|MISS: .+)$", line) for line in rows.values()), proc.stdout
    assert all(int(line.split()[2]) > 0 for line in rows.values())  # registers
    missed = sum("MISS" in line for line in rows.values())
    assert lines[-1].startswith(f"{len(rows) - missed} of {len(rows)} rows meet their expectation")
    assert proc.returncode == (1 if missed else 0)
