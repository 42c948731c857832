"""Model shapes from the command line: presets, ``--model NAME:key=value,...`` and ``--model-config config.json``."""
import json

import pandas as pd
import pytest

from codabench.cli import main
from workloads.models import LLAMA3_VOCAB, PRESETS, from_hf_config, parse_model_spec
from harness_helpers import isolated_registry

LLAMA3_8B = {"_name_or_path": "meta-llama/Meta-Llama-3-8B", "hidden_size": 4096, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-05}


def test_inline_spec_and_hf_config_give_the_same_shape(tmp_path):
    inline = parse_model_spec("Meta-Llama-3-8B-x:hidden=4096,ffn=14336,heads=32,kv_heads=8,head_dim=128,"
                              "vocab=128256,rope_theta=500000")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    from_file = from_hf_config(tmp_path)
    assert from_file.name == "Meta-Llama-3-8B"
    assert from_file.with_(name=inline.name) == inline
    assert PRESETS["llama3-8b"].with_(name=inline.name) == inline  # the preset with the real vocabulary
    assert {PRESETS[f"llama3-{s}"].vocab for s in ("1b", "8b", "70b")} == {LLAMA3_VOCAB}


def test_hf_config_defaults_and_nested_rope_theta(tmp_path):
    cfg = {k: v for k, v in LLAMA3_8B.items() if k not in ("num_key_value_heads", "head_dim", "rope_theta",
                                                           "_name_or_path")}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    m = from_hf_config(path)
    assert (m.name, m.kv_heads, m.head_dim, m.rope_theta, m.eps) == ("my-model", 32, 128, 1e6, 1e-5)


@pytest.mark.parametrize("spec, says", [
    ("nocolon", "expected NAME:hidden=...,ffn=...,heads=...,vocab=..."),
    ("m:hidden=64,ffn=64,heads=4", "vocab is missing"),
    ("m:hidden=64,ffn=64,heads=4,vocab=x", "vocab='x' is not a number"),
    ("m:hidden=64,ffn=64,heads=4,vocab=99,window=3", "'window=3' is not key=value with a key of"),
    ("m:hidden=64,ffn=64,heads=6,kv_heads=4,head_dim=16,vocab=99", "heads (6) must be a multiple of kv_heads (4)"),
    ("m:hidden=60,ffn=64,heads=4,vocab=99", "head_dim (15) must be even"),
    ("m:hidden=64,ffn=0,heads=4,vocab=99", "ffn must be a whole number >= 1, got 0"),
    ("llama-7b:hidden=64,ffn=64,heads=4,vocab=99", "that name is a preset"),
])
def test_bad_inline_specs_say_what_is_wrong(spec, says):
    with pytest.raises(ValueError, match=None) as e:
        parse_model_spec(spec)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_bad_hf_configs_say_what_is_wrong(tmp_path):
    for body, says in ((json.dumps({k: v for k, v in LLAMA3_8B.items() if k != "intermediate_size"}),
                        "the field intermediate_size is missing"),
                       (json.dumps({**LLAMA3_8B, "num_attention_heads": "32"}), "num_attention_heads must be a number"),
                       (json.dumps({**LLAMA3_8B, "num_key_value_heads": 5}), "must be a multiple of kv_heads (5)"),
                       ("{not json", "not JSON")):
        (tmp_path / "config.json").write_text(body)
        with pytest.raises(ValueError) as e:
            from_hf_config(tmp_path / "config.json")
        assert says in str(e.value), (says, str(e.value))
    with pytest.raises(ValueError, match="cannot read it"):
        from_hf_config(tmp_path / "missing.json")


def test_models_flag_lists_the_presets(capsys):
    assert main(["--models"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS) and "128256" in out


def test_a_run_on_an_inline_model(tmp_path, capsys):
    """An inline shape is a model like a preset: its rows carry its name, env.json its shape."""
    with isolated_registry():
        code = main(["--model", "mini:hidden=64,ffn=96,heads=4,kv_heads=2,vocab=128,tokens=32,seq_len=16",
                     "--ops", "rmsnorm_swiglu", "--modes", "fwd", "--impls", "torch-eager,coda-triton",
                     "--out", str(tmp_path / "run"), "--quiet", "--no-entry-points"])
    assert code == 0, capsys.readouterr().err
    df = pd.read_csv(tmp_path / "run" / "results.csv")
    assert set(df["model"]) == {"mini"} and (df["status"] == "ok").all() and df["correct"].all()
    assert (df["tokens"] == 32).all()
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["models"]["mini"]["ffn"] == 96 and env["models"]["mini"]["kv_heads"] == 2
    assert main(["--model", "m:hidden=64", "--list"]) == 2
    assert "--model m: ffn is missing" in capsys.readouterr().err
