"""``compare`` of two runs: unpaired deltas with the four verdicts (plus `unknown`), and the delta relative to each
run's torch-compile, which cancels a clock that ran lower through a whole run."""
import numpy as np
import pytest

from codabench.report.compare import compare, format_compare
from synthetic_runs import noisy_rounds, write_run

CELLS = [("gemm_out", f"m{i}", "fwd", "bf16", impl) for i in range(60) for impl in ("torch-compile", "coda-triton")]


def two_runs(tmp_path, change: float = 1.0, noise: float = 0.015, drift: float = 0.015, rounds: int = 3,
             timing: str = "cuda-events", seed: int = 0):
    """Runs A and B of the same cells (medians from 0.05 to 50 ms) sampled in rounds; B's times are A's
    distribution x ``change``."""
    rng = np.random.default_rng(seed)
    medians = {c: float(m) for c, m in zip(CELLS, np.exp(rng.uniform(np.log(0.05), np.log(50), len(CELLS))))}
    per_round = max(1, 21 // rounds)
    runs = []
    for name, factor in (("a", 1.0), ("b", change)):
        cells = {c: noisy_rounds(rng, m * factor, rounds, per_round, noise, drift) for c, m in medians.items()}
        runs.append(write_run(tmp_path / name, cells, timing))
    return runs


def swept_runs(tmp_path, clock_b: float = 1.0, coda_b: float = 1.0, drift: float = 0.25, sweeps: int = 100,
               noise: float = 0.01, groups: int = 20, seed: int = 0):
    """Runs A and B sampled in sweeps (one sample per cell per sweep). Each sweep of a group runs at its own clock
    level (times growing by ``drift`` across the cell, plus sweep-to-sweep wander, common to the group's cells); in B
    every time is ``clock_b`` x A's (a whole run on a lower clock) and coda-triton's also ``coda_b`` x (a real
    change)."""
    rng = np.random.default_rng(seed)
    runs = []
    for name, clock, coda in (("a", 1.0, 1.0), ("b", clock_b, coda_b)):
        cells = {}
        for g in range(groups):
            level = clock * np.linspace(1.0, 1.0 + drift, sweeps) * np.exp(rng.normal(0, 0.01, sweeps))
            for impl, base in (("torch-compile", 2.0), ("coda-triton", 1.9 * coda)):
                times = base * level * np.exp(rng.normal(0, noise, sweeps))
                cells[("gemm_out", f"m{g}", "fwd", "bf16", impl)] = [[float(t)] for t in times]
        runs.append(write_run(tmp_path / name, cells, sweeps=True))
    return runs


def test_an_a_a_comparison_of_identical_code_finds_no_change(tmp_path):
    """Two runs of the same code sampled in 3 rounds (independent round drift in each): at least 95% of the cells are
    not called faster or slower, and every cell has an interval."""
    m = compare(*two_runs(tmp_path))
    assert len(m) == len(CELLS) and (m["verdict"] != "unknown").all()
    assert m["verdict"].isin(["same", "unresolved"]).mean() >= 0.95, m["verdict"].value_counts().to_dict()
    assert ((m["delta_lo_pct"] <= m["delta_pct"]) & (m["delta_pct"] <= m["delta_hi_pct"])).all()
    assert f"{len(CELLS)} cells, {len(CELLS)} timed in both; B vs A: " in format_compare(m)


def test_an_a_a_comparison_of_swept_runs_is_same(tmp_path):
    """Without drift inside the cells both deltas read `same`. With the clock drifting 25% across each cell the
    unpaired interval (its batches differ by the drift) cannot decide, and says so; the relative delta, paired
    within each run, still reads `same`."""
    steady = compare(*swept_runs(tmp_path / "steady", drift=0.0, groups=30))
    assert (steady["verdict"] == "same").mean() >= 0.95, steady["verdict"].value_counts().to_dict()
    drifting = compare(*swept_runs(tmp_path / "drifting", groups=30))
    assert (drifting["verdict"] == "unresolved").mean() >= 0.95, drifting["verdict"].value_counts().to_dict()
    for m in (steady, drifting):
        coda = m[m["impl"] == "coda-triton"]
        assert (coda["rel_verdict"] == "same").mean() >= 0.95, coda["rel_verdict"].value_counts().to_dict()


@pytest.mark.parametrize("change, verdict", [(1.05, "slower"), (1 / 1.05, "faster")])
def test_a_real_five_percent_change_with_low_noise_is_found(tmp_path, change, verdict):
    m = compare(*two_runs(tmp_path, change=change, noise=0.004, drift=0.003))
    assert (m["verdict"] == verdict).all(), m["verdict"].value_counts().to_dict()
    assert np.allclose(m["delta_pct"], 100 * (change - 1), atol=1.5)


def test_the_relative_delta_cancels_a_run_wide_clock_difference(tmp_path):
    """Run B on a 10% slower clock for every implementation: the absolute delta reads slower, the delta relative to
    each run's torch-compile reads same."""
    m = compare(*swept_runs(tmp_path, clock_b=1.10))
    assert (m["verdict"] == "slower").all(), m["verdict"].value_counts().to_dict()
    assert np.allclose(m["delta_pct"], 10.0, atol=2.5)  # the medians of cells drifting 25% wander
    coda, base = m[m["impl"] == "coda-triton"], m[m["impl"] == "torch-compile"]
    assert (coda["rel_verdict"] == "same").all(), coda["rel_verdict"].value_counts().to_dict()
    assert (coda["rel_lo_pct"] <= coda["rel_delta_pct"]).all() and (coda["rel_delta_pct"] <= coda["rel_hi_pct"]).all()
    assert coda["rel_delta_pct"].abs().max() < 1.0
    assert (base["rel_verdict"] == "unknown").all() and base["rel_delta_pct"].isna().all()  # the base itself
    text = format_compare(m)
    assert "0 faster, 40 slower, 0 same, 0 unresolved, 0 unknown" in text
    assert "relative to each run's torch-compile: 0 faster, 0 slower, 20 same, 0 unresolved, 20 unknown" in text


def test_the_relative_delta_finds_a_real_change_under_the_clock_difference(tmp_path):
    m = compare(*swept_runs(tmp_path, clock_b=1.10, coda_b=1.04))
    coda = m[m["impl"] == "coda-triton"]
    assert (coda["rel_verdict"] == "slower").all(), coda["rel_verdict"].value_counts().to_dict()
    assert np.allclose(coda["rel_delta_pct"], 4.0, atol=1.0)


def test_cpu_wall_and_single_round_runs_compare_as_unknown(tmp_path):
    cpu = compare(*two_runs(tmp_path / "cpu", change=2.0, noise=0.004, drift=0.003, timing="cpu-wall"))
    assert (cpu["verdict"] == "unknown").all() and cpu["delta_lo_pct"].isna().all()
    assert (cpu["rel_verdict"] == "unknown").all()
    assert "cpu-wall times (the Triton interpreter on the CPU) are not performance figures" in format_compare(cpu)
    one = compare(*two_runs(tmp_path / "one", change=1.05, rounds=1))  # drift between runs is unknowable
    assert (one["verdict"] == "unknown").all()
    assert f"0 faster, 0 slower, 0 same, 0 unresolved, {len(CELLS)} unknown" in format_compare(one)
    assert "not performance figures" not in format_compare(one)


def test_a_cell_timed_at_two_token_counts_is_not_compared(tmp_path):
    """A run resumed or rerun at another --tokens is not a change of speed: that cell has no delta and `unknown`
    verdicts, and the summary counts it; the other cells compare as usual."""
    rng = np.random.default_rng(0)
    cells = {c: noisy_rounds(rng, 1.0, 3, 7, 0.01, 0.01) for c in CELLS[:4]}
    a = write_run(tmp_path / "a", cells, rows={c: {"tokens": 48} for c in cells})
    b = write_run(tmp_path / "b", {c: [[t * 1.25 for t in r] for r in rounds] for c, rounds in cells.items()},
                  rows={c: {"tokens": 96 if c == CELLS[1] else 48} for c in cells})
    m = compare(a, b)
    other = m[m["other_shape"]]
    assert [tuple(r) for r in other[["op", "model", "mode", "dtype", "impl"]].values] == [CELLS[1]]
    assert other["delta_pct"].isna().all() and (other[["verdict", "rel_verdict"]] == "unknown").all(axis=None)
    assert (m[~m["other_shape"]]["verdict"] == "slower").all()
    assert "4 cells, 3 timed in both; B vs A: " in format_compare(m)
    assert "; 1 timed at different token counts, not compared" in format_compare(m)
