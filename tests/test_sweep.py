"""The interleaved sweeps of a group (codabench/sweep.py) and the timed calls' checks (codabench/measure.py), on the
CPU: every member once per sweep in a random order, pairing that cancels a drifting clock, the stopping rule, and
the cheats that only the timed calls can catch."""
import collections
import math
from dataclasses import replace
from time import perf_counter

import numpy as np
import pytest
import torch

from codabench import guard, stats, sweep, timing
from codabench.clocks import ClockSampler, Sampled
from codabench.discovery import load_plugin_file
from codabench.execute import CellError, check_outputs, moved
from codabench.results import load_run
from codabench.sweep import Member
from codabench.timing import CUDA_EVENTS, TimingConfig, graph_sets
from harness_helpers import CPU, PLUGINS, isolated_registry, make_runner


def busy(ms: float) -> None:
    t0 = perf_counter()
    while (perf_counter() - t0) * 1e3 < ms:
        pass


class Drift:
    """A GPU clock falling as the run goes on: a call of ``base`` ms takes base x factor(), factor rising from 1 to
    1980/1485 (the H100 at its power cap) over ``span_s`` seconds."""

    def __init__(self, span_s: float):
        self.t0, self.span_s = perf_counter(), span_s

    def factor(self) -> float:
        return 1 + (1980 / 1485 - 1) * min((perf_counter() - self.t0) / self.span_s, 1.0)


def timed(m: Member) -> stats.Timed:
    return stats.Timed(m.samples_ms, m.sweeps, CUDA_EVENTS, m.name)  # CPU wall times standing in for GPU samples


def test_every_member_is_sampled_once_per_sweep_in_an_order_drawn_for_each_sweep():
    order = []
    members = [Member(n, lambda _, n=n: order.append(n)) for n in "abc"]
    out = sweep.sample(members, CPU, TimingConfig(cpu_reps=40), ClockSampler(CPU))
    assert out.n_sweeps == 40 and out.stop == "cpu"
    assert all(m.sweeps == list(range(40)) and len(m.samples_ms) == 40 for m in members)
    sweeps = [tuple(order[3 * i:3 * i + 3]) for i in range(40)]
    assert all(sorted(s) == ["a", "b", "c"] for s in sweeps)
    assert len(set(sweeps)) >= 3  # 6 orders possible: a fixed order would give 1


def test_a_member_that_fails_is_dropped_with_its_error_and_the_others_go_on():
    calls = {"n": 0}

    def flaky(_):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("broke at call 5")

    def bad_output(sweep_id, returned):
        if sweep_id == 3:
            raise CellError("checked and wrong")

    members = [Member("good", lambda _: None), Member("flaky", flaky), Member("checked", lambda _: None,
                                                                               after=bad_output)]
    sweep.sample(members, CPU, TimingConfig(cpu_reps=10), ClockSampler(CPU))
    good, flaky_m, checked = members
    assert good.error is None and good.sweeps == list(range(10))
    assert "broke at call 5" in flaky_m.error and calls["n"] == 5  # not called again once it failed
    assert "checked and wrong" in checked.error and len(checked.sweeps) < 10


def test_paired_sweeps_cancel_a_drifting_clock_that_separate_blocks_do_not():
    """Two identical kernels under a clock that falls by 25% during the measurement: sampled interleaved, their
    paired ratio stays at 1 (within 2%); sampled one block after the other, the second looks >= 8% slower."""
    n, base = 120, 1.5
    drift = Drift(span_s=2 * n * base * 1.17e-3)
    twins = [Member(n_, lambda _: busy(base * drift.factor())) for n_ in ("a", "b")]
    sweep.sample(twins, CPU, TimingConfig(cpu_reps=n), ClockSampler(CPU))
    paired = stats.ratio(timed(twins[0]), timed(twins[1]), paired=True)
    assert abs(paired.value - 1) < 0.02, paired

    drift = Drift(span_s=2 * n * base * 1.17e-3)
    blocks = [Member(n_, lambda _: busy(base * drift.factor())) for n_ in ("a", "b")]
    for m in blocks:  # today's contiguous sampling: all of a, then all of b
        sweep.sample([m], CPU, TimingConfig(cpu_reps=n), ClockSampler(CPU))
    separate = stats.ratio(timed(blocks[0]), timed(blocks[1]), paired=True)
    assert separate.value < 0.92, separate


