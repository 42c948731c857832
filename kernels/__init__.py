"""Implementations: the CODA Triton kernels (``kernels.coda``) and the baseline plugins.

Plugins like any other: each module that registers implementations is named in pyproject.toml's
``codabench.plugins`` entry points, which discovery imports (:mod:`codabench.discovery`); the harness never
imports this package.
"""
