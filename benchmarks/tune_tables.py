"""Regenerate the shipped autotuning table of this machine's GPU (kernels/coda/tuned/<gpu>.json).

    python benchmarks/tune_tables.py [--suites full,train] [--fresh] [--budget SECONDS] [--gpus N]

Runs each suite's CODA cells (coda-triton, and hf-coda in the train suite) with few samples and ``--tune`` on an empty
autotuning cache, so that every kernel meets every shape and dtype the suites use (the correctness pass's
shapes too), then merges the winners into the table (:func:`kernels.coda.tuning.export`). By default the
existing table is used and only what it lacks is tuned, so an interrupted run continues where it stopped;
``--fresh`` ignores the table and tunes everything. ``--budget`` stops the suites after that many seconds
(what was tuned until then is exported). ``--gpus N`` (default: every GPU of the host) runs each suite as N shards
at once (``--shard i/N``: whole op/model/mode/dtype groups), one GPU each, sharing the cache file (writes merge under
a lock); the GPUs must be of one model. Needs the GPU the table is for.
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

def shard_commands(suite: str, gpus: int, cache_dir: str) -> list[tuple[list[str], dict[str, str]]]:
    """The run_bench commands (with their environments) that run ``suite``'s CODA cells for tuning: one, or one shard
    per GPU, each process seeing only its GPU."""
    cmd = [sys.executable, str(ROOT / "run_bench.py"), *tuning.tuning_run_args(suite)]
    if gpus == 1:
        return [(cmd + ["--out", f"{cache_dir}/run-{suite}"], dict(os.environ))]
    return [(cmd + ["--shard", f"{i + 1}/{gpus}", "--out", f"{cache_dir}/run-{suite}-{i + 1}of{gpus}"],
             {**os.environ, "CUDA_VISIBLE_DEVICES": str(i)}) for i in range(gpus)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suites", default="full,train", help="comma-separated suites whose shapes to tune")
    p.add_argument("--fresh", action="store_true", help="ignore the existing table: tune everything")
    p.add_argument("--budget", type=float, default=None, help="stop the suites after this many seconds")
    p.add_argument("--gpus", type=int, default=None, help="shards run at once, one per GPU (default: every GPU)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.exit(2, "tune_tables.py: no GPU; the table is measured on the GPU it is for\n")
    gpu = torch.cuda.get_device_name()
    gpus = args.gpus or torch.cuda.device_count()
    models = {torch.cuda.get_device_name(i) for i in range(min(gpus, torch.cuda.device_count()))}
    if not 1 <= gpus <= torch.cuda.device_count() or len(models) > 1:
        p.exit(2, f"tune_tables.py: --gpus must be 1 to {torch.cuda.device_count()} GPUs of one model, got {gpus} "
                  f"({', '.join(sorted(models))})\n")
    cache_dir = tempfile.mkdtemp(prefix="codabench-tune-")
    os.environ.update(CODABENCH_CACHE_DIR=cache_dir, CODABENCH_AUTOTUNE_CACHE="1",
                      CODABENCH_TUNING_TABLES="0" if args.fresh else "1")
    start = time.time()
    for suite in args.suites.split(","):
        left = None if args.budget is None else args.budget - (time.time() - start)
        if left is not None and left <= 0:
            print(f"{suite}: skipped, the budget is spent", flush=True)
            continue
        t0 = time.time()
        procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)  # own group: its worker stops with it
                 for cmd, env in shard_commands(suite, gpus, cache_dir)]
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=None if left is None else max(0.0, left - (time.time() - t0))))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGINT)  # the run stops like at Ctrl-C: its worker and report with it
                proc.wait()
                codes.append("stopped at the budget")
        print(f"{suite}: {time.time() - t0:.0f} s (exit {', '.join(map(str, codes))})", flush=True)
    cache = tuning.cache_file(gpu)
    if not cache.is_file():  # every kernel and choice came from the table, or the runs stopped before any tuning
        print(f"nothing was tuned or chosen: {tuning.table_file(gpu)} already served every shape the "
              "runs reached (see their reports above)")
        return
    table, n = tuning.export(cache)
    print(f"{table}: {n} entries, {time.time() - start:.0f} s in all")


if __name__ == "__main__":
    main()
