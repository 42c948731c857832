"""Reports: the files of a run, strict JSON, the HTML (also rendered by headless Chromium), compare."""
import json
import shutil
import subprocess
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from codabench.discovery import load_plugin_file
from codabench import results as tables
from codabench.report import finalize
from codabench.results import load_run
from codabench.timing import TimingConfig
from codabench.report.compare import compare, format_compare
from codabench.report.index import committed_runs
from codabench.report.palette import FIXED, impl_colors
from codabench.report.plots import log_ticks
from harness_helpers import PLUGINS, isolated_registry, make_runner
from synthetic_runs import noisy_rounds, write_run

REQUIRED = ["op", "impl", "model", "mode", "dtype", "status", "message", "median_ms", "p20_ms", "p80_ms", "tflops",
            "speedup", "sol_ms", "sol_ratio", "rel_err", "max_abs_err", "err_ratio", "correct"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    with isolated_registry():
        load_plugin_file(PLUGINS / "faulty.py")
        make_runner(out, ops=["gemm_out", "rmsnorm_linear"],
                    impls=["torch-eager", "torch-compile", "test-raises", "test-inaccurate"]).run()
        finalize(out)
    return out


@pytest.mark.slow
def test_run_files_and_columns(run_dir):
    for name in ("results.csv", "errors.csv", "results.json", "env.json", "report.html", "samples.jsonl"):
        assert (run_dir / name).stat().st_size > 0, name
    df = pd.read_csv(run_dir / "results.csv")
    assert set(REQUIRED) <= set(df.columns)
    err = pd.read_csv(run_dir / "errors.csv")
    assert {"output", "rel_err", "max_abs", "cosine", "torch_rel_err", "ratio", "passed"} <= set(err.columns)
    # a CPU run: latency (captioned as wall time) and errors, no speed figures
    assert sorted(p.name for p in (run_dir / "plots").glob("*.png")) == ["median_ms_fp32.png", "rel_err_fp32.png"]
    for png in (run_dir / "plots").glob("*.png"):  # palette PNGs keep the committed reports small
        assert Image.open(png).mode == "P", png.name


def test_speedup_and_sol_are_consistent(run_dir):
    df, _, _ = load_run(run_dir)
    ok = df[df["status"] == "ok"]
    base = ok[ok["impl"] == "torch-compile"].set_index(["op", "mode"])["median_ms"]
    for _, r in ok.iterrows():
        if (r["op"], r["mode"]) in base.index:
            assert r["speedup"] == pytest.approx(base[(r["op"], r["mode"])] / r["median_ms"], rel=1e-6)
        assert r["sol_ratio"] == pytest.approx(r["median_ms"] / r["sol_ms"], rel=1e-6)
        assert r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]


def test_results_json_is_strict_and_keeps_samples(run_dir):
    def no_constants(name):
        raise ValueError(f"non-standard JSON constant {name}")

    text = (run_dir / "results.json").read_text()
    data = json.loads(text, parse_constant=no_constants)
    ok = [r for r in data["results"] if r["status"] == "ok"]
    assert ok and all(len(r["samples_ms"]) == r["n_samples"] for r in ok)
    rows = [json.loads(line.strip().rstrip(",")) for line in text.splitlines() if line.startswith('    {"op"')]
    assert len(rows) == len(data["results"]) + len(data["errors"])  # one row per line
    assert data["env"]["device"] == "cpu"


def test_html_is_offline_and_complete(run_dir):
    html = (run_dir / "report.html").read_text()
    assert '<table id="headline">' in html and "every time in this report is a CPU wall time" in html
    headline = html[html.index('<table id="headline">'):html.index("</table>", html.index('<table id="headline">'))]
    assert "×" not in headline and "class='v " not in headline  # no speedups or verdicts from CPU wall times
    assert "Blank vs n/a" in html
    for op in ("gemm_out", "rmsnorm_linear"):
        assert f"id='op-{op}'" in html
    assert "boom from the plugin" in html  # the error row's message
    assert "data:image/png;base64," in html
    assert "http://" not in html and "https://" not in html and "<script" not in html


