"""The code the fused CODA kernels compile to for sm_90 (Hopper), built on a CPU, and compared with another tree's.

    python benchmarks/compare_ptx.py --base /tmp/base              # this tree against another checkout
    python benchmarks/compare_ptx.py --compile-only [--cases example-bf16,producer-fp8]

Each case calls a host wrapper of ``kernels/`` (``matmul``, ``gemm_residual_norm``, ...) on meta-device tensors
(shapes only, no memory) with Triton's driver replaced by one that names an sm_90 target. The fused kernel's launch
is caught at its autotuner and compiled the way ``JITFunction.run`` compiles a launch (argument specialization,
then ``warmup=True``: compile, don't run), with one representative tile config: the first of the kernel's list
with BK = 64 for 16-bit operands, BK = 128 for fp8 ones. So the code compared is the code that wrapper's launch
would run, arguments included. Each tree is compiled in a process of its own with an empty Triton cache.

Compared per case:

- the PTX, normalised as follows: the debug line information is dropped (``.loc`` and ``.file`` lines and the
  ``.section .debug_*`` blocks: they name source files and lines); every kernel parameter ``<kernel>_param_<i>``
  is renamed to the name of the argument it carries (``<kernel>_param_<name>``; Triton's two trailing hidden
  scratch pointers are ``hidden0``, ``hidden1``), and the parameter declarations are compared as a set of
  (name, type), since their order is what a signature change moves. ``--base`` trees that named the mainloop's
  parameters differently are mapped through :data:`BASE_NAMES`. Nothing else is normalised: every instruction,
  register number and label must match. Where they do not, the report says whether the two are still the same
  instructions in the same order once each parameter is read by name (:func:`without_param_loads`): a new
  parameter order can move the ``ld.param`` loads of the prologue and renumber registers.
- the SASS of the cubin (``cuobjdump -sass``) without the instruction encodings, parameter reads
  ``c[0x0][0x210 + offset]`` renamed to the parameter at that offset (``c[0x0][stride_c+0]``);
- registers, stack and local memory per thread (``cuobjdump -res-usage``), shared memory, warps and stages.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable

BASE_NAMES = {
    "gemm_residual_norm_kernel": {"w_ptr": "b_ptr", "stride_w": "stride_b"},
    **{k: {"h_ptr": "a_ptr", "w_ptr": "b_ptr", "stride_h": "stride_a", "stride_w": "stride_b",
           **({"stride_o": "stride_out"} if k == "gemm_rope_kernel" else {}),
           **({"lse_part_ptr": "ss_ptr", "stride_p": "stride_ss", "stride_l": "stride_logits"}
              if k == "gemm_cross_entropy_kernel" else {})}
       for k in ("scaled_linear_kernel", "gemm_swiglu_kernel", "gemm_rope_kernel", "gemm_cross_entropy_kernel")},
    "dgrad_rmsnorm_kernel": {"dz_ptr": "a_ptr", "w_ptr": "b_ptr", "stride_dz": "stride_a", "stride_w": "stride_b",
                             "dg_ptr": "cs_ptr", "stride_dg": "stride_cs"},
    "dgrad_swiglu_kernel": {"dx_ptr": "a_ptr", "w_ptr": "b_ptr", "stride_dx": "stride_a", "stride_w": "stride_b",
                            "part_ptr": "ss_ptr", "stride_p": "stride_ss"},
    "gemm_bias_gelu_kernel": {"x_ptr": "a_ptr", "w_ptr": "b_ptr", "b_ptr": "bias_ptr", "stride_x": "stride_a",
                              "stride_w": "stride_b"},
}
"""Parameter names of the fused kernels before the mainloop block (commit 9d59c22) that the block renamed, and that
the declared kernels (:mod:`kernels.coda.program`) name after their outputs (``stride_out``) and partials
(``ss_ptr``, ``cs_ptr``)."""

M, D, F, V = 4096, 2048, 8192, 128256
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64


# ---- the cases (run in the dumping process, against whichever tree is on the path) -----------------------------

def _t(*shape: int, dtype=None):
    import torch
    return torch.empty(shape, device="meta", dtype=dtype or torch.bfloat16)


def _fp8(rows: int, cols: int, rowwise: bool, e5m2: bool = False, transposed: bool = False):
    """An fp8 operand (rows, cols); ``transposed``: the .T view of a (cols, rows) K-major copy, per-tensor scale."""
    import torch
    from workloads.fp8 import Fp8
    dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    data = _t(cols, rows, dtype=dtype).T if transposed else _t(rows, cols, dtype=dtype)
    return Fp8(data, _t(rows, 1, dtype=torch.float32) if rowwise else _t(dtype=torch.float32))


def _rstd():
    import torch
    return _t(M, dtype=torch.float32)


def _gemm(fp8: bool) -> None:
    import inspect
    from kernels.coda.gemm import matmul
    from workloads.fp8 import Recipe
    if fp8:  # promoted accumulation: by the recipe, or by the bool of a base tree before the recipe travelled
        promoted = ({"recipe": Recipe(rowwise=False, accum="promoted")}
                    if "recipe" in inspect.signature(matmul).parameters else {"promote": True})
        matmul(_fp8(M, D, False), _fp8(F, D, False).T, **promoted)
    else:
        matmul(_t(M, D), _t(F, D).T)


def _producer(fp8: bool) -> None:
    from kernels.coda.producer import gemm_residual_norm
    a, w = (_fp8(M, F, True), _fp8(D, F, True)) if fp8 else (_t(M, F), _t(D, F))
    gemm_residual_norm(a, w, _t(M, D), _t(D), 1e-5, h_fp8="row" if fp8 else None)


def _scaled_linear(fp8: bool) -> None:
    from kernels.coda.scaled_linear import scaled_linear
    h, w = (_fp8(M, D, True), _fp8(D, D, True)) if fp8 else (_t(M, D), _t(D, D))
    scaled_linear(h, w, _rstd())


def _swiglu(fp8: bool) -> None:
    from kernels.coda.swiglu import gemm_swiglu
    h, w = (_fp8(M, D, True), _fp8(2 * F, D, True)) if fp8 else (_t(M, D), _t(2 * F, D))
    gemm_swiglu(h, w, _rstd(), save_preact=True, y_fp8="row" if fp8 else None)


def _rope(fp8: bool) -> None:
    import torch
    from kernels.coda.rope import gemm_rope
    n = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    h, w = (_fp8(M, D, True), _fp8(n, D, True)) if fp8 else (_t(M, D), _t(n, D))
    gemm_rope(h, w, _rstd(), _t(M, dtype=torch.int64), HEADS, KV_HEADS, HEAD_DIM, 500000.0)


def _cross_entropy(fp8: bool) -> None:
    import torch
    from kernels.coda.cross_entropy import gemm_cross_entropy
    h, w = (_fp8(M, D, True), _fp8(V, D, True)) if fp8 else (_t(M, D), _t(V, D))
    gemm_cross_entropy(h, w, _rstd(), _t(M, dtype=torch.int64), with_grad=True)


def _rmsnorm_bwd(fp8: bool) -> None:
    import torch
    from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm
    dz, w = (_fp8(M, F, False, e5m2=True), _fp8(F, D, False, transposed=True)) if fp8 else (_t(M, F), _t(F, D))
    dgrad_rmsnorm(dz, w, _t(M, D), _rstd(), _t(D), _rstd(), dres=_t(M, D), dz_scale=_t(1, dtype=torch.float32))


def _swiglu_bwd(fp8: bool) -> None:
    from kernels.coda.swiglu_bwd import dgrad_swiglu
    dx, w = (_fp8(M, D, False, e5m2=True), _fp8(D, F, False, transposed=True)) if fp8 else (_t(M, D), _t(D, F))
    dgrad_swiglu(dx, w, _t(M, 2 * F))


def _example(fp8: bool) -> None:
    from kernels.examples.gemm_bias_gelu import gemm_bias_gelu
    gemm_bias_gelu(_t(M, D), _t(F, D), _t(F))


KERNELS: dict[str, tuple[str, str, Callable[[bool], None], tuple[str, ...]]] = {
    "gemm": ("kernels.coda.gemm", "gemm_kernel", _gemm, ("bf16", "fp8")),
    "producer": ("kernels.coda.producer", "gemm_residual_norm_kernel", _producer, ("bf16", "fp8")),
    "scaled_linear": ("kernels.coda.scaled_linear", "scaled_linear_kernel", _scaled_linear, ("bf16", "fp8")),
    "swiglu": ("kernels.coda.swiglu", "gemm_swiglu_kernel", _swiglu, ("bf16", "fp8")),
    "rope": ("kernels.coda.rope", "gemm_rope_kernel", _rope, ("bf16", "fp8")),
    "cross_entropy": ("kernels.coda.cross_entropy", "gemm_cross_entropy_kernel", _cross_entropy, ("bf16", "fp8")),
    "rmsnorm_bwd": ("kernels.coda.rmsnorm_bwd", "dgrad_rmsnorm_kernel", _rmsnorm_bwd, ("bf16", "fp8")),
    "swiglu_bwd": ("kernels.coda.swiglu_bwd", "dgrad_swiglu_kernel", _swiglu_bwd, ("bf16", "fp8")),
    "example": ("kernels.examples.gemm_bias_gelu", "gemm_bias_gelu_kernel", _example, ("bf16",)),
}
"""Per fused kernel: its module, its name, the call of its host wrapper and the operand dtypes it is built for.
fp8 forward cases use rowwise scales (and quantize their output where the kernel can), backward ones per-tensor
scales with an e5m2 gradient; ``gemm-fp8`` uses per-tensor scales and promoted accumulation."""
CASES = [f"{k}-{dt}" for k, (*_, dtypes) in KERNELS.items() for dt in dtypes]


class _Launched(Exception):
    pass


class _Sm90Driver:
    """Just enough of a Triton driver for ``JITFunction.run(warmup=True)``: an sm_90 target, device 0."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


