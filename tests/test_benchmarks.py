"""The GPU-only benchmark experiments still build: benchmarks/gluon_ws_producer.py (Gluon has no interpreter)
compiles for sm_90 here, without a GPU, and fits Hopper's shared memory."""
import importlib.util
from pathlib import Path

HOPPER_SMEM = 232448
"""Bytes of shared memory one CTA may use on an H100/H200 (227 KB)."""


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gluon_ws_producer_compiles_for_hopper():
    g = _load("gluon_ws_producer")
    operand_ring = g.STAGES * (g.BM + g.BN) * g.BK * 2
    staging = g.BM * g.BN * 2
    shared = g.compile_only()
    assert set(shared) == {"producer=False h_from_x16=True", "producer=True h_from_x16=True",
                           "producer=True h_from_x16=False"}
    for variant, smem in shared.items():
        assert operand_ring + staging <= smem <= HOPPER_SMEM, (variant, smem)
