"""report.html: one self-contained page (inline CSS, plots embedded as base64 PNG, no scripts).

Sections: first the verdict (on the run's GPU, per mode, how many cells of the implementation in focus, coda-triton
where present or the one ``report --impl`` names, are faster / same / slower / unresolved against the fastest other
implementation of their row, its biggest wins and losses with their 95% intervals: :mod:`codabench.report.summary`;
and the run's resolving power: the median half-width of the vs-fastest-other intervals and the share of decided
cells); then, folded, the run's facts (suite, device, wall time, clocks) and how to read the report; the headline
table (speedup vs torch-compile with its 95% interval, the verdict against the fastest other implementation,
pass/fail, per op x model x mode x dtype, one column per implementation), the roofline view (% of the measured GEMM
ceiling), failures, per-op tables with the per-output errors, the time to each implementation's first result
(:mod:`codabench.report.first_result`), where the time goes (``--profile``: :mod:`codabench.report.profiles`),
plots, the GPU clock trace, environment. A CPU run (wall times of the Triton interpreter) says so at the top and shows
no speed figures or verdicts. Every implementation keeps the colour of :mod:`codabench.report.palette`.
"""
from __future__ import annotations

import base64
import datetime
import html
import json
import math
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from codabench.clocks import CLOCK_DIP, clock_dips, run_clock_mhz
from codabench.matrix import PLUGIN_OP, SPEED_BASELINE
from codabench.report.first_result import first_result_section
from codabench.report.palette import impl_colors, impl_order
from codabench.report.profiles import profile_section
from codabench.report.training import REFERENCES, train_step_table
from codabench.report.summary import (COUNTED, FOCUS, cells as timed_cells, extremes, focus_impl, ratio_text,
                                      resolving_power, verdict_counts)
