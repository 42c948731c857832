from __future__ import annotations

import math

import torch

from workloads import reference as R
from workloads.models import ModelShape
from workloads.op import Gemm, InputMaker, Op

HF_LAYER_NAMES = {"gamma_attn": "input_layernorm.weight", "w_q": "self_attn.q_proj.weight",
                  "w_k": "self_attn.k_proj.weight", "w_v": "self_attn.v_proj.weight",
                  "w_o": "self_attn.o_proj.weight", "gamma_mlp": "post_attention_layernorm.weight",
                  "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight"}
""":data:`workloads.reference.LLAMA_LAYER_WEIGHTS` -> the weight's name in a Hugging Face Llama layer."""
EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
WEIGHT_GAIN = 0.25
"""Linear weights have std ``WEIGHT_GAIN / sqrt(in_features)``. The harness's verification inputs are the inputs x2,
which multiplies each sublayer's output by 8 to 32 (2 per weight and norm gain on its path) and sharpens the softmax;
with this gain a step stays about as well conditioned after doubling (the errors of fp32 and bf16 against float64
grew less than 2x in every gradient on 2- and 4-layer shapes), where at gain 1 they grew 10-50x, enough to fail an
honest implementation in the check of the refilled buffers."""


def layer_weight(i: int, name: str) -> str:
    """The Hugging Face state-dict name of layer i's weight ``name`` (one of ``LLAMA_LAYER_WEIGHTS``)."""
    return f"model.layers.{i}.{HF_LAYER_NAMES[name]}"


def batch_and_seq(model: ModelShape) -> tuple[int, int]:
    """The batch of a step of ``model.tokens`` tokens: the fewest rows of at most ``seq_len`` tokens that split the
    tokens evenly, ``(batch, tokens / batch)`` (16384 tokens, seq_len 8192: 2 x 8192; 1024 tokens: 1 x 1024)."""
    batch = math.ceil(model.tokens / model.seq_len)
    while model.tokens % batch:
        batch += 1
    return batch, model.tokens // batch


class TrainStep(Op):
    """One training step, forward + backward, of an N-layer Llama (N = ``model.layers``) in Hugging Face layout::

        loss = llama_loss(weights, input_ids, shifted(labels))      (workloads.reference.llama_loss)

    Inputs: the weights of an untied ``LlamaForCausalLM`` under their state-dict names (``model.embed_tokens.weight``,
    ``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``), and ``input_ids``
    and ``labels`` of shape [batch, seq] (:func:`batch_and_seq`), the labels being the input ids with about 5% set to
    -100. The loss is Hugging Face's causal LM loss: ``targets[b, t] = labels[b, t + 1]`` (the last position
    ignored), cross-entropy with ignore_index -100, the mean over the tokens not ignored. RoPE is the default
    (unscaled) kind with ``model.rope_theta``, attention causal SDPA with GQA. The compared tensors are the loss
    and the gradient of every weight (the optimizer step is not part of the cell: it would write the weights,
    which are the cell's inputs).
    """

    name = "train_step"
    description = "forward + backward of an N-layer Llama (HF layout), loss and every weight's gradient"
    level = "model"
    modes = ("fwd_bwd",)
    outputs = ("loss",)
    consts = ("input_ids", "labels")

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        d, f, dh = model.hidden, model.ffn, model.head_dim

        def weight(n_out: int, n_in: int) -> torch.Tensor:
            return mk.normal(n_out, n_in, std=WEIGHT_GAIN * n_in ** -0.5)

        inp = {EMBED: mk.normal(model.vocab, d)}
        for i in range(model.layers):
            for name, t in [("gamma_attn", mk.gamma(d)), ("w_q", weight(model.heads * dh, d)),
                            ("w_k", weight(model.kv_heads * dh, d)), ("w_v", weight(model.kv_heads * dh, d)),
                            ("w_o", weight(d, model.attn_width)), ("gamma_mlp", mk.gamma(d)),
                            ("w_gate", weight(f, d)), ("w_up", weight(f, d)), ("w_down", weight(d, f))]:
                inp[layer_weight(i, name)] = t
        inp[FINAL_NORM], inp[LM_HEAD] = mk.gamma(d), weight(model.vocab, d)
        shape = batch_and_seq(model)
        ids = mk.targets(model.tokens, model.vocab, ignore_frac=0.0)
        drop = torch.rand(model.tokens, generator=mk.gen, device=mk.device) < 0.05
        drop[1:2] = False  # the first row's second label, the first token's shifted target: the loss has a term
        inp["input_ids"], inp["labels"] = ids.view(shape), ids.masked_fill(drop, R.IGNORE_INDEX).view(shape)
        return inp

    def na_reason(self, model):
        batch, seq = batch_and_seq(model)
        if seq < 2:
            return (f"n/a: a step of {model.tokens} token(s) splits into rows of at most seq_len = {model.seq_len} "
                    f"tokens only as rows of 1 token, which have no next-token target; give --tokens a count that "
                    f"splits into rows of 2 to {model.seq_len} tokens")
        return None

    def reference(self, inp, model, mm=None):  # no fp8 cells: mm unused
        layers = [{k: inp[layer_weight(i, k)] for k in R.LLAMA_LAYER_WEIGHTS} for i in range(model.layers)]
        return {"loss": R.llama_loss(inp[EMBED], layers, inp[FINAL_NORM], inp[LM_HEAD], inp["input_ids"],
                                     R.shifted_targets(inp["labels"]), model)}

    def forward_gemms(self, model):
        """Per layer the packed QKV, out, packed gate/up and down projections, then the LM head. Attention's
        ``q k^T`` and ``p v`` are not plain GEMMs (one SDPA kernel, the same in every implementation): they are in
        :meth:`flops` but not in the speed-of-light."""
        m, d, f = model.tokens, model.hidden, model.ffn
        layer = [Gemm(m, model.qkv_width, d), Gemm(m, d, model.attn_width), Gemm(m, 2 * f, d), Gemm(m, d, f)]
        return layer * model.layers + [Gemm(m, model.vocab, d)]

    def flops(self, model, mode):
        """The GEMMs' FLOPs plus causal attention's: per layer, sequence and head, ``q k^T`` and ``p v`` take
        ``2 dh`` FLOPs each for every (query, key) pair at or below the diagonal, ``seq (seq + 1) / 2`` pairs; the
        backward twice that (dq, dk, dv, dp). The masked half is not counted, nor the softmax, norms and the
        embedding."""
        batch, seq = batch_and_seq(model)
        fwd = model.layers * batch * model.heads * 4 * model.head_dim * (seq * (seq + 1) // 2)
        return super().flops(model, mode) + fwd * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[mode]
