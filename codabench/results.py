"""The results store: the files of a run directory, their columns, and reading a run back.

``results.csv`` (one row per cell) and ``errors.csv`` (one row per cell x compared output) are
appended to as each cell finishes, each row flushed and fsynced, so a killed run keeps what it
measured. ``samples.jsonl`` keeps every timing sample; ``profiles.jsonl`` (``--profile``) each timed cell's profile
(:mod:`codabench.profile`), and ``traces/`` (``--profile-trace``) a Chrome trace per cell (:func:`trace_name`).
:func:`read_csv` tolerates a last line cut off by a kill. Every other file is written whole or not at all
(:func:`write_atomic`).

``codabench-run.json`` (:data:`MARKER`) marks a folder as a run of this layout (:data:`SCHEMA`); it is written
before anything else of the run. :func:`check_run` says whether a folder can be read as a run: its marker, or for
a run from before the marker (a legacy run) ``env.json`` beside ``results.csv``; CSVs with codabench's columns and
whole rows; ``samples.jsonl`` and ``profiles.jsonl`` of JSON lines.
"""
from __future__ import annotations

import csv
import datetime
import json
import math
import os
import re
import tempfile
from io import StringIO
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from codabench.matrix import BASELINE_ORDER
from workloads.models import PRESETS
from workloads.op import MODES
from workloads.ops import OPS

RESULTS, ERRORS, SAMPLES, ENV = "results.csv", "errors.csv", "samples.jsonl", "env.json"
PROFILES, TRACES = "profiles.jsonl", "traces"
MARKER, LOCK = "codabench-run.json", ".lock"
SCHEMA = 1
"""The layout of a run folder that this code reads and writes, as its marker states it."""
KEY = ["op", "model", "mode", "dtype", "impl"]

RESULT_COLUMNS = [
    "op", "impl", "model", "mode", "dtype", "status", "message", "label", "strategy", "tokens", "check_tokens",
    "fp8_recipe",
    "median_ms", "p20_ms", "p80_ms", "cv", "n_samples", "timing", "grain", "n_sweeps", "stop", "settle_s",
    "settle_mhz", "settle_w", "host_ms", "first_call_s", "check_s", "setup_s", "tflops",
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
reached; ``host_ms`` = the median host milliseconds of a timed call (its start event's enqueue to its return; GPU
sweeps only): each sample starts behind a lead as long as that (:mod:`codabench.sweep`; at most
:data:`codabench.timing.LEAD_MAX_MS`), so ``median_ms`` is the GPU time of the call with its launches queued, and a
``host_ms`` above it says the call's host side outlasts its GPU work (past the lead's cap, the rest of the host time
is in ``median_ms`` too).
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


_WORDS = {"op", "impl", "model", "mode", "dtype", "status", "message", "label", "strategy", "fp8_recipe", "timing", "grain", "stop",
          "verdict", "correct", "finished_at", "output", "passed"}
"""The columns of results.csv and errors.csv whose values are words; every other column holds a number or nothing."""
_REQUIRED = {RESULTS: KEY + ["status"], ERRORS: KEY + ["output"]}


class RunFolderError(Exception):
    """A folder that cannot be read or written as a run (foreign files, garbage, another schema); one line."""


class AppendWriter:
    """Appends rows to a CSV (header written once), durable after each row. A file of an earlier column list (a
    subset of ``columns``) is first rewritten whole under the new header, its rows kept. It knows what the file must
    hold (what it found, and what it appended since), so that :meth:`restore` undoes what any other writer did."""

    def __init__(self, path: Path, columns: list[str]):
        self.path, self.columns = path, columns
        if path.exists() and path.stat().st_size:
            _drop_partial_last_line(path)
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                if reader.fieldnames != columns:
                    write_atomic(path, _csv_text(list(reader), columns))
        else:
            write_atomic(path, _csv_text([], columns))
        self.expected = path.read_bytes()
        """What the file must hold: what this writer found (or began it with) and the rows it appended."""

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        text = _csv_text(rows, self.columns, header=False).encode()
        with open(self.path, "ab") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        self.expected += text

    def restore(self) -> bool:
        """Put the file back as this writer left it where it holds anything else (a process that is not the run
        wrote into it, or removed it); True if it did."""
        try:
            if self.path.read_bytes() == self.expected:
                return False
        except OSError:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, self.expected)
        return True


