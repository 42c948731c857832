"""The command line: device bootstrap, --list, a small run end to end, merge/compare/report commands."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from codabench.cli import GPU_ROUNDS, _summary, main, run_config, run_parser
from codabench.matrix import Selection
from workloads.ops import OPS
from workloads.suites import get_suite
from harness_helpers import PLUGINS, isolated_registry
from synthetic_runs import write_run

ROOT = Path(__file__).resolve().parents[1]


def test_bootstrap_sets_the_interpreter_only_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os, sys; from codabench.bootstrap import select_device; d = select_device(); "
            "print(d, os.environ.get('TRITON_INTERPRET'), 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    expected = ["cuda", "None"] if torch.cuda.is_available() else ["cpu", "1"]
    assert out == expected + ["False"]


def test_list_prints_cells_and_statuses(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-below")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    with isolated_registry():
        assert main(["--suite", "smoke", "--ops", "gemm_out,rmsnorm_linear", "--plugin", str(PLUGINS / "broken.py"),
                     "--list", "--no-entry-points", "--out", str(tmp_path / "runs" / "x")]) == 1  # its load error
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "runs" / ".cache" / "torchinductor")
    out = capsys.readouterr().out
    assert "gemm_out         tiny       fwd      fp32    torch-eager        to run" in out
    assert "skipped: the smoke suite runs torch-compile only in fwd_bwd mode" in out
    assert "broken.py failed to load" in out
    with isolated_registry():  # an implementation the suite leaves out; --impls brings it back
        for impls, status in ([], "skipped: the smoke suite leaves hf-coda-lora out (give --impls to run it)"),\
                             (["--impls", "hf-coda-lora"], "to run"):
            assert main(["--suite", "smoke", "--ops", "train_step", "--list", "--no-entry-points", *impls,
                         "--out", str(tmp_path / "runs" / "y")]) == 0
            line = next(x for x in capsys.readouterr().out.splitlines() if " hf-coda-lora " in x)
            assert line.endswith(status), line
    n_cells = sum(1 for line in out.splitlines() if line.startswith(("gemm_out ", "rmsnorm_linear ")))
    assert re.fullmatch(rf"{n_cells} cells: .*\d+ to run.*", out.strip().splitlines()[-1])


def test_small_run_end_to_end_then_report_and_compare(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind")))
    out = tmp_path / "run"
    with isolated_registry():
        code = main(["--ops", "gemm_out", "--impls", "torch-eager,torch-compile,test-good", "--out", str(out),
                     "--plugin", str(PLUGINS / "good.py"), "--reps", "2", "--quiet", "--no-entry-points"])
    assert code == 0
    printed = capsys.readouterr()
    assert "Triton interpreter" in printed.err or torch.cuda.is_available()
    df = pd.read_csv(out / "results.csv")
    assert list(df["impl"]) == ["torch-eager", "torch-compile", "test-good"]
    assert (df["status"] == "ok").all() and df["correct"].all() and (df["n_samples"] == 2).all()
    assert (out / "report.html").exists()
    assert main(["report", str(out)]) == 0
    assert main(["compare", str(out), str(out), "--csv", str(tmp_path / "cmp.csv")]) == 0
    assert "3 cells, 3 timed in both; B vs A: 0 faster, 0 slower, 0 same, 0 unresolved, 3 unknown" in capsys.readouterr().out
    assert main(["merge", str(tmp_path / "m"), str(out)]) == 0
    assert len(pd.read_csv(tmp_path / "m" / "results.csv")) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without a GPU")
def test_gpu_suites_refuse_to_run_on_the_cpu(tmp_path, capsys):
    with isolated_registry():
        assert main(["--suite", "quick", "--out", str(tmp_path / "q"), "--no-entry-points"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_suites_sampling_defaults_give_way_to_flags(tmp_path):
    """The full suite checks at 2048 tokens unless flags say otherwise, the other suites at the timing shape; every
    suite samples adaptively (sweeps until resolved) unless --reps fixes the sweeps."""
    def cfg(*flags):
        args = run_parser().parse_args(list(flags))
        suite = get_suite(args.suite)
        return run_config(args, suite, Selection.from_suite(suite), torch.device("cuda"), tmp_path)
    full, quick = cfg("--suite", "full"), cfg("--suite", "quick")
    assert (full.check_tokens, full.timing.reps, full.timing.rounds) == (2048, None, GPU_ROUNDS)
    assert (quick.check_tokens, quick.timing.reps) == (None, None)
    custom = cfg("--suite", "full", "--check-tokens", "512", "--reps", "7", "--rounds", "1")
    assert (custom.check_tokens, custom.timing.reps, custom.timing.rounds) == (512, 7, 1)


def test_precision_flags_reach_the_timing_config(tmp_path):
    def timing(*flags):
        args = run_parser().parse_args(list(flags))
        suite = get_suite("smoke")
        return run_config(args, suite, Selection.from_suite(suite), torch.device("cpu"), tmp_path).timing
    assert (timing().precision, timing().same_within) == (0.01, 0.02)
    custom = timing("--precision", "0.005", "--same-within", "0.03")
    assert (custom.precision, custom.same_within) == (0.005, 0.03)


def _usage_error(capsys, argv) -> str:
    """Run the command line on bad input: exit code 2 and exactly one line on stderr, no traceback."""
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], (code, err)
    return err[0]


@pytest.mark.parametrize("flags, says", [
    (["--tokens", "0"], "--tokens: expected a whole number from 1 to 1048576, got '0'"),
    (["--tokens", "-5"], "--tokens: expected a whole number from 1 to 1048576, got '-5'"),
    (["--vocab", "0"], "--vocab: expected a whole number from 1 to"),
    (["--check-tokens", "-1"], "--check-tokens: expected a whole number from 1 to"),
    (["--reps", "0"], "--reps: expected a whole number from 1 to 10000"),
    (["--rounds", "0"], "--rounds: expected a whole number from 1 to 100"),
    (["--warmup", "-1"], "--warmup: expected a whole number from 0 to 1000"),
    (["--cell-timeout", "0"], "--cell-timeout: expected a number of seconds from 0.001 to 86400"),
    (["--cell-timeout", "soon"], "--cell-timeout: expected a number of seconds from 0.001 to 86400, got 'soon'"),
    (["--shard", "3/2"], "argument --shard: 3/2: need 1 <= I <= N"),
    (["--shard", "x"], "argument --shard: expected I/N (e.g. 1/4), got 'x'"),
])
def test_bad_numbers_get_one_line_and_exit_2(capsys, flags, says):
    line = _usage_error(capsys, flags + ["--list"])
    assert says in line and line.endswith("(see --help)"), line


@pytest.mark.parametrize("suite", ["smoke", "quick"])
def test_an_op_a_plugin_adds_is_in_the_suites_of_its_level(capsys, tmp_path, suite):
    """A suite's ops are read from the catalogue once the plugins are loaded: an op of the pattern level that a
    plugin adds is a cell of smoke (every op) and of quick (the pattern level) without --ops."""
    plugin = tmp_path / "own_op.py"
    plugin.write_text("from workloads.ops import OPS\nfrom workloads.ops.gemm_bias_gelu import GemmBiasGelu\n\n\n"
                      "class OwnOp(GemmBiasGelu):\n    name = 'test_own_op'\n\n\nOPS[OwnOp.name] = OwnOp()\n")
    models = ["--models", "tiny", "--dtypes", "fp32"] if suite == "quick" else []
    try:
        with isolated_registry():
            assert main(["--suite", suite, *models, "--plugin", str(plugin), "--list", "--no-entry-points",
                         "--out", str(tmp_path / "runs" / suite)]) == 0
    finally:
        OPS.pop("test_own_op", None)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("test_own_op ")]
    assert rows and any(" torch-eager " in line and line.endswith("to run") for line in rows), rows


def test_list_refuses_what_the_run_would_refuse(capsys, tmp_path):
    """--list answers as the run would: an empty selection (naming the ops' modes) and a --resume into a run of
    another suite are one line and exit 2, a plugin that fails to load is listed and exits 1; it writes nothing."""
    with isolated_registry():
        line = _usage_error(capsys, ["--no-entry-points", "--ops", "gemm_out", "--modes", "bwd", "--list"])
        assert "the selection has no cells" in line and "the ops' modes: gemm_out: fwd" in line, line
        other = tmp_path / "other"
        assert main(["--no-entry-points", "--ops", "gemm_out", "--impls", "torch-eager", "--reps", "1", "--quiet",
                     "--inline", "--out", str(other)]) == 0
        (other / "codabench-run.json").write_text((other / "codabench-run.json").read_text()
                                                  .replace('"smoke"', '"kernels"'))
        before = sorted(p.name for p in other.iterdir())
        capsys.readouterr()
        line = _usage_error(capsys, ["--no-entry-points", "--ops", "gemm_out", "--resume", "--out", str(other),
                                     "--list"])
        assert "is a run of suite 'kernels', not 'smoke'" in line, line
        assert sorted(p.name for p in other.iterdir()) == before
        code = main(["--no-entry-points", "--ops", "gemm_out", "--plugin", str(PLUGINS / "broken.py"), "--list",
                     "--out", str(tmp_path / "never")])
        assert code == 1 and "broken.py failed to load" in capsys.readouterr().out
        assert not (tmp_path / "never").exists()


def test_resume_refuses_flags_that_change_what_its_rows_measured(capsys, tmp_path):
    """A resumed run measures as its rows did: another token count (or model shape, check tokens, fp8 accumulation,
    CUDA-graph timing, L2 flush) is one line naming it and exit 2, nothing written; the same flags resume."""
    out = tmp_path / "run"
    common = ["--no-entry-points", "--ops", "gemm_out", "--reps", "1", "--quiet", "--inline", "--out", str(out)]
    with isolated_registry():
        assert main(common + ["--impls", "torch-eager"]) == 0
        before = (out / "results.csv").read_text()
        capsys.readouterr()
        for flags, says in ((["--tokens", "96"], "tiny tokens: 48 -> 96"),
                            (["--no-l2-flush"], "--no-l2-flush (timing.flush_l2): True -> False")):
            line = _usage_error(capsys, common + ["--impls", "torch-eager,coda-triton", "--resume"] + flags)
            assert "was measured otherwise (" + says in line, line
            assert (out / "results.csv").read_text() == before
        assert main(common + ["--impls", "torch-eager,coda-triton", "--resume"]) == 0
    assert (out / "results.csv").read_text().count("\n") == 3


def test_defined_models_are_listed_and_one_left_out_is_named(capsys):
    spec = "mine:hidden=64,ffn=96,heads=4,vocab=128"
    assert main(["--model", spec, "--models"]) == 0
    assert any(line.startswith("mine ") and line.endswith("(defined)") for line in capsys.readouterr().out.splitlines())
    with isolated_registry():
        assert main(["--no-entry-points", "--model", spec, "--models", "tiny", "--ops", "gemm_out", "--list"]) == 0
    err = capsys.readouterr().err
    assert "--models tiny leaves out the defined model(s) mine: add them to --models" in err, err
    with isolated_registry():
        assert main(["--no-entry-points", "--model", spec, "--ops", "gemm_out", "--list"]) == 0
    assert "mine: hidden 64, 16384 tokens on the CPU's Triton interpreter (a cell may take many minutes" in \
        capsys.readouterr().err


def test_bad_names_and_paths_get_one_line_and_exit_2(capsys, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with isolated_registry():
        common = ["--no-entry-points", "--ops", "gemm_out", "--modes", "fwd"]
        line = _usage_error(capsys, common + ["--impls", "nosuch", "--out", str(tmp_path / "r1")])  # a worker stopped
        assert "unknown implementation(s) nosuch; known:" in line and "torch-eager" in line
        common.append("--inline")  # the other refusals start no worker process
        line = _usage_error(capsys, common + ["--impls", "liger", "--out", str(tmp_path / "r2")])
        assert "the selection has no cells" in line and "impls liger" in line
        line = _usage_error(capsys, common + ["--plugin", str(tmp_path / "nope.py"), "--out", str(tmp_path / "r3")])
        assert line == f"codabench: --plugin {tmp_path / 'nope.py'}: no such file"
        line = _usage_error(capsys, common + ["--ops", "gemm_outt"])
        assert "unknown op(s) gemm_outt; known: " in line
        for out in (a_file, a_file / "below"):
            line = _usage_error(capsys, common + ["--impls", "torch-eager", "--out", str(out)])
            assert line.startswith(f"codabench: --out {out}: "), line
    with isolated_registry():  # the name asked for may be the one a plugin that failed to load registers
        broken = (PLUGINS / "broken.py").resolve()
        line = _usage_error(capsys, common + ["--impls", "test-broken", "--plugin", str(broken)])
        assert "unknown implementation(s) test-broken; known: " in line and line.endswith(
            f"; plugin {broken} failed to load: ImportError: this plugin is broken on purpose ({broken}:2)"), line
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_subcommands_check_their_arguments(capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    header_only = tmp_path / "header-only"
    header_only.mkdir()
    (header_only / "results.csv").write_text("op,impl,model,mode,dtype,status\n")
    (header_only / "env.json").write_text("{}")
    for argv, says in ((["report", str(tmp_path / "missing")], "no such directory"),
                       (["report", str(empty)], "not a run directory (no results.csv)"),
                       (["report", str(header_only)], "results.csv: no rows"),
                       (["compare", str(empty), str(empty)], "not a run directory"),
                       (["merge", str(tmp_path / "m"), str(empty)], "not a run directory")):
        assert says in _usage_error(capsys, argv), argv
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_a_failed_merge_leaves_nothing_and_can_be_retried(tmp_path, capsys, monkeypatch):
    """merge builds under a temporary name: a failure while writing the report leaves no folder behind. The run merged
    is two ops of a committed full report, every model, mode and dtype (the whole report's plots took most of a minute
    to draw)."""
    import json

    import codabench.report.merge as merging

    run = tmp_path / "run"
    run.mkdir()
    reference = ROOT / "reports" / "h100-2026-11-27-full"
    ops = ("block", "lm_head_ce")
    for name in ("results.csv", "errors.csv"):
        lines = (reference / name).read_text().splitlines(keepends=True)
        (run / name).write_text(lines[0] + "".join(line for line in lines[1:] if line.startswith(tuple(
            f"{op}," for op in ops))))
    (run / "samples.jsonl").write_text("".join(line for line in (reference / "samples.jsonl").read_text().splitlines(
        keepends=True) if json.loads(line)["op"] in ops))
    (run / "env.json").write_bytes((reference / "env.json").read_bytes())
    assert set(pd.read_csv(run / "results.csv")["model"]) == {"llama-1b", "llama-7b", "llama-70b"}

    def broken_finalize(_):
        raise OSError("disk full")

    monkeypatch.setattr(merging, "finalize", broken_finalize)
    with pytest.raises(OSError):
        main(["merge", str(tmp_path / "merged"), str(run)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    monkeypatch.undo()
    assert main(["merge", str(tmp_path / "merged"), str(run)]) == 0
    assert len(pd.read_csv(tmp_path / "merged" / "results.csv")) == len(pd.read_csv(run / "results.csv"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]
    assert "is not empty" in _usage_error(capsys, ["merge", str(tmp_path / "merged"), str(run)])
    assert main(["merge", str(tmp_path / "twice"), str(run), str(run)]) == 0  # not shards of one run: said so
    assert f"{len(pd.read_csv(run / 'results.csv'))} cells are in more than one folder" in capsys.readouterr().err


def test_error_rows_give_exit_code_1_and_a_plugin_failure_is_printed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind")))
    with isolated_registry():
        code = main(["--ops", "gemm_out", "--modes", "fwd", "--impls", "torch-eager,test-raises,test-good",
                     "--out", str(tmp_path / "run"), "--plugin", str(PLUGINS / "faulty.py"), "--plugin",
                     str(PLUGINS / "good.py"), "--plugin", str(PLUGINS / "broken.py"), "--reps", "1", "--quiet",
                     "--no-entry-points"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"plugin {(PLUGINS / 'broken.py').resolve()} failed to load: ImportError: this plugin is broken on " \
           f"purpose ({(PLUGINS / 'broken.py').resolve()}:2)" in err
    df = pd.read_csv(tmp_path / "run" / "results.csv")
    assert set(df[df["status"] == "error"]["impl"]) == {"test-raises", str((PLUGINS / "broken.py").resolve())}
    assert set(df[df["status"] == "ok"]["impl"]) == {"torch-eager", "test-good"}


def test_the_summary_counts_each_failing_cell_once_and_only_ok_rows_have_a_pass_mark(tmp_path, capsys):
    """test-nan is an error row whose correctness pass ran (NaN), test-inaccurate an ok row that fails the error
    rule: the exit summary counts each once, and an error row's `correct` is empty (docs/reports.md)."""
    out = tmp_path / "run"
    with isolated_registry():
        code = main(["--ops", "gemm_out", "--modes", "fwd", "--impls", "torch-eager,test-nan,test-inaccurate,test-raises",
                     "--out", str(out), "--plugin", str(PLUGINS / "faulty.py"), "--reps", "1", "--quiet", "--inline",
                     "--no-entry-points"])
    printed = capsys.readouterr().out
    assert code == 1
    df = pd.read_csv(out / "results.csv", keep_default_na=False, na_values=[""])
    status = dict(zip(df["impl"], df["status"]))
    assert status == {"torch-eager": "ok", "test-nan": "error", "test-inaccurate": "ok", "test-raises": "error"}
    assert "; of the ok, 1 fails the error rule (exit code 1)" in printed, printed
    message = dict(zip(df["impl"], df["message"]))["test-inaccurate"]  # which output, by how much
    assert message.startswith("fails the error rule: out rel_err ") and "allowed" in message, message
    errors = df[df["status"] == "error"]
    assert errors["correct"].isna().all(), errors.to_dict("records")
    assert dict(zip(df["impl"], df["correct"]))["test-inaccurate"] == False  # noqa: E712
    err = pd.read_csv(out / "errors.csv")
    assert not err[err["impl"] == "test-nan"]["passed"].any()  # what the correctness pass measured stays
    # rows of an older version (a resumed run): an error row that says correct False is still one cell
    old = write_run(tmp_path / "old", {("gemm_out", "tiny", "fwd", "fp32", impl): [[1.0]] for impl in "abc"},
                    rows={("gemm_out", "tiny", "fwd", "fp32", "a"): {"status": "error", "correct": False},
                          ("gemm_out", "tiny", "fwd", "fp32", "b"): {"correct": False}})
    assert _summary(old, 0) == 1 and "; of the ok, 1 fails the error rule (exit code 1)" in capsys.readouterr().out


def test_the_readme_plugin_example_runs_on_the_cpu_as_written(tmp_path, capsys):
    """The first code block of the README's "Adding a plugin", saved under the name its first line gives, run with
    the README's command (narrowed to it and eager PyTorch, into a temporary folder) through the harness."""
    section = (ROOT / "README.md").read_text().split("## Adding a plugin", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    plugin = tmp_path / code.splitlines()[0].removeprefix("# ").strip()
    assert plugin.name == "my_kernels.py"
    plugin.write_text(code)
    command = re.search(r"Then run `python run_bench\.py (.*?)`", section).group(1).split()
    argv = [str(plugin) if a == plugin.name else a for a in command]
    out = tmp_path / "run"
    with isolated_registry():
        code = main(argv + ["--impls", "torch-eager,my-gemm", "--out", str(out), "--quiet", "--no-entry-points"])
    assert code == 0, capsys.readouterr().err
    df = pd.read_csv(out / "results.csv")
    row = df[df["impl"] == "my-gemm"]
    assert len(row) == 1 and row["status"].item() == "ok" and bool(row["correct"].item()), row.to_dict("records")
    assert (row["op"].item(), row["dtype"].item()) == ("gemm_out", "fp32" if not torch.cuda.is_available() else
                                                                    "bf16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's limit: only without a GPU")
def test_tl_dot_kernels_skip_bf16_in_the_interpreter_with_the_reason(tmp_path, capsys):
    """Implementations that declare ``triton-dot`` (coda-triton, the example) get a skipped bf16 row on the CPU that
    says why, instead of the interpreter's wrong bf16 products; their fp32 cells still run."""
    reason = "skipped: the Triton interpreter has no bf16 math; run bf16 on a GPU"
    with isolated_registry():
        assert main(["--ops", "gemm_out,gemm_bias_gelu", "--dtypes", "fp32,bf16", "--impls",
                     "torch-eager,coda-triton,coda-example", "--list", "--out", str(tmp_path / "l")]) == 0
        listed = capsys.readouterr().out.splitlines()
        for op, impl in (("gemm_out", "coda-triton"), ("gemm_bias_gelu", "coda-example")):
            assert any(line.split()[:5] == [op, "tiny", "fwd", "bf16", impl] and line.endswith(reason)
                       for line in listed), listed
            assert any(line.split()[:5] == [op, "tiny", "fwd", "fp32", impl] and line.endswith("to run")
                       for line in listed), listed
        out = tmp_path / "run"
        assert main(["--ops", "gemm_out", "--dtypes", "bf16", "--impls", "torch-eager,coda-triton", "--out", str(out),
                     "--quiet", "--no-entry-points"]) == 0
    df = pd.read_csv(out / "results.csv").set_index("impl")
    assert df.loc["coda-triton", "status"] == "skipped" and df.loc["coda-triton", "message"] == reason
    assert df.loc["torch-eager", "status"] == "ok"
