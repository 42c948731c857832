"""Intervals and verdicts (codabench.stats): paired sweeps cancel a drifting clock that contiguous blocks turn into a
false difference, real differences are found, equal cells read `same` only inside the margin, old runs still read,
and the run's derived speed columns follow the rules."""
import json
import math
from collections import Counter

import numpy as np
import pandas as pd
import pytest

from codabench import results as tables
from codabench.report import finalize
from codabench.results import load_run
from codabench.stats import (MIN_PAIRS, MIN_SAMPLES, ROUND, SAME_WITHIN, SAMPLE, Ratio, Timed, median_rank, ratio,
                             read_timed, speed_figures, timing_settings)
from synthetic_runs import noisy_rounds, write_run

TOP, CAP = 1980.0, 1485.0
"""An H100 at its power cap: the SM clock falls from the top clock to this inside one cell."""


def falling_clock(n: int) -> np.ndarray:
    return np.linspace(TOP, CAP, n)


def interleaved(rng, bases: list[float], sweeps: int, noise: float = 0.01) -> list[Timed]:
    """Each implementation (time ``base`` at the top clock, scaling with 1/clock) takes one sample per sweep, in a
    random order within the sweep, while the clock falls across the whole cell."""
    clock = falling_clock(len(bases) * sweeps).reshape(sweeps, len(bases))
    out = [[] for _ in bases]
    for s in range(sweeps):
        for slot, impl in enumerate(rng.permutation(len(bases))):
            out[impl].append(bases[impl] * TOP / clock[s, slot] * np.exp(rng.normal(0, noise)))
    return [Timed(x, range(sweeps), "cuda-events", f"impl{j}") for j, x in enumerate(out)]


def in_blocks(rng, bases: list[float], rounds: int = 3, per_round: int = 7, noise: float = 0.01) -> list[Timed]:
    """The same cell sampled the old way: per round, each implementation takes a contiguous block of samples."""
    clock = falling_clock(len(bases) * rounds * per_round).reshape(rounds, len(bases), per_round)
    out = [[[] for _ in range(rounds)] for _ in bases]
    for r in range(rounds):
        for impl, base in enumerate(bases):
            out[impl][r] = list(base * TOP / clock[r, impl] * np.exp(rng.normal(0, noise, per_round)))
    return [Timed.from_rounds(x, "cuda-events", f"impl{j}") for j, x in enumerate(out)]


def test_a_falling_clock_biases_contiguous_blocks_and_cancels_in_interleaved_sweeps():
    """Two identical implementations under the drifting clock: in blocks the second reads several % slower and is
    called slower in most trials; in 150 interleaved sweeps the paired ratio stays within 0.5% of 1 and reads `same`
    in >= 95% of the trials."""
    rng = np.random.default_rng(1)
    blocks = [ratio(*in_blocks(rng, [1.0, 1.0]), paired=True) for _ in range(100)]
    assert np.median([abs(r.value - 1) for r in blocks]) > 0.02
    assert sum(r.verdict() in ("faster", "slower") for r in blocks) >= 50, Counter(r.verdict() for r in blocks)
    sweeps = [ratio(*interleaved(rng, [1.0, 1.0], 150), paired=True) for _ in range(100)]
    verdicts = Counter(r.verdict() for r in sweeps)
    assert all(abs(r.value - 1) < 0.005 for r in sweeps)
    assert verdicts["same"] >= 95 and verdicts["faster"] + verdicts["slower"] <= 5, verdicts
    assert all(r.lo <= r.value <= r.hi for r in sweeps)


@pytest.mark.parametrize("sweeps", [100, 200])
def test_a_planted_two_percent_is_found_under_the_same_drift(sweeps):
    rng = np.random.default_rng(2)
    found = [ratio(*interleaved(rng, [1.0, 1.02], sweeps), paired=True) for _ in range(60)]
    assert sum(r.verdict() == "slower" for r in found) >= 0.9 * len(found)
    assert np.median([r.value for r in found]) == pytest.approx(1 / 1.02, abs=0.003)


