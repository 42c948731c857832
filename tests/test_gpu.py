"""GPU-only paths of the harness: CUDA-event timing, interleaved sweeps, L2 flush, CUDA graphs, ceilings, NVML,
poisoning.

Run on a GPU node with ``python -m pytest -q tests/test_gpu.py``; without a GPU every test here is
reported as skipped (the CPU paths are covered by the other test files).
"""
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from codabench.ceilings import GemmTimer, measure_ceilings, sol_ms
from codabench.env import gpu_info, gpu_state
from codabench.discovery import load_plugin_file
from codabench.report import finalize
from codabench.results import load_run
from codabench import stats, sweep
from codabench.clocks import ClockSampler
from codabench.sweep import Member
from codabench.timing import CUDA_EVENTS, TimingConfig, l2_flusher, measure
from harness_helpers import PLUGINS, isolated_registry, make_runner
from workloads.op import Gemm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda")
FAST = TimingConfig(warmup=2, warmup_ms=5, reps=10)


def test_event_timing_excludes_setup():
    a = torch.randn(2048, 2048, device=GPU)

    def slow_setup():
        torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time, queued before the start event

    t = measure(lambda _: a.mul_(1.0), slow_setup, GPU, FAST)
    assert t.kind == CUDA_EVENTS and len(t.samples_ms) == 10
    assert 0 < t.median < 2.0


def _busy(ms: float) -> None:
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        pass


def test_the_lead_keeps_host_time_before_a_launch_out_of_the_samples():
    """A 4096^3 GEMM, and the same GEMM after 0.4 ms of host work in its call and 0.3 ms in its set-up (its host
    side outlasts its GPU work): behind the lead both loops time the GPU's work alone, within 5%."""
    a = torch.randn(4096, 4096, device=GPU, dtype=torch.float16)
    b = torch.randn_like(a)

    def slow(_):
        _busy(0.4)
        return a @ b

    members = [Member("plain", lambda _: a @ b), Member("slow", slow, lambda _: _busy(0.3))]
    sweep.sample(members, GPU, TimingConfig(min_sweeps=30, max_sweeps=30), ClockSampler(GPU))
    plain, slowed = (statistics.median(m.samples_ms) for m in members)
    assert all(m.error is None for m in members) and members[1].lead_cycles > members[0].lead_cycles > 0
    assert abs(slowed / plain - 1) < 0.05, (plain, slowed)
    assert statistics.median(members[1].host_ms) >= 0.4
    alone = measure(lambda _: a @ b, None, GPU, FAST).median
    behind = measure(slow, lambda: _busy(0.3), GPU, FAST).median
    assert abs(behind / alone - 1) < 0.05, (alone, behind)


def test_during_wraps_only_the_kept_samples_on_the_gpu():
    """The context given as ``during`` (the clock sampler) is entered after the first call, the warm-up and the
    pilot samples, and left after the last kept sample: the calls it sees are the samples."""
    a, calls, seen = torch.randn(1024, 1024, device=GPU), [], []

    @contextmanager
    def during():
        start = len(calls)
        yield
        seen.append(len(calls) - start)

    timing = measure(lambda _: calls.append(a.mul_(1.0)), None, GPU, FAST, during=during)
    assert len(timing.samples_ms) == 10
    assert seen[0] == 10 and len(calls) > 10


def test_l2_flusher_exceeds_l2():
    l2 = getattr(torch.cuda.get_device_properties(GPU), "L2_cache_size", 0)
    assert l2_flusher(GPU).buf.numel() >= 2 * l2 > 0


def test_interleaved_sweeps_settle_record_clocks_and_resolve_planted_work(tmp_path):
    """A group of a GEMM and the same GEMM plus 5% planted GPU work (benchmarks/planted.py), at default settings:
    sampled in sweeps after a settled warm-up, every sample with its clock, and the planted cell called slower."""
    with isolated_registry():
        load_plugin_file(Path(__file__).resolve().parents[1] / "benchmarks" / "planted.py")
        make_runner(tmp_path, device=GPU, models=("llama-7b",), modes=("fwd",), dtypes=("bf16",),
                    impls=["gemm-ref", "gemm-plant-5"]).run()
    df, _, env = load_run(tmp_path)
    rows = {r["impl"]: r for _, r in df.iterrows()}
    for r in rows.values():
        assert r["status"] == "ok" and r["grain"] == "sample" and r["n_sweeps"] >= 20, r["message"]
        assert r["stop"] in ("resolved", "budget") and r["settle_s"] > 0 and r["sm_clock_min_mhz"] > 0
    entries = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all(len(e["sweeps"]) == len(e["samples_ms"]) == len(e["clock_mhz"]) for e in entries)
    assert entries[0]["sweeps"] == entries[1]["sweeps"]  # one sample each per sweep
    timed = stats.read_timed(tmp_path, env)
    ref, planted = (next(t for k, t in timed.items() if k[4] == name) for name in ("gemm-ref", "gemm-plant-5"))
    r = stats.ratio(ref, planted, paired=True)
    assert r.verdict() == "slower" and 1.03 < 1 / r.value < 1.07, r


def test_ceilings_and_gemm_speed_of_light():
    c = measure_ceilings(GPU, FAST)
    assert c["copy_gbps"] > 100 and c["bf16_tflops"] > 10
    assert "fp8_tflops" in c or "fp8_tflops_error" in c
    timer = GemmTimer(GPU, FAST)
    g, h = Gemm(1024, 2048, 512), Gemm(1024, 512, 2048, "km", "kn")
    samples = {g: timer.cached(g, "bf16"), h: timer.cached(h, "bf16")}
    assert timer.cached(g, "bf16") is samples[g] and len(samples[g]) == 10  # measured once per run
    assert sol_ms(samples, [g, g, h]) == pytest.approx(2 * torch.tensor(samples[g]).median().item()
                                                       + torch.tensor(samples[h]).median().item(), rel=0.05)


