"""codabench: speed and numerical error of fused GEMM-epilogue Transformer kernels.

Importing this package is cheap and never imports triton: :mod:`codabench.bootstrap` must be able
to set ``TRITON_INTERPRET`` before anything does.
"""
__version__ = "0.1.0"
