"""While being imported, gives torch-eager's registry entry a slower ``run`` (an instance attribute over its method),
so that every speedup against it grows: the change is this plugin's load error and is undone before any cell."""
import time

import torch.nn.functional as F

from codabench.registry import REGISTRY, register

_victim = REGISTRY.get("gemm_out", "torch-eager")
_run = _victim.run


def _slower(native):
    time.sleep(0.05)
    return _run(native)


_victim.run = _slower


@register("gemm_out", "adv-slows-a-baseline", dtypes=("fp32",))
def honest(x, w):
    return {"out": F.linear(x, w)}
