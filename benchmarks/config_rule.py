"""How good is the untuned rule (kernels/coda/configs.py)? Leave-one-out over the shipped tables, and on a GPU the
speed of the predicted configs against the tuned ones.

    python benchmarks/config_rule.py                              # agreement (any machine)
    python benchmarks/config_rule.py --time [--suites full,train] # + speed of predicted vs tuned (needs the GPU)

Agreement: for every entry of every shipped table (kernels/coda/tuned/<gpu>.json), its config is predicted from the
table's other entries, as a run predicts a shape the table lacks, and compared with the tuned one (exact match).
Three rules, each among the configs still in the kernel's list and the keys of the same flags and dtypes: ``vote``
(the rule the kernels use, :func:`kernels.coda.configs.vote`: the five nearest keys in log(M, N, K), weighted by
closeness), ``nearest`` (the nearest key's) and ``frequent`` (the kernel's most frequent config).
Then each GPU's table predicted from the other GPU's alone (the stand-in table, H100 <-> H200). An exact-match share
understates a rule: two configs within noise of each other are a coin toss for the tuner too; ``--time`` measures.

Strategies (fused, split, gluon): each stored choice is predicted from the others the same way
(:func:`kernels.coda.strategy.predicted`); since every record holds the medians of the paths it measured, the cost
of a wrong prediction is read off the table itself: the predicted path's time over the fastest path's, geometric
mean and worst, against always taking the fused path.

``--time`` (CUDA): runs the suites' coda-triton cells in this process with every kernel launch of a new key going
through :func:`compare` instead of tuning: the tuned config (this GPU's table) and the config predicted without that
key are timed in interleaved rounds (``Autotuner._bench``, :data:`ROUNDS`), and the ratio predicted / tuned printed
per kernel (geometric mean and worst) with the overall figures against the targets (geometric mean within 3%, no key
worse than 8%). Fused paths everywhere (``CODABENCH_STRATEGY=fused``), so every fused kernel meets its shapes.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.coda import configs, tuning  # noqa: E402

MODULES = ("gemm", "producer", "rope", "swiglu", "swiglu_bwd", "rmsnorm_bwd", "cross_entropy", "scaled_linear")
"""The modules of kernels.coda whose autotuned kernels the tables hold."""
ROUNDS = 5
"""Interleaved timing rounds of the tuned and the predicted config of one key (``--time``)."""
TARGET_GEOMEAN, TARGET_WORST = 1.03, 1.08


def _config_text(record: Any) -> str:
    return json.dumps(record, sort_keys=True)


def kernel_lists() -> dict[str, set[str]]:
    """Per autotuned kernel (by name): its configs (as JSON text), the GPU's lists (not the interpreter's one)."""
    out = {}
    for name in MODULES:
        module = importlib.import_module(f"kernels.coda.{name}")
        for value in (getattr(v, "kernel", v) for v in vars(module).values()):  # declared: the host's .kernel
            if isinstance(value, tuning.Autotuner):
                out[tuning.kernel_name(value)] = {_config_text(tuning._config_json(c)) for c in value.configs}
    return out


def rules(key: str, records: dict[str, Any], allowed: set[str] | None, exclude: str | None) -> dict[str, Any]:
    """The predictions of the three rules for ``key`` from ``records`` (``exclude`` left out); absent: no key of
    the same flags and dtypes."""
    found = configs.neighbours(json.loads(key), records,
                               lambda r: allowed is None or _config_text(r) in allowed, exclude)
    if not found:
        return {}
    counts = collections.Counter(_config_text(r) for _, _, r in found)
    frequent = max(counts.values())
    return {"vote": configs.vote(found), "nearest": found[0][2],
            "frequent": next(r for _, _, r in found if counts[_config_text(r)] == frequent)}


def agreement(target: dict[str, dict[str, Any]], source: dict[str, dict[str, Any]] | None,
              lists: dict[str, set[str]]) -> list[tuple[str, int, int, dict[str, int]]]:
    """Per kernel of ``target``: (name, entries, predicted, exact matches per rule), each entry predicted from
    ``source`` (None: the target's other entries)."""
    out = []
    for name, records in sorted(target.items()):
        if name.startswith("strategy:"):
            continue
        allowed = lists.get(name)
        hits, n, predicted = collections.Counter(), 0, 0
        for key, tuned in records.items():
            if allowed is not None and _config_text(tuned) not in allowed:
                continue  # a config that left the kernel's list: no rule could name it
            n += 1
            guesses = rules(key, records if source is None else source.get(name, {}), allowed,
                            key if source is None else None)
            predicted += bool(guesses)
            for rule, guess in guesses.items():
                hits[rule] += _config_text(guess) == _config_text(tuned)
        out.append((name, n, predicted, dict(hits)))
    return out


def strategy_costs(table: dict[str, dict[str, Any]]) -> list[tuple[str, int, int, float, float, float]]:
    """Per host function: (name, records with times, right predictions, geometric mean and worst of predicted /
    fastest, geometric mean of fused / fastest), each record predicted from the others."""
    from kernels.coda.strategy import STRATEGIES, predicted

    out = []
    for name, records in sorted(table.items()):
        if not name.startswith("strategy:"):
            continue
        rows = []
        for key, record in records.items():
            times = {s: record[f"{s}_ms"] for s in STRATEGIES if isinstance(record.get(f"{s}_ms"), (int, float))}
            if "fused" not in times or len(times) < 2:
                continue
            near = configs.nearest(json.loads(key), records, lambda r: isinstance(r, dict) and "strategy" in r, key)
            guess = predicted(near, tuple(times))
            best = min(times.values())
            rows.append((guess == record["strategy"], times[guess] / best, times["fused"] / best))
        if rows:
            geo = math.exp(statistics.fmean(math.log(r[1]) for r in rows))
            fused = math.exp(statistics.fmean(math.log(r[2]) for r in rows))
            out.append((name.removeprefix("strategy:"), len(rows), sum(r[0] for r in rows), geo,
                        max(r[1] for r in rows), fused))
    return out


def print_agreement() -> None:
    lists = kernel_lists()
    tables = {p.stem: json.loads(p.read_text()).get("kernels", {}) for p in sorted(tuning.TABLES.glob("*.json"))}
    for gpu, table in tables.items():
        print(f"\n== {gpu}: each entry predicted from the table's others (leave-one-out)")
        _print_rows(agreement(table, None, lists))
        print("\n   strategies: predicted path's time / fastest path's (the records' own medians)")
        print(f"   {'function':22} {'n':>4} {'right':>6} {'geomean':>8} {'worst':>7} {'fused':>7}")
        for name, n, right, geo, worst, fused in strategy_costs(table):
            print(f"   {name:22} {n:4} {right:6} {geo:8.3f} {worst:7.3f} {fused:7.3f}")
        for other, source in tables.items():
            if other != gpu:
                print(f"\n== {gpu} predicted from {other}'s table alone (the stand-in table)")
                _print_rows(agreement(table, source, lists))


def _print_rows(rows: list[tuple[str, int, int, dict[str, int]]]) -> None:
    names = ("vote", "nearest", "frequent")
    print(f"   {'kernel':28} {'n':>4} {'pred':>5} " + " ".join(f"{r:>10}" for r in names))
    total = collections.Counter()
    for name, n, predicted, hits in rows:
        total.update(n=n, predicted=predicted, **{r: hits.get(r, 0) for r in names})
        print(f"   {name:28} {n:4} {predicted:5} " + " ".join(f"{hits.get(r, 0):10}" for r in names))
    share = " ".join(f"{total[r] / max(total['n'], 1):10.0%}" for r in names)
    print(f"   {'all':28} {total['n']:4} {total['predicted']:5} {share}")


# ---- --time: predicted vs tuned configs on the GPU ---------------------------------------------------------------

RATIOS: dict[str, list[float]] = collections.defaultdict(list)


def compare(tuner: tuning.Autotuner, args: tuple, kwargs: dict) -> Any:
    """In place of :func:`kernels.coda.tuning.tune`: time the table's config of this launch's key against the one
    predicted without that key (records the ratio predicted / tuned) and return the table's (the prediction where
    the table lacks the key)."""
    import torch

    gpu = torch.cuda.get_device_name()
    key = tuning.tuning_key(tuner, args, kwargs)
    name = tuning.kernel_name(tuner)
    records = configs.table_records(tuning.table_file(gpu), name)
    tuner.nargs = dict(zip(tuner.arg_names, args))
    try:
        allowed = {_config_text(tuning._config_json(c)): c for c in tuner.prune_configs(kwargs)}
    finally:
        tuner.nargs = None
    text = json.dumps(list(key))
    tuned = allowed.get(_config_text(records.get(text)))
    found = configs.neighbours(list(key), records, lambda r: _config_text(r) in allowed, exclude=text)
    guess = allowed[_config_text(configs.vote(found))] if found else next(iter(allowed.values()))
    if tuned is None:
        return guess
    if guess is tuned:
        RATIOS[name].append(1.0)
        return tuned
    times: dict[Any, list[float]] = {tuned: [], guess: []}
    for _ in range(ROUNDS):
        for c in (tuned, guess):
            times[c].append(tuning._median_ms(tuner._bench(*args, config=c, **kwargs)))
    RATIOS[name].append(statistics.median(times[guess]) / statistics.median(times[tuned]))
    return tuned


def time_suites(suites: list[str]) -> int:
    os.environ.update(CODABENCH_TUNE="1", CODABENCH_AUTOTUNE_CACHE="0", CODABENCH_STRATEGY="fused")
    from codabench.cli import main as run_bench

    tuning.tune = compare  # every new key of every kernel goes through compare (the cache is off: no key is known)
    out = Path(tempfile.mkdtemp(prefix="codabench-config-rule-"))
    for suite in suites:
        run_bench([*tuning.tuning_run_args(suite), "--inline", "--out", str(out / suite)])
    every = [r for v in RATIOS.values() for r in v]
    if not every:
        print("no key of the table was met")
        return 1
    print(f"\n== predicted / tuned config, median of {ROUNDS} interleaved rounds per key")
    print(f"   {'kernel':28} {'keys':>5} {'differ':>6} {'geomean':>8} {'worst':>7}")
    for name, ratios in sorted(RATIOS.items()):
        geo = math.exp(statistics.fmean(math.log(r) for r in ratios))
        print(f"   {name:28} {len(ratios):5} {sum(r != 1.0 for r in ratios):6} {geo:8.3f} {max(ratios):7.3f}")
    geo, worst = math.exp(statistics.fmean(math.log(r) for r in every)), max(every)
    ok = geo <= TARGET_GEOMEAN and worst <= TARGET_WORST
    print(f"   {'all':28} {len(every):5} {sum(r != 1.0 for r in every):6} {geo:8.3f} {worst:7.3f}   targets "
          f"{TARGET_GEOMEAN} / {TARGET_WORST}: {'met' if ok else 'MISSED'} (runs in {out})")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--time", action="store_true", help="also time predicted vs tuned configs (needs the GPU)")
    p.add_argument("--suites", default="full,train", help="comma-separated suites whose shapes --time runs")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.exit(2, "config_rule.py: unset TRITON_INTERPRET (the interpreter's kernels have one config each)\n")
    print_agreement()
    if not args.time:
        return 0
    import torch

    if not torch.cuda.is_available():
        p.exit(2, "config_rule.py: --time needs the GPU the table is for\n")
    return time_suites(args.suites.split(","))


if __name__ == "__main__":
    sys.exit(main())
