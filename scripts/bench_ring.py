"""Ring attention on 2 GPUs (NCCL) vs the same attention op on 1 GPU: correctness, tokens/s, peak memory.

    torchrun --nproc_per_node=2 scripts/bench_ring.py --check --out results.json

``--check``: ring vs the float64 reference at 2 ranks (small shapes, bf16 and fp32), with the error bounded
like the CPU tests: ``tolerance * (plain PyTorch's error in that dtype) + 8 ulp``.
Benchmark: causal ``[1, H, L, D]`` bf16, fwd+bwd with gradients into q, k, v (and the bias). Time is the
median over iterations of the slowest rank; peak is ``torch.cuda.max_memory_allocated`` during one step,
inputs (q, k, v, dO, bias) included, per GPU. The 1-GPU baseline runs on rank 0 while rank 1 waits.
Results are appended as JSON lines to ``--out`` as they come (a deadline stops before the time runs out).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attn_ops  # noqa: E402
from attn_ops import registry  # noqa: E402
from attn_ops.reference import attention_reference  # noqa: E402
from attn_ops.ring import ring_attention, shard_sequence  # noqa: E402

GiB = 2 ** 30
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}


def log(rank, msg):
    if rank == 0:
        print(msg, flush=True)


def emit(args, rank, rec):
    if rank == 0:
        print(json.dumps(rec), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


# --------------------------------------------------------------------------------------------------
# Correctness at 2 ranks
# --------------------------------------------------------------------------------------------------
class _RelBias(torch.nn.Module):
    def __init__(self, heads, max_dist=64):
        super().__init__()
        self.max_dist = max_dist
        self.table = torch.nn.Parameter(torch.randn(heads, 2 * max_dist + 1) * 0.5)

    def forward(self, q_pos, k_pos):
        rel = (k_pos[None, :] - q_pos[:, None]).clamp(-self.max_dist, self.max_dist) + self.max_dist
        return self.table[:, rel]  # [H, Lq, Lk]


def _errs(got, ref):
    out = []
    for a, b in zip(got, ref):
        if a is None:
            out.append(None)
            continue
        a, b = a.double(), b.double()
        ok = torch.isfinite(b)
        out.append((a[ok] - b[ok]).abs().max().item())
    return out


def check(args, rank, world, dev):
    names = ["out", "lse", "dq", "dk", "dv", "dbias"]
    cases = [
        dict(name="causal_zigzag_pairbias_keymask", causal=True, layout="zigzag", bias="pair", mask=True, parts=1,
             q_div=0),
        dict(name="causal_zigzag_pairbias_parts4_qchunk", causal=True, layout="zigzag", bias="pair", mask=False,
             parts=4, q_div=8),
        dict(name="bidir_contiguous_relbias_module", causal=False, layout="contiguous", bias="module", mask=True,
             parts=2, q_div=0),
    ]
    for dtype in (torch.bfloat16, torch.float32):
        for gdt in ((None, dtype) if dtype != torch.float32 else (None,)):
            for case in cases:
                if (gdt is not None or dtype == torch.float32) and case["bias"] == "module":
                    continue
                if dtype == torch.float32 and case["parts"] > 1:
                    continue
                t0 = time.time()
                g = torch.Generator(device=dev).manual_seed(7)
                B, H, L, D = 2, 4, args.check_len, 64
                q, k, v, do = (torch.randn(B, H, L, D, generator=g, device=dev, dtype=torch.float64) for _ in range(4))
                module = None
                bias = None
                if case["bias"] == "pair":
                    bias = torch.randn(1, H, L, L, generator=g, device=dev, dtype=torch.float64)
                else:
                    torch.manual_seed(3)
                    module = _RelBias(H).to(dev)
                mask = (torch.rand(B, 1, 1, L, generator=g, device=dev) > 0.3) if case["mask"] else None
                if mask is not None:
                    mask[..., 0] = True

                def full_run(dt, upcast):
                    leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
                    if module is not None:
                        m64 = _RelBias(H).to(dev).to(dt)
                        m64.load_state_dict(module.state_dict())
                        pos = torch.arange(L, device=dev)
                        b_in, b_leaf = m64(pos, pos), m64.table
                    else:
                        b_leaf = bias.detach().to(dt).requires_grad_()
                        b_in = b_leaf
                    o, l = attention_reference(*leaves, b_in, mask, None, case["causal"], upcast=upcast)
                    o.backward(do.to(dt))
                    return [o, l] + [t.grad for t in leaves] + [b_leaf.grad]

                ref = full_run(torch.float64, True)
                plain = full_run(dtype, False)  # plain low-precision PyTorch: the yardstick

                def single_run():  # the same op on one GPU over the whole sequence: the second yardstick
                    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
                    if module is not None:
                        m1 = _RelBias(H).to(dev)
                        m1.load_state_dict(module.state_dict())
                        pos = torch.arange(L, device=dev)
                        b_in, b_leaf = m1(pos, pos), m1.table
                    else:
                        b_leaf = bias.detach().to(dtype).requires_grad_()
                        b_in = b_leaf
                    o1, l1 = attn_ops.attention(*leaves, b_in, mask, causal=case["causal"], backend=args.backend,
                                                return_lse=True)
                    o1.backward(do.to(dtype))
                    return [o1, l1] + [t.grad for t in leaves] + [b_leaf.grad]

                one = single_run()
                shard = lambda t, d=-2: shard_sequence(t, d, world, rank, case["layout"])  # noqa: E731
                ql, kl, vl = (shard(t).to(dtype).requires_grad_() for t in (q, k, v))
                if module is not None:
                    mod_r = _RelBias(H).to(dev)
                    mod_r.load_state_dict(module.state_dict())
                    b_arg = mod_r
                else:
                    b_arg = shard(bias).to(dtype).requires_grad_()
                o, l = ring_attention(ql, kl, vl, b_arg, mask, causal=case["causal"], layout=case["layout"],
                                      backend=args.backend, return_lse=True, kv_parts=case["parts"], grad_dtype=gdt,
                                      q_chunk=(L // world // case["q_div"]) if case["q_div"] else None)
                o.backward(shard(do).to(dtype))
                b_grad = (mod_r.table.grad if module is not None else b_arg.grad)
                if module is not None:
                    b_grad = b_grad.clone()
                    dist.all_reduce(b_grad)
                    ref_b, plain_b = ref[5], plain[5]
                else:
                    ref_b, plain_b = shard(ref[5]), shard(plain[5])
                got = [o, l, ql.grad, kl.grad, vl.grad, b_grad]
                ref_l = [shard(ref[0]), shard(ref[1], -1), shard(ref[2]), shard(ref[3]), shard(ref[4]), ref_b]
                plain_l = [shard(plain[0]), shard(plain[1], -1), shard(plain[2]), shard(plain[3]), shard(plain[4]),
                           plain_b]
                one_l = [shard(one[0]), shard(one[1], -1), shard(one[2]), shard(one[3]), shard(one[4]),
                         one[5] if module is not None else shard(one[5])]
                e_ring, e_plain, e_one = _errs(got, ref_l), _errs(plain_l, ref_l), _errs(one_l, ref_l)
                tol = registry.get(args.backend if args.backend != "auto" else "triton").tolerance.get(dtype, 2.0) \
                    if args.backend in registry.BACKENDS else 2.0
                rows = {}
                ok = ok_one = True
                for nme, er, ep, e1, r in zip(names, e_ring, e_plain, e_one, ref_l):
                    scale = max(r.double().abs().max().item(), 1.0)
                    t_e = torch.tensor([er, ep, e1], device=dev, dtype=torch.float64)
                    dist.all_reduce(t_e, op=dist.ReduceOp.MAX)
                    er, ep, e1 = t_e.tolist()
                    bound = tol * ep + 8 * ULP[dtype] * scale
                    bound_one = 2 * e1 + 8 * ULP[dtype] * scale
                    rows[nme] = dict(ring=er, plain_torch=ep, single_gpu_op=e1, bound=bound, ok=er <= bound,
                                     ok_vs_single=er <= bound_one)
                    ok &= er <= bound
                    ok_one &= er <= bound_one
                emit(args, rank, dict(kind="check", case=case["name"], dtype=str(dtype), grad_dtype=str(gdt),
                                      backend=args.backend, ok=ok, ok_vs_single_gpu_op=ok_one, errors=rows,
                                      seconds=round(time.time() - t0, 1)))


# --------------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------------
class _Dev:
    """CUDA timing and memory stats; on CPU (``--cpu`` smoke runs) wall time and zeros."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def allocated(self):
        return torch.cuda.memory_allocated() if self.cuda else 0

    def peak(self):
        return torch.cuda.max_memory_allocated() if self.cuda else 0


