"""A plugin that registers an op that does not exist (a typo): a load error naming this file and line, not a silent drop."""
import torch.nn.functional as F

from codabench.registry import register


@register("gemm_outt", "test-misspelled", dtypes=("fp32",))
def misspelled(x, w):
    return {"out": F.linear(x, w)}
