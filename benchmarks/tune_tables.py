"""Regenerate the shipped autotuning table of this machine's GPU (kernels/coda/tuned/<gpu>.json).

    python benchmarks/tune_tables.py [--suites full,train] [--fresh] [--budget SECONDS]

Runs each suite's CODA cells (coda-triton, and hf-coda in the train suite) with few samples on an empty
autotuning cache, so that every kernel meets every shape and dtype the suites use (the correctness pass's
shapes too), then merges the winners into the table (:func:`kernels.coda.tuning.export`). By default the
existing table is used and only what it lacks is tuned, so an interrupted run continues where it stopped;
``--fresh`` ignores the table and tunes everything. ``--budget`` stops the suites after that many seconds
(what was tuned until then is exported). Needs the GPU the table is for.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.coda import tuning  # noqa: E402

IMPLS = {"train": "hf-coda"}
"""The CODA implementations of a suite whose ops coda-triton does not implement."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suites", default="full,train", help="comma-separated suites whose shapes to tune")
    p.add_argument("--fresh", action="store_true", help="ignore the existing table: tune everything")
    p.add_argument("--budget", type=float, default=None, help="stop the suites after this many seconds")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.exit(2, "tune_tables.py: no GPU; the table is measured on the GPU it is for\n")
    gpu = torch.cuda.get_device_name()
    cache_dir = tempfile.mkdtemp(prefix="codabench-tune-")
    os.environ.update(CODABENCH_CACHE_DIR=cache_dir, CODABENCH_AUTOTUNE_CACHE="1",
                      CODABENCH_TUNING_TABLES="0" if args.fresh else "1")
    start = time.time()
    for suite in args.suites.split(","):
        left = None if args.budget is None else args.budget - (time.time() - start)
        if left is not None and left <= 0:
            print(f"{suite}: skipped, the budget is spent", flush=True)
            continue
        cmd = [sys.executable, str(ROOT / "run_bench.py"), "--suite", suite, "--impls", IMPLS.get(suite, "coda-triton"),
               "--reps", "2", "--rounds", "1", "--warmup", "1", "--quiet", "--out", f"{cache_dir}/run-{suite}"]
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)  # its own group: the worker stops with it
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)  # the run stops like at Ctrl-C: its worker and report with it
            proc.wait()
            rc = "stopped at the budget"
        print(f"{suite}: {time.time() - t0:.0f} s (exit {rc})", flush=True)
    cache = tuning.cache_file(gpu)
    if not cache.is_file():  # every kernel and choice came from the table, or the runs stopped before any tuning
        print(f"nothing was tuned or chosen: {tuning.table_file(gpu)} already served every shape the "
              "runs reached (see their reports above)")
        return
    table, n = tuning.export(cache)
    print(f"{table}: {n} entries, {time.time() - start:.0f} s in all")


if __name__ == "__main__":
    main()
