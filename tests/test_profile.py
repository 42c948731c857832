"""--profile: where a cell's time goes (codabench/profile.py), recorded after a group's samples into profiles.jsonl
and Chrome traces, carried by merge, shown by the report; a profiler that fails costs a note, never a row."""
import json
import os
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from torch.autograd import DeviceType

import codabench.measure as measure
from codabench import results as tables
from codabench.registry import prepared
from codabench.cli import main
from codabench.case import Case
from codabench.eager import TorchEager
from codabench.execute import forward_shapes, timed_call
from codabench.profile import (CPU_OPS, GPU_KERNELS, MARKER, OTHER, TOP, _Call, _one_call, _summary, _union_us,
                               profile_call, readable)
from codabench.results import RunFolderError, check_run, read_profiles, trace_name
from harness_helpers import isolated_registry
from workloads.models import get_model
from workloads.ops import OPS

CELL = ["--ops", "gemm_out", "--modes", "fwd", "--models", "tiny", "--reps", "1", "--quiet", "--no-entry-points"]
ACTIVITY = GPU_KERNELS if torch.cuda.is_available() else CPU_OPS


@pytest.fixture(autouse=True)
def compile_cache(tmp_path, monkeypatch):
    """The command line points torch.compile's cache beside --out unless it is set: keep it set, and undone after."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind")))


def test_a_profiled_run_records_each_cells_kernels_traces_them_and_reports_them(tmp_path, capsys):
    out = tmp_path / "run"
    with isolated_registry():
        code = main(CELL + ["--impls", "torch-eager,coda-triton", "--out", str(out), "--profile-trace"])
    assert code == 0, capsys.readouterr().err
    df = pd.read_csv(out / "results.csv")
    assert (df["status"] == "ok").all() and (df["n_samples"] == 1).all()  # the timing is the run's, untouched
    env = json.loads((out / "env.json").read_text())
    assert env["profile"] is True and env["profile_trace"] is True  # the run says how it was made
    profiles = read_profiles(out)
    assert sorted(k[-1] for k in profiles) == ["coda-triton", "torch-eager"]
    for key, p in profiles.items():
        assert p["activity"] == ACTIVITY and p["calls"] == 3 and p["note"] == "", p
        kernels = p["kernels"]
        assert kernels and len(kernels) <= TOP + 1 and all(k["launches"] > 0 and k["ms"] >= 0 for k in kernels), p
        assert [k["ms"] for k in kernels if k["name"] != OTHER] == sorted((k["ms"] for k in kernels
                                                                          if k["name"] != OTHER), reverse=True)
        total = sum(k["ms"] for k in kernels)
        assert total == pytest.approx(p["kernel_ms"], rel=1e-3, abs=1e-3)
        assert sum(k["share"] for k in kernels) == pytest.approx(1.0, abs=1e-3)
        if ACTIVITY == CPU_OPS:  # top-level operators of the call: within its host time, never a GPU time
            assert total <= p["host_ms"] + 1e-3 and p["gpu_ms"] is None and p["gemm_ms"] is None, p
        else:
            assert p["gpu_ms"] <= total + 1e-3 and p["gemm_ms"] <= total + 1e-3, p
        assert p["trace"] == f"traces/{trace_name(key)}"
        trace = json.loads((out / p["trace"]).read_text())
        assert any(e.get("name") == MARKER for e in trace["traceEvents"]), p["trace"]
    eager = profiles[("gemm_out", "tiny", "fwd", "fp32", "torch-eager")]
    if ACTIVITY == CPU_OPS:
        assert [k["name"] for k in eager["kernels"]] == ["aten::linear"] and eager["kernels"][0]["launches"] == 1
    check_run(out)
    page = (out / "report.html").read_text()
    section = page[page.index("Where the time goes"):page.index("<h2>Plots</h2>")]
    assert "<details><summary>gemm_out tiny fwd fp32: coda-triton median" in section
    assert section.index("<th class='l' colspan='4'>coda-triton</th>") < \
        section.index("<th class='l' colspan='4'>torch-eager</th>")  # the focus first, the fastest other beside it
    assert all(k["name"] in section for p in profiles.values() for k in p["kernels"])
    assert f"href='traces/{trace_name(('gemm_out', 'tiny', 'fwd', 'fp32', 'coda-triton'))}'" in section

    merged = tmp_path / "merged"
    assert main(["merge", str(merged), str(out)]) == 0
    assert read_profiles(merged) == profiles
    assert sorted(p.name for p in (merged / "traces").iterdir()) == sorted(p.name for p in (out / "traces").iterdir())
    assert "Where the time goes" in (merged / "report.html").read_text()


def test_a_profiler_failure_is_a_note_and_the_profile_comes_after_the_groups_samples(tmp_path, capsys, monkeypatch):
    calls = []
    for name in ("first", "sample", "again", "profile"):
        original = getattr(measure.Measurer, name)
        monkeypatch.setattr(measure.Measurer, name, lambda self, *a, _n=name, _f=original: (calls.append(_n),
                                                                                             _f(self, *a))[1])

    def broken(*args, **kwargs):
        raise RuntimeError("the profiler broke")

    monkeypatch.setattr(measure, "profile_call", broken)
    out = tmp_path / "run"
    with isolated_registry():
        code = main(CELL + ["--impls", "torch-eager", "--out", str(out), "--inline", "--profile"])
    assert code == 0, capsys.readouterr().err
    assert calls == ["first", "sample", "profile"]
    row = pd.read_csv(out / "results.csv").iloc[0]
    assert row["status"] == "ok" and row["median_ms"] > 0
    [record] = read_profiles(out).values()
    assert record["note"].startswith("profiling failed: RuntimeError: the profiler broke (") and "kernels" not in record
    page = (out / "report.html").read_text()
    assert "profiling failed: RuntimeError: the profiler broke" in page
    assert not (out / "traces").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's operators: only without a GPU")
def test_a_backward_cells_profile_holds_the_backward_not_its_forward():
    """The bwd mode's forward is the call's untimed setup: it runs outside the profiler, like outside the timing."""
    op, model, cpu = OPS["rmsnorm_swiglu"], get_model("tiny"), torch.device("cpu")
    eager = TorchEager(op)
    case = Case(op, model, "bwd", "fp32", cpu, op.inputs(model, "fp32", cpu, 0))
    native = prepared(eager, case)
    grads = op.grad_outputs(forward_shapes(op, eager, prepared(eager, case)), 7)
    p = profile_call(timed_call(op, eager, native, "bwd", grads), cpu, calls=2)
    names = [k.name for k in p.kernels]
    assert p.calls == 2 and "MmBackward0" in names and "MulBackward0" in names, names
    assert not any(n.startswith(("aten::rms_norm", "aten::linear", "aten::silu")) for n in names), names
    assert p.kernel_ms <= p.host_ms


def test_kernel_names_are_readable():
    assert readable("gemm_swiglu_kernel_0d1d2de3de4c") == "gemm_swiglu_kernel"  # older Triton's specialization
    assert readable("triton_poi_fused_add_0") == "triton_poi_fused_add_0"  # torch.compile's index stays
    assert readable("triton_poi_fused_add_0_0d1d2de") == "triton_poi_fused_add_0"
    assert readable("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
                    "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)") == \
        "at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
    assert readable("Memcpy HtoD (Pageable -> Device)") == "Memcpy HtoD (Pageable -> Device)"
    assert readable("autograd::engine::evaluate_function: MmBackward0") == "MmBackward0"


def test_the_summary_keeps_the_top_kernels_and_folds_the_rest():
    """Means per call over the calls; the top entries by time, the rest summed into 'other'; shares of the whole
    kernel time; GPU busy time the union of overlapping intervals."""
    calls = [_Call(100.0, 50.0, {"a": [30.0, 1], "b": [20.0, 2], "c": [6.0, 1], "gemm_x": [4.0, 1]}),
             _Call(120.0, 70.0, {"a": [50.0, 1], "b": [20.0, 2], "c": [2.0, 1], "gemm_x": [8.0, 1]})]
    p = _summary(calls, on_gpu=True, top=2)
    assert [(k.name, k.launches) for k in p.kernels] == [("a", 1), ("b", 2), (OTHER, 2)]
    assert [k.ms for k in p.kernels] == pytest.approx([0.040, 0.020, 0.010])
    assert p.kernel_ms == pytest.approx(0.070) and sum(k.share for k in p.kernels) == pytest.approx(1.0)
    assert (p.host_ms, p.gpu_ms, p.gemm_ms) == pytest.approx((0.110, 0.060, 0.006))
    assert _summary(calls, on_gpu=False, top=TOP).gemm_ms is None
    assert _union_us([(0, 10), (5, 12), (20, 25)]) == 17


def test_a_gpu_call_counts_its_kernels_not_its_ranges_or_host_operators():
    """The GPU branch on events shaped as torch.profiler gives them: the marker's CPU range is the host time; its GPU
    shadow (a user annotation) and the CPU operators are no kernels; two launches of one kernel are one entry."""
    def event(name, device, start, end, annotation=False, parent=None):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation, cpu_parent=parent)

    marker = event(MARKER, DeviceType.CPU, 0.0, 50.0, annotation=True)
    events = [marker, event("aten::mm", DeviceType.CPU, 1.0, 5.0, parent=marker),
              event(MARKER, DeviceType.CUDA, 2.0, 90.0, annotation=True),
              event("gemm_swiglu_kernel_0d1d2de", DeviceType.CUDA, 10.0, 40.0),
              event("gemm_swiglu_kernel_0d1d2de", DeviceType.CUDA, 45.0, 60.0),
              event("Memset (Device)", DeviceType.CUDA, 55.0, 70.0)]
    c = _one_call(events, on_gpu=True)
    assert (c.host_us, c.busy_us) == (50.0, 55.0)
    assert c.entries == {"gemm_swiglu_kernel": [45.0, 2], "Memset (Device)": [15.0, 1]}
    assert _one_call(events, on_gpu=False).entries == {"aten::mm": [4.0, 1]}


def test_the_run_folder_checks_know_profiles_and_trace_names_are_safe(tmp_path):
    assert trace_name(("gemm_out", "my model/2", "fwd", "bf16", "x y")) == "gemm_out-my_model_2-fwd-bf16-x_y.json"
    run = tmp_path / "run"
    run.mkdir()
    tables.write_marker(run, "smoke", None, None)
    tables.AppendWriter(run / tables.RESULTS, tables.RESULT_COLUMNS).write([{
        "op": "gemm_out", "impl": "torch-eager", "model": "tiny", "mode": "fwd", "dtype": "fp32", "status": "ok"}])
    (run / tables.PROFILES).write_text('{"op": "gemm_out", "model": "tiny"}\n')
    with pytest.raises(RunFolderError, match="profiles.jsonl, line 1: not a profile record"):
        check_run(run)
