import torch
from kernels.coda.rmsnorm_bwd import dgrad_rmsnorm, dgrad_rmsnorm_kernel
from kernels.coda.swiglu_bwd import dgrad_swiglu, dgrad_swiglu_kernel
from workloads.models import get_model
for name in ("llama-1b", "llama-7b", "llama-70b"):
    m = get_model(name); M, d, f = m.tokens, m.hidden, m.ffn
    bf = torch.bfloat16
    dz = torch.randn(M, 2 * f, device="cuda", dtype=bf); w = torch.randn(2 * f, d, device="cuda", dtype=bf) / 100
    x = torch.randn(M, d, device="cuda", dtype=bf); g = torch.ones(d, device="cuda", dtype=bf)
    r = torch.ones(M, device="cuda"); zdz = torch.zeros(M, device="cuda"); dres = torch.randn_like(x)
    dgrad_rmsnorm(dz, w, x, r, g, zdz, dres)
    print(name, "dgrad_rmsnorm gate/up", dgrad_rmsnorm_kernel.best_config)
    del dz, w
    wd = torch.randn(d, f, device="cuda", dtype=bf) / 100; zp = torch.randn(M, 2 * f, device="cuda", dtype=bf)
    dgrad_swiglu(x, wd, zp)
    print(name, "dgrad_swiglu", dgrad_swiglu_kernel.best_config)
    del wd, zp
    torch.cuda.empty_cache()