def test_the_paired_interval_covers_equal_cells_at_its_level():
    rng = np.random.default_rng(3)
    covered = 0
    for t in range(200):
        a, b = (Timed(np.exp(rng.normal(0, 0.01, 60)), range(60), "cuda-events", f"{s}{t}") for s in "ab")
        r = ratio(a, b, paired=True)
        covered += r.lo <= 1 <= r.hi
    assert covered >= 0.94 * 200


def test_verdict_boundaries_and_half_width():
    assert Ratio(1.03, 1.01, 1.07).verdict() == "faster" and Ratio(0.97, 0.95, 0.99).verdict() == "slower"
    assert Ratio(1.0, 0.99, 1.01).verdict() == "same"
    assert Ratio(1.0, 1 / 1.02, 1.02).verdict() == "same"  # the margin's own bounds are inside it
    assert Ratio(1.0, 0.99, 1.0201).verdict() == "unresolved" and Ratio(1.0, 0.97, 1.01).verdict() == "unresolved"
    assert Ratio(1.0, 0.97, 1.03).verdict() == "unresolved" and Ratio(1.0, 0.97, 1.03).verdict(0.05) == "same"
    assert Ratio(1.01, 1.0, 1.02).verdict() == "same"  # lo == 1 is not above 1
    assert Ratio(1.001, 1.0005, 1.002).verdict() == "faster"  # beyond noise, however small
    assert Ratio(2.0, 1.9, 2.2).half_width == pytest.approx(0.1) and Ratio(1.0, 0.99, 1.0).half_width == \
        pytest.approx(0.01)
    assert SAME_WITHIN == 0.02


def test_no_interval_for_cpu_wall_times_too_few_samples_or_too_few_common_sweeps():
    rng = np.random.default_rng(4)
    x = np.exp(rng.normal(0, 0.01, 40))
    assert ratio(Timed(x, range(40), "cpu-wall", "a"), Timed(x, range(40), "cpu-wall", "b"), paired=True) is None
    few = Timed(x[:MIN_SAMPLES - 1], range(MIN_SAMPLES - 1), "cuda-events", "few")
    assert ratio(few, Timed(x, range(40), "cuda-events", "b"), paired=True) is None
    # 40 samples each but only MIN_PAIRS - 1 sweeps in common
    a = Timed(x, range(40), "cuda-events", "a")
    b = Timed(x, range(40 - MIN_PAIRS + 1, 80 - MIN_PAIRS + 1), "cuda-events", "b")
    assert ratio(a, b, paired=True) is None
    assert ratio(a, Timed(x, range(40 - MIN_PAIRS, 80 - MIN_PAIRS), "cuda-events", "b"), paired=True) is not None
    assert median_rank(5) == -1 and median_rank(10) == 1  # [x_(1), x_(8)] of 10: 97.9% coverage
    for n in (11, 50, 151, 400):  # the largest k whose binomial tail P(Bin(n, 1/2) <= k) stays within 2.5%
        k = median_rank(n)
        tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
        assert tail <= 0.025 < tail + math.comb(n, k + 1) / 2 ** n, n


def test_pairs_join_on_common_sweeps_whatever_the_order_of_the_entry():
    """A cell that missed sweeps (dropped after a failure) pairs on the sweeps it has; sweep ids, not positions,
    pair the samples."""
    rng = np.random.default_rng(5)
    level = np.exp(np.linspace(0, 0.3, 50))  # a drift that only pairing by sweep cancels
    ref = level * np.exp(rng.normal(0, 0.002, 50))
    cell = level / 1.05 * np.exp(rng.normal(0, 0.002, 50))
    keep = np.r_[0:20, 30:50]  # sweeps 20-29 missing
    shuffled = rng.permutation(keep)
    r = ratio(Timed(ref, range(50), "cuda-events", "ref"),
              Timed(cell[shuffled], shuffled, "cuda-events", "cell"), paired=True)
    assert r.verdict() == "faster" and r.value == pytest.approx(1.05, abs=0.002) and r.hi < 1.06
    with pytest.raises(ValueError, match="3 samples but 2 sweep ids"):
        Timed([1.0, 2.0, 3.0], [0, 1], "cuda-events", "bad")
    with pytest.raises(ValueError, match="a sweep id repeats"):
        Timed([1.0, 2.0, 3.0], [0, 1, 1], "cuda-events", "bad")


