"""Fused, split or Gluon: every fused kernel's host function also has a split alternative, and runs the fastest.

The fused path is CODA itself: one GEMM whose epilogue does the memory-bound work. Its *split* alternative
computes the same outputs (same dtypes, shapes and layouts) as the plain GEMM (cuBLAS through torch;
:func:`kernels.coda.gemm.matmul`, the mainloop with dequantization, for fp8 operands), then ONE bandwidth-bound
Triton kernel that does the epilogue's math on that output, built from the same epilogue primitives. The GEMM output
is rounded to the activation dtype, as PyTorch's eager code rounds it: the pass rule's reference error (PyTorch's)
has that rounding too, and an fp32 output would double the bytes the split path moves. Where the epilogue is not
overlapped with the next tile's mainloop (docs/performance.md: small K, large epilogue traffic) the split path can be
faster::

    def my_kernel_split(a, w, x): ...       # the plain GEMM, then one pass of the epilogue's math over its output

    @with_split(my_kernel_split)
    def my_kernel(a, w, x): ...             # the fused path (a declared kernel gets both: kernels/coda/program.py)

For a plain GEMM (:func:`kernels.coda.gemm.mm`) the fused path is the mainloop and the split path is cuBLAS, with
no epilogue kernel at all. A host function may also have a *Gluon* path (:class:`Gluon`): a warp-specialized
kernel for Hopper (sm_90) written in Gluon, Triton's lower-level dialect, which the Triton language cannot express
(docs/performance.md). It has no interpreter, so its fused Triton twin is its CPU-tested reference; it takes part where
its ``applies`` holds (the GPU, the dtypes), and the fused path runs elsewhere. A call the fused kernel cannot
take (``fuses`` false: :func:`kernels.coda.rmsnorm_bwd.dgrad_rmsnorm` without a ZdZ, which its epilogue needs before
the first tile) runs split, forced or not, unmeasured.

The decorated function dispatches each call by its key (:func:`call_key`: the shape and dtype of each tensor
argument, its flags) to the strategy chosen for that key:

- ``CODABENCH_STRATEGY=fused|split|gluon`` forces one everywhere (gluon where it applies, fused elsewhere; tests run
  the split paths on the interpreter this way; benchmarks compare them); ``auto`` (the default) chooses:
- on a GPU, a key neither the cache file nor the shipped table holds gets the choice of the nearest stored key
  (:func:`predicted`: :mod:`kernels.coda.configs` over the call keys' log-shapes, same names, dtypes and flags;
  with no such key, fused), unmeasured and unstored; only with ``CODABENCH_TUNE=1`` (``--tune``,
  :func:`kernels.coda.tuning.tuning_on`) does the first call of such a key measure every path that applies: each
  is launched once (compiling and autotuning), then they take turns over :data:`ROUNDS` rounds of ``triton.testing.do_bench``; the fastest other
  path wins if its median is lower than fused's by more than :data:`MARGIN` (ties go to the fused path, the
  reference of the CODA idea). The choice is stored in
  the autotuning cache file (:mod:`kernels.coda.tuning`: same file, keyed by GPU model and Triton version, entry
  ``strategy:<function>:<hash of the source of every path's module>``), so later processes reuse it; a key the
  cache lacks is first looked up in the GPU model's shipped table (``strategy:<function>``). Measurement
  runs on arguments that are safe to repeat (``safe``: e.g. not in place), never during CUDA graph capture or
  torch.compile tracing (there an unknown key runs fused, unstored);
- on the CPU (the Triton interpreter) nothing is measured: fused.

:class:`Recorder` records which strategy each call used (host function, strategy), from any thread (autograd's
backward threads too), so an implementation can say how it ran a cell (:func:`summary`).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import itertools
import json
import os
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import triton

from kernels.coda import configs, precompile, tuning
from workloads.fp8 import Fp8, Recipe

FUSED, SPLIT, GLUON, AUTO = "fused", "split", "gluon", "auto"
STRATEGIES = (FUSED, SPLIT, GLUON)
ENV = "CODABENCH_STRATEGY"
ROUNDS = 3
"""Interleaved timing rounds of the candidates."""
MARGIN = 0.02
"""Another path is chosen when its median is below (1 - MARGIN) x the fused median."""
BENCH_MS = 25
"""``do_bench``'s repetition time per candidate and round (its warm-up: a fifth of it)."""


