"""The settings of one run, shared by the parent process (plan, writer, progress) and its cell worker."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from codabench.matrix import Selection
from codabench.timing import TimingConfig
from workloads.models import ModelShape, get_model

DEFAULT_CELL_TIMEOUT_S = 1200.0
"""``--cell-timeout``: one request to the worker (a cell's correctness pass, checks and first timing round, or one later
round) may take this long. Generous: a cold first call on a GPU compiles (torch.compile), JIT-builds (FlashInfer:
about 130 s on 16 cores) and autotunes (CODA's block: up to a few minutes) before any sample."""


@dataclass
class RunConfig:
    out_dir: Path
    selection: Selection
    device: torch.device
    suite: str = "custom"
    tokens: int | None = None
    vocab: int | None = None
    layers: int | None = None
    """Decoder layers of the whole-model ops (``--layers``; default: the model's)."""
    checkpointing: bool = False
    """Activation checkpointing in the whole-model training steps (``--checkpointing``), passed to each Case."""
    check_tokens: int | None = None
    """Tokens of the correctness pass (default: the timing's)."""
    timing: TimingConfig = field(default_factory=TimingConfig)
    cuda_graph: bool = False
    resume: bool = False
    shard: tuple[int, int] | None = None
    cooldown_s: float = 0.05
    """Pause between cells on the GPU."""
    show_progress: bool = True
    fp8_accum: str = "fast"
    """fp8 tensor-core accumulation of every fp8 cell (``--fp8-accum``): ``fast`` or ``promoted``."""
    cell_timeout_s: float = DEFAULT_CELL_TIMEOUT_S
    isolate: bool = True
    """Run cells in a worker process (the default); False runs them in this process (``--inline``, for debuggers)."""
    plugin_files: tuple[str, ...] = ()
    """``--plugin`` files, loaded again by the worker."""
    entry_points: bool = True
    """Load other installed packages' ``codabench.plugins`` entry points (``--no-entry-points``: not); the built-in
    implementations always load."""
    profile: bool = False
    """Profile each timed cell after its group's samples (``--profile``): profiles.jsonl (:mod:`codabench.profile`)."""
    profile_trace: bool = False
    """...and write each one's Chrome trace under traces/ (``--profile-trace``)."""
    models: dict[str, ModelShape] = field(default_factory=dict)
    """Model shapes defined for this run (``--model``, ``--model-config``), beside the presets; the worker gets them
    through this config."""

    def model(self, name: str, check: bool = False) -> ModelShape:
        """The model shape of a cell: the preset with the run's token, vocab and layer overrides (``check``: the
        correctness pass's tokens)."""
        m = self.models[name].with_(tokens=self.tokens, vocab=self.vocab) if name in self.models else \
            get_model(name, self.tokens, self.vocab)
        m = m.with_(layers=self.layers)
        return m.with_(tokens=self.check_tokens) if check else m

    def model_record(self, name: str) -> dict[str, Any]:
        """A cell model's shape as env.json records it (``models``)."""
        return json.loads(json.dumps(vars(self.model(name))))

    def resume_conflicts(self, env: dict[str, Any]) -> list[str]:
        """What this run would measure otherwise than the run whose env.json is ``env``, which a ``--resume`` of it
        must not (its rows would mix two measurements): a model both select with another shape (tokens, vocab and
        layers included), the correctness pass's tokens, CUDA-graph timing, the fp8 accumulation, the L2 flush. Each
        as ``what: then -> now``."""
        out = []
        old_models = env.get("models") or {}
        for name in [m for m in self.selection.models if m in old_models]:
            then, now = old_models[name], self.model_record(name)
            out += [f"{name} {k}: {then[k]} -> {now[k]}" for k in now if k in then and then[k] != now[k]]
        recorded = {**env, **{f"timing.{k}": v for k, v in (env.get("timing") or {}).items()}}  # older runs: fewer
        for flag, key, now in (("--check-tokens", "check_tokens", self.check_tokens),
                               ("--cuda-graph", "cuda_graph", self.cuda_graph),
                               ("--fp8-accum", "fp8_accum", self.fp8_accum),
                               ("--no-l2-flush", "timing.flush_l2", self.timing.flush_l2)):
            if key in recorded and recorded[key] != now:
                out.append(f"{flag} ({key}): {recorded[key]} -> {now}")
        return out
