"""The worked example of docs/writing-kernels.md: discovered as a plugin, one launch, passes the harness check."""
from __future__ import annotations

import pytest
import torch

from codabench.case import Case
from codabench.correctness import CHECK_SEED, build_reference, check_impl
from codabench.discovery import discover
from codabench.registry import REGISTRY
from kernels.examples.gemm_bias_gelu import gemm_bias_gelu
from workloads.models import get_model
from workloads.ops import OPS


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_example_is_discovered_and_correct(dtype):
    discover(entry_points=False)
    impl = REGISTRY.get("gemm_bias_gelu", "coda-example")
    op, model = OPS["gemm_bias_gelu"], get_model("tiny")
    tdt = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    case = Case(op, model, "fwd", dtype, torch.device("cpu"), op.make_inputs(model, tdt, "cpu", CHECK_SEED))
    assert impl.skip_reason(case) is None and impl.label == "fused"
    launched = []
    kernel = gemm_bias_gelu.kernel
    run = kernel.fn.run
    kernel.fn.run = lambda *a, **k: launched.append(1) or run(*a, **k)
    try:
        outcome = check_impl(build_reference(op, case), impl)
    finally:
        del kernel.fn.run
    assert launched == [1]
    assert impl.describe(None) == "bias_gelu:fused"  # the report's strategy column: the path the kernel took
    assert outcome.correct, (outcome.errors, [(c.output, c.stats, c.torch_rel_err) for c in outcome.checks])
