"""Registration, discovery (the harness's baselines, the built-in and other entry points, --plugin files) and load
errors."""
import importlib
import importlib.metadata
import json
import pkgutil
import subprocess
import sys
from importlib.metadata import EntryPoint
from types import SimpleNamespace

import pytest
import torch

from codabench import discovery, guard
from codabench.case import Case
from codabench.discovery import ENTRY_POINT_GROUP, builtin_entry_points, discover, load_plugin_file, other_entry_points
from codabench.eager import TorchEager
from codabench.registry import (REGISTRY, REQUIREMENTS, FunctionImplementation, Implementation, Registry, register,
                                requirement_missing)
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
    assert registry.get("gemm_out", "torch-eager").source == "codabench.eager"


def test_the_builtin_implementations_are_the_project_entry_points(registry):
    """pyproject.toml's entry points are exactly the modules under kernels/ that register implementations, and an
    entry point named after an implementation points at the module that registers it."""
    eps = builtin_entry_points()
    assert len(eps) >= 6 and all(ep.group == ENTRY_POINT_GROUP for ep in eps)
    import kernels

    for info in pkgutil.walk_packages(kernels.__path__, prefix="kernels."):  # a module left out of pyproject too
        importlib.import_module(info.name)
    sources = {i.source for i in registry.impls.values()}
    assert {s for s in sources if s.startswith("kernels.")} == {ep.value for ep in eps}
    for ep in eps:
        named = {i.source for i in registry.impls.values() if i.name == ep.name}
        assert named in (set(), {ep.value}), ep
    assert not [e for e in registry.load_errors if e[0] in {ep.value for ep in eps}]


def test_builtin_entry_points_outside_a_source_tree_come_from_the_installed_metadata(monkeypatch, tmp_path):
    installed = [EntryPoint("good", "good", ENTRY_POINT_GROUP), EntryPoint("codabench", "codabench.cli:main",
                                                                           "console_scripts")]
    monkeypatch.setattr(importlib.metadata, "distribution",
                        lambda name: SimpleNamespace(entry_points=installed) if name == "codabench" else None)
    monkeypatch.setattr(discovery, "SOURCE_TREE", tmp_path)  # no pyproject.toml: an installed wheel
    assert builtin_entry_points() == installed[:1]
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "another-project"\n')  # another project's tree
    assert builtin_entry_points() == installed[:1]
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "codabench"\n'
                                             '[project.entry-points."codabench.plugins"]\nmine = "my.module"\n')
    assert builtin_entry_points() == [EntryPoint("mine", "my.module", ENTRY_POINT_GROUP)]


def test_other_entry_points_leave_out_the_project_own(monkeypatch):
    own = SimpleNamespace(name="liger", value="kernels.liger", group=ENTRY_POINT_GROUP,
                          dist=SimpleNamespace(name="codabench"))
    theirs = EntryPoint("good", "good", ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None, **kw: [own, theirs])
    assert other_entry_points() == [theirs]


