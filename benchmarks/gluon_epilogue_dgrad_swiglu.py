"""Times the Gluon SwiGLU dgrad with its epilogue partition (:mod:`kernels.coda.swiglu_bwd_gluon`, the Gluon path of
``dgrad_swiglu`` on Hopper) against the fused Triton kernel, the split path and cuBLAS, over its configs.

    python benchmarks/gluon_epilogue_dgrad_swiglu.py                # 1B / 7B / 70B shapes (H100 or H200)
    python benchmarks/gluon_epilogue_dgrad_swiglu.py --compile-only  # no GPU needed: compiles each config for sm_90

Each config is (operand ring stages, rows of an epilogue sub-tile); the shipped choice is
:func:`kernels.coda.swiglu_bwd_gluon.stages` and ``SUB_M``. Each config is checked against the fused kernel first.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, also without pip install -e .
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gluon_experiment, also when loaded by path

from gluon_experiment import check, cli, compile_for_hopper, desc_type, inputs, reference_paths, time_paths
from kernels.coda import swiglu_bwd_gluon as G

CONFIGS = [(4, 32), (5, 32), (4, 16), (4, 64)]
"""(stages, epilogue sub-tile rows) timed; BM = BN = 128, BK = 64."""


def compile_only() -> dict[str, str]:
    """Compile each config for sm_90 (no GPU needed): shared memory bytes, and ptxas's registers and spills."""
    types = [desc_type([G.BM, G.BK]), desc_type([G.BK, G.BN]), "*i32", "*i32", "*bf16", "*fp32", "i32", "i32", "i32",
             "i32"]
    return {f"config={stages},{sub_m}": compile_for_hopper(
        G.ws_dgrad_swiglu_kernel, types,
        {"S": stages, "GROUP_M": G.GROUP_M, "SUB_M": sub_m, "MMA_W": G.MMA_WARPS, "num_warps": G.EPI_WARPS},
        G.EPI_WARPS, G.MAXNREG) for stages, sub_m in CONFIGS}


def bench(model: str) -> None:
    """The fused Triton kernel, its split path, each config (checked against the fused kernel first), cuBLAS."""
    args = inputs(model)
    paths = reference_paths(args)
    for stages, sub_m in CONFIGS:
        paths[f"gluon {(stages, sub_m)}"] = lambda s=stages, r=sub_m: G.ws_dgrad_swiglu(**args, n_stages=s, sub_m=r)
    ref = paths["fused (Triton)"]()
    for c in CONFIGS:
        check(f"{model} gluon {c}", paths[f"gluon {c}"](), ref)
    print(f"shipped at {model}: {G.stages(args['dx'].shape[1])} stages, {G.SUB_M} rows")
    time_paths(model, paths)


if __name__ == "__main__":
    raise SystemExit(cli(__doc__, compile_only, bench))
