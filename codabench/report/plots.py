"""PNG plots of a run: one figure per (metric, dtype), one panel per op, x = model size; and the run's GPU clock trace.

Metrics: latency (median, whiskers p20-p80), speedup vs torch-compile (bars: its 95% interval), worst relative
error, fused time / plain GEMM time (``sol_ratio``), % of the measured GEMM ceiling and the peak memory of a call.
Every implementation keeps its colour across the figures (:mod:`codabench.report.palette`); the points of one model
size are spread sideways so that equal values do not hide each other. A CPU run (wall times of the Triton
interpreter) gets no speed figures: its latency plot says what its times are.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from PIL import Image  # noqa: E402

from codabench.clocks import CLOCK_DIP, run_clock_mhz  # noqa: E402
from codabench.report.palette import impl_colors, impl_order  # noqa: E402
from codabench.results import write_atomic  # noqa: E402
from codabench.timing import CPU_WALL  # noqa: E402
from workloads.models import PRESETS  # noqa: E402


@dataclass(frozen=True)
class Metric:
    column: str
    title: str
    ylabel: str
    log: bool
    ref_line: float | None = None
    needs_perf: bool = True
    """Only meaningful for GPU timings: not drawn for a CPU run."""
    bounds: tuple[str, str] | None = None
    """Columns of the whiskers (low, high)."""
    min_span: tuple[float, float] | None = None
    """The y range shown at least (a ratio axis must not blow 1% of noise up to the full height)."""


METRICS = [
    Metric("median_ms", "Latency", "median ms (p20-p80)", log=True, needs_perf=False, bounds=("p20_ms", "p80_ms")),
    Metric("speedup", "Speedup vs torch-compile", "x (higher is faster), 95% interval", log=False, ref_line=1.0,
           bounds=("speedup_lo", "speedup_hi"), min_span=(0.9, 1.1)),
    Metric("rel_err", "Worst relative error vs float64", "relative Frobenius error", log=True, needs_perf=False),
    Metric("sol_ratio", "Fused time / plain GEMM time", "median / sum of cuBLAS GEMMs", log=False, ref_line=1.0,
           min_span=(0.9, 1.1)),
    Metric("pct_ceiling", "% of the measured GEMM ceiling", "% of ceiling TFLOP/s", log=False, ref_line=100.0,
           min_span=(0.0, 100.0)),
    Metric("peak_mem_mib", "Peak memory of a call above its inputs", "MiB", log=True),
]
MODE_MARKERS = {"fwd": "o", "bwd": "s", "fwd_bwd": "^"}
DODGE = 0.6
"""Width, in model slots, over which the points of one model size are spread."""
LOG_MIN_SPAN = 2.0
"""The least ratio of the top to the bottom of a log axis."""


def _model_order(name: str) -> tuple[int, str]:
    p = PRESETS.get(name)
    return (p.hidden if p else 0, name)


def make_plots(df: pd.DataFrame, out_dir: Path, env: dict[str, Any] | None = None) -> list[tuple[str, Path]]:
    """Write the PNGs, each replacing its earlier version whole (the PNGs of an earlier report that this one does
    not draw are removed last); returns (title, path) for each figure drawn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = df[df["status"] == "ok"]
    cpu_only = not ok.empty and (ok["timing"] == CPU_WALL).all()
    colors = impl_colors(df["impl"])
    made = []
    for dtype in sorted(ok["dtype"].unique()):
        sub = ok[ok["dtype"] == dtype]
        for metric in METRICS:
            if cpu_only and metric.needs_perf:
                continue
            data = sub[pd.to_numeric(sub[metric.column], errors="coerce") > 0]
            if data.empty:
                continue
            title = f"{metric.title}, {dtype}" + (" (CPU wall time: not a performance figure)"
                                                  if cpu_only and metric.column == "median_ms" else "")
            path = out_dir / f"{metric.column}_{dtype}.png"
            _panel_figure(data, metric, title, path, colors)
            made.append((title, path))
    trace = (env or {}).get("clock_trace") or []
    if trace:
        path = out_dir / "clock_trace.png"
        title = "GPU during the kept samples: SM clock, power, temperature"
        _trace_figure(trace, run_clock_mhz(df), title, path)
        made.append((title, path))
    for old in set(out_dir.glob("*.png")) - {p for _, p in made}:
        old.unlink()
    return made


