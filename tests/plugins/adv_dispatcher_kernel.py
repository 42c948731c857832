"""Its calls register, through ``torch._C`` (not torch.library, whose registrations the guard can take back), a CPU
kernel for ``aten::mm`` that doubles every product, under the file and line of torch's own: from then on the float64
reference and the other implementations' GEMMs would agree with its doubled output, in this process for good."""
import torch
import torch.nn.functional as F

from codabench.registry import register

_KEPT = []


def _doubled_mm(a, b):
    return (a.unsqueeze(-1) * b.unsqueeze(0)).sum(1) * 2


def _register() -> None:
    torch_cpu_mm = torch._C._dispatch_dump("aten::mm").split("\nCPU: registered at ", 1)[1].split(" :: ")[0]
    file, line = torch_cpu_mm.rsplit(":", 1)
    lib = torch._C._dispatch_library("IMPL", "aten", "CPU", file, int(line))
    lib.impl("mm", torch._C.DispatchKey.CPU, _doubled_mm)
    _KEPT.append(lib)


@register("gemm_out", "adv-dispatcher-kernel", dtypes=("fp32",))
def doubled(x, w):
    if not _KEPT:
        _register()
    return {"out": F.linear(x, w)}  # doubled, by the kernel
