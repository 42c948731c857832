"""The results store: the files of a run directory, their columns, and reading a run back.

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

from codabench.matrix import BASELINE_ORDER
from workloads.models import PRESETS
from workloads.op import MODES
from workloads.ops import OPS

RESULTS, ERRORS, SAMPLES, ENV = "results.csv", "errors.csv", "samples.jsonl", "env.json"
KEY = ["op", "model", "mode", "dtype", "impl"]

RESULT_COLUMNS = [
    "op", "impl", "model", "mode", "dtype", "status", "message", "label", "strategy", "tokens", "check_tokens",
    "fp8_recipe",
    "median_ms", "p20_ms", "p80_ms", "cv", "n_samples", "timing", "grain", "n_sweeps", "stop", "settle_s",
    "settle_mhz", "settle_w", "first_call_s", "check_s", "setup_s", "tflops",
    "speedup", "speedup_lo", "speedup_hi", "vs_best", "vs_best_lo", "vs_best_hi", "verdict", "sol_ms", "sol_ratio",
    "pct_ceiling", "floor_ms",
    "peak_mem_mib", "cast_ms", "rel_err", "max_abs_err", "err_ratio", "rel_err_vs_bf16", "correct",
    "sm_clock_min_mhz", "sm_clock_median_mhz", "sm_clock_mhz", "power_w", "temp_c", "finished_at"]
"""``strategy`` = how the implementation ran the cell, in its own words (:meth:`codabench.registry.Implementation.
describe`; coda-triton: each fused kernel's ``fused`` or ``split`` path), "" when it says nothing. ``timing`` is
``cuda-events``, ``cuda-graph`` or ``cpu-wall`` (cpu-wall is not a performance figure). ``grain`` = ``sample``
(the group's cells and GEMMs took turns sample by sample, in interleaved sweeps) or ``round`` (the blocks fallback:
the message says why); ``n_sweeps`` = the sweeps (rounds) taken; ``stop`` = why sampling stopped (``resolved``: every
watched ratio within ``--precision``; ``budget``; ``max_sweeps``; ``cpu``; ``blocks``); ``settle_s``, ``settle_mhz``,
``settle_w`` = the warm-up before the group's sweeps (until the clock and power settled) and the SM clock and power it
reached.
``first_call_s`` = wall seconds of the first call at the timed shape, before any sample (torch.compile
compiling, FlashInfer's JIT, Triton autotuning: each provider's warm-up cost in this process); ``check_s`` = wall
seconds of the cell's correctness pass at the check shape (its first call there, compiling and tuning; the cell that
first needs the group's float64 reference pays for it here); ``setup_s`` = wall seconds of the cell's first round
(correctness pass, first call, samples, the checks that make them count), so a run's cold cost per implementation
is its ``check_s`` and ``first_call_s`` summed;
``speedup`` = this cell's speed over torch-compile's on the same cell (the median of the per-sweep ratios where the
group was sampled in sweeps, else torch-compile's median / this median); ``sol_ms`` = sum of the cell's
plain cuBLAS GEMM times; ``sol_ratio`` = median_ms / sol_ms; ``pct_ceiling`` = tflops as % of the
measured GEMM ceiling of the dtype; ``floor_ms`` = the op's physical floor on this GPU, the larger of its
minimum bytes at the measured copy bandwidth and its FLOPs at the measured GEMM ceiling; ``peak_mem_mib`` = the
peak memory one call allocates above its inputs. ``speedup_lo``/``speedup_hi`` = 95% confidence interval of the
speedup; ``vs_best`` (with ``vs_best_lo``/``vs_best_hi``) = this cell's speed over the fastest *other* implementation of the
group (the same estimate); ``verdict`` = ``faster`` or ``slower`` (the interval lies above or below 1), ``same`` (it
lies inside env.json's ``timing.same_within`` margin, default 2%) or ``unresolved`` against it (``n/a``: nothing to
compare, CPU wall times or too few samples); all of them recomputed by :func:`codabench.stats.speed_figures` when a
report is built. ``sm_clock_min_mhz``/``sm_clock_median_mhz`` = NVML SM clock sampled during the cell's kept
samples; ``sm_clock_mhz``, ``power_w``, ``temp_c`` = the GPU's state when the row was written. ``rel_err``, ``max_abs_err`` and ``err_ratio`` are the worst over
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


def sample_rounds(run_dir: Path, env: dict[str, Any]) -> dict[tuple[str, ...], list[list[float]]]:
    """Each timed cell's samples (``samples.jsonl``) by timing round, keyed like :data:`KEY`.

    Runs from before the rounds were stored kept only the pooled samples, in round order; where their ``--reps``
    was fixed every round took the same number, so env.json's ``timing.rounds`` splits them back. Otherwise the
    samples count as one round."""
    timing = env.get("timing") or {}
    legacy = (timing.get("rounds") or 1) if timing.get("reps") else 1
    out = {}
    for s in read_samples(run_dir / SAMPLES):
        pooled = s.get("samples_ms") or []
        rounds = s.get("rounds")
        if rounds is None:
            n = legacy if len(pooled) % legacy == 0 else 1
            rounds = [pooled[i * len(pooled) // n:(i + 1) * len(pooled) // n] for i in range(n)]
        out[tuple(str(s[k]) for k in KEY)] = rounds
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


def _bool_or_none(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v in ("True", "False"):
        return v == "True"
    return None


def load_run(run_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """results and errors (last row per cell kept, sorted), and env.json, of a run directory."""
    run_dir = Path(run_dir)
    df = read_csv(run_dir / RESULTS, RESULT_COLUMNS)
    err = read_csv(run_dir / ERRORS, ERROR_COLUMNS) if (run_dir / ERRORS).exists() \
        else pd.DataFrame(columns=ERROR_COLUMNS)
    env_path = run_dir / ENV
    env = json.loads(env_path.read_text()) if env_path.exists() else {}
    for frame in (df, err):
        for c in KEY:
            if c in frame:
                frame[c] = frame[c].fillna("").astype(str)
    df["correct"] = df["correct"].map(_bool_or_none).astype(object)
    err["passed"] = err["passed"].map(_bool_or_none).astype(object)
    df = df.drop_duplicates(KEY, keep="last")
    err = err.drop_duplicates(KEY + ["output"], keep="last")
    return _sorted(df), _sorted(err), env


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    ops, models = list(OPS), sorted(PRESETS, key=lambda m: (PRESETS[m].hidden, m))

    def rank(values, order):
        return values.map(lambda v: order.index(v) if v in order else len(order))

    keys = pd.DataFrame({
        "op": rank(df["op"], ops), "model": rank(df["model"], models), "mode": rank(df["mode"], list(MODES)),
        "dtype": df["dtype"], "impl": df["impl"].map(lambda i: (BASELINE_ORDER.index(i) if i in BASELINE_ORDER
                                                               else len(BASELINE_ORDER), i))})
    order = sorted(range(len(df)), key=lambda i: tuple(keys.iloc[i]) + (df["impl"].iloc[i],))
    return df.iloc[order].reset_index(drop=True)


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as dicts, NaN as None."""
    out = []
    for rec in df.to_dict("records"):
        out.append({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()})
    return out


