"""Device selection, done before anything imports triton.

Triton reads ``TRITON_INTERPRET`` when it is imported, so on a machine without a GPU the entry
points (``run_bench.py``, ``python -m codabench``) call :func:`select_device` first. Importing
torch and calling ``torch.cuda.is_available()`` does not import triton (``torch._dynamo`` does).
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

INTERPRETER_NOTE = ("no CUDA GPU found: running on the CPU with the Triton interpreter (TRITON_INTERPRET=1); "
                    "wall times on the CPU are not performance figures")


def select_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"`` with ``TRITON_INTERPRET=1`` set."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    # torch.utils.cpp_extension warns "No CUDA runtime is found" when it is imported on a machine with a CUDA toolkit
    # but no GPU: the interpreter note printed by the entry points already says so
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # the interpreter computes with numpy, which warns where fp32 overflows to inf as the GPU does silently and
    # correctly (a sigmoid's exp(-x) at large |x| gives 0); invalid values (NaN) still warn
    warnings.filterwarnings("ignore", "overflow encountered in", RuntimeWarning, r"triton\.runtime\.interpreter")
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise RuntimeError("triton was imported before codabench.bootstrap.select_device(); "
                               "set TRITON_INTERPRET=1 yourself or import codabench first")
        os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"
