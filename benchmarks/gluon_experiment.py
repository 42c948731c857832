"""What the Gluon dgrad experiments share (gluon_epilogue_dgrad_rmsnorm.py, and the SwiGLU dgrad's two lost forms,
gluon_ws_dgrad_swiglu.py and gluon_pingpong_dgrad_swiglu.py): the suite's SwiGLU shapes and inputs, the SwiGLU
backward on packed bf16 pairs, building a kernel for sm_90 without a GPU (shared memory, ptxas's registers and
spills), checking a path against the fused Triton kernel, interleaved timing, and the command line."""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

SHAPES = {"llama-1b": (16384, 8192, 2048), "llama-7b": (16384, 11008, 4096), "llama-70b": (16384, 28672, 8192)}
"""(M, f, d) of the suite's swiglu_dgrad cells."""
FUSED = "fused (Triton)"


@gluon.jit
def swiglu_pairs_bwd(dy, pairs):
    """The SwiGLU backward of fp32 dy given the (gate, up) bf16 pairs of z_pre as uint32 words (gate in the low half):
    the packed (dgate, dup) bf16 words, y in bf16, and the row sums of ``gate dgate + up dup``."""
    gate = (pairs << 16).to(gl.float32, bitcast=True)
    up = (pairs & 0xFFFF0000).to(gl.float32, bitcast=True)
    s = 1.0 / (1.0 + gl.exp(-gate))
    silu = gate * s
    dgate = dy * up * s * (1.0 + gate * (1.0 - s))
    dup = dy * silu
    dz = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [dgate, dup], dtype=gl.int32,
                                   is_pure=True, pack=1)
    return dz, (silu * up).to(gl.bfloat16), gl.sum(gate * dgate + up * dup, axis=1)


def desc_type(block: list[int], dtype: Any = gl.bfloat16, name: str = "bf16") -> str:
    """The signature type of a host TMA descriptor of ``block`` tiles in the default NVMMA shared layout."""
    return f"tensordesc<{name}[{block[0]}, {block[1]}],{gl.NVMMASharedLayout.get_default_for(block, dtype)!r}>"


def ptxas_usage(kernel: Any) -> str:
    """ptxas's register and spill lines for a compiled kernel (Triton's bundled ptxas, ``-v``)."""
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        ptxas = get_ptxas(90).path  # Triton 3.9's signature
    except TypeError:
        ptxas = get_ptxas().path
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True)
    lines = [ln.split("info    : ")[-1].strip() for ln in res.stderr.splitlines() if "registers" in ln or "spill" in ln]
    return "; ".join(lines) or res.stderr.strip()[-200:]


def compile_for_hopper(kernel: Any, types: list[str], consts: dict[str, Any], num_warps: int, maxnreg: int) -> str:
    """Compile the Gluon ``kernel`` for sm_90 with its runtime arguments of ``types`` (in order) and its constexpr
    arguments ``consts``: ``"<shared memory> B shared, <ptxas's usage line>"``."""
    names = kernel.arg_names
    sig = dict(zip(names, types + ["constexpr"] * len(consts)))
    src = GluonASTSource(kernel, sig, {(names.index(k), ): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                                "maxnreg": maxnreg})
    return f"{compiled.metadata.shared} B shared, {ptxas_usage(compiled)}"


def ws_types(fp8: bool) -> list[str]:
    """The signature types of the leading runtime parameters of a :mod:`kernels.coda.mainloop_gluon` kernel (a_desc,
    b_desc, sa_ptr, sb_ptr, M, N, K) for bf16 operands or fp8 ones (dx e5m2, the weight e4m3 staged K-major)."""
    from kernels.coda.mainloop_gluon import BM, BN, K_BYTES
    bk = K_BYTES // (1 if fp8 else 2)
    descs = ([desc_type([BM, bk], gl.float8e5, "fp8e5"), desc_type([BN, bk], gl.float8e4nv, "fp8e4nv")] if fp8 else
             [desc_type([BM, bk]), desc_type([bk, BN])])
    return descs + ["*fp32", "*fp32", "i32", "i32", "i32"]


