"""A Llama built from the CODA pieces, the standard unfused Llama it must equal, and the check of that.

Standard pre-norm Llama (``reference_loss``, canonical weights): per layer
``x += attn(rope(rmsnorm(x; ga) Wq^T), rope(.. Wk^T), .. Wv^T) Wo^T`` (half-split RoPE, GQA, causal SDPA),
``x += (silu(rmsnorm(x; gm) Wg^T) * (rmsnorm(x; gm) Wu^T)) Wd^T``; then
``loss = CE(rmsnorm(x; gf) Wlm^T, targets)``.

:class:`CodaLlama` computes the same function with CODA's shifted block boundary (coda-spec "The block")::

    qkv_0 = norm_consumer(x_0, ga_0, Wqkv_0, RoPE)                          the first-layer piece
    x_l+1, qkv_l+1 = block(attn(qkv_l), x_l, Wo_l, gm_l, Wgu_l, Wd_l,       one CODA block per layer
                           ga_l+1, Wqkv_l+1, RoPE)
    the last block's consumer is the final norm + LM head + cross-entropy   (gf, Wlm, CrossEntropy)

Native layouts: Wqkv = [Wq; Wk; Wv] with q/k rows in adjacent-pair order, Wgu = gate/up rows interleaved.
Attention is plain torch SDPA on the adjacent-layout q and k: permuting the head dimension of q and k the
same way leaves q k^T unchanged. The embedding lookup is torch's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from codabench.metrics import passes, rel_err
from kernels import layouts as L
from kernels.coda.functions import CrossEntropy, RoPE, block, norm_consumer
from workloads import reference as R
from workloads.models import ModelShape
from workloads.reference import LLAMA_LAYER_WEIGHTS as LAYER_WEIGHTS

# ---- the standard unfused Llama (canonical weights) ----------------------------------------------------

def init_params(shape: ModelShape, n_layers: int, dtype: torch.dtype, device: torch.device | str,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical weights: ``embed``, ``layers.{i}.{LAYER_WEIGHTS}``, ``gamma_final``, ``w_lm`` (nn.Linear layout)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*s: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(s, generator=gen, device=device) * std + mean).to(dtype)

    d, f, dh = shape.hidden, shape.ffn, shape.head_dim
    p = {"embed": normal(shape.vocab, d)}
    for i in range(n_layers):
        for name, t in [("gamma_attn", normal(d, std=0.1, mean=1.0)), ("w_q", normal(shape.heads * dh, d, std=d ** -0.5)),
                        ("w_k", normal(shape.kv_heads * dh, d, std=d ** -0.5)),
                        ("w_v", normal(shape.kv_heads * dh, d, std=d ** -0.5)),
                        ("w_o", normal(d, shape.heads * dh, std=(shape.heads * dh) ** -0.5)),
                        ("gamma_mlp", normal(d, std=0.1, mean=1.0)), ("w_gate", normal(f, d, std=d ** -0.5)),
                        ("w_up", normal(f, d, std=d ** -0.5)), ("w_down", normal(d, f, std=f ** -0.5))]:
            p[f"layers.{i}.{name}"] = t
    p["gamma_final"] = normal(d, std=0.1, mean=1.0)
    p["w_lm"] = normal(shape.vocab, d, std=d ** -0.5)
    return p


def n_layers_of(params: dict[str, torch.Tensor]) -> int:
    return sum(1 for k in params if k.endswith(".gamma_attn"))


def reference_loss(params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor, shape: ModelShape,
                   reduction: str = "mean") -> torch.Tensor:
    """The standard unfused Llama's loss (:func:`workloads.reference.llama_loss`) on the canonical weights."""
    layers = [{k: params[f"layers.{i}.{k}"] for k in LAYER_WEIGHTS} for i in range(n_layers_of(params))]
    return R.llama_loss(params["embed"], layers, params["gamma_final"], params["w_lm"], tokens, targets, shape,
                        reduction)


# ---- the CODA Llama ------------------------------------------------------------------------------------

class CodaLayer(nn.Module):
    """One layer's weights in CODA's native layouts (Wqkv adjacent-pair q/k rows, Wgu interleaved)."""

    def __init__(self, gamma_attn, w_qkv, w_o, gamma_mlp, w_gu, w_down):
        super().__init__()
        self.gamma_attn, self.w_qkv, self.w_o = nn.Parameter(gamma_attn), nn.Parameter(w_qkv), nn.Parameter(w_o)
        self.gamma_mlp, self.w_gu, self.w_down = nn.Parameter(gamma_mlp), nn.Parameter(w_gu), nn.Parameter(w_down)


