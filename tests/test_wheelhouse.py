"""Wheelhouse for offline nodes (tools/wheelhouse.py): flashinfer trimming on a small fake wheel, split/join, the
command line. No network."""
from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

TOOL = Path(__file__).resolve().parents[1] / "tools" / "wheelhouse.py"
_spec = importlib.util.spec_from_file_location("wheelhouse", TOOL)
W = importlib.util.module_from_spec(_spec)
sys.modules["wheelhouse"] = W  # (dataclasses look their module up)
_spec.loader.exec_module(W)

FAKE = "flashinfer_python-0.0.1-py3-none-any.whl"
DIST = "flashinfer_python-0.0.1.dist-info"
FILES = {
    "flashinfer/__init__.py": "x = 1\n",
    "flashinfer/norm/__init__.py": "",
    "flashinfer/data/build_utils.py": "",
    "flashinfer/data/include/flashinfer/norm.cuh": "// header tree\n",
    "flashinfer/data/cutlass/include/cutlass/cutlass.h": "//\n",
    "flashinfer/data/cccl/cub/cub.cuh": "//\n",
    "flashinfer/data/spdlog/include/spdlog.h": "//\n",
    "flashinfer/data/csrc/norm.cu": "// kept source\n",
    "flashinfer/data/csrc/flashinfer_norm_binding.cu": "//\n",
    "flashinfer/data/csrc/rope.cu": "//\n",
    "flashinfer/data/csrc/flashinfer_rope_binding.cu": "//\n",
    "flashinfer/data/csrc/tvm_ffi_utils.h": "//\n",
    "flashinfer/data/csrc/fused_moe/moe_kernels.cuh": "//\n",
    "flashinfer/data/csrc/batch_prefill.cu": "// dropped\n" * 100,
    "flashinfer/data/csrc/fused_moe/moe.cu": "// dropped\n",
    "flashinfer/data/csrc/gemm/kernel.cpp": "// dropped\n",
    "flashinfer/data/cubins/a.cubin": "dropped",
    f"{DIST}/METADATA": "Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 0.0.1\n",
    f"{DIST}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
DROPPED = {"flashinfer/data/csrc/batch_prefill.cu", "flashinfer/data/csrc/fused_moe/moe.cu",
           "flashinfer/data/csrc/gemm/kernel.cpp", "flashinfer/data/cubins/a.cubin"}


def record_hash(data: bytes) -> str:
    """The wheel RECORD form of a sha256: ``sha256=<urlsafe base64, no padding>``."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_fake_wheel(folder: Path) -> Path:
    path = folder / FAKE
    record = io.StringIO()
    rows = [[name, record_hash(text.encode()), str(len(text.encode()))] for name, text in FILES.items()]
    csv.writer(record, lineterminator="\n").writerows(rows + [[f"{DIST}/RECORD", "", ""]])
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, text in FILES.items():
            z.writestr(name, text)
        z.writestr(f"{DIST}/RECORD", record.getvalue())
    return path


def test_keep_rule_matches_what_the_norm_activation_and_rope_modules_compile():
    keep = W.keep_flashinfer_file
    assert {n for n in FILES if not keep(n)} == DROPPED
    assert keep("flashinfer/jit/norm.py") and keep(f"{DIST}/RECORD")


def test_trimmed_wheel_has_a_consistent_record_and_pip_installs_it(tmp_path):
    src = make_fake_wheel(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    stats = W.trim_wheel(src, out / FAKE)
    assert (stats.kept, stats.dropped) == (len(FILES) + 1 - len(DROPPED), len(DROPPED))
    with zipfile.ZipFile(out / FAKE) as z:
        names = set(z.namelist())
        assert names == (set(FILES) - DROPPED) | {f"{DIST}/RECORD"}
        rows = {r[0]: r for r in csv.reader(io.StringIO(z.read(f"{DIST}/RECORD").decode()))}
        assert set(rows) == names
        for name in names - {f"{DIST}/RECORD"}:
            assert rows[name][1] == record_hash(z.read(name))
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
                           "--target", str(target), str(out / FAKE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (target / "flashinfer/data/csrc/norm.cu").exists()
    assert not (target / "flashinfer/data/csrc/batch_prefill.cu").exists()


def test_trim_in_place_keeps_the_name(tmp_path):
    src = make_fake_wheel(tmp_path)
    before = src.stat().st_size
    stats = W.trim_wheel(src, src)
    assert stats.bytes_before == before and stats.bytes_after == src.stat().st_size < before
    assert zipfile.ZipFile(src).testzip() is None


def test_split_then_join_restores_the_file_and_checks_its_hash(tmp_path):
    data = bytes(range(256)) * 40
    wheel = tmp_path / "big-1.0-py3-none-any.whl"
    wheel.write_bytes(data)
    entry = {"bytes": len(data), "sha256": W.sha256_file(wheel)}
    entry["parts"] = [p.name for p in W.split_file(wheel, 4000)]
    assert entry["parts"] == [f"{wheel.name}.part0{i}" for i in range(3)] and not wheel.exists()
    (tmp_path / W.MANIFEST).write_text(json.dumps({"files": {wheel.name: entry}}))
    assert W.join_parts(tmp_path) == [wheel]
    assert wheel.read_bytes() == data and not list(tmp_path.glob("*.part*"))

    W.split_file(wheel, 4000)
    (tmp_path / f"{wheel.name}.part01").write_bytes(b"corrupted")
    with pytest.raises(RuntimeError, match="sha256"):
        W.join_parts(tmp_path)


def test_download_and_install_commands():
    cmd = W.pip_download_command(W.default_specs(), Path("/w"), "3.12", "manylinux_2_28_x86_64")
    assert cmd[1:4] == ["-m", "pip", "download"]
    for flag in ("--no-deps", "--only-binary=:all:"):
        assert flag in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    platforms = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--platform"]
    assert platforms[0] == "manylinux_2_28_x86_64"
    # an older pip takes each tag literally: the abi3 wheels tagged manylinux_2_17 / 2014 must be asked for too
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= set(platforms)
    assert "manylinux_2_29_x86_64" not in platforms
    assert W.compatible_platforms("win_amd64") == ["win_amd64"]
    assert {"liger-kernel==0.8.5", "flashinfer-python==0.7.2.post1", "transformers==5.24.0"} <= set(cmd)
    assert any(c.startswith("apache-tvm-ffi") for c in cmd) and set(W.HF_SPECS) <= set(cmd)


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: set[str], markers: bool = False) -> set[str]:
    """The distributions and, transitively, their unconditional requirements (those installed here); with
    ``markers``, also those whose environment marker holds here (no extra asked for)."""
    seen, todo = set(), [_dist(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = [Requirement(r) for r in metadata.requires(name) or []]
        except metadata.PackageNotFoundError:
            continue
        todo += [_dist(r.name) for r in reqs
                 if r.marker is None or markers and r.marker.evaluate({"extra": ""})]
    return seen


IMPORTS_OF_HF = """
import json, sys, tempfile
from importlib import metadata
import torch
before = {m.split(".")[0] for m in sys.modules}
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=32, num_hidden_layers=1))
ids = torch.zeros(1, 4, dtype=torch.long)
model(ids, labels=ids).loss.backward()
folder = tempfile.mkdtemp()
model.save_pretrained(folder)
LlamaForCausalLM.from_pretrained(folder)
from peft import LoraConfig, get_peft_model
get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))(ids, labels=ids).loss.backward()
dists = metadata.packages_distributions()
print(json.dumps(sorted({d for m in {m.split(".")[0] for m in sys.modules} - before for d in dists.get(m, [])})))
"""


def test_hf_specs_carry_what_transformers_imports_beyond_torch_and_codabench():
    """Every distribution that a Llama forward/backward/save/load imports is in HF_SPECS or already on a node.

    A node has torch and codabench's requirements (pyproject.toml) with their own requirements; ``install-offline``
    installs with ``--no-deps``, so anything else transformers imports must be a wheel of the wheelhouse.
    """
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")
    tomllib = pytest.importorskip("tomllib", reason="tomllib (Python 3.11+) reads pyproject.toml")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    node = _closure({re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in project["dependencies"]})
    proc = subprocess.run([sys.executable, "-c", IMPORTS_OF_HF], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {_dist(d) for d in json.loads(proc.stdout.strip().splitlines()[-1])}
    # what transformers imports only because another package installed it here (protobuf, by FlashInfer's CUTLASS
    # DSL) is not imported on a node without that package: the wheels needed are the imported requirements
    needed = imported & _closure({"transformers", "peft"}, markers=True)
    carried = {_dist(spec.split("==")[0]) for spec in W.HF_SPECS}
    assert "transformers" in needed and needed - node - carried == set()
    assert carried <= needed  # no wheel is carried that nothing imports


def _tool(*args: str) -> subprocess.CompletedProcess:
    """The command line as a node runs it: the file on its own (isolated mode: neither its folder nor the working
    directory on the path; it needs only the standard library)."""
    return subprocess.run([sys.executable, "-I", str(TOOL), *args], capture_output=True, text=True, timeout=60)


def test_install_dry_run_joins_parts_and_prints_the_command(tmp_path):
    wheel = make_fake_wheel(tmp_path)
    (tmp_path / W.MANIFEST).write_text(json.dumps({"files": {wheel.name: {"sha256": W.sha256_file(wheel)}}}))
    W.split_file(wheel, 500)
    proc = _tool("install", str(tmp_path), "--dry-run", "--target", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stderr
    assert f"joined {FAKE}" in proc.stdout and "--no-index --no-deps" in proc.stdout and str(wheel) in proc.stdout
    assert wheel.exists() and not (tmp_path / "t").exists()


def test_install_refuses_a_missing_or_empty_folder(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder, says in ((tmp_path / "missing", "no such directory"), (empty, "no wheels in")):
        proc = _tool("install", str(folder))
        assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    proc = _tool("fetch")
    assert proc.returncode == 2 and "invalid choice: 'fetch'" in proc.stderr
