"""Computes honestly, but every call ends with ``torch._dynamo.reset()``: in the group's sweeps torch-compile would
compile again inside each of its timed calls (79 ms a sample for 1.5 on the CPU), making every other implementation
look faster against the speedup's reference. Its cell must be an error row naming torch-compile's graphs, and the
others are sampled again without it (their warm-up compiles again). A reset outside the sweeps (its correctness
call) costs torch-compile only a compile in its warm-up, as hf-compile's own reset at a new model does."""
import torch
import torch.nn.functional as F

from codabench.registry import register


@register("gemm_out", "adv-dynamo-reset", dtypes=("fp32",))
def resets(x, w):
    out = F.linear(x, w)
    torch._dynamo.reset()
    return {"out": out}
