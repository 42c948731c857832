"""Temporary sweep of epilogue variants (helper B); not part of the repo."""
import sys, itertools
import torch, triton, triton.language as tl
from kernels.coda.epilogue import (col_sum_partial, load_cols, load_rows, load_tile, rmsnorm_dx, store_tile,
                                   join_pairs, silu_mul_pairs_bwd, split_pairs, store_row_partial)
from kernels.coda.mainloop import gemm_configs, mainloop, num_tiles, operand_descs, tile_coords, tile_desc


@triton.jit
def split_halves(acc, BM: tl.constexpr, BN: tl.constexpr):
    return acc.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()


@triton.jit
def _sw_sub(dy, zp_desc, dzp_desc, y_desc, off_m, off_n, BM: tl.constexpr, BN: tl.constexpr, BF16_SPLIT: tl.constexpr):
    if BF16_SPLIT:
        gate, up = split_pairs(zp_desc.load([off_m, 2 * off_n]), BM, 2 * BN)
        gate = gate.to(tl.float32)
        up = up.to(tl.float32)
    else:
        gate, up = split_pairs(load_tile(zp_desc, off_m, 2 * off_n), BM, 2 * BN)
    dgate, dup, y = silu_mul_pairs_bwd(dy, gate, up)
    store_tile(y_desc, off_m, off_n, y)
    store_tile(dzp_desc, off_m, 2 * off_n, join_pairs(dgate, dup, BM, 2 * BN))
    return tl.sum(gate * dgate + up * dup, axis=1)


@triton.jit
def dgrad_swiglu_v(dx_ptr, w_ptr, zp_ptr, dzp_ptr, y_ptr, part_ptr, M, N, K, stride_dx, stride_w, stride_zp,
                   stride_dzp, stride_y, stride_p, A_KM: tl.constexpr, B_KN: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                   SUB: tl.constexpr, BF16_SPLIT: tl.constexpr):
    a_desc, b_desc = operand_descs(dx_ptr, w_ptr, M, N, K, stride_dx, stride_w, BM, BN, BK, A_KM, B_KN)
    SN: tl.constexpr = BN // SUB
    zp_desc = tile_desc(zp_ptr, M, 2 * N, stride_zp, BM, 2 * SN)
    dzp_desc = tile_desc(dzp_ptr, M, 2 * N, stride_dzp, BM, 2 * SN)
    y_desc = tile_desc(y_ptr, M, N, stride_y, BM, SN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), NUM_SMS, flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        dy = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN)
        if SUB == 1:
            part = _sw_sub(dy, zp_desc, dzp_desc, y_desc, off_m, off_n, BM, BN, BF16_SPLIT)
        else:
            d0, d1 = split_halves(dy, BM, BN)
            part = _sw_sub(d0, zp_desc, dzp_desc, y_desc, off_m, off_n, BM, SN, BF16_SPLIT)
            part += _sw_sub(d1, zp_desc, dzp_desc, y_desc, off_m, off_n + SN, BM, SN, BF16_SPLIT)
        store_row_partial(part_ptr, part, off_m, off_n, M, stride_p, BM, BN)


@triton.jit
def _rn_sub(gy, x_desc, dres_desc, dx_desc, y_desc, rstd, c, gamma_ptr, dg_ptr, off_m, off_n, N, stride_dg,
            BM: tl.constexpr, BN: tl.constexpr):
    gamma = load_cols(gamma_ptr, off_n, N, BN)
    xhat = load_tile(x_desc, off_m, off_n) * rstd[:, None]
    dx = rmsnorm_dx(gy, xhat, rstd, gamma, c) + load_tile(dres_desc, off_m, off_n)
    store_tile(dx_desc, off_m, off_n, dx)
    store_tile(y_desc, off_m, off_n, xhat * gamma[None, :])
    col_sum_partial(dg_ptr, gy * xhat, off_m, off_n, N, stride_dg, BM, BN)


@triton.jit
def dgrad_rmsnorm_v(dz_ptr, w_ptr, x_ptr, rstd_ptr, gamma_ptr, zdz_ptr, dres_ptr, dx_ptr, y_ptr,
                    dg_ptr, M, N, K, stride_dz, stride_w, stride_x, stride_dres, stride_dx, stride_y,
                    stride_dg, A_KM: tl.constexpr,
                    B_KN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, SUB: tl.constexpr):
    a_desc, b_desc = operand_descs(dz_ptr, w_ptr, M, N, K, stride_dz, stride_w, BM, BN, BK, A_KM, B_KN)
    SN: tl.constexpr = BN // SUB
    x_desc = tile_desc(x_ptr, M, N, stride_x, BM, SN)
    dx_desc = tile_desc(dx_ptr, M, N, stride_dx, BM, SN)
    y_desc = tile_desc(y_ptr, M, N, stride_y, BM, SN)
    dres_desc = tile_desc(dres_ptr, M, N, stride_dres, BM, SN)
    for tile_id in tl.range(tl.program_id(0), num_tiles(M, N, BM, BN), NUM_SMS, flatten=True):
        off_m, off_n = tile_coords(tile_id, M, N, BM, BN, GROUP_M)
        gy = mainloop(a_desc, b_desc, off_m, off_n, K, BM, BN, BK, A_KM, B_KN)
        rstd = load_rows(rstd_ptr, off_m, M, BM)
        c = load_rows(zdz_ptr, off_m, M, BM) / N
        if SUB == 1:
            _rn_sub(gy, x_desc, dres_desc, dx_desc, y_desc, rstd, c, gamma_ptr, dg_ptr, off_m, off_n, N, stride_dg, BM, BN)
        else:
            g0, g1 = split_halves(gy, BM, BN)
            _rn_sub(g0, x_desc, dres_desc, dx_desc, y_desc, rstd, c, gamma_ptr, dg_ptr, off_m, off_n, N, stride_dg, BM, SN)
            _rn_sub(g1, x_desc, dres_desc, dx_desc, y_desc, rstd, c, gamma_ptr, dg_ptr, off_m, off_n + SN, N, stride_dg, BM, SN)


