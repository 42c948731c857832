"""Progress: the ETA from the cost of cells like the ones left (a fake clock), plain lines where no bar can be drawn,
the run's wall time and its split."""
import fcntl
import io
import json
import os
import select
import struct
import termios

import pytest

from codabench.matrix import Cell
from codabench.progress import Progress, can_draw
from harness_helpers import isolated_registry, make_runner


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def cells(impls, ops=("gemm_out",), models=("llama-1b",), modes=("fwd",)):
    return [Cell(op, model, mode, "bf16", impl) for op in ops for model in models for mode in modes for impl in impls]


def run_cell(p: Progress, clock: Clock, cell: Cell, seconds: float, first_call_s: float = 0.0, check_s: float = 0.0):
    clock.now += seconds
    p.update(cell, "ok", True, first_call_s, check_s)


def test_the_eta_counts_the_cells_left_at_the_cost_of_cells_like_them():
    clock = Clock()
    plan = cells(["torch-eager", "torch-compile"], models=("llama-1b", "llama-70b"), modes=("fwd", "bwd"))
    p = Progress(len(plan), plan, enabled=False, clock=clock)
    assert p.eta() is None  # nothing measured yet
    cost = {("torch-eager", "llama-1b"): 1.0, ("torch-compile", "llama-1b"): 5.0,
            ("torch-eager", "llama-70b"): 20.0, ("torch-compile", "llama-70b"): 30.0}
    for c in plan[:2]:  # llama-1b fwd, both implementations
        run_cell(p, clock, c, cost[(c.impl, c.model)])
    # llama-1b bwd: each implementation's 1b fwd; llama-70b fwd: its 1b fwd; llama-70b bwd: its mean so far
    assert p.eta() == pytest.approx((1 + 5) * 3)
    for c in plan[2:6]:
        run_cell(p, clock, c, cost[(c.impl, c.model)])
    assert [c.model + c.mode for c in p.left] == ["llama-70bbwd"] * 2
    assert p.eta() == pytest.approx(20 + 30)  # llama-70b bwd: the same implementation, op and model (fwd)


def test_an_implementation_not_seen_yet_pays_a_cold_start_once():
    """On a cold GPU the first cells were cheap and the ETA said seconds; the next provider then compiled for
    minutes. The first-call seconds of the implementations seen so far stand for its compile, JIT and autotuning."""
    clock = Clock()
    plan = cells(["torch-eager", "torch-compile", "liger"], models=("llama-1b", "llama-7b"))
    p = Progress(len(plan), plan, enabled=False, clock=clock)
    run_cell(p, clock, plan[0], 2.0, first_call_s=0.5)  # eager
    run_cell(p, clock, plan[1], 122.0, first_call_s=120.0)  # compile, cold
    left = plan[2:]  # liger 1b (never seen), then the 7b cells: eager, compile, liger
    expected_1b_group = (2 + 122) / 2
    cold = (0.5 + 120) / 2
    assert p.eta() == pytest.approx(expected_1b_group + 2 + 122 + expected_1b_group + cold)
    assert p.eta() > 4 * 60 and len(p.left) == len(left)
    run_cell(p, clock, plan[2], 90.0, first_call_s=85.0)
    assert p.eta() == pytest.approx(2 + 122 + 90)  # every implementation seen: no cold start left


def test_rows_written_together_share_their_groups_time_and_add_up_to_the_wall_time():
    """With timing rounds a group's rows come at its end: each cell's own seconds overlap, the costs do not."""
    clock = Clock()
    plan = cells(["torch-eager", "torch-compile", "liger"], models=("llama-1b", "llama-7b"))
    p = Progress(len(plan), plan, enabled=False, clock=clock)
    clock.now += 30.0  # the group's three cells, three rounds each
    for c in plan[:3]:
        p.update(c, "ok", True)
    assert sum(p.costs[("all",)]) == pytest.approx(30.0)
    assert p.eta() == pytest.approx(30.0)  # the next group, of the same shape, costs the same in all


