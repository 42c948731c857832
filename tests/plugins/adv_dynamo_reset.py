"""Computes honestly, but its call ends with ``torch._dynamo.reset()``: torch-compile's graphs are gone, so it would
compile again inside its timed calls (79 ms a sample for 1.5 on the CPU), making every other implementation look
faster against the speedup's reference. No restore brings the graphs back: its cell must be an error row naming
them, and its worker is replaced."""
import torch
import torch.nn.functional as F

from codabench.registry import register


@register("gemm_out", "adv-dynamo-reset", dtypes=("fp32",))
def resets(x, w):
    out = F.linear(x, w)
    torch._dynamo.reset()
    return {"out": out}