def test_nvml_state_is_recorded_when_available():
    info = gpu_info(GPU)
    assert info["sm_count"] > 0
    state = gpu_state(GPU)
    if "nvml" not in info:  # nvidia-ml-py present: clocks and temperature read
        assert state["sm_clock_mhz"] > 0 and state["temp_c"] > 0


def test_faulty_plugins_on_the_gpu(tmp_path):
    with isolated_registry():
        load_plugin_file(PLUGINS / "faulty.py")
        load_plugin_file(PLUGINS / "good.py")
        make_runner(tmp_path, device=GPU, timing=FAST,
                    impls=["torch-eager", "test-good", "test-raises", "test-nan", "test-mutates",
                           "test-unwritten", "test-wrong-shape"]).run()
    df, _, _ = load_run(tmp_path)
    rows = {r["impl"]: r for _, r in df.iterrows()}
    assert rows["test-good"]["status"] == "ok" and rows["test-good"]["correct"] is True
    assert rows["test-good"]["timing"] == "cuda-events" and rows["test-good"]["n_samples"] == 10
    for impl in ("test-raises", "test-nan", "test-mutates", "test-unwritten", "test-wrong-shape"):
        assert rows[impl]["status"] == "error", (impl, rows[impl]["message"])
    assert "NaN" in rows["test-unwritten"]["message"]  # the poisoned allocator caught the unwritten rows


def test_work_left_on_a_side_stream_is_caught(tmp_path):
    """The side-stream cheat's events stop early; honest cells get clocks and peak memory."""
    with isolated_registry():
        load_plugin_file(PLUGINS / "cheaters.py")
        make_runner(tmp_path, device=GPU, timing=FAST, models=("llama-1b",), tokens=4096, modes=("fwd",),
                    dtypes=("bf16",), impls=["torch-eager", "cheat-side-stream"]).run()
    df, _, _ = load_run(tmp_path)
    rows = {r["impl"]: r for _, r in df.iterrows()}
    bad = rows["cheat-side-stream"]
    assert bad["status"] == "error" and ("calling stream" in bad["message"] or "events saw" in bad["message"]), \
        bad["message"]
    good = rows["torch-eager"]
    # floor_ms is at the ceilings measured at 8192^3; a short GEMM can beat that probe by a few percent (seen on an
    # H100: 0.0479 ms against a floor of 0.0494 ms), so only the floor at datasheet peaks makes a cell an error
    assert good["status"] == "ok" and good["peak_mem_mib"] > 0 and 0 < good["floor_ms"] < 1.5 * good["median_ms"]
    assert good["sm_clock_min_mhz"] > 0 and good["sm_clock_median_mhz"] >= good["sm_clock_min_mhz"]


def test_bf16_and_fp8_run_with_cuda_graphs(tmp_path):
    with isolated_registry():
        load_plugin_file(PLUGINS / "good.py")
        r = make_runner(tmp_path, device=GPU, timing=FAST, models=("llama-1b",), tokens=512,
                        ops=["gemm_out", "rmsnorm_linear"], dtypes=("bf16", "fp8", "fp8-row"), cuda_graph=True,
                        impls=["torch-eager", "torch-compile", "test-fp8-standin"])
        r.run()
        finalize(tmp_path)
    df, err, env = load_run(tmp_path)
    ok = df[df["status"] == "ok"]
    bad = df[~df["status"].isin(["ok", "n/a"])][["op", "impl", "mode", "dtype", "message"]].to_string()
    assert set(ok["dtype"]) == {"bf16", "fp8", "fp8-row"} and (ok["correct"] == True).all(), bad  # noqa: E712
    assert env["ceilings"]["bf16_tflops"] > 10 and env["ceilings"]["fp8_tflops"] > 10 and env["gpu"]["name"]
    fwd = ok[ok["mode"] == "fwd"]  # fp8 cells are fwd (or direct): every one is graph-captured
    assert set(fwd["timing"]) == {"cuda-graph"} and fwd["message"].str.contains("rotating input sets").all()
    bwd = ok[ok["mode"] != "fwd"]
    assert set(bwd["timing"]) == {"cuda-events"} and set(bwd["dtype"]) == {"bf16"}
    assert (bwd["message"].str.contains("cuda-graph mode covers fwd")).all()
    assert ok["sol_ms"].notna().all() and ok["pct_ceiling"].notna().all() and ok["sm_clock_mhz"].notna().all()
    # fp8: torch-eager and torch-compile are _scaled_mm compositions; the cast is timed on its own
    fp8 = ok[ok["dtype"] != "bf16"]
    assert set(fp8["impl"]) == {"torch-eager", "torch-compile", "test-fp8-standin"}, bad
    assert (fp8["cast_ms"] > 0).all() and (fp8["rel_err_vs_bf16"] > fp8["rel_err"]).all()
    assert fp8[fp8["impl"] == "torch-eager"]["err_ratio"].between(0.95, 1.05).all()  # it is PyTorch's error
    assert fp8["fp8_recipe"].str.endswith("fast accum").all() and env["fp8_accum"] == "fast"
    standin = df[(df["impl"] == "test-fp8-standin") & (df["op"] == "gemm_out")].set_index("dtype")
    assert standin.loc["fp8", "status"] == "ok" and standin.loc["fp8", "sol_ms"] > 0
    assert standin.loc["fp8-row", "status"] == "n/a"  # registered for per-tensor fp8 only
