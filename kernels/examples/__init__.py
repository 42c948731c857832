"""Example plugins built from the CODA primitives (see docs/writing-kernels.md)."""
