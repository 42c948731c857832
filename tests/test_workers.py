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
