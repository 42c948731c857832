"""``python -m codabench history ...``: the runs of the results history (:mod:`codabench.history`), a cell's trend,
regressions against the previous run on the same GPU, and the export to the PyTorch OSS benchmark database.

- ``history [--gpu NAME]``: the runs, newest first: start, GPU, suite, commit, cells ok and error.
- ``history --regressions [--gpu NAME]``: the newest run on each GPU against the previous run there with the same
  cells (:func:`codabench.history.regressions`: ``compare``'s ``rel_verdict`` rule); exit code 1 when a cell is
  ``slower``, 0 when none is.
- ``history add RUN_DIR...``: import run folders (a run already there is replaced, not doubled).
- ``history trend --op OP --impl IMPL [--model M --mode MODE --dtype D] [--plot FILE]``: the cell's median with
  p20/p80 and its speed over torch-compile with the 95% interval, per run, on each GPU; ``--plot`` writes a PNG.
- ``history export --format pytorch-oss [RUN] [--out FILE]``: a run's cells (RUN: a run id or folder, default the
  newest run) as a JSON list of records of the PyTorch OSS benchmark database
  (:func:`codabench.history.iter_pytorch_oss`).

Bad flags, names or paths and a store that cannot be read: one line on stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pandas as pd

from codabench import history
from codabench.cli import EXIT_OK, OneLineParser, UsageError, run_dir_arg
from codabench.matrix import SPEED_BASELINE
from codabench.report.compare import COMPARE_VERDICTS
from codabench.results import write_atomic
from codabench.timing import CPU_WALL
from workloads.op import DTYPES, MODES

ACTIONS = ("add", "trend", "export")
EXIT_REGRESSED = 1
"""``--regressions`` found a cell slower than in the previous run on its GPU."""
EXPORT_FORMATS = ("pytorch-oss",)
RULE = (f"a cell regressed when its speed relative to its own run's {SPEED_BASELINE} fell beyond noise: compare's "
        f"rel_verdict rule (each run's paired 95%% interval of the cell against {SPEED_BASELINE}, the two combined "
        "by adding their log bounds) reads 'slower'; a clock that ran lower through a whole run cancels, "
        f"{SPEED_BASELINE} itself is not judged")


def main(argv: list[str]) -> int:
    """The ``history`` command; its exit code."""
    action = argv[0] if argv and argv[0] in ACTIONS else None
    p = OneLineParser(prog="codabench history" + (f" {action}" if action else ""),
                      description=("" if action else "Lists the runs, newest first. ")
                      + f"The results history is {history.store_path()} (${history.ENV_VAR} moves it)."
                      + ("" if action else " Other commands: " + ", ".join(f"'history {a} --help'" for a in ACTIONS)))
    if action == "add":
        p.add_argument("run_dirs", type=run_dir_arg, nargs="+", metavar="RUN_DIR")
        return _add(p.parse_args(argv[1:]))
    if action == "trend":
        p.add_argument("--op", required=True)
        p.add_argument("--impl", required=True)
        p.add_argument("--model")
        p.add_argument("--mode", choices=MODES)
        p.add_argument("--dtype", choices=list(DTYPES))
        p.add_argument("--plot", type=Path, metavar="FILE", help="also write the trend as a PNG plot")
        return _trend(p.parse_args(argv[1:]))
    if action == "export":
        p.add_argument("--format", choices=EXPORT_FORMATS, required=True,
                       help="pytorch-oss: the PyTorch OSS benchmark database's records (v3 schema)")
        p.add_argument("run", nargs="?", metavar="RUN", help="a run id or run folder (default: the newest run)")
        p.add_argument("--out", type=Path, metavar="FILE", help="write the JSON here (default: standard output)")
        return _export(p.parse_args(argv[1:]))
    p.add_argument("--gpu", metavar="NAME", help="only the runs on this GPU (as the list names it)")
    p.add_argument("--regressions", action="store_true",
                   help="the newest run on each GPU against the previous run on that GPU with the same cells; " + RULE
                   + "; exit code 1 when any cell regressed, 0 when none did")
    a = p.parse_args(argv)
    return _regressions(a.gpu) if a.regressions else _list(a.gpu)


def _store() -> sqlite3.Connection:
    try:
        return history.open_store()
    except history.HistoryError as e:
        raise UsageError(f"history: {e}") from None


def _add(a: argparse.Namespace) -> int:
    for run_dir in a.run_dirs:
        try:
            run, n, replaced = history.add_run(run_dir)
        except history.HistoryError as e:
            raise UsageError(f"history add: {e}") from None
        print(f"codabench: history: {run_dir}: {n} cells, {run['gpu']}, {run['started_at']}"
              + (" (was there: replaced)" if replaced else ""))
    return EXIT_OK


def _check_gpu(conn: sqlite3.Connection, gpu: str | None) -> None:
    if gpu is not None and gpu not in history.gpus(conn):
        raise UsageError(f"history: no runs on GPU {gpu!r}; GPUs: {', '.join(map(repr, history.gpus(conn))) or 'none'}")


def _empty(gpu: str | None) -> bool:
    """No store yet: said in one line (``--gpu`` names no GPU of it: a usage error)."""
    if history.store_path().is_file():
        return False
    if gpu is not None:
        raise UsageError(f"history: no runs on GPU {gpu!r}: {history.store_path()} holds no history yet")
    print(f"codabench: history: no runs yet ({history.store_path()} does not exist; every finished run adds to it, "
          "'history add RUN_DIR' imports runs)")
    return True


def _list(gpu: str | None) -> int:
    if _empty(gpu):
        return EXIT_OK
    with closing(_store()) as conn:
        _check_gpu(conn, gpu)
        rows = history.runs(conn, gpu)
    print(f"{'date (UTC)':16} {'GPU':22} {'suite':12} {'commit':18} {'cells':>5} {'ok':>5} {'error':>5}  run folder")
    for r in rows:
        suite = (r["suite"] or "?") + (f" {r['shard']}" if r["shard"] else "")
        print(f"{_date(r['started_at']):16} {r['gpu']:22} {suite:12} {_commit(r['git_sha']):18} {r['cells']:5} "
              f"{r['ok']:5} {r['errors']:5}  {r['path']}")
    print(f"{len(rows)} runs in {history.store_path()}")
    return EXIT_OK


def _date(stamp: str | None) -> str:
    try:
        return datetime.datetime.fromisoformat(stamp).astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    except (TypeError, ValueError):
        return str(stamp)


def _commit(sha: str | None) -> str:
    if not sha:
        return "?"
    return sha[:10] + ("-dirty" if sha.endswith("-dirty") else "")


def _f(v, spec: str) -> str:
    return "" if v is None or pd.isna(v) else format(v, spec)


def _trend(a: argparse.Namespace) -> int:
    with closing(_store()) as conn:
        t = history.trend(conn, a.op, a.impl, a.model, a.mode, a.dtype)
    if t.empty:
        raise UsageError("history trend: no cell of " + ", ".join(
            f"{k} {v}" for k, v in vars(a).items() if k in ("op", "impl", "model", "mode", "dtype") and v is not None)
            + " in the history")
    for (gpu, model, mode, dtype), rows in t.groupby(["gpu", "model", "mode", "dtype"], sort=False):
        print(f"{gpu}: {a.op} {model} {mode} {dtype} {a.impl}")
        print(f"  {'date (UTC)':16} {'commit':18} {'status':7} {'median ms':>10} {'p20-p80 ms':>21} "
              f"{'vs ' + SPEED_BASELINE:>16} {'95% interval':>17}")
        for _, r in rows.iterrows():
            spread = f"[{_f(r['p20_ms'], '.4g')}, {_f(r['p80_ms'], '.4g')}]" if not pd.isna(r["p20_ms"]) else ""
            cpu = r["timing"] == CPU_WALL  # a CPU wall time: no speed figure
            interval = (f"[{_f(r['speedup_lo'], '.3f')}, {_f(r['speedup_hi'], '.3f')}]"
                        if not (cpu or pd.isna(r["speedup_lo"])) else "")
            speed = "(cpu wall)" if cpu else _f(r["speedup"], ".3f")
            print(f"  {_date(r['started_at']):16} {_commit(r['git_sha']):18} {r['status']:7} "
                  f"{_f(r['median_ms'], '.4g'):>10} {spread:>21} {speed:>16} {interval:>17}")
    if a.plot:
        write_atomic(a.plot, trend_png(t, f"{a.op} {a.impl}"))
        print(f"codabench: plot {a.plot}")
    return EXIT_OK


def trend_png(t: pd.DataFrame, title: str) -> bytes:
    """A PNG of :func:`codabench.history.trend`'s rows: the median with its p20-p80 spread, and the speed over
    torch-compile with its 95% interval, against the run's start; one series per GPU and cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for (gpu, model, mode, dtype), rows in t.groupby(["gpu", "model", "mode", "dtype"], sort=False):
        x = pd.to_datetime(rows["started_at"], utc=True, format="ISO8601")
        label = f"{gpu} {model} {mode} {dtype}"
        med = rows["median_ms"]
        top.errorbar(x, med, yerr=[med - rows["p20_ms"], rows["p80_ms"] - med], marker="o", capsize=3, label=label)
        s = rows["speedup"].where(rows["timing"] != CPU_WALL)  # CPU wall times: no speed figure
        bottom.errorbar(x, s, yerr=[s - rows["speedup_lo"].fillna(s), rows["speedup_hi"].fillna(s) - s], marker="o",
                        capsize=3, label=label)
    top.set_ylabel("median ms (bars: p20-p80)")
    top.set_title(title)
    top.legend(fontsize="small")
    bottom.axhline(1.0, color="grey", linewidth=0.8)
    bottom.set_ylabel(f"speed over {SPEED_BASELINE}\n(bars: 95% interval)")
    bottom.set_xlabel("run start (UTC)")
    fig.autofmt_xdate()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _regressions(gpu: str | None) -> int:
    if _empty(gpu):
        return EXIT_OK
    with closing(_store()) as conn:
        _check_gpu(conn, gpu)
        comparisons = history.regressions(conn, gpu)
    if not comparisons:
        print(f"codabench: history: no runs in {history.store_path()}; nothing compared")
    regressed = 0
    for c in comparisons:
        after = f"{_date(c.after['started_at'])} {_commit(c.after['git_sha'])} ({c.after['path']})"
        if c.before is None:
            print(f"{c.gpu}: newest run {after}: no earlier run on this GPU with the same {len(c.cells)} "
                  "cells; nothing compared")
            continue
        before = f"{_date(c.before['started_at'])} {_commit(c.before['git_sha'])} ({c.before['path']})"
        counts = c.cells["rel_verdict"].value_counts()
        print(f"{c.gpu}: {after} against {before}: {len(c.cells)} cells; relative to each run's {SPEED_BASELINE}: "
              + ", ".join(f"{counts.get(v, 0)} {v}" for v in COMPARE_VERDICTS))
        for title, rows in (("slower", c.regressed), ("no longer ok", c.newly_failing)):
            for _, r in rows.iterrows():
                change = (f"{r['rel_delta_pct']:+.1f}% [{r['rel_lo_pct']:+.1f}, {r['rel_hi_pct']:+.1f}]"
                          if title == "slower" else f"{r['status_a']} -> {r['status_b']}: {r['message_b'] or ''}")
                print(f"  {title:12} {r['op']:16} {r['model']:10} {r['mode']:8} {r['dtype']:7} {r['impl']:16} "
                      f"{_f(r['median_ms_a'], '.4g')} -> {_f(r['median_ms_b'], '.4g')} ms  {change}")
        regressed += len(c.regressed)
    if regressed:
        print(f"codabench: {regressed} cells regressed (exit code {EXIT_REGRESSED})")
        return EXIT_REGRESSED
    return EXIT_OK


def _export(a: argparse.Namespace) -> int:
    with closing(_store()) as conn:
        run = history.find_run(conn, a.run)
        if run is None:
            raise UsageError(f"history export: no run {a.run!r} in the history ('history' lists them)"
                             if a.run else "history export: the history holds no runs")
        records = list(history.iter_pytorch_oss(conn, run))
    text = "[\n" + ",\n".join(json.dumps(r, allow_nan=False) for r in records) + "\n]\n"
    if a.out:
        write_atomic(a.out, text)
        print(f"codabench: history: {len(records)} records of {run['id']} -> {a.out}")
    else:
        print(text, end="")
    return EXIT_OK