def test_sampling_stops_once_resolved_and_otherwise_at_its_budget():
    cfg = TimingConfig(precision=0.03, min_sweeps=20, max_sweeps=400, target_ms=2000.0)
    members = [Member("a", lambda _: busy(1.0)), Member("b", lambda _: busy(1.3))]
    n, stop, widths = sweep._sweep(members, CPU, cfg, None, np.random.default_rng(0), 2.3e-3, "a", guard.private_clocks())
    assert stop == "resolved" and 20 <= n < 400 and max(widths.values()) <= 0.03
    r = stats.ratio(timed(members[0]), timed(members[1]), paired=True)
    assert r.verdict() == "slower"  # b against a

    cfg = TimingConfig(precision=1e-6, min_sweeps=20, max_sweeps=10_000, target_ms=40.0, budget_factor=1.0)
    members = [Member("a", lambda _: busy(1.0)), Member("b", lambda _: busy(1.0))]
    t0 = perf_counter()
    n, stop, widths = sweep._sweep(members, CPU, cfg, None, np.random.default_rng(0), 2e-3, "a", guard.private_clocks())
    assert stop == "budget" and n < 10_000 and perf_counter() - t0 < 2.0
    assert all(0 < w < math.inf for w in widths.values())


def test_the_next_chunk_is_enqueued_before_the_last_one_is_read():
    """The GPU never waits for the host between chunks: chunk k's events are waited for only once chunk k+1 is
    enqueued (fake CUDA events: the log shows the order of enqueues and waits)."""
    log: list[str] = []

    class Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

    def record(ev):
        ev.t = float(len(log))

    clocks = guard.Clocks(perf_counter, Event, record, lambda a, b: b.t - a.t, lambda device: log.append("sync"),
                          lambda: None, lambda ev: log.append(f"wait {ev.t:g}"), lambda cycles: log.append("sleep"))
    members = [Member("a", lambda sweep: log.append(f"call {sweep}"), setup=lambda sweep: sweep)]
    chunks = sweep._Chunks(members, torch.device("cuda"), None, np.random.default_rng(0), clocks)
    chunks.push(range(0, 2))
    chunks.push(range(2, 4))
    assert chunks.kept == 2 and members[0].sweeps == [0, 1]
    chunks.drain()
    assert chunks.kept == 4 and members[0].sweeps == [0, 1, 2, 3]
    assert [e.split()[0] for e in log] == ["sync", "call", "call", "call", "call", "wait", "wait"]
    assert log.index("call 3") < log.index("wait 3")  # chunk 1 (ended at event 3) read after chunk 2 was enqueued


class Stream:
    """A simulated GPU stream and its host, in ms: each enqueue costs the host ``launch_ms``; the GPU runs what is
    enqueued in order, each item starting once the host has enqueued it and the item before it is done."""

    def __init__(self, spin_cycles_per_ms: float = 1.98e6, launch_ms: float = 0.005):
        self.host = self.gpu = 0.0
        self.per_ms, self.launch_ms = spin_cycles_per_ms, launch_ms

    def work(self, host_ms: float) -> None:
        self.host += host_ms

    def launch(self, gpu_ms: float) -> None:
        self.host += self.launch_ms
        self.gpu = max(self.gpu, self.host) + gpu_ms

    def clocks(self) -> guard.Clocks:
        stream = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = math.nan

        def record(ev):
            stream.launch(0.0)
            ev.t = stream.gpu

        def wait(ev):
            stream.host = max(stream.host, ev.t)

        def synchronize(device):
            stream.host = max(stream.host, stream.gpu)

        return guard.Clocks(lambda: stream.host / 1e3, Event, record, lambda a, b: b.t - a.t, synchronize,
                            lambda: None, wait, lambda cycles: stream.launch(cycles / stream.per_ms))


