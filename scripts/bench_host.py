"""Host time per call of the triton backend's launch path (Python: planning, allocations, launches).

    python scripts/bench_host.py                  # GPU: eager fwd+bwd wall time per call and the host share
    python scripts/bench_host.py --stub           # CPU or GPU: kernels replaced by no-ops, host time alone

``--stub`` replaces every compiled Triton kernel by a no-op (nothing is compiled or run), so it measures the launch
path's own Python cost anywhere, including a machine without a GPU (CPU tensors). Default shape: the triangle
``[1,256,4,256,32]`` (q ``[B, R, H, L, D]``), bf16 (fp32 with --stub on the CPU), pair bias ``[B, 1, H, L, L]`` and
key mask ``[B, R, 1, 1, L]``, forward + backward with gradients into q, k, v and bias.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stub_triton():
    """Every JITFunction launch returns a compiled kernel whose launch does nothing."""
    from triton.runtime.jit import JITFunction

    class _Compiled:
        def __getitem__(self, grid):
            return lambda *args: None

    compiled = _Compiled()
    JITFunction.run = lambda self, *args, grid, warmup, **kw: compiled


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,256,4,256,32", help="B,R,H,L,D")
    ap.add_argument("--stub", action="store_true", help="no-op kernels: the launch path's host time alone")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench_host.py measures compiled launches: unset TRITON_INTERPRET")
    import torch

    cuda = torch.cuda.is_available()
    if args.stub:
        _stub_triton()
        if not cuda:
            from attn_ops.triton import launch
            launch._device = lambda: 0
    from attn_ops import settings
    from attn_ops.triton import triton_attention

    if args.stub:
        settings.update(tune=False)
    B, R, H, L, D = (int(x) for x in args.shape.split(","))
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(dev, dtype).requires_grad_()

    q, k, v = rnd(B, R, H, L, D), rnd(B, R, H, L, D), rnd(B, R, H, L, D)
    bias = rnd(B, 1, H, L, L)
    mask = torch.ones(B, R, 1, 1, L, dtype=torch.bool, device=dev)
    mask[..., L - L // 8:] = False
    do = torch.randn(B, R, H, L, D, generator=g).to(dev, dtype)

    def step():
        out, lse = triton_attention(q, k, v, bias, mask, D ** -0.5, False)
        torch.autograd.grad((out,), (q, k, v, bias), (do,))

    for _ in range(5):  # tuning, compiles, cache fills
        step()
    if cuda:
        torch.cuda.synchronize()
    per_call, host, cpu = [], [], []
    for _ in range(args.repeats):
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(args.iters):
            step()
        t1, c1 = time.perf_counter(), time.thread_time()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / args.iters * 1e6)
        cpu.append((c1 - c0) / args.iters * 1e6)
        per_call.append((t2 - t0) / args.iters * 1e6)
    what = "stubbed kernels" if args.stub else "real kernels"
    print(f"[{B},{R},{H},{L},{D}] {str(dtype)[6:]} bias+mask fwd+bwd, {what} on {dev}: "
          f"host {statistics.median(host):.1f} us/call (Python returns), "
          f"cpu {statistics.median(cpu):.1f} us/call (this thread's CPU time: a shared host's other tenants and "
          f"preemption left out), "
          f"wall {statistics.median(per_call):.1f} us/call (median of {args.repeats} x {args.iters})")


if __name__ == "__main__":
    main()
