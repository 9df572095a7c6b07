"""Count and time the Triton compiles behind the triton backend's first calls, on any machine (no GPU needed).

    python scripts/compile_cost.py --lengths 300,301,320      # triangle + single attention at these N, in order
    python scripts/compile_cost.py --varlen 40                # the 40 lengths of `bench_blocks.py --varlen`
    python scripts/compile_cost.py --varlen 40 --no-tune      # the heuristic pick alone: one config per kernel

Triton's driver is replaced by a stand-in that reports an sm_90 (H100) target, so every kernel compiles for the GPU
(ptxas included, from the Triton wheel) and nothing runs; the tuner's timing is replaced by a constant (it keeps
the first candidate that compiles) and launches become compile-only. What it measures is the compile workload of
the first step at each length: which kernels compile, how many variants, and the wall time on this machine's
cores with ``--threads`` compile threads, as the tuner runs them (Triton's own cache starts empty unless
``--triton-cache`` names a folder). A new length compiles when it opens a new tuning key (length bucket) or
changes a specialisation (the EVEN_M / EVEN_N flags: the length is a multiple of a tile size).

The attention calls are those of a Pairformer block (bf16, in the blocks' layout: q, k, v are ``[*, H, L, C]`` views
of ``[*, L, H, C]`` memory): triangle attention q ``[1, N, 4, N, 32]`` with a pair bias ``[1, 1, 4, N, N]`` and a
key mask (the starting node; the ending node's mask is the transposed pair mask, whose key stride is N:
``triangle_end``), and the single track's attention with pair bias q
``[1, 16, N, 24]``, bias ``[1, 16, N, N]``; forward + backward with gradients into q, k, v and bias. Bias tiles take
pointer loads here (TMA descriptors need a real device): on an H100, steps of at least ``launch.STATE.tma_min_scores``
scores compile the descriptor variant instead.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from typing import Iterator, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = ("triangle", "triangle_end", "single")


class CompileOnlyDriver:
    """A stand-in for Triton's active driver that compiles for ``target`` (a ``GPUTarget``) and has no GPU."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def cross_compile(arch: int = 90, triton_cache: str = None) -> Iterator[List[dict]]:
    """Inside the block the triton backend compiles its kernels for sm_``arch`` and runs none; yields the list
    that each compile appends a record to (kernel name, the variant's constexprs, warps and stages). Everything
    patched is restored after the block."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from attn_ops import settings
    from attn_ops.triton import launch, tuning

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_cost measures real compiles: unset TRITON_INTERPRET")
    log: List[dict] = []
    real_compile = JITFunction._do_compile

    seen = set()

    def counted(self, *args, **kwargs):
        out = real_compile(self, *args, **kwargs)
        key = (self.fn.__name__, repr(kwargs.get("key", args[0] if args else None)))
        if key in seen:  # the same variant again (Triton's asynchronous mode hands back its pending compile)
            return out
        seen.add(key)
        # (key, signature, device, constexprs, options, ...) in Triton 3.x's JITFunction._do_compile
        constexprs = kwargs.get("constexprs", args[3] if len(args) > 3 else {})
        options = kwargs.get("options", args[4] if len(args) > 4 else None)
        names = [p.name for p in self.params]
        flags = {}
        for path, value in constexprs.items():
            index = path[0] if isinstance(path, tuple) and len(path) == 1 else path
            flags[names[index] if isinstance(index, int) and index < len(names) else index] = value
        log.append(dict(kernel=self.fn.__name__, flags=flags, num_warps=getattr(options, "num_warps", None),
                        num_stages=getattr(options, "num_stages", None)))
        return out

    saved_cache, saved_driver = knobs.cache.dir, getattr(driver, "_active", None)
    cache_dir = triton_cache or tempfile.mkdtemp(prefix="attn_zoo_compile_cost_")
    token = tuning._WARMUP_ONLY.set(True)
    patches = [(tuning, "measure", lambda fn, **kw: (fn(), 1.0)[1]), (tuning.TUNER, "picks", {}),
               (launch, "bound", lambda *a, **k: None), (launch.STATE, "plans", {}), (launch, "_device", lambda: 0),
               (JITFunction, "_do_compile", counted)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    before = settings.get()
    try:
        knobs.cache.dir = cache_dir
        driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
        for obj, name, value in patches:
            setattr(obj, name, value)
        settings.update(cache_dir=None)  # the on-disk tuning cache would skip candidates: keep this run's own
        yield log
    finally:
        settings._current = before
        for obj, name, value in saved:
            setattr(obj, name, value)
        driver._active = saved_driver  # (reset_active would build the default driver: none without a GPU)
        knobs.cache.dir = saved_cache
        tuning._WARMUP_ONLY.reset(token)
        if triton_cache is None:
            shutil.rmtree(cache_dir, ignore_errors=True)


def attention_inputs(kind: str, n: int):
    """The leaves and call arguments of one Pairformer attention call at length ``n`` (CPU tensors, bf16)."""
    import torch

    def leaf(*shape):
        return torch.empty(shape, dtype=torch.bfloat16).normal_().requires_grad_()

    mask = torch.ones(n, dtype=torch.bool)
    mask[n - max(1, n // 10):] = False  # key padding
    # q, k, v in the blocks' layout: heads split out of a projection [*, L, H*C] and made dense by the op, i.e.
    # [*, H, L, C] views of [*, L, H, C] memory (strides that do not depend on N beyond the batch dims)
    if kind in ("triangle", "triangle_end"):
        q, k, v = (leaf(1, n, n, 4, 32).transpose(2, 3) for _ in range(3))
        bias = leaf(1, 1, 4, n, n)
        if kind == "triangle":
            return (q, k, v, bias), mask.view(1, 1, 1, 1, n).expand(1, n, 1, 1, n)
        pair = mask[:, None] & mask[None, :]
        return (q, k, v, bias), pair.t()[None, :, None, None, :]  # key stride N
    if kind == "single":
        q, k, v = (leaf(1, n, 16, 24).transpose(1, 2) for _ in range(3))
        bias = leaf(1, 16, n, n)
        return (q, k, v, bias), mask.view(1, 1, 1, n)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def step(kind: str, n: int) -> None:
    """One forward + backward of the triton backend at ``kind``, length ``n`` (inside :func:`cross_compile`)."""
    import torch

    from attn_ops.triton import triton_attention

    (q, k, v, bias), mask = attention_inputs(kind, n)
    out, lse = triton_attention(q, k, v, bias, mask, q.shape[-1] ** -0.5, False)
    torch.autograd.grad((out,), (q, k, v, bias), (torch.zeros_like(out),))  # (q, k, v: views, grads of the leaves)


@contextlib.contextmanager
def _ahead(threads: int):
    """``compile_ahead`` inside :func:`cross_compile`: launches submit compiles instead of the stand-in's
    compile-only launches."""
    from attn_ops.triton import tuning

    token = tuning._WARMUP_ONLY.set(False)
    try:
        with tuning.compile_ahead(threads):
            yield
    finally:
        tuning._WARMUP_ONLY.reset(token)


def run(lengths: Sequence[int], kinds: Sequence[str] = KINDS, tune: bool = True, threads: int = 8,
        arch: int = 90, triton_cache: str = None, ahead: bool = False) -> Tuple[List[dict], dict]:
    """(per length: dict(n, wall_s, compiles, by_kernel (Counter), records); totals: dict(binaries in Triton's cache
    at the end)), with the tuner's settings as given. ``ahead``: the lengths' steps run first under
    ``attn_ops.compile_ahead()`` (rows with ``which`` "ahead"), then as usual ("after"; else "plain")."""
    from triton import knobs

    from attn_ops import settings

    rows = []
    with settings.kernel_settings(tune=tune, compile_threads=threads), cross_compile(arch, triton_cache) as log:
        for which in ["ahead", "after"] if ahead else ["plain"]:
            for n in lengths:
                start, t0 = len(log), time.perf_counter()
                with _ahead(threads) if which == "ahead" else contextlib.nullcontext():
                    for kind in kinds:
                        step(kind, n)
                records = log[start:]
                rows.append(dict(n=n, wall_s=time.perf_counter() - t0, compiles=len(records), which=which,
                                 by_kernel=Counter(r["kernel"] for r in records), records=records))
        # folders holding a compiled kernel's group file (a cache lookup may leave an empty folder)
        totals = dict(binaries=sum(1 for entry in os.scandir(knobs.cache.dir) if entry.is_dir() and
                                   any(f.startswith("__grp__") for f in os.listdir(entry.path))))
    return rows, totals


def table(rows: Sequence[dict]) -> str:
    lines = ["| N | new compiles | wall s | kernels (variants) | EVEN_M / EVEN_N variants |", "|---|---|---|---|---|"]
    for r in rows:
        kernels = ", ".join(f"{_short(k)} {c}" for k, c in sorted(r["by_kernel"].items()))
        lines.append(f"| {r['n']} | {r['compiles']} | {r['wall_s']:.1f} | {kernels or '-'} | {even_variants(r)} |")
    lines.append(f"| all | {sum(r['compiles'] for r in rows)} | {sum(r['wall_s'] for r in rows):.1f} | | "
                 f"{sum(even_variants(r) for r in rows)} |")
    return "\n".join(lines)


def _short(kernel: str) -> str:
    return kernel.replace("attn_", "").replace("_kernel", "")


def even_variants(row: dict) -> int:
    """Compiles of a length's row that specialise on a tile dividing the length (EVEN_M or EVEN_N set)."""
    return sum(1 for x in row["records"] if x["flags"].get("EVEN_M") or x["flags"].get("EVEN_N"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="comma-separated N, run in this order")
    src.add_argument("--varlen", type=int, metavar="COUNT", help="the first COUNT lengths of bench_blocks --varlen")
    ap.add_argument("--varlen-seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"attention calls per length, from {KINDS}")
    ap.add_argument("--no-tune", action="store_true", help="settings.tune False: the first candidate, no timing")
    ap.add_argument("--threads", type=int, default=8, help="settings.compile_threads")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90: H100/H200)")
    ap.add_argument("--triton-cache", help="Triton's cache folder (default: a new empty one, i.e. a cold start)")
    ap.add_argument("--ahead", action="store_true",
                    help="run the lengths under attn_ops.compile_ahead() first, then as usual (two tables)")
    args = ap.parse_args(argv)
    if args.varlen is not None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_blocks import varlen_lengths

        lengths = varlen_lengths(args.varlen, args.varlen_seed)
    else:
        try:
            lengths = [int(x) for x in args.lengths.split(",")]
        except ValueError:
            ap.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    kinds = args.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"--kinds: unknown {bad}; known: {list(KINDS)}")
    rows, totals = run(lengths, kinds, tune=not args.no_tune, threads=args.threads, arch=args.arch,
                       triton_cache=args.triton_cache, ahead=args.ahead)
    import triton

    print(f"compiles for sm_{args.arch} (triton {triton.__version__}, {os.cpu_count()} CPUs, "
          f"tune={not args.no_tune}, compile_threads={args.threads}, "
          f"kinds={','.join(kinds)})")
    for which in dict.fromkeys(r["which"] for r in rows):
        if which != "plain":
            print(f"{which} compile_ahead():")
        print(table([r for r in rows if r["which"] == which]))
    print(f"binaries in Triton's cache: {totals['binaries']}")


if __name__ == "__main__":
    main()
