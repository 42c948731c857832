"""Autotuning beyond ``triton.autotune``: interleaved re-timing of close candidates, and an on-disk cache of the
results keyed by GPU model, Triton version, kernel source, shape and dtypes.

Re-timing: Triton times each config once, one after the other; on an H100 the same config's time varied by up
to 10% between tunings (LM-head GEMM, 1B), enough to pick a config 8-15% slower than the best. :func:`tune` times every config once
as Triton does, then :func:`refine` re-times those within 10% of the winner in three interleaved rounds and
keeps the lowest median, all before the launch.

Cache: Triton's autotuner benchmarks every tile config the first time a kernel meets a new key (M, N, K and the
argument dtypes) in a process: seconds to a minute per kernel and shape on a cold start. :func:`attach`
makes an autotuned kernel remember its winners in one JSON file per GPU model and Triton version::

    $CODABENCH_CACHE_DIR/autotune/<gpu>--triton-<version>.json      (default ~/.cache/codabench)
    {"<kernel name>:<source hash>": {"<tuning key as JSON>": {"kwargs": {...}, "num_warps": 8, "num_stages": 3}},
     "strategy:<host function>:<source hash>": {"<call key as JSON>": {"strategy": "split", "fused_ms": 1.31,
                                                                         "split_ms": 1.17}}}

so that a second run on the same kind of GPU starts timing within seconds. A kernel edit changes the source
hash (it retunes); a stored config that is no longer in the kernel's list is ignored. The ``strategy:`` entries
are the fused-or-split choices of the host functions (:mod:`kernels.coda.strategy`), keyed by their calls'
shapes, dtypes and flags, with the two medians they were chosen by; :func:`load_entries` and
:func:`store_entries` read and merge any entry. Writes merge with the
file's current content under a lock and replace it atomically, so concurrent runs (shards on the GPUs of one
host) lose nothing.

Shipped tables: the package carries the winners measured on the GPUs we benchmark, one file per GPU model::

    kernels/coda/tuned/<gpu>.json
    {"gpu": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "kernels": {"<kernel name>": {"<tuning key>": {...}}}}

keyed by kernel *name* and tuning key only, so that they serve any Triton version and survive edits elsewhere
in a kernel's file. A key absent from the user's cache is taken from the table of the same GPU model before any
tuning (a table entry whose config left the kernel's list is ignored, as above); what the table lacks is tuned
and cached as before. Regenerate a table on the GPU with ``python benchmarks/tune_tables.py`` (runs the suites'
shapes on empty caches, then :func:`export`), or export an existing cache file with
``python -m kernels.coda.tuning export CACHE_FILE``.

Tuning is opt-in. By default a key that neither the user's cache nor the table holds gets a *predicted* config at
once, nothing benchmarked (:func:`predict`, :mod:`kernels.coda.configs`): the config the nearest tuned shapes in
log(M, N, K) with the same flags and dtypes vote for, among this GPU's cache and table entries (else the table of the
nearest GPU model, H100 <-> H200), restricted to the configs the kernel's list and pruning leave for the call; with
no such entry, the first config pruning leaves. A config whose binary does not fit the GPU (more shared memory than it
has: Triton raises ``OutOfResources`` loading it) gives way to the next that does (:func:`run_fitting`), so a GPU
without a table (an A100, an L40S) runs every kernel. A predicted config is kept in memory only, never stored: the cache
holds measured winners alone, so a later tuning run still tunes that key. ``CODABENCH_TUNE=1`` (``--tune`` on the
run command; ``python -m kernels.coda.tuning tune`` for given models) tunes such keys as described above, and
stores the winners in the user cache, where later runs read them.

``CODABENCH_AUTOTUNE_CACHE=0`` turns the cache and the tables off (not the re-timing);
``CODABENCH_TUNING_TABLES=0`` the tables alone (with ``CODABENCH_TUNE=1``: to tune everything afresh; without it,
every key the cache lacks gets the first config pruning leaves). Kernels with a single config (the interpreter's)
never tune, so nothing is cached for them.

Binaries: Triton compiles one binary per config and per *specialization* of the integer arguments (divisible by 16
or not, equal to 1 or not), not per value: M, N and K are plain arguments of every CODA kernel, so the correctness
pass (``check_tokens`` = 2048) and the timed shape (16384) share the binary whenever they get the same config; a
token count not divisible by 16 (16381) is another specialization and compiles once more.
"""
from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import inspect
import json
import os
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources

