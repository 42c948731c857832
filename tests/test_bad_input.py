"""Bad input on the command line, in-process through :func:`codabench.cli.main`: every invocation ends in exit code 2
with exactly one line on stderr (no traceback, no usage block), prints nothing on stdout and writes nothing.

``--list`` is added where a valid command would start a run, so that an invocation wrongly accepted ends quickly (and
fails the exit-code check) instead of running cells.
"""
from __future__ import annotations

import json

import pytest

from codabench.cli import main
from harness_helpers import isolated_registry

LLAMA = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "model_type": "llama"}
"""A small valid config.json; each bad one below changes it."""

COUNTS = ("--tokens", "--vocab", "--layers", "--check-tokens", "--reps", "--rounds", "--warmup", "--cell-timeout",
          "--precision", "--same-within")
NAME_LISTS = ("--ops", "--models", "--modes", "--dtypes", "--impls")

FLAG_CASES = [
    # empty selections: an empty list is an error, never "the default"
    *[[flag, value] for flag in NAME_LISTS for value in ("", ",", ",,,", " , ")],
    ["--ops", "gemm_out,,rmsnorm_linear"], ["--ops", "gemm_out,gemm_out"], ["--dtypes", "fp32,fp32"],
    # unknown names
    ["--ops", "nosuch"], ["--ops", "gemm_out,nosuch"], ["--ops", "GEMM_OUT"], ["--models", "llama-13b"],
    ["--models", "tiny,nosuch"], ["--modes", "forward"], ["--modes", "fwd,back"], ["--dtypes", "fp64"],
    ["--dtypes", "int8"], ["--impls", "nosuch"], ["--impls", "torch-eager,nosuch"], ["--suite", "nosuch"],
    ["--suite", ""], ["--fp8-accum", "slow"], ["--fp8-accum", ""],
    # empty and garbage values of every number flag
    *[[flag, value] for flag in COUNTS for value in ("", "x", "nan", "-1", "0x10")],
    # out of range: the bounds stated in --help
    ["--reps", "0"], ["--reps", "10001"], ["--reps", "1000000000"], ["--reps", "1e9"], ["--reps", "2.5"],
    ["--rounds", "0"], ["--rounds", "101"], ["--rounds", "1000000"],
    ["--warmup", "1001"], ["--warmup", "-5"],
    ["--layers", "0"], ["--layers", "257"], ["--layers", "100000"],
    ["--tokens", "0"], ["--tokens", "1048577"], ["--tokens", "99999999999999999999"],
    ["--vocab", "0"], ["--vocab", "2000000"], ["--check-tokens", "0"], ["--check-tokens", "1048577"],
    ["--cell-timeout", "0"], ["--cell-timeout", "86401"], ["--cell-timeout", "inf"], ["--cell-timeout", "1e-9"],
    ["--precision", "0.0001"], ["--precision", "0.3"], ["--precision", "inf"],
    ["--same-within", "0"], ["--same-within", "0.6"], ["--same-within", "-inf"],
    ["--precision", "0.1", "--same-within", "0.05"], ["--precision", "0.02", "--same-within", "0.02"],
    ["--same-within", "0.005"],
    # shards
    ["--shard", ""], ["--shard", "0/0"], ["--shard", "2/1"], ["--shard", "1/0"], ["--shard", "a/b"],
    ["--shard", "1/2/3"], ["--shard", "1"],
    # abbreviations and unknown flags
    ["--suit", "smoke"], ["--op", "gemm_out"], ["--mode", "fwd"], ["--dtype", "fp32"], ["--impl", "torch-eager"],
    ["--rep", "3"], ["--round", "2"], ["--warm", "1"], ["--prec", "0.01"], ["--same", "0.1"], ["--cell", "5"],
    ["--model-conf", "x"], ["--check", "64"], ["--no-l2", ""], ["--li"], ["--nosuch"], ["extra-positional"],
    # a flag without its value
    ["--ops"], ["--reps"], ["--suite"], ["--model"], ["--model-config"], ["--plugin"],
    # models defined inline
    ["--model", ""], ["--model", "nocolon"], ["--model", ":hidden=64,ffn=96,heads=4,vocab=128"],
    ["--model", "m:hidden=x,ffn=96,heads=4,vocab=128"], ["--model", "m:hidden=64"],
    ["--model", "m:hidden=64,ffn=96,heads=4,vocab=128,window=3"], ["--model", "m:hidden=64,ffn=96,heads=4,vocab=-1"],
    ["--model", "m:hidden=64,ffn=96,heads=4,vocab=128,layers=100000"],
    ["--model", "m:hidden=64,ffn=96,heads=3,kv_heads=2,head_dim=16,vocab=128"],
    ["--model", "tiny:hidden=64,ffn=96,heads=4,vocab=128"],
    ["--model", "m:hidden=64,ffn=96,heads=4,vocab=128", "--model", "m:hidden=64,ffn=96,heads=4,vocab=128"],
    ["--plugin", ""], ["--plugin", "no-such-plugin.py"],
]

