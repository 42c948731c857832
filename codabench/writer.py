"""The run directory as the parent process writes it: one row per cell as it finishes, its samples, env.json.

Rows are appended and fsynced one by one (:mod:`codabench.results`), so a killed run keeps what it measured and
``--resume`` skips the cells that have a row.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from codabench import results
from codabench.matrix import Cell


class RunExists(Exception):
    """The output directory already holds results and --resume was not given."""


class RunWriter:
    def __init__(self, out_dir: Path, resume: bool):
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / results.RESULTS
        if path.exists() and not resume:
            raise RunExists(f"{out_dir} already holds results: pass --resume to continue it, or another --out")
        self.done = self._done_keys() if resume else set()
        """Keys of the cells that already have a row (resume)."""
        self._results = results.AppendWriter(path, results.RESULT_COLUMNS)
        self._errors = results.AppendWriter(out_dir / results.ERRORS, results.ERROR_COLUMNS)

    def _done_keys(self) -> set[tuple]:
        df = results.read_csv(self.out_dir / results.RESULTS, results.RESULT_COLUMNS)
        return {tuple("" if isinstance(v, float) and math.isnan(v) else str(v) for v in r)
                for r in df[results.KEY].itertuples(index=False)}

    def write(self, row: dict[str, Any], err_rows: list[dict[str, Any]] = (),
              samples: dict[str, Any] | None = None, cell: Cell | None = None) -> None:
        """One cell's row, its per-output error rows and (timed cells) its samples."""
        self._results.write([row])
        self._errors.write(err_rows)
        if samples is not None and cell is not None:
            results.append_jsonl(self.out_dir / results.SAMPLES, {**dict(zip(results.KEY, cell.key)), **samples})

    def write_env(self, env: dict[str, Any], resume: bool) -> None:
        """env.json at the start of a run; a resumed run keeps the earlier sessions' records under earlier_sessions."""
        path = self.out_dir / results.ENV
        if resume and path.exists():
            old = json.loads(path.read_text())
            env["earlier_sessions"] = old.pop("earlier_sessions", []) + [old]
        results.write_json(path, env)

    def update_env(self, **fields: Any) -> None:
        path = self.out_dir / results.ENV
        env = json.loads(path.read_text()) if path.exists() else {}
        env.update(fields)
        results.write_json(path, env)
