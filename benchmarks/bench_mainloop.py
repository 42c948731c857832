"""Plain GEMM through the CODA mainloop vs cuBLAS (torch.mm) on the block's GEMM shapes.

    python benchmarks/bench_mainloop.py [--models llama-7b,llama-70b] [--tokens 16384] [--sweep]
                                        [--dtype bf16|fp8|fp8-row] [--accum fast|promoted]

Prints, per shape and layout (fwd: x W^T, dgrad: dz W, wgrad: dz^T y), cuBLAS and mainloop TFLOP/s and
their ratio. ``--sweep`` also times every tile config and loop variant (flatten, warp specialization)
one by one, to choose the autotune space. ``--dtype fp8`` / ``fp8-row``: the forward GEMMs on e4m3
operands (per-tensor / rowwise scales, bf16 out) against ``torch._scaled_mm`` with the same scales and
accumulation mode. Timing: triton.testing.do_bench (median, L2 flushed).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, also without pip install -e .

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from codabench.metrics import rel_err  # noqa: E402
from kernels.coda.gemm import gemm_kernel, linear, matmul  # noqa: E402
from kernels.coda.mainloop import gemm_configs, mainloop, num_tiles, operand_descs, tile_coords, tile_desc  # noqa: E402
from workloads import fp8  # noqa: E402
from workloads.models import get_model  # noqa: E402
from workloads.op import Gemm  # noqa: E402
from workloads.ops import OPS  # noqa: E402


@triton.jit
def _variant_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_a, stride_b, stride_c,
                    A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, GROUP_M: tl.constexpr,
                    FLATTEN: tl.constexpr, WS: tl.constexpr):
    a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, N, K, stride_a, stride_b, BM, BN, BK, A_KM, B_KN)
    c_desc = tile_desc(c_ptr, M, N, stride_c, BM, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), tl.num_programs(0), flatten=FLATTEN,
                            warp_specialize=WS):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def operands(g: Gemm, dtype):
    a = torch.randn(g.m, g.k, device="cuda", dtype=dtype) if g.a_layout == "mk" else \
        torch.randn(g.k, g.m, device="cuda", dtype=dtype).T
    b = torch.randn(g.n, g.k, device="cuda", dtype=dtype).T if g.b_layout == "nk" else \
        torch.randn(g.k, g.n, device="cuda", dtype=dtype)
    return a, b


def tflops(g: Gemm, ms: float) -> float:
    return g.flops / ms / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="llama-1b,llama-7b,llama-70b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--layouts", default="fwd,dgrad,wgrad")
    p.add_argument("--dtype", default="bf16", choices=("bf16", *fp8.FP8_DTYPES))
    p.add_argument("--accum", default="fast", choices=("fast", "promoted"))
    args = p.parse_args()
    dtype = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device {torch.cuda.get_device_name()} triton {triton.__version__} torch {torch.__version__}")
    if args.dtype != "bf16":
        return fp8_main(args)
    rows = []
    for name in args.models.split(","):
        model = get_model(name, tokens=args.tokens)
        shapes = {op: OPS[op].forward_gemms(model)[0] for op in
                  ("gemm_qkv", "gemm_out", "gemm_gate_up", "gemm_down")}
        for op, fwd in shapes.items():
            dgrad, wgrad = fwd.backward()
            for lay, g in (("fwd", fwd), ("dgrad", dgrad), ("wgrad", wgrad)):
                if lay not in args.layouts:
                    continue
                a, b = operands(g, dtype)
                ref = torch.mm(a, b)
                out = matmul(a, b)
                err = rel_err(out, ref)
                t_cublas = triton.testing.do_bench(lambda: torch.mm(a, b), warmup=50, rep=300)
                t_ours = triton.testing.do_bench(lambda: matmul(a, b), warmup=50, rep=300)
                best = gemm_kernel.best_config
                rows.append((name, op, lay, t_cublas / t_ours))
                print(f"{name:10s} {op:13s} {lay:5s} {g.m:6d}x{g.n:6d}x{g.k:6d}  cuBLAS {tflops(g, t_cublas):6.1f}"
                      f"  ours {tflops(g, t_ours):6.1f} TFLOP/s  ratio {t_cublas / t_ours:5.3f}  relerr {err:.1e}"
                      f"  best {best}", flush=True)
                if args.sweep and lay == "fwd":
                    sweep(g, a, b, ref, sms)
    print("\nsummary (ours/cuBLAS throughput):")
    for name, op, lay, ratio in rows:
        print(f"  {name:10s} {op:13s} {lay:5s} {ratio:5.3f}")


def fp8_main(args) -> None:
    """The forward GEMM shapes on fp8 operands: mainloop vs torch._scaled_mm, same recipe and accumulation."""
    recipe = fp8.recipe(args.dtype, args.accum)
    print(f"fp8 recipe: {recipe.label}")
    ratios = []
    for name in args.models.split(","):
        model = get_model(name, tokens=args.tokens)
        for op in ("gemm_qkv", "gemm_out", "gemm_gate_up", "gemm_down", "gemm_lm_head"):
            g = OPS[op].forward_gemms(model)[0]
            xq = fp8.quantize_as(torch.randn(g.m, g.k, device="cuda"), "act", recipe)
            wq = fp8.quantize_as(torch.randn(g.n, g.k, device="cuda") * g.k ** -0.5, "weight", recipe)
            mm = fp8.ScaledMMGemms(recipe)
            ref = xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).T
            ours, theirs = linear(xq, wq, recipe), mm.linear(xq, wq)
            errs = [rel_err(o, ref) for o in (ours, theirs)]
            t_ref = triton.testing.do_bench(lambda: mm.linear(xq, wq), warmup=50, rep=300)
            t_ours = triton.testing.do_bench(lambda: linear(xq, wq, recipe), warmup=50, rep=300)
            best = gemm_kernel.best_config
            ratios.append((name, op, t_ref / t_ours))
            print(f"{name:10s} {op:13s} {g.m:6d}x{g.n:6d}x{g.k:6d}  _scaled_mm {tflops(g, t_ref):7.1f}  ours "
                  f"{tflops(g, t_ours):7.1f} TFLOP/s  ratio {t_ref / t_ours:5.3f}  relerr ours {errs[0]:.1e} "
                  f"_scaled_mm {errs[1]:.1e}  best {best}", flush=True)
    print("\nsummary (ours/_scaled_mm throughput):")
    for name, op, r in ratios:
        print(f"  {name:10s} {op:13s} {r:5.3f}")


def sweep(g: Gemm, a, b, ref, sms: int) -> None:
    c = torch.empty(g.m, g.n, device="cuda", dtype=a.dtype)
    a_s, a_t = (a, False) if a.stride(-1) == 1 else (a.T, True)
    b_s, b_t = (b, False) if b.stride(-1) == 1 else (b.T, True)
    for cfg, flatten, ws in itertools.product(gemm_configs(), (True, False), (False, True)):
        kw = dict(cfg.kwargs)
        grid = (min(sms, triton.cdiv(g.m, kw["BM"]) * triton.cdiv(g.n, kw["BN"])),)
        fn = lambda: _variant_kernel[grid](a_s, b_s, c, g.m, g.n, g.k, a_s.stride(0), b_s.stride(0),
                                           c.stride(0), A_KM=a_t, B_KN=not b_t, FLATTEN=flatten,
                                           WS=ws, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **kw)
        try:
            fn()
            err = rel_err(c, ref)
            ms = triton.testing.do_bench(fn, warmup=25, rep=150)
            print(f"    {kw} w{cfg.num_warps} s{cfg.num_stages} flatten={flatten:d} ws={ws:d}: "
                  f"{tflops(g, ms):6.1f} TFLOP/s relerr {err:.1e}", flush=True)
        except Exception as e:  # a variant this Triton cannot compile
            print(f"    {kw} w{cfg.num_warps} s{cfg.num_stages} flatten={flatten:d} ws={ws:d}: FAILED "
                  f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)


if __name__ == "__main__":
    main()
