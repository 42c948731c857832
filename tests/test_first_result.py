"""Time to first result per implementation (codabench/report/first_result.py) and its section of report.html."""
import numpy as np
import pandas as pd
import pytest

from codabench.report import finalize
from codabench.report.first_result import first_result_section, first_result_table
from synthetic_runs import noisy_rounds, write_run


def rows(*cells):
    return pd.DataFrame([dict(zip(("op", "model", "mode", "dtype", "impl", "status", "check_s", "first_call_s"), c))
                         for c in cells])


def test_sums_check_and_first_call_per_implementation_with_the_median_and_the_worst_cell():
    df = rows(("block", "a", "fwd", "bf16", "coda-triton", "ok", 10.0, 2.0),
              ("block", "b", "fwd", "bf16", "coda-triton", "ok", 1.0, 0.5),
              ("lm_head_ce", "a", "fwd", "fp8", "coda-triton", "error", 30.0, None),  # no result: not counted
              ("block", "a", "fwd", "bf16", "raises", "error", 0.01, None),  # nor the fastest
              ("block", "a", "fwd", "bf16", "torch-compile", "ok", 20.0, 3.0),
              ("block", "b", "fwd", "bf16", "torch-compile", "ok", None, 4.0),
              ("block", "c", "fwd", "bf16", "liger", "skipped", None, None))  # never ran: not a row of the table
    t = first_result_table(df).set_index("impl")
    assert list(t.index) == ["torch-compile", "coda-triton"]  # the report's implementation order
    coda, compiled = t.loc["coda-triton"], t.loc["torch-compile"]
    assert (coda["cells"], coda["total_s"], coda["check_s"], coda["first_call_s"]) == (2, 13.5, 11.0, 2.5)
    assert coda["median_s"] == 6.75 and coda["worst_s"] == 12.0 and coda["worst_cell"] == "block a fwd bf16"
    assert compiled["total_s"] == 27.0 and compiled["median_s"] == 13.5
    assert coda["vs_fastest"] == 1.0 and compiled["vs_fastest"] == pytest.approx(27.0 / 13.5)


def test_no_recorded_time_no_section():
    assert first_result_section(rows(("block", "a", "fwd", "bf16", "x", "skipped", None, None))) == []
    assert first_result_section(pd.DataFrame()) == []


def test_the_report_shows_the_section(tmp_path):
    rng = np.random.default_rng(3)
    cells = {("gemm_out", "llama-7b", "fwd", "bf16", impl): noisy_rounds(rng, ms) for impl, ms in
             (("torch-compile", 1.0), ("coda-triton", 0.9))}
    extra = {k: {"check_s": 4.0 if k[-1] == "coda-triton" else 30.0, "first_call_s": 1.5} for k in cells}
    run = write_run(tmp_path / "run", cells, rows=extra)
    finalize(run)
    page = (run / "report.html").read_text()
    section = page[page.index("<h2>Time to first result</h2>"):]
    table = section[:section.index("</table>")]
    assert "<td class='l'>coda-triton</td><td class=''>1</td><td class=''>5.5</td>" in table
    assert "<td class=''>5.73</td>" in table  # torch-compile's 31.5 s over coda-triton's 5.5 s
