"""Resolving power: can the suite tell a GEMM from the same GEMM plus 1%, 2% or 5% more GPU work, and call 0% same?

Runs the suite itself (``run_bench.py`` through :func:`codabench.cli.main`, default settings unless flags say
otherwise) on the plain GEMM op ``gemm_out`` with the implementations of ``benchmarks/planted.py``: ``gemm-ref`` and
``gemm-plant-P`` (the same GEMM followed by a spin kernel calibrated by measurement to P% of the GEMM's time). Each
try is its own group (a model shape defined inline, identical for every try), so the cells of a try are sampled
together, in interleaved sweeps, exactly as the suite samples any group. For each planted share it counts the
verdicts of ``gemm-plant-P`` against ``gemm-ref`` (:func:`codabench.stats.ratio`, paired, the run's ``--same-within``)
over the tries, with the median ratio and half-width, and checks the targets: planted 2% called ``slower`` in at
least 9 of 10 tries, planted 0% called ``same`` in at least 19 of 20 and ``faster``/``slower`` at most once.

    python benchmarks/resolving_power.py --tries 20 --out reports/<gpu>-<date>-resolving-power

Prints the table and writes ``resolving_power.json``, ``resolving_power.txt`` and the run's headline for
``python -m codabench index`` (``headline.txt``: the verdicts per planted share) beside the run. Exit code 0 when
the targets are met (or cannot be judged: the CPU), 1 when one is missed, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codabench.bootstrap import select_device  # noqa: E402

select_device()

from codabench import stats  # noqa: E402
from codabench.cli import OneLineParser, main as run_bench  # noqa: E402
from codabench.report.index import HEADLINE  # noqa: E402
from codabench.results import load_run  # noqa: E402

PLUGIN = ROOT / "benchmarks" / "planted.py"
PLANTED = (0, 1, 2, 5)
SHAPE = "hidden=4096,ffn=11008,heads=32,vocab=32000"
"""A 7B-class out projection: (16384 x 4096) x (4096 x 4096), about 0.8 ms in bf16 on an H100."""


def parse(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="resolving_power.py", description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=20, help="groups (tries) per planted share (default 20)")
    p.add_argument("--out", type=Path, required=True, help="run directory (must not exist)")
    p.add_argument("--shape", default=SHAPE, help=f"the model shape of every try (default {SHAPE})")
    p.add_argument("--tokens", type=int, help="tokens (default: the harness's)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("bench_args", nargs="*", help="more run_bench.py flags, after --")
    a = p.parse_args(argv)
    if not 1 <= a.tries <= 200:
        p.error(f"--tries: expected 1-200, got {a.tries}")
    if a.out.exists():
        p.error(f"--out {a.out}: exists; give a new directory")
    return a


def summarize(run_dir: Path) -> dict:
    """Per planted share: the verdicts of gemm-plant-P against gemm-ref over the tries, the ratios and half-widths."""
    df, _, env = load_run(run_dir)
    timed = stats.read_timed(run_dir, env)
    _, same_within = stats.timing_settings(env)
    out = {"gpu": (env.get("gpu") or {}).get("name", env.get("device")), "same_within": same_within,
           "wall_s": env.get("wall_s"), "planted": {}}
    tries = sorted(set(df["model"]))
    for pct in PLANTED:
        verdicts, ratios, widths, sweeps = [], [], [], []
        for model in tries:
            key = ("gemm_out", model, "fwd")
            ref = next((t for k, t in timed.items() if k[:3] == key and k[4] == "gemm-ref"), None)
            cell = next((t for k, t in timed.items() if k[:3] == key and k[4] == f"gemm-plant-{pct}"), None)
            r = stats.ratio(ref, cell, paired=True) if ref is not None and cell is not None else None
            verdicts.append(r.verdict(same_within) if r is not None else "n/a")
            if r is not None:
                ratios.append(1 / r.value)  # planted time over the reference's: 1.02 for 2% more work
                widths.append(r.half_width)
                sweeps.append(cell.n)
        out["planted"][pct] = {
            "tries": len(tries), "verdicts": {v: verdicts.count(v) for v in sorted(set(verdicts))},
            "median_time_ratio": statistics.median(ratios) if ratios else None,
            "median_half_width": statistics.median(widths) if widths else None,
            "median_sweeps": statistics.median(sweeps) if sweeps else None}
    out["targets"] = targets(out["planted"])
    return out


def targets(planted: dict) -> dict[str, bool | None]:
    """The issue's targets, None where no try has an interval (CPU wall times)."""
    def count(pct: int, verdict: str) -> int:
        return planted[pct]["verdicts"].get(verdict, 0)

    n0, n2 = planted[0]["tries"], planted[2]["tries"]
    if count(0, "n/a") == n0:
        return {"2% slower in >= 90%": None, "0% same in >= 95%, decided otherwise at most once": None}
    return {"2% slower in >= 90%": count(2, "slower") >= 0.9 * n2,
            "0% same in >= 95%, decided otherwise at most once": count(0, "same") >= 0.95 * n0 and
            count(0, "faster") + count(0, "slower") <= 1}


