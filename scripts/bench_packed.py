"""Packed variable-length batches on the GPU: the op with ``segment_ids`` vs its sequences one at a time vs compiled
flex_attention with a document block mask built from the same ids (the targets: packed <= 1.1x one at a time, <= flex).

Lengths are drawn from a log-normal with median 300 capped at 1024 (UniRef50-like) and packed first-fit into rows of
``--tokens`` (default 4096) tokens, padding at the end (id -1). bf16 q, k, v ``[B, H, L, D]`` with gradients; every
variant runs forward + backward. Times per variant:

- ``kernel_ms``: the summed CUDA kernel time of one fwd+bwd (torch.profiler), what the targets compare;
- ``wall_ms``: median wall time of one fwd+bwd (``triton.testing.do_bench``).

Variants: ``packed`` (triton, segment_ids), ``one-by-one`` (triton on each sequence alone, times summed),
``flex-doc`` (compiled flex_attention + BlockMask from a mask_mod on the ids), ``dense`` (triton on the packed rows
without ids: what the L^2 costs). Targets: packed <= 1.1x one-by-one and <= flex-doc (kernel time).

    python scripts/bench_packed.py                       # H = 8, 16, 20; D = 64; causal and not
    python scripts/bench_packed.py --heads 16 --no-causal --bias   # also a trainable packed-length bias [B,H,L,L]

Writes ``packed.csv`` and ``packed.md`` into ``--out`` (default ``$OUT`` or ``bench_out``) and prints each row.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attn_ops  # noqa: E402

FIELDS = ["H", "D", "causal", "bias", "rows", "seqs", "tokens", "variant", "kernel_ms", "wall_ms", "vs_one_by_one",
          "vs_flex", "max_err"]


def draw_rows(rows: int, tokens: int, median: float = 300.0, sigma: float = 0.6, cap: int = 1024, seed: int = 0):
    """Per row, the sequence lengths packed first-fit into ``tokens`` (log-normal lengths, 16 <= n <= cap)."""
    g = torch.Generator().manual_seed(seed)
    packed = [[] for _ in range(rows)]
    free = [tokens] * rows
    misses = 0
    while misses < 20:
        n = int(torch.empty(1).log_normal_(float(torch.log(torch.tensor(median))), sigma, generator=g).clamp(16, cap))
        slot = next((i for i in range(rows) if free[i] >= n), None)
        if slot is None:
            misses += 1
            continue
        packed[slot].append(n)
        free[slot] -= n
    return packed


def ids_of(lengths, tokens, device):
    ids = torch.full((tokens,), -1, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(lengths):
        ids[pos:pos + n] = i
        pos += n
    return ids.to(device)


def kernel_ms(fn, iters: int = 5) -> float:
    """Summed CUDA kernel time of one ``fn()`` call (mean over ``iters``), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    from torch.autograd import DeviceType

    total = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return total / 1000.0 / iters


def wall_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50)


def step_fn(forward, leaves, grad_out):
    """fwd + bwd of ``forward()`` w.r.t. ``leaves`` with a fixed upstream gradient."""
    def step():
        out = forward()
        return torch.autograd.grad(out, leaves, grad_out)
    return step


