"""Properties of the code the CODA kernels compile to for sm_90 (Hopper), built on a CPU, each against what the kernel
is meant to meet: registers, spills, stack and local memory per thread, shared memory.

    python benchmarks/check_compiled.py                    # the table of every group; exit code 0
    python benchmarks/check_compiled.py --strict           # exit code 1 when a row misses its expectation
    python benchmarks/check_compiled.py --groups fused --cases example-bf16,producer-fp8

They are what one Triton release's compiler (its register allocation, ptxas's) makes of the kernels, so another
release may move them: they are reported here, with the Triton version, rather than asserted by the unit tests (which
check that the kernels compile and fit the shared memory). The groups:

- ``fused``: the fused Triton kernels as their host wrappers launch them (:mod:`compare_ptx`'s cases, compiled in a
  process of their own with an empty cache): at most 255 registers, no stack, no local memory.
- ``gluon``: the Gluon variants built from the declared kernels (:mod:`kernels.coda.gluon_program`), as their host
  functions launch them with :mod:`compare_ptx`'s cases' arguments: every one is reported; the SwiGLU dgrad's (the
  Gluon path the shipped tables choose) spills nothing.
- ``gluon-rmsnorm``: the lost Gluon RMSNorm dgrad experiment (:mod:`gluon_epilogue_dgrad_rmsnorm`): no config spills.

Every row also holds its shared memory against Hopper's 227 KB a CTA.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout, also without pip install -e .
sys.path.insert(0, str(HERE))  # the benchmark scripts whose kernels are compiled

HOPPER_SMEM = 232448
"""Bytes of shared memory one CTA may use on an H100/H200 (227 KB)."""
NO_SPILLS = "no spills"
NO_LOCAL = "<=255 regs, no stack/local"
GROUPS = ("fused", "gluon", "gluon-rmsnorm")


class Row(NamedTuple):
    """One compiled kernel (or config): its resources (None where the compiler's report did not say) and the
    expectation it is held to (empty: reported only)."""
    name: str
    regs: int | None
    spill_stores: int | None
    spill_loads: int | None
    stack: int | None
    local: int | None
    shared: int
    expect: str = ""

    def misses(self) -> list[str]:
        """What of its expectation, and of the shared-memory limit, this row misses (unknown counts as missed)."""
        out = [f"shared {self.shared} B > {HOPPER_SMEM}"] if self.shared > HOPPER_SMEM else []
        if self.expect == NO_SPILLS:
            out += [f"{k} {v}" for k, v in (("spill stores", self.spill_stores), ("spill loads", self.spill_loads))
                    if v != 0]
        elif self.expect == NO_LOCAL:
            out += [f"regs {self.regs}"] if self.regs is None or self.regs > 255 else []
            out += [f"{k} {v}" for k, v in (("stack", self.stack), ("local", self.local)) if v != 0]
        return out


def parse_ptxas(usage: str) -> dict[str, int | None]:
    """Registers, spill stores and loads and stack bytes from ptxas's ``-v`` lines (as
    :func:`gluon_experiment.ptxas_usage` joins them); None for what they do not say."""
    def find(pattern: str) -> int | None:
        m = re.search(pattern, usage)
        return int(m[1]) if m else None
    return {"regs": find(r"Used (\d+) registers"), "spill_stores": find(r"(\d+) bytes spill stores"),
            "spill_loads": find(r"(\d+) bytes spill loads"), "stack": find(r"(\d+) bytes stack frame")}


def gluon_rows(compiled: dict[str, str], expect: Callable[[str], str]) -> list[Row]:
    """Rows of a Gluon script's ``compile_only()`` (``{config: "<shared> B shared, <ptxas usage>"}``)."""
    rows = []
    for name, info in compiled.items():
        shared = int(re.match(r"(\d+) B shared", info)[1])
        rows.append(Row(name, **parse_ptxas(info), local=None, shared=shared, expect=expect(name)))
    return rows


def fused_rows(cases: list[str]) -> list[Row]:
    """Rows of :mod:`compare_ptx`'s ``cases``, compiled in a process of their own (cuobjdump's resource usage)."""
    import compare_ptx
    with tempfile.TemporaryDirectory() as tmp:
        compare_ptx.dump_tree(HERE.parent, cases, Path(tmp))
        found = [json.loads((Path(tmp) / f"{case}.json").read_text()) for case in cases]
    return [Row(f"{case} {c['kernel']}", c["regs"], None, None, c["stack"], c["local"], c["shared"], NO_LOCAL)
            for case, c in zip(cases, found)]


