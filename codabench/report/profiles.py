"""The report's section on where the time goes (``--profile``; the records of profiles.jsonl, :mod:`codabench.profile`).

For each group (op, model, mode, dtype) with profiles, one folded table: the focus implementation's kernels (name,
launches, ms and share per call) beside those of the fastest other implementation of the group (the lowest median
among its ok cells whose outputs were not judged wrong), then both calls' totals: kernel time, the part in GEMM
kernels, GPU busy time, host time, the timed median and the host synchronizations; a profile that failed shows its
note. Where the focus implementation has no profile in a group, the group's fastest profiled implementation takes
its place. A CPU run's entries are host operators, not GPU kernels, and say so.
"""
from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import pandas as pd

from codabench.profile import CPU_OPS
from codabench.results import KEY, read_profiles

GROUP = KEY[:4]


def profile_section(df: pd.DataFrame, run_dir: Path, focus: str) -> list[str]:
    """The section's HTML parts (none where the run has no profiles): ``df`` the run's rows (with ``median_ms``,
    ``status``, ``correct``), ``focus`` the implementation whose kernels lead each table."""
    profiles = read_profiles(run_dir)
    if not profiles:
        return []
    ok = df[df["status"] == "ok"]
    parts = ["<h2>Where the time goes (--profile)</h2>",
             f"<p>Each timed cell's call profiled after its group's samples (torch.profiler; one warm-up call, then "
             f"the mean per call of a few, L2 flushed before each as in the timing): <b>{_esc(focus)}</b>'s kernels "
             "beside the fastest other implementation's. <i>share</i> is of the call's kernel time; <i>GPU busy</i> "
             "the union of its kernels' intervals; <i>host</i> the wall time of the call on the host, launches "
             "included: a host time above the GPU busy time means the call is bound by its launches. Each cell's "
             "Chrome trace is linked where the run wrote one (<code>--profile-trace</code>).</p>"]
    for group, g in ok.groupby(GROUP, sort=False):
        keyed = {r["impl"]: profiles.get(tuple(map(str, (*group, r["impl"])))) for _, r in g.iterrows()}
        profiled = g[g["impl"].map(lambda i: keyed.get(i) is not None)]
        if profiled.empty:
            continue
        subject = focus if focus in set(profiled["impl"]) else \
            profiled.sort_values("median_ms", kind="stable")["impl"].iloc[0]
        others = g[(g["impl"] != subject) & (g["correct"] != False)].sort_values(  # noqa: E712 (element-wise)
            "median_ms", kind="stable")
        other = others["impl"].iloc[0] if not others.empty else None
        medians = dict(zip(g["impl"], g["median_ms"]))
        shown = [(subject, keyed[subject], medians[subject])]
        if other is not None:
            shown.append((other, keyed.get(other), medians[other]))
        parts.append(_table(" ".join(map(str, group)), shown))
    return parts


def _table(title: str, shown: list[tuple[str, dict[str, Any] | None, float]]) -> str:
    cpu = any(p is not None and p.get("activity") == CPU_OPS for _, p, _ in shown)
    what = ("top-level CPU operators (host times on the Triton interpreter, not GPU figures; its kernels run outside "
            "any operator)" if cpu else "GPU kernels")
    summary = "; ".join(f"{_esc(impl)} median {_ms(median)} ms" + _times(p) for impl, p, median in shown)
    head = "".join(f"<th class='l' colspan='4'>{_esc(impl)}</th>" for impl, _, _ in shown)
    sub = f"<th class='l'>{'operator' if cpu else 'kernel'}</th><th>launches</th><th>ms</th><th>share</th>" * len(shown)
    kernels = [(p or {}).get("kernels") or [] for _, p, _ in shown]
    rows = []
    for i in range(max(map(len, kernels))):
        cells = []
        for ks in kernels:
            if i < len(ks):
                k = ks[i]
                cells.append(f"<td class='txt'>{_esc(k['name'])}</td><td>{_num(k['launches'], '.3g')}</td>"
                             f"<td>{_ms(k['ms'])}</td><td>{_pct(k['share'])}</td>")
            else:
                cells.append("<td colspan='4'></td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    for label, field in (("operators' time" if cpu else "kernel time", "kernel_ms"), ("in GEMM kernels", "gemm_ms"),
                         ("GPU busy", "gpu_ms"), ("host", "host_ms")):
        values = [(p or {}).get(field) for _, p, _ in shown]
        if any(v is not None for v in values):
            rows.append("<tr>" + "".join(f"<td class='l' colspan='2'>{label}</td><td>{_ms(v)}</td><td></td>"
                                         for v in values) + "</tr>")
    rows.append("<tr>" + "".join(f"<td class='l' colspan='2'>timed median</td><td>{_ms(median)}</td><td></td>"
                                 for _, _, median in shown) + "</tr>")
    rows.append("<tr>" + "".join(f"<td class='msg' colspan='4'>{_facts(p)}</td>" for _, p, _ in shown) + "</tr>")
    return (f"<details><summary>{_esc(title)}: {summary}</summary><p>{what}, per call</p>"
            f"<table class='perop'><tr>{head}</tr><tr>{sub}</tr>{''.join(rows)}</table></details>")


def _times(p: dict[str, Any] | None) -> str:
    """A profile's host time and GPU busy time, for a summary line."""
    if p is None or p.get("host_ms") is None:
        return ""
    return f" (host {_ms(p['host_ms'])}" + (f", GPU busy {_ms(p['gpu_ms'])})" if p.get("gpu_ms") is not None else ")")


def _facts(p: dict[str, Any] | None) -> str:
    """A profile's host synchronizations, note and trace link."""
    if p is None:
        return "not profiled"
    out = []
    syncs = p.get("syncs")
    if syncs is not None:
        out.append(f"host synchronizations per call: {len(syncs)}" + (f" ({_esc(' '.join(syncs))})" if syncs else ""))
    if p.get("note"):
        out.append(_esc(p["note"]))
    if p.get("trace"):
        out.append(f"<a href='{_esc(p['trace'])}'>Chrome trace</a> (chrome://tracing or ui.perfetto.dev)")
    return "; ".join(out)


def _esc(v: Any) -> str:
    return html.escape(str(v))


def _num(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return format(v, spec)


def _ms(v: Any) -> str:
    return _num(v, ".4g")


def _pct(v: Any) -> str:
    return "" if v is None else f"{100 * v:.1f}%"