def test_entries_of_old_and_new_runs():
    new = Timed.from_entry({"timing": "cuda-events", "samples_ms": [3.0, 1.0, 2.0], "sweeps": [2, 0, 1],
                            "grain": "sample"}, "k")
    assert new.grain == SAMPLE and new.samples.tolist() == [1.0, 2.0, 3.0] and new.sweeps.tolist() == [0, 1, 2]
    assert Timed.from_entry({"samples_ms": [1.0], "sweeps": [0]}, "k").grain == SAMPLE  # grain defaults to sample
    old = Timed.from_entry({"timing": "cuda-events", "samples_ms": [1, 2, 3, 4, 5], "rounds": [[1, 2], [3, 4, 5]]},
                           "k")
    assert old.grain == ROUND and old.sweeps.tolist() == [0, 0, 1, 1, 1] and len(old.blocks) == 2
    oldest = Timed.from_entry({"timing": "cuda-events", "samples_ms": [1, 2, 3]}, "k")
    assert oldest.grain == ROUND and oldest.sweeps.tolist() == [0, 0, 0]
    rounds = Timed.from_entry({"samples_ms": [1.0] * 6, "sweeps": [0, 0, 0, 1, 1, 1], "grain": "round"}, "k")
    assert [len(b) for b in rounds.blocks] == [3, 3]
    batches = Timed(np.ones(47), range(47), "cuda-events", "k").blocks  # grain sample: contiguous batches
    assert [len(b) for b in batches] == [6, 6, 5, 5, 5, 5, 5, 5, 5]
    assert len(Timed(np.ones(200), range(200), "cuda-events", "k").blocks) == 10


def test_runs_without_stored_rounds_are_split_by_the_runs_rounds(tmp_path):
    """Runs from before samples.jsonl kept rounds pooled them in round order, the same number per round when --reps
    was fixed."""
    key = ("gemm_out", "llama-1b", "fwd", "bf16", "torch-compile")
    for name, timing, expected in (("fixed", {"reps": 6, "rounds": 3}, [0, 0, 1, 1, 2, 2]),
                                   ("adaptive", {"reps": None, "rounds": 3}, [0] * 6)):
        d = tmp_path / name
        d.mkdir()
        tables.append_jsonl(d / tables.SAMPLES, {**dict(zip(tables.KEY, key)), "samples_ms": [1, 2, 3, 4, 5, 6]})
        t = read_timed(d, {"timing": timing})[key]
        assert t.grain == ROUND and t.sweeps.tolist() == expected, name


def test_timing_settings_default_when_absent():
    assert timing_settings({}) == (0.01, 0.02)
    assert timing_settings({"timing": {"rounds": 3}}) == (0.01, 0.02)
    assert timing_settings({"timing": {"precision": 0.005, "same_within": 0.03}}) == (0.005, 0.03)


def test_rounds_pair_a_common_drift_and_a_round_that_disagrees_widens_the_interval():
    """Old runs (grain "round"): a drift common to both cells' round cancels; a round where the ratio differs widens
    the interval to cover it."""
    rng = np.random.default_rng(4)
    levels = [1.0, 1.15, 0.9]
    ref = [list(lv * 2.0 * np.exp(rng.normal(0, 0.003, 7))) for lv in levels]
    fast = [list(lv * 2.0 / 1.05 * np.exp(rng.normal(0, 0.003, 7))) for lv in levels]
    r = ratio(Timed.from_rounds(ref, "cuda-events", "ref"), Timed.from_rounds(fast, "cuda-events", "fast"), True)
    assert r.verdict() == "faster" and r.lo > 1.03 and r.hi < 1.07
    odd = [list(f / s * 2.0 * np.exp(rng.normal(0, 0.003, 7))) for f, s in zip(levels, (1.05, 1.05, 0.95))]
    wide = ratio(Timed.from_rounds(ref, "cuda-events", "ref"), Timed.from_rounds(odd, "cuda-events", "odd"), True)
    assert wide.verdict() == "unresolved" and wide.lo < 1 < wide.hi


