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

from codabench.registry import load_plugin_file
from codabench import results as tables
from codabench.report import finalize
from codabench.results import load_run
from codabench.report.compare import compare, format_compare
from harness_helpers import PLUGINS, isolated_registry, make_runner

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


def test_run_files_and_columns(run_dir):
    for name in ("results.csv", "errors.csv", "results.json", "env.json", "report.html", "samples.jsonl"):
        assert (run_dir / name).stat().st_size > 0, name
    df = pd.read_csv(run_dir / "results.csv")
    assert set(REQUIRED) <= set(df.columns)
    err = pd.read_csv(run_dir / "errors.csv")
    assert {"output", "rel_err", "max_abs", "cosine", "torch_rel_err", "ratio", "passed"} <= set(err.columns)
    assert sorted(p.name for p in (run_dir / "plots").glob("*.png")) == \
        ["median_ms_fp32.png", "rel_err_fp32.png", "sol_ratio_fp32.png", "speedup_fp32.png"]
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
    assert '<table id="headline">' in html and "not performance figures" in html
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
    assert "+200.0%" in text and "0 faster, 0 slower, 0 same" in text


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


def test_a_truncated_results_file_still_reports(run_dir, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    data = (cut / tables.RESULTS).read_bytes()
    (cut / tables.RESULTS).write_bytes(data[: len(data) - 40])  # killed mid-row
    df, _, _ = load_run(cut)
    assert len(df) == len(load_run(run_dir)[0]) - 1
    assert finalize(cut).exists()


ROOT_REPORTS = Path(__file__).resolve().parents[1] / "reports"
# the committed reports are the ones .gitignore lets through ("!/reports/NAME/")
COMMITTED = [ROOT_REPORTS / line.strip()[len("!/reports/"):].strip("/") / "results.csv"
             for line in (ROOT_REPORTS.parent / ".gitignore").read_text().splitlines() if line.startswith("!/reports/")]


@pytest.mark.parametrize("results", COMMITTED, ids=lambda p: p.parent.name)
def test_committed_reference_reports_load_pass_and_rebuild(results, tmp_path):
    """The reports in the tree are what the README cites: they load with today's reader, every timed cell passed
    the error rule, and their HTML rebuilds from the CSVs."""
    df, _, env = load_run(results.parent)
    ok = df[df["status"] == "ok"]
    assert len(ok) > 100 and env["device"] == "cuda"
    assert ok["correct"].all() and (ok["median_ms"] > 0).all()
    copy = tmp_path / results.parent.name
    shutil.copytree(results.parent, copy)
    assert "coda-triton" in finalize(copy).read_text()


def test_the_full_reference_report_is_one_full_run():
    """The headline report (README, Results) covers the whole full suite with the suite's sampling."""
    df, _, env = load_run(ROOT_REPORTS / "h200-2026-11-22-full")
    assert len(df) == 513 and env["suite"] == "full"
    ok = df[df["status"] == "ok"]
    assert set(ok["model"]) == {"llama-1b", "llama-7b", "llama-70b"} and set(ok["dtype"]) == {"bf16", "fp8"}
    assert (ok["check_tokens"] == 2048).all() and (ok["n_samples"] == 21).all()
