"""Pick the device before anything imports triton: the GPU when there is one, else the Triton interpreter.

The ``strategy`` fixture runs a test under each path of the CODA kernels (:mod:`kernels.coda.strategy`).
"""
from codabench.bootstrap import select_device

select_device()

import pytest  # noqa: E402


@pytest.fixture(params=["fused", "split"])
def strategy(request, monkeypatch):
    """``CODABENCH_STRATEGY`` set to fused, then split, for the test."""
    monkeypatch.setenv("CODABENCH_STRATEGY", request.param)
    return request.param