def _bin(tool: str) -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool)


def compile_case(case: str) -> dict:
    """Compile the fused kernel of ``case`` as its wrapper launches it; PTX, SASS and resource usage."""
    import importlib
    from triton.runtime.driver import driver
    name, dtype = case.rsplit("-", 1)
    module, kernel_name, call, _ = KERNELS[name]
    kernel = next(k for k in (getattr(v, "kernel", v) for v in vars(importlib.import_module(module)).values())
                  if getattr(k, "base_fn", None) and k.base_fn.__name__ == kernel_name)  # declared kernels: .kernel
    launch = {}

    def catch(*args, **kwargs):
        launch.update(args=args, kwargs=kwargs)
        raise _Launched

    driver.set_active(_Sm90Driver())
    run, kernel.run = kernel.run, catch  # the autotuner's entry point: the launch's arguments, before any tuning
    try:
        call(dtype == "fp8")
    except _Launched:
        pass
    finally:
        kernel.run = run
    kwargs = dict(launch["kwargs"])
    grid, _ = kwargs.pop("grid"), kwargs.pop("warmup")
    cfg = next(c for c in kernel.configs if c.kwargs["BK"] == (128 if dtype == "fp8" else 64))
    compiled = kernel.fn.run(*launch["args"], grid=grid, warmup=True, **kwargs, **cfg.all_kwargs())
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_bin("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_bin("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    res = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    meta = compiled.metadata
    return {"kernel": kernel_name, "params": [k for k, v in compiled.src.signature.items() if v != "constexpr"],
            "config": f"{cfg}", "shared": meta.shared, "num_warps": meta.num_warps, "num_stages": meta.num_stages,
            "regs": int(res[1]), "stack": int(res[2]), "local": int(res[3]), "ptx": compiled.asm["ptx"], "sass": sass}


def dump(cases: list[str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        (out / f"{case}.json").write_text(json.dumps(compile_case(case)))
        print(f"compiled {case}", file=sys.stderr, flush=True)


def dump_tree(root: Path, cases: list[str], out: Path) -> None:
    """:func:`dump` in a fresh process that imports ``kernels`` from ``root``, with an empty Triton cache."""
    with tempfile.TemporaryDirectory() as cache:  # FP fusion on: Triton's default (3.9 warns it will change)
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": cache, "TRITON_DEFAULT_FP_FUSION": "1",
               "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
        subprocess.run([sys.executable, __file__, "--dump-into", str(out), "--cases", ",".join(cases)], env=env,
                       check=True)


# ---- normalisation and comparison ------------------------------------------------------------------------------

def normalise_ptx(ptx: str, kernel: str, params: list[str], names: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """``({parameter: declared type}, body lines)`` of a kernel's PTX, as the module docstring describes."""
    params = [names.get(p, p) for p in params]
    param_re = re.compile(rf"\b{re.escape(kernel)}_param_(\d+)\b")

    def pname(i: int) -> str:
        return params[i] if i < len(params) else f"hidden{i - len(params)}"

    decls, body = {}, []
    for line in ptx.split("\n"):
        if re.match(r"\s*\.section\s+\.debug", line):
            break
        if re.match(r"\s*\.(loc|file)\b", line):
            continue
        decl = re.match(rf"\s*\.param\s+(.*?)\s*{re.escape(kernel)}_param_(\d+),?$", line)
        if decl:
            decls[pname(int(decl[2]))] = decl[1]
            continue
        body.append(param_re.sub(lambda m: f"{kernel}_param_{pname(int(m[1]))}", line))
    return decls, body


def without_param_loads(body: list[str]) -> list[str]:
    """A normalised PTX body with every parameter read by name: each register that an ``ld.param`` fills (and
    nothing else writes) is replaced by the parameter, the load dropped, and the other registers renumbered in
    order of first appearance. Equal results are the same instructions in the same order, up to where the
    parameter loads were scheduled and how registers are numbered."""
    loads = {}
    for line in body:
        m = re.match(r"\s*ld\.param\.\w+\s+(%\w+),\s*\[\w+_param_(\w+)\];", line)
        if m:
            loads[m[1]] = m[2]
    written = Counter(m[1] for line in body if (m := re.match(r"\s*(?:@!?%\w+\s+)?[a-z][\w.]*\s+(%\w+),", line)))
    loads = {r: p for r, p in loads.items() if written[r] == 1}
    numbers: dict[str, str] = {}
    per_kind: Counter[str] = Counter()

    def rename(m: re.Match) -> str:
        if m[0] in loads:
            return f"<{loads[m[0]]}>"
        if m[0] not in numbers:
            numbers[m[0]] = f"%{m[1]}#{per_kind[m[1]]}"
            per_kind[m[1]] += 1
        return numbers[m[0]]

    out = []
    for line in body:
        m = re.match(r"\s*ld\.param\.\w+\s+(%\w+),", line)
        if (m and m[1] in loads) or re.match(r"\s*\.reg\b", line):
            continue
        out.append(re.sub(r"%([a-z]+)\d+\b", rename, line))
    return out


_PARAM_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}


def normalise_sass(sass: str, decls: list[tuple[str, str]]) -> list[str]:
    """SASS instructions without encodings, with parameter reads named (``decls``: (name, type) in PTX order)."""
    where, off = [], 0x210  # sm_90: kernel parameters start at c[0x0][0x210]
    for name, decl in decls:
        size = _PARAM_BYTES[re.search(r"\.[usbf](\d+)", decl)[1]]
        off = -(-off // size) * size
        where.append((off, off + size, name))
        off += size

    def named(m: re.Match) -> str:
        o = int(m[1], 16)
        hit = [f"{n}+{o - lo}" for lo, hi, n in where if lo <= o < hi]
        return f"c[0x0][{hit[0]}]" if hit else m[0]

    lines = []
    for line in sass.split("\n"):
        line = re.sub(r"/\*[0-9a-fx ]*\*/", "", line).strip()  # addresses and encodings
        if line:
            lines.append(re.sub(r"c\[0x0\]\[(0x[0-9a-f]+)\]", named, line))
    return lines


def _ordered_decls(ptx: str, kernel: str, params: list[str], names: dict[str, str]) -> list[tuple[str, str]]:
    decls = re.findall(rf"\s*\.param\s+(.*?)\s*{re.escape(kernel)}_param_(\d+)", ptx)
    params = [names.get(p, p) for p in params]
    return [(params[int(i)] if int(i) < len(params) else f"hidden{int(i) - len(params)}", d) for d, i in decls]


def compare(base: dict, new: dict) -> dict[str, list[str]]:
    """The differences between two compiled cases, per artefact (resources, PTX, SASS; empty: identical)."""
    kernel = new["kernel"]  # a rename applies where the base lacks its new name (a base that has it is newer)
    names = {old: now for old, now in BASE_NAMES.get(kernel, {}).items() if now not in base["params"]}
    resources = [f"{key}: {base[key]} -> {new[key]}" for key in ("shared", "num_warps", "num_stages", "regs", "stack",
                                                                  "local") if base[key] != new[key]]
    (bdecl, bbody), (ndecl, nbody) = (normalise_ptx(base["ptx"], kernel, base["params"], names),
                                      normalise_ptx(new["ptx"], kernel, new["params"], {}))
    ptx = [f"parameters only in base: {sorted(set(bdecl.items()) - set(ndecl.items()))}, only in new: "
           f"{sorted(set(ndecl.items()) - set(bdecl.items()))}"] if bdecl != ndecl else []
    ptx += list(difflib.unified_diff(bbody, nbody, "base", "new", n=1, lineterm=""))[2:]
    if ptx and bdecl.keys() <= ndecl.keys() and without_param_loads(bbody) == without_param_loads(nbody):
        ptx.insert(0, "same instructions in the same order once the parameter loads are read by name "
                      "(without_param_loads); the differences:")
    sass = list(difflib.unified_diff(
        normalise_sass(base["sass"], _ordered_decls(base["ptx"], kernel, base["params"], names)),
        normalise_sass(new["sass"], _ordered_decls(new["ptx"], kernel, new["params"], {})), n=1, lineterm=""))[2:]
    return {"resources": resources, "PTX": ptx, "SASS": sass}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, help="another tree (e.g. a checkout of the base commit) to compare with")
    p.add_argument("--compile-only", action="store_true", help="compile this tree's cases and print their resources")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--keep", type=Path, help="keep the compiled cases (JSON: PTX, SASS, resources) under this folder")
    p.add_argument("--dump-into", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        p.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    if args.dump_into:
        return dump(cases, args.dump_into)
    if not args.base and not args.compile_only:
        p.error("give --base TREE or --compile-only")
    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        dump_tree(here, cases, out / "new")
        if args.base:
            dump_tree(args.base.resolve(), cases, out / "base")
        import triton
        print(f"triton {triton.__version__}, sm_90" + (f"; base {args.base} -> this tree" if args.base else ""))
        identical = 0
        for case in cases:
            new = json.loads((out / "new" / f"{case}.json").read_text())
            line = (f"{case:20s} {new['kernel']:26s} regs {new['regs']:3d} stack {new['stack']} local {new['local']} "
                    f"shared {new['shared']:6d} B  {new['config']}")
            if not args.base:
                print(line)
                continue
            diffs = compare(json.loads((out / "base" / f"{case}.json").read_text()), new)
            identical += not any(diffs.values())
            print(line + "\n    " + ", ".join(f"{k} {'different' if d else 'identical'}" for k, d in diffs.items()))
            for kind, d in diffs.items():
                print("".join(f"      {kind}: {x}\n" for x in d[:40]), end="")
        if args.base:
            print(f"{identical} of {len(cases)} cases identical")
            sys.exit(0 if identical == len(cases) else 1)


if __name__ == "__main__":
    main()
