"""Where an ESM-2 training step goes: wall time, summed kernel time and the heaviest kernels, for attn-zoo and fair-esm
eager, compiled or as CUDA graphs (``bench_esm2``'s models, weights and batches).

The step's loss skips the masked-position boolean index of ``bench_esm2`` (it takes ``ignore_index`` instead), so
that nothing in the step waits for the device and a host-bound step shows as wall time over kernel time. Each model
is built, warmed up (compiled), timed over ``--steps`` synchronised steps (median), then one step runs under
``torch.profiler`` whose CUDA events give the kernel time and the ``--top`` kernels. Prints one JSON line per model
and writes ``profile_esm2.md`` to ``--out``.

    python scripts/profile_esm2.py --models attn-zoo+compile fair-esm+compile --shape 8x512
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_esm2 as be  # noqa: E402


def kernel_table(events, top):
    """(summed device ms, launches, the ``top`` kernels as (ms, calls, name)) of a profile's CUDA events."""
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time  # us
            count[e.name] += 1
    kernels = [(round(t / 1e3, 3), count[n], n[:120]) for n, t in total.most_common(top)]
    return round(sum(total.values()) / 1e3, 2), sum(count.values()), kernels


def profile(name, model, batch, length, steps, top, device="cuda"):
    """(the row: first step s, median ms, kernel ms, launches, peak GiB; the ``top`` kernels as (ms, calls, name)).
    ``device`` "cpu" runs the same step without kernels to count (the CPU tests)."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokens, target, masked = be.mlm_batch(batch, length, device)
    labels = target.masked_fill(~masked, -100)
    if name.startswith("fair-esm"):
        with torch.no_grad():  # its rotary tables, cached on the module, made outside any graph (see bench_esm2)
            model(tokens[:1])
    fwd = be.forward_fn(name, model)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = fwd(tokens)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
        model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(3):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / be.GIB if cuda else 0.0
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        step()
        sync()
    kernel_ms, launches, kernels = kernel_table(prof.events(), top)
    row = dict(model=name, shape=f"{batch}x{length}", first_step_s=round(first, 1),
               ms=round(statistics.median(walls), 2), kernel_ms=kernel_ms, launches=launches, peak_gib=round(peak, 2))
    return row, kernels


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["attn-zoo+compile", "fair-esm+compile"],
                   choices=[m for m in be.MODELS if not m.startswith("hf-")])
    p.add_argument("--shape", default="8x512", help="batch x length")
    p.add_argument("--size", default="650M")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = p.parse_args()
    batch, length = (int(s) for s in args.shape.split("x"))
    models = be.build_models(args.size, args.models)
    lines = [f"# ESM-2 {args.size} step profile ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__})", ""]
    for name in args.models:
        model = models[name.split("+")[0]].cuda().train()
        row, kernels = profile(name, model, batch, length, args.steps, args.top)
        print(json.dumps(row), flush=True)
        lines += [f"## {name} {row['shape']}", "", "`" + json.dumps(row) + "`", "", "| ms | calls | kernel |",
                  "|---|---|---|"] + [f"| {t} | {n} | `{k}` |" for t, n, k in kernels] + [""]
        model.cpu()
        be.cleanup()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile_esm2.md"), "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()
