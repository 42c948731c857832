"""Intervals and verdicts (codabench.stats): an A/A comparison comes out clean, real differences are found, ties are
ties, and the run's derived speed columns follow the rules."""
import json

import numpy as np
import pandas as pd
import pytest

from codabench import results as tables
from codabench.report import finalize
from codabench.report.compare import compare, format_compare
from codabench.results import load_run
from codabench.stats import MIN_SAMPLES, Ratio, Timed, ratio, speed_figures
from synthetic_runs import noisy_rounds, write_run

CELLS = [("gemm_out", f"m{i}", "fwd", "bf16", impl) for i in range(60) for impl in ("torch-compile", "coda-triton")]


def two_runs(tmp_path, change: float = 1.0, noise: float = 0.015, drift: float = 0.015, rounds: int = 3,
             timing: str = "cuda-events", seed: int = 0):
    """Runs A and B of the same cells (medians from 0.05 to 50 ms); B's times are A's distribution x ``change``."""
    rng = np.random.default_rng(seed)
    medians = {c: float(m) for c, m in zip(CELLS, np.exp(rng.uniform(np.log(0.05), np.log(50), len(CELLS))))}
    per_round = max(1, 21 // rounds)
    runs = []
    for name, factor in (("a", 1.0), ("b", change)):
        cells = {c: noisy_rounds(rng, m * factor, rounds, per_round, noise, drift) for c, m in medians.items()}
        runs.append(write_run(tmp_path / name, cells, timing))
    return runs


def test_an_a_a_comparison_of_identical_code_comes_out_same(tmp_path):
    """Two runs of the same code (same noise, independent round drift in each run): at least 95% of the cells are
    `same`, none is unknown (every cell has an interval)."""
    m = compare(*two_runs(tmp_path))
    assert len(m) == len(CELLS) and (m["verdict"] != "unknown").all()
    assert (m["verdict"] == "same").mean() >= 0.95, m["verdict"].value_counts().to_dict()
    assert ((m["delta_lo_pct"] <= m["delta_pct"]) & (m["delta_pct"] <= m["delta_hi_pct"])).all()
    assert f"{len(CELLS)} cells, {len(CELLS)} timed in both; B vs A: " in format_compare(m)


@pytest.mark.parametrize("change, verdict", [(1.05, "slower"), (1 / 1.05, "faster")])
def test_a_real_five_percent_change_with_low_noise_is_found(tmp_path, change, verdict):
    m = compare(*two_runs(tmp_path, change=change, noise=0.004, drift=0.003))
    assert (m["verdict"] == verdict).all(), m["verdict"].value_counts().to_dict()
    assert np.allclose(m["delta_pct"], 100 * (change - 1), atol=1.5)


def test_cpu_wall_and_single_round_runs_compare_as_unknown(tmp_path):
    cpu = compare(*two_runs(tmp_path / "cpu", change=2.0, noise=0.004, drift=0.003, timing="cpu-wall"))
    assert (cpu["verdict"] == "unknown").all() and cpu["delta_lo_pct"].isna().all()
    one = compare(*two_runs(tmp_path / "one", change=1.05, rounds=1))  # drift between runs is unknowable
    assert (one["verdict"] == "unknown").all()
    assert f"0 faster, 0 slower, 0 same, {len(CELLS)} unknown" in format_compare(one)


def test_the_verdict_is_a_tie_when_the_interval_covers_one():
    assert Ratio(1.03, 0.99, 1.07).verdict == "tie"
    assert Ratio(1.03, 1.01, 1.07).verdict == "faster" and Ratio(0.97, 0.95, 0.99).verdict == "slower"
    rng = np.random.default_rng(3)
    same = [ratio(Timed(noisy_rounds(rng, 2.0), "cuda-events", f"ref{i}"),
                  Timed(noisy_rounds(rng, 2.0), "cuda-events", f"cell{i}"), paired=True) for i in range(40)]
    assert sum(r.verdict == "tie" for r in same) >= 38
    assert all(r.lo <= 1 <= r.hi for r in same if r.verdict == "tie")


def test_rounds_pair_a_common_drift_and_a_round_that_disagrees_widens_the_interval():
    """Round r of two cells ran side by side: a drift common to both cancels; a round where the ratio differs is
    drift the within-round bootstrap cannot see, and the interval grows to cover it."""
    rng = np.random.default_rng(4)
    levels = [1.0, 1.15, 0.9]
    ref = [list(lv * 2.0 * np.exp(rng.normal(0, 0.003, 7))) for lv in levels]
    fast = [list(lv * 2.0 / 1.05 * np.exp(rng.normal(0, 0.003, 7))) for lv in levels]
    r = ratio(Timed(ref, "cuda-events", "ref"), Timed(fast, "cuda-events", "fast"), paired=True)
    assert r.verdict == "faster" and r.lo > 1.03 and r.hi < 1.07
    odd = [list(f / s * 2.0 * np.exp(rng.normal(0, 0.003, 7))) for f, s in zip(levels, (1.05, 1.05, 0.95))]
    wide = ratio(Timed(ref, "cuda-events", "ref"), Timed(odd, "cuda-events", "odd"), paired=True)
    assert wide.verdict == "tie" and wide.lo < 1 < wide.hi


def group(rounds_by_impl: dict[str, list[list[float]]], timing="cuda-events", **fields) -> tuple[pd.DataFrame, dict]:
    rows, rounds = [], {}
    for impl, rs in rounds_by_impl.items():
        key = ("block", "llama-1b", "fwd", "bf16", impl)
        rows.append({**dict(zip(tables.KEY, key)), "status": "ok", "median_ms": float(np.median(sum(rs, []))),
                     "timing": timing, "correct": True, **fields.get(impl, {})})
        rounds[key] = rs
    df = pd.DataFrame(rows, columns=tables.RESULT_COLUMNS)
    df["correct"] = df["correct"].astype(object)
    return df, rounds


def test_speed_figures_of_a_group():
    rng = np.random.default_rng(5)
    df, rounds = group({"torch-eager": noisy_rounds(rng, 3.0, noise=0.004, drift=0.003),
                        "torch-compile": noisy_rounds(rng, 2.0, noise=0.004, drift=0.003),
                        "coda-triton": noisy_rounds(rng, 1.9, noise=0.004, drift=0.003),
                        "liger": noisy_rounds(rng, 2.0, noise=0.004, drift=0.003),
                        "test-wrong": noisy_rounds(rng, 1.0, noise=0.004, drift=0.003)},
                       **{"test-wrong": {"correct": False}})
    out = speed_figures(df, rounds).set_index("impl")
    med = out["median_ms"]
    assert out.loc["torch-compile", ["speedup", "speedup_lo", "speedup_hi"]].tolist() == [1.0, 1.0, 1.0]
    assert out.loc["coda-triton", "speedup"] == pytest.approx(med["torch-compile"] / med["coda-triton"])
    # the fastest other is the fastest correct one: test-wrong never sets the bar
    assert out.loc["coda-triton", "vs_best"] == pytest.approx(min(med["torch-compile"], med["liger"]) / med["coda-triton"])
    assert out.loc["torch-compile", "vs_best"] == pytest.approx(med["coda-triton"] / med["torch-compile"])
    assert out.loc["test-wrong", "vs_best"] == pytest.approx(med["coda-triton"] / med["test-wrong"])
    assert out["verdict"].to_dict() == {"torch-eager": "slower", "torch-compile": "slower", "coda-triton": "faster",
                                        "liger": "slower", "test-wrong": "faster"}
    for p in ("speedup", "vs_best"):
        assert (out[p + "_lo"] <= out[p]).all() and (out[p] <= out[p + "_hi"]).all()
    again = speed_figures(df, rounds).set_index("impl")  # reproducible: seeded by the cell
    alone = speed_figures(df[df["impl"].isin(["torch-compile", "coda-triton"])], rounds).set_index("impl")
    assert again.loc["coda-triton", "speedup_lo"] == out.loc["coda-triton", "speedup_lo"] \
        == alone.loc["coda-triton", "speedup_lo"]


def test_no_interval_for_cpu_wall_times_few_samples_or_a_lone_implementation():
    rng = np.random.default_rng(6)
    cpu, rounds = group({"torch-compile": [[1.0]], "coda-triton": [[2.0]]}, timing="cpu-wall")
    out = speed_figures(cpu, rounds)
    assert out["speedup"].tolist() == [1.0, 0.5] and out["speedup_lo"].isna().all()
    assert (out["verdict"] == "n/a").all() and out["vs_best"].tolist() == [2.0, 0.5]
    few, rounds = group({"torch-compile": noisy_rounds(rng, 1.0), "coda-triton": [[1.0] * (MIN_SAMPLES - 1)]})
    assert (speed_figures(few, rounds)["verdict"] == "n/a").all()
    alone, rounds = group({"coda-triton": noisy_rounds(rng, 1.0)})
    out = speed_figures(alone, rounds)
    assert out["verdict"].tolist() == ["n/a"] and out["vs_best"].isna().all() and out["speedup"].isna().all()


def test_samples_of_runs_without_stored_rounds_are_split_by_the_runs_rounds(tmp_path):
    """Runs from before samples.jsonl kept rounds (e.g. the committed H200 report) pooled them in round order, the
    same number per round when --reps was fixed."""
    key = ("gemm_out", "llama-1b", "fwd", "bf16", "torch-compile")
    for name, timing, expected in (("fixed", {"reps": 6, "rounds": 3}, [[1, 2], [3, 4], [5, 6]]),
                                   ("adaptive", {"reps": None, "rounds": 3}, [[1, 2, 3, 4, 5, 6]]),
                                   ("odd", {"reps": 7, "rounds": 3}, [[1, 2, 3, 4, 5, 6, 7]])):
        d = tmp_path / name
        d.mkdir()
        pooled = expected[0] if name != "fixed" else [1, 2, 3, 4, 5, 6]
        tables.append_jsonl(d / tables.SAMPLES, {**dict(zip(tables.KEY, key)), "samples_ms": pooled})
        assert tables.sample_rounds(d, {"timing": timing}) == {key: expected}, name


def test_finalize_writes_the_intervals_and_verdicts(tmp_path):
    rng = np.random.default_rng(7)
    cells = {("block", "llama-1b", "fwd", "bf16", impl): noisy_rounds(rng, m, noise=0.004, drift=0.003)
             for impl, m in (("torch-compile", 2.0), ("coda-triton", 1.8))}
    run = write_run(tmp_path / "run", cells)
    finalize(run)
    df, _, _ = load_run(run)
    row = df.set_index("impl").loc["coda-triton"]
    assert row["verdict"] == "faster" and row["speedup_lo"] > 1.05 and row["speedup"] == row["vs_best"]
    saved = json.loads((run / "results.json").read_text())["results"]
    assert {r["impl"]: r["verdict"] for r in saved} == {"torch-compile": "slower", "coda-triton": "faster"}
