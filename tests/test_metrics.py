"""Error metrics and the pass rule on inputs whose answers are known by hand."""
import math

import pytest
import torch

from codabench.metrics import FLOOR, error_ratio, error_stats, passes, rel_err, tolerance


def test_known_values():
    out = torch.tensor([1.0, 2.0, 3.0])
    ref = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64)
    s = error_stats(out, ref)
    assert s.rel_err == pytest.approx(1.0 / 3.0)
    assert s.max_abs == pytest.approx(1.0)
    assert s.cosine == pytest.approx(11.0 / (math.sqrt(14.0) * 3.0))
    assert s.finite


def test_exact_and_zero_reference():
    t = torch.randn(4, 5)
    s = error_stats(t, t.double())
    assert (s.rel_err, s.max_abs, s.cosine) == (0.0, 0.0, pytest.approx(1.0))
    z = error_stats(torch.tensor([0.0, 0.5]), torch.zeros(2, dtype=torch.float64))
    assert z.rel_err == pytest.approx(0.5)  # absolute norm when the reference is zero
    assert z.cosine == 0.0


def test_nan_and_inf_are_counted_and_never_pass():
    out = torch.tensor([1.0, float("nan"), float("inf"), float("-inf")])
    s = error_stats(out, torch.ones(4, dtype=torch.float64))
    assert (s.n_nan, s.n_inf) == (1, 2)
    assert not s.finite
    assert not passes(s.rel_err, torch_rel_err=1.0, dtype=torch.float32)
    for bad in (float("nan"), float("inf")):
        err = rel_err(torch.tensor([1.0, bad]), torch.ones(2, dtype=torch.float64))
        assert not math.isfinite(err) and not passes(err, torch_rel_err=1.0, dtype=torch.float32)


def test_rel_err_is_the_relative_error_of_error_stats():
    out, ref = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64)
    assert rel_err(out, ref) == error_stats(out, ref).rel_err == pytest.approx(1.0 / 3.0)
    assert rel_err(torch.tensor([0.0, 0.5]), torch.zeros(2)) == pytest.approx(0.5)


def test_pass_rule_is_twice_pytorch_plus_floor():
    torch_err = 1e-3
    limit = 2 * torch_err + FLOOR[torch.bfloat16]
    assert tolerance(torch_err, torch.bfloat16) == pytest.approx(limit)
    assert passes(limit * 0.999, torch_err, torch.bfloat16)
    assert not passes(limit * 1.001, torch_err, torch.bfloat16)
    # PyTorch exact: only the floor is allowed
    assert passes(FLOOR[torch.float32] / 2, 0.0, torch.float32)
    assert not passes(FLOOR[torch.float32] * 2, 0.0, torch.float32)
    assert not passes(FLOOR[torch.float32] * 2, None, torch.float32)
    assert tolerance(math.inf, torch.float16) == FLOOR[torch.float16]


def test_error_ratio():
    assert error_ratio(2e-3, 1e-3) == pytest.approx(2.0)
    assert error_ratio(0.0, 0.0) == 1.0
    assert error_ratio(1e-9, 0.0) == math.inf
    assert error_ratio(1e-3, None) is None
    assert error_ratio(math.nan, 1e-3) is None
