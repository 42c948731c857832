"""The results history: a local SQLite store of every finished run, its cells, and the queries on it.

The store is ``$CODABENCH_HISTORY`` if set, else ``~/.cache/codabench/history.sqlite`` (:func:`store_path`). Its
layout is :data:`SCHEMA`, kept in SQLite's ``user_version``; a store of another schema, or a file that is not one, is
refused (:class:`HistoryError`), never rewritten. Two tables:

- ``runs``: one row per run. ``id`` = the run folder's resolved path, ``@``, and the run's start (env.json's
  ``timestamp``; a resumed run keeps its first session's, so finishing it again replaces its row); ``gpu`` (env.json's
  GPU name; ``cpu`` for a CPU run), the suite and shard, git sha and code tree, torch/triton/CUDA/Python/codabench
  versions, the command, ``same_within`` (:func:`codabench.stats.timing_settings`) and env.json itself without its
  clock trace and shard copies (``env``, JSON).
- ``cells``: one row per cell of a run (:data:`codabench.results.KEY`; the plugin-load rows are left out): status
  and message, the median and p20/p80 of its time, its speed over torch-compile with the 95% interval
  (``speedup``, ``speedup_lo``, ``speedup_hi``, as the run's report computed them from its samples), ``vs_best`` and
  its ``verdict``, ``sol_ms``, peak memory, ``rel_err`` and ``correct``.

Adding a run (:func:`add_run`) replaces the run of the same id and its cells in one transaction, so importing a
folder twice keeps one run; a merged run (env.json's ``merged_from``) replaces the runs of the folders it merged (its
shards, recorded as each finished), so that no cell is counted twice. :func:`record_run`, called once a run or merge has written its report, never raises: a
store that is locked (after :data:`LOCK_TIMEOUT_S`), corrupt, of another schema or unwritable costs one warning line.

:func:`regressions` judges the newest run on each GPU (by its start, whenever it was added) against the previous run
on that GPU with the same set of cells by the rule of ``compare``'s ``rel_verdict`` (:func:`codabench.report.compare.relative_change`): each run's paired
interval of the cell against its own torch-compile, the two combined by adding their log bounds, ``same`` within the
smaller ``same_within`` of the two. A cell is a regression when that verdict is ``slower``; torch-compile itself (the
reference) and cells without an interval in either run are ``unknown``.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import sqlite3
import sys
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pandas as pd

from codabench import results as tables
from codabench.matrix import PLUGIN_OP, SPEED_BASELINE
from codabench.report.compare import as_delta, relative_change
from codabench.stats import Ratio, timing_settings
from codabench.timing import CPU_WALL

ENV_VAR = "CODABENCH_HISTORY"
DEFAULT_STORE = Path("~/.cache/codabench/history.sqlite")
SCHEMA = 1
"""The layout of the store (SQLite ``user_version``) that this code reads and writes."""
LOCK_TIMEOUT_S = 10.0
"""How long a write waits for another process's lock on the store before giving up."""

RUN_COLUMNS = {"path": "TEXT", "started_at": "TEXT", "device": "TEXT", "gpu": "TEXT", "suite": "TEXT",
               "shard": "TEXT", "git_sha": "TEXT", "code_tree": "TEXT", "torch": "TEXT", "triton": "TEXT",
               "cuda": "TEXT", "python": "TEXT", "codabench": "TEXT", "command": "TEXT", "same_within": "REAL",
               "env": "TEXT"}
CELL_COLUMNS = {"status": "TEXT", "message": "TEXT", "timing": "TEXT", "median_ms": "REAL", "p20_ms": "REAL",
                "p80_ms": "REAL", "n_samples": "INTEGER", "speedup": "REAL", "speedup_lo": "REAL",
                "speedup_hi": "REAL", "vs_best": "REAL", "vs_best_lo": "REAL", "vs_best_hi": "REAL",
                "verdict": "TEXT", "sol_ms": "REAL", "peak_mem_mib": "REAL", "rel_err": "REAL", "correct": "INTEGER"}
