"""Layout conversions: exact inverses, and every provider's layout computes the canonical function."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import layouts as L
from kernels.flashinfer import cos_sin_cache
from kernels.liger import rope_tables, split_gate_up_grads
from workloads import reference as R

H, HKV, DH, D, FFN, M = 4, 2, 16, 24, 20, 40
THETA = 10000.0


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def positions() -> torch.Tensor:
    return torch.arange(M) * 97 % 4096  # large, unordered positions


def test_gate_up_interleave_rows_is_exact_inverse():
    g, u = rand(FFN, D, seed=1), rand(FFN, D, seed=2)
    w = L.interleave_rows(g, u)
    assert w.shape == (2 * FFN, D)
    assert torch.equal(w[0], g[0]) and torch.equal(w[1], u[0]) and torch.equal(w[2], g[1])
    g2, u2 = L.deinterleave_rows(w)
    assert torch.equal(g2, g) and torch.equal(u2, u)


def test_gate_up_interleave_cols_is_exact_inverse():
    g, u = rand(M, FFN, seed=3), rand(M, FFN, seed=4)
    t = L.interleave_cols(g, u)
    assert torch.equal(t[:, 0], g[:, 0]) and torch.equal(t[:, 1], u[:, 0]) and torch.equal(t[:, 3], u[:, 1])
    g2, u2 = L.deinterleave_cols(t)
    assert torch.equal(g2, g) and torch.equal(u2, u)


def test_gate_up_concat_is_exact_inverse():
    g, u = rand(FFN, D, seed=5), rand(FFN, D, seed=6)
    g2, u2 = L.split_rows(L.concat_rows(g, u))
    assert torch.equal(g2, g) and torch.equal(u2, u)


def test_swiglu_in_every_gate_up_layout_is_the_canonical_function():
    h, g, u = rand(M, D, seed=7), rand(FFN, D, seed=8), rand(FFN, D, seed=9)
    want = R.swiglu(F.linear(h, g), F.linear(h, u))
    z_il = F.linear(h, L.interleave_rows(g, u))  # CODA, quack
    z_cat = F.linear(h, L.concat_rows(g, u))  # Liger fused gate-up, FlashInfer silu_and_mul
    torch.testing.assert_close(F.silu(z_il[:, 0::2]) * z_il[:, 1::2], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(F.silu(z_cat[:, :FFN]) * z_cat[:, FFN:], want, rtol=1e-12, atol=1e-12)


def test_gate_up_gradient_maps_back_to_both_weights():
    g, u = rand(FFN, D, seed=10), rand(FFN, D, seed=11)
    out = split_gate_up_grads({"w_gate_up": L.concat_rows(g, u), "a": g})
    assert set(out) == {"w_gate", "w_up", "a"}
    assert torch.equal(out["w_gate"], g) and torch.equal(out["w_up"], u)


def test_rope_pair_perm_maps_half_split_to_adjacent_pairs():
    assert L.rope_pair_perm(1, 4).tolist() == [0, 2, 1, 3]
    assert L.rope_pair_perm(2, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    p = L.qkv_perm(H, HKV, DH)
    assert sorted(p.tolist()) == list(range((H + 2 * HKV) * DH))  # a permutation
    v0 = (H + HKV) * DH
    assert p[v0:].tolist() == list(range(v0, (H + 2 * HKV) * DH))  # v untouched


def test_qkv_permutations_are_exact_inverses():
    w = rand((H + 2 * HKV) * DH, D, seed=12)
    adj = L.qkv_rows_to_adjacent(w, H, HKV, DH)
    assert not torch.equal(adj, w)
    assert torch.equal(L.qkv_rows_to_halfsplit(adj, H, HKV, DH), w)
    t = rand(M, (H + 2 * HKV) * DH, seed=13)
    assert torch.equal(L.qkv_cols_to_halfsplit(L.qkv_cols_to_adjacent(t, H, HKV, DH), H, HKV, DH), t)
    # rows of W are the GEMM's output columns: permuting W permutes the output the same way
    h = rand(M, D, seed=14)
    torch.testing.assert_close(F.linear(h, adj), L.qkv_cols_to_adjacent(F.linear(h, w), H, HKV, DH),
                               rtol=1e-12, atol=1e-12)


def rope_adjacent(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Adjacent-pair RoPE on x (M, heads, dh), angles as the canonical reference computes them."""
    return L.rotate_adjacent(x, R.rope_angles(pos, x.shape[-1], THETA, x.dtype)[:, None, :])