def test_a_lead_keeps_a_short_calls_host_side_out_of_its_samples(monkeypatch):
    """A 0.1 ms call whose host side (refilling its inputs, 0.3 ms; its own launch, 0.08 ms) outlasts its GPU work:
    the GPU drains between samples. Without the lead each sample holds the call's 0.08 ms of host time before its
    launch; behind the lead the samples are the GPU's 0.1 ms, and the host time is kept beside them."""
    def member(stream: Stream) -> Member:
        def setup(sweep):
            stream.work(0.3)
            stream.launch(0.01)  # the refill's copies

        def call(_):
            stream.work(0.08)
            stream.launch(0.1)

        return Member("short", call, setup)

    def sampled(lead: bool) -> Member:
        stream = Stream()
        monkeypatch.setattr(guard, "private_clocks", stream.clocks)
        if not lead:
            monkeypatch.setattr(sweep, "_lead", lambda members, device, clocks: None)
        m = member(stream)
        sweep.sample([m], torch.device("cuda"), TimingConfig(min_sweeps=20, max_sweeps=20), ClockSampler(CPU),
                     flush_l2=False)
        return m

    led, plain = sampled(lead=True), sampled(lead=False)
    assert min(plain.samples_ms) >= 0.1 + 0.08 - 1e-9  # the host's time before the launch is in every sample
    assert led.lead_cycles > 0 and max(led.samples_ms) == pytest.approx(0.1, abs=1e-9)  # the GPU time alone
    assert np.median(led.host_ms) == pytest.approx(0.08 + 2 * Stream().launch_ms)
    assert timing.lead_ms([0.08] * 9 + [5.0]) == pytest.approx(1.5 * 0.08 + 0.02)  # the 90th percentile
    assert timing.lead_ms([50.0]) == timing.LEAD_MAX_MS and timing.lead_ms([]) == 0.0


def test_the_blocks_and_ceilings_loop_times_a_short_call_behind_its_lead_too(monkeypatch):
    """codabench.timing.measure (a cell of a group sampled in blocks, the ceilings, an fp8 cast): the same call as
    above, its samples the GPU's 0.1 ms, not its host side's."""
    stream = Stream()
    monkeypatch.setattr(guard, "private_clocks", stream.clocks)

    def setup():
        stream.work(0.3)
        stream.launch(0.01)

    def call(_):
        stream.work(0.08)
        stream.launch(0.1)

    t = timing.measure(call, setup, torch.device("cuda"), TimingConfig(flush_l2=False, reps=10, warmup_ms=0.0))
    assert len(t.samples_ms) == 10 and max(t.samples_ms) == pytest.approx(0.1, abs=1e-9)


def test_a_groups_budget_stretches_to_enough_sweeps_for_long_members_within_its_cap():
    cfg = TimingConfig()  # 1.5 x 0.5 s per member; 60 sweeps; at most 20 s
    assert sweep.group_budget_s(cfg, 4, sweep_s=0.004) == pytest.approx(3.0)  # short calls: the per-member budget
    assert sweep.group_budget_s(cfg, 4, sweep_s=0.15) == pytest.approx(9.0)  # 60 sweeps of a 70B group
    assert sweep.group_budget_s(cfg, 4, sweep_s=0.6) == pytest.approx(20.0)  # capped
    assert sweep.group_budget_s(replace(cfg, budget_sweeps=0), 4, sweep_s=0.6) == pytest.approx(3.0)


def test_the_watched_ratios_are_each_member_against_the_baseline_and_its_fastest_other():
    ms = {"base": 3.0, "fast": 1.0, "mid": 2.0}
    members = [Member(k, lambda _: None) for k in ms]
    for m in members:
        m.samples_ms, m.sweeps = [ms[m.name]] * 3, [0, 1, 2]
    gemm = Member("gemm", lambda _: None, watch=False)
    gemm.samples_ms, gemm.sweeps = [0.5] * 3, [0, 1, 2]
    pairs = {(r.name, m.name) for r, m in sweep.watched_pairs(members + [gemm], baseline="base")}
    assert pairs == {("fast", "base"), ("base", "fast"), ("mid", "fast"), ("fast", "mid"), ("base", "mid")}


def test_a_samples_clock_is_the_nvml_reading_nearest_in_time():
    s = Sampled(sm_mhz=[1980.0, 1700.0, 1500.0], power_w=[700.0] * 3, temp_c=[60.0] * 3, t_s=[0.0, 1.0, 2.0])
    assert s.at([0.1, 0.9, 1.6, 5.0]) == [1980.0, 1700.0, 1500.0, 1500.0]
    assert Sampled().at([1.0]) == [None]