from codabench.stats import MIN_PAIRS, MIN_SAMPLES, VERDICTS, timing_settings
from codabench.timing import CPU_WALL
from workloads.fp8 import FP8_DTYPES
from workloads.op import MODES

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1600px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}h3{font-size:15px}
table{border-collapse:collapse;margin:8px 0 16px;font-size:12px}
th,td{border:1px solid #ccc;padding:3px 5px;text-align:right;white-space:nowrap}
th{background:#f2f2f2;white-space:normal;vertical-align:bottom}td.l,th.l{text-align:left}
td.msg{text-align:left;white-space:normal;min-width:160px;max-width:300px;overflow-wrap:anywhere}
td.msg[colspan]{max-width:none}td.note{color:#555;padding-left:24px}
td.txt{text-align:left;white-space:normal;min-width:120px;max-width:260px}
td.msg details{margin:0}td.msg summary{cursor:pointer}
.pass{background:#dff3df}.fail{background:#f8d7d7}.err{background:#f3b6b6}.na{background:#eee;color:#777}
.skip{background:#f6f0dc;color:#6b5a1e}.dip{background:#ffe08a}.host{background:#d9e8fb}
.banner{background:#fff4ce;border:1px solid #e0c060;padding:8px 12px}
.cpu{background:#fde2c8;border:2px solid #d9822b;padding:10px 14px;font-size:16px}
img{max-width:100%;border:1px solid #eee;margin:6px 0}details{margin:4px 0 12px}pre{white-space:pre-wrap;overflow-wrap:anywhere}
.legend span{display:inline-block;padding:1px 6px;margin-right:6px;border:1px solid #ccc}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px;vertical-align:baseline}
.ci{color:#555;font-size:11px}
.v{display:inline-block;padding:0 4px;border-radius:3px;font-size:11px;margin-right:3px}
.v-faster{background:#1b7f3b;color:#fff;font-weight:600}.v-same{background:#d6e4f5;color:#173a63}
.v-slower{color:#555;border:1px solid #bbb}.v-unresolved{background:#fff;color:#8a5a00;border:1px dashed #d9a441}
.v-na{color:#888}
#glance td,#glance th,table.extreme td,table.extreme th{font-size:13px;padding:3px 8px}.glance{font-size:15px}
.first{display:flex;flex-wrap:wrap;gap:8px 28px;align-items:flex-start}.first table{margin:4px 0}
#glance tr.total td{font-weight:600;border-top:2px solid #999}details>summary{cursor:pointer}
#headline{font-size:11px}#headline td.best{outline:2px solid #1b7f3b;outline-offset:-2px}
td.bar{min-width:64px}table.perop{font-size:11px}table.perop td,table.perop th{padding:2px 4px}
"""

HOW_TO_READ = f"""<p>Each cell of the matrix is one implementation (<i>impl</i>) of one op, for one model size,
mode (<code>fwd</code>, <code>bwd</code>: backward alone, <code>fwd_bwd</code>) and dtype. The headline table shows
the speedup against torch-compile on the same cell (&gt;1 is faster) with its 95% confidence interval, the
<b>verdict</b> against the fastest <i>other</i> implementation of the row, and whether every output and gradient
passed the error rule: relative error &le; 2&times; PyTorch's own error in the same dtype + a small floor, against a
float64 reference; NaN/Inf never passes.</p>
<p><b>Verdicts.</b> <span class="v v-faster">faster</span> the interval of this cell's speed over the fastest other
implementation lies above 1: the fastest of the row beyond noise. <span class="v v-same">same</span> the whole
interval lies inside the equivalence margin (&plusmn;{{margin}}, env.json <code>timing.same_within</code>): level with
the fastest. <span class="v v-slower">slower</span> the interval lies below 1. <span class="v v-unresolved">unresolved
</span> the interval contains 1 but reaches beyond the margin: the samples cannot tell equal from different.
<span class="v v-na">n/a</span> no interval: CPU wall times, fewer than {MIN_SAMPLES} samples (or {MIN_PAIRS} common
sweeps), or nothing to compare with. The interval: where a row's cells were sampled in interleaved sweeps (one sample
of each per sweep, in random order), the median of the per-sweep log ratios with the union of its order-statistic
interval and a batch-means t interval; in runs sampled in rounds, a bootstrap of the ratio of medians within each
round widened by Student's t over the per-round ratios. See <code>codabench/stats.py</code>.</p>
<p><b>Blank vs n/a.</b> A blank headline cell: no such cell in this run (the implementation does not register the op,
or was not selected). <code>n/a</code> as a status: the implementation registers the op but has no such mode/dtype;
<code>skipped</code>: it cannot run here (reason in the tooltip and the per-op tables); <code>error</code>: it raised,
returned a wrong shape/dtype, NaN/Inf, mutated its inputs, or failed a check that makes a time count. A blank number
in the per-op tables was not measured for that cell (fp8-only columns, clocks without NVML, memory on the CPU).</p>
<p>Timings: median of many samples with p20/p80, cold L2, CUDA events, each sample the GPU time of a call with its
launches queued (the start event waits behind a GPU spin longer than the call's host time); where the call's host
time exceeds its GPU time, the median is highlighted and followed by &#8224; and the host time (&#8224; in the
headline too): the host cannot feed the GPU that fast call after call; <i>time / GEMMs</i> is the time over the
plain cuBLAS GEMMs the op must do (ideal 1.00); <i>% ceiling</i> its TFLOP/s as a share of the GEMM ceiling measured
at the start of the run (the roofline of these GEMM-bound ops); <i>peak MiB</i> the memory one call allocates above
its inputs; <i>SM MHz</i> the NVML clock during the cell's kept samples (min / median), highlighted where it fell more
than {100 * CLOCK_DIP:.0f}% below the run's median clock.</p>
<p><i>strategy</i> (per-op tables): how the implementation ran the cell, in its own words (blank where it says
nothing). coda-triton names each of its GEMM kernels with <code>fused</code> (the epilogue in the GEMM's kernel, the
CODA idea), <code>split</code> (the plain GEMM, then one bandwidth-bound kernel over its output) or <code>gluon</code>
(a warp-specialized Gluon kernel, on Hopper), whichever measured faster for the shape on this GPU (or what
<code>CODABENCH_STRATEGY</code> forced); <code>mm</code> is a plain GEMM of the backward, <code>fused</code> on the
CODA mainloop, <code>split</code> on cuBLAS; <code>fused,split</code>: the kernel's calls in order.</p>
<p>fp8 cells (<code>fp8</code>: per-tensor scales, <code>fp8-row</code>: rowwise; forward and the dgrad ops)
take bf16 inputs whose GEMM operands lie on the fp8 grid; quantizing them is untimed, and its time is the
separate <i>cast ms</i> column. Their float64 reference is computed on those inputs, and PyTorch's error is
that of its <code>torch._scaled_mm</code> composition under the same recipe. <i>err vs bf16</i> is the
error against the unquantized bf16 computation (reported, not judged).</p>"""

CPU_BANNER = ("<p class='cpu'><b>CPU run: every time in this report is a CPU wall time</b> of the Triton interpreter "
              "(a functional check), <b>not a performance figure</b>. No speedups, intervals or verdicts are shown; "
              "the correctness results are real.</p>")
MESSAGE_FOLD = 70
"""Longer messages fold into a <details> element."""


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v == "":
        return ""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


def _esc(v: Any) -> str:
    return html.escape(str(v))


def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _ratio(r: pd.Series, column: str) -> tuple[str, str]:
    """(``1.07×``, ``[1.01, 1.13]``) of a ratio column and its interval; blanks where missing."""
    return ratio_text(*(_num(r.get(c)) for c in (column, column + "_lo", column + "_hi")))


def _interval(r: pd.Series, column: str) -> str:
    point, interval = _ratio(r, column)
    return f"{point} <span class='ci'>{interval}</span>" if interval else point


def _verdict(r: pd.Series) -> str:
    v = r.get("verdict")
    if not isinstance(v, str) or not v:
        return ""
    return f"<span class='v v-{'na' if v == 'n/a' else v}'>{_esc(v)}</span>"


def _message(v: Any) -> str:
    text = _fmt(v)
    if len(text) <= MESSAGE_FOLD:
        return _esc(text)
    return f"<details><summary>{_esc(text[:MESSAGE_FOLD - 20])}&hellip;</summary>{_esc(text)}</details>"


Column = tuple[str, str, "str | Callable[[pd.Series], str]"]
"""(column, header, format): a format spec, ``l`` (left-aligned text), ``txt`` (left-aligned text that wraps),
``msg`` (a message) or a function of the row returning HTML."""


def _table(df: pd.DataFrame, columns: list[Column], row_class=None, cell_class=None, css: str = "",
           span_from: str | None = None) -> str:
    """``cell_class(row, column)``: an extra class for one cell; ``css``: the table's class. ``span_from``: the
    messages take no column: in rows that are not ``ok`` (no figures to show) the cells from that column on merge
    into one that holds the message, and an ok row's message (a note) gets a row of its own below it."""
    head = "".join(f'<th class="{"l" if f in ("l", "txt", "msg") else ""}">{_esc(h)}</th>' for _, h, f in columns)
    names = [c for c, _, _ in columns]
    body = []
    for _, r in df.iterrows():
        cls = f' class="{row_class(r)}"' if row_class else ""
        span = span_from in names and r.get("status") != "ok"
        tds = []
        for col, _, f in columns:
            if span and col == span_from:
                tds.append(f'<td class="msg" colspan="{len(names) - names.index(col)}">{_esc(r.get("message"))}</td>')
                break
            extra = (cell_class(r, col) if cell_class else "") or ""
            if callable(f):
                tds.append(f'<td class="{extra}">{f(r)}</td>')
            elif f == "txt":
                tds.append(f'<td class="txt {extra}">{_esc(_fmt(r.get(col)))}</td>')
            elif f in ("l", "msg"):
                tds.append(f'<td class="{f} {extra}">{_message(r.get(col)) if f == "msg" else _esc(_fmt(r.get(col)))}'
                           "</td>")
            else:
                tds.append(f'<td class="{extra}">{_esc(_fmt(r.get(col), f))}</td>')
        body.append(f"<tr{cls}>{''.join(tds)}</tr>")
        if span_from in names and not span and _fmt(r.get("message")):
            body.append(f'<tr{cls}><td class="msg note" colspan="{len(names)}">&#8627; {_esc(r["message"])}</td></tr>')
    return f"<table class='{css}'><tr>{head}</tr>{''.join(body)}</table>"


def _status_class(r) -> str:
    s = r["status"]
    if s == "ok":
        return "pass" if r.get("correct") is True else "fail"
    return {"error": "err", "n/a": "na", "skipped": "skip"}.get(s, "")


def _impl_head(impl: str, colors: dict[str, str]) -> str:
    return f"<span class='sw' style='background:{colors[impl]}'></span>{_esc(impl)}"


def _host_bound(r: pd.Series) -> bool:
    """An ok row whose call's host time (``host_ms``) exceeds its GPU time (``median_ms``): timed with its launches
    queued, as a kernel is, but the host cannot feed the GPU that fast call after call."""
    host, gpu = pd.to_numeric(r.get("host_ms"), errors="coerce"), pd.to_numeric(r.get("median_ms"), errors="coerce")
    return bool(r.get("status") == "ok" and host > gpu)


def _median(r: pd.Series) -> str:
    """The median, and where the call is host-bound its host time after the mark."""
    text = _fmt(r.get("median_ms"), ".4g")
    return f"{text} {HOST_MARK}{_fmt(r.get('host_ms'), '.3g')}" if _host_bound(r) else text


def host_bound(df: pd.DataFrame) -> pd.Series:
    """:func:`_host_bound` of each row (False throughout a run without ``host_ms``)."""
    if "host_ms" not in df or df.empty:
        return pd.Series(False, index=df.index)
    return df.apply(_host_bound, axis=1).astype(bool)


HOST_MARK = "&#8224;"
"""The headline's mark on a host-bound cell (a dagger: every font has it)."""


def _headline(df: pd.DataFrame, impls: list[str], colors: dict[str, str], perf: bool, dips: pd.Series) -> str:
    cells = df[df["op"] != PLUGIN_OP]
    bound = host_bound(df)
    head = "".join(f"<th>{_impl_head(i, colors)}</th>" for i in impls)
    rows = []
    for (op, model, mode, dtype), g in cells.groupby(["op", "model", "mode", "dtype"], sort=False):
        by_impl = {r["impl"]: (idx, r) for idx, r in g.iterrows()}
        tds = []
        for impl in impls:
            if impl not in by_impl:
                tds.append("<td></td>")
                continue
            idx, r = by_impl[impl]
            cls = _status_class(r)
            title = r["message"]
            if r["status"] == "ok":
                mark = {True: "&#10003;", False: "&#10007;"}.get(r.get("correct"), "?")
                text = mark
                if perf and r.get("timing") != CPU_WALL:
                    vs = " ".join(_ratio(r, "vs_best")).strip()  # the verdict's own ratio and interval
                    text = f"{_interval(r, 'speedup')} {mark}<br>{_verdict(r)}<span class='ci'>{vs.replace('×', '')}</span>"
                    cls += " best" if r.get("verdict") == "faster" else ""
                    title = "; ".join(t for t in (vs and f"vs the fastest other: {vs}", title) if t)
                if dips[idx]:
                    text += " &#9888;"
                    title = f"SM clock fell to {_fmt(r.get('sm_clock_min_mhz'), '.0f')} MHz; {title}"
                if perf and bound[idx]:
                    text += f" {HOST_MARK}"
                    title = (f"host-bound: {_fmt(r.get('host_ms'), '.3g')} ms of host time a call against "
                             f"{_fmt(r.get('median_ms'), '.3g')} ms on the GPU; {title}")
            else:
                text = _esc(r["status"])
            tds.append(f'<td class="{cls}" title="{_esc(title)}">{text}</td>')
        rows.append(f'<tr><td class="l">{_esc(op)}</td><td class="l">{_esc(model)}</td>'
                    f'<td class="l">{_esc(mode)}</td><td class="l">{_esc(dtype)}</td>{"".join(tds)}</tr>')
    return (f'<table id="headline"><tr><th class="l">op</th><th class="l">model</th><th class="l">mode</th>'
            f'<th class="l">dtype</th>{head}</tr>{"".join(rows)}</table>')


def _roofline(df: pd.DataFrame, impls: list[str], colors: dict[str, str]) -> str:
    """% of the measured GEMM ceiling per cell, drawn as a bar inside the cell (the best of the row in bold)."""
    cells = df[(df["op"] != PLUGIN_OP) & (df["status"] == "ok")]
    pct = pd.to_numeric(cells["pct_ceiling"], errors="coerce")
    cells = cells[pct.notna()]
    if cells.empty:
        return ""
    shown = [i for i in impls if i in set(cells["impl"])]
    head = "".join(f"<th>{_impl_head(i, colors)}</th>" for i in shown)
    rows = []
    for (op, model, mode, dtype), g in cells.groupby(["op", "model", "mode", "dtype"], sort=False):
        p = dict(zip(g["impl"], pd.to_numeric(g["pct_ceiling"])))
        best = max(p.values())
        tds = []
        for impl in shown:
            if impl not in p:
                tds.append("<td></td>")
                continue
            w = max(0.0, min(100.0, p[impl]))
            style = f"background:linear-gradient(90deg,{colors[impl]}30 {w:.0f}%,transparent {w:.0f}%)"
            text = f"<b>{p[impl]:.0f}</b>" if p[impl] == best else f"{p[impl]:.0f}"
            tds.append(f'<td class="bar" style="{style}">{text}</td>')
        rows.append(f'<tr><td class="l">{_esc(op)}</td><td class="l">{_esc(model)}</td>'
                    f'<td class="l">{_esc(mode)}</td><td class="l">{_esc(dtype)}</td>{"".join(tds)}</tr>')
    return (f'<table id="roofline"><tr><th class="l">op</th><th class="l">model</th><th class="l">mode</th>'
            f'<th class="l">dtype</th>{head}</tr>{"".join(rows)}</table>')


def _range(lo: str, hi: str, spec: str) -> Callable[[pd.Series], str]:
    return lambda r: _esc(f"{_fmt(r.get(lo), spec)}–{_fmt(r.get(hi), spec)}") if _fmt(r.get(lo)) else ""


def _clock(r: pd.Series) -> str:
    lo, med = _fmt(r.get("sm_clock_min_mhz"), ".0f"), _fmt(r.get("sm_clock_median_mhz"), ".0f")
    return f"{lo}/{med}" if lo else ""


def _mib(r: pd.Series) -> str:
    v = _num(r.get("peak_mem_mib"))
    return "" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


PER_OP_COLUMNS: list[Column] = [
    ("impl", "impl", "l"), ("model", "model", "l"), ("mode", "mode", "l"), ("dtype", "dtype", "l"),
    ("status", "status", "l"), ("strategy", "strategy", "txt"), ("median_ms", "median ms", _median),
    ("p20_ms", "p20–p80 ms", _range("p20_ms", "p80_ms", ".4g")),
    ("cv", "CV", ".2f"), ("speedup", f"speedup vs {SPEED_BASELINE} [95%]", lambda r: _interval(r, "speedup")),
    ("vs_best", "vs fastest other [95%], verdict", lambda r: f"{_interval(r, 'vs_best')} {_verdict(r)}".strip()),
    ("sol_ratio", "time / GEMMs", ".3f"), ("pct_ceiling", "% ceiling", ".1f"),
    ("peak_mem_mib", "peak MiB", _mib), ("sm_clock_min_mhz", "SM MHz min / med", _clock),
    ("first_call_s", "first call s", ".3g"), ("check_s", "check s", ".3g"), ("cast_ms", "cast ms", ".4g"),
    ("rel_err", "rel err", ".3g"), ("err_ratio", "err / torch err", ".3g"),
    ("rel_err_vs_bf16", "err vs bf16", ".3g"),
    ("correct", "correct", "l")]
"""A row's message spans the row, or a row below it (:func:`_table`)."""
SPEED_COLUMNS = ("speedup", "vs_best", "sol_ratio", "pct_ceiling")
"""Not shown for CPU wall times."""
KEPT = ("impl", "model", "mode", "dtype", "status", "median_ms", "correct")
"""Shown even when empty; any other column of a table is left out where every row is blank."""
ERROR_TABLE_COLUMNS: list[Column] = [
    ("impl", "impl", "l"), ("model", "model", "l"), ("mode", "mode", "l"), ("dtype", "dtype", "l"),
    ("output", "output", "l"), ("rel_err", "rel err", ".3g"), ("max_abs", "max abs", ".3g"),
    ("cosine", "cosine", ".9f"), ("torch_rel_err", "torch rel err", ".3g"), ("ratio", "ratio", ".3g"),
    ("rel_err_vs_bf16", "err vs bf16", ".3g"), ("passed", "passed", "l")]
FP8_ONLY = ("cast_ms", "rel_err_vs_bf16")
"""Columns shown only in tables that hold an fp8 cell."""


def _columns(df: pd.DataFrame, columns: list[Column], perf: bool = True) -> list[Column]:
    """``columns`` without those blank in every row of ``df`` (fp8-only ones without an fp8 cell), and without the
    speed columns in a CPU run."""
    has_fp8 = df["dtype"].isin(FP8_DTYPES).any()

    def shown(c: str) -> bool:
        if c in KEPT:
            return True
        if (c in FP8_ONLY and not has_fp8) or (c in SPEED_COLUMNS and not perf) or c not in df:
            return False
        return df[c].map(lambda v: _fmt(v) != "").any()
    return [c for c in columns if shown(c[0])]


def render(df: pd.DataFrame, errors: pd.DataFrame, env: dict[str, Any], plots: list[tuple[str, Path]],
           run_dir: Path, focus: str | None = None) -> str:
    """The page; ``focus``: the implementation whose verdicts the first screen counts (default:
    :func:`codabench.report.summary.focus_impl`'s pick, coda-triton where the run has it)."""
    cells = df[df["op"] != PLUGIN_OP]
    impls = impl_order(cells["impl"])
    colors = impl_colors(df["impl"])
    counts = df["status"].value_counts().to_dict()
    ok = df[df["status"] == "ok"]
    perf = not ok.empty and (ok["timing"] != CPU_WALL).any()
    cpu = not ok.empty and (ok["timing"] == CPU_WALL).any()
    dips = clock_dips(df)
    n_pass = int((ok["correct"] == True).sum())  # noqa: E712 (pandas element-wise)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>codabench {_esc(run_dir.name)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>codabench report: {_esc(run_dir.name)}</h1>"]
    precision, same_within = timing_settings(env)
    if cpu:
        parts.append(CPU_BANNER)
    if perf:
        parts += _glance(df, env, impls, focus, precision, same_within)
    parts += [f"<details><summary><b>Run</b>: {_esc(_run_line(env, counts, dips))}</summary>",
              _facts(env, counts, n_pass, len(ok)), *_clock_summary(df, dips), "</details>"]
    parts += ["<details><summary><b>How to read this report</b> (verdicts, statuses, columns)</summary>",
              HOW_TO_READ.replace("{margin}", f"{100 * same_within:g}%"),
              '<p class="legend"><span class="pass">pass</span><span class="fail">error above the rule</span>'
              '<span class="err">error row</span><span class="skip">skipped</span><span class="na">n/a</span>'
              '<span class="dip">clock dip &#9888;</span><span class="host">host-bound &#8224;: host time '
              'above GPU time</span></p></details>']
    if perf:
        n = ok["verdict"].value_counts()
        parts += ["<h2>Headline: speedup vs torch-compile [95% interval], verdict against the fastest other, "
                  "pass/fail</h2>",
                  f"<p>{n.get('faster', 0)} cells faster than every other implementation of their row, "
                  f"{n.get('same', 0)} the same as the fastest (within &plusmn;{100 * same_within:g}%), "
                  f"{n.get('slower', 0)} slower, {n.get('unresolved', 0)} unresolved; the fastest beyond noise is "
                  "outlined. First line: the speedup against torch-compile [95% interval]; second: the verdict with "
                  "its own ratio, to the fastest other implementation of the row [95% interval].</p>"]
    else:
        parts.append("<h2>Headline: pass/fail</h2>")
    parts.append(_headline(df, impls, colors, perf, dips))
    parts += _training(df, errors, env, perf)
    parts += first_result_section(cells)
    roof = _roofline(df, impls, colors) if perf else ""
    if roof:
        parts += ["<h2>Roofline: % of the measured GEMM ceiling</h2>",
                  "<p>Each op here is bound by its GEMMs, so the GEMM ceiling measured at the start of the run "
                  "(bf16 <code>torch.mm</code>, fp8 <code>torch._scaled_mm</code> at 8192&sup3;) is its roof: the bar "
                  "is the cell's TFLOP/s as a share of it, the row's best in bold. Shapes faster than the probe can "
                  "pass 100.</p>", roof]
    bad = df[df["status"] == "error"]
    if not bad.empty:
        parts += ["<h2>Errors</h2>", _table(bad, [("op", "op", "l"), ("impl", "impl", "l"), ("model", "model", "l"),
                                                  ("mode", "mode", "l"), ("dtype", "dtype", "l"),
                                                  ("message", "message", "msg")], lambda r: "err")]
    parts.append("<h2>Per-op results</h2>")

    bound = host_bound(df)

    def flag(r, col):
        if col == "median_ms" and bound[r.name]:
            return "host"
        return "dip" if col == "sm_clock_min_mhz" and dips[r.name] else ""

    for op, g in cells.groupby("op", sort=False):
        parts += [f"<h3 id='op-{_esc(op)}'>{_esc(op)}</h3>",
                  _table(g, _columns(g, PER_OP_COLUMNS, perf), _status_class, flag, "perop", span_from="median_ms")]
        e = errors[errors["op"] == op]
        if not e.empty:
            parts += [f"<details><summary>per-output errors of {_esc(op)} ({len(e)} rows)</summary>",
                      _table(e, _columns(e, ERROR_TABLE_COLUMNS), lambda r: "pass" if r["passed"] is True else "fail"),
                      "</details>"]
    parts += profile_section(df, run_dir, focus or focus_impl(ok, impls) or FOCUS)
    parts.append("<h2>Plots</h2>")
    for title, path in plots:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h3>{_esc(title)}</h3><img alt='{_esc(title)}' src='data:image/png;base64,{data}'>")
    if not plots:
        parts.append("<p>No plots: no cell was timed.</p>")
    shown = {k: (f"{len(v)} points, plotted above" if k == "clock_trace" and v else v) for k, v in env.items()}
    parts += ["<h2>Environment</h2>", f"<pre>{_esc(json.dumps(shown, indent=2, default=str))}</pre>",
              "</body></html>"]
    return "\n".join(parts)


def _glance(df: pd.DataFrame, env: dict[str, Any], impls: list[str], focus: str | None, precision: float,
            same_within: float) -> list[str]:
    """The first screen: on the run's GPU, per mode, how many cells of the implementation in focus (``focus``, else
    :func:`codabench.report.summary.focus_impl`'s) are faster / same / slower / unresolved against the fastest other
    implementation of their row, its biggest wins and losses with their intervals, and the run's resolving power."""
    ok = timed_cells(df)
    hw, decided = resolving_power(ok)
    if hw is None:
        return []
    impl = focus or focus_impl(ok, impls)
    gpu = env.get("gpu", {}).get("name") if isinstance(env.get("gpu"), dict) else None
    where = f"{_esc(gpu)}: " if gpu else ""
    mine = ok[ok["impl"] == impl]
    if impl is None or not mine["verdict"].isin(VERDICTS).any():
        parts = [f"<h2>{where}no verdicts for {_esc(impl or 'any implementation')} in this run</h2>"]
    else:
        head = "".join(f"<th>{_verdict(pd.Series({'verdict': v}))}</th>" for v in COUNTED)
        rows = []
        modes = [m for m in MODES if m in set(mine["mode"])] + sorted(set(mine["mode"]) - set(MODES))
        for label, g in [(m, mine[mine["mode"] == m]) for m in modes] + ([("all", mine)] if len(modes) > 1 else []):
            n = verdict_counts(g)
            cls = ' class="total"' if label == "all" else ""
            rows.append(f'<tr{cls}><td class="l">{_esc(label)}</td>' + "".join(f"<td>{n[v]}</td>" for v in COUNTED)
                        + f"<td>{len(g)}</td></tr>")
        counts = (f'<table id="glance"><tr><th class="l">mode</th>{head}<th>cells</th></tr>{"".join(rows)}'
                  "</table>")
        wins, losses = extremes(mine)
        parts = [f"<h2>{where}{_esc(impl)} against the fastest other implementation of each row</h2>",
                 "<div class='first'>", counts, "<div>",
                 _extreme_table("Biggest wins", wins, "none: no cell is faster than every other beyond noise"),
                 _extreme_table("Biggest losses", losses, "none: no cell is slower than the fastest other beyond "
                                                          "noise"),
                 "</div></div>",
                 "<p class='glance'><i>faster</i> / <i>slower</i>: the 95% interval of the ratio lies above / "
                 f"below 1; <i>same</i>: it lies within &plusmn;{100 * same_within:g}%; <i>unresolved</i>: it holds 1 "
                 "and reaches beyond that margin.</p>"]
    parts.append(f"<p class='glance'>Resolving power: median half-width of the intervals against the fastest other "
                 f"<b>&plusmn;{100 * hw:.1f}%</b> (target &plusmn;{100 * precision:g}%); <b>{100 * decided:.0f}%</b> "
                 "of the cells with an interval are decided (faster, same or slower), the rest unresolved.</p>")
    return parts


def _extreme_table(title: str, rows: pd.DataFrame, empty: str) -> str:
    """A small table of wins or losses: op, model, mode, dtype, the ratio to the fastest other [95% interval]."""
    if rows.empty:
        return f"<table class='extreme'><tr><th class='l'>{_esc(title)}</th></tr><tr><td class='l'>{_esc(empty)}" \
               "</td></tr></table>"
    body = "".join(f'<tr><td class="l">{_esc(r["op"])}</td><td class="l">{_esc(r["model"])}</td>'
                   f'<td class="l">{_esc(r["mode"])}</td><td class="l">{_esc(r["dtype"])}</td>'
                   f'<td>{_interval(r, "vs_best")}</td></tr>' for _, r in rows.iterrows())
    return (f"<table class='extreme'><tr><th class='l' colspan='4'>{_esc(title)}</th><th>vs fastest other [95%]</th>"
            f"</tr>{body}</table>")


def _training(results: pd.DataFrame, errors: pd.DataFrame, env: dict[str, Any], perf: bool) -> list[str]:
    """The "Training step" section (empty without whole-model cells): a headline sentence per (op, model, dtype) for
    hf-coda against the references, then the figures of :func:`codabench.report.training.train_step_table`."""
    table = train_step_table(results, errors)
    if table.empty:
        return []
    parts = ["<h2>Training step</h2>",
             "<p>One training step (forward + backward of the loss, no optimizer step) of the model's first layers "
             "at the timed batch. <i>tokens/s</i> = tokens / median step time; <i>vs</i> = the reference's step "
             "time over this one (&gt;1: faster); <i>peak GiB</i> = the memory one step allocates above its weights "
             "and batch; <i>first step</i> = the first call at the timed shape in this process (compiling, "
             "autotuning; the correctness pass at the check shape ran before it); the errors are the loss's and the "
             "worst weight gradient's against float64.</p>"]
    for (op, model, dtype), g in table.groupby(["op", "model", "dtype"], sort=False):
        shape = (env.get("models") or {}).get(model, {})
        parts.append(f"<h3>{_esc(op)} &middot; {_esc(model)} &middot; {shape.get('layers', '?')} layers &middot; "
                     f"{_esc(_fmt(g['tokens'].iloc[0]))} tokens &middot; {_esc(dtype)}</h3>")
        coda = g[g["impl"] == "hf-coda"]
        if perf and not coda.empty:
            c = coda.iloc[0]
            said = [f"hf-coda: {c['tokens_per_s'] / 1e3:.1f}k tokens/s"]
            for r in REFERENCES:
                if pd.notna(c[f"vs_{r}"]):
                    said.append(f"{c[f'vs_{r}']:.2f}x {r}'s tokens/s, {c[f'mem_vs_{r}']:.2f}x its peak memory")
            said.append(f"first step {c['first_step_s']:.1f} s")
            parts.append(f"<p><b>{_esc('; '.join(said))}</b>.</p>")
        shown = g.sort_values("tokens_per_s", ascending=False) if perf else g
        columns = [("impl", "impl", "l")]
        if perf:
            columns += [("median_ms", "ms / step", ".4g"), ("tokens_per_s", "tokens/s", ",.0f"),
                        *[(f"vs_{r}", f"vs {r}", ".3f") for r in REFERENCES], ("peak_gib", "peak GiB", ".2f"),
                        *[(f"mem_vs_{r}", f"x {r} memory", ".2f") for r in REFERENCES],
                        ("first_step_s", "first step s", ".3g")]
        columns += [("loss_rel_err", "loss err", ".2e"), ("grad_rel_err", "worst grad err", ".2e"),
                    ("correct", "correct", "l")]
        parts.append(_table(shown, columns, lambda r: "pass" if r["correct"] is True else "fail"))
    return parts


def _clock_summary(df: pd.DataFrame, dips: pd.Series) -> list[str]:
    run = run_clock_mhz(df)
    if run is None:
        return []
    med = pd.to_numeric(df.loc[df["status"] == "ok", "sm_clock_median_mhz"], errors="coerce")
    text = (f"<p>SM clock during the kept samples: run median {run:.0f} MHz (cells' medians "
            f"{med.min():.0f}-{med.max():.0f}; the trace is plotted at the end). ")
    if dips.any():
        names = ", ".join(f"{r['op']} {r['model']} {r['mode']} {r['dtype']} {r['impl']}" for _, r in df[dips].iterrows())
        text += (f"<b>{int(dips.sum())} cell(s) ran with the clock more than {100 * CLOCK_DIP:.0f}% below it</b> "
                 f"(&#9888;; their times are suspect): {_esc(names)}.</p>")
    else:
        text += f"No cell's clock fell more than {100 * CLOCK_DIP:.0f}% below it.</p>"
    return [text]


def _hms(seconds: Any) -> str | None:
    s = _num(seconds)
    return None if s is None else str(datetime.timedelta(seconds=round(s)))


def _summed(env: dict[str, Any], key: str) -> float | None:
    """``key`` (wall_s, first_calls_s, ...) summed over a run's sessions (a resumed run keeps the earlier ones under
    ``earlier_sessions``); None where a session lacks it."""
    sessions = [*(env.get("earlier_sessions") or []), env]
    values = [_num(e.get(key)) for e in sessions if _num(e.get("wall_s")) is not None]
    return None if not values or None in values else sum(values)


def _wall(env: dict[str, Any]) -> str | None:
    """The run's wall time: over all its sessions, split into first calls, correctness passes and the rest; a merged
    run's shards (which may have run side by side): the range of their wall times and their sum."""
    shards = [w for w in (_summed(e, "wall_s") for e in env.get("shards") or []) if w is not None]
    if shards:
        return f"{len(shards)} shards: {_hms(min(shards))} to {_hms(max(shards))} each, {_hms(sum(shards))} summed"
    wall = _summed(env, "wall_s")
    if wall is None:
        return None
    sessions = len(env.get("earlier_sessions") or []) + 1
    text = _hms(wall) + (f" over {sessions} sessions (--resume)" if sessions > 1 else "")
    first, checks, rest = (_summed(env, k) for k in ("first_calls_s", "checks_s", "rest_s"))
    if first is not None and rest is not None:
        text += (f" (first calls: compile, JIT, autotune {_hms(first)}"
                 + (f"; correctness passes {_hms(checks)}" if checks is not None else "") + f"; the rest {_hms(rest)})")
    return text


def _facts(env: dict[str, Any], counts: dict[str, int], n_pass: int, n_ok: int) -> str:
    gpu = env.get("gpu", {}).get("name") if isinstance(env.get("gpu"), dict) else None
    ceil = env.get("ceilings") or {}
    wall = _wall(env)
    facts = [("suite", env.get("suite")), ("device", gpu or env.get("device")), ("started", env.get("timestamp")),
             ("wall time", wall), ("git", env.get("git_sha")), ("code tree", env.get("code_tree")),
             ("torch", env.get("torch")),
             ("triton", env.get("triton")), ("CUDA", env.get("cuda")),
             ("cells", ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))),
             ("correct", f"{n_pass} of {n_ok} timed cells pass")]
    if ceil:
        facts.append(("ceilings", ", ".join(f"{k} {_fmt(v, '.4g')}" for k, v in ceil.items())))
    for dtype, label in (env.get("fp8_recipes") or {}).items():
        facts.append((f"{dtype} recipe", label))
    rows = "".join(f'<tr><th class="l">{_esc(k)}</th><td class="l">{_esc(_fmt(v))}</td></tr>'
                   for k, v in facts if v not in (None, ""))
    return f"<table>{rows}</table>"


def _run_line(env: dict[str, Any], counts: dict[str, int], dips: pd.Series) -> str:
    """The folded run details in one line: suite, device, start, cells, wall time, clock dips."""
    gpu = env.get("gpu", {}).get("name") if isinstance(env.get("gpu"), dict) else None
    wall = _summed(env, "wall_s")
    said = [f"{env['suite']} suite" if env.get("suite") else None, gpu or env.get("device"),
            f"started {env['timestamp']}" if env.get("timestamp") else None,
            f"{sum(counts.values())} cells (" + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ")",
            f"wall time {_hms(wall)}" if wall is not None else None,
            f"\u26a0 {int(dips.sum())} cell(s) with a clock dip" if dips.any() else None]
    return " \u00b7 ".join(s for s in said if s)