def test_the_harness_and_the_workloads_import_no_implementation():
    """codabench and workloads never import kernels: the implementations are plugins, found by discovery."""
    code = ("import importlib, json, pkgutil, sys\n"
            "from codabench.bootstrap import select_device\n"
            "select_device()\n"
            "import codabench, workloads\n"
            "for pkg in (codabench, workloads):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        if not m.name.endswith('__main__'):\n"
            "            importlib.import_module(m.name)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('codabench', 'workloads', 'kernels'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "codabench.cli" in loaded and "workloads.ops.block" in loaded
    assert not [m for m in loaded if m.split(".")[0] == "kernels"], loaded


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


def test_a_name_removed_from_a_registry_stays_taken():
    """Entries are append-only: one removed is tampering that the guard puts back, and its name cannot be
    registered again meanwhile, by the same module or another."""
    registry = Registry()
    first = registry.add(TorchEager(OPS["gemm_out"]))
    del registry.impls[("gemm_out", "torch-eager")]
    again = TorchEager(OPS["gemm_out"])
    again.source = "some_plugin"
    with pytest.raises(ValueError, match=r"registered twice: by \S+eager.py and again by some_plugin \(after "
                                         r"removing the first, which does not free it\)"):
        registry.add(again)
    assert guard.tampered() == ["the registered implementation ('gemm_out', 'torch-eager') (removed)"]
    guard.restore()
    assert registry.impls[("gemm_out", "torch-eager")] is first and guard.tampered() == []


def _plugin(path, body: str):
    path.write_text("import torch.nn.functional as F\nfrom codabench.registry import register\n" + body)
    return path


def test_a_name_registered_twice_is_refused_naming_both_sources(registry, tmp_path):
    """From two plugin files, or twice in one: the second is the file's load error (one line naming both files), the
    first stays; a plugin cannot take over a baseline's name either."""
    one = "register('gemm_out', 'test-dup', dtypes=('fp32',))(lambda x, w: {'out': F.linear(x, w)})\n"
    first, second = _plugin(tmp_path / "first.py", one), _plugin(tmp_path / "second.py", one.replace("w)}", "w) * 2}"))
    same = _plugin(tmp_path / "same.py", one.replace("test-dup", "test-dup-same") * 2)
    eager = _plugin(tmp_path / "eager.py", one.replace("test-dup", "torch-eager"))
    for f in (first, second, same, eager):
        load_plugin_file(f)
    errors = dict(registry.load_errors)
    assert f"registered twice: by {first} and again by {second}; a name must be unique per op" in errors[str(second)]
    assert f"'test-dup-same' of op 'gemm_out' registered twice: by {same} (twice)" in errors[str(same)]
    assert "'torch-eager' of op 'gemm_out' registered twice: by " in errors[str(eager)]
    assert str(first) not in errors and registry.get("gemm_out", "test-dup").source.startswith("codabench_plugin_first")
    assert registry.get("gemm_out", "torch-eager").source == "codabench.eager"
    discover(entry_points=False)  # discovery again (as every test does) registers nothing twice
    assert len(registry.load_errors) == len(errors)


@pytest.mark.parametrize("kwargs, says", [
    ("dtypes=('fp33',)", "unknown dtype(s) 'fp33' (valid: fp32, fp16, bf16, fp8, fp8-row)"),
    ("modes=('forward',)", "unknown mode(s) 'forward' (valid: fwd, bwd, fwd_bwd)"),
    ("requires=('gpu',)", "unknown requirement(s) 'gpu' (valid: cuda, sm90, cpu, triton, triton-dot, pkg:<module>)"),
    ("requires=('pkg:',)", "unknown requirement(s) 'pkg:'"),
    ("dtypes='fp32'", "dtypes='fp32' is a string; give a tuple"),
])
def test_a_misspelled_declaration_is_refused_at_registration(registry, tmp_path, kwargs, says):
    plugin = _plugin(tmp_path / "typo.py", f"register('gemm_out', 'test-typo', {kwargs})(lambda x, w: {{'out': x}})\n")
    load_plugin_file(plugin)
    err = dict(registry.load_errors)[str(plugin)]
    assert f"ValueError: implementation 'test-typo' of op 'gemm_out': {says}" in err and err.endswith("typo.py:3)")
    assert "test-typo" not in registry.names()


def test_every_known_requirement_is_one_requirement_missing_answers():
    for req in (*REQUIREMENTS, "pkg:torch"):
        requirement_missing(req, CPU, "fp32")  # no ValueError


def test_an_op_a_plugin_adds_gets_the_baselines(registry, tmp_path):
    """discovery registers torch-eager and torch-compile again after the plugin files, for the ops they added."""
    plugin = tmp_path / "new_op.py"
    plugin.write_text("from workloads.ops import OPS\nfrom workloads.ops.gemm_bias_gelu import GemmBiasGelu\n\n\n"
                      "class NewOp(GemmBiasGelu):\n    name = 'test_new_op'\n\n\nOPS[NewOp.name] = NewOp()\n")
    try:
        discover([plugin], entry_points=False)
        assert {i.name for i in registry.for_op("test_new_op")} == {"torch-eager", "torch-compile"}
        assert registry.get("test_new_op", "torch-eager").op_def is OPS["test_new_op"]
    finally:
        OPS.pop("test_new_op", None)


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


def test_a_plugin_that_fails_halfway_contributes_no_implementation(registry, tmp_path):
    """As with any failed import, nothing of it is used: what it registered before the error is left out of every
    selection (its function may read a global the error left undefined), named in its load error, and stays taken."""
    plugin = tmp_path / "halfway.py"
    plugin.write_text("import torch.nn.functional as F\n"
                      "from codabench.registry import register\n\n\n"
                      "@register('gemm_out', 'test-halfway', dtypes=('fp32',))\n"
                      "def linear(x, w):\n"
                      "    return {'out': F.linear(x, w) * SCALE}\n\n\n"
                      "raise RuntimeError('no GPU here')\n"
                      "SCALE = 1.0\n")
    load_plugin_file(plugin)
    err = dict(registry.load_errors)[str(plugin.resolve())]
    assert err.startswith("RuntimeError: no GPU here") and err.endswith(
        "left out, as registered by a failed import: test-halfway (gemm_out)"), err
    assert "test-halfway" not in registry.names()
    assert "test-halfway" not in [i.name for i in registry.for_op("gemm_out")]
    with pytest.raises(ValueError, match="registered twice"):
        register("gemm_out", "test-halfway", dtypes=("fp32",))(lambda x, w: {"out": x @ w.T})


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


def test_first_calls_arm_once_per_shape():
    """prepare runs before every timed call: one-time work is armed at a shape's first prepare only."""
    from codabench.registry import FirstCalls

    first = FirstCalls()
    first.arm(("7b", "bf16"), "cuda:0")
    first.arm(("7b", "bf16"), "cuda:0")  # the next prepare at the same shape: nothing more
    assert first.take() == "cuda:0" and first.take() is None
    first.arm(("7b", "bf16"), "cuda:0")
    assert first.take() is None
    first.arm(("70b", "bf16"), "cuda:1")
    assert first.take() == "cuda:1"


def test_a_plugin_imports_a_module_beside_it(registry, tmp_path):
    """The plugin's folder is searched after every other place: its helper module imports by name, and a module
    beside it named like one of the harness's packages does not replace the harness's."""
    (tmp_path / "codabench_sibling_helper.py").write_text("def double(t):\n    return 2 * t\n")
    (tmp_path / "workloads.py").write_text("raise RuntimeError('a shadow of the harness package was imported')\n")
    plugin = _plugin(tmp_path / "uses_helper.py",
                     "import workloads.ops\n"
                     "from codabench_sibling_helper import double\n"
                     "from codabench.registry import register\n"
                     "@register('gemm_out', 'sibling-gemm', modes=('fwd',), dtypes=('fp32',))\n"
                     "def f(x, w):\n    return {'out': double(x @ w.T) / 2}\n")
    try:
        load_plugin_file(plugin)
        assert not [e for e in registry.load_errors if str(plugin) in e[0]], registry.load_errors
        assert ("gemm_out", "sibling-gemm") in registry.impls
    finally:
        sys.modules.pop("codabench_sibling_helper", None)
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))