def _panel_figure(data: pd.DataFrame, metric: Metric, title: str, path: Path, colors: dict[str, str]) -> None:
    """One panel per op; x = model size; colour = implementation, marker = mode; whiskers where the metric has
    bounds."""
    panels = list(dict.fromkeys(data["op"]))
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    impls = impl_order(data["impl"])
    modes = [m for m in MODE_MARKERS if m in set(data["mode"])] + sorted(set(data["mode"]) - set(MODE_MARKERS))
    width = 3.6 * ncols
    legend_cols = min(10, len(impls) + len(modes), max(2, int(width / 1.3)))
    legend_rows = math.ceil((len(impls) + len(modes)) / legend_cols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 2.6 * nrows + 0.7 + 0.2 * legend_rows), squeeze=False)
    models = sorted(data["model"].unique(), key=_model_order)
    for ax, op in zip(axes.flat, panels):
        sel = data[data["op"] == op]
        present = set(zip(sel["impl"], sel["mode"]))
        series = [(i, m) for i in impls for m in modes if (i, m) in present]
        offset = {s: (k - (len(series) - 1) / 2) * DODGE / len(series) for k, s in enumerate(series)}
        for (impl, mode), rows in sel.groupby(["impl", "mode"]):
            rows = rows.assign(x=rows["model"].map(models.index)).sort_values("x")
            x = rows["x"] + offset[(impl, mode)]
            y = pd.to_numeric(rows[metric.column])
            style = dict(marker=MODE_MARKERS.get(mode, "D"), ms=4, color=colors[impl], lw=0.9)
            if metric.bounds:
                lo, hi = (pd.to_numeric(rows[c], errors="coerce") for c in metric.bounds)
                err = np.array([(y - lo).clip(lower=0).fillna(0), (hi - y).clip(lower=0).fillna(0)])
                ax.errorbar(x, y, yerr=err, capsize=2, elinewidth=0.8, **style)
            else:
                ax.plot(x, y, **style)
        if metric.ref_line is not None:
            ax.axhline(metric.ref_line, color="grey", lw=0.8, ls="--")
        if metric.min_span:
            low, high = ax.get_ylim()
            ax.set_ylim(min(low, metric.min_span[0]), max(high, metric.min_span[1]))
        if metric.log:
            ax.set_yscale("log")
            _log_ticks(ax)
        ax.set_xticks(range(len(models)), models, fontsize=7)
        ax.set_xlim(-0.5, len(models) - 0.5)
        ax.set_title(op, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_ylabel(metric.ylabel, fontsize=7)
        ax.grid(axis="y", color="#e6e6e6", lw=0.6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colors[i], marker="o", label=i) for i in impls]
    handles += [plt.Line2D([], [], color="black", ls="", marker=MODE_MARKERS.get(m, "D"), label=m) for m in modes]
    height = fig.get_figheight()
    fig.legend(handles=handles, loc="upper center", ncol=legend_cols, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.3 / height))
    fig.suptitle(title, fontsize=10, y=1 - 0.05 / height, va="top")
    fig.subplots_adjust(left=0.07 if ncols > 1 else 0.2, right=0.98, bottom=0.35 / height,
                        top=1 - (0.55 + 0.2 * legend_rows) / height, wspace=0.35, hspace=0.45)
    _save_png(fig, path)
    plt.close(fig)


def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values for a log axis over [lo, hi]: the coarsest of 1-10-100, 1-2-5 and 1..9 steps per decade that puts
    three or more inside (at most seven shown), else (a range narrower than one step) round linear steps."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    for mantissas in ((1,), (1, 2, 5), tuple(range(1, 10))):
        ticks = [m * 10.0 ** d for d in decades for m in mantissas if lo <= m * 10.0 ** d <= hi]
        if len(ticks) >= 3:
            return ticks[:: math.ceil(len(ticks) / 7)]
    return [float(v) for v in MaxNLocator(nbins=5, steps=[1, 2, 5, 10]).tick_values(lo, hi) if lo <= v <= hi] or [lo]


def _log_ticks(ax: plt.Axes) -> None:
    """Labelled ticks on a log y axis whatever its range (matplotlib labels only the decades, which a narrow range
    may not contain), no unlabelled minor ones, and a range of at least LOG_MIN_SPAN (equal errors of a few
    implementations must not fill the height with their last digits)."""
    low, high = ax.get_ylim()
    if high / low < LOG_MIN_SPAN:
        mid = math.sqrt(low * high)
        low, high = mid / math.sqrt(LOG_MIN_SPAN), mid * math.sqrt(LOG_MIN_SPAN)
    ax.set_yticks(log_ticks(low, high))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1000 else f"{v:.3g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylim(low, high)


def _trace_figure(trace: list[list[float]], run_mhz: float | None, title: str, path: Path) -> None:
    """SM clock (with the run's median clock and the threshold below which cells are flagged), power and temperature
    against seconds from the start of the run; an older trace may hold the clock only."""
    t = np.array([p[0] for p in trace])
    rows = [(1, "SM clock, MHz"), (2, "power, W"), (3, "temperature, C")]
    rows = [(k, label) for k, label in rows if all(len(p) > k and p[k] is not None for p in trace)]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.3 * len(rows) + 0.6), sharex=True, squeeze=False)
    for ax, (k, label) in zip(axes[:, 0], rows):
        y = np.array([p[k] for p in trace], dtype=float)
        ax.plot(t, y, ".", ms=2, color="#444444")  # no implementation's colour
        if k == 1 and run_mhz is not None:
            ax.axhline(run_mhz, color="grey", lw=0.8, ls="--", label=f"run median {run_mhz:.0f}")
            ax.axhline((1 - CLOCK_DIP) * run_mhz, color="#d62728", lw=0.8, ls=":",
                       label=f"-{100 * CLOCK_DIP:.0f}%: cells below are flagged")
            ax.legend(fontsize=7, loc="lower left", frameon=False)
        ax.set_ylabel(label, fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(color="#e6e6e6", lw=0.6)
    axes[-1, 0].set_xlabel("seconds from the start of the run", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def _save_png(fig: plt.Figure, path: Path) -> None:
    """A 256-colour palette PNG: a few line colours plus their anti-aliasing fit a palette, and the
    file is about a quarter of matplotlib's RGBA one (it is embedded in report.html too); written atomically."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    image = Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    png = io.BytesIO()
    image.save(png, format="png", optimize=True)
    write_atomic(path, png.getvalue())
