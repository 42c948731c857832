"""Pick the device before anything imports triton.

The tests run on the CPU, the Triton kernels in the interpreter, also on a machine with a GPU: most of them hand
the kernels CPU tensors. ``CODABENCH_TEST_GPU=1`` leaves the GPU visible, for the tests that need one (those named
``gpu``, e.g. ``CODABENCH_TEST_GPU=1 python -m pytest -q -k gpu tests/test_gpu.py``); without it they are skipped.

The ``strategy`` fixture runs a test under each path of the CODA kernels (:mod:`kernels.coda.strategy`). Before each
test the guard records the harness's modules again (:func:`codabench.guard.snapshot`): an earlier test's monkeypatches
(adopted by an inline run's record) and their undoing are a test's business, not tampering.

Tests marked ``slow`` (pyproject.toml registers the marker) are left out of the default run, which its ``addopts``
keep to about 15 minutes on 2 CPU cores (CI, .ci/run, runs exactly that); ``python -m pytest -q -m slow`` runs
them. A GPU test is never marked slow: the GPU commands of docs/testing.md select by name and would leave it out.

The runs of the tests append to a results history in a temporary folder (``CODABENCH_HISTORY``), not the user's.
"""
import os
import tempfile

GPU_ENV = "CODABENCH_TEST_GPU"
if os.environ.get(GPU_ENV) != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch looks for a GPU; subprocesses of the tests inherit it
# test processes side by side (pytest-xdist workers): each gets its share of the cores for PyTorch's threads, not
# every core (on 2 cores, two workers of two threads each took the default run from 9:06 to 11:10)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(max(1, (os.cpu_count() or 1) // _workers)))
# the tests' runs go into a results history of their own, never the user's (codabench/history.py)
os.environ["CODABENCH_HISTORY"] = os.path.join(tempfile.mkdtemp(prefix="codabench-tests-"), "history.sqlite")

from codabench.bootstrap import select_device  # noqa: E402

DEVICE = select_device()

from interpreter_patches import install  # noqa: E402

install()  # the interpreter without its repeated patching inside a launch: same values

import pytest  # noqa: E402


def pytest_configure(config) -> None:
    """The GPU tests time the GPU: they run in one process (-n 0), never beside other test processes."""
    if os.environ.get(GPU_ENV) == "1" and getattr(config.option, "numprocesses", None) not in (None, 0):
        raise pytest.UsageError(f"{GPU_ENV}=1: run the GPU tests in one process, with -n 0")


def pytest_collection_modifyitems(config, items) -> None:
    """The files with a test marked ``long`` first, then the others by their number of tests, most first: with
    ``--no-loadscope-reorder`` (pyproject's addopts) pytest-xdist hands out test files in this order (``--dist
    loadfile``), so the longest one starts at once beside the others instead of after them. xdist's own reorder
    sorts by the number of tests alone, which put the smoke suite's file (one test, ~6 of the slow run's ~10
    minutes) last."""
    def file_of(item) -> str:
        return item.nodeid.split("::")[0]

    count: dict[str, int] = {}
    for item in items:
        count[file_of(item)] = count.get(file_of(item), 0) + 1
    long_files = {file_of(item) for item in items if item.get_closest_marker("long") is not None}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (file_of(item) not in long_files, -count[file_of(item)], file_of(item),
                                 order[id(item)]))


def pytest_report_header(config) -> str:
    if os.environ.get(GPU_ENV) == "1":
        return f"codabench: tests on {DEVICE} ({GPU_ENV}=1)"
    return f"codabench: tests on the CPU with the Triton interpreter; {GPU_ENV}=1 runs the GPU tests on a GPU"


@pytest.fixture(autouse=True)
def guard_record_of_this_test():
    from codabench import guard

    guard.snapshot(refresh=True)


@pytest.fixture(params=["fused", "split"])
def strategy(request, monkeypatch):
    """``CODABENCH_STRATEGY`` set to fused, then split, for the test."""
    monkeypatch.setenv("CODABENCH_STRATEGY", request.param)
    return request.param