def _csv_text(rows: Iterable[dict[str, Any]], columns: list[str], header: bool = True) -> str:
    buf = StringIO()
    w = csv.DictWriter(buf, columns, extrasaction="raise")
    if header:
        w.writeheader()
    for row in rows:
        w.writerow({k: _cell(row.get(k)) for k in columns})
    return buf.getvalue()


def write_csv(path: Path, rows: Iterable[dict[str, Any]], columns: list[str]) -> None:
    """A whole CSV, written atomically."""
    write_atomic(path, _csv_text(rows, columns))


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return repr(v)
    return "" if v is None else v


def _drop_partial_last_line(path: Path) -> None:
    """Cut a last line without its newline (a write cut off by a kill) off in place; the whole lines stay."""
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)


def append_jsonl(path: Path, record: dict[str, Any]) -> bytes:
    """Append ``record`` to the JSON-lines file ``path`` as one line (a cut-off last line dropped first); the bytes
    appended."""
    line = (json.dumps(record) + "\n").encode()
    if path.exists():
        _drop_partial_last_line(path)
    with open(path, "ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    return line


def write_atomic(path: Path, data: str | bytes) -> None:
    """``path`` holds the old content or ``data``, never part of it: ``data`` goes to a temporary file in the same
    folder, is fsynced and renamed over ``path`` (an exception or Ctrl-C in between removes the temporary file)."""
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_marker(run_dir: Path, suite: str, code_tree: str | None, git_sha: str | None) -> None:
    """The marker that makes ``run_dir`` a run of this layout: schema, suite, the code that writes it, when."""
    write_json(run_dir / MARKER, {
        "schema": SCHEMA, "suite": suite, "code_tree": code_tree, "git_sha": git_sha,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})


def read_marker(run_dir: Path) -> dict[str, Any] | None:
    """The marker of ``run_dir``; None without one. A marker that is not one, or of another schema: RunFolderError."""
    path = run_dir / MARKER
    if not path.exists():
        return None
    marker = _json_object(path)
    if not isinstance(marker.get("schema"), int):
        raise RunFolderError(f"{path}: not a codabench run marker (no schema number)")
    if marker["schema"] != SCHEMA:
        raise RunFolderError(f"{path}: a run of schema {marker['schema']}; this codabench reads schema {SCHEMA}")
    return marker


def read_env(run_dir: Path) -> dict[str, Any]:
    """env.json of ``run_dir`` ({} without one); a file that is not a JSON object: RunFolderError."""
    path = run_dir / ENV
    return _json_object(path) if path.exists() else {}


def _json_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError):
        obj = None
    if not isinstance(obj, dict):
        raise RunFolderError(f"{path}: not a JSON object")
    return obj


def check_run(run_dir: Path, need_rows: bool = True) -> list[str]:
    """Whether ``run_dir`` reads as a run: its marker, or without one a legacy run (env.json beside results.csv);
    results.csv (and errors.csv) with codabench's columns, whole rows and numbers where numbers belong; samples.jsonl
    and profiles.jsonl of JSON objects naming their cell; env.json a JSON object. A last line cut off (a killed run's
    append) is tolerated: it is named in the notes returned. Anything else (and, with ``need_rows``, a results.csv
    without rows): RunFolderError, one line."""
    if not run_dir.is_dir():
        raise RunFolderError(f"{run_dir}: no such directory")
    marker = read_marker(run_dir)
    if not (run_dir / RESULTS).is_file():
        raise RunFolderError(f"{run_dir}: not a run directory (no {RESULTS})")
    if marker is None and not (run_dir / ENV).is_file():
        raise RunFolderError(f"{run_dir}: not a codabench run (neither {MARKER} nor {ENV} beside {RESULTS})")
    read_env(run_dir)
    notes = []
    for name, columns in ((RESULTS, RESULT_COLUMNS), (ERRORS, ERROR_COLUMNS)):
        if name == RESULTS or (run_dir / name).exists():
            notes += _check_csv(run_dir / name, columns, _REQUIRED[name], need_rows and name == RESULTS)
    for name, what in ((SAMPLES, "sample"), (PROFILES, "profile")):
        if (run_dir / name).exists():
            notes += _check_records(run_dir / name, what)
    return notes