def test_unpaired_intervals_need_two_blocks_and_cut_sweeps_into_batches():
    rng = np.random.default_rng(6)
    a = Timed(2.0 * np.exp(rng.normal(0, 0.01, 150)), range(150), "cuda-events", "a")
    b = Timed(2.1 * np.exp(rng.normal(0, 0.01, 150)), range(150), "cuda-events", "b")
    r = ratio(a, b, paired=False)
    assert r.verdict() == "slower" and r.lo < 2.0 / 2.1 < r.hi and r.half_width < 0.01
    same = ratio(a, Timed(2.0 * np.exp(rng.normal(0, 0.01, 150)), range(150), "cuda-events", "c"), paired=False)
    assert same.verdict() == "same"
    nine = Timed(np.ones(9), range(9), "cuda-events", "nine")  # one batch only: no spread between batches
    assert ratio(nine, a, paired=False) is None
    one_round = Timed.from_rounds([list(np.ones(20))], "cuda-events", "one")
    assert ratio(one_round, a, paired=False) is None


def group(samples_by_impl: dict[str, list[list[float]]], timing="cuda-events", sweeps=False, **fields):
    """One group's rows and their samples.jsonl objects (by round, or one sample per sweep)."""
    rows, entries = [], {}
    for impl, rs in samples_by_impl.items():
        key = ("block", "llama-1b", "fwd", "bf16", impl)
        rows.append({**dict(zip(tables.KEY, key)), "status": "ok", "median_ms": float(np.median(sum(rs, []))),
                     "timing": timing, "correct": True, **fields.get(impl, {})})
        entries[key] = ({"samples_ms": sum(rs, []), "sweeps": [i for i, r in enumerate(rs) for _ in r]} if sweeps
                        else {"samples_ms": sum(rs, []), "rounds": rs})
    df = pd.DataFrame(rows, columns=tables.RESULT_COLUMNS)
    df["correct"] = df["correct"].astype(object)
    return df, entries


def test_speed_figures_of_a_group_sampled_in_rounds():
    rng = np.random.default_rng(5)
    df, entries = group({"torch-eager": noisy_rounds(rng, 3.0, noise=0.004, drift=0.003),
                         "torch-compile": noisy_rounds(rng, 2.0, noise=0.004, drift=0.003),
                         "coda-triton": noisy_rounds(rng, 1.9, noise=0.004, drift=0.003),
                         "liger": noisy_rounds(rng, 2.0, noise=0.004, drift=0.003),
                         "test-wrong": noisy_rounds(rng, 1.0, noise=0.004, drift=0.003)},
                        **{"test-wrong": {"correct": False}})
    out = speed_figures(df, entries).set_index("impl")
    med = out["median_ms"]
    assert out.loc["torch-compile", ["speedup", "speedup_lo", "speedup_hi"]].tolist() == [1.0, 1.0, 1.0]
    assert out.loc["coda-triton", "speedup"] == pytest.approx(med["torch-compile"] / med["coda-triton"])
    # the fastest other is the fastest correct one: test-wrong never sets the bar
    assert out.loc["coda-triton", "vs_best"] == pytest.approx(min(med["torch-compile"], med["liger"])
                                                              / med["coda-triton"])
    assert out.loc["torch-compile", "vs_best"] == pytest.approx(med["coda-triton"] / med["torch-compile"])
    assert out.loc["test-wrong", "vs_best"] == pytest.approx(med["coda-triton"] / med["test-wrong"])
    assert out["verdict"].to_dict() == {"torch-eager": "slower", "torch-compile": "slower", "coda-triton": "faster",
                                        "liger": "slower", "test-wrong": "faster"}
    for p in ("speedup", "vs_best"):
        assert (out[p + "_lo"] <= out[p]).all() and (out[p] <= out[p + "_hi"]).all()
    again = speed_figures(df, entries).set_index("impl")  # reproducible: seeded by the cell
    alone = speed_figures(df[df["impl"].isin(["torch-compile", "coda-triton"])], entries).set_index("impl")
    assert again.loc["coda-triton", "speedup_lo"] == out.loc["coda-triton", "speedup_lo"] \
        == alone.loc["coda-triton", "speedup_lo"]


