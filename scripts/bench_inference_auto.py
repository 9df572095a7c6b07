"""Inference path choice: one PairformerBlock forward without autograd on the plain path, the memory-bounded path
and ``mode="auto"``, at N = 512, 1024, 2048, 4096 (AF3 widths, random weights, bf16 weights and inputs on CUDA,
eval, 13 padded residues).

Each row: the path that ran (``blk.last_inference``), the bounded path's chunk, the median ms of ``--iters``
forwards after ``--warmup``, the extra peak memory (``max_memory_allocated`` during one forward minus the allocation
before it; the output counts), the absolute peak, the plain path's estimate and the budget auto held it against,
and each row's time over the plain path's at that N. A path that runs out of memory is a row with status OOM.

Needs only torch and triton (no Hydra). On a GPU:

    python scripts/bench_inference_auto.py --out $OUT

and on the CPU, as a smoke run: ``python scripts/bench_inference_auto.py --device cpu --n 32 --iters 1``.
Writes ``inference_auto.md`` and ``inference_auto.csv`` to ``--out`` when given.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attn_zoo.models.pairformer import PairformerBlock  # noqa: E402

GIB = 2.0 ** 30
PADDED = 13
MODES = ("plain", "bounded", "auto")
FIELDS = ["n", "mode", "path", "chunk", "ms", "vs_plain", "extra_gib", "peak_gib", "plain_est_gib", "budget_gib",
          "z_gib", "status", "note"]


def randomize(mod: torch.nn.Module) -> torch.nn.Module:
    """Random weights: AF2's zero-init final layers would make every update 0."""
    with torch.no_grad():
        for p in mod.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return mod


def inputs(n: int, dev: torch.device, dtype: torch.dtype, c_s: int, c_z: int):
    g = torch.Generator(device=dev).manual_seed(n)
    s = torch.randn(1, n, c_s, device=dev, generator=g).to(dtype)
    z = torch.randn(1, n, n, c_z, device=dev, generator=g).to(dtype)
    single = (torch.arange(n, device=dev) < n - min(PADDED, n // 4))[None]  # [1, N]
    return s, z, single, single[:, :, None] & single[:, None, :]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(fn, dev: torch.device, iters: int, warmup: int):
    """(median ms, extra peak bytes, absolute peak bytes); the memory only on CUDA."""
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        out = fn()
        del out
    sync(dev)
    extra = peak = None
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    out = fn()
    sync(dev)
    if cuda:
        peak = torch.cuda.max_memory_allocated(dev)
        extra = peak - base
    del out
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        out = fn()
        sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
        del out
    return (statistics.median(times) if times else float("nan")), extra, peak


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run(args) -> list:
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    backend = args.backend or ("triton" if dev.type == "cuda" else "chunked")
    blk = PairformerBlock(c_s=args.c_s, c_z=args.c_z, attention=backend)
    blk = randomize(blk).to(dev, dtype).eval()
    rows = []
    for n in args.n:
        s, z, single, pair = inputs(n, dev, dtype, args.c_s, args.c_z)
        z_gib = z.numel() * z.element_size() / GIB
        plain_ms = None
        for mode in MODES:
            row = dict(n=n, mode=mode, z_gib=round(z_gib, 3))

            def fn(mode=mode):
                return blk.forward_inference(s, z, single, pair, mode=mode)

            try:
                ms, extra, peak = measure(fn, dev, args.iters, args.warmup)
            except Exception as exc:  # an OOM is a result; anything else too, with its message
                row.update(status="OOM" if is_oom(exc) else "error", note=f"{type(exc).__name__}: {exc}"[:160])
                rows.append(row)
                torch.cuda.empty_cache() if dev.type == "cuda" else None
                continue
            choice = blk.last_inference
            if mode == "plain":
                plain_ms = ms
            row.update(path=choice.path, ms=round(ms, 2), status="ok",
                       chunk=choice.plan.chunk_size if choice.plan is not None else "",
                       vs_plain="" if plain_ms is None else round(ms / plain_ms, 2),
                       extra_gib="" if extra is None else round(extra / GIB, 3),
                       peak_gib="" if peak is None else round(peak / GIB, 3),
                       plain_est_gib="" if choice.plain is None else round(choice.plain.extra / GIB, 3),
                       budget_gib="" if choice.budget is None else round(choice.budget / GIB, 2),
                       note=choice.reason if mode == "auto" else "")
            rows.append(row)
            print(row, flush=True)
        del s, z, single, pair
    return rows


def env_lines(args) -> list:
    dev = torch.device(args.device)
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = "none"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    return [
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}; commit {commit or 'unknown'}",
        f"- device: {gpu}; torch {torch.__version__}, triton {triton_v}, python {platform.python_version()}",
        f"- one PairformerBlock (c_s={args.c_s}, c_z={args.c_z}), {args.dtype}, backend "
        f"{args.backend or ('triton' if dev.type == 'cuda' else 'chunked')}, forward_inference(mode=...), "
        f"median of {args.iters} after {args.warmup} warm-up",
    ]


def markdown(rows: list, env: list) -> str:
    head = ["N", "mode", "path", "chunk", "ms", "/ plain", "extra GiB", "peak GiB", "plain est. GiB", "budget GiB",
            "z GiB", "status"]
    keys = ["n", "mode", "path", "chunk", "ms", "vs_plain", "extra_gib", "peak_gib", "plain_est_gib", "budget_gib",
            "z_gib", "status"]
    lines = env + ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    notes = [f"- N={r['n']} {r['mode']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def profile(args, n: int) -> str:
    """Where the time goes at ``n``: each path's kernels by device time (torch.profiler), after one warm-up; the
    wall time, kernel count and device total of one call head each table."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    blk = randomize(PairformerBlock(c_s=args.c_s, c_z=args.c_z, attention=args.backend or "triton"))
    blk = blk.to(dev, dtype).eval()
    s, z, single, pair = inputs(n, dev, dtype, args.c_s, args.c_z)
    parts = []
    for mode in ("plain", "bounded"):
        def fn():
            return blk.forward_inference(s, z, single, pair, mode=mode)
        fn()
        sync(dev)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            fn()
            sync(dev)
            wall = (time.perf_counter() - t) * 1e3
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = sum(e.count for e in events)
        device_ms = sum(e.self_device_time_total for e in events) / 1e3
        parts.append(f"## N={n}, {mode}: wall {wall:.2f} ms, {kernels} kernels, {device_ms:.2f} ms on the device\n")
        parts.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    return "\n".join(parts)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--backend", default=None, help="attention backend (default triton on CUDA, chunked on the CPU)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--c-s", type=int, default=384)
    ap.add_argument("--c-z", type=int, default=128)
    ap.add_argument("--out", default=None, help="folder for inference_auto.md / .csv")
    ap.add_argument("--profile", type=int, nargs="*", default=[], metavar="N",
                    help="also profile both paths at these N (inference_profile.txt in --out)")
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    rows = run(args)
    text = markdown(rows, env_lines(args))
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "inference_auto.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "inference_auto.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
    if args.profile:
        text = "\n\n".join(profile(args, n) for n in args.profile)
        print(text)
        if args.out:
            with open(os.path.join(args.out, "inference_profile.txt"), "w") as f:
                f.write(text)
    return rows


if __name__ == "__main__":
    main()
