"""Command line: ``python run_bench.py [run flags]``, ``python -m codabench {merge,compare,report,index,history} ...``.

Call :func:`codabench.bootstrap.select_device` before importing this module (the entry points do):
on a machine without a GPU it sets ``TRITON_INTERPRET=1``, which triton reads when imported.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import sys
from pathlib import Path

import torch

from codabench.bootstrap import INTERPRETER_NOTE, select_device
from codabench import distributed, history
from codabench.matrix import Selection, build_cells, parse_shard
from codabench.discovery import discover
from codabench.env import REPO_ROOT
from codabench.history import record_run
from codabench.report import finalize
from codabench.results import KEY, MARKER, RunFolderError, check_run, load_run, read_env, write_atomic
from codabench.report.compare import compare, format_compare
from codabench.report.index import EXIT_STALE, build_index
from codabench.report.merge import merge
from codabench.config import DEFAULT_CELL_TIMEOUT_S, RunConfig
from codabench.runner import DeviceLost, Runner
from codabench.worker import WorkerProcess
from codabench.writer import RunLock, check_run_dir
from codabench.timing import TimingConfig
from codabench.registry import TUNE_ENV
from workloads.models import INLINE_KEYS, LIMITS, PRESETS, ModelShape, from_hf_config, parse_model_spec
from workloads.op import DTYPES, MODES
from workloads.ops import OPS
from workloads.suites import SUITES, Suite, get_suite

REPORTS = Path("reports")
GPU_ROUNDS = 3
"""Default rounds of the blocks fallback on the GPU (a group sampled in blocks: codabench/runner.py)."""
SUBCOMMANDS = ("merge", "compare", "report", "index", "history")
LIST_MODELS = ["?"]
"""``--models`` given without a value: list the presets."""
EXIT_OK, EXIT_CELL_ERRORS, EXIT_USAGE, EXIT_DEVICE_LOST, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
"""Exit codes of a run: finished with every cell ok (and correct), n/a or skipped; finished with error rows or cells
that fail the error rule (the report is written all the same); bad flags, names or paths (nothing ran); the CUDA
context broke (``--inline`` only); interrupted (Ctrl-C, or SIGTERM: ``timeout``, ``kill``, a scheduler's job end;
the worker is stopped and the report is written)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is: it stops the run as Ctrl-C does."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated()


class UsageError(Exception):
    """Bad input on the command line: one line on stderr, exit code 2."""


