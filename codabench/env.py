"""Environment metadata stored with every run (env.json) and the GPU state stored with every row.

NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``) is optional: without it the clocks,
temperature and driver fields say why they are missing. Clocks are only read, never set.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import codabench
from codabench.registry import Implementation

REPO_ROOT = Path(__file__).resolve().parent.parent


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_sha() -> str | None:
    """HEAD's SHA of the repository codabench runs from, with ``-dirty`` when the tree has changes."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def code_tree(repo: Path = REPO_ROOT) -> str | None:
    """The git tree hash of the code as it is on disk: every file git does not ignore, tracked or not, hashed into a
    throwaway index (the repository's own index and work tree are untouched; git stores the blobs as objects). It
    equals ``git rev-parse COMMIT^{tree}`` of the commit whose files these are, whatever HEAD says: a copy of a work
    tree with a stale ``.git`` (a GPU node's) still names its code."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        try:
            for cmd in (["git", "add", "-A", "."], ["git", "write-tree"]):
                out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=60)
                if out.returncode != 0:
                    return None
        except (OSError, subprocess.SubprocessError):
            return None
    return out.stdout.strip() or None


def nvml_handle(device: torch.device) -> tuple[Any, Any]:
    """``(pynvml, handle)`` of the GPU behind ``device``. NVML numbers GPUs physically and ignores
    ``CUDA_VISIBLE_DEVICES``, so the GPU is found by its UUID as CUDA reports it; the index serves only where
    the UUID is not to be had."""
    import pynvml

    pynvml.nvmlInit()
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    return pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


def gpu_state(device: torch.device) -> dict[str, Any]:
    """Current SM/memory clocks (MHz), temperature (C) and power (W) via NVML; empty without it."""
    if device.type != "cuda":
        return {}
    try:
        nv, h = nvml_handle(device)
        return {"sm_clock_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                "mem_clock_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000.0}
    except Exception:
        return {}


def gpu_info(device: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    info: dict[str, Any] = {
        "name": props.name, "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_bytes": getattr(props, "L2_cache_size", None)}
    try:
        nv, h = nvml_handle(device)
        info["driver"] = nv.nvmlSystemGetDriverVersion()
        info["max_sm_clock_mhz"] = nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)
        info["max_mem_clock_mhz"] = nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM)
        info["power_limit_w"] = nv.nvmlDeviceGetPowerManagementLimit(h) / 1000.0
        info["state_at_start"] = gpu_state(device)
    except Exception as e:
        info["nvml"] = f"unavailable ({type(e).__name__}: {e})"
    return info


def provider_metadata(impls: list[Implementation]) -> dict[str, Any]:
    """``Implementation.metadata()`` per implementation name (errors recorded, not raised)."""
    out: dict[str, Any] = {}
    for impl in impls:
        if impl.name in out:
            continue
        try:
            out[impl.name] = {"label": impl.label, "source": impl.source, **impl.metadata()}
        except Exception as e:
            out[impl.name] = {"label": impl.label, "source": impl.source,
                              "metadata_error": f"{type(e).__name__}: {e}"}
    return out


def command() -> str:
    """The command line of this process, as the user typed it (the script's name, then its arguments)."""
    return " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])


def collect_env(device: torch.device, impls: list[Implementation]) -> dict[str, Any]:
    env: dict[str, Any] = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "git_sha": git_sha(),
        "code_tree": code_tree(),
        "codabench": codabench.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton") or _version("pytorch-triton"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "providers": provider_metadata(impls),
    }
    if device.type == "cuda":
        env["gpu"] = gpu_info(device)
    return env