from codabench.registry import TUNE_ENV
from kernels.coda import configs, precompile


def tuning_on() -> bool:
    """Whether keys not tuned yet are tuned (``CODABENCH_TUNE=1``) rather than predicted."""
    return os.environ.get(TUNE_ENV, "0") not in ("", "0")


def enabled() -> bool:
    return os.environ.get("CODABENCH_AUTOTUNE_CACHE", "1") != "0"


def tables_enabled() -> bool:
    return enabled() and os.environ.get("CODABENCH_TUNING_TABLES", "1") != "0"


TABLES = Path(__file__).parent / "tuned"
"""The shipped tables, one ``<gpu>.json`` per GPU model."""


def _slug(gpu_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", gpu_name).strip("-")


def cache_file(gpu_name: str, triton_version: str = triton.__version__) -> Path:
    """The cache file of one GPU model and Triton version (under ``CODABENCH_CACHE_DIR``, else
    ``~/.cache/codabench``; every strategy choice asks for it, so the path is built once per environment)."""
    return _cache_file(os.environ.get("CODABENCH_CACHE_DIR"), os.environ.get("HOME"), gpu_name, triton_version)


@functools.lru_cache(maxsize=64)
def _cache_file(cache_dir: str | None, home: str | None, gpu_name: str, triton_version: str) -> Path:
    if cache_dir is not None:
        root = Path(cache_dir)
    else:  # $HOME, or the password database's home directory where HOME is unset (as Path.home())
        root = (Path(home) if home else Path.home()) / ".cache" / "codabench"
    return root / "autotune" / f"{_slug(gpu_name)}--triton-{triton_version}.json"


def table_file(gpu_name: str) -> Path:
    """The shipped table of one GPU model."""
    return TABLES / f"{_slug(gpu_name)}.json"


def kernel_id(tuner: Autotuner) -> str:
    """The kernel's name and the hash of its source and of every jit function it calls."""
    fn = tuner.fn
    while not hasattr(fn, "cache_key") and hasattr(fn, "fn"):  # through decorators to the JITFunction
        fn = fn.fn
    # Triton's cache_key covers the jit functions it calls; the interpreter's functions have none: hash the source
    digest = getattr(fn, "cache_key", None) or hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    return f"{fn.__name__}:{digest[:16]}"


def _config_json(cfg: triton.Config) -> dict[str, Any]:
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or a torn/foreign file: start afresh
        return {}


def _fill(tuner: Autotuner, entries: dict[str, Any]) -> int:
    """Put ``entries`` (tuning key as JSON -> config) whose key ``tuner`` does not know yet and whose config is in
    its list into its in-memory cache; the number put."""
    configs = {json.dumps(_config_json(c), sort_keys=True): c for c in tuner.configs}
    n = 0
    for key, stored in entries.items():
        cfg, k = configs.get(json.dumps(stored, sort_keys=True)), tuple(json.loads(key))
        if cfg is not None and k not in tuner.cache:
            tuner.cache[k] = cfg
            n += 1
    return n


def kernel_name(tuner: Autotuner) -> str:
    return kernel_id(tuner).rsplit(":", 1)[0]


def load(tuner: Autotuner, path: Path) -> int:
    """Put the cached winners of ``tuner``'s kernel into its in-memory cache; the number loaded."""
    return _fill(tuner, load_entries(path, kernel_id(tuner)))


def table_entries(path: Path, name: str) -> dict[str, Any]:
    """The records the shipped table ``path`` holds under ``name`` (a kernel's name, or ``strategy:<function>``),
    by key (JSON text); none when tables are turned off."""
    return _read(path).get("kernels", {}).get(name, {}) if tables_enabled() else {}


def load_table(tuner: Autotuner, path: Path) -> int:
    """Put the shipped table's winners of ``tuner``'s kernel (by name) for keys it does not know yet into its
    in-memory cache; the number loaded."""
    return _fill(tuner, table_entries(path, kernel_name(tuner)))


def export(cache: Path, table: Path | None = None) -> tuple[Path, int]:
    """Merge the winners of a cache file (``<gpu>--triton-<version>.json``) into the shipped table of its GPU model
    (by default ``TABLES/<gpu>.json``): entries by kernel name, the cache's replacing the table's. The table's path
    and its number of entries."""
    slug, _, version = cache.stem.rpartition("--triton-")
    if not slug:
        raise ValueError(f"{cache.name}: not a cache file name (<gpu>--triton-<version>.json)")
    table = table or TABLES / f"{slug}.json"
    data = _read(table)
    kernels = data.setdefault("kernels", {})
    for kid, entries in _read(cache).items():
        kernels.setdefault(kid.rsplit(":", 1)[0], {}).update(entries)
    data.update(gpu=slug, triton=version)
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return table, sum(len(v) for v in kernels.values())


def store(tuner: Autotuner, keys: list[tuple], path: Path) -> None:
    """Add ``tuner``'s winners for ``keys`` to the file (merged with what is there, replaced atomically)."""
    store_entries(path, kernel_id(tuner), {json.dumps(list(k)): _config_json(tuner.cache[k]) for k in keys})


def load_entries(path: Path, entry: str) -> dict[str, Any]:
    """The records the file holds under ``entry`` (a kernel id, or ``strategy:...``), by key (JSON text)."""
    return _read(path).get(entry, {})


def store_entries(path: Path, entry: str, records: dict[str, Any]) -> None:
    """Add ``records`` (by key) under ``entry`` to the file: merged with what is there, under a lock (runs on several
    GPUs of one host share the file), replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _read(path)
        data.setdefault(entry, {}).update(records)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(f.name, path)


REFINE_WITHIN = 0.10
REFINE_ROUNDS = 3


def _median_ms(t: float | list[float]) -> float:
    return t[0] if isinstance(t, (list, tuple)) else t  # do_bench's quantiles start with the median


_PLAIN = frozenset((int, float, bool, str, type(None)))
"""Argument types with no ``dtype`` (skipped without asking, the common case of a launch's ~40 arguments)."""


@functools.lru_cache(maxsize=None)
def _arg_names(tuner: Autotuner) -> frozenset[str]:
    return frozenset(tuner.arg_names)


def tuning_key(tuner: Autotuner, args: tuple, kwargs: dict) -> tuple:
    """The key ``Autotuner.run`` files a launch under: the values of its ``key`` arguments, then the dtype of
    every argument that has one, in the order given (Triton 3.x). Should it ever differ, Triton tunes on its own (no
    refining, still cached)."""
    names = _arg_names(tuner)
    named = dict(zip(tuner.arg_names, args))
    named.update((k, v) for k, v in kwargs.items() if k in names)
    return tuple([named[k] for k in tuner.keys if k in named] +
                 [str(v.dtype) for v in named.values() if type(v) not in _PLAIN and hasattr(v, "dtype")])


def refine(tuner: Autotuner, timings: dict[triton.Config, Any], args: tuple, kwargs: dict) -> triton.Config:
    """The config of lowest median among those within REFINE_WITHIN of the fastest of ``timings`` (a first pass),
    re-timed in REFINE_ROUNDS interleaved rounds with the launch's arguments."""
    first = {c: _median_ms(t) for c, t in timings.items()}
    best = min(first, key=first.get)
    close = [c for c, t in first.items() if t <= first[best] * (1 + REFINE_WITHIN)]
    if len(close) < 2:
        return best
    rounds: dict[triton.Config, list[float]] = {c: [] for c in close}
    for _ in range(REFINE_ROUNDS):
        for c in close:
            rounds[c].append(_median_ms(tuner._bench(*args, config=c, **kwargs)))
    return min(close, key=lambda c: statistics.median(rounds[c]))


def tune(tuner: Autotuner, args: tuple, kwargs: dict) -> triton.Config | None:
    """Triton's tuning pass (every config that survives pruning, timed once by ``Autotuner._bench``, which
    restores ``restore_value`` outputs) followed by :func:`refine`; None when pruning leaves one config.
    Runs before the launch, as Triton's own tuning does: a tuning run must never be the last to write a
    kernel's outputs (a config of another tile shape leaves partial sums in another layout)."""
    tuner.nargs = dict(zip(tuner.arg_names, args))
    try:
        configs = tuner.prune_configs(kwargs)
        if len(configs) < 2:
            return None
        timings = {c: tuner._bench(*args, config=c, **kwargs) for c in configs}
        tuner.configs_timings = timings
        return refine(tuner, timings, args, kwargs)
    finally:
        tuner.nargs = None


def sources(gpu: str, name: str, entry: str | None = None) -> list[dict[str, Any]]:
    """The records :func:`predict` draws on for ``name`` (a kernel's name, or ``strategy:<function>``) on GPU model
    ``gpu``, nearest first: its shipped table's merged with (overridden by) its cache file's ``entry`` (a kernel id,
    or ``strategy:<function>:<hash>``), then each stand-in table (:func:`kernels.coda.configs.stand_in_tables`).
    The tables are left out when turned off, the cache when it is."""
    own = dict(table_entries(table_file(gpu), name))
    if entry is not None and enabled():
        own.update(load_entries(cache_file(gpu), entry))
    stand_ins = configs.stand_in_tables(_slug(gpu), TABLES) if tables_enabled() and not table_file(gpu).is_file() else []
    return [own] + [configs.table_records(p, name) for p in stand_ins]


def _allowed(tuner: Autotuner, args: tuple, kwargs: dict) -> list[triton.Config]:
    """The configs pruning leaves for a launch of ``tuner`` with ``args``, in the kernel's order."""
    tuner.nargs = dict(zip(tuner.arg_names, args))
    try:
        return tuner.prune_configs(kwargs)
    finally:
        tuner.nargs = None


def run_fitting(tuner: Autotuner, run: Callable, key: tuple, args: tuple, kwargs: dict) -> Any:
    """``run`` under the config ``tuner`` holds for ``key``, else the next that fits: where a
    config's binary needs more shared memory or registers than this GPU has, Triton raises :class:`OutOfResources`
    loading it, before anything runs, and the next config pruning leaves takes its place for the key (pruning
    bounds the mainloop's stages, not the epilogue's buffers: on a GPU with less shared memory than the tables'
    or a kernel's first config that no table vouches for). Raises when none fits."""
    tried = []
    while True:
        try:
            return _launch(tuner, run, key, args, kwargs)
        except OutOfResources:
            tried.append(tuner.cache[key])
            left = [c for c in _allowed(tuner, args, kwargs) if c not in tried]
            if not left:
                raise
            tuner.cache[key] = left[0]


def _launch(tuner: Autotuner, run: Callable, key: tuple, args: tuple, kwargs: dict) -> Any:
    """``run`` (the tuner's ``Autotuner.run``) under the config held for ``key``. Where ``run`` is Autotuner's own and
    the config has no pre-hook, this is what that method does for a known key, without building the key from the
    arguments once more (dicts of ~40 arguments: about 40 us of a launch's 70 on an H200's host): ``best_config``
    set, the kernel's JIT launch with the config's arguments."""
    config = tuner.cache[key]
    if getattr(run, "__func__", None) is not Autotuner.run or config.pre_hook is not None:
        return run(*args, **kwargs)
    tuner.best_config = config
    return tuner.fn.run(*args, **kwargs, **config.all_kwargs())


def predict(tuner: Autotuner, key: tuple, args: tuple, kwargs: dict, gpu: str) -> tuple[triton.Config, str]:
    """A config for a launch of ``tuner`` under tuning key ``key`` without benchmarking, and how it was chosen:
    ``predicted`` (the nearest tuned keys' vote, :func:`kernels.coda.configs.predict` over :func:`sources`, among
    the configs pruning leaves for the launch) or ``default`` (no tuned key of its signature: the first config
    pruning leaves)."""
    allowed = _allowed(tuner, args, kwargs)
    by_json = {json.dumps(_config_json(c), sort_keys=True): c for c in allowed}

    def accept(record: Any) -> bool:
        return isinstance(record, dict) and json.dumps(record, sort_keys=True) in by_json

    record = configs.predict(list(key), sources(gpu, kernel_name(tuner), kernel_id(tuner)), accept)
    if record is None:
        return allowed[0], "default"
    return by_json[json.dumps(record, sort_keys=True)], "predicted"


def attach(tuner: Autotuner, gpu_name: Callable[[], str]) -> Autotuner:
    """Back ``tuner``'s in-memory cache by the file of the GPU ``gpu_name()`` names, then by that GPU's shipped
    table (loaded at the first launch, not at import: that would initialise CUDA); a key neither holds gets
    :func:`predict`'s config, or with :func:`tuning_on` is tuned by :func:`tune` and its winner stored in the file."""
    if len(tuner.configs) < 2:
        return tuner
    run, path, gpu, use_file = tuner.run, None, None, enabled()

    def tuned_run(*args, **kwargs):
        nonlocal path, gpu
        if gpu is None:
            gpu = gpu_name()
        if use_file and path is None:
            path = cache_file(gpu)
            load(tuner, path)
            load_table(tuner, table_file(gpu))
        key = tuning_key(tuner, args, kwargs)
        if key in tuner.cache:  # the common case: a known shape, nothing to tune or store (a dry pass may have
            return run_fitting(tuner, run, key, args, kwargs)  # put a predicted config there, compiled but not loaded)
        if not tuning_on():  # kept in memory only: a tuning run still tunes this key
            tuner.cache[key], _ = predict(tuner, key, args, kwargs, gpu)
            return run_fitting(tuner, run, key, args, kwargs)
        precompile.untuned(f"{kernel_name(tuner)}: no tuned config for {key}")  # a dry pass ends here
        known = set(tuner.cache)
        best = tune(tuner, args, kwargs)
        if best is not None:
            tuner.cache[key] = best
        out = run(*args, **kwargs)
        if path is not None:  # our pick, or what Triton filed itself (one config left, or a key of its own)
            store(tuner, [k for k in tuner.cache if k not in known], path)
        return out

    tuner.run = tuned_run
    return tuner


CODA_IMPLS = {"train": "hf-coda"}
"""The CODA implementation of a suite whose ops coda-triton does not implement (coda-triton elsewhere)."""
TUNING_RUN = ("--reps", "2", "--rounds", "1", "--warmup", "1", "--quiet", "--tune")
"""Run-command flags of a tuning run: few samples (the timings are not the point), tuning on."""


def tuning_run_args(suite: str) -> list[str]:
    """The run command's arguments that run ``suite``'s CODA cells to tune them."""
    return ["--suite", suite, "--impls", CODA_IMPLS.get(suite, "coda-triton"), *TUNING_RUN]


def _entries(path: Path) -> int:
    return sum(len(v) for v in _read(path).values() if isinstance(v, dict))


def tune_models(suites: list[str], run_args: list[str], out: Path) -> int:
    """Run each of ``suites``' CODA cells with tuning on (:func:`tuning_run_args`, then ``run_args``: the models,
    tokens, ops, dtypes), each run's folder under ``out``, in this process (the run's worker inherits the
    environment); the worst exit code."""
    from codabench import cli  # the harness, to run its cells (it never imports us)

    codes = [cli.main([*tuning_run_args(suite), *run_args, "--out", str(out / f"tune-{suite}")]) for suite in suites]
    return max(codes)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kernels.coda.tuning",
                                description="tune CODA kernels for given models into the user cache; export a cache "
                                            "file into the shipped table of its GPU model")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="merge CACHE_FILE (<gpu>--triton-<version>.json) into kernels/coda/tuned/<gpu>.json")
    e.add_argument("cache", type=Path)
    e.add_argument("--table", type=Path, help="the table to write (default: the shipped one of the cache's GPU)")
    t = sub.add_parser("tune", help="run the CODA cells of the given models with tuning on (--tune): the winners "
                                    "go to the user cache, read by later runs on this GPU model",
                       epilog="other run-command flags (--tokens, --ops, --dtypes, --modes, --check-tokens) pass on")
    t.add_argument("--model", action="append", default=[], metavar="NAME:hidden=H,ffn=F,heads=N,vocab=V[,...]")
    t.add_argument("--model-config", action="append", default=[], metavar="PATH", help="a Hugging Face config.json")
    t.add_argument("--suites", default="full", help="comma-separated suites whose ops to tune (default: full; "
                                                    "train: the training step, on hf-coda)")
    t.add_argument("--out", type=Path, help="folder of the tuning runs (default: a new temporary folder)")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "export":
        if rest:
            p.exit(2, f"export: unknown arguments {' '.join(rest)}\n")
        if not args.cache.is_file():
            p.exit(2, f"{args.cache}: no such file\n")
        try:
            table, n = export(args.cache, args.table)
        except ValueError as err:
            p.exit(2, f"{err}\n")
        print(f"{table}: {n} entries")
        return
    if not args.model and not args.model_config:
        p.exit(2, "tune: give the models to tune (--model or --model-config)\n")
    import torch

    if not torch.cuda.is_available():
        p.exit(2, "tune: no GPU; configs are tuned on the GPU they are for\n")
    models = [a for m in args.model for a in ("--model", m)] + [a for m in args.model_config for a in ("--model-config", m)]
    out = args.out or Path(tempfile.mkdtemp(prefix="codabench-tune-"))
    path = cache_file(torch.cuda.get_device_name())
    before = _entries(path)
    code = tune_models(args.suites.split(","), models + rest, out)
    print(f"{path}: {_entries(path) - before} new entries ({_entries(path)} in all); runs in {out}")
    if code:
        p.exit(code, f"tune: a tuning run ended with exit code {code} (its entries are kept)\n")


if __name__ == "__main__":
    main()