def table(summary: dict) -> str:
    lines = [f"resolving power on {summary['gpu']} (same within +-{summary['same_within']:.1%}, "
             f"{summary['wall_s'] or 0:.0f} s)",
             f"{'planted':>8} {'tries':>5} {'faster':>6} {'same':>5} {'slower':>6} {'unres.':>6} {'n/a':>4} "
             f"{'time ratio':>10} {'half-width':>10} {'sweeps':>6}"]
    for pct, s in summary["planted"].items():
        v = s["verdicts"]
        fmt = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
        lines.append(f"{pct:>7}% {s['tries']:>5} {v.get('faster', 0):>6} {v.get('same', 0):>5} {v.get('slower', 0):>6} "
                     f"{v.get('unresolved', 0):>6} {v.get('n/a', 0):>4} {fmt(s['median_time_ratio'], '.4f'):>10} "
                     f"{fmt(s['median_half_width'], '.2%'):>10} {fmt(s['median_sweeps'], '.0f'):>6}")
    for name, ok in summary["targets"].items():
        lines.append(f"target {name}: {'met' if ok else 'MISSED' if ok is False else 'not judged (no intervals)'}")
    return "\n".join(lines)


def headline(summary: dict) -> str:
    """One line: per planted share, the verdicts of gemm-plant-P against gemm-ref over the tries; the median
    half-width; the targets."""
    shares = []
    for pct, s in summary["planted"].items():
        v = ", ".join(f"{n} {k}" for k, n in sorted(s["verdicts"].items(), key=lambda kv: -kv[1]))
        shares.append(f"{pct}%: {v}")
    widths = [s["median_half_width"] for s in summary["planted"].values() if s["median_half_width"] is not None]
    tries = max((s["tries"] for s in summary["planted"].values()), default=0)
    met = [ok for ok in summary["targets"].values()]
    verdict = ("targets met" if met and all(met) else "a target MISSED" if any(ok is False for ok in met)
               else "targets not judged")
    width = f"; median half-width {statistics.median(widths):.1%}" if widths else ""
    return f"resolving power, planted work against gemm-ref over {tries} tries: {'; '.join(shares)}{width}; {verdict}"


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    models = [f"rp{i:02d}:{a.shape}" for i in range(a.tries)]
    flags = ["--ops", "gemm_out", "--dtypes", a.dtype, "--impls",
             ",".join(["gemm-ref"] + [f"gemm-plant-{p}" for p in PLANTED]), "--plugin", str(PLUGIN),
             "--no-entry-points", "--out", str(a.out), "--quiet"]
    flags += [x for m in models for x in ("--model", m)] + (["--tokens", str(a.tokens)] if a.tokens else [])
    code = run_bench(flags + a.bench_args)
    if not (a.out / "results.csv").exists():
        print(f"resolving_power: the run wrote no results (exit code {code})", file=sys.stderr)
        return 2
    summary = summarize(a.out)
    text = table(summary)
    print(text)
    (a.out / "resolving_power.json").write_text(json.dumps(summary, indent=1, default=str))
    (a.out / "resolving_power.txt").write_text(text + "\n")
    (a.out / HEADLINE).write_text(headline(summary) + "\n")
    return 1 if any(ok is False for ok in summary["targets"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