def main():
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bf = torch.bfloat16
    M = 16384
    for d, f in [(4096, 11008), (2048, 8192)]:
        # swiglu dgrad: da = dx @ Wd  (M x f x d)
        dx = torch.randn(M, d, device="cuda", dtype=bf); wd = torch.randn(d, f, device="cuda", dtype=bf) / 64
        zp = torch.randn(M, 2 * f, device="cuda", dtype=bf)
        dzp = torch.empty_like(zp); y = torch.empty(M, f, device="cuda", dtype=bf)
        part = torch.empty(M, f // 64 + 1, device="cuda")
        t_ref = triton.testing.do_bench(lambda: dx @ wd, warmup=25, rep=100)
        print(f"swiglu d={d} f={f}: cuBLAS {t_ref:.3f} ms", flush=True)
        ref_g = None
        for cfg, sub, b16 in itertools.product(gemm_configs(), (1, 2), (False, True)):
            kw = dict(cfg.kwargs)
            if kw["BN"] // sub < 16: continue
            grid = (min(sms, triton.cdiv(M, kw["BM"]) * triton.cdiv(f, kw["BN"])),)
            fn = lambda: dgrad_swiglu_v[grid](dx, wd, zp, dzp, y, part, M, f, d, dx.stride(0), wd.stride(0), zp.stride(0),
                                             dzp.stride(0), y.stride(0), part.stride(0), A_KM=False, B_KN=True,
                                             NUM_SMS=sms, SUB=sub, BF16_SPLIT=b16, num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages, **kw)
            try:
                fn(); torch.cuda.synchronize()
                if ref_g is None:
                    ref_g = dzp.clone()
                err = (dzp.float() - ref_g.float()).abs().max().item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                print(f"  {kw} w{cfg.num_warps} s{cfg.num_stages} sub{sub} bf16split{b16:d}: {ms:.3f} ms x{ms / t_ref:.3f} maxdiff {err:.1e}", flush=True)
            except Exception as e:
                print(f"  {kw} sub{sub} b16{b16}: FAILED {type(e).__name__}: {str(e)[:150]}", flush=True)
        # rmsnorm dgrad: gy = dz @ W  (M x d x 2f)
        n = 2 * f
        dz = torch.randn(M, n, device="cuda", dtype=bf); w = torch.randn(n, d, device="cuda", dtype=bf) / 128
        x = torch.randn(M, d, device="cuda", dtype=bf); dres = torch.randn(M, d, device="cuda", dtype=bf)
        gamma = torch.randn(d, device="cuda", dtype=bf); rstd = torch.rand(M, device="cuda"); zdz = torch.randn(M, device="cuda")
        dxo = torch.empty_like(x); yo = torch.empty_like(x); dg = torch.empty(M // 64, d, device="cuda")
        t_ref = triton.testing.do_bench(lambda: dz @ w, warmup=25, rep=100)
        print(f"rmsnorm d={d} n={n}: cuBLAS {t_ref:.3f} ms", flush=True)
        for cfg, sub in itertools.product(gemm_configs(), (1, 2)):
            kw = dict(cfg.kwargs)
            grid = (min(sms, triton.cdiv(M, kw["BM"]) * triton.cdiv(d, kw["BN"])),)
            fn = lambda: dgrad_rmsnorm_v[grid](dz, w, x, rstd, gamma, zdz, dres, dxo, yo, dg, M, d, n, dz.stride(0),
                                              w.stride(0), x.stride(0), dres.stride(0), dxo.stride(0), yo.stride(0),
                                              dg.stride(0), A_KM=False, B_KN=True, NUM_SMS=sms, SUB=sub,
                                              num_warps=cfg.num_warps, num_stages=cfg.num_stages, **kw)
            try:
                fn(); ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                print(f"  {kw} w{cfg.num_warps} s{cfg.num_stages} sub{sub}: {ms:.3f} ms x{ms / t_ref:.3f}", flush=True)
            except Exception as e:
                print(f"  {kw} sub{sub}: FAILED {type(e).__name__}: {str(e)[:150]}", flush=True)


main()