def test_settled_needs_a_full_window_of_steady_clock_and_power():
    t = list(np.arange(0, 0.5, 0.01))
    steady = Sampled(sm_mhz=[1500.0] * len(t), power_w=[690.0 + (i % 3) for i in range(len(t))], temp_c=[60.0] * len(t),
                     t_s=t)
    assert steady.settled(0.25, 0.02, 0.05)
    falling = Sampled(sm_mhz=[1980.0 - 1000 * x for x in t], power_w=[690.0] * len(t), temp_c=[60.0] * len(t), t_s=t)
    assert not falling.settled(0.25, 0.02, 0.05)
    short = Sampled(sm_mhz=[1500.0] * 5, power_w=[690.0] * 5, temp_c=[60.0] * 5, t_s=[0, 0.01, 0.02, 0.03, 0.04])
    assert not short.settled(0.25, 0.02, 0.05)


def test_cuda_graph_input_sets_together_exceed_l2_or_flush():
    l2 = 50 * 2**20
    for set_bytes in (2**30, 200 * 2**20, 30 * 2**20, 4 * 2**20, 2**20):
        k, flush = graph_sets(set_bytes, l2)
        assert k >= 2 and (k * set_bytes >= 3 * l2 or flush), (set_bytes, k, flush)
    assert graph_sets(2**10, l2) == (64, True)  # tiny inputs: the cap, and the replays flushed
    assert graph_sets(2**30, l2) == (2, False)


def test_outputs_must_be_plain_tensors_on_the_device_and_not_an_inputs_storage():
    x, w = torch.randn(4, 3), torch.randn(5, 3)
    native = {"x": x, "w": w}
    check_outputs({"out": x @ w.T}, native, CPU)
    with pytest.raises(CellError, match="not a plain torch.Tensor"):
        check_outputs({"out": (x @ w.T).as_subclass(type("Lazy", (torch.Tensor,), {}))}, native, CPU)
    with pytest.raises(CellError, match="shares its storage with the input 'x'"):
        check_outputs({"out": x[:2]}, native, CPU)
    with pytest.raises(CellError, match="expected a dict"):
        check_outputs(x @ w.T, native, CPU)
    with pytest.raises(CellError, match="is on meta"):
        check_outputs({"out": torch.empty(4, 5, device="meta")}, native, CPU)


def test_outputs_are_checked_by_their_exact_types_not_by_what_they_say_they_are():
    x, w = torch.randn(4, 3), torch.randn(5, 3)
    native = {"x": x, "w": w}
    check_outputs(collections.OrderedDict(out=x @ w.T, count=3, note="ok", scale=0.5, flag=True, none=None),
                  native, CPU)

    class Lies:
        __class__ = torch.Tensor

    class Items(dict):
        pass

    class Key(str):
        pass

    with pytest.raises(CellError, match="is a .*Lies, not a plain torch.Tensor"):
        check_outputs({"out": Lies()}, native, CPU)
    with pytest.raises(CellError, match="expected a dict"):
        check_outputs(Items(out=x @ w.T), native, CPU)
    with pytest.raises(CellError, match="named by a .*Key, not a str"):
        check_outputs({Key("out"): x @ w.T}, native, CPU)
    with pytest.raises(CellError, match="not a plain torch.Tensor"):
        check_outputs({"out": [x @ w.T]}, native, CPU)


def test_a_layout_conversion_may_move_values_but_not_make_them():
    a, b = torch.randn(4, 6), torch.randn(3)
    given = {"z": a, "s": b}
    moved("c", given, given)  # passed through
    moved("c", given, {"s": b, "gate": a[:, 0::2], "up": a[:, 1::2]})  # split, views
    moved("c", given, {"z": a.t().contiguous()[torch.randperm(6)], "s": b.flip(0)})  # reordered copies
    nan = a.clone()
    nan[0, 0] = float("nan")
    moved("c", {"z": nan}, {"z": nan.flip(1).clone()})
    for made in ({"z": a * 2, "s": b}, {"z": a, "s": b.double() * 1.0001}, {"s": b},
                 {"z": a.bfloat16(), "s": b}, {"z": torch.cat([a.flatten()[1:], a.flatten()[:1] + 1]), "s": b}):
        with pytest.raises(CellError, match="values it was not given"):
            moved("outputs_to_canonical", given, made)
    with pytest.raises(CellError, match="not a plain torch.Tensor"):
        moved("c", given, {"z": a.as_subclass(type("Sub", (torch.Tensor,), {})), "s": b})