def test_compare_two_runs(run_dir, tmp_path):
    slower = tmp_path / "slower"
    shutil.copytree(run_dir, slower)
    df = pd.read_csv(slower / "results.csv")
    for c in ("median_ms", "p20_ms", "p80_ms"):
        df[c] = df[c] * 3
    df.to_csv(slower / "results.csv", index=False)
    m = compare(run_dir, slower)
    timed = m.dropna(subset=["delta_pct"])
    assert len(timed) and np.allclose(timed["delta_pct"], 200.0)
    assert (m["verdict"] == "unknown").all()  # CPU wall times are no evidence of a change
    text = format_compare(m)
    assert "+200.0%" in text and "0 faster, 0 slower, 0 same, 0 unresolved" in text


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    url = (run_dir / "report.html").resolve().as_uri()
    flags = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    shot = tmp_path / "report.png"
    subprocess.run(flags + ["--window-size=1280,1600", f"--screenshot={shot}", url], check=True,
                   capture_output=True, timeout=180)
    img = mpimg.imread(shot)
    assert img.shape[0] >= 1000 and img.shape[1] >= 1000
    colors = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colors) > 50  # text, tables and status colours, not a blank page
    dom = subprocess.run(flags + ["--dump-dom", url], check=True, capture_output=True, text=True, timeout=180).stdout
    assert '<table id="headline">' in dom and "rmsnorm_linear" in dom and "test-inaccurate" in dom


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (.ci/run installs it)")
def test_a_gpu_report_fits_a_1400_pixel_window(gpu_run, tmp_path):
    """Nothing of the page (tables with every column, plots, the environment) runs past the right edge of a 1400 px
    window: the margin beside it stays white."""
    shot = tmp_path / "gpu.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1400,6000", f"--screenshot={shot}", (gpu_run / "report.html").resolve().as_uri()],
                   check=True, capture_output=True, timeout=180)
    img = np.asarray(Image.open(shot).convert("RGB"))
    assert img.shape[1] == 1400 and (img[:, :100] < 250).any()  # the page is drawn
    assert (img[:, -12:] >= 250).all()  # the right margin is untouched


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    """A made-up GPU run with every column filled: three implementations of a bf16 and an fp8 group (coda-triton ahead
    in one, tied with liger in the other), memory, % of ceiling, NVML clocks (one cell's clock dipped), host times
    (one cell's above its GPU time), coda-triton's
    strategies, a note on an ok cell, an n/a cell, and a clock trace."""
    rng = np.random.default_rng(11)
    cells, rows = {}, {}
    for dtype in ("bf16", "fp8"):
        liger = 2.0 if dtype == "bf16" else 1.8
        for impl, ms, mib in (("torch-compile", 2.0, 300.0), ("coda-triton", 1.8, 256.0), ("liger", liger, 2800.0)):
            key = ("rmsnorm_linear", "llama-70b", "fwd_bwd", dtype, impl)
            cells[key] = noisy_rounds(rng, ms, noise=0.004, drift=0.003)
            rows[key] = {"peak_mem_mib": mib, "pct_ceiling": 180 / ms, "sol_ms": ms / 1.1, "sol_ratio": 1.1,
                         "first_call_s": 12.345, "host_ms": 5.0 if (dtype, impl) == ("bf16", "liger") else 0.3,
                         "tflops": 654.3, "rel_err": 3.21e-3, "err_ratio": 1.23,
                         "sm_clock_median_mhz": 1980.0, "sm_clock_min_mhz": 1500.0 if (dtype, impl) == ("fp8", "liger")
                         else 1950.0, **({"cast_ms": 0.8786, "rel_err_vs_bf16": 0.0466} if dtype == "fp8" else {})}
            if impl == "coda-triton":  # the longest account the block gives of its kernels
                rows[key]["strategy"] = ("residual_norm:fused,split swiglu:split rope:fused dgrad_rmsnorm:split,fused "
                                         "dgrad_swiglu:split")
    rows[key]["message"] = "timing the GEMMs failed: RuntimeError: a long note that a cell can carry " * 3
    trace = [[t / 2, 1980.0 - t, 400.0 + t, 50.0 + t / 10] for t in range(40)]
    run = write_run(tmp_path_factory.mktemp("gpu") / "run", cells, rows=rows,
                    env={"clock_trace": trace, "wall_s": 300.0, "first_calls_s": 120.0, "rest_s": 180.0})
    tables.AppendWriter(run / tables.RESULTS, tables.RESULT_COLUMNS).write([{
        "op": "rmsnorm_linear", "impl": "flashinfer", "model": "llama-70b", "mode": "fwd_bwd", "dtype": "bf16",
        "status": "n/a", "message": "n/a: FlashInfer's kernels are inference-only (no autograd), so no fwd_bwd"}])
    finalize(run)
    return run