def test_cells_that_do_not_run_cost_nothing_and_the_finish_reports_the_split():
    clock = Clock()
    plan = cells(["torch-eager", "torch-compile"])
    stream = io.StringIO()
    p = Progress(3, plan, stream=stream, clock=clock)
    clock.now += 0.5
    p.update(Cell("gemm_out", "llama-1b", "fwd", "bf16", "flashinfer"), "n/a: no such op", False)
    run_cell(p, clock, plan[0], 3.0, first_call_s=1.0, check_s=0.5)
    run_cell(p, clock, plan[1], 6.0, first_call_s=4.0, check_s=1.5)
    assert p.costs[("all",)] == [3.5, 6.0] and p.ran == 2 and p.done == 3  # the n/a row's moment goes to the next
    times = p.finish()
    assert times == {"wall_s": 9.5, "first_calls_s": 5.0, "checks_s": 2.0, "rest_s": 2.5,
                     "startup_s": {"torch-compile": 5.5, "torch-eager": 1.5}}
    assert list(times["startup_s"]) == ["torch-compile", "torch-eager"]  # largest first
    lines = stream.getvalue().splitlines()
    assert len(lines) == 5 and lines[0].startswith("[1/3] gemm_out llama-1b fwd bf16 flashinfer: n/a")
    assert "ETA ?" in lines[0] and "ETA 0:00:00" in lines[2]
    assert lines[-2] == ("codabench: wall time 0:00:09 (0:00:05 in first calls: compile, JIT, autotune; 0:00:02 in "
                         "correctness passes; 0:00:02 the rest) for 2 cells run")
    assert lines[-1] == ("codabench: correctness passes and first calls by implementation: torch-compile 0:00:05, "
                         "torch-eager 0:00:01")


def _read_all(fd: int) -> str:
    """What was written to the terminal (a pseudo-terminal hands it over in pieces)."""
    out = b""
    while select.select([fd], [], [], 0.5)[0]:
        out += os.read(fd, 65536)
    return out.decode()


def _pty(columns: int):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return master, os.fdopen(slave, "w")


def test_a_bar_only_where_a_terminal_can_draw_it():
    """No terminal, or a pseudo-terminal of zero width (nobody sized it): plain lines; a sized terminal: tqdm."""
    assert not can_draw(io.StringIO())
    for columns, drawn in ((0, False), (80, True)):
        master, stream = _pty(columns)
        try:
            assert can_draw(stream) == drawn
            p = Progress(1, cells(["torch-eager"]), stream=stream)
            assert (p.bar is not None) == drawn
            p.update(cells(["torch-eager"])[0], "ok", True)
            p.finish()
            out = _read_all(master)
            assert ("[1/1] gemm_out llama-1b fwd bf16 torch-eager: ok" in out) != drawn
            assert "codabench: wall time" in out
        finally:
            stream.close()
            os.close(master)


def test_the_run_records_its_wall_time_and_first_calls_in_env_json(tmp_path):
    with isolated_registry():
        make_runner(tmp_path, modes=("fwd",), impls=["torch-eager", "torch-compile"]).run()
    env = json.loads((tmp_path / "env.json").read_text())
    rows = [line.split(",") for line in (tmp_path / "results.csv").read_text().splitlines()]
    first_calls = sum(float(r[rows[0].index("first_call_s")]) for r in rows[1:])
    checks = sum(float(r[rows[0].index("check_s")]) for r in rows[1:])
    assert env["first_calls_s"] == pytest.approx(first_calls) and first_calls > 0
    assert env["checks_s"] == pytest.approx(checks) and checks > 0
    for r in rows[1:]:  # a cell's first round holds its correctness pass and its first call
        setup, check, first = (float(r[rows[0].index(k)]) for k in ("setup_s", "check_s", "first_call_s"))
        assert setup > check + first
    assert env["wall_s"] == pytest.approx(env["first_calls_s"] + env["checks_s"] + env["rest_s"]) and env["rest_s"] > 0
    assert set(env["startup_s"]) == {"torch-eager", "torch-compile"}
