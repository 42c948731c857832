"""tests/interpreter_patches.py: the interpreter without its repeated patching computes what Triton's own does."""
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

import interpreter_patches as fast
from kernel_helpers import rand
from kernels.coda.cross_entropy import gemm_cross_entropy
from kernels.coda.producer import gemm_residual_norm

pytestmark = pytest.mark.skipif(not fast.install(), reason="this Triton's interpreter lacks what the patch relies on")


def outputs() -> list[torch.Tensor]:
    """Two CODA kernels made of nested jit functions (mainloop, epilogue primitives, reductions), fp32."""
    a, w, res, gamma = rand(96, 64), rand(80, 64, seed=1), rand(96, 80, seed=2), rand(80, seed=3)
    x, h, rstd = gemm_residual_norm(a, w, res, gamma, 1e-5)
    w_lm = rand(50, 80, seed=4)
    target = torch.randint(0, 50, (96,), generator=torch.Generator().manual_seed(5))
    return [x, h, rstd, *gemm_cross_entropy(h, w_lm, rstd, target, with_grad=True)]


@pytest.fixture
def unpatched(monkeypatch):
    """The interpreter as Triton ships it, for one test."""
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.original)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", interpreter.GridExecutor.__call__.original)


def test_the_patched_interpreter_computes_triton_s_values_bit_for_bit(request):
    ours = outputs()
    request.getfixturevalue("unpatched")
    theirs = outputs()
    assert len(ours) == len(theirs) == 7
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_nested_calls_are_skipped_and_a_launch_still_restores_the_language(monkeypatch):
    """Inside a launch the nested calls find their modules patched (most are skipped); after it, triton.language is
    Triton's own again."""
    calls = {"patched": 0, "all": 0}
    original, skipping = interpreter._patch_lang.original, interpreter._patch_lang

    def counted_original(fn):
        calls["patched"] += 1
        return original(fn)

    def counted(fn):
        calls["all"] += 1
        return skipping(fn)

    monkeypatch.setattr(skipping, "original", counted_original)
    monkeypatch.setattr(interpreter, "_patch_lang", counted)
    before = (tl.program_id, tl.core.tensor.__add__, tl.range)
    outputs()
    assert (tl.program_id, tl.core.tensor.__add__, tl.range) == before
    assert 0 < calls["patched"] < calls["all"] / 2, calls


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv(fast.ENV, "0")
    assert fast.install() is False
