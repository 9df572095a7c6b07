"""The attention of protein language models alone: the triton backend beside PyTorch's SDPA kernels, fwd+bwd.

    python scripts/bench_plm_attention.py                 # GPU: ESM-2 650M and ESM C 600M shapes, bf16

q, k, v are ``[B, H, L, D]`` head-split views of ``[B, L, H, D]`` projections (the layout Hugging Face and ESM
models hand to their attention), B=4, L=1024, sequences of 300-1024 real residues padded to 1024. Masks: none,
a key-padding mask ``[B, 1, 1, L]`` and the same mask expanded to ``[B, 1, L, L]`` (what transformers' SDPA mask
builder hands an attention function). SDPA rows run each of its kernels alone (flash takes no mask; cuDNN and
efficient attention do); the triton rows run deterministic and not; ``cudnn`` (``--variants ... cudnn``) is this
project's cudnn backend, cuDNN with its deterministic backward (no mask). Time: ``triton.testing.do_bench`` median,
fwd+bwd with gradients into q, k and v; host: perf_counter of 20 calls queued behind a GPU sleep, per call.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"esm2-650m": (4, 20, 1024, 64), "esmc-600m": (4, 18, 1024, 64)}
LENGTHS = (300, 700, 1024, 512)


def inputs(B, H, L, D, mask_kind, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    qkv = [torch.randn(B, L, H, D, generator=g).to(device, torch.bfloat16).transpose(1, 2).requires_grad_()
           for _ in range(3)]
    real = torch.arange(L)[None] < torch.tensor(LENGTHS)[:B, None]
    key = real[:, None, None, :].to(device)
    mask = {"none": None, "key": key, "dense": key.expand(B, 1, L, L)}[mask_kind]
    return qkv, mask


def runner(variant, qkv, mask):
    import attn_ops
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv
    do = torch.randn_like(q)
    if variant.startswith("triton"):
        det = variant == "triton"

        def run():
            out = attn_ops.attention(q, k, v, mask=mask, backend="triton", deterministic=det)
            torch.autograd.grad(out, (q, k, v), do)
        return run
    if variant == "cudnn":  # this project's cudnn backend: cuDNN with its deterministic backward (no mask)
        def run():
            out = attn_ops.attention(q, k, v, mask=mask, backend="cudnn")
            torch.autograd.grad(out, (q, k, v), do)
        return run
    kernel = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
              "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[variant]

    def run():
        with sdpa_kernel([kernel]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.autograd.grad(out, (q, k, v), do)
    return run


def host_ms(run, n=20):
    torch.cuda._sleep(int(2e9))  # keep the GPU busy so that only the host's time is counted
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--masks", nargs="+", default=["none", "key", "dense"])
    ap.add_argument("--variants", nargs="+",
                    default=["triton", "triton-nondet", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    import triton

    import attn_ops

    os.makedirs(args.out, exist_ok=True)
    lines = [f"# Protein-LM attention, fwd+bwd ms ({torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
             f"triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC)", "",
             "| shape | mask | " + " | ".join(args.variants) + " | triton host ms |",
             "|---|---|" + "---|" * len(args.variants) + "---|"]
    for shape in args.shapes:
        B, H, L, D = SHAPES[shape]
        for mask_kind in args.masks:
            cells, host = [], ""
            for variant in args.variants:
                qkv, mask = inputs(B, H, L, D, mask_kind, "cuda")
                if variant in ("sdpa-flash", "cudnn") and mask is not None:
                    cells.append("-")
                    continue
                try:
                    run = runner(variant, qkv, mask)
                    run()
                    if variant.startswith("triton"):
                        attn_ops.wait_compiles()
                    cells.append(f"{triton.testing.do_bench(run, warmup=25, rep=200):.3f}")
                    if variant == "triton":
                        host = f"{host_ms(run):.3f}"
                    if variant == "cudnn":
                        host += f" (cudnn {host_ms(run):.3f})"
                except Exception as exc:  # a kernel that refuses the inputs is a cell, not the end of the table
                    cells.append(f"error: {type(exc).__name__}: {str(exc)[:60]}")
            lines.append(f"| {shape} [{B},{H},{L},{D}] | {mask_kind} | " + " | ".join(cells) + f" | {host} |")
            print(lines[-1], flush=True)
    with open(os.path.join(args.out, "plm_attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
