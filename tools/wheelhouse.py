"""Wheels of the baseline packages and of transformers for GPU nodes without internet (a packaging tool of the
repository, not part of the harness: it imports nothing of codabench, so it runs before codabench is installed).

On a connected machine, from the repository root::

    python tools/wheelhouse.py build --dest DIR --python-version 3.12 --platform manylinux_2_28_x86_64

downloads (``pip download --no-deps --only-binary=:all:``) liger-kernel, flashinfer-python, apache-tvm-ffi,
and transformers with what it imports (``HF_SPECS``, for :mod:`kernels.coda.hf`), for the node's Python and
platform. It rewrites the flashinfer wheel so that its ``data/`` keeps only what the norm, activation and
RoPE modules JIT-compile: ``data/include``, ``data/cutlass``, ``data/cccl``, ``data/spdlog`` and, of
``data/csrc``, ``norm.cu``, ``rope.cu``, their two ``flashinfer_*_binding.cu`` files and every
``*.h``/``*.cuh`` header (62 MB -> ~35 MB).
The rewritten wheel keeps its name; its ``RECORD`` lists exactly the files it holds, so pip
installs it. ``DIR/wheelhouse.json`` records every file's size and sha256. A file larger than
``--max-part-mib`` is split into ``NAME.part00``, ``NAME.part01``, ... (join by hand with
``cat NAME.part* > NAME``). Carry DIR (and this file) to the node, then::

    python tools/wheelhouse.py install DIR

joins any split files (checking their sha256), then runs ``pip install --no-index --no-deps`` on
every wheel in DIR. ``--no-deps``: the node already has flashinfer's import-time needs (torch,
nvidia-ml-py, cuda-bindings, tqdm, packaging, requests, ninja); flashinfer's other declared
dependencies (cutlass-dsl, cudnn-frontend, nccl, ...) serve kernels this suite does not call.
transformers: ``HF_SPECS`` are the distributions that ``import transformers``, building a
LlamaForCausalLM, its forward/backward and ``save_pretrained``/``from_pretrained`` from a local folder, and PEFT
LoRA on it (the train suite's ``hf-*-lora``), import beyond torch's and codabench's own requirements
(tokenizers, safetensors, regex, pyyaml and psutil are platform wheels). Its other declared dependencies (typer, click, fsspec, hf-xet) serve the command line
and hub downloads. The pins are versions tested together (``tests/test_wheelhouse.py`` checks the set).
quack is not in the default set (it needs nvidia-cutlass-dsl, about 100 MB); add it with
``--extra quack-kernels==0.6.1 --extra nvidia-cutlass-dsl==... --extra ...``.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import posixpath
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

LIGER_VERSION = "0.8.5"
FLASHINFER_VERSION = "0.7.2.post1"
TVM_FFI_SPEC = "apache-tvm-ffi>=0.1.11,<0.2"  # flashinfer 0.7.2.post1's requirement
HF_SPECS = ("transformers==5.24.0", "huggingface-hub==2.4.0", "tokenizers==0.23.3", "safetensors==0.8.0",
            "regex==2026.11.19", "pyyaml==6.0.4", "httpx2==2.16.2", "httpcore2==2.16.2", "h11==0.16.0",
            "anyio==4.16.0", "idna==3.20", "truststore==0.10.5", "peft==0.21.2", "accelerate==1.15.0",
            "psutil==7.2.2")
MANIFEST = "wheelhouse.json"

FLASHINFER_DATA_DIRS = ("include", "cutlass", "cccl", "spdlog")
FLASHINFER_CSRC_SOURCES = ("norm.cu", "flashinfer_norm_binding.cu", "rope.cu", "flashinfer_rope_binding.cu")
_PART = re.compile(r"^(?P<name>.+)\.part(?P<idx>\d{2})$")


def keep_flashinfer_file(path: str) -> bool:
    """Whether a file of the flashinfer wheel is needed by the norm, activation and RoPE JIT modules.

    Everything outside ``flashinfer/data/`` (the Python package, dist-info) and the loose files of
    ``data/`` are kept; of the data subfolders only the header trees and the four sources.
    """
    parts = path.split("/")
    if parts[:2] != ["flashinfer", "data"] or len(parts) == 3:
        return True
    sub = parts[2]
    if sub in FLASHINFER_DATA_DIRS:
        return True
    if sub == "csrc":
        base = posixpath.basename(path)
        return base in FLASHINFER_CSRC_SOURCES or base.endswith((".h", ".cuh"))
    return False


@dataclass
class TrimStats:
    kept: int
    dropped: int
    bytes_before: int
    bytes_after: int


def trim_wheel(src: Path, dest: Path, keep=keep_flashinfer_file) -> TrimStats:
    """Write ``dest``: the wheel ``src`` with only the files ``keep`` accepts, and a matching RECORD."""
    src, dest = Path(src), Path(dest)
    bytes_before = src.stat().st_size
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        record_name = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        kept = [i for i in infos if i.filename == record_name or keep(i.filename)]
        kept_names = {i.filename for i in kept}
        rows = list(csv.reader(io.StringIO(zin.read(record_name).decode())))
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(r for r in rows if r and r[0] in kept_names)
        tmp = dest.with_name(dest.name + ".tmp")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
            for info in kept:
                data = record.getvalue().encode() if info.filename == record_name else zin.read(info)
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(dest)
    return TrimStats(kept=len(kept), dropped=len(infos) - len(kept), bytes_before=bytes_before,
                     bytes_after=dest.stat().st_size)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split_file(path: Path, max_bytes: int) -> list[Path]:
    """Split ``path`` into ``path.part00, path.part01, ...`` of at most ``max_bytes``; remove ``path``."""
    parts = []
    with open(path, "rb") as f:
        for idx, chunk in enumerate(iter(lambda: f.read(max_bytes), b"")):
            part = path.with_name(f"{path.name}.part{idx:02d}")
            part.write_bytes(chunk)
            parts.append(part)
    path.unlink()
    return parts


def join_parts(folder: Path) -> list[Path]:
    """Join every ``NAME.partNN`` set in ``folder`` into ``NAME`` (sha256 checked against the manifest)."""
    folder = Path(folder)
    manifest = json.loads((folder / MANIFEST).read_text()) if (folder / MANIFEST).exists() else {"files": {}}
    groups: dict[str, list[Path]] = {}
    for p in sorted(folder.iterdir()):
        m = _PART.match(p.name)
        if m:
            groups.setdefault(m["name"], []).append(p)
    joined = []
    for name, parts in groups.items():
        expected = manifest["files"].get(name, {}).get("parts")
        if expected is not None and [p.name for p in parts] != expected:
            raise RuntimeError(f"{name}: expected parts {expected}, found {[p.name for p in parts]}")
        out = folder / name
        with open(out, "wb") as f:
            for p in parts:
                f.write(p.read_bytes())
        want = manifest["files"].get(name, {}).get("sha256")
        if want and sha256_file(out) != want:
            out.unlink()
            raise RuntimeError(f"{name}: sha256 of the joined parts differs from {MANIFEST}")
        for p in parts:
            p.unlink()
        joined.append(out)
    return joined


def compatible_platforms(platform: str) -> list[str]:
    """``platform`` and the older manylinux tags a node of that glibc also installs, newest first.

    pip before 24 takes ``--platform manylinux_2_28_x86_64`` literally and misses wheels tagged only
    ``manylinux_2_17`` (tokenizers' abi3 wheel); every tag a node accepts is passed instead.
    """
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    minor, arch = int(m.group(1)), m.group(2)
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = [f"manylinux_2_{v}_{arch}" for v in range(minor, 4, -1)]
    return tags + [f"{legacy[v]}_{arch}" for v in sorted(legacy, reverse=True) if v <= minor]


def pip_download_command(specs: list[str], dest: Path, python_version: str, platform: str) -> list[str]:
    platforms = [arg for tag in compatible_platforms(platform) for arg in ("--platform", tag)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, *platforms, "-d", str(dest), *specs]


def default_specs(liger_version: str = LIGER_VERSION, flashinfer_version: str = FLASHINFER_VERSION) -> list[str]:
    return [f"liger-kernel=={liger_version}", f"flashinfer-python=={flashinfer_version}", TVM_FFI_SPEC, *HF_SPECS]


def build(dest: Path, python_version: str, platform: str, specs: list[str], max_part_bytes: int) -> dict:
    """Download, trim flashinfer, split oversized files, write and return the manifest."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(pip_download_command(specs, dest, python_version, platform), check=True)
    manifest: dict = {"python_version": python_version, "platform": platform, "specs": specs, "files": {}}
    for wheel in sorted(dest.glob("*.whl")):
        entry: dict = {}
        if wheel.name.startswith("flashinfer_python-"):
            stats = trim_wheel(wheel, wheel)
            entry["trimmed"] = {"kept_files": stats.kept, "dropped_files": stats.dropped,
                                "keep_data_dirs": list(FLASHINFER_DATA_DIRS),
                                "keep_csrc": [*FLASHINFER_CSRC_SOURCES, "*.h", "*.cuh"]}
        entry["bytes"], entry["sha256"] = wheel.stat().st_size, sha256_file(wheel)
        if entry["bytes"] > max_part_bytes:
            entry["parts"] = [p.name for p in split_file(wheel, max_part_bytes)]
        manifest["files"][wheel.name] = entry
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def install_command(folder: Path, target: str | None = None) -> list[str]:
    wheels = sorted(str(p) for p in Path(folder).glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no wheels in {folder}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(folder), *wheels]
    return cmd + (["--target", target] if target else [])


def main(argv: list[str] | None = None) -> int:
    """``build`` or ``install``, as the module's docstring shows."""
    ap = argparse.ArgumentParser(prog="wheelhouse.py", description=__doc__.split("\n\n")[0])
    commands = ap.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build", help="download and trim the wheels into a folder (needs the internet)")
    b.add_argument("--dest", required=True, type=Path, help="folder to fill (created)")
    b.add_argument("--python-version", default="3.12", help="the GPU node's Python (default 3.12)")
    b.add_argument("--platform", default="manylinux_2_28_x86_64", help="the node's wheel platform tag")
    b.add_argument("--liger-version", default=LIGER_VERSION)
    b.add_argument("--flashinfer-version", default=FLASHINFER_VERSION)
    b.add_argument("--extra", action="append", default=[], metavar="SPEC",
                   help="another requirement to download (repeatable), e.g. quack-kernels==0.6.1")
    b.add_argument("--max-part-mib", type=float, default=60.0,
                   help="split files larger than this into parts (default 60)")
    i = commands.add_parser("install", help="install a folder made by 'build', with no index")
    i.add_argument("folder", type=Path)
    i.add_argument("--target", help="install into this folder (pip --target) instead of site-packages")
    i.add_argument("--dry-run", action="store_true", help="print the pip command, install nothing")
    args = ap.parse_args(argv)
    return build_main(args) if args.command == "build" else install_main(args)


def build_main(args: argparse.Namespace) -> int:
    """Download, trim and split into ``args.dest``; a line per file."""
    specs = default_specs(args.liger_version, args.flashinfer_version) + args.extra
    manifest = build(args.dest, args.python_version, args.platform, specs, int(args.max_part_mib * 2**20))
    total = 0
    for name, entry in manifest["files"].items():
        total += entry["bytes"]
        note = f"  (split: {', '.join(entry['parts'])})" if "parts" in entry else ""
        note += "  (trimmed)" if "trimmed" in entry else ""
        print(f"{entry['bytes'] / 2**20:8.2f} MiB  {name}{note}")
    print(f"{total / 2**20:8.2f} MiB  total in {args.dest}; on the node: python tools/wheelhouse.py install DIR")
    return 0


def install_main(args: argparse.Namespace) -> int:
    """Join split files, then ``pip install --no-index --no-deps`` every wheel (exit code 2: nothing to install)."""
    try:
        if not args.folder.is_dir():
            raise FileNotFoundError(f"{args.folder}: no such directory")
        for joined in join_parts(args.folder):
            print(f"joined {joined.name}")
        cmd = install_command(args.folder, args.target)
    except (OSError, RuntimeError, ValueError) as e:  # ValueError: an unreadable wheelhouse.json
        print(f"wheelhouse.py install: {e}", file=sys.stderr)
        return 2
    print(" ".join(cmd))
    return 0 if args.dry_run else subprocess.run(cmd).returncode


if __name__ == "__main__":
    raise SystemExit(main())
