"""The Pairformer over P GPUs (z split by rows, ``attn_zoo.models.sharding``) against one GPU: per-GPU peak memory,
first-call and steady time, as one markdown row per run.

    torchrun --nproc_per_node=2 scripts/bench_shard.py --mode block-fwd --residues 4096
    torchrun --nproc_per_node=1 scripts/bench_shard.py --mode block-fwd --residues 4096        # the one-GPU baseline
    torchrun --nproc_per_node=2 scripts/bench_shard.py --mode stack-infer --residues 12288 --blocks 48
    torchrun --nproc_per_node=2 scripts/bench_shard.py --mode check                       # correctness, NCCL
    torchrun --nproc_per_node=2 scripts/bench_shard.py --device cpu --residues 24 --c-z 16 --c-s 32 --blocks 2  # gloo

Modes (AF3 widths by default: c_z 128, c_s 384, 16 single heads, 4 pair heads x 32, triangle products 128):
- ``block-fwd``: one PairformerBlock without autograd in eval mode, the in-place chunked path (one GPU:
  ``PairformerBlock.forward_inference(inplace=True)``; P GPUs: the sharded stack's in-place path on each rank);
- ``block-train``: one PairformerBlock forward and backward in train mode (dropout on), gradients into every
  parameter and into s and z (``--checkpoint``: every module checkpointed, on one GPU through the wrapper too);
- ``stack-infer``: a ``--blocks``-block PairformerStack without autograd, the in-place path; ``--blocks-run K``
  runs the first K blocks only (the per-block peak and time are the same for every block);
- ``check``: correctness on the device: the sharded and the single-process stack in float32 (TF32 off), each
  against the single-process stack in float64 on the CPU (training outputs and gradients, in-place outputs); PASS
  when the sharded error is at most 2x the single-process one plus 1e-6 (exit status 1 otherwise).
P = 1 runs the single-process modules (``--sharded`` runs the sharded wrapper on one rank instead). bf16 weights and
inputs on CUDA (NCCL), float32 on the CPU (gloo); random weights; the last 13 residues padded (masked). Time: the
first call alone, then the median of ``--iters`` calls (the slowest rank's; stack-infer: the one call, compiles
included); ms per block for ``stack-infer``. Peak:
``torch.cuda.max_memory_allocated`` over the run, the largest over the ranks; ``z/GPU``: a rank's rows of z.
Rows are printed by rank 0 and appended to ``--out``. ``--profile K`` profiles one more call on every rank and adds a
table after the row: wall, kernel time in NCCL's collectives and in compute, collective calls; rank 0's K heaviest
kernels (where a sharded call's time goes). Needs torch, triton and this repository only (no Hydra).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attn_zoo.models.pairformer import PairformerStack  # noqa: E402
from attn_zoo.models.sharding import ShardedPairformerStack  # noqa: E402

GIB = 2.0 ** 30
PADDED = 13
MODES = ("block-fwd", "block-train", "stack-infer", "check")
HEADER = ("| mode | GPUs | impl | N | N' | blocks run | c_z | c_s | chunk | first call s | ms (median) "
          "| per-GPU peak GiB | z/GPU GiB | status |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=MODES, default="block-fwd")
    p.add_argument("--residues", type=int, default=None, help="N, the last 13 masked as padding (default 4096; "
                   "check: 77)")
    p.add_argument("--blocks", type=int, default=None, help="blocks of the stack (stack-infer: default 48; check: 2)")
    p.add_argument("--blocks-run", type=int, default=0, help="stack-infer: run the first K blocks only (0: all)")
    p.add_argument("--c-z", type=int, default=128)
    p.add_argument("--c-s", type=int, default=384)
    p.add_argument("--heads-s", type=int, default=16)
    p.add_argument("--heads-z", type=int, default=4)
    p.add_argument("--c-pair", type=int, default=32, help="pair attention head width")
    p.add_argument("--c-mul", type=int, default=0, help="triangle product width (0: c_z)")
    p.add_argument("--chunk", type=int, default=0, help="pair rows per chunk (0: planned)")
    p.add_argument("--channel-groups", type=int, default=8, help="channel groups of the sharded in-place path")
    p.add_argument("--iters", type=int, default=None, help="timed calls after the first (default 3; stack-infer 0: "
                   "the first call is the measurement)")
    p.add_argument("--attention", default="auto", help="attention backend")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--backend", default=None, help="process group backend (default nccl on CUDA, gloo on the CPU)")
    p.add_argument("--sharded", action="store_true", help="the sharded wrapper even on one rank")
    p.add_argument("--checkpoint", action="store_true", help="block-train: every module of the block under activation "
                   "checkpointing (the sharded wrapper's checkpoint_modules; on one GPU too)")
    p.add_argument("--out", default=None, help="markdown file the row is appended to")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="after the timed calls, one more under torch.profiler on every rank: per rank its wall time, "
                        "kernel time split into collectives and compute, the collectives' count; rank 0's K "
                        "heaviest kernels (0: no profile)")
    args = p.parse_args(argv)
    if args.profile and args.mode == "check":
        p.error("--profile times a benchmark mode, not --mode check")
    if args.residues is None:
        args.residues = 77 if args.mode == "check" else 4096
    if args.blocks is None:
        args.blocks = 2 if args.mode == "check" else 48
    if args.iters is None:
        args.iters = 0 if args.mode == "stack-infer" else 3
    return args


def setup(args):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but no CUDA device; use --device cpu")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    backend = args.backend or ("nccl" if dev.type == "cuda" else "gloo")
    if "MASTER_ADDR" not in os.environ:  # a plain `python` run: one rank
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    kw = dict(device_id=dev) if dev.type == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(minutes=20), **kw)
    return dev, rank, world


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(args, dev, dtype, num_blocks):
    c_mul = args.c_mul or args.c_z
    stack = PairformerStack(c_s=args.c_s, c_z=args.c_z, num_blocks=num_blocks, num_heads_single=args.heads_s,
                            num_heads_pair=args.heads_z, c_hidden_pair=args.c_pair, c_hidden_mul=c_mul,
                            attention=args.attention)
    g = torch.Generator().manual_seed(0)  # the same weights on every rank
    with torch.no_grad():
        for p in stack.parameters():  # AF2's zero-initialised output layers would make every update 0
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 * p.shape[-1] ** -0.5)
    if args.chunk:
        stack.configure_inference(chunk_size=args.chunk)
    return stack.to(dev, dtype)


def inputs(args, dev, dtype, rows: slice, n_all: int, requires_grad: bool):
    """This rank's rows of s and z (rows ``rows`` of the padded N'), built by chunks of rows, and the whole masks."""
    g = torch.Generator(device=dev).manual_seed(1 + (rows.start or 0))
    n = rows.stop - rows.start
    s = torch.randn(1, n, args.c_s, device=dev, generator=g).to(dtype)
    z = torch.empty(1, n, n_all, args.c_z, device=dev, dtype=dtype)
    for i in range(0, n, 256):  # no float32 temporary of the whole z
        z[:, i:i + 256].normal_(generator=g)
    real = torch.arange(n_all, device=dev) < args.residues - min(PADDED, args.residues // 4)
    single = real[None].clone()
    pair = single[:, :, None] & single[:, None, :]
    if requires_grad:
        s.requires_grad_(), z.requires_grad_()
    return s, z, single, pair


def run(args):
    dev, rank, world = setup(args)
    if args.mode == "check":
        return check(args, dev, rank, world)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    train = args.mode == "block-train"
    sharded = world > 1 or args.sharded or (train and args.checkpoint)
    num_blocks = args.blocks if args.mode == "stack-infer" else 1
    stack = build(args, dev, dtype, num_blocks)
    if args.mode == "stack-infer" and args.blocks_run:
        stack.blocks = torch.nn.ModuleList(list(stack.blocks)[:args.blocks_run])
    blocks_run = len(stack.blocks)
    stack.train(train)
    wrapper = ShardedPairformerStack(stack, channel_groups=args.channel_groups,
                                     checkpoint_modules=args.checkpoint) if sharded else None
    n_all = wrapper.padded_length(args.residues) if sharded else args.residues
    n_loc = n_all // world if sharded else n_all
    rows = slice(rank * n_loc, (rank + 1) * n_loc)
    e = torch.empty((), dtype=dtype).element_size()
    impl = ("sharded" if sharded else "single") + (", checkpointed modules" if train and args.checkpoint else "")
    row = dict(mode=args.mode, gpus=world, impl=impl, n=args.residues, n_all=n_all,
               blocks=blocks_run, chunk="", z_gib=n_loc * n_all * args.c_z * e / GIB)
    status, first, times, prof = "ok", None, [], None
    try:
        s, z, single, pair = inputs(args, dev, dtype, rows, n_all, train)
        if not train:
            chunk = wrapper.plan_chunk(z) if sharded else None
            row["chunk"] = chunk if chunk is not None else "planned"

        def call():
            if train:
                out_s, out_z = wrapper(s, z, single, pair) if sharded else stack(s, z, single, pair)
                torch.autograd.backward([out_s, out_z], [torch.ones_like(out_s), torch.ones_like(out_z)])
                return
            with torch.no_grad():
                if sharded:
                    wrapper.forward_inference(s, z, single, pair, inplace=True)
                elif args.mode == "block-fwd":
                    stack.blocks[0].forward_inference(s, z, single, pair, inplace=True,
                                                      **_bounded(stack.blocks[0].forward_inference))
                else:
                    stack.configure_inference(mode="bounded")
                    stack.forward_inference(s, z, single, pair, inplace=True)

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        for i in range(1 + args.iters):
            dist.barrier()
            sync(dev)
            t0 = time.perf_counter()
            call()
            sync(dev)
            dt = time.perf_counter() - t0
            if i == 0:
                first = dt
            else:
                times.append(dt)
    except torch.cuda.OutOfMemoryError:
        status = "OOM"
    except RuntimeError as exc:
        if "out of memory" not in str(exc):
            raise
        status = "OOM"
    peak = torch.cuda.max_memory_allocated(dev) / GIB if dev.type == "cuda" else -1.0
    # the slowest rank's times, the largest peak, OOM anywhere
    stats = torch.tensor([first or 0.0, statistics.median(times) if times else 0.0, peak, status != "ok"],
                         dtype=torch.float64, device=dev if dev.type == "cuda" else "cpu")
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    first, med, peak, failed = stats.tolist()
    if not times:
        med = first
    if failed and status == "ok":
        status = "OOM on another rank"
    if args.profile and not failed:  # (every rank or none: a rank that failed would not meet the others' collectives)
        try:
            prof = profile_call(call, dev, args.profile)
        except torch.cuda.OutOfMemoryError:
            prof = None
    per = blocks_run if args.mode == "stack-infer" else 1
    cells = [args.mode, world, row["impl"], args.residues, n_all, f"{blocks_run}" + (f" of {args.blocks}"
             if args.mode == "stack-infer" else ""), args.c_z, args.c_s, row["chunk"],
             f"{first:.2f}" if status == "ok" else "", f"{med * 1e3 / per:.1f}" + (" / block" if per > 1 else "")
             if status == "ok" else "", f"{peak:.2f}" if peak >= 0 else "-", f"{row['z_gib']:.2f}", status]
    line = "| " + " | ".join(str(c) for c in cells) + " |"
    if rank == 0:
        print(HEADER)
        print(line, flush=True)
        if args.out:
            new = not os.path.exists(args.out)
            with open(args.out, "a") as f:
                if new:
                    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
                    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
                    f.write(f"{dev_name}, torch {torch.__version__}, {stamp}\n\n{HEADER}\n")
                f.write(line + "\n")
    if args.profile and not failed:
        profiles = [None] * world
        dist.all_gather_object(profiles, prof)
        if rank == 0:
            text = profile_markdown(profiles, line)
            print(text, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write("\n" + text + "\n")
    dist.destroy_process_group()
    return status


# profiler names of the collectives: the dispatcher ops every process group (NCCL, gloo) goes through; the groups' own
# events (gloo records its work on a thread of its own) would count them twice
COMM_PREFIXES = ("c10d::", "_c10d_functional::")


def outer_collective(e) -> bool:
    """Whether profiler event ``e`` is a collective not inside another one (one count per collective)."""
    if not e.name.startswith(COMM_PREFIXES):
        return False
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith(COMM_PREFIXES):
            return False
        parent = parent.cpu_parent
    return True


def profile_call(call, dev, top: int) -> dict:
    """One ``call()`` under ``torch.profiler`` on this rank: wall ms; kernel ms in all, in collective kernels (NCCL's)
    and in the rest; the collectives' count and host ms (their calls only: a wait on one is counted where it waits);
    the ``top`` heaviest kernels (CPU: host ops by self time)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    dist.barrier()
    sync(dev)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        call()
        sync(dev)
        wall = time.perf_counter() - t0
    comm = [e for e in prof.events() if outer_collective(e)]
    kernels = {}
    if dev.type == "cuda":
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1e3
        heavy = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    else:
        heavy = sorted(((e.key, e.self_cpu_time_total / 1e3) for e in prof.key_averages()),
                       key=lambda kv: -kv[1])[:top]
    comm_kernels = sum(ms for name, ms in kernels.items() if "nccl" in name.lower())
    return dict(wall_ms=wall * 1e3, kernel_ms=sum(kernels.values()), comm_kernel_ms=comm_kernels,
                comm_calls=len(comm), comm_host_ms=sum(e.cpu_time_total for e in comm) / 1e3,
                heavy=heavy, device=dev.type)


def profile_markdown(profiles, row: str) -> str:
    """The per-rank profile table (after the row it profiles) and rank 0's heaviest kernels."""
    lines = [f"Profile of one more call of: `{row}` (wall: that call under the profiler; kernel ms: kernels, copies "
             "and memsets on the device; NCCL's kernels include their wait for the slowest peer)", "",
             "| rank | wall ms | kernel ms | collective kernels ms | other kernels ms | collectives | their calls' "
             "host ms |", "|---|---|---|---|---|---|---|"]
    for r, p in enumerate(profiles):
        if p is None:
            lines.append(f"| {r} | not profiled (the call failed) | | | | | |")
            continue
        cuda = p["device"] == "cuda"
        k = (f"{p['kernel_ms']:.1f}", f"{p['comm_kernel_ms']:.1f}", f"{p['kernel_ms'] - p['comm_kernel_ms']:.1f}") \
            if cuda else ("-", "-", "-")
        lines.append(f"| {r} | {p['wall_ms']:.1f} | {k[0]} | {k[1]} | {k[2]} | {p['comm_calls']} | "
                     f"{p['comm_host_ms']:.1f} |")
    rank, first = next(((r, p) for r, p in enumerate(profiles) if p is not None), (None, None))
    if first is not None and first["heavy"]:
        what = "kernels by device time" if first["device"] == "cuda" else "host ops by self CPU time"
        lines += ["", f"Rank {rank}'s heaviest {what}:", "", "| ms | name |", "|---|---|"]
        lines += [f"| {ms:.2f} | `{name[:100]}` |" for name, ms in first["heavy"]]
    return "\n".join(lines)


def _rel(a, b, scale=None) -> float:
    """max |a - b| / max |b| (``scale``: instead of max |b|, for tensors whose own values are near zero)."""
    b = b.double().cpu()
    return ((a.double().cpu() - b).abs().max() / (b.abs().max().clamp_min(1e-30) if scale is None else scale)).item()


def check(args, dev, rank, world) -> str:
    """The sharded stack against the single-process one, both in float32 on ``dev`` (TF32 off), each compared with
    the single-process stack in float64 on the CPU: outputs, input gradients and the largest parameter-gradient
    error (training, gradients summed over ranks), and the in-place path's outputs. Passes when the sharded error
    is at most 2x the single-process float32 error plus 1e-6 (relative)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    n = args.residues
    g = torch.Generator().manual_seed(2)
    s = torch.randn(1, n, args.c_s, generator=g, dtype=torch.float64)
    z = torch.randn(1, n, n, args.c_z, generator=g, dtype=torch.float64)
    single = torch.arange(n)[None] < n - min(PADDED, n // 4)
    pair = single[:, :, None] & single[:, None, :] & (torch.rand(1, n, n, generator=g) > 0.1)
    ds = torch.randn(s.shape, generator=g, dtype=torch.float64)
    dz = torch.randn(z.shape, generator=g, dtype=torch.float64)
    base = build(args, torch.device("cpu"), torch.float64, args.blocks)
    for p in base.parameters():  # every layer random (the zero-initialised ones too), the same on every rank
        std = p.shape[-1] ** -0.5 if p.ndim > 1 else 0.3
        p.data.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std
                     + (1.0 if p.ndim == 1 and p.shape[0] in (args.c_z, args.c_s) else 0.0))
    base.train()  # dropout off below: the same function in every run
    for mod in base.modules():
        if hasattr(mod, "p"):
            mod.p = 0.0

    def train_run(stack, wrapper, device, dtype):
        si, zi = (t.detach().to(device, dtype).requires_grad_() for t in (s, z))
        sm, pm = single.to(device), pair.to(device)
        if wrapper is None:
            out_s, out_z = stack(si, zi, sm, pm)
            ((out_s.double() * ds.to(device)).sum() + (out_z.double() * dz.to(device)).sum()).backward()
        else:
            s_r, z_r, sm_p, pm_p = wrapper.shard(si, zi, sm, pm)
            ds_r, dz_r, _, _ = wrapper.shard(ds.to(device), dz.to(device))
            out_r = wrapper(s_r, z_r, sm_p, pm_p)
            ((out_r[0].double() * ds_r).sum() + (out_r[1].double() * dz_r).sum()).backward()
            wrapper.reduce_gradients()
            for t in (si, zi):
                dist.all_reduce(t.grad)
            with torch.no_grad():
                out_s, out_z = wrapper.gather(*out_r, n=n)
        grads = {k: q.grad for k, q in stack.named_parameters()}
        return [out_s, out_z, si.grad, zi.grad], grads

    def infer_run(stack, wrapper, device, dtype):
        stack.eval()
        with torch.no_grad():
            si, zi, sm, pm = s.to(device, dtype), z.to(device, dtype), single.to(device), pair.to(device)
            if wrapper is None:
                stack.configure_inference(mode="bounded")
                return list(stack.forward_inference(si, zi, sm, pm))
            return list(wrapper.gather(*wrapper.forward_inference(*wrapper.shard(si, zi, sm, pm)), n=n))

    import copy

    ref, ref_grads = train_run(base, None, torch.device("cpu"), torch.float64)
    ref_inf = infer_run(copy.deepcopy(base), None, torch.device("cpu"), torch.float64)
    dtype = torch.float32
    one = copy.deepcopy(base).to(dev, dtype)
    one_out, one_grads = train_run(one, None, dev, dtype)
    one_inf = infer_run(copy.deepcopy(one), None, dev, dtype)
    many = copy.deepcopy(base).to(dev, dtype)
    wrapper = ShardedPairformerStack(many, channel_groups=args.channel_groups)
    many_out, many_grads = train_run(many, wrapper, dev, dtype)
    wrapper_inf = ShardedPairformerStack(copy.deepcopy(many).eval(), channel_groups=args.channel_groups)
    many_inf = infer_run(wrapper_inf.stack, wrapper_inf, dev, dtype)
    names = ["s", "z", "grad s", "grad z"]
    rows = [(f"train {k}", _rel(a, r), _rel(b, r)) for k, a, b, r in zip(names, one_out, many_out, ref)]
    # against the largest parameter gradient: some are analytically zero (a layer-norm bias before a softmax)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    rows.append(("train parameter grads (max)", max(_rel(one_grads[k], g, scale) for k, g in ref_grads.items()),
                 max(_rel(many_grads[k], g, scale) for k, g in ref_grads.items())))
    rows += [(f"in-place {k}", _rel(a, r), _rel(b, r)) for k, a, b, r in zip(names, one_inf, many_inf, ref_inf)]
    ok = all(b <= 2 * a + 1e-6 for _, a, b in rows)
    if rank == 0:
        print(f"| quantity (float32, {world} ranks, N={n}) | single process vs float64 | sharded vs float64 |\n"
              "|---|---|---|")
        for k, a, b in rows:
            print(f"| {k} | {a:.2e} | {b:.2e} |")
        print("check:", "PASS" if ok else "FAIL", flush=True)
    dist.destroy_process_group()
    return "ok" if ok else "FAIL"


def _bounded(fn) -> dict:
    """``mode="bounded"`` where a block's ``forward_inference`` takes a mode (it may otherwise pick another path)."""
    import inspect

    return {"mode": "bounded"} if "mode" in inspect.signature(fn).parameters else {}


if __name__ == "__main__":
    sys.exit(0 if run(parse()) == "ok" else 1)