_DDL = [
    "CREATE TABLE runs (id TEXT PRIMARY KEY, " + ", ".join(f"{c} {t}" for c, t in RUN_COLUMNS.items()) + ")",
    "CREATE TABLE cells (run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE, "
    + ", ".join(f"{k} TEXT NOT NULL" for k in tables.KEY) + ", "
    + ", ".join(f"{c} {t}" for c, t in CELL_COLUMNS.items())
    + ", PRIMARY KEY (run_id, " + ", ".join(tables.KEY) + "))",
    "CREATE INDEX runs_by_gpu ON runs (gpu, started_at)",
]
_ENV_LEFT_OUT = ("clock_trace", "shards")
"""env.json's bulky parts, not kept in ``runs.env`` (the run folder has them)."""


class HistoryError(Exception):
    """The store cannot be opened, read or written (locked, corrupt, of another schema, not a file); one line."""


def store_path() -> Path:
    """``$CODABENCH_HISTORY``, else ``~/.cache/codabench/history.sqlite``."""
    return Path(os.environ.get(ENV_VAR) or DEFAULT_STORE).expanduser()


def _connect(path: Path, create: bool) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions begun explicitly) to a store of :data:`SCHEMA`; with ``create``
    the folder and an empty store are made where there is none."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    elif not path.is_file():
        raise HistoryError(f"{path}: no history store (a run adds to it; 'history add RUN_DIR' imports runs)")
    conn = sqlite3.connect(path, timeout=LOCK_TIMEOUT_S, isolation_level=None)
    try:
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA foreign_keys = ON")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 0 and create:
            conn.execute("BEGIN IMMEDIATE")  # two first writers: the second sees the first's tables
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                    raise HistoryError(f"{path}: an SQLite file that is not a codabench history store")
                for ddl in _DDL:
                    conn.execute(ddl)
                conn.execute(f"PRAGMA user_version = {SCHEMA}")
                version = SCHEMA
            conn.execute("COMMIT")
        if version != SCHEMA:
            raise HistoryError(f"{path}: a history store of schema {version}; this codabench reads schema {SCHEMA}"
                               if version else f"{path}: not a codabench history store")
    except BaseException:
        conn.close()
        raise
    return conn


def open_store(path: Path | None = None, create: bool = False) -> sqlite3.Connection:
    """The store at ``path`` (default :func:`store_path`); without ``create`` it must exist. Anything that keeps it
    from being used (locked, corrupt, another schema, unwritable): :class:`HistoryError`."""
    path = store_path() if path is None else path
    try:
        return _connect(path, create)
    except sqlite3.Error as e:
        raise HistoryError(f"{path}: {e}") from None
    except OSError as e:
        raise HistoryError(f"{path}: {e.strerror or e}") from None


