"""Output names: a misspelt side output (never compared), and an honest extra value that is not a tensor."""
import torch

from codabench.registry import Implementation, register
from workloads.ops import get_op


@register("rmsnorm_linear", "contract-misnamed", dtypes=("fp32",), modes=("fwd",))
class Misnamed(Implementation):
    """x and z right; the side output rstd, wrong, under the name 'rstdd'."""

    def run(self, native):
        out = get_op("rmsnorm_linear").reference(native, native.model)
        return {"x": out["x"], "z": out["z"], "rstdd": torch.zeros_like(out["rstd"])}


@register("rmsnorm_linear", "contract-counts-calls", dtypes=("fp32",), modes=("fwd",))
class CountsCalls(Implementation):
    """Right outputs, plus how many calls it has served (an int: not compared)."""

    def __init__(self):
        self.calls = 0

    def run(self, native):
        self.calls += 1
        return {**get_op("rmsnorm_linear").reference(native, native.model), "calls": self.calls}


@register("gemm_out", "contract-nan-last-row", dtypes=("fp32",))
def nan_last_row(x, w):
    """Right but for its last row, left NaN (a tail tile never stored)."""
    out = x @ w.T
    out[-1] = float("nan")
    return {"out": out}
