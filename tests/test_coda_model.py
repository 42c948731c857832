"""The CODA Llama equals the standard unfused Llama: same loss, same gradient for every parameter.

CPU: fp32 in the Triton interpreter, tight tolerances. GPU (only where CUDA is available): bf16 under the
suite's error rule (CODA's error against fp64 at most 2x plain PyTorch's in bf16, plus the bf16 floor).
"""
from __future__ import annotations

import os

import pytest
import torch

from kernels.coda import cross_entropy_bwd
from kernels.coda.model import CodaLlama, check_equivalence, init_params, make_batch
from workloads import reference as R
from workloads.models import ModelShape

from kernel_helpers import launches

# d, f, q all multiples of 8 but not of the interpreter's 32-wide tiles; GQA (4 heads, 2 kv heads)
SMALL = ModelShape("small", hidden=40, ffn=56, heads=4, kv_heads=2, head_dim=8, vocab=72, tokens=24, seq_len=12)
IGNORE_FRAC, SEED = 0.25, 0


@pytest.mark.parametrize("reduction,ce_chunk", [("mean", None), ("sum", None), ("mean", 10)])
def test_coda_llama_matches_standard_llama_fp32(reduction, ce_chunk, monkeypatch):
    """ce_chunk: rows per chunk of the LM head's gradient pass (10: chunks of 10, 10 and 4 of the 24 tokens)."""
    if ce_chunk:
        monkeypatch.setattr(cross_entropy_bwd, "ce_chunk_rows", lambda m, v, element_size: ce_chunk)
    _, targets = make_batch(SMALL, 2, 12, IGNORE_FRAC, "cpu", SEED + 1)
    assert (targets == R.IGNORE_INDEX).any() and (targets != R.IGNORE_INDEX).any()
    with launches() as names:
        rows = check_equivalence(SMALL, n_layers=2, batch=2, seq=12, dtype=torch.float32, device="cpu",
                                 reduction=reduction, ignore_frac=IGNORE_FRAC, seed=SEED)
    assert names.count("gemm_cross_entropy_kernel") == (3 if ce_chunk else 1)
    assert len(rows) == 1 + 3 + 2 * 9  # loss; embed, gamma_final, w_lm; 9 weights per layer
    for r in rows:
        assert r.passed and r.coda < 1e-5, (r.name, r.coda, r.torch)


def test_coda_llama_parameters_are_native_layouts():
    params = init_params(SMALL, 1, torch.float32, "cpu")
    model = CodaLlama(SMALL, params)
    layer = model.layers[0]
    assert layer.w_qkv.shape == (SMALL.qkv_width, SMALL.hidden) and layer.w_gu.shape == (2 * SMALL.ffn, SMALL.hidden)
    assert torch.equal(layer.w_gu[1::2], params["layers.0.w_up"])
    # v rows are untouched by the q/k pair permutation
    assert torch.equal(layer.w_qkv[-SMALL.kv_heads * SMALL.head_dim:], params["layers.0.w_v"])


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="bf16 equivalence needs a CUDA GPU and compiled kernels (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_coda_llama_matches_standard_llama_bf16_gpu(reduction):
    shape = ModelShape("gpu-small", hidden=1024, ffn=2816, heads=16, kv_heads=4, head_dim=64, vocab=8192,
                       tokens=2048, seq_len=1024, rope_theta=500000.0)
    rows = check_equivalence(shape, n_layers=2, batch=2, seq=1024, dtype=torch.bfloat16, device="cuda",
                             reduction=reduction)
    bad = [(r.name, r.coda, r.torch) for r in rows if not r.passed]
    assert not bad, bad
