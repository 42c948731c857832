"""Building a Gluon kernel for Hopper (sm_90) without a GPU, for the Gluon experiments' ``--compile-only``: the shared
memory it takes and ptxas's report of its registers and spills."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource


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


def compile_for_hopper(kernel: Any, types: list[str], consts: dict[str, Any], num_warps: int, maxnreg: int
                       ) -> tuple[int, str]:
    """Compile the Gluon ``kernel`` for sm_90 with its runtime arguments of ``types`` (in order) and its constexpr
    arguments ``consts``: (shared memory bytes, ptxas's usage line)."""
    names = kernel.arg_names
    sig = dict(zip(names, types + ["constexpr"] * len(consts)))
    src = GluonASTSource(kernel, sig, {(names.index(k), ): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                                "maxnreg": maxnreg})
    return compiled.metadata.shared, ptxas_usage(compiled)