class CodaLlama(nn.Module):
    """Llama on the CODA kernels: every GEMM and norm through :mod:`kernels.coda.functions`, attention by SDPA."""

    def __init__(self, shape: ModelShape, params: dict[str, torch.Tensor]):
        """``params``: canonical weights (:func:`init_params`), converted once to the native layouts."""
        super().__init__()
        self.shape = shape
        qkv = (shape.heads, shape.kv_heads, shape.head_dim)
        self.embed = nn.Parameter(params["embed"].clone())
        self.layers = nn.ModuleList()
        for i in range(n_layers_of(params)):
            p = {k: params[f"layers.{i}.{k}"] for k in LAYER_WEIGHTS}
            w_qkv = L.qkv_rows_to_adjacent(torch.cat([p["w_q"], p["w_k"], p["w_v"]]), *qkv)
            self.layers.append(CodaLayer(p["gamma_attn"].clone(), w_qkv, p["w_o"].clone(), p["gamma_mlp"].clone(),
                                         L.interleave_rows(p["w_gate"], p["w_up"]), p["w_down"].clone()))
        self.gamma_final = nn.Parameter(params["gamma_final"].clone())
        self.w_lm = nn.Parameter(params["w_lm"].clone())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        s = self.shape
        batch, seq = tokens.shape
        rope = RoPE(R.sequence_positions(batch, seq, tokens.device), s.heads, s.kv_heads, s.head_dim, s.rope_theta)
        ce = CrossEntropy(targets.reshape(-1), R.IGNORE_INDEX, reduction)
        x = F.embedding(tokens.reshape(-1), self.embed)
        qkv = norm_consumer(x, self.layers[0].gamma_attn, self.layers[0].w_qkv, rope, s.eps)[0]
        for i, layer in enumerate(self.layers):
            q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
            a = R.causal_attention(q, k, v, batch, s.heads, s.kv_heads, s.head_dim)
            last = i == len(self.layers) - 1
            gamma, w, consumer = ((self.gamma_final, self.w_lm, ce) if last else
                                  (self.layers[i + 1].gamma_attn, self.layers[i + 1].w_qkv, rope))
            x, out = block(a, x, layer.w_o, layer.gamma_mlp, layer.w_gu, layer.w_down, gamma, w, consumer, s.eps)[:2]
            qkv = out
        return out  # the last block's consumer output: the loss

    def canonical_grads(self) -> dict[str, torch.Tensor]:
        """The parameters' gradients under the canonical names and layouts of :func:`init_params`."""
        s = self.shape
        qkv = (s.heads, s.kv_heads, s.head_dim)
        g = {"embed": self.embed.grad, "gamma_final": self.gamma_final.grad, "w_lm": self.w_lm.grad}
        for i, layer in enumerate(self.layers):
            w_q, w_k, w_v = L.qkv_rows_to_halfsplit(layer.w_qkv.grad, *qkv).split(
                [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim])
            w_gate, w_up = L.deinterleave_rows(layer.w_gu.grad)
            for name, t in [("gamma_attn", layer.gamma_attn.grad), ("w_q", w_q), ("w_k", w_k), ("w_v", w_v),
                            ("w_o", layer.w_o.grad), ("gamma_mlp", layer.gamma_mlp.grad), ("w_gate", w_gate),
                            ("w_up", w_up), ("w_down", layer.w_down.grad)]:
                g[f"layers.{i}.{name}"] = t
        return g


# ---- equivalence check ---------------------------------------------------------------------------------

@dataclass
class Equivalence:
    """One compared tensor: the relative errors against the float64 reference of CODA's result and of plain
    PyTorch's, both computed in ``dtype``; ``passed`` is the suite's pass rule (:func:`codabench.metrics.passes`)."""

    name: str
    coda: float
    torch: float
    dtype: torch.dtype

    @property
    def passed(self) -> bool:
        return passes(self.coda, self.torch, self.dtype)


def _ref_grads(params: dict[str, torch.Tensor], tokens, targets, shape, reduction):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = reference_loss(leaves, tokens, targets, shape, reduction)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items()}


def make_batch(shape: ModelShape, batch: int, seq: int, ignore_frac: float, device: torch.device | str,
               seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (tokens, targets) of shape [batch, seq]; about ``ignore_frac`` of the targets are ignore_index."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (batch, seq), generator=gen, device=device)
    targets = torch.randint(0, shape.vocab, (batch, seq), generator=gen, device=device)
    targets[torch.rand(batch, seq, generator=gen, device=device) < ignore_frac] = R.IGNORE_INDEX
    return tokens, targets


def check_equivalence(shape: ModelShape, n_layers: int, batch: int, seq: int, dtype: torch.dtype,
                      device: torch.device | str, reduction: str = "mean", ignore_frac: float = 0.1,
                      seed: int = 0) -> list[Equivalence]:
    """Loss and every parameter gradient of :class:`CodaLlama` vs the standard Llama, both against fp64.

    Same weights (canonical, ``dtype``), random tokens and targets (a fraction set to ignore_index). Returns
    one row per compared tensor: "loss" and each canonical parameter name.
    """
    params = init_params(shape, n_layers, dtype, device, seed)
    tokens, targets = make_batch(shape, batch, seq, ignore_frac, device, seed + 1)
    ref_loss, ref_grads = _ref_grads({k: v.double() for k, v in params.items()}, tokens, targets, shape, reduction)
    torch_loss, torch_grads = _ref_grads(params, tokens, targets, shape, reduction)
    model = CodaLlama(shape, params)
    loss = model(tokens, targets, reduction)
    loss.backward()
    grads = model.canonical_grads()
    rows = [Equivalence("loss", rel_err(loss.detach(), ref_loss), rel_err(torch_loss, ref_loss), dtype)]
    rows += [Equivalence(k, rel_err(grads[k], ref_grads[k]), rel_err(torch_grads[k], ref_grads[k]), dtype)
             for k in params]
    return rows
