"""Registration, discovery (kernels/, entry points, --plugin files) and load errors."""
import importlib.metadata

import pytest
import torch

from codabench.case import Case
from codabench.registry import (ENTRY_POINT_GROUP, REGISTRY, FunctionImplementation, Implementation, Registry,
                                discover, load_plugin_file, register, requirement_missing)
from harness_helpers import CPU, PLUGINS, isolated_registry
from workloads.models import PRESETS
from workloads.ops import OPS


@pytest.fixture
def registry():
    with isolated_registry() as reg:
        yield reg


def _case(op="gemm_out", mode="fwd", dtype="fp32"):
    return Case(OPS[op], PRESETS["tiny"], mode, dtype, CPU, {})


def test_discovery_finds_the_baselines_for_every_op(registry):
    for op in OPS:
        names = {i.name for i in registry.for_op(op)}
        assert {"torch-eager", "torch-compile"} <= names, op
    assert registry.get("gemm_out", "torch-eager").source == "kernels.torch_baselines"


def test_register_function_and_class(registry):
    @register(["gemm_out", "gemm_down"], "test-fn", modes=("fwd",), dtypes=("bf16",), label="fused")
    def fn(x, w):
        """A test GEMM."""
        return {"out": x @ w.T}

    @register("gemm_qkv", "test-cls", requires=("cuda",))
    class Cls(Implementation):
        def run(self, native):
            return {"out": native["x"] @ native["w"].T}

    a, b = registry.get("gemm_out", "test-fn"), registry.get("gemm_down", "test-fn")
    assert isinstance(a, FunctionImplementation) and a is not b
    assert (a.modes, a.dtypes, a.label, a.description) == (("fwd",), ("bf16",), "fused", "A test GEMM.")
    assert a.skip_reason(_case(dtype="fp32")) == "n/a: test-fn does not support fp32"
    assert a.skip_reason(_case(dtype="bf16")) is None
    c = registry.get("gemm_qkv", "test-cls")
    assert isinstance(c, Cls) and c.skip_reason(_case("gemm_qkv")) == "skipped: needs a CUDA GPU"
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    assert torch.equal(a.run({"x": x, "w": w})["out"], x @ w.T)


def test_same_name_from_two_sources_is_refused():
    reg = Registry()

    class A(Implementation):
        name, op, source = "dup", "gemm_out", "mod_a"

    class B(Implementation):
        name, op, source = "dup", "gemm_out", "mod_b"

    reg.add(A())
    with pytest.raises(ValueError, match="registered twice"):
        reg.add(B())


def test_requirements():
    assert requirement_missing("cuda", CPU) == "skipped: needs a CUDA GPU"
    assert requirement_missing("cpu", CPU) is None
    assert requirement_missing("pkg:torch", CPU) is None
    assert requirement_missing("pkg:codabench_no_such_module", CPU).startswith("skipped: package")
    with pytest.raises(ValueError):
        requirement_missing("quantum", CPU)


def test_plugin_file_registers_its_implementations(registry):
    load_plugin_file(PLUGINS / "good.py")
    assert registry.get("gemm_out", "test-good").source.startswith("codabench_plugin_good_")
    assert registry.get("rmsnorm_linear", "test-good-autograd").modes == ("fwd", "bwd", "fwd_bwd")
    assert not [e for e in registry.load_errors if "good.py" in e[0]]


def test_broken_plugin_is_recorded_not_raised(registry):
    load_plugin_file(PLUGINS / "broken.py")
    load_plugin_file(PLUGINS / "does_not_exist.py")
    sources = [s for s, _ in registry.load_errors]
    assert any(s.endswith("broken.py") for s in sources)
    assert any(s.endswith("does_not_exist.py") for s in sources)
    err = dict(registry.load_errors)[str((PLUGINS / "broken.py").resolve())]
    assert err == f"ImportError: this plugin is broken on purpose ({(PLUGINS / 'broken.py').resolve()}:2)"


def test_a_misspelled_op_is_a_load_error_at_its_line(registry):
    load_plugin_file(PLUGINS / "misspelled_op.py")
    err = dict(registry.load_errors)[str((PLUGINS / "misspelled_op.py").resolve())]
    assert "registers op 'gemm_outt', which does not exist" in err and err.endswith("misspelled_op.py:7)"), err
    assert "test-misspelled" not in registry.names()


def test_same_named_plugin_files_of_two_folders_both_load(registry, tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "kernels_mine.py").write_text(
            "import torch.nn.functional as F\nfrom codabench.registry import register\n"
            f"register('gemm_out', 'test-same-name-{folder}', dtypes=('fp32',))(lambda x, w: {{'out': F.linear(x, w)}})\n")
        load_plugin_file(tmp_path / folder / "kernels_mine.py")
    assert {"test-same-name-a", "test-same-name-b"} <= set(registry.names())
    assert not registry.load_errors or all("kernels_mine" not in s for s, _ in registry.load_errors)


def test_entry_points_are_loaded_and_failures_recorded(registry, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    eps = [importlib.metadata.EntryPoint("good", "good", ENTRY_POINT_GROUP),
           importlib.metadata.EntryPoint("missing", "codabench_no_such_plugin_module", ENTRY_POINT_GROUP)]

    def fake_entry_points(group=None, **kw):
        return [e for e in eps if e.group == group]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    discover(entry_points=True)
    assert registry.get("gemm_out", "test-good") is not None
    assert any(s == "entry point missing" for s, _ in registry.load_errors)


def test_registry_names_and_for_op(registry):
    assert "torch-eager" in registry.names()
    assert all(i.op == "block" for i in registry.for_op("block"))
    assert REGISTRY is registry