def run_case(H, D, causal, with_bias, lengths, tokens, device="cuda"):
    B = len(lengths)
    g = torch.Generator(device=device).manual_seed(1)
    mk = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(B, H, tokens, D), mk(B, H, tokens, D), mk(B, H, tokens, D)
    bias = mk(B, H, tokens, tokens) if with_bias else None
    ids = torch.stack([ids_of(n, tokens, device) for n in lengths])
    grad_out = torch.randn(B, H, tokens, D, generator=g, device=device, dtype=torch.bfloat16)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    rows = {}

    # packed: one call with segment ids
    packed = lambda: attn_ops.attention(q, k, v, bias, causal=causal, backend="triton", segment_ids=ids)  # noqa
    step = step_fn(packed, leaves, grad_out)
    rows["packed"] = (kernel_ms(step), wall_ms(step))
    out_packed = packed().detach()

    # one by one: each sequence alone (its bias block), times summed
    k_sum = w_sum = 0.0
    err = 0.0
    for b, lens in enumerate(lengths):
        pos = 0
        for n in lens:
            sl = slice(pos, pos + n)
            qs, ks, vs = (t[b:b + 1, :, sl].detach().clone().requires_grad_() for t in (q, k, v))
            bs = None if bias is None else bias[b:b + 1, :, sl, sl].detach().clone().requires_grad_()
            one = lambda qs=qs, ks=ks, vs=vs, bs=bs: attn_ops.attention(  # noqa: E731
                qs, ks, vs, bs, causal=causal, backend="triton")
            st = step_fn(one, [t for t in (qs, ks, vs, bs) if t is not None], grad_out[b:b + 1, :, sl])
            k_sum += kernel_ms(st, iters=2)
            w_sum += wall_ms(st)
            err = max(err, (one().detach().float() - out_packed[b:b + 1, :, sl].float()).abs().max().item())
            pos += n
    rows["one-by-one"] = (k_sum, w_sum)

    # compiled flex with a document block mask from the same ids
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def doc(b, h, q_idx, kv_idx):
            keep = (ids[b, q_idx] == ids[b, kv_idx]) & (ids[b, q_idx] >= 0)
            return keep & (kv_idx <= q_idx) if causal else keep

        block_mask = create_block_mask(doc, B, None, tokens, tokens, device=device)
        flex = torch.compile(flex_attention)
        if bias is None:
            fwd = lambda: flex(q, k, v, block_mask=block_mask)  # noqa: E731
        else:
            def score_mod(s, b, h, qi, ki):
                return s + bias[b, h, qi, ki].float()
            fwd = lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)  # noqa: E731
        step = step_fn(fwd, leaves, grad_out)
        rows["flex-doc"] = (kernel_ms(step), wall_ms(step))
    except Exception as exc:  # report and go on: the triton rows still count
        print(f"flex-doc failed: {type(exc).__name__}: {exc}", flush=True)

    # dense: the same rows without ids (every tile computed)
    dense = lambda: attn_ops.attention(q, k, v, bias, causal=causal, backend="triton")  # noqa: E731
    step = step_fn(dense, leaves, grad_out)
    rows["dense (no ids)"] = (kernel_ms(step), wall_ms(step))
    return rows, err


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, nargs="+", default=[8, 16, 20])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--no-causal", action="store_true", help="only bidirectional")
    p.add_argument("--bias", action="store_true", help="also runs with a trainable packed-length bias [B,H,L,L]")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_packed.py needs a CUDA device")
    os.makedirs(args.out, exist_ok=True)
    lengths = draw_rows(args.rows, args.tokens)
    n_seq = sum(len(x) for x in lengths)
    print(f"{args.rows} rows of {args.tokens} tokens, {n_seq} sequences: {lengths}", flush=True)
    results = []
    for H in args.heads:
        for causal in ([False] if args.no_causal else [False, True]):
            for with_bias in ([False, True] if args.bias else [False]):
                rows, err = run_case(H, args.head_dim, causal, with_bias, lengths, args.tokens)
                base, flex = rows["one-by-one"][0], rows.get("flex-doc", (None,))[0]
                for name, (kms, wms) in rows.items():
                    r = dict(H=H, D=args.head_dim, causal=causal, bias=with_bias, rows=args.rows, seqs=n_seq,
                             tokens=args.tokens, variant=name, kernel_ms=f"{kms:.3f}", wall_ms=f"{wms:.3f}",
                             vs_one_by_one=f"{kms / base:.2f}", vs_flex=f"{kms / flex:.2f}" if flex else "",
                             max_err=f"{err:.3g}" if name == "packed" else "")
                    results.append(r)
                    print(" | ".join(str(r[f]) for f in FIELDS), flush=True)
    with open(os.path.join(args.out, "packed.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(results)
    with open(os.path.join(args.out, "packed.md"), "w") as f:
        f.write(f"packed fwd+bwd, bf16, {args.rows} rows x {args.tokens} tokens, {n_seq} sequences "
                f"(log-normal median 300, cap 1024), {torch.cuda.get_device_name()}, torch {torch.__version__}\n\n")
        f.write("| " + " | ".join(FIELDS) + " |\n|" + "---|" * len(FIELDS) + "\n")
        for r in results:
            f.write("| " + " | ".join(str(r[x]) for x in FIELDS) + " |\n")


if __name__ == "__main__":
    main()
