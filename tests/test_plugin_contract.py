"""The plugin contract on forms no other test names (tests/plugins/contract_*.py): each gets the right verdict, with a
message that names what is wrong, and the cells beside it keep theirs."""
import pytest

from codabench.discovery import load_plugin_file
from codabench.results import load_run
from harness_helpers import PLUGINS, isolated_registry, make_runner


@pytest.fixture
def registry():
    with isolated_registry() as reg:
        yield reg


def run_rows(tmp_path, plugin: str, **kw) -> dict[tuple[str, str], dict]:
    """Run ``plugin``'s cells (inline, fp32, tiny) beside torch-eager; the rows by (impl, mode)."""
    load_plugin_file(PLUGINS / plugin)
    make_runner(tmp_path, isolate=False, **kw).run()
    df, _, _ = load_run(tmp_path)
    return {(r["impl"], r["mode"]): r for _, r in df.iterrows()}


def test_a_backward_that_writes_into_its_upstream_gradient_is_an_error_and_spares_the_next_cell(registry, tmp_path):
    rows = run_rows(tmp_path, "contract_grad_writer.py", ops=["rmsnorm_linear"], modes=("bwd", "fwd_bwd"),
                    impls=["torch-eager", "contract-zeroes-grad", "contract-honest-after"])
    for mode in ("bwd", "fwd_bwd"):
        bad = rows[("contract-zeroes-grad", mode)]
        assert bad["status"] == "error" and "wrote into the upstream gradient(s) of z" in bad["message"], mode
        after = rows[("contract-honest-after", mode)]
        assert after["status"] == "ok" and after["correct"] is True, (mode, after["message"])


def test_a_tensor_under_a_name_the_op_lacks_is_an_error_naming_the_valid_ones(registry, tmp_path):
    rows = run_rows(tmp_path, "contract_outputs.py", ops=["rmsnorm_linear"], modes=("fwd",),
                    impls=["torch-eager", "contract-misnamed", "contract-counts-calls"])
    bad = rows[("contract-misnamed", "fwd")]
    assert bad["status"] == "error"
    assert ("returned 'rstdd', which rmsnorm_linear has no output of that name (outputs: x, z; side outputs: rstd)"
            in bad["message"])
    honest = rows[("contract-counts-calls", "fwd")]  # a value that is not a tensor is left alone
    assert honest["status"] == "ok" and honest["correct"] is True


def test_a_result_computed_in_prepare_does_not_count_and_an_output_buffer_from_prepare_is_named(registry, tmp_path):
    rows = run_rows(tmp_path, "contract_prepare.py", modes=("fwd",),
                    impls=["torch-eager", "contract-prepare-computes", "contract-prepare-buffer",
                           "contract-workspace"])
    computes = rows[("contract-prepare-computes", "fwd")]
    assert computes["status"] == "error" and "outputs are computed in prepare()" in computes["message"]
    buffer = rows[("contract-prepare-buffer", "fwd")]
    assert buffer["status"] == "error" and "an output buffer made in the untimed prepare()" in buffer["message"]
    workspace = rows[("contract-workspace", "fwd")]
    assert workspace["status"] == "ok" and workspace["correct"] is True, workspace["message"]


def test_a_non_finite_output_names_where_its_first_nan_is(registry, tmp_path):
    rows = run_rows(tmp_path, "contract_outputs.py", modes=("fwd",), impls=["torch-eager", "contract-nan-last-row"])
    bad = rows[("contract-nan-last-row", "fwd")]
    assert bad["status"] == "error" and "out has 80 NaN and 0 Inf values, the first at [47, 0] of (48, 80)" in bad[
        "message"]


def test_a_skip_reason_without_a_status_is_a_skipped_row_whose_message_it_is(registry, tmp_path):
    """The status column holds statuses: a reason that names none (``"only for big shapes"``) is ``skipped`` with
    the reason in its message; one that is no text is an error row."""
    from codabench.registry import Implementation, register

    @register("gemm_out", "contract-bare-reason", dtypes=("fp32",))
    class Bare(Implementation):
        def skip_reason(self, case):
            return "only for big shapes"

    @register("gemm_out", "contract-bool-reason", dtypes=("fp32",))
    class Flag(Implementation):
        def skip_reason(self, case):
            return True

    make_runner(tmp_path, isolate=False, ops=["gemm_out"],
                impls=["torch-eager", "contract-bare-reason", "contract-bool-reason"]).run()
    df, _, _ = load_run(tmp_path)
    rows = {r["impl"]: r for _, r in df.iterrows()}
    assert rows["contract-bare-reason"]["status"] == "skipped"
    assert rows["contract-bare-reason"]["message"] == "skipped: only for big shapes"
    assert rows["contract-bool-reason"]["status"] == "error"
    assert "skip_reason returned bool True, not a str or None" in rows["contract-bool-reason"]["message"]
    assert rows["torch-eager"]["status"] == "ok"
