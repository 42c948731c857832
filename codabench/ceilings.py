"""Measured ceilings and the speed-of-light of a cell (benchmarking.md, "Ceilings", "Units").

Ceilings, measured at the start of every GPU run: device-to-device copy bandwidth (bytes read +
written per second), bf16 ``torch.mm`` and fp8 e4m3 ``torch._scaled_mm`` TFLOP/s at 8192^3 (per-tensor
scales, the run's ``--fp8-accum`` mode).

Speed-of-light of a cell: ``sol_ms = sum of the median times of the plain GEMMs the op must do``
(``op.gemms(model, mode)``), each timed once per run (with ``--rounds`` > 1: in every round of the
cell's group, next to its cells) with ``torch.mm`` in the given operand layouts
(fp8 cells: ``torch._scaled_mm``, A row-major and B column-major, which is the layout it requires,
with per-tensor scales, or for ``fp8-row`` rowwise scales on its forward GEMMs (B stored (n, k)); the
dgrad GEMMs of the rowwise recipe are per-tensor, see :mod:`workloads.fp8`; ``use_fast_accum`` as the
run's ``--fp8-accum``). The epilogue overhead
of a fused kernel is ``median_ms / sol_ms``.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from codabench.timing import TimingConfig, measure
from workloads import fp8
from workloads.op import Gemm

CEILING_N = 8192
CEILING_WARMUP_MS = 1000.0
COPY_BYTES = 2**30


def _operands(g: Gemm, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A as an (m, k) view and B as a (k, n) view, stored in the GEMM's layouts, random values."""
    a = torch.randn(g.m, g.k, device=device).to(dtype) if g.a_layout == "mk" else \
        torch.randn(g.k, g.m, device=device).to(dtype).t()
    b = torch.randn(g.n, g.k, device=device).to(dtype).t() if g.b_layout == "nk" else \
        torch.randn(g.k, g.n, device=device).to(dtype)
    return a, b


def gemm_call(g: Gemm, dtype: str, device: torch.device, fp8_accum: str = "fast") -> Callable[[Any], Any]:
    """``fn(state)`` (state ignored) that runs the plain GEMM once, on random operands."""
    recipe = fp8.recipe(dtype, fp8_accum)
    if recipe is not None:  # K and N padded to the multiples of 16 torch._scaled_mm takes
        k, n = fp8.mm_size(g.k), fp8.mm_size(g.n)
        a = torch.randn(g.m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        # rowwise scales on the forward GEMMs (B a weight stored (n, k)); a dgrad's operands are per tensor
        rowwise = recipe.rowwise and g.b_layout == "nk"
        sa = torch.ones((g.m, 1) if rowwise else (), device=device)
        sb = torch.ones((1, n) if rowwise else (), device=device)
        fast = not fp8.promoted(recipe)
        return lambda _: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    a, b = _operands(g, tdt, device)
    return lambda _: torch.mm(a, b)


@dataclass
class GemmTimer:
    """Samples of each distinct (GEMM, dtype): measured once per run and kept (:meth:`cached`), or fresh for each
    round of a run in rounds (:meth:`samples`)."""

    device: torch.device
    cfg: TimingConfig
    fp8_accum: str = "fast"
    cache: dict[tuple[Gemm, str], list[float]] = field(default_factory=dict)
    failures: dict[tuple[Gemm, str], str] = field(default_factory=dict)

    def samples(self, g: Gemm, dtype: str, cfg: TimingConfig | None = None) -> list[float] | None:
        """New samples (ms) of the plain GEMM, or None if it cannot run here (the reason is kept in ``failures``)."""
        key = (g, dtype)
        if key in self.failures:
            return None
        try:
            return measure(gemm_call(g, dtype, self.device, self.fp8_accum), None, self.device,
                           cfg or self.cfg).samples_ms
        except Exception as e:  # e.g. fp8 on a GPU without it, or K not a multiple of 16
            self.failures[key] = f"{type(e).__name__}: {e}".splitlines()[0]
            return None

    def cached(self, g: Gemm, dtype: str) -> list[float] | None:
        """The run's first samples of the plain GEMM (measured on first use)."""
        key = (g, dtype)
        if key not in self.cache:
            samples = self.samples(g, dtype)
            if samples is None:
                return None
            self.cache[key] = samples
        return self.cache[key]


def sol_ms(samples: dict[Gemm, list[float] | None], gemms: list[Gemm]) -> float | None:
    """Speed-of-light of a cell: the sum of the median times of its plain GEMMs (None if any is missing)."""
    times = [samples.get(g) for g in gemms]
    return None if not times or any(not t for t in times) else sum(statistics.median(t) for t in times)


FLOPS_SLACK = 1.6
"""The dense tensor-core peaks of the datasheets exceed the GEMM ceilings measured at 8192^3 by up to ~1.4x (H100
bf16 989 / ~720 TFLOP/s) and ~1.55x (fp8 1979 / ~1290)."""
BYTES_SLACK = 1.25
"""Datasheet memory bandwidth exceeds the measured device-to-device copy by ~1.1-1.15x (H100, H200)."""


def floor_ms(flops: float, min_bytes: float, ceilings: dict[str, Any], dtype: str, slack: bool = False
             ) -> float | None:
    """The physical floor of a cell on this GPU: the larger of its minimum bytes at the measured copy bandwidth and
    its FLOPs at the measured GEMM ceiling of its dtype (``slack``: at the datasheet peaks those imply, the bound no
    honest time can beat); None without measured ceilings."""
    copy = ceilings.get("copy_gbps")
    gemm = ceilings.get("fp8_tflops" if dtype in fp8.FP8_DTYPES else "bf16_tflops")
    if not isinstance(copy, float) or not isinstance(gemm, float):
        return None
    bytes_ms = min_bytes / (copy * 1e9 * (BYTES_SLACK if slack else 1.0)) * 1e3
    flops_ms = flops / (gemm * 1e12 * (FLOPS_SLACK if slack else 1.0)) * 1e3
    return max(bytes_ms, flops_ms)


def _copy_gbps(device: torch.device, cfg: TimingConfig) -> float:
    """Device-to-device copy of COPY_BYTES: bytes read + written per second, in GB/s."""
    src = torch.randn(COPY_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    ms = measure(lambda _: dst.copy_(src), None, device, cfg).median
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


def measure_ceilings(device: torch.device, cfg: TimingConfig, fp8_accum: str = "fast") -> dict[str, float | str]:
    """Copy GB/s and bf16/fp8 GEMM TFLOP/s on this GPU now (failures recorded as strings).

    Each measurement warms up for at least CEILING_WARMUP_MS: an idle GPU needs time to raise its
    clocks, and a ceiling measured cold would be too low (fused kernels would exceed 100%)."""
    cfg = replace(cfg, warmup_ms=max(cfg.warmup_ms, CEILING_WARMUP_MS))
    out: dict[str, float | str] = {"copy_gbps": _copy_gbps(device, cfg)}
    g = Gemm(CEILING_N, CEILING_N, CEILING_N)
    for dtype in ("bf16", "fp8"):
        try:
            ms = measure(gemm_call(g, dtype, device, fp8_accum), None, device, cfg).median
            out[f"{dtype}_tflops"] = g.flops / (ms * 1e-3) / 1e12
        except Exception as e:
            out[f"{dtype}_tflops_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
    torch.cuda.empty_cache()
    return out