def built_gluon_rows(cases: list[str]) -> list[Row]:
    """Rows of the built Gluon variants of the declared kernels among :mod:`compare_ptx`'s ``cases``: each case's host
    call with the host function's ``built_gluon`` in its place, every launch compiled for sm_90 (``warmup``) instead
    of run, on a Hopper the meta device stands in for; the variant's own kernel reported (ptxas's usage)."""
    import importlib
    import compare_ptx
    import kernels.coda.program as program
    from gluon_experiment import ptxas_usage
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
    compiled: list = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup=False, **kwargs):
        compiled.append(run(self, *args, grid=grid, warmup=True, **kwargs))
        return compiled[-1]

    driver.set_active(compare_ptx._Sm90Driver())
    run_was, hopper_was = JITFunction.run, program.hopper
    JITFunction.run, program.hopper = compile_only, lambda device: True
    rows = []
    try:
        for case in cases:
            name, dtype = case.rsplit("-", 1)
            module_name, kernel_name, call, _ = compare_ptx.KERNELS[name]
            module, host_name = importlib.import_module(module_name), kernel_name.removesuffix("_kernel")
            host = getattr(module, host_name, None)
            if not hasattr(host, "built_gluon"):  # not a declared kernel
                continue
            compiled.clear()
            setattr(module, host_name, host.built_gluon)
            try:
                call(dtype == "fp8")
            except Exception:  # after the launch: the host's results from meta tensors, as far as they go
                if not any(k.name == f"{host_name}_gluon_kernel" for k in compiled):
                    raise  # before it: the case's own failure
            finally:
                setattr(module, host_name, host)
            kernel = next(k for k in compiled if k.name == f"{host_name}_gluon_kernel")
            rows += gluon_rows({f"{case} {kernel.name}": f"{kernel.metadata.shared} B shared, {ptxas_usage(kernel)}"},
                               lambda row: NO_SPILLS if name == "swiglu_bwd" else "")
    finally:
        JITFunction.run, program.hopper = run_was, hopper_was
    return rows


def rmsnorm_rows() -> list[Row]:
    import gluon_epilogue_dgrad_rmsnorm as bench
    return gluon_rows(bench.compile_only(), lambda name: NO_SPILLS)


def table(rows: list[Row]) -> list[str]:
    """The report: one line per row, ``ok`` or ``MISS: <what>`` in the last column (expected ``-``: only the shared
    memory limit)."""
    def cell(v: int | None) -> str:
        return "?" if v is None else str(v)
    width = max([len(r.name) for r in rows] + [6])
    lines = [f"{'kernel':{width}} {'regs':>5} {'spill st':>8} {'spill ld':>8} {'stack':>5} {'local':>5} "
             f"{'shared B':>8}  {'expected':26} result"]
    for r in rows:
        miss = r.misses()
        verdict = f"MISS: {', '.join(miss)}" if miss else "ok"
        lines.append(f"{r.name:{width}} {cell(r.regs):>5} {cell(r.spill_stores):>8} {cell(r.spill_loads):>8} "
                     f"{cell(r.stack):>5} {cell(r.local):>5} {r.shared:>8}  {r.expect or '-':26} {verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    import compare_ptx
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    p.add_argument("--cases", default=",".join(compare_ptx.CASES),
                   help=f"the fused and gluon groups' cases, comma-separated, of {', '.join(compare_ptx.CASES)}")
    p.add_argument("--strict", action="store_true", help="exit code 1 when a row misses its expectation")
    args = p.parse_args(argv)
    groups, cases = args.groups.split(","), args.cases.split(",")
    if unknown := [g for g in groups if g not in GROUPS]:
        p.error(f"--groups: unknown {', '.join(unknown)} (known: {', '.join(GROUPS)})")
    if unknown := [c for c in cases if c not in compare_ptx.CASES]:
        p.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(compare_ptx.CASES)})")
    build = {"fused": lambda: fused_rows(cases), "gluon": lambda: built_gluon_rows(cases), "gluon-rmsnorm": rmsnorm_rows}
    rows = [row for g in groups for row in build[g]()]
    import triton
    print(f"triton {triton.__version__}, sm_90: {', '.join(groups)}")
    print("\n".join(table(rows)))
    missed = sum(bool(r.misses()) for r in rows)
    print(f"{len(rows) - missed} of {len(rows)} rows meet their expectation"
          + ("" if not missed or args.strict else " (--strict: exit code 1 when one does not)"))
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # Gluon compiles only outside the interpreter; triton is not imported yet
    raise SystemExit(main())