def test_a_gpu_report_shows_intervals_verdicts_clocks_memory_and_the_roofline(gpu_run):
    html = (gpu_run / "report.html").read_text()
    headline = html[html.index('<table id="headline">'):html.index("</table>", html.index('<table id="headline">'))]
    assert "1.00× <span class='ci'>ref</span>" in headline  # torch-compile is the reference
    verdicts = {v: headline.count(f"<span class='v v-{v}'>{v}</span>")
                for v in ("faster", "same", "slower", "unresolved")}
    assert verdicts == {"faster": 1, "same": 2, "slower": 3, "unresolved": 0}  # coda-triton ahead, level with liger
    assert "tie" not in html
    assert headline.count('class="pass best"') == 1
    df, _, _ = load_run(gpu_run)
    coda = df[df["impl"] == "coda-triton"].iloc[0]
    assert f"{coda['speedup']:.2f}× <span class='ci'>[{coda['speedup_lo']:.2f}, {coda['speedup_hi']:.2f}]" in headline
    assert "1 cell(s) ran with the clock more than 10% below it" in html and "llama-70b fwd_bwd fp8 liger" in html
    assert headline.count("&#9888;") == 1 and 'class="dip">1500/1980' in html
    assert headline.count("&#8224;") == 1 and "host-bound: 5 ms of host time" in headline  # liger bf16 alone
    assert html.count('<td class="host">') == 1 and html.count("&#8224;5</td>") == 1  # the median, then its host time
    assert '<table id="roofline">' in html and "0:05:00 (first calls: compile, JIT, autotune 0:02:00" in html
    assert html.count('<td class="txt ">residual_norm:fused,split swiglu:split') == 2  # coda-triton's two rows
    assert "every time in this report is a CPU wall time" not in html
    plots = sorted(p.name for p in (gpu_run / "plots").glob("*.png"))
    assert plots == sorted(["clock_trace.png"] + [f"{m}_{d}.png" for d in ("bf16", "fp8") for m in (
        "median_ms", "pct_ceiling", "peak_mem_mib", "rel_err", "sol_ratio", "speedup")])


def test_the_first_screen_counts_the_verdicts_and_the_resolving_power_before_any_explanation(gpu_run):
    """coda-triton's verdicts by mode (faster in bf16, level with liger in fp8), the median half-width of the
    vs-fastest intervals and the share of decided cells, all above the folded explanations."""
    from codabench.report.summary import resolving_power
    from codabench.stats import Ratio

    html = (gpu_run / "report.html").read_text()
    glance = html.index("<h2>coda-triton against the fastest other implementation of each row</h2>")
    assert glance < html.index("<details><summary><b>How to read this report</b>") < html.index('id="headline"')
    table = html[html.index('<table id="glance">'):html.index("</table>", glance)]
    assert '<tr><td class="l">fwd_bwd</td><td>1</td><td>1</td><td>0</td><td>0</td><td>0</td><td>2</td></tr>' in table
    assert "none: no cell is slower than the fastest other beyond noise" in html[glance:html.index("<details>")]
    df, _, _ = load_run(gpu_run)
    ok = df[df["status"] == "ok"]
    hw, decided = resolving_power(ok)
    assert decided == 1.0 and hw == pytest.approx(pd.Series(
        [Ratio(r["vs_best"], r["vs_best_lo"], r["vs_best_hi"]).half_width for _, r in ok.iterrows()]).median())
    assert f"<b>&plusmn;{100 * hw:.1f}%</b> (target &plusmn;1%); <b>100%</b> of the cells" in html


