"""One training step of a small Llama-shaped model, where an eager step is host-bound (its Python and launches
outlast its GPU work): Hugging Face eager, ``apply_coda`` and Liger, each eager and under
``torch.compile(mode="reduce-overhead")`` (Inductor's CUDA graphs), and ``apply_coda`` under default torch.compile.

    python benchmarks/small_model_step.py [--hidden 576 --ffn 1536 --heads 9 --kv-heads 3 --vocab 49152
                                           --layers 8 --batch 2 --seq 1024 --steps 20]

Per variant: the step's median wall time (loss and backward, synchronized) and host time, the first step's seconds
(compiles), the loss and its distance from Hugging Face eager's, and the relative distance of the first layer's
down-projection gradient from eager's (bf16 rounding puts every variant near 1e-2). Without a GPU it runs eager and
apply_coda in fp32 on the Triton interpreter, one step, the compiled variants left out: a check that the script runs
(its times say nothing). Exit code 1 when a variant failed (its line says why). Liger runs last, as it replaces
transformers' Llama module classes for the rest of the process (apply_coda then refuses the models built after it:
their norms are no longer LlamaRMSNorm).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the CODA kernels import Triton


def variants(gpu: bool) -> list[tuple[str, str | None, str | None]]:
    """(name, patch, torch.compile mode) in the order they run."""
    eager = [("hf-eager", None, None), ("hf-coda", "coda", None)]
    if not gpu:
        return eager
    return eager + [("hf-coda+compile", "coda", "default"), ("hf-coda+reduce-overhead", "coda", "reduce-overhead"),
                    ("hf-eager+reduce-overhead", None, "reduce-overhead"), ("hf-liger", "liger", None),
                    ("hf-liger+reduce-overhead", "liger", "reduce-overhead")]


def build(args: argparse.Namespace, patch: str | None, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, vocab_size=args.vocab, num_hidden_layers=args.layers,
                         max_position_embeddings=max(4096, args.seq), tie_word_embeddings=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device, dtype).train()
    if patch == "coda":
        from kernels.coda.hf import apply_coda
        apply_coda(model)
    elif patch == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(model=model)
    return model


def run(args: argparse.Namespace, patch: str | None, mode: str | None, ids: torch.Tensor
        ) -> tuple[float, float, float, float, torch.Tensor]:
    """(median step s, median host s, first step s, first loss, the first step's down-projection gradient)."""
    device, dtype = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)
    torch._dynamo.reset()
    model = build(args, patch, device, dtype)
    fn = model if mode is None else torch.compile(model, mode=mode)
    sync = torch.cuda.synchronize if GPU else (lambda: None)

    def step() -> torch.Tensor:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def clear() -> None:
        for p in model.parameters():
            p.grad = None

    t0 = time.perf_counter()
    loss = float(step())
    sync()
    first = time.perf_counter() - t0
    grad = model.model.layers[0].mlp.down_proj.weight.grad.float().clone()
    clear()
    for _ in range(3 if args.steps > 1 else 0):
        step()
        clear()
    walls, hosts = [], []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - t0)
        sync()
        walls.append(time.perf_counter() - t0)
        clear()
    return statistics.median(walls), statistics.median(hosts), first, loss, grad


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("hidden", 576), ("ffn", 1536), ("heads", 9), ("kv-heads", 3), ("vocab", 49152),
                          ("layers", 8), ("batch", 2), ("seq", 1024), ("steps", 20)):
        p.add_argument(f"--{flag}", type=int, default=default)
    args = p.parse_args(argv)
    if min(vars(args).values()) < 1 or args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("every size must be positive, --heads must divide --hidden and --kv-heads --heads")
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda" if GPU else "cpu")
    print(f"{'variant':26s} {'step ms':>9s} {'host ms':>9s} {'first s':>8s} {'loss':>9s} {'- eager':>10s} "
          f"{'grad vs eager':>13s}")
    eager, failed = None, False
    for name, patch, mode in variants(GPU):
        try:
            wall, host, first, loss, grad = run(args, patch, mode, ids)
        except Exception as e:  # a variant that fails is a line, the others still run
            print(f"{name:26s} failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            failed = True
            continue
        eager = eager or (loss, grad)
        rel = float((grad - eager[1]).norm() / eager[1].norm())
        print(f"{name:26s} {wall * 1e3:9.2f} {host * 1e3:9.2f} {first:8.1f} {loss:9.5f} {loss - eager[0]:+10.2e} "
              f"{rel:13.2e}", flush=True)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
