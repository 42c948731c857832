"""Merge the run directories of the shards of one run (``--shard I/N``) into one report.

The merged directory is built under a temporary name beside its destination and renamed into place once its report
is written, so a merge that fails leaves nothing behind and can simply be run again. Each shard must read as a run
(:func:`codabench.results.check_run`); the merged directory is a run of this layout (its marker names the shards'
suite and code).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from codabench import results as tables
from codabench.report import finalize
from codabench.results import load_run, records


def merge(out_dir: str | Path, shard_dirs: list[str | Path]) -> Path:
    """Concatenate the shards' rows, samples and profiles, and copy their Chrome traces (a cell present twice: the
    later directory wins), keep every
    shard's env.json under ``shards`` (and their ``code_tree`` when they share one), and build the report in
    ``out_dir`` (which must not exist, or be empty)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty; merge into a new directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.merging-", dir=out_dir.parent))
    try:
        built = _merge_into(staging / out_dir.name, shard_dirs)
        if out_dir.exists():
            out_dir.rmdir()
        built.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _merge_into(out_dir: Path, shard_dirs: list[str | Path]) -> Path:
    out_dir.mkdir()
    results = tables.AppendWriter(out_dir / tables.RESULTS, tables.RESULT_COLUMNS)
    errors = tables.AppendWriter(out_dir / tables.ERRORS, tables.ERROR_COLUMNS)
    envs, seen, twice = [], set(), []
    for d in map(Path, shard_dirs):
        tables.check_run(d, need_rows=False)
        df, err, env = load_run(d)
        keys = [tuple(r) for r in df[tables.KEY].astype(str).values]
        twice += [k for k in keys if k in seen]
        seen.update(keys)
        results.write(records(df))
        errors.write(records(err))
        for name in (tables.SAMPLES, tables.PROFILES):
            for s in tables.read_samples(d / name):
                tables.append_jsonl(out_dir / name, s)
        for trace in sorted((d / tables.TRACES).glob("*.json")):
            (out_dir / tables.TRACES).mkdir(exist_ok=True)
            shutil.copyfile(trace, out_dir / tables.TRACES / trace.name)
        envs.append({"dir": str(d), **env})
    if twice:  # shards of one run hold each cell once: these folders are not (a run merged twice, a rerun)
        print(f"codabench merge: {len(twice)} cells are in more than one folder ({' '.join(twice[0])}, ...); the "
              "later folder's rows are kept", file=sys.stderr)
    first = envs[0] if envs else {}
    merged = {k: first.get(k) for k in ("suite", "device", "torch", "triton", "cuda", "git_sha", "timestamp")}
    merged.update(run=out_dir.name, merged_from=[e["dir"] for e in envs], shards=envs)
    trees = {e.get("code_tree") for e in envs}
    if len(trees) == 1 and None not in trees:  # the shards ran one code: the merged run names it
        merged["code_tree"] = trees.pop()
    if first.get("gpu"):
        merged["gpu"] = first["gpu"]
    tables.write_marker(out_dir, merged["suite"], merged.get("code_tree"), merged["git_sha"])
    tables.write_json(out_dir / tables.ENV, merged)
    finalize(out_dir)
    return out_dir

