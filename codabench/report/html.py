"""report.html: one self-contained page (inline CSS, plots embedded as base64 PNG, no scripts).

Sections: run facts, headline table (speedup vs torch-compile and pass/fail per op x model x mode x
dtype, one column per implementation), failures, per-op tables with the per-output errors,
plots, environment.
"""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from codabench.matrix import PLUGIN_OP, SPEED_BASELINE
from workloads.fp8 import FP8_DTYPES

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1600px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}h3{font-size:15px}
table{border-collapse:collapse;margin:8px 0 16px;font-size:12px}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#f2f2f2}td.l,th.l{text-align:left}td.msg{text-align:left;white-space:normal;min-width:320px;max-width:640px}
.pass{background:#dff3df}.fail{background:#f8d7d7}.err{background:#f3b6b6}.na{background:#eee;color:#777}
.skip{background:#f6f0dc;color:#6b5a1e}.banner{background:#fff4ce;border:1px solid #e0c060;padding:8px 12px}
img{max-width:100%;border:1px solid #eee;margin:6px 0}details{margin:4px 0 12px}
.legend span{display:inline-block;padding:1px 6px;margin-right:6px;border:1px solid #ccc}
"""

HOW_TO_READ = """<p>Each cell of the matrix is one implementation (<i>impl</i>) of one op, for one model size,
mode (<code>fwd</code>, <code>bwd</code>: backward alone, <code>fwd_bwd</code>) and dtype. The headline
table shows the speedup against torch-compile on the same cell (&gt;1 is faster) and whether every
output and gradient passed the error rule: relative error &le; 2&times; PyTorch's own error in the
same dtype + a small floor, against a float64 reference; NaN/Inf never passes. <code>n/a</code>: the
impl has no such mode/dtype; <code>skipped</code>: it cannot run here (reason in the tooltip and the
per-op tables); <code>error</code>: it raised, returned a wrong shape/dtype, NaN/Inf, or mutated its
inputs. Timings: median of many samples with p20/p80, cold L2, CUDA events; <i>sol_ratio</i> is the
time over the plain cuBLAS GEMMs the op must do (ideal 1.00).</p>
<p>fp8 cells (<code>fp8</code>: per-tensor scales, <code>fp8-row</code>: rowwise; forward and the dgrad ops)
take bf16 inputs whose GEMM operands lie on the fp8 grid; quantizing them is untimed, and its time is the
separate <i>cast ms</i> column. Their float64 reference is computed on those inputs, and PyTorch's error is
that of its <code>torch._scaled_mm</code> composition under the same recipe. <i>err vs bf16</i> is the
error against the unquantized bf16 computation (reported, not judged).</p>"""


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


def _table(df: pd.DataFrame, columns: list[tuple[str, str, str]], row_class=None) -> str:
    """columns: (column, header, format spec or "l" for left-aligned text / "msg" for messages)."""
    head = "".join(f'<th class="{"l" if f in ("l", "msg") else ""}">{_esc(h)}</th>' for _, h, f in columns)
    body = []
    for _, r in df.iterrows():
        cls = f' class="{row_class(r)}"' if row_class else ""
        tds = []
        for col, _, f in columns:
            v = r.get(col)
            if f in ("l", "msg"):
                tds.append(f'<td class="{f}">{_esc(_fmt(v))}</td>')
            else:
                tds.append(f"<td>{_esc(_fmt(v, f))}</td>")
        body.append(f"<tr{cls}>{''.join(tds)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _status_class(r) -> str:
    s = r["status"]
    if s == "ok":
        return "pass" if r.get("correct") is True else "fail"
    return {"error": "err", "n/a": "na", "skipped": "skip"}.get(s, "")


def _headline(df: pd.DataFrame, impls: list[str]) -> str:
    cells = df[df["op"] != PLUGIN_OP]
    head = "".join(f"<th>{_esc(i)}</th>" for i in impls)
    rows = []
    for (op, model, mode, dtype), g in cells.groupby(["op", "model", "mode", "dtype"], sort=False):
        by_impl = {r["impl"]: r for _, r in g.iterrows()}
        tds = []
        for impl in impls:
            r = by_impl.get(impl)
            if r is None:
                tds.append("<td></td>")
                continue
            cls = _status_class(r)
            if r["status"] == "ok":
                sp = r.get("speedup") if r.get("timing") != "cpu-wall" else None  # CPU times are no figures
                mark = {True: "&#10003;", False: "&#10007;"}.get(r.get("correct"), "?")
                text = (f"{_fmt(sp, '.2f')}&times; " if _fmt(sp) else "") + mark
            else:
                text = _esc(r["status"])
            tds.append(f'<td class="{cls}" title="{_esc(r["message"])}">{text}</td>')
        rows.append(f'<tr><td class="l">{_esc(op)}</td><td class="l">{_esc(model)}</td>'
                    f'<td class="l">{_esc(mode)}</td><td class="l">{_esc(dtype)}</td>{"".join(tds)}</tr>')
    return (f'<table id="headline"><tr><th class="l">op</th><th class="l">model</th><th class="l">mode</th>'
            f'<th class="l">dtype</th>{head}</tr>{"".join(rows)}</table>')


PER_OP_COLUMNS = [("impl", "impl", "l"), ("model", "model", "l"), ("mode", "mode", "l"), ("dtype", "dtype", "l"),
                  ("status", "status", "l"), ("median_ms", "median ms", ".4g"), ("p20_ms", "p20", ".4g"),
                  ("p80_ms", "p80", ".4g"), ("cv", "CV", ".2f"), ("first_call_s", "first call s", ".3g"),
                  ("tflops", "TFLOP/s", ".4g"),
                  ("speedup", f"speedup vs {SPEED_BASELINE}", ".3f"), ("sol_ratio", "time / GEMMs", ".3f"),
                  ("pct_ceiling", "% ceiling", ".1f"), ("cast_ms", "cast ms", ".4g"), ("rel_err", "rel err", ".3g"),
                  ("err_ratio", "err / torch err", ".3g"), ("rel_err_vs_bf16", "err vs bf16", ".3g"),
                  ("correct", "correct", "l"), ("message", "message", "msg")]
ERROR_TABLE_COLUMNS = [("impl", "impl", "l"), ("model", "model", "l"), ("mode", "mode", "l"),
                       ("dtype", "dtype", "l"), ("output", "output", "l"), ("rel_err", "rel err", ".3g"),
                       ("max_abs", "max abs", ".3g"), ("cosine", "cosine", ".9f"),
                       ("torch_rel_err", "torch rel err", ".3g"), ("ratio", "ratio", ".3g"),
                       ("rel_err_vs_bf16", "err vs bf16", ".3g"), ("passed", "passed", "l")]
FP8_ONLY = ("cast_ms", "rel_err_vs_bf16")
"""Columns shown only in tables that hold an fp8 cell."""


def _columns(df: pd.DataFrame, columns: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """``columns`` without the fp8-only ones when no row of ``df`` is an fp8 cell."""
    has_fp8 = df["dtype"].isin(FP8_DTYPES).any()
    return [c for c in columns if has_fp8 or c[0] not in FP8_ONLY]


def render(df: pd.DataFrame, errors: pd.DataFrame, env: dict[str, Any], plots: list[tuple[str, Path]],
           run_dir: Path) -> str:
    impls = list(dict.fromkeys(df.loc[df["op"] != PLUGIN_OP, "impl"]))
    counts = df["status"].value_counts().to_dict()
    ok = df[df["status"] == "ok"]
    n_pass = int((ok["correct"] == True).sum())  # noqa: E712 (pandas element-wise)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>codabench {_esc(run_dir.name)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>codabench report: {_esc(run_dir.name)}</h1>",
             _facts(env, counts, n_pass, len(ok))]
    if (ok["timing"] == "cpu-wall").any():
        parts.append('<p class="banner">CPU run (Triton interpreter): the times below are wall-clock times of '
                     "a functional check, <b>not performance figures</b>. Correctness results are real.</p>")
    parts += ["<h2>How to read this report</h2>", HOW_TO_READ,
              '<p class="legend"><span class="pass">pass</span><span class="fail">error above the rule</span>'
              '<span class="err">error row</span><span class="skip">skipped</span><span class="na">n/a</span></p>',
              "<h2>Headline: speedup vs torch-compile and pass/fail</h2>", _headline(df, impls)]
    bad = df[df["status"] == "error"]
    if not bad.empty:
        parts += ["<h2>Errors</h2>", _table(bad, [("op", "op", "l"), ("impl", "impl", "l"), ("model", "model", "l"),
                                                  ("mode", "mode", "l"), ("dtype", "dtype", "l"),
                                                  ("message", "message", "msg")], lambda r: "err")]
    parts.append("<h2>Per-op results</h2>")
    for op, g in df[df["op"] != PLUGIN_OP].groupby("op", sort=False):
        parts += [f"<h3 id='op-{_esc(op)}'>{_esc(op)}</h3>", _table(g, _columns(g, PER_OP_COLUMNS), _status_class)]
        e = errors[errors["op"] == op]
        if not e.empty:
            parts += [f"<details><summary>per-output errors of {_esc(op)} ({len(e)} rows)</summary>",
                      _table(e, _columns(e, ERROR_TABLE_COLUMNS), lambda r: "pass" if r["passed"] is True else "fail"),
                      "</details>"]
    parts.append("<h2>Plots</h2>")
    for title, path in plots:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h3>{_esc(title)}</h3><img alt='{_esc(title)}' src='data:image/png;base64,{data}'>")
    if not plots:
        parts.append("<p>No plots: no cell was timed.</p>")
    parts += ["<h2>Environment</h2>", f"<pre>{_esc(json.dumps(env, indent=2, default=str))}</pre>",
              "</body></html>"]
    return "\n".join(parts)


def _facts(env: dict[str, Any], counts: dict[str, int], n_pass: int, n_ok: int) -> str:
    gpu = env.get("gpu", {}).get("name") if isinstance(env.get("gpu"), dict) else None
    ceil = env.get("ceilings") or {}
    facts = [("suite", env.get("suite")), ("device", gpu or env.get("device")), ("started", env.get("timestamp")),
             ("git", env.get("git_sha")), ("torch", env.get("torch")), ("triton", env.get("triton")),
             ("CUDA", env.get("cuda")), ("cells", ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))),
             ("correct", f"{n_pass} of {n_ok} timed cells pass")]
    if ceil:
        facts.append(("ceilings", ", ".join(f"{k} {_fmt(v, '.4g')}" for k, v in ceil.items())))
    for dtype, label in (env.get("fp8_recipes") or {}).items():
        facts.append((f"{dtype} recipe", label))
    rows = "".join(f'<tr><th class="l">{_esc(k)}</th><td class="l">{_esc(_fmt(v))}</td></tr>'
                   for k, v in facts if v not in (None, ""))
    return f"<table>{rows}</table>"
