"""Experiment: the producer GEMM (out-proj + residual + RMSNorm statistics) as a warp-specialized Gluon kernel.

    python benchmarks/gluon_ws_producer.py [--models llama-1b,llama-7b,llama-70b] [--tokens 16384] [bench_coda flags]
    python benchmarks/gluon_ws_producer.py --compile-only      # no GPU needed: compiles for sm_90

The kernel is :mod:`kernels.coda.producer_gluon`, the Gluon path of :func:`kernels.coda.producer.gemm_residual_norm`
(Hopper only). This file times it and the variants that lost (docs/performance.md, "Gluon") as
codabench plugins: ``gluon-ws`` (the shipped form, h = bf16(x) * gamma) and ``gluon-ws-x32`` (h = bf16(x_fp32 *
gamma)) implement the op ``producer_out``, ``gluon-ws`` also the plain GEMM ``gemm_out``. Run as a script, it runs
them through the harness with bench_coda.py (the ``kernels`` suite's inputs, float64 check and pass rule, timing
rounds beside the cuBLAS GEMMs), next to the shipped Triton kernel (``coda-triton``, forced fused) and torch.compile,
and prints bench_coda's table: error, time / cuBLAS GEMM, speedup.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import triton
from triton.experimental.gluon import language as gl

from codabench.case import Case
from codabench.registry import register
from kernels.coda.producer_gluon import BK, BM, BN, GROUP_M, MAXNREG, STAGES, WARPS, ws_producer, ws_producer_kernel


def compile_only() -> dict[str, int]:
    """Compile every variant for sm_90 (no GPU needed); shared memory bytes per variant."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"

    names = ws_producer_kernel.arg_names
    types = [desc([BM, BK]), desc([BN, BK])] + [desc([BM, BN])] * 3 + ["*fp32", "*fp32"] + ["i32"] * 4
    shared = {}
    for producer, x16 in ((False, True), (True, True), (True, False)):
        consts = {"PRODUCER": producer, "H_FROM_X16": x16, "S": STAGES, "GROUP_M": GROUP_M, "num_warps": WARPS}
        sig = dict(zip(names, types + ["constexpr"] * len(consts)))
        src = GluonASTSource(ws_producer_kernel, sig, {(names.index(k), ): v for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS, "maxnreg": MAXNREG})
        shared[f"producer={producer} h_from_x16={x16}"] = k.metadata.shared
    return shared


# ---- the plugin ------------------------------------------------------------------------------------------------

def _with_eps(case: Case) -> dict:
    return {**case.inputs, "eps": case.model.eps}


GLUON = {"modes": ("fwd",), "dtypes": ("bf16", "fp16"), "requires": ("sm90",), "label": "fused"}


@register("producer_out", "gluon-ws", prepare=_with_eps, **GLUON)
def gluon_ws(a, w, residual, gamma, eps):
    """The warp-specialized Gluon producer, h = bf16(x) * gamma."""
    return dict(zip(("x", "h", "rstd"), ws_producer(a, w, residual, gamma, eps)))


@register("producer_out", "gluon-ws-x32", prepare=_with_eps, **GLUON)
def gluon_ws_x32(a, w, residual, gamma, eps):
    """The warp-specialized Gluon producer, h = bf16(x_fp32 * gamma)."""
    return dict(zip(("x", "h", "rstd"), ws_producer(a, w, residual, gamma, eps, h_from_x16=False)))


@register("gemm_out", "gluon-ws", **GLUON)
def gluon_ws_gemm(x, w):
    """The plain GEMM through the same warp-specialized mainloop."""
    return {"out": ws_producer(x, w)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compile-only", action="store_true")
    args, rest = p.parse_known_args()
    if args.compile_only:
        for name, smem in compile_only().items():
            print(f"{name}: compiled for sm_90, {smem} B shared memory")
        return 0
    # a process of its own: this one imported triton before the harness could pick the device
    return subprocess.run([sys.executable, str(Path(__file__).with_name("bench_coda.py")), "--kernels",
                           "producer_out,gemm_out", "--plugin", __file__,
                           "--impls", "torch-compile,coda-triton,gluon-ws,gluon-ws-x32", *rest],
                          env={**os.environ, "CODABENCH_STRATEGY": os.environ.get("CODABENCH_STRATEGY", "fused")}
                          ).returncode


if __name__ == "__main__":
    raise SystemExit(main())
