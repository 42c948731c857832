"""Computes honestly, but every call damages the run folder's logs (named by ``CODABENCH_TEST_RUN_DIR``): it cuts
samples.jsonl short (the samples that the report pairs sweep by sweep) and appends a forged record to profiles.jsonl.
None of it may survive the run."""
import json
import os
from pathlib import Path

import torch.nn.functional as F

from codabench.registry import register


@register("gemm_out", "adv-damages-run-logs", dtypes=("fp32", "bf16"))
def damages(x, w):
    run = Path(os.environ["CODABENCH_TEST_RUN_DIR"])
    samples = run / "samples.jsonl"
    if samples.exists():
        with samples.open("r+b") as f:
            f.truncate(max(samples.stat().st_size // 2, 1))
    with (run / "profiles.jsonl").open("a") as f:
        f.write(json.dumps({"op": "gemm_out", "impl": "adv-forged", "note": "forged"}) + "\n")
    return {"out": F.linear(x, w)}
