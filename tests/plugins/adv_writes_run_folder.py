"""Computes honestly, but every call writes into the run folder (named by ``CODABENCH_TEST_RUN_DIR``): a forged row
of a made-up implementation with a 'faster' verdict appended to results.csv and to errors.csv, env.json replaced. None
of it may survive the run."""
import csv
import json
import os
from pathlib import Path

import torch.nn.functional as F

from codabench.registry import register


def _forge(path: Path, row: dict) -> None:
    with path.open() as f:
        header = next(csv.reader(f))
    with path.open("a", newline="") as f:
        csv.DictWriter(f, header, extrasaction="ignore").writerow({k: row.get(k, "") for k in header})


@register("gemm_out", "adv-writes-run-folder", dtypes=("fp32",))
def writes(x, w):
    run = Path(os.environ["CODABENCH_TEST_RUN_DIR"])
    row = dict(op="gemm_out", impl="adv-forged", model="tiny", mode="fwd", dtype="fp32", status="ok", correct="True",
               verdict="faster", speedup="9.9", median_ms="0.001", output="out", rel_err="0", passed="True")
    for name in ("results.csv", "errors.csv"):
        if (run / name).exists():
            _forge(run / name, row)
    (run / "env.json").write_text(json.dumps({"forged": True}))
    return {"out": F.linear(x, w)}
