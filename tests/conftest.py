"""Run Triton kernels on the CPU interpreter unless a caller chose otherwise (set before triton is imported)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