def _whole_lines(path: Path) -> tuple[str, list[str]]:
    """The file's text up to its last newline, and the note when a cut-off last line was left out."""
    try:
        text = path.read_bytes().decode()
    except UnicodeDecodeError:
        raise RunFolderError(f"{path}: not text") from None
    if not text or text.endswith("\n"):
        return text, []
    return text[: text.rfind("\n") + 1], [f"{path}: its last line is cut off (a killed run?); the lines before it "
                                          "are read"]


def _check_csv(path: Path, columns: list[str], required: list[str], need_rows: bool) -> list[str]:
    text, notes = _whole_lines(path)
    if not text.strip():
        raise RunFolderError(f"{path}: " + ("its header is cut off" if notes else "empty"))
    reader = csv.reader(StringIO(text), strict=True)
    try:
        header = next(reader)
        missing = [c for c in required if c not in header]
        unknown = [c for c in header if c not in columns]
        if missing or unknown:
            raise RunFolderError(f"{path}: not codabench's columns (" + "; ".join(
                f"{what}: {', '.join(cols[:5])}{' ...' if len(cols) > 5 else ''}"
                for what, cols in (("missing", missing), ("unknown", unknown)) if cols) + ")")
        numeric = [i for i, c in enumerate(header) if c not in _WORDS]
        rows = 0
        for row in reader:
            if len(row) != len(header):
                raise RunFolderError(f"{path}, line {reader.line_num}: {len(row)} fields where the header has "
                                     f"{len(header)}")
            for i in numeric:
                if row[i]:
                    try:
                        float(row[i])
                    except ValueError:
                        raise RunFolderError(f"{path}, line {reader.line_num}: {header[i]} is {row[i][:40]!r}, not a "
                                             "number") from None
            rows += 1
    except csv.Error as e:
        raise RunFolderError(f"{path}, line {reader.line_num}: {e}") from None
    if need_rows and not rows:
        raise RunFolderError(f"{path}: no rows" + (" (its only row is cut off)" if notes else ""))
    return notes


def _check_records(path: Path, what: str) -> list[str]:
    text, notes = _whole_lines(path)
    for n, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not all(k in record for k in KEY):
            raise RunFolderError(f"{path}, line {n}: not a {what} record of codabench")
    return notes


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
    """The records of a JSON-lines file of the run (samples.jsonl, profiles.jsonl); a line cut off by a kill is
    left out."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut off by a kill
            continue
    return out


def read_profiles(run_dir: Path) -> dict[tuple[str, ...], dict[str, Any]]:
    """Each profiled cell's profile record (profiles.jsonl), keyed like :data:`KEY`; a cell profiled twice (a resumed
    or merged run): its last record."""
    return {tuple(str(r[k]) for k in KEY): r for r in read_samples(run_dir / PROFILES)}


def trace_name(key: tuple[str, ...]) -> str:
    """The file name of a cell's Chrome trace under ``traces/``: its key (:data:`KEY`) joined by ``-``, each
    character other than a letter, digit, ``.``, ``_`` or ``-`` made ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(map(str, key))) + ".json"


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
    """:func:`json_text`, written atomically."""
    write_atomic(path, json_text(obj))


def json_text(obj: Any) -> str:
    """Strict JSON, indented, except that each element of a list of dicts (a row) takes one line."""
    return _dumps(_json_safe(obj), 0) + "\n"


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
    env = read_env(run_dir)
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