def run_record(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``runs`` row and ``cells`` rows of a run folder (it must read as a run: :func:`codabench.results.
    check_run`)."""
    tables.check_run(run_dir)
    df, _, env = tables.load_run(run_dir)
    marker = tables.read_marker(run_dir) or {}
    started = min([t for t in [env.get("timestamp")] + [s.get("timestamp") for s in env.get("earlier_sessions", [])]
                   if isinstance(t, str)] or [marker.get("created_at") or _mtime(run_dir / tables.RESULTS)])
    path = str(run_dir.resolve())
    gpu = (env.get("gpu") or {}).get("name") or ("cpu" if env.get("device") == "cpu" else "unknown")
    shard = env.get("shard")
    run = {"id": f"{path}@{started}", "path": path, "started_at": started, "device": env.get("device"), "gpu": gpu,
           "suite": env.get("suite") or marker.get("suite"), "shard": "/".join(map(str, shard)) if shard else None,
           "git_sha": env.get("git_sha") or marker.get("git_sha"),
           "code_tree": env.get("code_tree") or marker.get("code_tree"),
           **{k: env.get(k) for k in ("torch", "triton", "cuda", "python", "codabench", "command")},
           "same_within": timing_settings(env)[1],
           "env": json.dumps({k: v for k, v in env.items() if k not in _ENV_LEFT_OUT}, default=str)}
    cells = []
    for r in tables.records(df[df["op"] != PLUGIN_OP]):
        cell = {k: r[k] for k in tables.KEY}
        for c, kind in CELL_COLUMNS.items():
            v = r.get(c)
            if c == "correct":
                v = None if v is None else int(v)
            elif kind == "REAL":
                v = _number(v)
            elif kind == "INTEGER":
                v = None if _number(v) is None else int(v)
            cell[c] = v
        cells.append(cell)
    return run, cells


def _number(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _mtime(path: Path) -> str:
    stamp = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
    return stamp.isoformat(timespec="seconds")


def add_run(run_dir: Path, path: Path | None = None) -> tuple[dict[str, Any], int, bool]:
    """Append the run in ``run_dir`` to the store (created if need be), replacing a run of the same id and its cells,
    and those of the folders it merged, in one transaction: ``(its runs row, its number of cells, whether it replaced
    one)``. A folder that is not a run:
    :class:`codabench.results.RunFolderError`; a store that cannot take it: :class:`HistoryError`."""
    run, cells = run_record(run_dir)
    conn = open_store(path, create=True)
    try:
        with closing(conn):
            conn.execute("BEGIN IMMEDIATE")
            try:
                replaced = conn.execute("DELETE FROM runs WHERE id = ?", (run["id"],)).rowcount > 0
                for shard in json.loads(run["env"]).get("merged_from") or []:
                    conn.execute("DELETE FROM runs WHERE path = ?", (str(Path(shard).resolve()),))
                conn.execute(f"INSERT INTO runs ({', '.join(run)}) VALUES ({', '.join('?' * len(run))})",
                             tuple(run.values()))
                if cells:
                    cols = ["run_id", *cells[0]]
                    conn.executemany(f"INSERT INTO cells ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                                     [(run["id"], *c.values()) for c in cells])
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
    except sqlite3.Error as e:
        raise HistoryError(f"{path or store_path()}: {e}") from None
    return run, len(cells), replaced


class Kept:
    """A copy of the store as a run found it (:func:`keep`), to put back what changed in its earlier runs while the
    run went on: the run's plugins execute in its worker, which could open the store and rewrite the runs it holds
    (slowing a peer's past times, say). When the run is recorded (:func:`record_run`), each run of the copy is compared
    with the store by a digest of its rows; one that changed, or is gone, is put back from the copy, and a warning line
    says so. (The digests are taken then, not at the start, which stays a copy.)"""

    def __init__(self, copy: sqlite3.Connection | None):
        self.copy = copy


def keep() -> Kept:
    """The store as it is now, in memory (an empty :class:`Kept` where there is none or it cannot be read)."""
    try:
        with closing(open_store()) as conn:
            copy = sqlite3.connect(":memory:")
            conn.backup(copy)
    except (HistoryError, sqlite3.Error):
        return Kept(None)
    copy.row_factory = sqlite3.Row
    return Kept(copy)


def _digest(conn: sqlite3.Connection, run_id: str) -> str | None:
    """A digest of a run's ``runs`` row and its cells, in order (None where it is not in the store)."""
    run = conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    if run is None:
        return None
    h = hashlib.sha256(repr(tuple(run)).encode())
    for cell in conn.execute("SELECT * FROM cells WHERE run_id = ? ORDER BY rowid", (run_id,)):
        h.update(repr(tuple(cell)).encode())
    return h.hexdigest()


def put_back(kept: Kept, path: Path | None = None) -> list[str]:
    """The runs of ``kept`` whose rows changed or are gone in the store, written back as they were (in one
    transaction; the runs added meanwhile are left alone)."""
    if kept.copy is None:
        return []
    conn = open_store(path)
    with closing(conn):
        changed = [run["id"] for run in kept.copy.execute("SELECT id FROM runs")
                   if _digest(conn, run["id"]) != _digest(kept.copy, run["id"])]
        if changed:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for rid in changed:
                    conn.execute("DELETE FROM runs WHERE id = ?", (rid,))
                    for table, key in (("runs", "id"), ("cells", "run_id")):
                        rows = kept.copy.execute(f"SELECT * FROM {table} WHERE {key} = ? ORDER BY rowid", (rid,))
                        for row in rows:
                            conn.execute(f"INSERT INTO {table} ({', '.join(row.keys())}) VALUES "
                                         f"({', '.join('?' * len(row))})", tuple(row))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
    return changed


def record_run(run_dir: Path, kept: Kept | None = None) -> bool:
    """:func:`add_run` for a run that just wrote its report: True when it was added; any failure is one warning line
    on stderr (the run and its exit code are untouched). ``kept``: the store as the run found it (:func:`keep`): the
    earlier runs changed meanwhile are put back first, with a warning line."""
    try:
        if kept is not None:
            changed = put_back(kept)
            if changed:
                print(f"codabench: warning: {len(changed)} earlier run(s) of the results history {store_path()} "
                      f"changed while this run went on (by a plugin of this run, or another codabench process): put "
                      f"back as they were ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})",
                      file=sys.stderr)
        add_run(run_dir)
    except Exception as e:  # the history is a by-product: nothing in it may cost a run
        print(f"codabench: warning: {run_dir} not added to the results history ({type(e).__name__}: {e}); "
              f"'python -m codabench history add {run_dir}' adds it later", file=sys.stderr)
        return False
    return True


def runs(conn: sqlite3.Connection, gpu: str | None = None) -> list[dict[str, Any]]:
    """The runs, newest first (by start), each with its cell counts ``cells``, ``ok`` and ``errors``; only those of
    ``gpu`` when given."""
    rows = conn.execute(
        "SELECT runs.*, count(cells.op) AS cells, coalesce(sum(cells.status = 'ok'), 0) AS ok, "
        "coalesce(sum(cells.status = 'error'), 0) AS errors FROM runs LEFT JOIN cells ON cells.run_id = runs.id "
        + ("WHERE runs.gpu = ? " if gpu is not None else "")
        + "GROUP BY runs.id ORDER BY runs.started_at DESC, runs.id DESC", (gpu,) if gpu is not None else ())
    return [dict(r) for r in rows]


def gpus(conn: sqlite3.Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT DISTINCT gpu FROM runs ORDER BY gpu")]


def cells(conn: sqlite3.Connection, run_id: str) -> pd.DataFrame:
    """The cells of one run, one row each."""
    return pd.read_sql_query("SELECT * FROM cells WHERE run_id = ?", conn, params=(run_id,))


def trend(conn: sqlite3.Connection, op: str, impl: str, model: str | None = None, mode: str | None = None,
          dtype: str | None = None) -> pd.DataFrame:
    """The matching cells of every run with their run's GPU, start and commit, ordered by GPU, cell, start."""
    where = {"op": op, "impl": impl, "model": model, "mode": mode, "dtype": dtype}
    given = {k: v for k, v in where.items() if v is not None}
    return pd.read_sql_query(
        "SELECT runs.gpu, runs.started_at, runs.git_sha, runs.suite, cells.* FROM cells "
        "JOIN runs ON runs.id = cells.run_id WHERE " + " AND ".join(f"cells.{k} = ?" for k in given)
        + " ORDER BY runs.gpu, cells.model, cells.mode, cells.dtype, runs.started_at, runs.id", conn,
        params=tuple(given.values()))


@dataclass
class Comparison:
    """The newest run on one GPU (``after``) against the previous run there with the same cells (``before``; None:
    there is none, and ``cells`` holds the newest run's cells alone). ``cells``: one row per cell, both runs'
    figures (suffixes ``_a`` before, ``_b`` after) and the relative change ``rel_delta_pct`` with
    ``rel_lo_pct``/``rel_hi_pct`` and ``rel_verdict`` (module docstring)."""

    gpu: str
    after: dict[str, Any]
    before: dict[str, Any] | None
    cells: pd.DataFrame

    @property
    def regressed(self) -> pd.DataFrame:
        """The cells whose verdict is ``slower``."""
        if self.before is None:
            return self.cells.iloc[0:0]
        return self.cells[self.cells["rel_verdict"] == "slower"]

    @property
    def newly_failing(self) -> pd.DataFrame:
        """Cells ok (and not judged wrong) before that are not now; not regressions: the run's own exit code reports
        them."""
        c = self.cells
        if self.before is None:
            return c.iloc[0:0]

        def good(s: str) -> pd.Series:
            return (c["status" + s] == "ok") & (c["correct" + s] != 0)

        return c[good("_a") & ~good("_b")]


def regressions(conn: sqlite3.Connection, gpu: str | None = None) -> list[Comparison]:
    """For each GPU (or ``gpu``): its newest run against the previous run there with the same set of cells."""
    out = []
    for name in ([gpu] if gpu is not None else gpus(conn)):
        history = runs(conn, name)
        if not history:
            continue
        newest, older = history[0], history[1:]
        mine = cells(conn, newest["id"])
        keys = _keys(mine)
        before = next((r for r in older if _keys(cells(conn, r["id"])) == keys), None)
        if before is None:
            out.append(Comparison(name, newest, None, mine))
            continue
        out.append(Comparison(name, newest, before, _changes(cells(conn, before["id"]), mine,
                                                             min(before["same_within"], newest["same_within"]))))
    return out


def _keys(df: pd.DataFrame) -> frozenset[tuple[str, ...]]:
    return frozenset(df[tables.KEY].itertuples(index=False, name=None))


def _changes(a: pd.DataFrame, b: pd.DataFrame, same_within: float) -> pd.DataFrame:
    m = a.drop(columns="run_id").merge(b.drop(columns="run_id"), on=tables.KEY, suffixes=("_a", "_b"))
    cols: dict[str, list] = {c: [] for c in ("rel_delta_pct", "rel_lo_pct", "rel_hi_pct", "rel_verdict")}
    for _, r in m.iterrows():
        x = None
        if r["impl"] != SPEED_BASELINE and r["status_a"] == r["status_b"] == "ok":
            pair = [_speedup(r, s) for s in ("_a", "_b")]
            x = relative_change(*pair) if None not in pair else None
        lo, hi, verdict = as_delta(x, same_within)
        cols["rel_delta_pct"].append(math.nan if x is None else 100 * (1 / x.value - 1))
        cols["rel_lo_pct"].append(lo)
        cols["rel_hi_pct"].append(hi)
        cols["rel_verdict"].append(verdict)
    return m.assign(**cols)


def _speedup(r: pd.Series, side: str) -> Ratio | None:
    """A run's stored paired ratio of the cell against its torch-compile; None without an interval."""
    v = [r["speedup" + s + side] for s in ("", "_lo", "_hi")]
    if any(x is None or pd.isna(x) or x <= 0 for x in v):
        return None
    return Ratio(*map(float, v))


def find_run(conn: sqlite3.Connection, ref: str | None) -> dict[str, Any] | None:
    """A run by its id or its folder (the newest run of that folder); the newest run for None."""
    history = runs(conn)
    if ref is None:
        return history[0] if history else None
    path = str(Path(ref).resolve())
    return next((r for r in history if r["id"] == ref or r["path"] == path), None)


def iter_pytorch_oss(conn: sqlite3.Connection, run: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The run's cells as records of the PyTorch OSS benchmark database (its v3 schema: pytorch/test-infra,
    ``clickhouse_db_schema/oss_ci_benchmark_v3/schema.sql``; the record layout of the pytorch/pytorch wiki page
    "How to integrate with PyTorch OSS benchmark database", which ``.github/scripts/upload_benchmark_results.py`` of
    pytorch/test-infra uploads). One record per metric of a cell: ``pass`` (1 when the cell ran and its outputs
    passed the error rule, else 0: every cell), and for a timed cell ``latency_ms`` (the median; target: the
    speed-of-light ``sol_ms``, the cell's plain GEMMs, where measured), ``speedup_vs_torch_compile`` (target 1) and
    ``peak_memory_mib`` where measured. A target of 0 is the schema's "none". ``benchmark.mode`` is ``inference``
    for fwd cells, ``training`` for bwd and fwd_bwd (the cell's own mode is in ``extra_info``); ``model`` is the op on
    the model's shapes, its ``backend`` the implementation. The fields that CI fills in (timestamp,
    repo, head_sha, workflow and job ids) are left to the uploader; each record's ``benchmark.extra_info`` names the
    run and its commit. Map values are strings, as the schema's ``Map(String, String)`` wants."""
    env = json.loads(run["env"] or "{}")
    gpu = env.get("gpu") or {}
    runner = {"name": "", "type": run["gpu"], "cpu_info": env.get("cpu") or "",
              "gpu_info": run["gpu"] if run["device"] == "cuda" else "", "gpu_count": 1 if run["device"] == "cuda"
              else 0, "avail_gpu_mem_in_gb": int(gpu.get("memory_gib") or 0),
              "extra_info": _strings({k: gpu.get(k) for k in ("capability", "sm_count", "driver", "power_limit_w")}
                                     | {"cuda": run["cuda"]})}
    dependencies = {name: {"repo": repo, "branch": "", "sha": "", "version": run[key] or "", "extra_info": {}}
                    for name, repo, key in (("pytorch", "pytorch/pytorch", "torch"),
                                            ("triton", "triton-lang/triton", "triton"))}
    for _, c in cells(conn, run["id"]).iterrows():
        benchmark = {"name": "codabench", "mode": "inference" if c["mode"] == "fwd" else "training",
                     "dtype": c["dtype"], "extra_info": _strings({
                         "op": c["op"], "mode": c["mode"], "suite": run["suite"], "run": run["id"],
                         "git_sha": run["git_sha"], "code_tree": run["code_tree"], "timing": c["timing"],
                         "same_within": run["same_within"]})}
        model = {"name": f"{c['op']}/{c['model']}", "type": "gemm-epilogue-op", "backend": c["impl"],
                 "origins": ["codabench"], "extra_info": _strings({"op": c["op"], "model": c["model"]})}
        passed = c["status"] == "ok" and c["correct"] != 0
        metrics = [("pass", 1.0 if passed else 0.0, 1.0,
                    {"status": c["status"], "message": c["message"], "rel_err": c["rel_err"]})]
        if c["status"] == "ok" and _number(c["median_ms"]) is not None and c["timing"] != CPU_WALL:
            metrics.append(("latency_ms", c["median_ms"], _number(c["sol_ms"]) or 0.0,
                            {"p20_ms": c["p20_ms"], "p80_ms": c["p80_ms"], "n_samples": c["n_samples"],
                             "aggregation": "median"}))
            if _number(c["speedup"]) is not None:
                metrics.append(("speedup_vs_torch_compile", c["speedup"], 1.0,
                                {"lo": c["speedup_lo"], "hi": c["speedup_hi"], "level": "0.95"}))
            if _number(c["peak_mem_mib"]) is not None:
                metrics.append(("peak_memory_mib", c["peak_mem_mib"], 0.0, {}))
        for name, value, target, extra in metrics:
            yield {"benchmark": benchmark, "model": model,
                   "metric": {"name": name, "benchmark_values": [float(value)], "target_value": float(target),
                              "extra_info": _strings(extra)},
                   "runners": [runner], "dependencies": dependencies}


def _strings(d: dict[str, Any]) -> dict[str, str]:
    """A Map(String, String): values as text, missing values left out."""
    out = {}
    for k, v in d.items():
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        out[k] = str(v)
    return out
