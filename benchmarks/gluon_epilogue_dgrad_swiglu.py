"""Times the Gluon SwiGLU dgrad with its epilogue partition (:mod:`kernels.coda.swiglu_bwd_gluon`, the Gluon path of
``dgrad_swiglu`` on Hopper) against the fused Triton kernel, the split path and cuBLAS, over its configs.

    python benchmarks/gluon_epilogue_dgrad_swiglu.py                # 1B / 7B / 70B shapes (H100 or H200)
    python benchmarks/gluon_epilogue_dgrad_swiglu.py --compile-only  # no GPU needed: compiles each config for sm_90

Each config is (operand ring stages, rows of an epilogue sub-tile); the shipped choice is
:func:`kernels.coda.swiglu_bwd_gluon.stages` and ``SUB_M``. Each config is checked against the fused kernel first.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, also without pip install -e .
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gluon_build, also when loaded by path

import torch
import triton

from kernels.coda import swiglu_bwd_gluon as G

CONFIGS = [(4, 32), (5, 32), (4, 16), (4, 64)]
"""(stages, epilogue sub-tile rows) timed; BM = BN = 128, BK = 64."""
SHAPES = {"llama-1b": (16384, 8192, 2048), "llama-7b": (16384, 11008, 4096), "llama-70b": (16384, 28672, 8192)}
"""(M, f, d) of the suite's swiglu_dgrad cells."""


def compile_only() -> dict[str, str]:
    """Compile each config for sm_90 (no GPU needed): shared memory bytes, and ptxas's registers and spills."""
    from gluon_build import compile_for_hopper, desc_type

    out = {}
    for stages, sub_m in CONFIGS:
        types = [desc_type([G.BM, G.BK]), desc_type([G.BK, G.BN]), "*i32", "*i32", "*bf16", "*fp32", "i32", "i32",
                 "i32", "i32"]
        consts = {"S": stages, "GROUP_M": G.GROUP_M, "SUB_M": sub_m, "MMA_W": G.MMA_WARPS, "num_warps": G.EPI_WARPS}
        shared, usage = compile_for_hopper(G.ws_dgrad_swiglu_kernel, types, consts, G.EPI_WARPS, G.MAXNREG)
        out[f"config={stages},{sub_m}"] = f"{shared} B shared, {usage}"
    return out


def bench(models: list[str]) -> None:
    """Per shape: the fused Triton kernel, its split path, each config, cuBLAS (``dx @ w_down``); 3 interleaved
    ``do_bench`` rounds (L2 flushed), medians."""
    from codabench.metrics import rel_err
    from kernels.coda.swiglu_bwd import dgrad_swiglu

    torch.manual_seed(0)
    for model in models:
        m, f, d = SHAPES[model]
        dx = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(d, f, device="cuda") * d ** -0.5).to(torch.bfloat16)
        z = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16)
        args = {"dx": dx, "w_down": w, "z_pre": z}
        paths = {"fused (Triton)": lambda: dgrad_swiglu.fused(**args), "split": lambda: dgrad_swiglu.split(**args)}
        paths.update({f"gluon {c}": (lambda c=c: G.ws_dgrad_swiglu(dx, w, z, *c)) for c in CONFIGS})
        paths["cuBLAS GEMM"] = lambda: dx @ w
        ref = paths["fused (Triton)"]()
        for c in CONFIGS:
            errs = [rel_err(a, b.double()) for a, b in zip(paths[f"gluon {c}"](), ref)]
            print(f"{model} gluon {c}: rel_err against fused: dz_pre {errs[0]:.1e}, y {errs[1]:.1e}, zdz {errs[2]:.1e}",
                  flush=True)
        times = {k: [] for k in paths}
        for _ in range(3):
            for k, fn in paths.items():
                times[k].append(triton.testing.do_bench(fn, warmup=25, rep=100))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{model}, M = {m}, f = {f}, d = {d} (shipped: {G.stages(d)} stages, {G.SUB_M} rows):")
        fused = med["fused (Triton)"]
        for k, v in med.items():
            print(f"  {k:20} {v:7.3f} ms  {2 * m * f * d / v / 1e9:4.0f} TFLOP/s  {v / fused:.3f}x fused", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = p.parse_args()
    unknown = [m for m in args.models.split(",") if m not in SHAPES]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if args.compile_only:
        for name, info in compile_only().items():
            print(f"{name}: compiled for sm_90, {info}")
        return 0
    bench(args.models.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
