"""PNG plots of a run: one figure per (metric, dtype), one panel per op, x = model size.

Metrics: latency (median, whiskers p20-p80), speedup vs torch-compile, worst relative error,
fused time / plain GEMM time (``sol_ratio``) and % of the measured GEMM ceiling.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402
import pandas as pd  # noqa: E402
from PIL import Image  # noqa: E402

from workloads.models import PRESETS  # noqa: E402


@dataclass(frozen=True)
class Metric:
    column: str
    title: str
    ylabel: str
    log: bool
    ref_line: float | None = None
    needs_perf: bool = True
    """Only meaningful for GPU timings (cpu-wall rows are plotted with a caveat in the title)."""


METRICS = [
    Metric("median_ms", "Latency", "median ms (p20-p80)", log=True),
    Metric("speedup", "Speedup vs torch-compile", "x (higher is faster)", log=False, ref_line=1.0),
    Metric("rel_err", "Worst relative error vs float64", "relative Frobenius error", log=True, needs_perf=False),
    Metric("sol_ratio", "Fused time / plain GEMM time", "median / sum of cuBLAS GEMMs", log=False, ref_line=1.0),
    Metric("pct_ceiling", "% of the measured GEMM ceiling", "% of ceiling TFLOP/s", log=False),
]


def _model_order(name: str) -> tuple[int, str]:
    p = PRESETS.get(name)
    return (p.hidden if p else 0, name)


def make_plots(df: pd.DataFrame, out_dir: Path) -> list[tuple[str, Path]]:
    """Write the PNGs; returns (title, path) for each figure drawn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = df[df["status"] == "ok"]
    cpu_only = not ok.empty and (ok["timing"] == "cpu-wall").all()
    made = []
    for dtype in sorted(ok["dtype"].unique()):
        sub = ok[ok["dtype"] == dtype]
        for metric in METRICS:
            data = sub[pd.to_numeric(sub[metric.column], errors="coerce").notna()]
            if data.empty:
                continue
            title = f"{metric.title}, {dtype}" + (" (CPU wall time: not a performance figure)"
                                                  if cpu_only and metric.needs_perf else "")
            path = out_dir / f"{metric.column}_{dtype}.png"
            _panel_figure(data, metric, title, path)
            made.append((title, path))
    return made


MODE_MARKERS = {"fwd": "o", "bwd": "s", "fwd_bwd": "^"}


def _panel_figure(data: pd.DataFrame, metric: Metric, title: str, path: Path) -> None:
    """One panel per op; x = model size; colour = implementation, marker = mode."""
    panels = list(dict.fromkeys(data["op"]))
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.6 * nrows + 0.9), squeeze=False)
    impls = sorted(data["impl"].unique())
    colors = {impl: plt.cm.tab10(i % 10) for i, impl in enumerate(impls)}
    models = sorted(data["model"].unique(), key=_model_order)
    for ax, op in zip(axes.flat, panels):
        sel = data[data["op"] == op]
        for (impl, mode), rows in sel.groupby(["impl", "mode"]):
            rows = rows.assign(x=rows["model"].map(models.index)).sort_values("x")
            y = pd.to_numeric(rows[metric.column])
            style = dict(marker=MODE_MARKERS.get(mode, "o"), ms=4, color=colors[impl])
            if metric.column == "median_ms":
                err = [y - pd.to_numeric(rows["p20_ms"]), pd.to_numeric(rows["p80_ms"]) - y]
                ax.errorbar(rows["x"], y, yerr=err, capsize=2, **style)
            else:
                ax.plot(rows["x"], y, **style)
        if metric.ref_line is not None:
            ax.axhline(metric.ref_line, color="grey", lw=0.8, ls="--")
        if metric.log:
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(range(len(models)), models, fontsize=7)
        ax.set_xlim(-0.5, len(models) - 0.5)
        ax.set_title(op, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_ylabel(metric.ylabel, fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    modes = [m for m in MODE_MARKERS if m in set(data["mode"])]
    handles = [plt.Line2D([], [], color=colors[i], marker="o", label=i) for i in impls]
    handles += [plt.Line2D([], [], color="black", ls="", marker=MODE_MARKERS[m], label=m) for m in modes]
    fig.legend(handles=handles, loc="upper center", ncol=min(8, len(handles)), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.3 / fig.get_figheight()))
    height = fig.get_figheight()
    fig.suptitle(title, fontsize=10, y=1 - 0.05 / height, va="top")
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.35 / height, top=1 - 0.75 / height,
                        wspace=0.35, hspace=0.45)
    _save_png(fig, path)
    plt.close(fig)


def _save_png(fig: plt.Figure, path: Path) -> None:
    """A 256-colour palette PNG: a few line colours plus their anti-aliasing fit a palette, and the
    file is about a quarter of matplotlib's RGBA one (it is embedded in report.html too)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    image = Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    image.save(path, format="png", optimize=True)