def ws_consts(fp8: bool, stages: int) -> dict[str, Any]:
    """The schedule's constexpr arguments of a :mod:`kernels.coda.mainloop_gluon` kernel, as :class:`WsGemm` passes
    them."""
    from kernels.coda.mainloop_gluon import EPI_WARPS, GROUP_M, MMA_WARPS
    return {"B_NK": fp8, "SCALED": fp8, "INSTR_K": 32 if fp8 else 16, "S": stages, "GROUP_M": GROUP_M,
            "MMA_W": MMA_WARPS, "num_warps": EPI_WARPS}


def inputs(model: str) -> dict[str, torch.Tensor]:
    """bf16 ``dx`` [M, d], ``w_down`` [d, f] and ``z_pre`` [M, 2f] at ``model``'s swiglu_dgrad shape (seeded)."""
    m, f, d = SHAPES[model]
    torch.manual_seed(0)
    return {"dx": torch.randn(m, d, device="cuda", dtype=torch.bfloat16),
            "w_down": (torch.randn(d, f, device="cuda") * d ** -0.5).to(torch.bfloat16),
            "z_pre": torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16)}


def reference_paths(args: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The fused Triton kernel (the reference every config is checked against), its split path and the GEMM alone
    (cuBLAS; for fp8 operands ``torch._scaled_mm`` in fast accumulation)."""
    from kernels.coda.swiglu_bwd import dgrad_swiglu
    from workloads.fp8 import Fp8, Recipe, ScaledMMGemms
    dx, w = args["dx"], args["w_down"]
    gemm = ((lambda: ScaledMMGemms(Recipe(rowwise=False)).dgrad(dx, w.T)) if isinstance(dx, Fp8) else
            (lambda: dx @ w))
    return {FUSED: lambda: dgrad_swiglu.fused(**args), "split": lambda: dgrad_swiglu.split(**args),
            "cuBLAS GEMM": gemm}


def check(label: str, out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> None:
    """Print ``out``'s (dz_pre, y, zdz) relative errors against the fused kernel's ``ref``."""
    from codabench.metrics import rel_err
    errs = [rel_err(a, b.double()) for a, b in zip(out, ref)]
    print(f"{label}: rel_err against fused: dz_pre {errs[0]:.1e}, y {errs[1]:.1e}, zdz {errs[2]:.1e}", flush=True)


def swiglu_case(model: str, label: str = "") -> tuple[str, float]:
    """(title, FLOPs) of ``model``'s swiglu_dgrad cell for :func:`time_paths`; ``label``: the operands' dtype, say."""
    m, f, d = SHAPES[model]
    return f"{model}{' ' + label if label else ''}, M = {m}, f = {f}, d = {d}", 2 * m * f * d


def time_paths(paths: dict[str, Callable[[], Any]], title: str, flops: float) -> None:
    """Time every path in 3 interleaved rounds of ``do_bench`` (L2 flushed) and print the medians, TFLOP/s (of
    ``flops``) and the ratio to the fused kernel's, under ``title``."""
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(3):
        for k, fn in paths.items():
            times[k].append(triton.testing.do_bench(fn, warmup=25, rep=100))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{title}:")
    width = max(map(len, med))
    for k, v in med.items():
        print(f"  {k:{width}} {v:7.3f} ms  {flops / v / 1e9:4.0f} TFLOP/s  {v / med[FUSED]:.3f}x fused",
              flush=True)


def cli(doc: str, compile_only: Callable[[], dict[str, str]], bench: Callable[[str], None]) -> int:
    """``--compile-only`` (each config built for sm_90: ``config=...: compiled for sm_90, <info>``) or ``bench`` of
    each of ``--models``; an unknown model is one argparse error line, exit 2, and so is timing without a Hopper GPU
    (the kernels are sm_90's)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
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
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        p.exit(2, f"{p.prog}: timing needs a Hopper GPU (sm_90: an H100 or H200); --compile-only builds the kernels "
                  "without one\n")
    for model in args.models.split(","):
        bench(model)
    return 0
