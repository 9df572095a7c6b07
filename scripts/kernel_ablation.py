"""Where the triton backend's time goes on one pair-bias shape: each launcher timed with parts switched off.

Times (median of ``triton.testing.do_bench``, ms) the forward launcher and the backward launcher of
``attn_ops.triton.passes`` on canonical ``[B, R, H, L, D]`` bf16 inputs, with and without the shared bias, the key
mask and the bias gradient, then prints the per-kernel CUDA times of the full step. Differences between rows
place the cost of reading the bias, applying the mask and reducing dBias without hardware counters.

    python scripts/kernel_ablation.py --shape 1 768 4 768 32
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=5, type=int, default=[1, 768, 4, 768, 32], metavar=("B", "R", "H", "L", "D"))
    args = ap.parse_args()
    from triton.testing import do_bench

    from attn_ops.triton.passes import attn_backward, attn_forward
    from attn_ops.triton.tuning import chosen

    B, R, H, L, D = args.shape
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v, do = (rnd(B, R, H, L, D) for _ in range(4))
    bias = rnd(B, 1, H, L, L)
    mask = torch.rand(B, R, 1, 1, L, device="cuda", generator=g) > 0.1
    scale = D ** -0.5
    scores = B * R * H * L * L
    print(f"shape B={B} R={R} H={H} L={L} D={D}: {scores / 1e9:.3f}e9 scores per pass", flush=True)
    rows = []
    for name, b, m in (("bias+mask", bias, mask), ("bias", bias, None), ("mask", None, mask), ("plain", None, None)):
        ms = do_bench(lambda: attn_forward(q, k, v, b, m, scale, False), warmup=25, rep=200, return_mode="median")
        rows.append((f"fwd {name}", ms))
        out, lse = attn_forward(q, k, v, b, m, scale, False)
        variants = [(False, True, False), (False, False, False)] if b is not None else [(False, False, False)]
        if name == "bias+mask":  # the non-deterministic variants: dBias by atomics, with split or fused dq
            variants += [(False, True, True), (True, True, True)]
        for fused, need, atomic in variants:
            ms = do_bench(lambda: attn_backward(do, None, q, k, v, out, lse, b, m, scale, False, fused, need, atomic),
                          warmup=25, rep=200, return_mode="median")
            tag = (" +dbias" if need else "") + (" atomic" if atomic else "") + (" fused-dq" if fused else "")
            rows.append((f"bwd {name}{tag}", ms))
        print(rows[-1], flush=True)
    print("\n| step | ms | G scores/s |\n|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {scores / ms / 1e6:.0f} |")

    from torch.profiler import ProfilerActivity, profile

    out, lse = attn_forward(q, k, v, bias, mask, scale, False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            attn_forward(q, k, v, bias, mask, scale, False)
            attn_backward(do, None, q, k, v, out, lse, bias, mask, scale, False, False, True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))
    for key, cfg in chosen().items():
        print(key[0], key[2:-3], cfg)  # (kernel, launcher key without pair / tune / shipped / device)


if __name__ == "__main__":
    main()
