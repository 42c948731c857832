"""The files of a run directory and their columns.

``results.csv`` (one row per cell) and ``errors.csv`` (one row per cell x compared output) are
appended to as each cell finishes, each row flushed and fsynced, so a killed run keeps what it
measured. ``samples.jsonl`` keeps every timing sample. :func:`read_csv` tolerates a last line cut
off by a kill.
"""
from __future__ import annotations

import csv
import json
import math
import os
from io import StringIO
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

RESULTS, ERRORS, SAMPLES, ENV = "results.csv", "errors.csv", "samples.jsonl", "env.json"
KEY = ["op", "model", "mode", "dtype", "impl"]

RESULT_COLUMNS = [
    "op", "impl", "model", "mode", "dtype", "status", "message", "label", "tokens", "check_tokens", "fp8_recipe",
    "median_ms", "p20_ms", "p80_ms", "cv", "n_samples", "timing", "first_call_s", "tflops", "speedup", "sol_ms",
    "sol_ratio", "pct_ceiling", "cast_ms", "rel_err", "max_abs_err", "err_ratio", "rel_err_vs_bf16", "correct",
    "sm_clock_mhz", "temp_c", "finished_at"]
"""``timing`` is ``cuda-events``, ``cuda-graph`` or ``cpu-wall`` (cpu-wall is not a performance figure).
``first_call_s`` = wall seconds of the first call at the timed shape, before any sample (torch.compile
compiling, FlashInfer's JIT, Triton autotuning: each provider's warm-up cost in this process);
``speedup`` = torch-compile median / this median on the same cell; ``sol_ms`` = sum of the cell's
plain cuBLAS GEMM times; ``sol_ratio`` = median_ms / sol_ms; ``pct_ceiling`` = tflops as % of the
measured GEMM ceiling of the dtype. ``rel_err``, ``max_abs_err`` and ``err_ratio`` are the worst over
the compared outputs; ``correct`` is True when every compared output passes. fp8 cells only (empty
otherwise): ``fp8_recipe`` (scaling and accumulation), ``cast_ms`` (median time of quantizing the
cell's GEMM operands, not part of ``median_ms``; one value per op/model/mode/dtype, on its timed rows) and
``rel_err_vs_bf16`` (worst error against the unquantized bf16 computation)."""

ERROR_COLUMNS = ["op", "impl", "model", "mode", "dtype", "output", "rel_err", "max_abs", "cosine",
                 "torch_rel_err", "ratio", "rel_err_vs_bf16", "passed"]


class AppendWriter:
    """Appends rows to a CSV (header written once), durable after each row."""

    def __init__(self, path: Path, columns: list[str]):
        self.path, self.columns = path, columns
        if path.exists() and path.stat().st_size:
            _drop_partial_last_line(path)
        else:
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(columns)

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, self.columns, extrasaction="raise")
            for row in rows:
                w.writerow({k: _cell(row.get(k)) for k in self.columns})
            f.flush()
            os.fsync(f.fileno())


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return repr(v)
    return "" if v is None else v


def _drop_partial_last_line(path: Path) -> None:
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    if path.exists():
        _drop_partial_last_line(path)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_csv(path: Path, columns: list[str]) -> pd.DataFrame:
    """The rows of a results/errors CSV (complete lines only), with every expected column."""
    if not path.exists():
        return pd.DataFrame(columns=columns)
    data = path.read_text()
    if data and not data.endswith("\n"):
        data = data[: data.rfind("\n") + 1]
    df = pd.read_csv(StringIO(data), keep_default_na=False, na_values=[""], dtype={"message": str})
    for c in columns:
        if c not in df.columns:
            df[c] = None
    if "message" in df:
        df["message"] = df["message"].fillna("")
    return df[columns + [c for c in df.columns if c not in columns]]


def read_samples(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut off by a kill
            continue
    return out


def write_json(path: Path, obj: Any) -> None:
    """Strict JSON, indented, except that each element of a list of dicts (a row) takes one line."""
    path.write_text(_dumps(_json_safe(obj), 0) + "\n")


def _dumps(obj: Any, depth: int) -> str:
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(obj, dict) and obj:
        items = (f"{inner}{json.dumps(k)}: {_dumps(v, depth + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        return "[\n" + ",\n".join(inner + json.dumps(v) for v in obj) + f"\n{pad}]"
    return json.dumps(obj)


def _json_safe(obj: Any) -> Any:
    """NaN -> null and +-inf -> "inf"/"-inf", so the file is strict JSON."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        return ("inf" if obj > 0 else "-inf") if math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
