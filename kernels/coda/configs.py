"""Configs for shapes never tuned: the tuned record of the nearest shape, without benchmarking.

A kernel's tuning key (:func:`kernels.coda.tuning.tuning_key`: M, N, K, flags, dtypes) or a host function's call key
(:func:`kernels.coda.strategy.call_key`: per argument its shape and dtype, or a flag) splits into a *signature*
(everything but the integers: flags, dtypes, argument names, ranks) and *log-shape features* (log2 of every
integer: M, N, K, tensor dimensions, head counts). :func:`neighbours` are the records of keys of the same
signature, nearest first in Euclidean distance (ties by key), among those a caller accepts (a config still in the
kernel's list and not pruned for the call; a strategy the call can take). A kernel's config is the :func:`vote` of
the :data:`K_NEAREST` nearest, each weighing 1 / (distance + :data:`SMOOTH`); a fused-or-split choice is the
nearest record's (its measured times decide among the paths the call has: :func:`kernels.coda.strategy.predicted`).
:func:`predict` draws on this GPU model's user cache and shipped table, else on the table of the nearest GPU model
(:func:`stand_in_tables`, :data:`NEAREST_GPU`: H100 <-> H200); :func:`kernels.coda.tuning.sources` lists them.

Why these rules: ``python benchmarks/config_rule.py`` predicts every shipped table entry from the others
(leave-one-out) and prints the share of exact-config matches for the vote, the nearest alone and the kernel's most
frequent config of the signature; on the tables of 2026-11 (Triton 3.6) the vote matched 69% (H100) and 79% (H200),
the nearest alone 68% and 71%, the most frequent 67% and 81%, and from the other GPU's table alone 74% and 78%
(nearest: 72%, 78%). For fused/split/gluon it prints the time the predicted path costs over the fastest, read off
the records' own medians: the nearest record's choice cost 3.2% (H100) and 2.9% (H200) in geometric mean, against
3- and 5-nearest averages of the time ratios (3.6-3.8%, 2.4-2.5%) and always fused (0-38% per function). Exact
matches understate a rule (near-tied configs are a coin toss for the tuner too): ``--time`` measures on the GPU.
Integer flags (RoPE's heads, head_dim) count as features: they scale like shapes and differ between models;
booleans and dtypes are signature and never mix.

The integers are logs, not values: the cost of a tile config depends on the ratios of problem to tile sizes, so
2048 -> 4096 is as far as 8192 -> 16384.
"""
from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Mapping

NEAREST_GPU = {"H100": ("H200",), "H200": ("H100",)}
"""Per GPU family (a word of the GPU's name), the families whose tables stand in, nearest first, when the
family's own table is absent."""


def split_key(key: Any) -> tuple[str, tuple[float, ...]]:
    """(signature, features) of a key (a tuple, or nested lists as JSON keys are): the key as JSON text with each
    integer (not a bool) replaced by ``#``, and log2 of each integer (at least 1) in order."""
    features: list[float] = []

    def walk(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        if isinstance(v, int) and not isinstance(v, bool):
            features.append(math.log2(max(v, 1)))
            return "#"
        return v

    return json.dumps(walk(key)), tuple(features)


@functools.lru_cache(maxsize=4096)
def _split_text(key: str) -> tuple[str, tuple[float, ...]]:
    return split_key(json.loads(key))


def distance(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))


def neighbours(key: Any, records: Mapping[str, Any], accept: Callable[[Any], bool] = lambda r: True,
               exclude: str | None = None) -> list[tuple[float, str, Any]]:
    """(distance, key, record) of every record of ``records`` (by key as JSON text) with ``key``'s signature that
    ``accept`` takes, ``exclude`` (a key as JSON text) left out, nearest first (ties by key)."""
    sig, x = split_key(key)
    found = []
    for k, record in records.items():
        if k == exclude:
            continue
        try:
            s, y = _split_text(k)
        except ValueError:  # a foreign key
            continue
        if s == sig and accept(record):
            found.append((distance(x, y), k, record))
    return sorted(found, key=lambda t: (t[0], t[1]))


def nearest(key: Any, records: Mapping[str, Any], accept: Callable[[Any], bool] = lambda r: True,
            exclude: str | None = None) -> Any | None:
    """The record of the nearest key (:func:`neighbours`), None when no key has ``key``'s signature."""
    found = neighbours(key, records, accept, exclude)
    return found[0][2] if found else None


def family(gpu_slug: str) -> str | None:
    """The family word (a key of :data:`NEAREST_GPU`) in a GPU's name or table slug, None if none."""
    return next((f for f in NEAREST_GPU if re.search(rf"(?<![A-Za-z0-9]){f}(?![0-9])", gpu_slug)), None)


def stand_in_tables(gpu_slug: str, tables: Path) -> list[Path]:
    """The shipped tables under ``tables`` that stand in for GPU ``gpu_slug``'s absent table, nearest first: those of
    :data:`NEAREST_GPU`'s families for its family (then those of its own family: another H100 variant's)."""
    own = family(gpu_slug)
    if own is None:
        return []
    shipped = sorted(tables.glob("*.json"))
    out = []
    for f in (own, *NEAREST_GPU[own]):
        out += [p for p in shipped if family(p.stem) == f and p not in out and p.stem != gpu_slug]
    return out


@functools.lru_cache(maxsize=16)
def read_table(path: Path, mtime: float) -> dict[str, dict[str, Any]]:
    """A shipped table's ``kernels`` (name -> key as JSON -> record), parsed once per file version."""
    try:
        return json.loads(path.read_text()).get("kernels", {})
    except (OSError, ValueError):
        return {}


def table_records(path: Path, name: str) -> dict[str, Any]:
    """The records a table file holds under ``name`` (a kernel's name, or ``strategy:<function>``)."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return {}
    return read_table(path, mtime).get(name, {})


K_NEAREST = 5
"""A config is voted for by the :data:`K_NEAREST` nearest tuned keys."""
SMOOTH = 0.25
"""A neighbour's vote weighs 1 / (distance + SMOOTH): distances in octaves, so a key a quarter octave away counts
half as much as the same key."""


def vote(found: list[tuple[float, str, Any]]) -> Any:
    """The record of most weight among :func:`neighbours`' first :data:`K_NEAREST` (each 1 / (distance +
    :data:`SMOOTH`); records equal as JSON add up), ties to the nearer."""
    weight: dict[str, float] = {}
    for d, _, record in found[:K_NEAREST]:
        text = json.dumps(record, sort_keys=True)
        weight[text] = weight.get(text, 0.0) + 1 / (d + SMOOTH)
    best = max(weight.values())
    return next(r for _, _, r in found if weight.get(json.dumps(r, sort_keys=True)) == best)


def predict(key: Any, sources: list[Mapping[str, Any]], accept: Callable[[Any], bool] = lambda r: True,
            rule: Callable[[list[tuple[float, str, Any]]], Any] = vote) -> Any | None:
    """``rule`` (:func:`vote`, or ``lambda found: found[0][2]`` for the nearest alone) over the :func:`neighbours`
    of ``key`` in the first of ``sources`` (nearest GPU first) that has any; None if none has."""
    for records in sources:
        found = neighbours(key, records, accept)
        if found:
            return rule(found)
    return None
