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
    ("m:hidden=64,ffn=64,heads=4,vocab=99,window=3", "unknown key 'window' (keys: hidden, ffn,"),
    ("m:hidden=64,ffn=64,heads=4,vocab=99,layers", "'layers' is not key=value (keys: hidden,"),
    ("m:hidden=64,ffn=64,heads=6,kv_heads=4,head_dim=16,vocab=99", "heads (6) must be a multiple of kv_heads (4)"),
    ("m:hidden=60,ffn=64,heads=4,vocab=99", "head_dim (15) must be even"),
    ("m:hidden=64,ffn=0,heads=4,vocab=99", "ffn must be a whole number from 1 to 262144, got 0"),
    ("llama-7b:hidden=64,ffn=64,heads=4,vocab=99", "that name is a preset"),
    ("m:hidden=64,ffn=64,heads=4,vocab=99,hidden=32", "m: hidden given more than once"),
])
def test_bad_inline_specs_say_what_is_wrong(spec, says):
    with pytest.raises(ValueError, match=None) as e:
        parse_model_spec(spec)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_bad_hf_configs_say_what_is_wrong(tmp_path):
    for body, says in ((json.dumps({k: v for k, v in LLAMA3_8B.items() if k != "intermediate_size"}),
                        "the field intermediate_size is missing"),
                       (json.dumps({**LLAMA3_8B, "num_attention_heads": "32"}),
                        "num_attention_heads must be a whole number"),
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


# Abridged config.json files of real models: the fields the check reads, with their published values.
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
             "intermediate_size": 14336, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
             "vocab_size": 256000, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-06,
             "rope_theta": 10000.0}
PHI3_MINI = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
             "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
             "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "rope_scaling": None}
PHI3_128K = {**PHI3_MINI, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                                            "long_factor": [1.0] * 48}}
PHI4_MINI = {**PHI3_MINI, "partial_rotary_factor": 0.75}
LLAMA31_8B = {**LLAMA3_8B, "_name_or_path": "meta-llama/Llama-3.1-8B", "model_type": "llama",
              "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
LLAMA_YARN = {**LLAMA3_8B, "model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 32768}}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32768,
              "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None}
QWEN2_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
            "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
            "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None}


@pytest.mark.parametrize("config, shape", [
    (MISTRAL_7B, (4096, 14336, 32, 8, 128, 32768, 1e6)),
    (QWEN2_7B, (3584, 18944, 28, 4, 128, 152064, 1e6)),
    (PHI3_MINI, (3072, 8192, 32, 32, 96, 32064, 1e4)),
    ({**LLAMA3_8B, "model_type": "llama", "rope_scaling": None}, (4096, 14336, 32, 8, 128, 128256, 5e5)),
    ({k: v for k, v in MISTRAL_7B.items() if k != "model_type"}, (4096, 14336, 32, 8, 128, 32768, 1e6)),
])
def test_llama_family_configs_are_read(tmp_path, config, shape):
    (tmp_path / "config.json").write_text(json.dumps(config))
    notes = []
    m = from_hf_config(tmp_path, notes)
    assert (m.hidden, m.ffn, m.heads, m.kv_heads, m.head_dim, m.vocab, m.rope_theta) == shape
    # what the ops leave out of an accepted model is said: Qwen2's q/k/v bias
    assert len(notes) == (config is QWEN2_7B) and all("q/k/v projections' bias is not modeled" in n for n in notes)


@pytest.mark.parametrize("config, says", [
    (GEMMA2_9B, "model_type 'gemma2' is not a Llama-family block this suite models (its block has a GeGLU MLP"),
    ({**GEMMA2_9B, "model_type": None}, "architectures ['Gemma2ForCausalLM'] is not a Llama-family block"),
    ({**MISTRAL_7B, "model_type": "qwen3"}, "(its block has RMSNorms of q and k before RoPE)"),
    ({**MISTRAL_7B, "model_type": "falcon"}, "model_type 'falcon' is not a Llama-family block"),
    ({**MISTRAL_7B, "model_type": ["llama"]}, "model_type must be a string, got ['llama']"),
    (PHI3_128K, "rope_scaling type 'longrope' is not modeled"),
    (PHI4_MINI, "partial_rotary_factor 0.75 is not modeled (the ops rotate whole heads)"),
    (LLAMA_YARN, "rope_scaling type 'yarn' is not modeled"),
    (LLAMA31_8B, "rope_scaling type 'llama3' is not modeled (the ops' RoPE has the frequencies theta^(-2i/dh)); "
                 "its shapes with plain RoPE: --model Llama-3.1-8B:hidden=4096,ffn=14336,heads=32,kv_heads=8,"
                 "head_dim=128,vocab=128256,rope_theta=500000.0,eps=1e-05,"),
    ({**LLAMA3_8B, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters type 'dynamic'"),
    ({**LLAMA3_8B, "rope_scaling": "linear"}, "rope_scaling must be an object or null, got 'linear'"),
    ({**MISTRAL_7B, "hidden_act": "gelu"}, "hidden_act 'gelu' is not modeled (the ops' MLP is SwiGLU"),
    ({**MISTRAL_7B, "final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not modeled"),
    ({**LLAMA3_8B, "attention_bias": True}, "attention_bias True is not modeled (the ops' projections have no bias)"),
    ({**LLAMA3_8B, "mlp_bias": True}, "mlp_bias True is not modeled"),
])
def test_other_architectures_are_refused_with_the_reason(tmp_path, config, says):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        from_hf_config(tmp_path)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_suggested_inline_model_is_the_config_shape(tmp_path):
    """A refused scaled RoPE names the --model flag of the same shapes: it parses to the shape the config gives."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B))
    with pytest.raises(ValueError) as e:
        from_hf_config(tmp_path)
    spec = str(e.value).split("--model ", 2)[-1]
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA31_8B, "rope_scaling": None}))
    assert parse_model_spec(spec) == from_hf_config(tmp_path)


def test_a_refused_config_is_one_line_and_exit_2_on_the_command_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA2_9B))
    assert main(["--model-config", str(tmp_path), "--list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type 'gemma2' is not a Llama-family block" in err[0], err


def test_what_the_ops_leave_out_is_said_on_the_console(tmp_path, capsys):
    (tmp_path / "Qwen2-7B").mkdir()
    (tmp_path / "Qwen2-7B" / "config.json").write_text(json.dumps(QWEN2_7B))
    with isolated_registry():
        assert main(["--model-config", str(tmp_path / "Qwen2-7B"), "--ops", "rmsnorm_rope", "--list",
                     "--no-entry-points"]) == 0
    out, err = capsys.readouterr()
    assert "rmsnorm_rope     Qwen2-7B" in out
    assert f"codabench: --model-config {tmp_path / 'Qwen2-7B' / 'config.json'}: its q/k/v projections' bias is not " \
           "modeled" in err