PLANTS = {  # (op, model, mode, dtype): (coda-triton's speed over torch-compile's, noise)
    ("gemm_out", "llama-1b", "fwd", "bf16"): (1.30, 0.003), ("gemm_out", "llama-7b", "fwd", "bf16"): (1.15, 0.003),
    ("gemm_out", "llama-70b", "fwd", "bf16"): (1.05, 0.003), ("gemm_down", "llama-7b", "fwd", "fp8"): (1.08, 0.003),
    ("gemm_down", "llama-1b", "fwd", "bf16"): (1.0, 0.003),
    ("gemm_out", "llama-1b", "bwd", "bf16"): (0.80, 0.003), ("gemm_out", "llama-7b", "bwd", "bf16"): (0.90, 0.003),
    ("gemm_out", "llama-70b", "bwd", "bf16"): (0.95, 0.003), ("gemm_down", "llama-1b", "bwd", "bf16"): (0.97, 0.003),
    ("gemm_down", "llama-7b", "bwd", "bf16"): (1.0, 0.15)}
"""fwd: 4 faster (1.30, 1.15, 1.08, 1.05), 1 same; bwd: 4 slower (0.80, 0.90, 0.95, 0.97), 1 unresolved."""


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from synthetic_runs import planted_run

    run = planted_run(tmp_path_factory.mktemp("planted") / "run", PLANTS,
                      env={"gpu": {"name": "NVIDIA H100 80GB HBM3"}, "suite": "quick", "timestamp": "2026-11-27T10:00"})
    finalize(run)
    return run


def _rows(table: str) -> list[str]:
    """The rows of an HTML table as 'cell cell ...' text."""
    import re
    return [" ".join(" ".join(re.sub(r"<[^>]+>", " ", c).split()) for c in re.findall(r"<td[^>]*>(.*?)</td>", row))
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table) if "<td" in row]


def _section(html: str, start: str) -> str:
    i = html.index(start)
    return html[i:html.index("</table>", i)]


def test_the_first_screen_answers_the_question_before_the_folded_details(planted):
    """On a run with planted speeds: per mode, the counts of coda-triton's verdicts; its three biggest wins and
    losses, largest first, with their intervals; the run's facts and the explanations folded below."""
    html = (planted / "report.html").read_text()
    top = html.index("<h2>NVIDIA H100 80GB HBM3: coda-triton against the fastest other implementation of each row")
    run = html.index("<details><summary><b>Run</b>: quick suite · NVIDIA H100 80GB HBM3 · started "
                     "2026-11-27T10:00 · 20 cells (20 ok)")
    assert top < html.index('id="glance"') < html.index("Biggest wins") < html.index("Biggest losses") < run
    assert run < html.index('<tr><th class="l">suite</th>') < html.index("</details>", run)  # the facts are folded
    assert html.index("</details>", run) < html.index("<details><summary><b>How to read this report")
    assert html.index("<details><summary><b>How to read this report") < html.index('id="headline"')
    assert _rows(_section(html, '<table id="glance">')) == [
        "fwd 4 1 0 0 0 5", "bwd 0 0 4 1 0 5", "all 4 1 4 1 0 10"]
    df, _, _ = load_run(planted)
    by_cell = {(r["op"], r["model"], r["mode"], r["dtype"]): r for _, r in df[df["impl"] == "coda-triton"].iterrows()}
    for title, expected in (("Biggest wins", [("gemm_out", "llama-1b", "fwd", "bf16"),
                                               ("gemm_out", "llama-7b", "fwd", "bf16"),
                                               ("gemm_down", "llama-7b", "fwd", "fp8")]),
                            ("Biggest losses", [("gemm_out", "llama-1b", "bwd", "bf16"),
                                                ("gemm_out", "llama-7b", "bwd", "bf16"),
                                                ("gemm_out", "llama-70b", "bwd", "bf16")])):
        shown = _rows(_section(html, title))
        wanted = []
        for cell in expected:
            r = by_cell[cell]
            wanted.append(f"{' '.join(cell)} {r['vs_best']:.2f}× [{r['vs_best_lo']:.2f}, {r['vs_best_hi']:.2f}]")
        assert shown == wanted, title
    assert by_cell[("gemm_out", "llama-1b", "fwd", "bf16")]["vs_best"] == pytest.approx(1.30, rel=0.01)


