"""Run directories written from made-up samples: realistic GPU noise without a GPU, for the statistics and reports."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from codabench import results as tables


def noisy_rounds(rng: np.random.Generator, median_ms: float, rounds: int = 3, per_round: int = 7, noise: float = 0.015,
                 drift: float = 0.015, slow_share: float = 0.05) -> list[list[float]]:
    """Samples of one cell: each round at its own level (log-normal drift between rounds), log-normal noise within,
    and a few slow samples (a GPU timing's right tail)."""
    out = []
    for level in np.exp(rng.normal(0.0, drift, rounds)):
        x = median_ms * level * np.exp(rng.normal(0.0, noise, per_round))
        x *= 1 + (rng.random(per_round) < slow_share) * rng.exponential(0.2, per_round)
        out.append([float(v) for v in x])
    return out


def write_run(run_dir: Path, cells: dict[tuple[str, ...], list[list[float]]], timing: str = "cuda-events",
              rows: dict[tuple[str, ...], dict[str, Any]] | None = None, env: dict[str, Any] | None = None,
              sweeps: bool = False) -> Path:
    """A run directory holding ``cells`` (key (op, model, mode, dtype, impl) -> samples by round) as ok, correct
    rows; ``rows`` overrides fields per cell. ``sweeps``: each round is one sweep of a sample each (grain "sample",
    the sweep id its index), else the rounds are written as such (grain "round")."""
    run_dir.mkdir(parents=True)
    writer = tables.AppendWriter(run_dir / tables.RESULTS, tables.RESULT_COLUMNS)
    for key, rounds in cells.items():
        pooled = [s for r in rounds for s in r]
        row = {**dict(zip(tables.KEY, key)), "status": "ok", "message": "", "median_ms": float(np.median(pooled)),
               "p20_ms": float(np.quantile(pooled, 0.2)), "p80_ms": float(np.quantile(pooled, 0.8)),
               "n_samples": len(pooled), "timing": timing, "correct": True, **(rows or {}).get(key, {})}
        writer.write([row])
        grain = {"sweeps": [i for i, r in enumerate(rounds) for _ in r], "grain": "sample"} if sweeps else {}
        tables.append_jsonl(run_dir / tables.SAMPLES, {**dict(zip(tables.KEY, key)), "timing": timing,
                                                        "samples_ms": pooled, "rounds": rounds, **grain})
    tables.write_json(run_dir / tables.ENV, {"device": "cuda" if timing != "cpu-wall" else "cpu", **(env or {})})
    return run_dir


def planted_run(run_dir: Path, plants: dict[tuple[str, str, str, str], tuple[float, float]], env: dict[str, Any],
                impl: str = "coda-triton", other: str = "torch-compile", sweeps: int = 40, seed: int = 0) -> Path:
    """A GPU run sampled in sweeps where, in each group (op, model, mode, dtype) of ``plants``, ``impl`` is
    ``speed`` times as fast as ``other`` (1 ms), both with log-normal ``noise``: ``plants[group] = (speed, noise)``."""
    rng = np.random.default_rng(seed)
    cells = {}
    for group, (speed, noise) in plants.items():
        for name, ms in ((other, 1.0), (impl, 1.0 / speed)):
            cells[(*group, name)] = noisy_rounds(rng, ms, rounds=sweeps, per_round=1, noise=noise, drift=0.0,
                                                 slow_share=0.0)
    return write_run(run_dir, cells, env=env, sweeps=True)
