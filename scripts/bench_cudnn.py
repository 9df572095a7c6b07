"""The ``cudnn`` backend (cuDNN's deterministic backward) beside triton and PyTorch's own cuDNN, on a GPU.

    python scripts/bench_cudnn.py                 # both sets (needs nvidia-cudnn-frontend; ~3 min on an H200)
    python scripts/bench_cudnn.py --set op        # the op around auto's rule: head dims 64 / 128, 2048-8192 keys
    python scripts/bench_cudnn.py --set esm2      # ESM-2 650M eager training steps, triton vs cudnn vs fair-esm

``op``: bf16 ``[B, H, L, D]`` head-split views of ``[B, L, H, D]`` memory, no bias or mask; fwd+bwd median
(``triton.testing.do_bench``) of the triton backend, the cudnn backend (deterministic) and ``scaled_dot_product_attention``
on ``SDPBackend.CUDNN_ATTENTION`` (not deterministic); the pick of ``auto`` under the default workspace bound; cuDNN's
first call at the shape (graph building); the extra peak memory of a step. ``esm2``: the model of
``bench_esm2.py`` (fair-esm's random init) built twice, on triton and on cudnn, and fair-esm itself, stepped in 5
alternating rounds of 8 steps in one process (no padding, so no key mask: the batches the cudnn backend takes), with
each attn-zoo variant's device time and attention kernels' share in one profiled step. Writes ``cudnn_op.md`` /
``cudnn_esm2.md`` to ``--out`` (default ``$OUT`` or ``bench_out``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OP_SHAPES = [(4, 16, 2048, 128, False), (4, 16, 2048, 128, True), (1, 16, 4096, 128, True),
             (1, 16, 4096, 128, False), (2, 16, 4096, 128, False), (1, 32, 4096, 128, True),
             (1, 16, 8192, 128, True), (1, 16, 8192, 128, False), (1, 16, 8192, 64, True), (1, 16, 8192, 64, False)]
# kernel names of the attention in a profiled step: triton's, cuDNN's
ATTENTION_KERNELS = ("attn", "sdpa", "cudnn", "bwd_preprocess")


def header(title):
    return [f"# {title} ({torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC)", ""]


def op_set():
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attn_ops
    from attn_ops import registry
    from attn_ops.inputs import describe

    lines = header("cudnn backend around auto's rule") + [
        "| shape | causal | auto picks | triton ms | cudnn ms | sdpa cudnn (not det.) ms | cudnn first call s | "
        "peak triton / cudnn GiB |", "|---|---|---|---|---|---|---|---|"]
    for B, H, L, D, causal in OP_SHAPES:
        q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                   for _ in range(3))
        d_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
        pick = registry.select("auto", describe(q, k, v, None, None, causal, False, True)).name

        def step(backend):
            if backend == "sdpa cudnn":
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            else:
                out = attn_ops.attention(q, k, v, causal=causal, backend=backend)
            torch.autograd.grad(out, (q, k, v), d_out)

        cells = {}
        for backend in ("triton", "cudnn", "sdpa cudnn"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(backend)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            attn_ops.wait_compiles()
            torch.cuda.reset_peak_memory_stats()  # one step's peak, outside do_bench (its L2-flush buffer)
            base = torch.cuda.memory_allocated()
            step(backend)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            ms = triton.testing.do_bench(lambda: step(backend), warmup=5, rep=60, return_mode="median")
            cells[backend] = (ms, first, peak)
        t, c, s = cells["triton"], cells["cudnn"], cells["sdpa cudnn"]
        lines.append(f"| [{B},{H},{L},{D}] | {causal} | {pick} | {t[0]:.3f} | {c[0]:.3f} | {s[0]:.3f} | {c[1]:.2f} | "
                     f"{t[2]:.2f} / {c[2]:.2f} |")
        print(lines[-1], flush=True)
    return lines


def esm2_set(rounds=5, steps=8):
    import bench_esm2 as esm
    from bench_patch import Timer, alternate
    from torch.profiler import ProfilerActivity, profile

    from attn_zoo.models.zoo import from_fair_esm

    models = esm.build_models("650M", ["attn-zoo", "fair-esm"], "triton")
    models["attn-zoo cudnn"] = from_fair_esm(models["fair-esm"].state_dict(), attention="cudnn")
    for m in models.values():
        m.cuda().train()
    lines = header("ESM-2 650M eager training step on the triton and the cudnn backend")
    for batch, length in ((4, 1024), (8, 512)):
        tokens, target, masked = esm.mlm_batch(batch, length, "cuda")
        fns = {n: esm.forward_fn("fair-esm" if n == "fair-esm" else "attn-zoo", m) for n, m in models.items()}
        peaks = {}
        for n, m in models.items():
            for _ in range(3):
                esm.train_step(fns[n], m, tokens, target, masked)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            esm.train_step(fns[n], m, tokens, target, masked)
            torch.cuda.synchronize()
            peaks[n] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        times = alternate(Timer(torch.device("cuda"), steps, 1), [
            (n, lambda: None, lambda n=n: esm.train_step(fns[n], models[n], tokens, target, masked)) for n in models],
            rounds)
        device = {}
        for n in ("attn-zoo", "attn-zoo cudnn"):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                esm.train_step(fns[n], models[n], tokens, target, masked)
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            attention = [e for e in kernels if any(s in e.name.lower() for s in ATTENTION_KERNELS)]
            device[n] = (sum(e.device_time for e in kernels) / 1e3, sum(e.device_time for e in attention) / 1e3)
        lines += [f"## {batch} x {length}", "", "| model | ms (median of rounds) | fastest - slowest round | "
                  "peak GiB | device ms (attention) |", "|---|---|---|---|---|"]
        for n in models:
            dev = f"{device[n][0]:.1f} ({device[n][1]:.1f})" if n in device else ""
            ms, lo, hi = times[n]
            lines.append(f"| {n} | {ms:.2f} | {lo:.1f} - {hi:.1f} | {peaks[n]:.2f} | {dev} |")
        lines.append("")
        print("\n".join(lines[-len(models) - 5:]), flush=True)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=["op", "esm2", "all"], default="all")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_cudnn.py needs a CUDA device")
    import attn_ops

    if "cudnn" not in attn_ops.backends():
        sys.exit(f"the cudnn backend is unavailable: {attn_ops.registry.get('cudnn').unavailable_reason()}")
    os.makedirs(args.out, exist_ok=True)
    for name, run in (("op", op_set), ("esm2", esm2_set)):
        if args.set in (name, "all"):
            with open(os.path.join(args.out, f"cudnn_{name}.md"), "w") as f:
                f.write("\n".join(run()) + "\n")


if __name__ == "__main__":
    main()
