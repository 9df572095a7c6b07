"""Whether each SDPA kernel's backward is bitwise reproducible on this GPU: repeat one fwd+bwd and compare.

    python scripts/check_sdpa_determinism.py --repeats 20     # GPU: a table of identical / differing runs

For each shape and mask (none, key padding, causal) and each of PyTorch's SDPA kernels (cuDNN, flash, efficient)
the same inputs run ``--repeats`` times; a run counts as identical when its output and dq, dk, dv are bitwise
equal to the first run's. Between runs other work is put on the GPU (a matmul of changing size), so that a
backward whose result depends on the order in which thread blocks finish shows it. A kernel that is identical
on every run of every shape is a candidate for the deterministic no-bias path; one differing run rules it out.

``--cudnn-backend`` adds a column for this project's ``cudnn`` backend, which asks cuDNN (through NVIDIA's cuDNN
frontend) for its deterministic backward.

``--torch-deterministic`` runs everything under ``torch.use_deterministic_algorithms(True)``, the switch PyTorch's
flash backward reads to take its deterministic path and the efficient kernel to use one key split (cuDNN refuses
or ignores it); each cell then also gives the kernel's fwd+bwd median ms in that mode, beside this project's
triton kernel (deterministic backward) on the same inputs.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = ((4, 20, 1024, 64), (4, 18, 1024, 64), (2, 16, 2048, 128), (1, 16, 4096, 64), (3, 8, 777, 64),
          (1, 16, 16384, 128))


def run_once(kernel, q, k, v, mask, causal, do):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([kernel]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return [out.detach().clone()] + [g.clone() for g in grads]


def run_cudnn_backend(q, k, v, mask, causal, do):
    """This project's cudnn backend: cuDNN asked for its deterministic backward (no mask; the workspace bound
    lifted, as a call that names the backend may)."""
    import attn_ops

    if mask is not None:
        raise RuntimeError("takes no mask")
    with attn_ops.kernel_settings(cudnn_workspace_gib=1024):
        out = attn_ops.attention(q, k, v, causal=causal, backend="cudnn")
    grads = torch.autograd.grad(out, (q, k, v), do)
    return [out.detach().clone()] + [g.clone() for g in grads]


def run_triton(q, k, v, mask, causal, do):
    import attn_ops

    out = attn_ops.attention(q, k, v, mask=None if mask is None else mask[:, :, 0, :], causal=causal,
                             backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), do)
    return [out.detach()] + list(grads)


def median_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def main():
    from torch.nn.attention import SDPBackend

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--shapes", nargs="+", default=None, metavar="B,H,L,D", help="instead of the default shapes")
    ap.add_argument("--masks", nargs="+", default=["none", "key", "causal"], choices=["none", "key", "causal"])
    ap.add_argument("--cudnn-backend", action="store_true",
                    help="also this project's cudnn backend (cuDNN's deterministic backward; nvidia-cudnn-frontend)")
    ap.add_argument("--torch-deterministic", action="store_true",
                    help="run under torch.use_deterministic_algorithms(True) and time each kernel")
    args = ap.parse_args()
    if args.torch_deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (the noise matmul needs it in this mode)
    kernels = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if args.cudnn_backend:
        kernels["cudnn backend"] = "backend"
    lines = [f"# SDPA backward reproducibility ({torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
             f"cuDNN {torch.backends.cudnn.version()}, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC)", "",
             f"identical runs of {args.repeats} (output, dq, dk, dv bitwise equal to the first run), bf16"
             + (", under torch.use_deterministic_algorithms(True); ms = fwd+bwd median" if args.torch_deterministic
                else ""), "",
             "| shape | mask | " + " | ".join(kernels) + (" | triton ms |" if args.torch_deterministic else " |"),
             "|---|---|" + "---|" * (len(kernels) + args.torch_deterministic)]
    noise = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes] if args.shapes else SHAPES
    for B, H, L, D in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = [torch.randn(B, L, H, D, generator=g).to("cuda", torch.bfloat16).transpose(1, 2).requires_grad_()
                   for _ in range(3)]
        do = torch.randn(B, H, L, D, generator=g).to("cuda", torch.bfloat16)
        lengths = torch.randint(L // 3, L + 1, (B,), generator=g)
        key = (torch.arange(L)[None] < lengths[:, None])[:, None, None, :].cuda()
        for mask_name, mask, causal in (("none", None, False), ("key", key, False), ("causal", None, True)):
            if mask_name not in args.masks:
                continue
            cells = []
            for name, kernel in kernels.items():
                if name in ("flash", "cudnn backend") and mask is not None:
                    cells.append("-")
                    continue
                once = run_cudnn_backend if kernel == "backend" else functools.partial(run_once, kernel)
                try:
                    first = once(q, k, v, mask, causal, do)
                    same = 1
                    for i in range(1, args.repeats):
                        n = 512 + 256 * (i % 8)
                        noise[:n, :n] @ noise[:n, :n]  # other work in flight: changes block scheduling
                        again = once(q, k, v, mask, causal, do)
                        same += all(torch.equal(a, b) for a, b in zip(first, again))
                    cell = f"{same}/{args.repeats}"
                    if args.torch_deterministic:
                        cell += f", {median_ms(lambda: once(q, k, v, mask, causal, do)):.3f} ms"
                    cells.append(cell)
                except RuntimeError as exc:  # the kernel refuses these inputs
                    cells.append(f"refused: {str(exc).splitlines()[0][:50]}")
            if args.torch_deterministic:
                try:
                    cells.append(f"{median_ms(lambda: run_triton(q, k, v, mask, causal, do)):.3f}")
                except RuntimeError as exc:
                    cells.append(f"failed: {str(exc).splitlines()[0][:50]}")
            lines.append(f"| [{B},{H},{L},{D}] | {mask_name} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sdpa_determinism.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
