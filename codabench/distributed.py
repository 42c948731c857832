"""Runs that outgrow one GPU: ``torchrun --nproc-per-node N run_bench.py ...`` (one node or several).

torchrun starts one process per GPU and gives each its ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (and the
rendezvous address). Each rank runs shard ``RANK + 1`` of ``WORLD_SIZE`` (whole groups, as ``--shard`` deals them)
on GPU ``LOCAL_RANK``, into its own run directory ``<out>-rank<R>of<N>`` beside ``<out>``; rank 0 chooses ``<out>``
for all. When every rank is done, the ranks send their run files to rank 0 over a gloo process group (the files
travel, so nodes need no shared file system), and rank 0 merges them into ``<out>``: one report
(:func:`codabench.report.merge.merge`), while the others wait. The run's exit code is rank 0's (the worst of every
rank's), the others exit 0. The process group only carries these small messages; the cells never communicate.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from codabench import results as tables

RUN_FILES = (tables.RESULTS, tables.ERRORS, tables.SAMPLES, tables.PROFILES, tables.ENV)
WAIT = datetime.timedelta(days=2)
"""How long a rank waits for the others at the end (a rank's shard can take hours)."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int

    @property
    def shard(self) -> tuple[int, int]:
        """This rank's shard, 1-based as ``--shard I/N``."""
        return self.rank + 1, self.world

    def device(self, device: torch.device) -> torch.device:
        """The rank's GPU (``cuda:LOCAL_RANK``), or ``device`` itself on the CPU."""
        return torch.device("cuda", self.local_rank) if device.type == "cuda" else device

    def run_dir(self, out: Path) -> Path:
        return out.parent / f"{out.name}-rank{self.rank + 1}of{self.world}"


def from_env() -> Ranks | None:
    """The ranks torchrun describes in the environment, or None outside torchrun (or with one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return None
    return Ranks(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


def start(ranks: Ranks) -> None:
    """Join torchrun's process group (gloo: it runs on every machine and carries Python objects)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world, timeout=WAIT)


def agree(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def collect(ranks: Ranks, run_dir: Path, code: int, out: Path) -> tuple[list[Path], int]:
    """Wait for every rank, send this rank's run files to rank 0 and (rank 0) write every rank's files into its run
    directory beside ``out``. Returns (the ranks' run directories, the largest exit code) on rank 0, ([], code)
    elsewhere."""
    files = {name: (run_dir / name).read_bytes() for name in RUN_FILES if (run_dir / name).exists()}
    traces = sorted((run_dir / tables.TRACES).glob("*.json"))  # --profile-trace
    files.update({f"{tables.TRACES}/{p.name}": p.read_bytes() for p in traces})
    gathered: list[Any] | None = [None] * ranks.world if ranks.rank == 0 else None
    dist.gather_object((code, files), gathered, dst=0)
    if ranks.rank != 0:
        return [], code
    dirs = []
    for r, (_, rank_files) in enumerate(gathered):
        d = Ranks(r, ranks.world, r).run_dir(out)
        d.mkdir(parents=True, exist_ok=True)
        for name, data in rank_files.items():
            (d / name).parent.mkdir(exist_ok=True)  # traces/
            if not (d / name).exists() or (d / name).read_bytes() != data:  # a shared file system has them already
                (d / name).write_bytes(data)
        dirs.append(d)
    return dirs, max(c for c, _ in gathered)


def finish(ranks: Ranks, code: int) -> int:
    """Leave the process group once rank 0 has merged (every rank waits for it here); this process's exit code:
    the run's (``code``, every rank's worst, merged on rank 0) on rank 0, 0 elsewhere. torchrun stops every rank as
    soon as one exits non-zero, so a rank whose shard had an error row must not leave first and take rank 0 down
    in the middle of the merge; the run's code is rank 0's, which torchrun passes on. (When it is not 0, torchrun may
    still stop another rank that is past this point, and print that it did: the report is written by then.)"""
    dist.barrier()
    dist.destroy_process_group()
    return code if ranks.rank == 0 else 0
