"""Where a cell's GPU time goes: each implementation's kernels, warm, under torch.profiler.

    python benchmarks/profile_cell.py --op block --model llama-1b --mode fwd_bwd [--dtype bf16]
        [--impls torch-compile,coda-triton] [--steps 5] [--top 12]

For each implementation, the cell's call as the suite times it (:func:`codabench.execute.timed_call` on the timing
inputs, with the timing pass's upstream gradients): its median over ``--steps`` x 4 samples by
:func:`codabench.timing.measure` (L2 flushed, as in a run), then ``--steps`` calls profiled one by one (a backward
cell's forward, its untimed setup, stays outside the profiler). Printed per implementation: the median, the summed
kernel time per call, the part of it in GEMM kernels (cuBLAS, CUTLASS, nvjet, and CODA's mainloop kernels with their
fused epilogues), the host synchronizations of one call (file:line, from torch's CUDA sync debug mode: each lets
the GPU run dry while the host catches up, which the median pays and the kernel sum does not) and the ``--top``
kernels by time. ``CODABENCH_STRATEGY=fused|split`` forces CODA's choices, as in
a run. On a machine without a GPU it profiles CPU time on the Triton interpreter: a check that the script runs, not a
figure.
"""
from __future__ import annotations

import argparse
import re
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from codabench.bootstrap import select_device  # noqa: E402

DEVICE = torch.device(select_device())  # before anything imports triton: the interpreter without a GPU

from codabench.case import Case  # noqa: E402
from codabench.discovery import discover  # noqa: E402
from codabench.eager import TorchEager  # noqa: E402
from codabench.execute import forward_shapes, timed_call, uses_autograd  # noqa: E402
from codabench.measure import TIMING_GRAD_SEED, TIMING_SEED  # noqa: E402
from codabench.timing import TimingConfig, measure  # noqa: E402
from workloads.fp8 import FP8_DTYPES  # noqa: E402
from workloads.models import PRESETS, get_model  # noqa: E402
from workloads.ops import OPS  # noqa: E402

GEMM = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|dgrad_|scaled_linear|matmul", re.IGNORECASE)
"""Kernel names that carry a GEMM: the vendor libraries' and CODA's mainloop kernels (fused epilogues included)."""


@dataclass
class Profile:
    """One implementation's profile: ``median_ms`` of the timed call; ``kernels``: name -> (ms, launches) per call;
    ``syncs``: where one call synchronized the host with the GPU (file:line each; None without a GPU)."""

    median_ms: float
    kernels: dict[str, tuple[float, float]]
    syncs: list[str] | None

    @property
    def total_ms(self) -> float:
        return sum(ms for ms, _ in self.kernels.values())

    @property
    def gemm_ms(self) -> float:
        return sum(ms for name, (ms, _) in self.kernels.items() if GEMM.search(name))


def profile_impl(impl, op_name: str, model: str, mode: str, dtype: str, steps: int, device: torch.device) -> Profile:
    """The cell's timed call of ``impl`` (a registered implementation), measured and then profiled ``steps`` times
    (module docstring)."""
    op, shape = OPS[op_name], get_model(model)
    case = Case(op, shape, mode, dtype, device, op.inputs(shape, dtype, device, TIMING_SEED))
    reason = impl.skip_reason(case)
    if reason:
        raise SystemExit(f"profile_cell.py: {impl.name} cannot run this cell: {reason}")
    native = impl.prepare(case)
    grads = None
    if uses_autograd(op, mode):
        eager = TorchEager(op)
        grads = impl.grad_outputs_to_native(op.grad_outputs(forward_shapes(op, eager, eager.prepare(case)),
                                                            TIMING_GRAD_SEED), native)
    timed = timed_call(op, impl, native, mode, grads)
    on_gpu = device.type == "cuda"
    with timed.context:
        median = measure(timed.fn, timed.setup, device, TimingConfig(reps=4 * steps, cpu_reps=1)).median
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for _ in range(steps):
            state = timed.setup() if timed.setup is not None else None
            if on_gpu:
                torch.cuda.synchronize(device)
            with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
                timed.fn(state)
                if on_gpu:
                    torch.cuda.synchronize(device)
            for e in prof.key_averages():
                us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
                if us > 0:
                    sums[e.key][0] += us / 1e3 / steps
                    sums[e.key][1] += e.count / steps
        syncs = host_syncs(timed, device) if on_gpu else None
    return Profile(median, {k: (ms, n) for k, (ms, n) in sums.items()}, syncs)


def host_syncs(timed, device: torch.device) -> list[str]:
    """file:line of each host synchronization in one call of ``timed`` (torch's CUDA sync debug mode warns at each;
    autograd's backward thread included)."""
    state = timed.setup() if timed.setup is not None else None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            timed.fn(state)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def report(impl: str, p: Profile, top: int) -> str:
    lines = [f"### {impl}: median {p.median_ms:.3f} ms; kernels {p.total_ms:.3f} ms per call, "
             f"GEMM kernels {p.gemm_ms:.3f}, the rest {p.total_ms - p.gemm_ms:.3f}",
             "    host synchronizations per call: " + ("not measured without a GPU" if p.syncs is None else
                                                       f"{len(p.syncs)} {' '.join(p.syncs)}".rstrip())]
    for name, (ms, n) in sorted(p.kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{ms:9.3f} ms {n:5.1f}x  {'G' if GEMM.search(name) else ' '} {name[:110]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", required=True, choices=sorted(OPS))
    p.add_argument("--model", default="llama-1b", choices=sorted(PRESETS))
    p.add_argument("--mode", default="fwd", choices=["fwd", "bwd", "fwd_bwd"])
    p.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16", *FP8_DTYPES])
    p.add_argument("--impls", default="torch-compile,coda-triton")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    if args.mode not in OPS[args.op].modes:
        p.exit(2, f"profile_cell.py: {args.op} has no {args.mode} mode (it has {', '.join(OPS[args.op].modes)})\n")
    registry = discover()
    names = [n for n in args.impls.split(",") if n]
    known = {i.name for i in registry.for_op(args.op)}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        p.exit(2, f"profile_cell.py: no implementation {', '.join(unknown) or '(none given)'} of {args.op} "
                  f"(there are: {', '.join(sorted(known))})\n")
    if DEVICE.type == "cpu":
        print("no GPU: CPU time on the Triton interpreter, not a performance figure", flush=True)
    for name in names:
        profiled = profile_impl(registry.get(args.op, name), args.op, args.model, args.mode, args.dtype, args.steps,
                                DEVICE)
        print(report(name, profiled, args.top), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