def test_timed_calls_run_on_new_inputs_every_sweep_and_their_outputs_are_rechecked(tmp_path):
    """Through the runner: the lazy tensor subclass fails at its first call; a cache keyed on the inputs' values
    never hits in a timed call (every sweep refills the buffers with new values); a plugin honest only for the
    checks' calls is caught by the rechecks of timed calls' outputs."""
    with isolated_registry():
        load_plugin_file(PLUGINS / "cheaters_timed.py")
        impls = ["torch-eager", "cheat-lazy-tensor", "cheat-value-cache", "cheat-stale-after-checks",
                 "cheat-duck-output", "cheat-work-in-conversion"]
        make_runner(tmp_path, modes=("fwd",), impls=impls, timing=TimingConfig(cpu_reps=6), isolate=False).run()
        df, _, _ = load_run(tmp_path)
        rows = {r["impl"]: r for _, r in df.iterrows()}
        for name in ("cheat-lazy-tensor", "cheat-duck-output"):
            assert rows[name]["status"] == "error" and "not a plain torch.Tensor" in rows[name]["message"], name
        conversion = rows["cheat-work-in-conversion"]
        assert conversion["status"] == "error" and "values it was not given" in conversion["message"]
        stale = rows["cheat-stale-after-checks"]
        assert stale["status"] == "error" and "rechecked" in stale["message"], stale["message"]
        honest = rows["cheat-value-cache"]
        assert honest["status"] == "ok" and honest["n_samples"] == 6 and honest["grain"] == "sample"
        cache = _module_of("cheaters_timed").VALUE_CACHE
        # misses: the correctness, timing, refilled and new-buffer inputs, and each of the 6 sweeps' new inputs (the
        # untimed same-buffers check and the last sweep's recheck call repeat inputs: those may hit)
        assert cache["calls"] - cache["hits"] >= 4 + 6, cache


def _module_of(stem: str):
    import sys

    return next(m for n, m in sys.modules.items() if str(getattr(m, "__file__", "")).endswith(f"{stem}.py"))


def test_the_expected_device_is_the_accelerator_any_input_is_on():
    from codabench.execute import _device_of

    from dataclasses import dataclass

    @dataclass
    class Quantized:
        data: torch.Tensor
        scale: torch.Tensor

    meta = torch.empty(2, device="meta")
    assert _device_of({"scale": torch.ones(()), "x": meta, "model": "tiny"}).type == "meta"
    assert _device_of({"x": Quantized(meta, torch.ones(())), "mm": ("a", [torch.ones(1)])}).type == "meta"
    assert _device_of({"x": torch.ones(2)}).type == "cpu" and _device_of({"model": "tiny"}).type == "cpu"


def test_each_timed_call_is_drawn_for_a_recheck_only_once_it_returned():
    """No set of rechecked sweeps exists before the calls (a plugin reading the harness's frames could read it): each
    sweep is drawn as its call returns, RECHECKS expected among the first min_sweeps, RECHECKS / s past them, and the
    last of a fixed number always."""
    from codabench.measure import RECHECKS, Rechecks

    assert not vars(Rechecks(20, None)).get("done")
    first = [sum(Rechecks(20, None).draw(s) for s in range(20)) for _ in range(3000)]
    assert abs(np.mean(first) - RECHECKS) < 0.15 and 0 < np.mean([c == 0 for c in first]) < 0.03
    late = [sum(Rechecks(20, None).draw(s) for s in range(20, 200)) for _ in range(1000)]
    assert abs(np.mean(late) - RECHECKS * sum(1 / (s + 1) for s in range(20, 200))) < 0.4
    fixed = [Rechecks(6, 6) for _ in range(200)]
    assert all(r.draw(5) for r in fixed) and all(r.done == {5} for r in fixed)
    assert 0.5 < np.mean([Rechecks(6, 6).draw(0) for _ in range(2000)]) < 0.83  # 4 / 6