def test_adjacent_pair_rope_on_permuted_weights_equals_canonical_rope():
    h, w, pos = rand(M, D, seed=15), rand((H + 2 * HKV) * DH, D, seed=16), positions()
    want = R.qkv_rope(F.linear(h, w), pos, H, HKV, DH, THETA)
    z = F.linear(h, L.qkv_rows_to_adjacent(w, H, HKV, DH))
    q, k, v = z.split([H * DH, HKV * DH, HKV * DH], -1)
    q = rope_adjacent(q.reshape(M, H, DH), pos).reshape(M, -1)
    k = rope_adjacent(k.reshape(M, HKV, DH), pos).reshape(M, -1)
    got = L.qkv_cols_to_halfsplit(torch.cat([q, k, v], -1), H, HKV, DH)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def test_hugging_face_rope_equals_canonical_rope():
    """HF Llama: inv_freq = theta^-(2i/dh), emb = cat(freqs, freqs), q cos + rotate_half(q) sin."""
    x, pos = rand(M, H, DH, seed=17), positions()
    inv_freq = 1.0 / THETA ** (torch.arange(0, DH, 2, dtype=torch.float64) / DH)
    emb = torch.cat([torch.outer(pos.double(), inv_freq)] * 2, -1)[:, None, :]
    hf = x * emb.cos() + rotate_half(x) * emb.sin()
    torch.testing.assert_close(hf, R.rope(x, pos, THETA), rtol=1e-10, atol=1e-10)


def test_liger_tables_give_the_canonical_rope():
    """Liger's (1, S, dh) cos/sin in HF form, one row per token, applied the HF way."""
    x, pos = rand(M, H, DH, seed=18), positions()
    cos, sin = rope_tables(pos, DH, THETA)
    assert cos.shape == (1, M, DH) and cos.dtype == torch.float32
    got = x * cos[0, :, None, :].double() + rotate_half(x) * sin[0, :, None, :].double()
    torch.testing.assert_close(got, R.rope(x, pos, THETA), rtol=0, atol=1e-6)  # fp32 tables


def test_flashinfer_cache_gives_the_canonical_rope():
    """FlashInfer's cache rows are ``[cos | sin]`` per position; neox (half-split) style rotation."""
    x, pos = rand(M, H, DH, seed=19), positions()
    cache = cos_sin_cache(int(pos.max()) + 1, DH, THETA, torch.device("cpu"))
    assert cache.shape == (int(pos.max()) + 1, DH) and cache.dtype == torch.float32
    cos, sin = cache[pos].double().chunk(2, -1)
    x1, x2 = x.chunk(2, -1)
    c, s = cos[:, None, :], sin[:, None, :]
    got = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    torch.testing.assert_close(got, R.rope(x, pos, THETA), rtol=0, atol=1e-6)


def test_pack_rows_builds_the_coda_weights_and_returns_each_gradient():
    """kernels.coda.pack (the Hugging Face drop-in's packing, one Triton row copy each way) equals the torch layouts,
    forward and backward, with every row of every weight hit once."""
    from kernels.coda.pack import gate_up_index, pack_rows, qkv_index

    cpu = torch.device("cpu")
    wq, wk, wv = (rand(n * DH, D, seed=s).float().requires_grad_() for n, s in ((H, 3), (HKV, 4), (HKV, 5)))
    wg, wu = (rand(FFN, D, seed=s).float().requires_grad_() for s in (6, 7))
    cases = [(qkv_index(H, HKV, DH, cpu), (wq, wk, wv),
              lambda q, k, v: L.qkv_rows_to_adjacent(torch.cat([q, k, v]), H, HKV, DH)),
             (gate_up_index(FFN, cpu), (wg, wu), L.interleave_rows)]
    for index, weights, reference in cases:
        packed = pack_rows(index, *weights)
        expected = reference(*weights)
        assert torch.equal(packed, expected)
        dpacked = rand(*packed.shape, seed=8).float()
        grads = torch.autograd.grad(packed, weights, dpacked)
        expected_grads = torch.autograd.grad(expected, weights, dpacked)
        for g, e in zip(grads, expected_grads):
            assert torch.equal(g, e)