def forced() -> str | None:
    """The strategy ``CODABENCH_STRATEGY`` forces (``fused``, ``split`` or ``gluon``), None for ``auto`` or unset."""
    value = os.environ.get(ENV, AUTO)
    if value not in (*STRATEGIES, AUTO):
        raise ValueError(f"{ENV} must be {FUSED}, {SPLIT}, {GLUON} or {AUTO}, got {value!r}")
    return None if value == AUTO else value


forced()  # a bad value fails this module's import: one load error of the plugins that use it, not an error per cell

@dataclass(frozen=True)
class Gluon:
    """A host function's Gluon path: ``function`` (same signature and results as the fused path), bound where the
    kernel is declared, for the calls whose arguments satisfy ``applies`` (a call's key decides it: device, dtypes,
    shapes). A kernel module imports its Gluon function directly; where that import fails (a Triton without Gluon's
    Hopper API, which :func:`hopper` then also finds missing) it declares no Gluon path, so the host function has
    its fused and split paths only, as on any GPU other than a Hopper."""

    function: Callable
    applies: Callable[[dict[str, Any]], bool]


@functools.lru_cache(maxsize=None)
def hopper(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper GPU (sm_90) and this Triton has Gluon's Hopper API (asked at every call of a
    host function with a Gluon path: cached)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return importlib.util.find_spec("triton.experimental.gluon") is not None


def always(arguments: dict[str, Any]) -> bool:
    """The default ``fuses``: the fused kernel takes every call."""
    return True


def call_key(arguments: dict[str, Any]) -> str:
    """A call's key as JSON: per argument, a tensor's shape and dtype (an fp8 operand's, with whether its scales are
    per row), a recipe's accumulation mode (its scaling shows in the fp8 operands': a dgrad's are per tensor in
    either recipe, so both recipes' dgrads share their entries), or a flag (bool, int, str, None); floats and tuples
    (eps, theta, scalar multipliers, frequencies) do not change the cost and are left out."""
    parts = []
    for name, v in arguments.items():
        if isinstance(v, Recipe):
            parts.append([name, v.accum])
        elif isinstance(v, Fp8):
            parts.append([name, list(v.data.shape), str(v.data.dtype), v.scale.numel() > 1])
        elif isinstance(v, torch.Tensor):
            parts.append([name, list(v.shape), str(v.dtype)])
        elif v is None or isinstance(v, (bool, int, str)):
            parts.append([name, v])
        elif not isinstance(v, (float, tuple)):
            parts.append([name, str(v)])
    return json.dumps(parts)


def shape_key(arguments: dict[str, Any]) -> tuple:
    """A call's arguments as a hashable tuple of what :func:`call_key` and a Gluon path's ``applies`` read: per tensor
    its shape, strides, dtype and device (an fp8 operand's data's, and whether its scales are per row), flags as
    they are; floats and tuples left out as :func:`call_key` leaves them (a loss scale that changes at every step
    must not grow the memo). Cheaper than the JSON key: a host function is called at every layer, so the chooser
    looks its call up by this first."""
    parts = []
    for v in arguments.values():
        if isinstance(v, Fp8):
            parts.append((v.data.shape, v.data.stride(), v.data.dtype, v.data.device, v.scale.numel() > 1))
        elif isinstance(v, torch.Tensor):
            parts.append((v.shape, v.stride(), v.dtype, v.device))
        elif v is None or isinstance(v, (bool, int, str)):
            parts.append(v)
        elif not isinstance(v, (float, tuple)):
            parts.append(str(v))
    return tuple(parts)