CONFIGS = {
    "missing": None,
    "empty": "",
    "not-json": "{hidden_size: 64",
    "a-list": "[1, 2]",
    "a-string": '"config"',
    "not-utf8": b"\xff\xfe\x00{",
    "no-hidden": {k: v for k, v in LLAMA.items() if k != "hidden_size"},
    "no-vocab": {k: v for k, v in LLAMA.items() if k != "vocab_size"},
    "null-heads": {**LLAMA, "num_attention_heads": None},
    "hidden-string": {**LLAMA, "hidden_size": "64"},
    "hidden-bool": {**LLAMA, "hidden_size": True},
    "hidden-fraction": {**LLAMA, "hidden_size": 64.5},
    "hidden-list": {**LLAMA, "hidden_size": [64]},
    "hidden-huge-int": {**LLAMA, "hidden_size": 10 ** 400},
    "negative-ffn": {**LLAMA, "intermediate_size": -96},
    "zero-heads": {**LLAMA, "num_attention_heads": 0},
    "vocab-too-large": {**LLAMA, "vocab_size": 1 << 21},
    "kv-not-divisor": {**LLAMA, "num_key_value_heads": 3},
    "odd-head-dim": {**LLAMA, "head_dim": 15},
    "negative-theta": {**LLAMA, "rope_theta": -1.0},
    "nan-eps": '{"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 128, '
               '"rms_norm_eps": NaN}',
    "zero-eps": {**LLAMA, "rms_norm_eps": 0},
    "gemma2": {**LLAMA, "model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh"},
    "unknown-type": {**LLAMA, "model_type": "gpt2"},
    "yarn": {**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "gelu": {**LLAMA, "hidden_act": "gelu"},
    "partial-rotary": {**LLAMA, "partial_rotary_factor": 0.5},
    "softcap": {**LLAMA, "attn_logit_softcapping": 50.0},
    "named-like-a-preset": {**LLAMA, "_name_or_path": "someone/tiny"},
}


@pytest.fixture(autouse=True)
def _no_writes(tmp_path, monkeypatch):
    """Run in an empty folder with the built-in implementations; nothing may be written there."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    with isolated_registry():
        yield
    assert list(work.iterdir()) == []


def _one_line_and_exit_2(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # would escape a real run: main must return the code itself
        code = ("SystemExit", e.code)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err and out == "", (argv, code, lines, out[-300:])
    return lines[0]


@pytest.mark.parametrize("flags", FLAG_CASES, ids=lambda f: " ".join(f) or "(none)")
def test_bad_flags(capsys, flags):
    line = _one_line_and_exit_2(capsys, flags + ["--list"])
    assert line.startswith(("run_bench.py: ", "codabench: ")), line


@pytest.mark.parametrize("name", CONFIGS)
def test_bad_model_configs(capsys, tmp_path, name):
    body = CONFIGS[name]
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    if body is not None:
        path.write_bytes(body if isinstance(body, bytes) else
                         (body if isinstance(body, str) else json.dumps(body)).encode())
    line = _one_line_and_exit_2(capsys, ["--model-config", str(path), "--list"])
    assert line.startswith(f"codabench: --model-config {path}: ") or "'tiny' is defined twice" in line, line


def test_a_key_given_twice_in_model(capsys):
    """The last value would silently win: refused, naming the key."""
    line = _one_line_and_exit_2(capsys, ["--model", "m:hidden=64,ffn=96,heads=4,vocab=128,hidden=32", "--list"])
    assert line == "codabench: --model m: hidden given more than once", line


def test_a_folder_without_config_json(capsys, tmp_path):
    line = _one_line_and_exit_2(capsys, ["--model-config", str(tmp_path), "--list"])
    assert line.startswith(f"codabench: --model-config {tmp_path}: cannot read config.json"), line


def test_the_same_config_twice(capsys, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(LLAMA))
    line = _one_line_and_exit_2(capsys, ["--model-config", str(tmp_path / "m")] * 2 + ["--list"])
    assert "model 'm' is defined twice" in line, line


@pytest.mark.parametrize("argv", [
    ["merge"], ["merge", "out-only"], ["compare"], ["compare", "one-run"], ["report"], ["report", "no-such-run"],
    ["report", "a", "b"], ["report", "--nosuch", "x"], ["compare", "a", "b", "--cs", "x.csv"],
    ["merge", "--help-me"],
], ids=" ".join)
def test_bad_subcommands(capsys, argv):
    line = _one_line_and_exit_2(capsys, argv)
    assert line.startswith(f"codabench {argv[0]}: "), line


def test_more_than_a_hundred_invocations():
    assert len(FLAG_CASES) + len(CONFIGS) + 2 + 10 >= 100
