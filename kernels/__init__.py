"""Implementations: the CODA Triton kernels (``kernels.coda``) and the baseline plugins.

Every module here is imported by discovery and registers its implementations.
"""