def _device(arguments: dict[str, Any]) -> torch.device:
    first = next(v for v in arguments.values() if isinstance(v, (torch.Tensor, Fp8)))
    return (first.data if isinstance(first, Fp8) else first).device


def measurable(device: torch.device) -> bool:
    """Whether a choice can be measured now: on a GPU, not while a CUDA graph is captured or torch.compile traces."""
    return (device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
            and not torch.compiler.is_compiling())


def bench_ms(fn: Callable[[], Any]) -> float:
    """Median time of ``fn`` in ms (``triton.testing.do_bench``, L2 cleared between calls)."""
    return triton.testing.do_bench(fn, warmup=BENCH_MS // 5, rep=BENCH_MS, return_mode="median")


def measure(candidates: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """The median over :data:`ROUNDS` interleaved rounds of each candidate's time, after one launch of each."""
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in candidates}
    for _ in range(ROUNDS):
        for k, fn in candidates.items():
            times[k].append(bench_ms(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def pick(times: dict[str, float]) -> str:
    """The fastest path when it beats fused by more than :data:`MARGIN`; fused otherwise."""
    best = min(times, key=times.__getitem__)
    return best if times[best] < (1 - MARGIN) * times[FUSED] else FUSED


@functools.lru_cache(maxsize=None)
def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


# ---- what ran ---------------------------------------------------------------------------------------

_lock = threading.Lock()
_active: list[Recorder] = []


class Recorder:
    """The (host function, strategy) of each call while started; thread-safe.

    ``start()`` clears the record and (re)starts it; ``stop()`` ends it. An implementation that starts its recorder
    at each call of its op has, when the harness asks, the record of its last call, backward included."""

    def __init__(self) -> None:
        self._launches: list[tuple[str, str]] = []

    def start(self) -> None:
        with _lock:
            self._launches = []
            if self not in _active:
                _active.append(self)

    def stop(self) -> None:
        with _lock:
            if self in _active:
                _active.remove(self)

    def launches(self) -> list[tuple[str, str]]:
        with _lock:
            return list(self._launches)

    def __enter__(self) -> Recorder:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _record(name: str, strategy: str) -> None:
    with _lock:
        for r in _active:
            r._launches.append((name, strategy))


def summary(launches: list[tuple[str, str]]) -> str:
    """``residual_norm:fused swiglu:split ...``: each host function (without its ``gemm_`` prefix) in the order of its
    first call, with its strategy, or the strategies of its calls in order where they differ (``fused,split``; a run
    of n > 1 equal ones as ``fusedxn``, so a model's many calls stay short)."""
    calls: dict[str, list[str]] = {}
    for name, strategy in launches:
        calls.setdefault(name.removeprefix("gemm_"), []).append(strategy)

    def runs(s: list[str]) -> str:
        if len(set(s)) == 1:
            return s[0]
        groups = [(k, len(list(g))) for k, g in itertools.groupby(s)]
        return ",".join(k if n == 1 else f"{k}x{n}" for k, n in groups)

    return " ".join(f"{n}:{runs(s)}" for n, s in calls.items())


# ---- dispatch ---------------------------------------------------------------------------------------

class Chooser:
    """The strategy of each key of one host function: forced, known (this process, the cache file or the table),
    predicted from the nearest known key, or (tuning) measured."""

    def __init__(self, fused: Callable, split: Callable, safe: Callable[[dict[str, Any]], dict[str, Any]],
                 gluon: Gluon | None = None, fuses: Callable[[dict[str, Any]], bool] = always):
        self.fused, self.split, self.safe, self.gluon, self.fuses = fused, split, safe, gluon, fuses
        self.name = fused.__name__
        sources = list(dict.fromkeys(inspect.getsource(inspect.getmodule(f)) for f in (fused, split)))
        sources += [inspect.getsource(inspect.getmodule(gluon.function))] if gluon else []
        self.entry = f"strategy:{self.name}:{hashlib.sha256(''.join(sources).encode()).hexdigest()[:16]}"
        self.known: dict[Path, dict[str, dict[str, Any]]] = {}
        """Per cache file (GPU model, Triton version): call key -> record (``strategy``, and the measured times)."""
        self.predictions: dict[str, dict[str, str]] = {}
        """Per GPU model: call key -> the strategy :meth:`_predicted` chose (kept in memory only)."""
        self._lock = threading.Lock()
        self._facts: dict[tuple, tuple[str, tuple[str, ...]]] = {}
        """:func:`shape_key` -> (:func:`call_key`, :meth:`strategies`): pure functions of the arguments, memoized."""

    def path(self, strategy: str) -> Callable:
        """The function of a strategy this chooser returned."""
        if strategy == GLUON:
            return self.gluon.function
        return self.split if strategy == SPLIT else self.fused

    def strategies(self, arguments: dict[str, Any]) -> tuple[str, ...]:
        """The paths a call may take: fused, split, and gluon where it applies."""
        gluon = self.gluon is not None and self.gluon.applies(arguments)
        return (FUSED, SPLIT, GLUON) if gluon else (FUSED, SPLIT)

    def choose(self, arguments: dict[str, Any]) -> str:
        if not self.fuses(arguments):
            return SPLIT
        strategy = forced()
        if strategy is not None:
            return strategy if strategy != GLUON or GLUON in self.strategies(arguments) else FUSED
        device = _device(arguments)
        if device.type != "cuda":
            return FUSED
        with self._lock:
            gpu = gpu_name(device)
            path = tuning.cache_file(gpu)  # read from the environment once a call (each read ~1.5 us)
            known = self._known(gpu, path)
            key, candidates = self._call_facts(arguments)
            if key in known and serves(known[key], candidates):
                return known[key]["strategy"]
            if not tuning.tuning_on():
                return self._predicted(gpu, key, candidates)
            if not measurable(device):
                return FUSED
            if precompile.skipped(f"{self.name}: no strategy chosen for {key}"):
                return FUSED  # a dry pass compiles the fused path; the real call measures every path
            safe = self.safe(arguments)
            times = measure({s: functools.partial(self.path(s), **safe) for s in candidates})
            known[key] = record = {"strategy": pick(times), **{f"{s}_ms": t for s, t in times.items()}}
            if tuning.enabled():
                tuning.store_entries(path, self.entry, {key: record})
            return record["strategy"]

    def _predicted(self, gpu: str, key: str, candidates: tuple[str, ...]) -> str:
        """The :func:`predicted` choice for ``key`` from the nearest choice stored for GPU model ``gpu`` (its own,
        else a stand-in table's), computed once per key."""
        memo = self.predictions.setdefault(gpu, {})
        if key not in memo:
            name = self.entry.rsplit(":", 1)[0]
            _, *stand_ins = tuning.sources(gpu, name)  # this GPU's own records: self._known
            record = configs.predict(json.loads(key), [self._known(gpu), *stand_ins],
                                     lambda r: isinstance(r, dict) and r.get("strategy") in STRATEGIES,
                                     rule=lambda found: found[0][2])  # the nearest (benchmarks/config_rule.py)
            memo[key] = predicted(record, candidates)
        return memo[key]

    def _call_facts(self, arguments: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        """(:func:`call_key`, :meth:`strategies`) of a call, computed once per :func:`shape_key`. The key is that of
        the call as measured (``safe``'s arguments): a call in place and one that is not cost the same and read the
        same choice."""
        fast = shape_key(arguments)
        facts = self._facts.get(fast)
        if facts is None:
            facts = self._facts[fast] = (call_key(self.safe(arguments)), self.strategies(arguments))
        return facts

    def _known(self, gpu: str, path: Path | None = None) -> dict[str, dict[str, Any]]:
        """The choices for GPU model ``gpu``: its shipped table's, overridden by its cache file's ``path`` (by default
        :func:`kernels.coda.tuning.cache_file`'s; both read once; records that are not a choice are stale or foreign
        and ignored), then this process's."""
        path = path or tuning.cache_file(gpu)
        if path not in self.known:
            stored = {**tuning.table_entries(tuning.table_file(gpu), self.entry.rsplit(":", 1)[0]),
                      **(tuning.load_entries(path, self.entry) if tuning.enabled() else {})}
            self.known[path] = {k: r for k, r in stored.items()
                                if isinstance(r, dict) and r.get("strategy") in STRATEGIES}
        return self.known[path]


def serves(record: dict[str, Any], candidates: tuple[str, ...]) -> bool:
    """Whether a stored choice serves a call whose paths are ``candidates``: its strategy is one of them and, where
    the record has times (``<strategy>_ms``), it timed each of them (a choice made before a path existed is
    measured again)."""
    timed = {k.removesuffix("_ms") for k in record if k.endswith("_ms")}
    return record["strategy"] in candidates and (not timed or timed >= set(candidates))


def predicted(record: dict[str, Any] | None, candidates: tuple[str, ...]) -> str:
    """The path a neighbour's stored choice ``record`` gives a call whose paths are ``candidates``: :func:`pick` over
    the times it measured for those paths where it timed fused and another of them, else its strategy where that
    is a candidate; fused without a record."""
    if record is None:
        return FUSED
    times = {s: record[f"{s}_ms"] for s in candidates if isinstance(record.get(f"{s}_ms"), (int, float))}
    if FUSED in times and len(times) > 1:
        return pick(times)
    return record["strategy"] if record["strategy"] in candidates else FUSED


def binder(fn: Callable) -> Callable[[tuple, dict[str, Any]], dict[str, Any]]:
    """``bind(args, kwargs)``: the arguments of a call of ``fn`` by name, in its signature's order, defaults filled
    (``inspect.Signature.bind`` then ``apply_defaults``). Parameters that are all positional-or-keyword, the host
    functions' kind, take a fast path of plain dict work; anything else, and any call the fast path cannot bind
    (too many arguments, an unknown or repeated name, a missing one), goes through ``inspect`` and its errors."""
    signature = inspect.signature(fn)

    def slow(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    params = list(signature.parameters.values())
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
        return slow
    names = [p.name for p in params]
    defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def bind(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        given = dict(zip(names, args))
        if len(args) > len(names) or any(k in given or k not in signature.parameters for k in kwargs):
            return slow(args, kwargs)
        given.update(kwargs)
        if len(given) < len(names) and any(n not in given and n not in defaults for n in names):
            return slow(args, kwargs)
        return {n: given[n] if n in given else defaults[n] for n in names}

    return bind


def with_split(split: Callable, safe: Callable[[dict[str, Any]], dict[str, Any]] = dict,
               gluon: Gluon | None = None, fuses: Callable[[dict[str, Any]], bool] = always
               ) -> Callable:
    """Decorate a fused host function: each call runs it, ``split`` or ``gluon`` (same signature, same results), by
    :class:`Chooser`. ``safe`` maps a call's arguments to ones a measurement may repeat (no input written in place;
    the same shapes and dtypes, and no work launched: the call's key is read from them); ``fuses`` whether the
    fused kernel can take a call at all (else split).
    The decorated function keeps the first two as ``.fused`` and ``.split``, and its chooser as ``.chooser``."""

    def deco(fused: Callable) -> Callable:
        bind = binder(fused)
        chooser = Chooser(fused, split, safe, gluon, fuses)

        @functools.wraps(fused)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            arguments = bind(args, kwargs)
            strategy = chooser.choose(arguments)
            _record(chooser.name, strategy)
            return chooser.path(strategy)(**arguments)

        dispatch.fused, dispatch.split, dispatch.chooser = fused, split, chooser
        return dispatch

    return deco