def test_speed_figures_of_a_group_sampled_in_sweeps_use_the_paired_estimate():
    rng = np.random.default_rng(8)
    compile_, coda, liger = interleaved(rng, [2.0, 1.9, 2.0], 120)
    per_sweep = {name: [[float(v)] for v in t.samples]
                 for name, t in (("torch-compile", compile_), ("coda-triton", coda), ("liger", liger))}
    df, entries = group(per_sweep, sweeps=True)
    out = speed_figures(df, entries).set_index("impl")
    paired = ratio(compile_, coda, paired=True)
    assert out.loc["coda-triton", "speedup"] == pytest.approx(paired.value)  # not the ratio of the medians
    assert out.loc["coda-triton", "speedup"] != pytest.approx(out.loc["torch-compile", "median_ms"]
                                                              / out.loc["coda-triton", "median_ms"], abs=1e-4)
    assert out.loc["torch-compile", ["speedup", "speedup_lo", "speedup_hi"]].tolist() == [1.0, 1.0, 1.0]
    assert out["verdict"].to_dict() == {"torch-compile": "slower", "coda-triton": "faster", "liger": "slower"}
    assert out.loc["coda-triton", "speedup"] == pytest.approx(2.0 / 1.9, abs=0.005)
    strict = speed_figures(df[df["impl"] != "coda-triton"], entries, same_within=0.001)
    assert (strict["verdict"] == "unresolved").all()  # +-0.4% intervals are not inside +-0.1%
    assert (speed_figures(df[df["impl"] != "coda-triton"], entries)["verdict"] == "same").all()


def test_no_interval_for_cpu_wall_times_few_samples_or_a_lone_implementation():
    rng = np.random.default_rng(6)
    cpu, entries = group({"torch-compile": [[1.0]], "coda-triton": [[2.0]]}, timing="cpu-wall")
    out = speed_figures(cpu, entries)
    assert out["speedup"].tolist() == [1.0, 0.5] and out["speedup_lo"].isna().all()
    assert (out["verdict"] == "n/a").all() and out["vs_best"].tolist() == [2.0, 0.5]
    few, entries = group({"torch-compile": noisy_rounds(rng, 1.0), "coda-triton": [[1.0] * (MIN_SAMPLES - 1)]})
    assert (speed_figures(few, entries)["verdict"] == "n/a").all()
    alone, entries = group({"coda-triton": noisy_rounds(rng, 1.0)})
    out = speed_figures(alone, entries)
    assert out["verdict"].tolist() == ["n/a"] and out["vs_best"].isna().all() and out["speedup"].isna().all()


def test_finalize_writes_the_intervals_and_verdicts_with_the_runs_margin(tmp_path):
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
    twins = {("block", "llama-1b", "fwd", "bf16", impl): [[float(v)] for v in t.samples]
             for impl, t in zip(("torch-compile", "liger"), interleaved(rng, [2.0, 2.0], 120))}
    for margin, verdict in ((None, "same"), (0.001, "unresolved")):
        env = {"timing": {"same_within": margin}} if margin else {}
        run = write_run(tmp_path / f"twins{margin}", twins, env=env, sweeps=True)
        finalize(run)
        assert set(load_run(run)[0]["verdict"]) == {verdict}, margin


def test_a_malformed_samples_object_costs_its_cell_an_interval_not_the_report(tmp_path, capsys):
    rng = np.random.default_rng(9)
    twins = {("block", "llama-1b", "fwd", "bf16", impl): [[float(v)] for v in t.samples]
             for impl, t in zip(("torch-compile", "liger", "coda-triton"), interleaved(rng, [2.0, 2.0, 2.4], 60))}
    run = write_run(tmp_path / "run", twins, sweeps=True)  # coda-triton the slowest: never the bar of the others
    lines = (run / tables.SAMPLES).read_text().splitlines()
    bad = json.loads(lines[2])
    bad["sweeps"] = bad["sweeps"][:-1]
    (run / tables.SAMPLES).write_text("\n".join(lines[:2] + [json.dumps(bad)]) + "\n")
    finalize(run)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "coda-triton: 60 samples but 59 sweep ids; that cell gets no interval" in err
    verdicts = load_run(run)[0].set_index("impl")["verdict"].to_dict()
    assert verdicts == {"torch-compile": "same", "liger": "same", "coda-triton": "n/a"}
