"""The CODA kernels one by one: the harness's ``kernels`` suite, then a compact table of its results.

    python benchmarks/bench_coda.py [--models llama-1b,llama-7b,llama-70b] [--tokens 16384]
                                    [--kernels producer_out,...] [--no-compile] [run_bench.py flags]

This runs ``run_bench.py --suite kernels`` (:func:`codabench.cli.main`): each CODA kernel's host call alone
(``coda-triton``; the ops of ``workloads.suites.KERNEL_SUITE_OPS``, forward then backward) per model, in bf16, beside
the unfused PyTorch math eager (``torch-eager``) and compiled (``torch-compile``), with everything a cell of the
harness gets: the check against float64 and the pass rule (:mod:`codabench.metrics`), the checks of the timed
buffers, timing rounds in which the cells and the plain cuBLAS GEMMs of their shape take turns, and the report
(``reports/kernels-<date>-<time>/``). Then it prints, per model and op, from the run's ``results.csv``:

- ``ms``: coda-triton's median time;
- ``GEMM ms`` and ``fused/GEMM``: the plain cuBLAS GEMMs of the kernel's shape (``op.forward_gemms``) and the
  kernel's time over theirs, ``sol_ratio`` (blank for the elementwise kernels, which have none);
- ``vs eager``, ``vs compile``: the unfused math's median over the kernel's, with its 95% interval
  (:func:`codabench.stats.ratio`; none for CPU wall times);
- ``err x torch``: the worst output's error over PyTorch's own, and ``pass`` or ``FAIL`` by the pass rule.

Flags: ``--kernels`` names the ops (``--ops``), ``--no-compile`` leaves torch-compile out (``--impls
torch-eager,coda-triton``: no compiling, and no ``vs compile``), ``--models`` and ``--tokens`` go to the run as they
are, and so does any other flag of run_bench.py (``--reps``, ``--rounds``, ``--check-tokens``, ``--out``, ``--resume``,
``--plugin``, ``--impls``, ``--dtypes`` ...). Without a GPU the suite runs on the CPU with the Triton interpreter
when given models and dtypes (``--models tiny --dtypes fp32``). The whole model on the CODA kernels is checked by the
``train`` suite (``hf-coda``) and ``tests/test_hf.py``. The exit code is the run's (:data:`codabench.cli.EXIT_OK`
...).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, also without pip install -e .

from codabench.bootstrap import select_device  # noqa: E402

select_device()  # before anything imports triton: TRITON_INTERPRET=1 when there is no GPU

from codabench import cli  # noqa: E402
from codabench.eager import TorchCompile, TorchEager  # noqa: E402
from codabench.results import KEY, load_run  # noqa: E402
from codabench.stats import Ratio, Timed, ratio, read_timed  # noqa: E402
from workloads.suites import KERNEL_SUITE_OPS  # noqa: E402

SUITE = "kernels"
BASELINES = (TorchEager.name, TorchCompile.name)
"""The unfused PyTorch math, eager and compiled: the table's speedup references, not rows of their own."""
NO_COMPILE_IMPLS = "torch-eager,coda-triton"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """bench_coda's own flags, and the rest for run_bench.py."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", help="comma-separated models (default: the suite's, llama-1b,llama-7b,llama-70b)")
    p.add_argument("--tokens", help="M, tokens per step (default: the preset's, 16384 for llama-*)")
    p.add_argument("--kernels", help="comma-separated ops of the suite (default: all of workloads.suites."
                   "KERNEL_SUITE_OPS)")
    p.add_argument("--no-compile", action="store_true", help="leave torch-compile out (no compiling)")
    p.add_argument("--out", type=Path, help="run directory (default: reports/kernels-<date>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out (default: the newest)")
    return p.parse_known_args(argv)


def run_argv(args: argparse.Namespace, out: Path, rest: list[str]) -> list[str]:
    """The run_bench.py command line of the run (``rest`` last: a flag given there wins)."""
    argv = ["--suite", SUITE, "--out", str(out)]
    for flag, value in (("--models", args.models), ("--tokens", args.tokens), ("--ops", args.kernels),
                        ("--impls", NO_COMPILE_IMPLS if args.no_compile else None)):
        if value:
            argv += [flag, value]
    return argv + (["--resume"] if args.resume else []) + rest


def _fmt(v: float | None, width: int, spec: str) -> str:
    return f"{'-' if v is None or v != v else format(v, spec):>{width}}"


def _interval(r: Ratio | None, point: float | None) -> str:
    if point is None:
        return "-"
    return f"{point:.2f}x" + (f" [{r.lo:.2f}, {r.hi:.2f}]" if r is not None else "")


def table(run_dir: Path) -> list[str]:
    """The lines of the table: one per (model, op, implementation other than the baselines); model by model (by
    size), the ops in the suite's order."""
    df, _, env = load_run(run_dir)
    samples = read_timed(run_dir, env)
    models = list(dict.fromkeys(df["model"]))
    ops = [*KERNEL_SUITE_OPS, *(o for o in dict.fromkeys(df["op"]) if o not in KERNEL_SUITE_OPS)]
    df = df.iloc[sorted(range(len(df)), key=lambda i: (models.index(df["model"].iat[i]), ops.index(df["op"].iat[i])))]

    def timed(row) -> Timed:
        key = tuple(str(row[k]) for k in KEY)
        return samples.get(key) or Timed([], [], str(row["timing"]), "|".join(key))

    head = (f"{'model':10} {'op':18} {'dtype':5} {'impl':14} {'ms':>9} {'GEMM ms':>9} {'fused/GEMM':>10} "
            f"{'vs eager':>19} {'vs compile':>19} {'err x torch':>11}")
    lines = [head]
    for (op, model, _, dtype), group in df.groupby(["op", "model", "mode", "dtype"], sort=False):
        ok = {r["impl"]: r for _, r in group.iterrows() if r["status"] == "ok"}
        for _, row in group.iterrows():
            if row["impl"] in BASELINES:
                continue
            name = f"{model:10} {op:18} {dtype:5} {row['impl']:14}"
            if row["status"] != "ok":
                msg = row["message"]
                msg = msg if msg.startswith(row["status"]) else f"{row['status']}: {msg}"
                lines.append(f"{name} {msg[:120]}")
                continue
            vs = []
            for base in BASELINES:
                ref = ok.get(base)
                point = ref["median_ms"] / row["median_ms"] if ref is not None else None
                vs.append(_interval(ratio(timed(ref), timed(row), True, point) if ref is not None else None, point))
            verdict = {True: "pass", False: "FAIL"}.get(row["correct"], "?")
            lines.append(f"{name} {row['median_ms']:9.4f} {_fmt(row['sol_ms'], 9, '.4f')} "
                         f"{_fmt(row['sol_ratio'], 10, '.3f')} {vs[0]:>19} {vs[1]:>19} "
                         f"{_fmt(row['err_ratio'], 6, '.2f')} {verdict}")
    if (df["timing"] == "cpu-wall").any():
        lines.append("(cpu-wall: CPU wall times of the Triton interpreter, not performance figures)")
    return lines


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out or cli.default_out(SUITE, args.resume)
    code = cli.main(run_argv(args, out, rest))
    if (out / "results.csv").exists():
        print(f"\n{SUITE} suite, {out}: each kernel against the plain cuBLAS GEMMs of its shape and the unfused "
              "PyTorch math (speedups > 1: the kernel is faster)")
        print("\n".join(table(out)))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
