"""Times the Gluon SwiGLU dgrad with its epilogue partition (:mod:`kernels.coda.swiglu_bwd_gluon`, the Gluon path of
``dgrad_swiglu`` on Hopper) against the fused Triton kernel, the split path and cuBLAS, over its configs, with bf16
operands and with fp8 ones (the dgrad's per-tensor recipe: dx e5m2, w_down e4m3 stored K-major).

    python benchmarks/gluon_epilogue_dgrad_swiglu.py                # 1B / 7B / 70B shapes (H100 or H200)
    python benchmarks/gluon_epilogue_dgrad_swiglu.py --compile-only  # no GPU needed: compiles each config for sm_90

Each config is (operand dtype, operand ring stages, rows of an epilogue sub-tile); the shipped choice is
:func:`kernels.coda.mainloop_gluon.stages` and ``SUB_M``. Each config is checked against the fused kernel first.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, also without pip install -e .
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gluon_experiment, also when loaded by path

from gluon_experiment import (FUSED, check, cli, compile_for_hopper, inputs, reference_paths, swiglu_case, time_paths,
                              ws_consts, ws_types)
from kernels.coda import mainloop_gluon as WS
from kernels.coda import swiglu_bwd_gluon as G
from workloads.fp8 import Fp8, Recipe, quantize_as

CONFIGS = [("bf16", 4, 32), ("bf16", 5, 32), ("bf16", 4, 16), ("bf16", 4, 64), ("fp8", 4, 32), ("fp8", 5, 32)]
"""(operands, stages, epilogue sub-tile rows) timed; BM = BN = 128, BK = 128 bytes (64 bf16, 128 fp8 elements)."""


def compile_only() -> dict[str, str]:
    """Compile each config for sm_90 (no GPU needed): shared memory bytes, and ptxas's registers and spills."""
    out = {}
    for dtype, stages, sub_m in CONFIGS:
        fp8 = dtype == "fp8"
        types = ws_types(fp8) + ["*i32", "*i32", "*bf16", "*fp32", "i32"]
        consts = {**ws_consts(fp8, stages), "SUB_M": sub_m}
        out[f"config={dtype},{stages},{sub_m}"] = compile_for_hopper(G.ws_dgrad_swiglu_kernel, types, consts,
                                                                     WS.EPI_WARPS, WS.MAXNREG)
    return out


def fp8_inputs(args: dict) -> dict:
    """``args`` quantized as the fp8 dgrad takes them (:func:`workloads.fp8.quantize_as`, per tensor in either recipe):
    dx as a gradient (e5m2), w_down as a dgrad weight (e4m3), passed as the transposed view of its K-major (f, d)
    copy."""
    recipe = Recipe(rowwise=False)
    return {**args, "dx": quantize_as(args["dx"], "grad", recipe),
            "w_down": quantize_as(args["w_down"], "weight_bwd", recipe).T}


def k_bytes(args: dict) -> int:
    """Bytes of a row of dx: the K the shipped stages depend on."""
    dx = args["dx"].data if isinstance(args["dx"], Fp8) else args["dx"]
    return dx.shape[1] * dx.element_size()


def bench(model: str) -> None:
    """Per operand dtype: the fused Triton kernel, its split path, each config (checked against the fused kernel
    first), the GEMM alone (cuBLAS; for fp8 the mainloop's, through the split path's GEMM)."""
    for dtype in ("bf16", "fp8"):
        args = fp8_inputs(inputs(model)) if dtype == "fp8" else inputs(model)
        paths = reference_paths(args)
        configs = [(s, r) for d, s, r in CONFIGS if d == dtype]
        for stages, sub_m in configs:
            paths[f"gluon {(stages, sub_m)}"] = lambda s=stages, r=sub_m: G.ws_dgrad_swiglu(**args, n_stages=s,
                                                                                          sub_m=r)
        ref = paths[FUSED]()
        for c in configs:
            check(f"{model} {dtype} gluon {c}", paths[f"gluon {c}"](), ref)
        print(f"shipped at {model}: {WS.stages(k_bytes(args))} stages, {G.SUB_M} rows")
        time_paths(paths, *swiglu_case(model, dtype))


if __name__ == "__main__":
    raise SystemExit(cli(__doc__, compile_only, bench))