def _step_time(fn, iters, d: _Dev, barrier=True):
    times = []
    for _ in range(iters):
        if barrier:
            dist.barrier()
        d.sync()
        t0 = time.perf_counter()
        fn()
        d.sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_one(args, rank, world, dev, L, bias_kind, mode, parts=1, gdt=None, q_div=0):
    """mode "single": rank 0 alone on the full length; mode "ring": every rank on its shard."""
    H, D = args.heads, args.dim
    n = L if mode == "single" else L // world
    d = _Dev(dev)
    d.reset_peak()
    g = torch.Generator(device=dev).manual_seed(rank)
    q, k, v = (torch.randn(1, H, n, D, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    do = torch.randn(1, H, n, D, generator=g, device=dev, dtype=torch.bfloat16)
    bias = None
    if bias_kind == "pair":
        bias = torch.randn(1, H, n, L, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_()
    elif bias_kind == "keys":
        bias = torch.randn(1, H, 1, L, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_()

    def step():
        for t in (q, k, v, bias):
            if t is not None:
                t.grad = None
        if mode == "single":
            o = attn_ops.attention(q, k, v, bias, causal=True, backend=args.backend)
        else:
            o = ring_attention(q, k, v, bias, causal=True, layout="zigzag", backend=args.backend,
                               kv_parts=parts, grad_dtype=gdt, q_chunk=(n // q_div) if q_div else None)
        o.backward(do)

    sync = mode == "ring"
    step()  # warm-up (and kernel tuning)
    for t in (q, k, v, bias):
        if t is not None:
            t.grad = None
    d.sync()
    d.reset_peak()
    base = d.allocated()
    ms = _step_time(step, args.iters, d, barrier=sync)
    peak = d.peak()
    if sync:
        t = torch.tensor([ms, peak], device=dev, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms, peak = t[0].item(), int(t[1].item())
    del q, k, v, do, bias
    return dict(ms=round(ms, 2), tokens_per_s=round(L / (ms / 1e3)), peak_gib=round(peak / GiB, 3),
                inputs_gib=round(base / GiB, 3))


def bench(args, rank, world, dev, t_start):
    configs = [(L, b) for L in args.lengths for b in args.biases if b != "pair" or L <= args.max_pair_len]
    if args.oom_pair_len:
        configs.append((args.oom_pair_len, "pair"))  # a length whose dense pair bias does not fit one GPU
    variants = [(v.split(":") + ["0"])[:3] for v in args.variants]  # "parts:grad_dtype[:q_chunk divisor]"
    for L, bias_kind in configs:
        if time.time() - t_start > args.deadline:
            log(rank, f"deadline reached, skipping L={L} bias={bias_kind}")
            return
        rec = dict(kind="bench", L=L, bias=bias_kind, heads=args.heads, dim=args.dim, backend=args.backend)
        for parts, gname, qd in variants:
            gdt = None if gname == "float32" else getattr(torch, gname)
            name = f"ring_parts{parts}_{gname}" + (f"_qchunk_n/{qd}" if int(qd) else "")
            rec[name] = bench_one(args, rank, world, dev, L, bias_kind, "ring", int(parts), gdt, int(qd))
        single = None
        if rank == 0:  # after the ring runs, so that an OOM here cannot strand the other rank in a p2p op
            # A dense [1, H, L, L] bf16 bias and its gradient alone: do not launch what cannot fit (kernels with
            # such tiles also risk 32-bit offsets overflow).
            need = 2 * 2 * args.heads * L * L if bias_kind == "pair" else 0
            total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else float("inf")
            if need > total:
                single = f"does not fit: bias + its gradient need {need / GiB:.0f} GiB > {total / GiB:.0f} GiB"
            else:
                try:
                    single = bench_one(args, rank, world, dev, L, bias_kind, "single")
                except torch.cuda.OutOfMemoryError as exc:
                    single = f"OOM ({str(exc)[:120]})"
                _Dev(dev).reset_peak()
        dist.barrier()
        rec["single"] = single
        for key, r in rec.items():
            if key.startswith("ring_") and isinstance(single, dict):
                r["speedup"] = round(single["ms"] / r["ms"], 3)
                r["peak_ratio"] = round(r["peak_gib"] / max(single["peak_gib"], 1e-9), 3)
        emit(args, rank, rec)


def profile(args, rank, world, dev, L):
    """Kernel-time tables (rank 0) of one ring fwd+bwd step per variant, at length L without bias."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    path = os.path.join(os.path.dirname(os.path.abspath(args.out)), "profile.txt")
    n = L // world
    for v in args.variants:
        parts, gname, qd = (v.split(":") + ["0"])[:3]
        g = torch.Generator(device=dev).manual_seed(rank)
        q, k, v_, do = (torch.randn(1, args.heads, n, args.dim, generator=g, device=dev, dtype=torch.bfloat16)
                        for _ in range(4))
        for t in (q, k, v_):
            t.requires_grad_()

        def step():
            o = ring_attention(q, k, v_, causal=True, layout="zigzag", backend=args.backend, kv_parts=int(parts),
                               grad_dtype=None if gname == "float32" else getattr(torch, gname),
                               q_chunk=(n // int(qd)) if int(qd) else None)
            o.backward(do)

        d = _Dev(dev)
        step()
        d.sync()
        dist.barrier()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.cuda else [])
        with prof(activities=acts) as pr:
            step()
            d.sync()
        if rank == 0:
            with open(path, "a") as f:
                f.write(f"\n### L={L} variant {v} (rank 0)\n")
                f.write(pr.key_averages().table(sort_by="cuda_time_total" if d.cuda else "cpu_time_total",
                                                row_limit=18, max_name_column_width=60))
        del q, k, v_, do


def bench_torch_cp(args, rank, world, dev, t_start):
    """PyTorch's ``context_parallel`` (ring SDPA, no bias) on the same shapes, for a side-by-side row."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cuda", (world,))
    for L in args.lengths:
        if time.time() - t_start > args.deadline:
            log(rank, f"deadline reached, skipping torch context_parallel L={L}")
            return
        d = _Dev(dev)
        g = torch.Generator(device=dev).manual_seed(0)  # the same full tensors on every rank
        q, k, v, do = (torch.randn(1, args.heads, L, args.dim, generator=g, device=dev, dtype=torch.bfloat16)
                       for _ in range(4))
        rec = dict(kind="torch_context_parallel", L=L, heads=args.heads, dim=args.dim)
        try:
            with context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2]):
                # leaves over the sharded buffers (the buffers themselves are resized back on exit)
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

                def step():
                    for t in (qg, kg, vg):
                        t.grad = None
                    F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(do)

                step()
                d.sync()
                d.reset_peak()
                ms = _step_time(step, args.iters, d)
                peak = d.peak()
            t = torch.tensor([ms, peak], device=dev, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rec.update(ms=round(t[0].item(), 2), tokens_per_s=round(L / (t[0].item() / 1e3)),
                       peak_gib=round(t[1].item() / GiB, 3))
        except Exception as exc:  # report, do not crash the run
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        emit(args, rank, rec)
        del q, k, v, do


def report(path: str) -> str:
    """Markdown tables from a results file written by this script."""
    recs = [json.loads(x) for x in open(path) if x.strip().startswith("{")]
    lines = []
    for r in recs:
        if r["kind"] == "env":
            lines.append(f"- {r['world']} x {r['gpu']}, torch {r['torch']}, triton {r['triton']}, CUDA {r['cuda']}, "
                         f"inner backend `{r['backend']}` (lse_backward: `{r['backend_lse_backward']}`), {r['date']}, "
                         f"NCCL_NVLS_ENABLE={r['nccl_nvls']}")
    checks = [r for r in recs if r["kind"] == "check"]
    if checks:
        lines += ["", "| check (2 ranks) | dtype | grad_dtype | within 2x PyTorch | within 2x 1-GPU op | "
                  "ring err / PyTorch err / 1-GPU op err (out, lse, dq, dk, dv, dbias) |",
                  "|---|---|---|---|---|---|"]
        for r in checks:
            errs = "; ".join(f"{e['ring']:.1e}/{e['plain_torch']:.1e}/{e['single_gpu_op']:.1e}"
                             for e in r["errors"].values())
            lines.append(f"| {r['case']} | {r['dtype']} | {r['grad_dtype']} | {r['ok']} | "
                         f"{r['ok_vs_single_gpu_op']} | {errs} |")
    benches = [r for r in recs if r["kind"] == "bench"]
    if benches:
        lines += ["", "| L | bias | run | ms (fwd+bwd) | tokens/s | speed-up vs 1 GPU | peak GiB/GPU | peak vs 1 GPU |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in benches:
            s1 = r["single"]
            if isinstance(s1, dict):
                lines.append(f"| {r['L']} | {r['bias']} | 1 GPU | {s1['ms']} | {s1['tokens_per_s']} | 1 | "
                             f"{s1['peak_gib']} | 1 |")
            else:
                lines.append(f"| {r['L']} | {r['bias']} | 1 GPU | {s1} | | | | |")
            for key, x in r.items():
                if key.startswith("ring_"):
                    lines.append(f"| {r['L']} | {r['bias']} | 2 GPUs {key[5:]} | {x['ms']} | {x['tokens_per_s']} | "
                                 f"{x.get('speedup', '')} | {x['peak_gib']} | {x.get('peak_ratio', '')} |")
    tcp = [r for r in recs if r["kind"] == "torch_context_parallel"]
    if tcp:
        lines += ["", "| L | PyTorch context_parallel (2 GPUs, SDPA, no bias) | ms | tokens/s | peak GiB/GPU |",
                  "|---|---|---|---|---|"]
        for r in tcp:
            lines.append(f"| {r['L']} | {r.get('error', 'ok')} | {r.get('ms', '')} | {r.get('tokens_per_s', '')} | "
                         f"{r.get('peak_gib', '')} |")
    return "\n".join(lines)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_ring.jsonl")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--biases", nargs="+", default=["none", "pair", "keys"])
    ap.add_argument("--max-pair-len", type=int, default=32768)
    ap.add_argument("--variants", nargs="+", default=["1:float32", "4:float32", "4:bfloat16"],
                    help="ring variants as kv_parts:grad_dtype[:d] (d: q_chunk = local length / d)")
    ap.add_argument("--oom-pair-len", type=int, default=0, help="extra pair-bias length expected to OOM on 1 GPU")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--torch-cp", action="store_true", help="also time PyTorch's context_parallel (no bias)")
    ap.add_argument("--profile", action="store_true", help="kernel tables of one step per variant (profile.txt)")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU, for a smoke run of the script")
    ap.add_argument("--check-len", type=int, default=2048)
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds after which no new config starts")
    args = ap.parse_args()
    t_start = time.time()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu:  # smoke run of this script on gloo
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    else:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None

    lse_bwd = registry.get(args.backend).lse_backward if args.backend in registry.BACKENDS else None
    emit(args, rank, dict(kind="env", gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                          world=world, torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
                          backend=args.backend,
                          backend_lse_backward=lse_bwd,
                          date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          nccl_nvls=os.environ.get("NCCL_NVLS_ENABLE")))
    if args.check:
        check(args, rank, world, dev)
    if not args.no_bench:
        bench(args, rank, world, dev, t_start)
    if args.torch_cp:
        bench_torch_cp(args, rank, world, dev, t_start)
    if args.profile:
        profile(args, rank, world, dev, args.lengths[0])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