class _ParserExit(SystemExit):
    """argparse is done (bad input, already printed, or ``--help``): :func:`main` returns its ``code``; a parser
    used on its own exits as argparse's does."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with one line for bad input (no usage block): ``prog: message (see --help)``, exit code 2. Flags are
    taken only as spelled in full (an abbreviation such as ``--suit`` is an unknown argument). Its exits are
    :class:`_ParserExit`, whose code :func:`main` returns."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: {message} (see --help)", file=sys.stderr)
        raise _ParserExit(EXIT_USAGE)

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            print(message, end="", file=sys.stderr)
        raise _ParserExit(status)


def _csv(text: str) -> list[str]:
    """An argparse type: comma-separated names, at least one, none twice (an empty list is an error, never "the
    default")."""
    names = [t.strip() for t in text.split(",")]
    if not any(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    if not all(names):
        raise argparse.ArgumentTypeError(f"an empty name in {text!r}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} given twice in {text!r}")
    return names


def _number(kind: type, minimum: float, maximum: float, what: str):
    """An argparse type: ``kind`` (int or float) from ``minimum`` to ``maximum``."""
    expected = "expected {} from {} to {}".format(what, *(f"{v:g}" if isinstance(v, float) else v
                                                          for v in (minimum, maximum)))

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
        if not minimum <= value <= maximum:  # NaN fails too
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value

    return parse


MAX_REPS, MAX_ROUNDS, MAX_WARMUP, MAX_CELL_TIMEOUT_S = 10_000, 100, 1000, 86_400.0
"""The most sweeps per group, rounds, warm-up calls and seconds of ``--cell-timeout`` a run takes: far above what a
measurement needs (a group resolved to 1% takes tens to hundreds of sweeps), low enough that a typo ends in one line, not in a
run that would not finish. The model-size flags are bounded by :data:`workloads.models.LIMITS`."""
PRECISION_RANGE, SAME_WITHIN_RANGE = (0.001, 0.2), (0.001, 0.5)
"""The ranges of ``--precision`` and ``--same-within`` (relative)."""
TOKENS, VOCAB, LAYERS = (_number(int, 1, LIMITS[k], "a whole number") for k in ("tokens", "vocab", "layers"))
REPS = _number(int, 1, MAX_REPS, "a whole number")
ROUNDS = _number(int, 1, MAX_ROUNDS, "a whole number")
WARMUP = _number(int, 0, MAX_WARMUP, "a whole number")
SECONDS = _number(float, 1e-3, MAX_CELL_TIMEOUT_S, "a number of seconds")
PRECISION, SAME_WITHIN = (_number(float, *r, "a fraction") for r in (PRECISION_RANGE, SAME_WITHIN_RANGE))


def _out_dir(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a run directory, got ''")
    return Path(text)


def _shard(text: str) -> tuple[int, int]:
    try:
        return parse_shard(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="run_bench.py", description="Run a codabench suite: (op x model x mode x dtype x impl) cells, "
        "each checked against a float64 reference and timed; writes reports/<run>/. Other commands: "
        "'merge OUT SHARD_DIR...', 'compare RUN_A RUN_B', 'report RUN_DIR [--impl NAME]', "
        "'index [FOLDER] [--check]', 'history' (see 'history --help').")
    p.add_argument("--suite", choices=list(SUITES), help="default: smoke without a GPU, quick with one")
    p.add_argument("--ops", type=_csv, help="comma-separated op names (default: the suite's)")
    p.add_argument("--models", type=_csv, nargs="?", const=LIST_MODELS,
                   help="comma-separated model names: presets or models defined by --model/--model-config (default: "
                   "the suite's, or the defined models); alone, lists the presets with their shapes")
    p.add_argument("--model", action="append", default=[], metavar="NAME:hidden=H,ffn=F,heads=N,vocab=V[,...]",
                   help="define a model shape inline (repeatable); keys: " + ", ".join(INLINE_KEYS) +
                   " (kv_heads defaults to heads, head_dim to hidden/heads)")
    p.add_argument("--model-config", action="append", default=[], metavar="PATH",
                   help="define a model shape from a Hugging Face config.json (or its folder; repeatable)")
    p.add_argument("--modes", type=_csv, help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--dtypes", type=_csv, help=f"comma-separated: {', '.join(DTYPES)}")
    p.add_argument("--impls", type=_csv, help="comma-separated implementation names (default: all registered)")
    p.add_argument("--tokens", type=TOKENS, help=f"M, tokens per step, 1-{LIMITS['tokens']} (default: the preset's, "
                   "16384 for llama-*)")
    p.add_argument("--vocab", type=VOCAB, help=f"vocabulary size, 1-{LIMITS['vocab']} (default: the preset's, 32768 "
                   "for llama-*)")
    p.add_argument("--layers", type=LAYERS, help=f"decoder layers of the whole-model ops, e.g. train_step, "
                   f"1-{LIMITS['layers']} (default: the preset's, 4; tiny: 2)")
    p.add_argument("--checkpointing", action="store_true", help="activation (gradient) checkpointing in the "
                   "Hugging Face training steps (train_step's hf-* implementations)")
    p.add_argument("--check-tokens", type=TOKENS, help=f"tokens of the correctness pass, 1-{LIMITS['tokens']} "
                   "(default: the suite's, 2048 for full; else as timing)")
    p.add_argument("--out", type=_out_dir, help="run directory (default: reports/<suite>-<date>-<time>)")
    p.add_argument("--plugin", action="append", default=[], metavar="FILE",
                   help="python file registering implementations (repeatable)")
    p.add_argument("--no-entry-points", action="store_true",
                   help="do not load other installed packages' codabench.plugins entry points (the built-in "
                        "implementations always load)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (default: the newest reports/<suite>-*), skipping finished cells")
    p.add_argument("--list", action="store_true", help="print the cells and their status, run nothing")
    p.add_argument("--shard", type=_shard, metavar="I/N", help="run shard I of N (1-based; whole groups)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time fwd/direct cells as CUDA-graph replays over rotating input sets")
    p.add_argument("--warmup", type=WARMUP, default=TimingConfig.warmup,
                   help=f"warm-up calls before sampling, 0-{MAX_WARMUP} (default {TimingConfig.warmup})")
    p.add_argument("--reps", type=REPS, help=f"sweeps per group, 1-{MAX_REPS}: each cell of a group sampled exactly "
                   f"REPS times, interleaved (default: adaptive on the GPU, {TimingConfig.min_sweeps} or more until "
                   "--precision or the group's budget; 1 on the CPU)")
    p.add_argument("--rounds", type=ROUNDS,
                   help=f"rounds of the blocks fallback, 1-{MAX_ROUNDS} (a group whose inputs do not fit in memory "
                   "together: its cells take a block of samples each in turn, then its speed-of-light GEMMs; default: "
                   f"{GPU_ROUNDS} on the GPU, 1 on the CPU)")
    p.add_argument("--precision", type=PRECISION, default=TimingConfig.precision, metavar="FRACTION",
                   help="a group's sweeps stop once every ratio's 95%% interval is within +-FRACTION, "
                   f"{PRECISION_RANGE[0]:g}-{PRECISION_RANGE[1]:g} (default {TimingConfig.precision:g})")
    p.add_argument("--same-within", type=SAME_WITHIN, default=TimingConfig.same_within, metavar="FRACTION",
                   help="a ratio whose whole interval lies within +-FRACTION of 1 is called 'same', "
                   f"{SAME_WITHIN_RANGE[0]:g}-{SAME_WITHIN_RANGE[1]:g}, above --precision "
                   f"(default {TimingConfig.same_within:g})")
    p.add_argument("--no-l2-flush", action="store_true", help="keep L2 warm between samples (not the default)")
    p.add_argument("--fp8-accum", choices=("fast", "promoted"), default="fast",
                   help="fp8 tensor-core accumulation of every provider in fp8 cells: 'fast' (like "
                   "_scaled_mm's use_fast_accum=True, the default) or 'promoted' (fp32 promotion per K block)")
    p.add_argument("--cell-timeout", type=SECONDS, default=DEFAULT_CELL_TIMEOUT_S, metavar="SECONDS",
                   help="a cell's request to the worker process (correctness, checks and a timing round, or a later "
                   "round) that takes longer is stopped: the cell gets an error row and the run goes on in a new "
                   f"worker; up to {MAX_CELL_TIMEOUT_S:g} (default {DEFAULT_CELL_TIMEOUT_S:g}: room for cold "
                   "compiles, JIT builds and autotuning)")
    p.add_argument("--inline", action="store_true",
                   help="run the cells in this process instead of a worker process (for a debugger); a crash or a "
                   "hang of an implementation then ends the run")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--no-history", action="store_true",
                   help="do not append the finished run to the results history (codabench/history.py)")
    p.add_argument("--tune", action="store_true",
                   help=f"let implementations tune on the cells' data (autotuning; {TUNE_ENV}=1) what they have not "
                        "tuned yet, and keep it for later runs; by default they pick without measuring")
    p.add_argument("--profile", action="store_true",
                   help="after each group's samples, profile its timed cells (torch.profiler: GPU kernels, launches, "
                   "time and share, host vs GPU time) into profiles.jsonl and the report; never inside the timing")
    p.add_argument("--profile-trace", action="store_true",
                   help="--profile, and a Chrome trace of each profiled cell under RUN/traces/")
    return p


def _use_compile_cache(folder: Path) -> None:
    """torch.compile's caches (compiled graphs, CPU compiler probes) live beside the runs, so a second run does not
    pay the compile time again. A TORCHINDUCTOR_CACHE_DIR of the user's wins; torch's own default does not (importing
    torch._dynamo writes that default into the environment)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder.resolve())


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (:data:`EXIT_OK` ...)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            return _subcommand(argv[0], argv[1:])
        return _run(run_parser().parse_args(argv))
    except UsageError as e:
        print(f"codabench: {e}", file=sys.stderr)
        return EXIT_USAGE
    except _ParserExit as e:
        return e.code


def _defined_models(args: argparse.Namespace, notes: list[str]) -> dict[str, ModelShape]:
    """The shapes of ``--model`` and ``--model-config``, by name; what the ops leave out of a config.json's model is
    appended to ``notes``."""
    try:
        shapes = [parse_model_spec(s) for s in args.model] + [from_hf_config(p, notes) for p in args.model_config]
    except ValueError as e:
        raise UsageError(str(e)) from None
    out: dict[str, ModelShape] = {}
    for shape in shapes:
        if shape.name in out or shape.name in PRESETS:
            raise UsageError(f"model {shape.name!r} is defined twice (or is a preset's name)")
        out[shape.name] = shape
    return out


def _print_models(defined: dict[str, ModelShape]) -> int:
    """The presets' shapes, then those of the models defined by --model / --model-config."""
    print(f"{'model':12} {'hidden':>6} {'ffn':>6} {'heads':>5} {'kv':>3} {'dh':>4} {'vocab':>7} {'tokens':>6} "
          f"{'rope_theta':>10}")
    for m in [*PRESETS.values(), *defined.values()]:
        print(f"{m.name:12} {m.hidden:6} {m.ffn:6} {m.heads:5} {m.kv_heads:3} {m.head_dim:4} {m.vocab:7} "
              f"{m.tokens:6} {m.rope_theta:10g}" + ("  (defined)" if m.name in defined else ""))
    print("define others with --model NAME:hidden=...,ffn=...,heads=...,vocab=... or --model-config config.json")
    return EXIT_OK


def _model_notes(args: argparse.Namespace, defined: dict[str, ModelShape], device: torch.device) -> list[str]:
    """What a user who defined models should know: those ``--models`` leaves out, and on the CPU the token count
    the interpreter will run them at."""
    notes = []
    left_out = [n for n in defined if args.models and n not in args.models]
    if left_out:
        notes.append(f"--models {','.join(args.models)} leaves out the defined model(s) {', '.join(left_out)}: add "
                     "them to --models to run them")
    for name in [n for n in defined if n not in left_out] if device.type == "cpu" else []:
        m = defined[name]
        tokens = args.tokens or m.tokens
        notes.append(f"{name}: hidden {m.hidden}, {tokens} tokens on the CPU's Triton interpreter"
                     + (" (a cell may take many minutes; --tokens sets fewer)" if tokens * m.hidden > 1 << 16 else ""))
    return notes


def _run(args: argparse.Namespace) -> int:
    if not args.same_within > args.precision:
        raise UsageError(f"--same-within ({args.same_within:g}) must be larger than --precision ({args.precision:g}): "
                         "a difference the medians are not precise enough to show cannot count as real")
    if args.tune:  # the worker inherits it
        os.environ[TUNE_ENV] = "1"
    notes: list[str] = []
    defined = _defined_models(args, notes)
    if args.models == LIST_MODELS:
        return _print_models(defined)
    ranks = distributed.from_env()
    if ranks is not None and args.shard:
        raise UsageError("--shard and torchrun both split the cells among processes: give one of them")
    missing = [f for f in args.plugin if not Path(f).is_file()]
    if missing:
        raise UsageError(f"--plugin {missing[0]}: no such file")
    device = torch.device(select_device())
    notes += _model_notes(args, defined, device)
    suite = get_suite(args.suite or ("quick" if device.type == "cuda" else "smoke"))
    out = args.out or default_out(suite.name, args.resume, args.shard)
    if ranks is not None:  # torchrun: rank 0 names the run, each rank runs its shard on its GPU
        distributed.start(ranks)
        out = distributed.agree(out)
        args.shard, device = ranks.shard, ranks.device(device)
    run_dir = ranks.run_dir(out) if ranks is not None else out
    _use_compile_cache(out.parent / ".cache" / "torchinductor")
    sel = Selection.from_suite(suite, ops=args.ops, models=args.models or list(defined) or None, modes=args.modes,
                               dtypes=args.dtypes, impls=args.impls)
    cfg = run_config(args, suite, sel, device, run_dir, defined)
    kept = history.keep() if not (args.no_history or args.list) else None  # before any plugin code runs
    worker = WorkerProcess(cfg) if cfg.isolate and not args.list else None
    if worker is not None:
        worker.spawn()  # it imports torch, Triton and the plugins while this process does the same for the plan
    try:
        runner = _runner(args, cfg, worker)
    except UsageError:
        if worker is not None:
            worker.close()
        raise
    for note in ([INTERPRETER_NOTE] if device.type == "cpu" else []) + notes:  # once the flags hold
        print(f"codabench: {note}", file=sys.stderr)
    if args.list:
        return _list(runner, run_dir if args.resume else None)
    if runner.cells:
        code = _execute(runner, suite.name, kept if ranks is None else None)
    else:  # torchrun with more ranks than groups: this rank's shard is empty
        if worker is not None:
            worker.close()
        code = EXIT_OK
    if ranks is None:
        return code
    dirs, code = distributed.collect(ranks, run_dir, code, out)
    if ranks.rank == 0:
        if (out / "env.json").exists() and "merged_from" in load_run(out)[2]:  # --resume: the last merge goes
            shutil.rmtree(out)
        merge(out, [d for d in dirs if (d / "results.csv").exists()])
        print(f"codabench: {ranks.world} ranks merged into {out}", file=sys.stderr)
        code = max(code, _summary(out, code))
        if kept is not None:
            _to_history(out, code, kept)
    return distributed.finish(ranks, code)


def _execute(runner: Runner, suite: str, kept: history.Kept | None) -> int:
    """Run the cells and write the report; with ``kept`` (the history store as the run found it) a finished run (exit
    code 0 or 1) is appended to the results history. The exit code."""
    out = runner.cfg.out_dir
    try:
        lock = RunLock(out)  # held over the run and its report: a second writer is refused before any cell runs
    except RunFolderError as e:
        if runner.worker is not None:
            runner.worker.close()
        raise UsageError(str(e)) from None
    print(f"codabench: {suite} suite, {len(runner.cells)} cells -> {out}", file=sys.stderr)
    code = EXIT_OK
    # Ctrl-C must raise KeyboardInterrupt here even if a plugin's import changed SIGINT's handler (seen on a GPU
    # machine: the run died of the signal, without its report)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)  # as Ctrl-C: the worker stopped, the report written
    with lock:
        try:
            runner.run()
        except RunFolderError as e:
            raise UsageError(str(e)) from None
        except DeviceLost as e:
            print(f"codabench: {e}", file=sys.stderr)
            code = EXIT_DEVICE_LOST
        except KeyboardInterrupt as e:
            print(f"codabench: {'terminated (SIGTERM)' if isinstance(e, Terminated) else 'interrupted'}; finished "
                  "cells are saved, rerun with --resume to go on", file=sys.stderr)
            code = EXIT_INTERRUPTED
        try:
            finalize(out)
            code = _summary(out, code)
            if kept is not None:
                _to_history(out, code, kept)
            return code
        except KeyboardInterrupt:
            print(f"codabench: interrupted again while the report was written; the measured rows are saved in {out} "
                  f"(python -m codabench report {out} writes the report)", file=sys.stderr)
            return EXIT_INTERRUPTED


def _to_history(out: Path, code: int, kept: history.Kept) -> None:
    """A finished run (exit code 0 or 1; not one cut short by Ctrl-C or a lost device) is appended to the results
    history, the earlier runs changed meanwhile put back first (``kept``); a store that cannot take it costs one
    warning line, never the run (:func:`codabench.history.record_run`)."""
    if code in (EXIT_OK, EXIT_CELL_ERRORS):
        record_run(out, kept)


def _summary(out: Path, code: int) -> int:
    """Print the counts of a written run and where its report is; the exit code (1 when cells failed)."""
    df, _, _ = load_run(out)
    counts = ", ".join(f"{v} {k}" for k, v in df["status"].value_counts().items())
    failing = int(((df["status"] != "error") & (df["correct"] == False)).sum())  # noqa: E712 (measured, wrong)
    failed = failing or bool((df["status"] == "error").any())
    fails = f"; of the ok, {failing} fail{'s' if failing == 1 else ''} the error rule" if failing else ""
    print(f"codabench: {counts}{fails}" +
          (f" (exit code {EXIT_CELL_ERRORS})" if failed and code == EXIT_OK else "") +
          f"\ncodabench: report {out / 'report.html'}\ncodabench: table  {out / 'results.csv'}")
    return EXIT_CELL_ERRORS if failed and code == EXIT_OK else code


def _runner(args: argparse.Namespace, cfg: RunConfig, worker: WorkerProcess | None) -> Runner:
    """The plan of the run, after the checks that need the registry (names, an empty selection, the device, --out)."""
    # with a worker, each plugin is imported here only once the worker imported it in time (a hang is vetoed there)
    registry = discover(args.plugin, entry_points=not args.no_entry_points,
                        gate=worker.import_verdict if worker is not None else None)
    if args.ops is None:  # the suite's ops as the catalogue holds them now: the plugins' own ops too
        cfg.selection.ops = get_suite(cfg.suite).op_names()
    _check_names(cfg.selection, registry, cfg.models)
    runner = Runner(cfg, registry, worker)
    if not args.list:  # the listing names the plugins that failed to load among its rows
        for source, err in registry.load_errors:
            print(f"codabench: plugin {source} failed to load: {err}", file=sys.stderr)
    if not build_cells(cfg.selection, registry):  # the whole selection: a rank's or shard's part may be empty
        modes = "; ".join(f"{op}: {','.join(OPS[op].modes)}" for op in cfg.selection.ops if op in OPS)
        raise UsageError(f"the selection has no cells: {_selection_text(cfg.selection)} (--impls from: "
                         + ", ".join(registry.names()) + f"; the ops' modes: {modes})")
    suite = get_suite(cfg.suite)
    if (suite.needs_gpu and cfg.device.type != "cuda" and not ((args.models or cfg.models) and args.dtypes)
            and not args.list):  # a GPU suite's cells may be listed anywhere
        raise UsageError(f"suite {suite.name!r} needs a CUDA GPU (use --suite smoke, or give --models and --dtypes to "
                         "run a custom slice on the CPU)")
    if not args.list:
        _check_out(cfg.out_dir, args.resume, cfg.suite)
    elif args.resume:  # what the run would refuse, read only: --list writes nothing
        try:
            check_run_dir(cfg.out_dir, True, cfg.suite)
        except RunFolderError as e:
            raise UsageError(f"--out {e}") from None
    if args.resume:
        conflicts = cfg.resume_conflicts(read_env(cfg.out_dir))
        if conflicts:
            raise UsageError(f"--resume: {cfg.out_dir} was measured otherwise ({'; '.join(conflicts[:4])}): give the "
                             "flags it ran with, or another --out")
    return runner


def _selection_text(sel: Selection) -> str:
    return "; ".join(f"{k} {','.join(v)}" for k, v in (("ops", sel.ops), ("models", sel.models), ("modes", sel.modes),
                                                       ("dtypes", sel.dtypes), ("impls", sel.impls or ("all",))))


def _check_out(out: Path, resume: bool, suite: str) -> None:
    """The run directory must not be a folder of other things (the current directory, the repository, the home
    directory, /), must take the run (:func:`codabench.writer.check_run_dir`: new, empty, or this suite's run for
    --resume) and be a directory this process can create and write into."""
    where = out.resolve()
    for place, what in ((Path.cwd(), "the current directory"), (REPO_ROOT, "the repository's root"),
                        (Path.home(), "the home directory"), (Path(where.anchor), "the file system's root")):
        if where == place.resolve():
            raise UsageError(f"--out {out}: is {what}; name a run directory of its own (e.g. reports/NAME)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a directory")
    try:
        notes = check_run_dir(out, resume, suite)
    except RunFolderError as e:
        raise UsageError(f"--out {e}") from None
    for note in notes:
        print(f"codabench: note: {note}", file=sys.stderr)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".codabench-write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    if resume and not (out / "results.csv").exists():
        print(f"codabench: --resume: {out} holds no results yet; starting the run there", file=sys.stderr)


def run_config(args: argparse.Namespace, suite: Suite, sel: Selection, device: torch.device, out: Path,
               models: dict[str, ModelShape] | None = None) -> RunConfig:
    """The runner's settings from the flags; flags left out take the suite's defaults, then the device's."""
    return RunConfig(out_dir=out, selection=sel, device=device, suite=suite.name, tokens=args.tokens,
                     vocab=args.vocab, layers=args.layers, models=models or {}, checkpointing=args.checkpointing,
                     check_tokens=args.check_tokens or suite.check_tokens,
                     cuda_graph=args.cuda_graph, resume=args.resume, shard=args.shard,
                     show_progress=not args.quiet, fp8_accum=args.fp8_accum, cell_timeout_s=args.cell_timeout,
                     isolate=not args.inline, plugin_files=tuple(str(Path(f).resolve()) for f in args.plugin),
                     entry_points=not args.no_entry_points,
                     profile=args.profile or args.profile_trace, profile_trace=args.profile_trace,
                     timing=TimingConfig(warmup=args.warmup, reps=args.reps or suite.reps,
                                         flush_l2=not args.no_l2_flush,
                                         rounds=args.rounds or (GPU_ROUNDS if device.type == "cuda" else 1),
                                         precision=args.precision, same_within=args.same_within))


def _check_names(sel: Selection, registry, defined: dict[str, ModelShape]) -> None:
    """Every name of the selection is known; an unknown op or implementation names the plugins that failed to load
    (the name may be theirs)."""
    failed = "".join(f"; plugin {source} failed to load: {err}" for source, err in registry.load_errors)
    for kind, given, known in (("op", sel.ops, OPS), ("model", sel.models, [*PRESETS, *defined]),
                               ("mode", sel.modes, MODES),
                               ("dtype", sel.dtypes, DTYPES), ("implementation", sel.impls or (), registry.names())):
        bad = [g for g in given if g not in known]
        if bad:
            raise UsageError(f"unknown {kind}(s) {', '.join(bad)}; known: {', '.join(known)}"
                             + (failed if kind in ("op", "implementation") else ""))


def default_out(suite: str, resume: bool = False, shard: tuple[int, int] | None = None) -> Path:
    """The run directory of a run without ``--out``: ``reports/<suite>-<date>-<time>[-shardIofN]``; with ``--resume``
    the newest such directory that holds results and its marker."""
    tail = f"-shard{shard[0]}of{shard[1]}" if shard else ""
    if resume:
        runs = sorted(p for p in REPORTS.glob(f"{suite}-*{tail}")
                      if (p / "results.csv").exists() and (p / MARKER).exists())
        if runs:
            return runs[-1]
    return REPORTS / f"{suite}-{datetime.datetime.now():%Y%m%d-%H%M%S}{tail}"


def _list(runner: Runner, resume_dir: Path | None) -> int:
    done = {}
    if resume_dir is not None and (resume_dir / "results.csv").exists():
        df, _, _ = load_run(resume_dir)
        done = {tuple(r[k] for k in KEY): r["status"] for _, r in df.iterrows()}
    counts: dict[str, int] = {}
    for cell, status in runner.plan():
        shown = f"done ({done[cell.key]})" if cell.key in done else ("to run" if status == "run" else status)
        counts[shown.split(":")[0]] = counts.get(shown.split(":")[0], 0) + 1
        print(f"{cell.op:16} {cell.model:10} {cell.mode:8} {cell.dtype:7} {cell.impl:18} {shown}")
    for source, err in runner.registry.load_errors:
        print(f"plugin {source} failed to load: {err}")
    print(f"{len(runner.cells)} cells: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return EXIT_CELL_ERRORS if runner.registry.load_errors else EXIT_OK  # as the run would: its load errors are rows


def run_dir_arg(text: str) -> Path:
    """A run directory given to report/compare/merge: it must read as a run (:func:`codabench.results.check_run`)
    with at least one row; what it tolerates (a cut-off last line) is printed as a note."""
    path = Path(text)
    try:
        notes = check_run(path)
    except RunFolderError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    for note in notes:
        print(f"codabench: note: {note}", file=sys.stderr)
    return path


def _subcommand(name: str, argv: list[str]) -> int:
    """merge, compare, report, index or history; a run directory in use by a run, or Ctrl-C, ends it with one line."""
    try:
        return _run_subcommand(name, argv)
    except RunFolderError as e:
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:
        print(f"codabench {name}: interrupted; the files it wrote are whole (old or new)", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run_subcommand(name: str, argv: list[str]) -> int:
    if name == "history":
        from codabench.report.history import main as history  # it builds on this module's parser

        return history(argv)
    p = OneLineParser(prog=f"codabench {name}")
    if name == "merge":
        p.add_argument("out", type=Path, help="new run directory for the merged report (must not exist)")
        p.add_argument("shards", type=run_dir_arg, nargs="+", help="the shards' run directories")
        a = p.parse_args(argv)
        if a.out.exists() and (not a.out.is_dir() or any(a.out.iterdir())):
            raise UsageError(f"merge: {a.out} exists and is not empty; merge into a new directory")
        print(f"codabench: merged report {merge(a.out, a.shards) / 'report.html'}")
        record_run(a.out)
    elif name == "compare":
        p.add_argument("run_a", type=run_dir_arg)
        p.add_argument("run_b", type=run_dir_arg)
        p.add_argument("--csv", type=Path, help="also write the joined table here")
        a = p.parse_args(argv)
        m = compare(a.run_a, a.run_b)
        print(format_compare(m))
        if a.csv:
            write_atomic(a.csv, m.to_csv(index=False))
    elif name == "index":
        p.add_argument("folder", type=Path, nargs="?", default=REPO_ROOT / "reports",
                       help="the folder of committed reports (default: the repository's reports/); its README.md "
                            "is written, and the results block of the README.md beside it where that file holds the "
                            "markers <!-- results:begin --> and <!-- results:end -->")
        p.add_argument("--check", action="store_true", help="write nothing; exit 1 if either file is stale")
        a = p.parse_args(argv)
        if not a.folder.is_dir():
            raise UsageError(f"index: {a.folder}: no such directory")
        stale = build_index(a.folder, a.check)
        for path in stale:
            print(f"codabench index: {'stale' if a.check else 'wrote'} {path}", file=sys.stderr if a.check else None)
        if a.check and stale:
            print("codabench index: run 'python -m codabench index' and commit the result", file=sys.stderr)
            return EXIT_STALE
    else:
        p.add_argument("run_dir", type=run_dir_arg)
        p.add_argument("--impl", help="the implementation whose verdicts the first screen counts (default: "
                       "coda-triton where the run has it)")
        a = p.parse_args(argv)
        impls = sorted(set(load_run(a.run_dir)[0]["impl"]))
        if a.impl is not None and a.impl not in impls:
            raise UsageError(f"report: --impl {a.impl}: no such implementation in {a.run_dir} (it has: "
                             f"{', '.join(impls)})")
        print(f"codabench: report {finalize(a.run_dir, a.impl)}")
    return EXIT_OK