def test_report_impl_chooses_whose_verdicts_the_first_screen_counts(planted, tmp_path, capsys):
    from codabench.cli import main

    copy = tmp_path / "copy"
    shutil.copytree(planted, copy)
    assert main(["report", str(copy), "--impl", "torch-compile"]) == 0
    html = (copy / "report.html").read_text()
    assert "<h2>NVIDIA H100 80GB HBM3: torch-compile against the fastest other" in html
    assert _rows(_section(html, '<table id="glance">')) == [  # coda-triton's counts, mirrored
        "fwd 0 1 4 0 0 5", "bwd 4 0 0 1 0 5", "all 4 1 4 1 0 10"]
    before = (copy / "report.html").read_bytes()
    capsys.readouterr()
    assert main(["report", str(copy), "--impl", "no-such-impl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--impl no-such-impl: no such implementation" in err
    assert (copy / "report.html").read_bytes() == before  # nothing rewritten


def test_the_wall_time_of_a_resumed_run_sums_its_sessions_and_a_merged_run_shows_its_shards():
    from codabench.report.html import _wall

    first = {"wall_s": 538.0, "first_calls_s": 56.0, "checks_s": 200.0, "rest_s": 282.0}
    last = {"wall_s": 508.0, "first_calls_s": 83.0, "checks_s": 141.0, "rest_s": 284.0, "earlier_sessions": [first]}
    assert _wall(last) == ("0:17:26 over 2 sessions (--resume) (first calls: compile, JIT, autotune 0:02:19; "
                           "correctness passes 0:05:41; the rest 0:09:26)")
    older = {"wall_s": 100.0, "first_calls_s": 10.0, "rest_s": 90.0}  # before correctness passes were counted
    assert _wall({**last, "earlier_sessions": [older]}) == ("0:10:08 over 2 sessions (--resume) (first calls: compile, "
                                                            "JIT, autotune 0:01:33; the rest 0:06:14)")
    assert _wall({"wall_s": 300.0}) == "0:05:00"
    merged = {"shards": [last, {"wall_s": 299.0}, {"device": "cuda"}]}  # a shard without times is left out
    assert _wall(merged) == "2 shards: 0:04:59 to 0:17:26 each, 0:22:25 summed"
    assert _wall({}) is None


def test_an_implementation_keeps_its_colour_in_every_plot(gpu_run):
    """Each per-op figure draws liger and coda-triton in their fixed colours, and no colour of an implementation that
    is not in the run (quantized PNGs keep a colour within a few levels)."""
    def rgb(impl):
        return np.array([int(FIXED[impl][i:i + 2], 16) for i in (1, 3, 5)])

    for png in (p for p in (gpu_run / "plots").glob("*.png") if p.name != "clock_trace.png"):
        pixels = np.asarray(Image.open(png).convert("RGB")).reshape(-1, 3).astype(int)
        for impl, drawn in (("coda-triton", True), ("liger", True), ("flashinfer", False), ("quack", False)):
            assert ((np.abs(pixels - rgb(impl)).max(axis=1) <= 6).sum() > 20) == drawn, (png.name, impl)
    html = (gpu_run / "report.html").read_text()
    assert f"<span class='sw' style='background:{FIXED['liger']}'></span>liger" in html  # the table's swatch


def test_every_implementation_of_a_run_gets_a_distinct_colour():
    """The fixed colours and those of up to ten plugins are pairwise at least MIN_DISTANCE apart (CIEDE2000); a
    plugin's colour does not depend on the order the names come in."""
    import itertools

    from codabench.report.palette import MIN_DISTANCE, ciede2000, distance

    # CIEDE2000 against pairs of Sharma, Wu and Dalal's test data (2005)
    assert ciede2000(np.array([50, 2.6772, -79.7751]), np.array([50, 0, -82.7485])) == pytest.approx(2.0425, abs=1e-4)
    assert ciede2000(np.array([50, 2.49, -0.001]), np.array([50, -2.49, 0.0009])) == pytest.approx(7.1792, abs=1e-4)

    known = ["torch-eager", "torch-compile", "coda-triton", "liger", "flashinfer", "quack", "coda-example", "hf-coda",
             "hf-liger", "hf-compile", "hf-eager", "hf-coda-lora", "hf-liger-lora", "hf-compile-lora", "hf-eager-lora"]
    assert set(known) <= set(FIXED)
    plugins = [f"plugin-{k}" for k in range(10)]
    colors = impl_colors(known + plugins)
    assert len(colors) == len(known) + len(plugins)
    pairs = [(distance(colors[a], colors[b]), a, b) for a, b in itertools.combinations(colors, 2)]
    assert min(pairs)[0] >= MIN_DISTANCE, min(pairs)
    assert distance(colors["hf-coda"], colors["hf-liger"]) > 2 * MIN_DISTANCE  # once two shades of red
    assert distance("#d62728", "#d52828") < 1 < MIN_DISTANCE  # the measure tells near colours from far ones
    assert impl_colors(["my-plugin", "coda-triton", "zz"]) == impl_colors(["zz", "coda-triton", "my-plugin"])
    assert impl_colors(plugins[:3]) == {p: colors[p] for p in plugins[:3]}  # fixed ones do not shift a plugin's


@pytest.mark.parametrize("lo, hi", [(2.3e-3, 2.8e-3), (1e-6, 1e-2), (0.9, 1.2), (41.0, 47.0), (0.05, 50.0)])
def test_log_axes_get_at_least_two_labelled_ticks(lo, hi):
    ticks = log_ticks(lo, hi)
    assert len(ticks) >= 2 and all(lo <= t <= hi for t in ticks) and len({f"{t:.3g}" for t in ticks}) == len(ticks)


def test_a_truncated_results_file_still_reports(run_dir, tmp_path):
    """A run killed mid-row, before its report (no results.json yet)."""
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    (cut / "results.json").unlink()
    data = (cut / tables.RESULTS).read_bytes()
    (cut / tables.RESULTS).write_bytes(data[: len(data) - 40])  # killed mid-row
    df, _, _ = load_run(cut)
    assert len(df) == len(load_run(run_dir)[0]) - 1
    assert finalize(cut).exists()



@pytest.mark.parametrize("damage", ["results.csv cut", "errors.csv and env.json deleted"])
def test_report_never_replaces_a_richer_results_json(run_dir, tmp_path, capsys, damage):
    """A folder whose files hold less than its results.json is refused with one line and exit 2, every file left as
    it was; a folder that only lacks samples.jsonl is reported, its samples kept from results.json."""
    from codabench.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(run_dir, bad)
    if damage == "results.csv cut":
        data = (bad / tables.RESULTS).read_bytes()
        (bad / tables.RESULTS).write_bytes(data[: len(data) // 2])
        says = "rows that the run's files no longer have"
    else:
        (bad / tables.ERRORS).unlink()
        (bad / tables.ENV).unlink()
        says = "error rows and env.json's record that the run's files no longer have"
    before = {p.name: p.read_bytes() for p in bad.iterdir() if p.is_file()}
    assert main(["report", str(bad)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert says in lines[-1] and "nothing was rewritten" in lines[-1], lines
    assert {p.name: p.read_bytes() for p in bad.iterdir() if p.is_file()} == before

    no_samples = tmp_path / "no-samples"
    shutil.copytree(run_dir, no_samples)
    (no_samples / tables.SAMPLES).unlink()
    kept = json.loads((run_dir / "results.json").read_text())["results"]
    assert main(["report", str(no_samples)]) == 0
    again = json.loads((no_samples / "results.json").read_text())["results"]
    assert [r["samples_ms"] for r in again] == [r["samples_ms"] for r in kept] and any(r["samples_ms"] for r in kept)


def test_a_run_stopped_before_its_first_cell_still_reports(run_dir, tmp_path):
    """Only the header of results.csv, no errors.csv (a cold train-suite run stopped while its first cell tuned, on an
    H200, crashed in the training section here)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run_dir / tables.ENV, empty)
    (empty / tables.RESULTS).write_text((run_dir / tables.RESULTS).read_text().splitlines()[0] + "\n")
    assert load_run(empty)[0].empty
    assert "Training step" not in finalize(empty).read_text()


ROOT_REPORTS = Path(__file__).resolve().parents[1] / "reports"
COMMITTED = [run / "results.csv" for run in committed_runs(ROOT_REPORTS)]  # those .gitignore lets through
DRAWN = min(COMMITTED, key=lambda p: len(p.read_text().splitlines()), default=None)
"""The committed report whose plots the rebuild test draws (the smallest); for the others it checks that each figure
the rebuild would draw is committed, and draws none (drawing was 90% of a rebuild: ~16 of 17.5 s for a full run's)."""


@pytest.mark.parametrize("results", COMMITTED, ids=lambda p: p.parent.name)
def test_committed_reference_reports_load_pass_and_rebuild(results, tmp_path, monkeypatch):
    """The reports in the tree are what the README cites: they load with today's reader, every timed cell passed
    the error rule, and their HTML rebuilds from the CSVs, with each of its figures committed."""
    from codabench.report import plots

    df, _, env = load_run(results.parent)
    ok = df[df["status"] == "ok"]
    assert len(ok) and env["device"] == "cuda"
    assert ok["correct"].all() and (ok["median_ms"] > 0).all()
    copy = tmp_path / results.parent.name
    shutil.copytree(results.parent, copy)
    drawn = []
    if results != DRAWN:  # the committed PNG stands for the figure: the copy keeps it
        def keep(*args):
            drawn.append(next(a for a in args if isinstance(a, Path)))
        monkeypatch.setattr(plots, "_panel_figure", keep)
        monkeypatch.setattr(plots, "_trace_figure", keep)
    html = finalize(copy).read_text()
    assert all(impl in html for impl in set(ok["impl"]))  # every implementation that ran, in the rebuilt report
    assert all((results.parent / "plots" / p.name).is_file() for p in drawn)  # each figure it shows is committed
    assert drawn or results == DRAWN  # a report with timed cells shows figures


@pytest.mark.parametrize("run", ["h100-2026-11-27-full", "h200-2026-11-27-full"])
def test_the_full_reference_reports_are_full_runs(run):
    """The headline reports (README, Results) cover the whole full suite with the suite's sampling: paired sweeps,
    at least the minimum number of sweeps per group."""
    df, _, env = load_run(ROOT_REPORTS / run)
    assert len(df) == 513 and env["suite"] == "full"
    ok = df[df["status"] == "ok"]
    assert set(ok["model"]) == {"llama-1b", "llama-7b", "llama-70b"} and set(ok["dtype"]) == {"bf16", "fp8"}
    assert (ok["check_tokens"] == 2048).all()
    assert (ok["grain"] == "sample").all() and (ok["n_sweeps"] >= TimingConfig.min_sweeps).all()
    assert (ok["n_samples"] == ok["n_sweeps"]).all()
