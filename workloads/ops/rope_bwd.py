from __future__ import annotations

from workloads import reference as R
from workloads.models import ModelShape
from workloads.op import InputMaker, Op


class RoPEBwd(Op):
    """The elementwise RoPE backward (``rope_bwd``). The forward wrote ``qkv = R z``, R rotating each (half-split)
    pair of the q and k heads by its angle ``pos_m theta^(-2i/dh)`` (v unrotated). Given dqkv and the saved qkv::

        dz = R^T dqkv        (the rotation by minus the angle: RoPE at position -pos_m)
        zdz_m = <qkv_m, dqkv_m>      (= <z_m, dz_m>: R is orthogonal, the pre-RoPE z is never needed)

    No GEMM: no speed-of-light.
    """

    name = "rope_bwd"
    kind = "direct"
    modes = ("bwd",)
    level = "kernel"
    description = "RoPE backward + ZdZ, elementwise"
    outputs = ("dz", "zdz")

    def make_inputs(self, model: ModelShape, dtype, device, seed):
        mk = InputMaker(dtype, device, seed)
        m, q = model.tokens, model.qkv_width
        return {"dqkv": mk.normal(m, q), "qkv": mk.normal(m, q), "positions": mk.positions(m, model.seq_len)}

    def reference(self, inp, model, mm=None):  # no GEMM: mm unused
        dq = R.upcast(inp["dqkv"])
        dz = R.qkv_rope(dq, -inp["positions"], model.heads, model.kv_heads, model.head_dim, model.rope_theta)
        return {"dz": dz.to(inp["dqkv"].dtype), "zdz": (R.upcast(inp["qkv"]) * dq).sum(-1)}

    def forward_gemms(self, model):
        return []
