"""The default run's test processes (pytest-xdist workers) share the machine's cores: each one's PyTorch threads
are its share (tests/conftest.py), not one per core, which oversubscribed 2 cores with 4 threads."""
import os

import pytest
import torch


def test_each_test_process_takes_its_share_of_the_cores():
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        pytest.skip("one test process (-n 0): it keeps PyTorch's default threads")
    share = max(1, (os.cpu_count() or 1) // workers)
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
    if os.environ["OMP_NUM_THREADS"] != str(share):  # only a value the user set before the run stands
        pytest.skip(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} set outside the tests")
    assert torch.get_num_threads() == share


def test_the_long_tests_are_handed_out_first():
    """A test marked ``long`` (the smoke suite) comes first in the collection, though its file sorts after the others
    and holds the fewest tests, then the files with more tests; pytest-xdist hands files out in that order because
    the project's options turn its own reorder (by number of tests alone: the smoke suite last) off."""
    import tomllib
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "slow or not slow",
                          "-p", "no:cacheprovider", *(str(tests / f"test_{n}.py") for n in ("layouts", "models", "smoke",
                                                                                               "stats"))],
                         capture_output=True, text=True, cwd=tests.parent, timeout=300)
    files = [line.split("::")[0] for line in out.stdout.splitlines() if "::" in line]
    runs = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert len(runs) == 4 and runs[0] == "tests/test_smoke.py", out.stdout[-2000:]
    assert [files.count(f) for f in runs[1:]] == sorted((files.count(f) for f in runs[1:]), reverse=True)
    addopts = tomllib.loads((tests.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "--dist loadfile" in addopts and "--no-loadscope-reorder" in addopts
