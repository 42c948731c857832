"""NVML readings during the kept samples (a fake NVML stands in for the GPU) and the flag of cells whose clock dipped."""
import sys
import time
import types

import pandas as pd
import torch

from codabench.clocks import CLOCK_DIP, ClockSampler, Sampled, clock_dips


def fake_nvml(monkeypatch, mhz=1980.0, milliwatts=412_000, celsius=61):
    nv = types.SimpleNamespace(NVML_CLOCK_SM=0, NVML_TEMPERATURE_GPU=0, nvmlInit=lambda: None,
                               nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
                               nvmlDeviceGetClockInfo=lambda h, kind: mhz,
                               nvmlDeviceGetPowerUsage=lambda h: milliwatts,
                               nvmlDeviceGetTemperature=lambda h, sensor: celsius)
    monkeypatch.setitem(sys.modules, "pynvml", nv)


def test_the_timed_region_gets_clock_power_and_temperature_and_the_run_a_trace(monkeypatch):
    fake_nvml(monkeypatch)
    sampler = ClockSampler(torch.device("cuda", 0))  # a device object only: nothing runs on it
    assert sampler.available
    with sampler.sampling(Sampled()) as got:
        time.sleep(0.05)
    assert got.sm_mhz and len(got.sm_mhz) == len(got.power_w) == len(got.temp_c)
    assert (got.sm_mhz[0], got.power_w[0], got.temp_c[0]) == (1980.0, 412.0, 61.0)
    assert len(sampler.trace) == 1 and sampler.trace[0][1:] == (1980.0, 412.0, 61.0)  # thinned to TRACE_EVERY_S


def test_the_gpu_is_found_by_its_uuid_not_by_cudas_index(monkeypatch):
    """With CUDA_VISIBLE_DEVICES=1, CUDA's device 0 is NVML's GPU 1: NVML must be asked for the UUID."""
    fake_nvml(monkeypatch)
    asked = []
    sys.modules["pynvml"].nvmlDeviceGetHandleByUUID = lambda uuid: asked.append(uuid) or "gpu-by-uuid"
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(uuid="2b4e8a3c-0000-1111-2222-333344445555"))
    sampler = ClockSampler(torch.device("cuda", 0))
    assert sampler._handle == "gpu-by-uuid" and asked == ["GPU-2b4e8a3c-0000-1111-2222-333344445555"]


def test_without_nvml_nothing_is_sampled():
    sampler = ClockSampler(torch.device("cpu"))
    with sampler.sampling(Sampled()) as got:
        pass
    assert not sampler.available and got == Sampled() and sampler.trace == []


def test_cells_whose_clock_fell_more_than_ten_percent_below_the_runs_median_are_flagged():
    run_median = 1800.0
    df = pd.DataFrame({
        "status": ["ok", "ok", "ok", "ok", "error"],
        "sm_clock_median_mhz": [run_median, run_median, run_median + 100, run_median - 50, None],
        "sm_clock_min_mhz": [run_median * (1 - CLOCK_DIP) - 1, run_median * (1 - CLOCK_DIP) + 1, 1900, 1700, 900]})
    assert clock_dips(df).tolist() == [True, False, False, False, False]
    no_clocks = df.assign(sm_clock_median_mhz=None, sm_clock_min_mhz=None)
    assert not clock_dips(no_clocks).any()
