"""Packed vs padded ESM-2 masked-LM training: real tokens per second at equal memory, and the loss curves.

    python scripts/bench_packing.py                  # GPU: ESM-2 35M, bf16 autocast, triton backend (~4 min)
    python scripts/bench_packing.py --smoke          # CPU: a tiny model, a few steps (the test suite runs this)

Lengths: log-normal with median 300 residues, capped at 1022 (+ <cls>/<eos> = 1024), seeded (UniRef50-like); or
``--fasta FILE`` for a file's lengths. Random residues, 15% BERT masking (80/10/10) on every protein.

- padded: batches of B proteins in the data's order, padded to the longest (what a plain DataLoader does);
- packed: rows of ``--width`` tokens (default 1024) filled first-fit with as many proteins as fit, ``segment_ids``
  telling them apart; the number of rows is chosen so the packed step's peak memory matches the padded one's
  (measured: both peaks are reported).
Throughput counts real tokens (no padding) per second over timed steps after warm-up. Loss curves, from the
same weights, per optimizer step (windowed means side by side): padded; packed with the same proteins per step
(packed into as few rows as hold them: packing must not change training); packed at equal memory (more
proteins per step).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attn_zoo.models.data.packing import collate_packed, first_fit  # noqa: E402
from attn_zoo.models.esm2 import ALPHABET, esm2  # noqa: E402

RESIDUES = torch.tensor([ALPHABET.get_idx(c) for c in "LAGVSERTIDPKQNFYMHWC"])


def lengths_lognormal(n: int, median: float = 300.0, sigma: float = 0.6, cap: int = 1022, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g)).round().clamp(8, cap)
    return [int(v) for v in x]


def lengths_fasta(path: str, cap: int = 1022):
    from attn_zoo.models.data.parsers import read_fasta

    return [min(len(r.sequence), cap) for r in read_fasta(path)]


def make_protein(n: int, g: torch.Generator):
    """(tokens, target, masked) 1-D with <cls>/<eos>; 15% of residues chosen: 80% <mask>, 10% random, 10% kept."""
    res = RESIDUES[torch.randint(0, len(RESIDUES), (n,), generator=g)]
    target = torch.cat([torch.tensor([ALPHABET.cls_idx]), res, torch.tensor([ALPHABET.eos_idx])])
    return mask_protein(target, g)


def mask_protein(target: torch.Tensor, g: torch.Generator):
    """(tokens, target, masked) of a protein's tokens with <cls>/<eos>, masked with ``g``'s draws."""
    n = len(target) - 2
    chosen = torch.zeros(n + 2, dtype=torch.bool)
    chosen[1:-1] = torch.rand(n, generator=g) < 0.15
    r = torch.rand(n + 2, generator=g)
    tokens = target.clone()
    tokens[chosen & (r < 0.8)] = ALPHABET.mask_idx
    swap = chosen & (r >= 0.8) & (r < 0.9)
    tokens[swap] = RESIDUES[torch.randint(0, len(RESIDUES), (int(swap.sum()),), generator=g)]
    return tokens, target, chosen


def padded_batch(proteins):
    width = max(len(p[0]) for p in proteins)
    B = len(proteins)
    tokens = torch.full((B, width), ALPHABET.padding_idx)
    target = torch.full((B, width), ALPHABET.padding_idx)
    loss = torch.zeros(B, width, dtype=torch.bool)
    for i, (t, y, m) in enumerate(proteins):
        tokens[i, :len(t)], target[i, :len(t)], loss[i, :len(t)] = t, y, m
    return {"tokens": tokens, "target": target, "loss_mask": loss}


def packed_batch(proteins, rows: int, width: int):
    """(tokens, target, masked) proteins -> ``rows`` x ``width`` packed rows (``models/data/packing.py``)."""
    examples = [{"tokens": t, "target": y, "loss_mask": m} for t, y, m in proteins]
    return collate_packed(examples, rows, width, pad=ALPHABET.padding_idx)


def pack_stream(proteins, rows: int, width: int):
    """Consecutive groups of ``proteins`` (in order) that fit ``rows`` x ``width``: (start, stop) pairs."""
    groups, start = [], 0
    while start < len(proteins):
        stop = start + 1
        while stop < len(proteins) and first_fit([len(p[0]) for p in proteins[start:stop + 1]], rows, width):
            stop += 1
        groups.append((start, stop))
        start = stop
    return groups


def step(model, batch, device, opt, amp):
    b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        out = model(b["tokens"], segment_ids=b.get("segment_ids"))["logits"]
    loss = torch.nn.functional.cross_entropy(out[b["loss_mask"]].float(), b["target"][b["loss_mask"]])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def real_tokens(batch):
    key = "segment_ids"
    return int((batch[key] >= 0).sum()) if key in batch else int((batch["tokens"] != ALPHABET.padding_idx).sum())


def timed(model, batches, device, amp, warmup):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for b in batches[:warmup]:
        step(model, b, device, opt, amp)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, tokens = time.perf_counter(), 0
    for b in batches[warmup:]:
        step(model, b, device, opt, amp)
        tokens += real_tokens(b)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else float("nan")
    return tokens / dt, peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="35M")
    p.add_argument("--batch", type=int, default=8, help="proteins per padded batch")
    p.add_argument("--width", type=int, default=1024, help="packed row width")
    p.add_argument("--rows", type=int, default=0, help="packed rows per batch (0: batch x 1024 / width... see doc)")
    p.add_argument("--steps", type=int, default=200, help="padded steps of the loss-curve comparison")
    p.add_argument("--time-steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--fasta", default=None)
    p.add_argument("--attention", default="triton")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    amp = device.type == "cuda"
    if args.smoke:
        args.size, args.batch, args.width, args.steps, args.time_steps, args.warmup = None, 4, 128, 6, 3, 1
        args.attention = "torch"
    rows = args.rows or args.batch  # the padded batch's rows: equal memory when its longest protein fills width
    n_prot = (3 * args.steps + args.time_steps + args.warmup) * args.batch  # packed steps hold ~2-3x the proteins
    lengths = lengths_fasta(args.fasta) if args.fasta else lengths_lognormal(n_prot, cap=args.width - 2)
    lengths = (lengths * (n_prot // len(lengths) + 1))[:n_prot]
    g = torch.Generator().manual_seed(1)
    proteins = [make_protein(n, g) for n in lengths]

    torch.manual_seed(0)
    if args.smoke:
        from attn_zoo.models.esm2 import ESM2

        init = ESM2(2, 32, 4, attention=args.attention)
    else:
        init = esm2(args.size, attention=args.attention)
    state = {k: v.clone() for k, v in init.state_dict().items()}

    def fresh():
        init.load_state_dict(state)
        return init.to(device).train()

    padded = [padded_batch(proteins[i:i + args.batch]) for i in range(0, len(proteins), args.batch)]
    packed = [packed_batch(proteins[a:b], rows, args.width) for a, b in pack_stream(proteins, rows, args.width)]
    n_time = args.warmup + args.time_steps
    rows_out = []
    for name, batches in (("padded", padded[:n_time]), ("packed", packed[:n_time])):
        tps, peak = timed(fresh(), batches, device, amp, args.warmup)
        rows_out.append({"run": name, "tokens_per_s": tps, "peak_gib": peak,
                         "proteins_per_batch": statistics.mean(
                             int(b["segment_ids"].max(-1).values.add(1).sum()) if "segment_ids" in b else len(b["tokens"])
                             for b in batches)})
        print(json.dumps(rows_out[-1]), flush=True)

    # Loss curves, two ways. "same": each step's proteins identical in both runs (the padded batch's 8), packed into
    # as few rows as hold them: packing must not change training (equal up to bf16 rounding). "memory": the
    # equal-memory batches above (packed steps hold more proteins), per optimizer step.
    def run_curve(batches):
        model = fresh()
        torch.manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=4e-4)
        return [float(step(model, b, device, opt, amp)) for b in batches]

    def rows_for(group):
        need = 1
        while first_fit([len(p[0]) for p in group], need, args.width) is None:
            need += 1
        return need

    same_groups = [proteins[i:i + args.batch] for i in range(0, args.steps * args.batch, args.batch)]
    # the noise of a run: the same proteins and init, the 15% masks drawn again (another seed)
    g2 = torch.Generator().manual_seed(2)
    remasked = [mask_protein(p[1], g2) for p in proteins[:args.steps * args.batch]]
    curves = {
        "padded": run_curve(padded[:args.steps]),
        "padded, other masks": run_curve([padded_batch(remasked[i:i + args.batch])
                                          for i in range(0, len(remasked), args.batch)]),
        "packed, same proteins": run_curve([packed_batch(g, rows_for(g), args.width) for g in same_groups]),
        "packed, equal memory": run_curve(packed[:args.steps]),
    }
    windows = 5
    names = list(curves)
    lines = ["| steps | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for w in range(windows):
        lo, hi = args.steps * w // windows, args.steps * (w + 1) // windows
        vals = [statistics.mean(c[lo:hi]) if c[lo:hi] else float("nan") for c in curves.values()]
        lines.append(f"| {lo}-{hi} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    diff = max(abs(a - b) / abs(b) for a, b in zip(curves["packed, same proteins"], curves["padded"]))
    lines += ["", f"same proteins per step: largest relative loss difference over {args.steps} steps {diff:.2e}", "",
              "Within noise? |window mean - padded's| of packed (same proteins) against that of padded with other "
              "masks (the run-to-run noise):", "", "| steps | packed, same proteins | padded, other masks | within |",
              "|---|---|---|---|"]
    within_all = True
    for w in range(windows):
        lo, hi = args.steps * w // windows, args.steps * (w + 1) // windows
        if lo == hi:
            continue
        ref = statistics.mean(curves["padded"][lo:hi])
        d_pack = abs(statistics.mean(curves["packed, same proteins"][lo:hi]) - ref)
        d_noise = abs(statistics.mean(curves["padded, other masks"][lo:hi]) - ref)
        within_all &= d_pack <= d_noise
        lines.append(f"| {lo}-{hi} | {d_pack:.3f} | {d_noise:.3f} | {'yes' if d_pack <= d_noise else 'no'} |")
    lines += ["", f"packed within the noise in every window: {'yes' if within_all else 'no'}"]
    pad, pk = rows_out
    table = [f"# Packed vs padded ESM-2 {args.size or 'tiny'} MLM ({device}, {args.attention})", "",
             "| run | real tokens/s | peak GiB | proteins per batch |", "|---|---|---|---|"]
    table += [f"| {r['run']} | {r['tokens_per_s']:,.0f} | {r['peak_gib']:.2f} | {r['proteins_per_batch']:.1f} |"
              for r in rows_out]
    table += ["", f"packed / padded tokens/s: {pk['tokens_per_s'] / pad['tokens_per_s']:.2f}x", ""] + lines
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "packing.md"), "w") as f:
            f.write("\n".join(table) + "\n")
        with open(os.path.join(args.out, "packing.json"), "w") as f:
            json.dump({"throughput": rows_out, "curves": curves}, f)
    return rows_out, curves


if __name__ == "__main__":
    main()
