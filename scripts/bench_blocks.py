"""Benchmark the Evoformer and Pairformer blocks per attention backend, next to Boltz-2's PairformerLayer.

One training step (forward + backward, train mode with dropout, bf16 autocast, fp32 parameters and inputs
that require grad) per case; median step time over ``--iters`` steps after warm-up, and the extra peak
device memory of one step beyond parameters and inputs (gradients included). Writes ``blocks.csv`` and
``blocks.md`` (table + environment) to ``--out`` (default ``$OUT`` or ``bench_out``), row by row, so a run
cut short still leaves its results. ``--breakdown CASE...`` first times every sub-module of the
triton-backend block (where the block's time goes).

    python scripts/bench_blocks.py                      # the default cases and backends (H100: ~5-7 min)
    python scripts/bench_blocks.py --cases pair384 --backends triton torch --breakdown pair384
    python scripts/bench_blocks.py --cases pair384 --backends triton+compile --compile-mode reduce-overhead
    python scripts/bench_blocks.py --cases pair384 pair299 --backends triton+compile --compile-dynamic
    python scripts/bench_blocks.py --cases pair299 pair767 --backends boltz-cueq triton triton+compile --isolate
    python scripts/bench_blocks.py --varlen             # 40 new lengths in a row: per-step times, compile + tune
    python scripts/bench_blocks.py --cases pair384 pair447 --backends boltz-cueq triton triton+graphs --rounds 5

``--rounds R``: after the table, the eager rows of each case again, all built at once and timed in turns (R rounds
of ``--iters`` steps, the order rotating by round), so that a drift of the host's speed within the process, which
moves host-bound steps by up to 25%, falls on every row alike (``alternating`` rows).

``--varlen``: one PairformerBlock (c_s 384, c_z 128) per backend, eager, stepping through ``--varlen-count``
distinct random lengths in [180, 520] (``--varlen-seed``); each length runs 3 fwd+bwd steps: the first includes any
compile / tuning at that length, steady = the faster of the other two. Each backend runs in a fresh process of its
own (no backend inherits another's compiled kernels or cuBLAS's per-shape heuristics). Writes ``varlen.csv`` and ``varlen.md``.
A fresh process with ``ATTN_ZOO_CACHE_DIR`` at an empty folder measures cold tuning; run it again for a warm cache.
``--varlen-multiple M`` pads every length to a multiple of M (masked, as ``data.length_multiple`` does);
``--varlen-warmup`` first runs one step at each padded length of the range (its time counts as compile + tune).

    python scripts/bench_blocks.py --varlen --varlen-backends triton --varlen-multiple 32 --varlen-warmup

Boltz-2 (``boltz.model.layers.pairformer.PairformerLayer``) and cuequivariance are optional imports
(see ../shared/anchor-wheels/README.md); rows for them are skipped with the reason if they do not import.
On the GPU machine install them into a folder of your own (a shared ``.site`` may hold other versions,
and ``pip --target`` silently keeps what is there), and run pytest without it on the path (its
``platformdirs`` registers a pytest plugin that fails to load):

    mkdir -p .site_blocks && python3 -m pip install -q --upgrade --no-index --no-deps --target .site_blocks \
        .peers/*.whl && tar xJf .peers/cue.tar.xz -C .site_blocks
    python -m pytest tests/test_pairformer.py tests/test_evoformer.py -m gpu -q
    PYTHONPATH=$PWD/.site_blocks python scripts/bench_blocks.py --breakdown pair384 pair768 --profile pair384
"""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attn_ops  # noqa: E402
from attn_ops import wait_compiles  # noqa: E402
from attn_zoo.models.graphs import CUDAGraphs  # noqa: E402
from attn_zoo.models.evoformer import EvoformerBlock  # noqa: E402
from attn_zoo.models.pairformer import PairformerBlock  # noqa: E402
from attn_zoo.models.shapes import round_up  # noqa: E402

GIB = 2.0 ** 30
PADDED = 13  # padded residues at the end of every sequence (real masks, not all-True)

# name: (block, N_res, N_seq)
CASES = {
    "evo256": ("evoformer", 256, 128),
    "evo384": ("evoformer", 384, 128),
    "pair384": ("pairformer", 384, None),
    "pair768": ("pairformer", 768, None),
    "pair299": ("pairformer", 299, None),  # an odd crop length (13 of it padded, as every case)
    "pair767": ("pairformer", 767, None),  # an odd length near 768 (rows of its [N, N] matrices not 16-byte aligned)
    "pair447": ("pairformer", 447, None),  # an odd crop with 21 of it padded
}
PADDED_OF = {"pair447": 21}  # cases whose padding is not PADDED
BACKENDS = ("triton", "triton+compile", "triton+graphs", "triton-atomic", "triton-atomic+compile", "flex",
            "flex+compile", "sdpa", "torch", "torch+compile", "boltz", "boltz-cueq")
# "triton+compile": torch.compile of the whole triton-backend block (Inductor fuses the glue around the op)
# "triton+graphs": the eager triton-backend block replayed as CUDA graphs (models.graphs.CUDAGraphs: captured at the
#   first step; no compile), what a fixed crop size allows
# "triton-atomic": the triton backend with deterministic=False (the pair bias's gradient summed by atomics)
# flex's bias gradient and sdpa's CUDA backward use atomics: allowed explicitly
BACKEND_OPTIONS = {"flex": {"deterministic": False}, "sdpa": {"deterministic": False},
                   "triton-atomic": {"deterministic": False}}


def attention_config(backend: str) -> dict:
    """The blocks' ``attention`` config of a bench backend name (``+compile`` stripped)."""
    name = backend.split("+")[0]
    return {"backend": name.split("-")[0], **BACKEND_OPTIONS.get(name, {})}


# ------------------------------------------------------------------------------------------------
# inputs and steps
# ------------------------------------------------------------------------------------------------
def _masks(n: int, dev, width: int | None = None, padded: int = PADDED):
    """Single [1, W] and pair [1, W, W] masks of a length-``n`` sequence whose last ``padded`` residues are padding,
    padded on to ``width`` (default ``n``)."""
    real = torch.arange(n if width is None else width, device=dev) < n - padded  # [W]
    single = real[None].clone()  # [1, N]
    pair = single[:, :, None] & single[:, None, :]  # [1, N, N]
    return single, pair


def build_case(case: str, backend: str, dev, compile_mode: str | None = None, dynamic: bool = False):
    """(module, float inputs requiring grad, forward callable); ``compile_mode`` and ``dynamic`` go to
    ``torch.compile``. ``dynamic`` False: compiled for this length alone, whatever the process compiled before
    (torch.compile's default, None, recompiles for symbolic lengths once the code has met a second length).
    True: symbolic lengths, the kernels a run over many lengths ends up with."""
    kind, n, s_rows = CASES[case]
    single, pair = _masks(n, dev, padded=PADDED_OF.get(case, PADDED))
    g = torch.Generator(device=dev).manual_seed(0)
    if backend in ("boltz", "boltz-cueq"):
        if kind != "pairformer":
            raise NotImplementedError("Boltz has no Evoformer block")
        try:
            from boltz.model.layers.pairformer import PairformerLayer
        except ImportError as exc:
            import importlib.util

            spec = importlib.util.find_spec("boltz")
            raise ImportError(f"{exc} (boltz found at {spec.origin if spec else None})") from exc

        mod = PairformerLayer(384, 128, num_heads=16, dropout=0.25, pairwise_head_width=32, pairwise_num_heads=4,
                              v2=True).to(dev)
        s = torch.randn(1, n, 384, device=dev, generator=g, requires_grad=True)
        z = torch.randn(1, n, n, 128, device=dev, generator=g, requires_grad=True)
        use = backend == "boltz-cueq"
        fwd = lambda: mod(s, z, single.float(), pair.float(), use_kernels=use)  # noqa: E731
        return mod, [s, z], fwd
    attention = attention_config(backend)
    if kind == "evoformer":
        mod = EvoformerBlock(c_m=256, c_z=128, attention=attention).to(dev)
        m = torch.randn(1, s_rows, n, 256, device=dev, generator=g, requires_grad=True)
        z = torch.randn(1, n, n, 128, device=dev, generator=g, requires_grad=True)
        msa_mask = single[:, None, :].expand(1, s_rows, n).clone()  # [1, S, N]
        x, masks = [m, z], (msa_mask, pair)
    else:
        mod = PairformerBlock(c_s=384, c_z=128, attention=attention).to(dev)
        s = torch.randn(1, n, 384, device=dev, generator=g, requires_grad=True)
        z = torch.randn(1, n, n, 128, device=dev, generator=g, requires_grad=True)
        x, masks = [s, z], (single, pair)
    # the whole block, as a user would compile it, or in CUDAGraphs (captured at the first step, replayed after)
    run = torch.compile(mod, mode=compile_mode, dynamic=dynamic) if backend.endswith("+compile") else \
        CUDAGraphs(mod) if backend.endswith("+graphs") else mod
    fwd = lambda: run(*x, *masks)  # noqa: E731
    return mod, x, fwd


def _randomize(mod: torch.nn.Module):
    """AF2's zero-init final layers would make the attention's gradients vanish; use random weights."""
    with torch.no_grad():
        for p in mod.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)


def train_step(mod, inputs, fwd):
    """One training step of ``mod`` (train mode): gradients to None, ``fwd()`` under bf16 autocast, backward of
    fixed random upstream gradients (drawn at the first call, kept in ``step.grads_out``)."""
    mod.train()

    def step():
        mod.zero_grad(set_to_none=True)
        for t in inputs:
            t.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = fwd()
        if step.grads_out is None:
            step.grads_out = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, step.grads_out)

    step.grads_out = None
    return step


def measure(mod, inputs, fwd, iters: int, warmup: int, graph_pool: bool = False):
    """Median ms of one fwd+bwd step and its extra peak memory (GiB) beyond params and inputs.

    Runs ``max(warmup, 1)`` warm-up steps, one step for the peak memory, then ``iters`` timed steps.
    ``graph_pool``: the step runs as CUDA graphs, whose private memory pool counts in the peak (below).
    """
    step = train_step(mod, inputs, fwd)

    # Baselines before the first step. The peak is (a) allocated memory at its high point in one step, and with
    # CUDA graphs the larger of (a) and (b) memory that stays reserved between steps after the cache is emptied:
    # the graphs' private pool (torch.compile mode="reduce-overhead") holds the step's tensors outside (a).
    mod.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    base_reserved = torch.cuda.memory_reserved()
    for _ in range(max(warmup, 1)):
        step()
    torch.cuda.synchronize()
    if wait_compiles() > 1e-3:  # EVEN variants of a tile-multiple length were compiling: one more step keeps them
        step()
        torch.cuda.synchronize()
    upstream = sum(g.numel() * g.element_size() for g in step.grads_out)  # the upstream gradients are inputs too
    base += upstream
    mod.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    torch.cuda.empty_cache()
    pool = torch.cuda.memory_reserved() - base_reserved - upstream
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = max(torch.cuda.max_memory_allocated() - base, pool if graph_pool else 0) / GIB
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), peak


# ------------------------------------------------------------------------------------------------
# sub-module breakdown (where the block's time goes)
# ------------------------------------------------------------------------------------------------
def attention_alone(shape: str, n: int, dev, backend, iters, warmup):
    """The attention op alone, bf16, gradients into q, k, v and bias, 13 padded keys:
    ``triangle``: q, k, v ``[1, N, 4, N, 32]``, bias ``[1, 1, 4, N, N]`` shared over rows, mask ``[1, N, 1, 1, N]``;
    ``single``: q, k, v ``[1, 16, N, 24]``, bias ``[1, 16, N, N]``, mask ``[1, 1, 1, N]`` (AttentionPairBias)."""
    import attn_ops

    g = torch.Generator(device=dev).manual_seed(1)
    single, pair = _masks(n, dev)
    if shape == "triangle":
        qkv_shape, bias_shape, mask = (1, n, 4, n, 32), (1, 1, 4, n, n), pair[:, :, None, None, :]
    else:
        qkv_shape, bias_shape, mask = (1, 16, n, 24), (1, 16, n, n), single[:, None, None, :]
    q, k, v = (torch.randn(qkv_shape, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    bias = torch.randn(bias_shape, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    opts = attention_config(backend)
    holder = torch.nn.Module()
    ms, peak = measure(holder, [q, k, v, bias], lambda: (attn_ops.attention(q, k, v, bias, mask, **opts),),
                       iters, warmup)
    return (f"attention op alone, {shape} shape", ms, peak)


def breakdown(case: str, dev, iters: int, warmup: int, backend: str = "triton"):
    """(sub-module, ms fwd+bwd, peak GiB) for the block of ``case`` with ``backend``."""
    mod, (x, z), _ = build_case(case, backend, dev)
    _randomize(mod)
    kind = CASES[case][0]
    single, pair = _masks(CASES[case][1], dev, padded=PADDED_OF.get(case, PADDED))
    parts = [(name, getattr(mod, name), lambda m: m(z, pair))
             for name in ("tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end")]
    parts.append(("pair_transition", mod.pair_transition, lambda m: m(z)))
    if kind == "evoformer":
        msa_mask = single[:, None, :].expand(*x.shape[:-1]).clone()
        parts = [
            ("msa_row_attention", mod.msa_row_attention, lambda m: m(x, z, msa_mask)),
            ("msa_column_attention", mod.msa_column_attention, lambda m: m(x, msa_mask)),
            ("msa_transition", mod.msa_transition, lambda m: m(x)),
            ("outer_product_mean", mod.outer_product_mean, lambda m: m(x, msa_mask)),
        ] + parts
    else:
        parts += [
            ("attention_pair_bias", mod.attention_pair_bias, lambda m: m(x, z, single)),
            ("single_transition", mod.single_transition, lambda m: m(x)),
        ]
    rows = [attention_alone("triangle", CASES[case][1], dev, backend, iters, warmup)]
    if kind == "pairformer":
        rows.append(attention_alone("single", CASES[case][1], dev, backend, iters, warmup))
    for name, sub, call in parts:
        ms, peak = measure(sub, [x, z], lambda sub=sub, call=call: (call(sub),), iters, warmup)
        rows.append((name, ms, peak))
    return rows


def kernel_profile(case: str, dev, path: str, backend: str = "triton", steps: int = 3,
                   compile_mode: str | None = None, rows: int = 40) -> None:
    """torch.profiler over ``steps`` fwd+bwd steps of the block: the top CUDA kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    if steps < 2:
        raise ValueError(f"kernel_profile needs steps >= 2 (a warm-up and a peak-memory step), got {steps}")
    mod, inputs, fwd = build_case(case, backend, dev, compile_mode)
    _randomize(mod)
    measure(mod, inputs, fwd, iters=1, warmup=2)  # warm-up, autotuning
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        measure(mod, inputs, fwd, iters=steps - 2, warmup=0)  # one warm-up + one peak step + the timed ones
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=rows, max_name_column_width=90)
    with open(path, "w") as f:
        f.write(f"# {case}, backend {backend} (compile mode {compile_mode}): {steps} fwd+bwd steps, "
                f"CUDA kernels by total time\n\n{table}\n")


# ------------------------------------------------------------------------------------------------
# varlen: a new protein length every step
# ------------------------------------------------------------------------------------------------
VARLEN_BACKENDS = ("triton", "flex", "boltz-cueq")
VARLEN_CHOICES = ("triton", "triton+graphs", "triton-atomic", "flex", "sdpa", "torch", "boltz", "boltz-cueq")
VARLEN_MAX_GRAPHS = 64  # triton+graphs: a capture per padded length (none evicted for multiples >= 8 of the range)
VARLEN_GRAPH_WARMUP = 1  # eager steps before each capture (CUDAGraphs' default 3; one gave the same replays)
VARLEN_RANGE = (180, 520)
VARLEN_WARM = 3  # the ratio target applies after this many lengths
VARLEN_RATIO_TARGET = 1.5
VARLEN_TIME_LIMIT = 280.0
VARLEN_FIELDS = ["backend", "step", "n", "width", "first_ms", "steady_ms", "ratio", "overhead_s", "note"]


def varlen_lengths(count: int = 40, seed: int = 0, lo: int = VARLEN_RANGE[0], hi: int = VARLEN_RANGE[1]):
    """``count`` distinct random lengths in [lo, hi], fixed by ``seed``."""
    if not 1 <= count <= hi - lo + 1:
        raise ValueError(f"varlen count must be in [1, {hi - lo + 1}], got {count}")
    return random.Random(seed).sample(range(lo, hi + 1), count)


def build_varlen(backend: str, dev, c_s: int = 384, c_z: int = 128, multiple: int = 1):
    """(module, make) for the varlen run; ``make(n)`` -> (float inputs requiring grad, forward callable), a
    length-``n`` sequence padded to a multiple of ``multiple``."""
    g = torch.Generator(device=dev).manual_seed(0)
    if backend.startswith("boltz"):
        from boltz.model.layers.pairformer import PairformerLayer

        mod = PairformerLayer(c_s, c_z, num_heads=16, dropout=0.25, pairwise_head_width=32, pairwise_num_heads=4,
                              v2=True).to(dev)
    else:
        mod = PairformerBlock(c_s=c_s, c_z=c_z, attention=attention_config(backend)).to(dev)
        if backend.endswith("+graphs"):
            mod = CUDAGraphs(mod, max_graphs=VARLEN_MAX_GRAPHS, warmup_iters=VARLEN_GRAPH_WARMUP)

    def make(n, module=None):
        w = round_up(n, multiple)
        single, pair = _masks(n, dev, w)
        s = torch.randn(1, w, c_s, device=dev, generator=g, requires_grad=True)
        z = torch.randn(1, w, w, c_z, device=dev, generator=g, requires_grad=True)
        if backend.startswith("boltz"):
            use = backend == "boltz-cueq"
            return [s, z], lambda: mod(s, z, single.float(), pair.float(), use_kernels=use)
        return [s, z], lambda: (module or mod)(s, z, single, pair)
    return mod, make


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _varlen_step(mod, inputs, fwd, dev, grads=None):
    """One timed fwd+bwd step (ms) and the output gradients it used (random on the first call)."""
    mod.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    _sync(dev)
    a = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        outs = fwd()
    if grads is None:
        grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    _sync(dev)
    return (time.perf_counter() - a) * 1e3, grads


def varlen_label(backend: str, multiple: int = 1, warmup: bool = False) -> str:
    return backend + (f" /{multiple}" if multiple > 1 else "") + (" +warm-up" if warmup else "")


def varlen_run(backend: str, lengths, dev, budget_s: float, c_s: int = 384, c_z: int = 128, repeats: int = 3,
               log=print, empty_cache: bool = False, multiple: int = 1, warmup=None, ahead: bool = True):
    """Rows (VARLEN_FIELDS) of one backend stepping through ``lengths``: per length ``repeats`` fwd+bwd steps
    (bf16 autocast, train mode), wall time with a sync after each; first = the first step, steady = the fastest of
    the others. Lengths not started within ``budget_s`` get a "skipped: time limit" row. ``empty_cache``: hand the
    allocator's cached memory back to the driver after each length (a training loop does not: every first step
    would then allocate from the driver; docs/bench/varlen_h200.md). ``multiple``: every length padded to a
    multiple of it; ``warmup`` (lo, hi): first one step at each padded length of [lo, hi] (the range the lengths
    come from), reported as a row with step -1 whose ``overhead_s`` is its time; triton backends first run those
    steps under ``attn_ops.compile_ahead()`` (the plain block, not its CUDA graphs), so their kernels compile at
    once (``ahead`` False: not).
    Python's full (generation 2) garbage collections during a length's first step are named in its row's note."""
    if repeats < 2:
        raise ValueError(f"varlen repeats must be >= 2 (a first and a steady step), got {repeats}")
    t0 = time.perf_counter()
    mod, make = build_varlen(backend, dev, c_s, c_z, multiple)
    _randomize(mod)
    mod.train()
    label = varlen_label(backend, multiple, warmup is not None)
    rows = []
    if warmup is not None:
        t_warm = time.perf_counter()
        widths = sorted({round_up(n, multiple) for n in range(warmup[0], warmup[1] + 1)})
        each = []
        ahead = ahead and backend.startswith("triton")
        if ahead:
            with attn_ops.compile_ahead():
                for w in widths:
                    inputs, fwd = make(w, getattr(mod, "module", mod))  # (CUDAGraphs: the block it wraps)
                    _varlen_step(mod, inputs, fwd, dev)
            ahead_s = time.perf_counter() - t_warm
        for w in widths:
            each.append(_varlen_step(mod, *make(w), dev)[0] / 1e3)
        took = time.perf_counter() - t_warm
        rows.append(dict(backend=label, step=-1, n=f"{widths[0]}-{widths[-1]}", width="", first_ms="",
                         steady_ms="", ratio="", overhead_s=took, note=f"warm-up: {len(widths)} lengths; "
                         + (f"compiles ahead {ahead_s:.2f} s; " if ahead else "") + "s each: "
                         + " ".join(f"{w}: {t:.2f}" for w, t in zip(widths, each))))
        log(rows[-1], f"[{took:.0f} s]")
    full_gc = []  # [start, [ms of each full collection]] while a first step runs

    def on_gc(phase, info):
        if full_gc and info.get("generation") == 2:
            if phase == "start":
                full_gc[0] = time.perf_counter()
            else:
                full_gc[1].append((time.perf_counter() - full_gc[0]) * 1e3)

    gc.callbacks.append(on_gc)
    try:
        _varlen_lengths(rows, lengths, label, mod, make, dev, repeats, multiple, budget_s, t0, empty_cache, log,
                        full_gc)
    finally:
        gc.callbacks.remove(on_gc)
    return rows


def _varlen_lengths(rows, lengths, label, mod, make, dev, repeats, multiple, budget_s, t0, empty_cache, log,
                    full_gc):
    """varlen_run's timed steps: a row per length appended to ``rows``."""
    for i, n in enumerate(lengths):
        row = dict(backend=label, step=i, n=n, width=round_up(n, multiple), first_ms="", steady_ms="", ratio="",
                   overhead_s="", note="")
        if time.perf_counter() - t0 > budget_s:
            row["note"] = "skipped: time limit"
            rows.append(row)
            continue
        try:
            inputs, fwd = make(n)
            grads = None
            times = []
            for r in range(repeats):
                full_gc[:] = [0.0, []] if r == 0 else []
                ms, grads = _varlen_step(mod, inputs, fwd, dev, grads)
                times.append(ms)
                if r == 0 and full_gc[1]:
                    row["note"] = "first step: full gc " + ", ".join(f"{t:.0f} ms" for t in full_gc[1])
            full_gc[:] = []
            first, steady = times[0], min(times[1:])
            row.update(first_ms=first, steady_ms=steady, ratio=first / steady, overhead_s=(first - steady) / 1e3)
        except Exception as exc:  # OOM, unsupported shape: record and go on
            row["note"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            traceback.print_exc(limit=3)
        finally:
            inputs = fwd = grads = None
            if empty_cache and dev.type == "cuda":
                torch.cuda.empty_cache()
        log({k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in row.items()},
            f"[{time.perf_counter() - t0:.0f} s]")
        rows.append(row)


def varlen_summary(rows, warm: int = VARLEN_WARM):
    """Per backend: dict(backend, lengths (run / asked), steady_median_ms, max_ratio and over_target (lengths after
    the first ``warm`` whose first step took more than VARLEN_RATIO_TARGET x steady), compile_tune_s (sum over
    lengths of first - steady))."""
    out = []
    for be in dict.fromkeys(r["backend"] for r in rows):
        rs = [r for r in rows if r["backend"] == be]
        done = [r for r in rs if r["ratio"] != ""]
        later = [r["ratio"] for r in done if int(r["step"]) >= warm]
        warmups = [r["overhead_s"] for r in rs if int(r["step"]) < 0 and r["overhead_s"] != ""]
        out.append(dict(
            backend=be, lengths=f"{len(done)} / {len(rs) - len(warmups)}",
            steady_median_ms=statistics.median(r["steady_ms"] for r in done) if done else "",
            max_ratio=max(later) if later else "",
            over_target=sum(x > VARLEN_RATIO_TARGET for x in later) if later else "",
            compile_tune_s=sum(r["overhead_s"] for r in done) + sum(warmups) if done else "",
        ))
    return out


def _f(x, spec):
    return format(x, spec) if x != "" else "-"


def write_varlen_markdown(path, rows, env, lengths, empty_cache: bool = False, multiple: int = 1):
    """Summary per backend, then a row per length with first ms, steady ms and first/steady per backend."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    lines = ["# Varlen block benchmark (scripts/bench_blocks.py --varlen)", "", *env,
             f"- lengths: {len(lengths)} distinct in [{VARLEN_RANGE[0]}, {VARLEN_RANGE[1]}], in this order: "
             + ", ".join(map(str, lengths)),
             f"- per length 3 fwd+bwd steps (eager PairformerBlock c_s 384, c_z 128, {PADDED} padded residues; "
             "Boltz-2's PairformerLayer for boltz rows), wall time with a sync; first includes compile/tune;",
             "  steady = the faster of the other two; the allocator's cache is "
             + ("emptied after each length (--varlen-empty-cache);" if empty_cache else "kept across lengths, as in training;"),
             f"  target: first/steady <= {VARLEN_RATIO_TARGET}x after the first {VARLEN_WARM} lengths, "
             "compile + tune (sum of first - steady) <= 20 s fresh, <= 2 s with a warm on-disk cache.",
             *([f"- every length padded to a multiple of {multiple} (masked); N -> the padded length below"]
               if multiple > 1 else []),
             *[f"- {r['backend']}: {r['overhead_s']:.2f} s before the timed steps ({r['note']}) "
               "(counted in compile + tune)" for r in rows if int(r["step"]) < 0 and r["overhead_s"] != ""], "",
             "| backend | lengths run | steady median ms | max first/steady after 3 lengths | lengths over 1.5x | "
             "compile + tune s | target met |", "|---|---|---|---|---|---|---|"]
    for s in varlen_summary(rows):
        met = ""
        if s["max_ratio"] != "":
            ok = s["over_target"] == 0 and s["compile_tune_s"] <= 20 and s["lengths"].split(" / ")[0] == \
                s["lengths"].split(" / ")[1]
            met = "yes" if ok else "**no**"
        lines.append(f"| {s['backend']} | {s['lengths']} | {_f(s['steady_median_ms'], '.1f')} | "
                     f"{_f(s['max_ratio'], '.2f')} | {_f(s['over_target'], 'd')} | {_f(s['compile_tune_s'], '.1f')} | "
                     f"{met} |")
    head = ["step", "N"] + [f"{b} {c}" for b in backends for c in ("first ms", "steady ms", "first/steady")]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["backend"], int(r["step"])): r for r in rows}
    for i, n in enumerate(lengths):
        cells = [str(i), str(n) if round_up(n, multiple) == n else f"{n} -> {round_up(n, multiple)}"]
        for b in backends:
            r = by.get((b, i))
            if r is None or r["ratio"] == "":
                why = (r["note"].replace("|", "\\|") if r else "") or "-"
                cells += [why, "-", "-"]
            else:
                cells += [f"{r['first_ms']:.1f}", f"{r['steady_ms']:.1f}", f"{r['ratio']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    noted = [r for r in rows if r["ratio"] != "" and r["note"] and int(r["step"]) >= 0]
    if noted:
        lines += [""] + [f"- step {r['step']} ({r['backend']}, first/steady {r['ratio']:.2f}): {r['note']}"
                         for r in noted]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


_WORKER_TAG = "VARLEN_ROWS_JSON "


def _varlen_worker(backend: str, lengths, budget: float, empty_cache: bool = False, multiple: int = 1,
                   warmup: bool = False, ahead: bool = True) -> None:
    """One backend's varlen run in this (fresh) process; rows printed as one tagged JSON line."""
    dev = torch.device("cuda")
    # CUDA context, cuBLAS handles and the glue kernels' first use are charged to no backend: one torch-backend step
    try:
        varlen_run("torch", [32], dev, float("inf"), log=lambda *a: None)
    except Exception:
        traceback.print_exc(limit=2)
    rows = varlen_run(backend, lengths, dev, budget, empty_cache=empty_cache, multiple=multiple,
                      warmup=VARLEN_RANGE if warmup else None, ahead=ahead)
    print(_WORKER_TAG + json.dumps(rows), flush=True)


def _varlen_in_subprocess(backend: str, args, lengths, budget: float):
    """Rows of one backend, run in a fresh Python process: no backend inherits another's compiled kernels, cuBLAS
    heuristics (a new GEMM shape costs host time on its first call: docs/bench/varlen_h200.md) or allocator
    segments."""
    cmd = [sys.executable, os.path.abspath(__file__), "--varlen-worker", backend, "--varlen-count",
           str(args.varlen_count), "--varlen-seed", str(args.varlen_seed), "--time-limit", str(budget),
           "--varlen-multiple", str(args.varlen_multiple)] + (
        ["--varlen-empty-cache"] if args.varlen_empty_cache else []) + (
        ["--varlen-warmup"] if args.varlen_warmup else []) + (["--varlen-no-ahead"] if args.varlen_no_ahead else [])
    return _worker_result(cmd, _WORKER_TAG, budget + 300)


def _worker_result(cmd, tag: str, timeout: float):
    """Run a worker process (``cmd``); return what it printed as one ``tag``-prefixed JSON line. Its stderr
    (tracebacks, warnings) passes through to ours. No such line: RuntimeError naming the exit code and the last
    stderr line; past ``timeout`` s: subprocess.TimeoutExpired."""
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    sys.stderr.write(proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"worker exited with {proc.returncode}: {tail[:160]}")


def run_varlen(args, dev, env):
    lengths = varlen_lengths(args.varlen_count, args.varlen_seed)
    rows, t0 = [], time.perf_counter()
    path_csv, path_md = (os.path.join(args.out, f"varlen.{e}") for e in ("csv", "md"))
    with open(path_csv, "w", newline="") as fcsv:
        w = csv.DictWriter(fcsv, fieldnames=VARLEN_FIELDS)
        w.writeheader()
        for i, backend in enumerate(args.varlen_backends):
            # what the backends before did not use goes to the ones after
            budget = (args.time_limit - (time.perf_counter() - t0)) / (len(args.varlen_backends) - i)
            try:
                got = _varlen_in_subprocess(backend, args, lengths, budget)
            except Exception as exc:  # a peer that does not import or build: one row with the reason
                got = [dict(backend=varlen_label(backend, args.varlen_multiple, args.varlen_warmup), step=0,
                            n=lengths[0], width="", first_ms="", steady_ms="", ratio="",
                            overhead_s="", note=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")]
            rows += got
            for r in got:
                w.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})
            fcsv.flush()
            write_varlen_markdown(path_md, rows, env, lengths, args.varlen_empty_cache, args.varlen_multiple)
    print(open(path_md).read())
    return rows


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def env_lines():
    import triton

    props = torch.cuda.get_device_properties(0)
    return [
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M')}",
        f"- GPU: {props.name}, {props.total_memory / GIB:.0f} GiB",
        f"- torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, "
        f"python {platform.python_version()}",
        "- step: forward + backward, train mode (dropout on), bf16 autocast, fp32 params and inputs requiring grad;",
        f"  {PADDED} padded residues per sequence (pair447: {PADDED_OF['pair447']}); time = median over the timed steps; peak = extra device memory",
        "  of one step beyond params and inputs (gradients included).",
    ]


def write_markdown(path, rows, brk, env, notes):
    with open(path, "w") as f:
        f.write("# Block benchmark (scripts/bench_blocks.py)\n\n" + "\n".join(env) + "\n\n")
        f.write("| block | N_res | N_seq | backend | fwd+bwd ms | peak GiB | vs triton (time) | note |\n")
        f.write("|---|---|---|---|---|---|---|---|\n")
        # alternating rows against the alternating triton row (same rounds)
        tri = {(r["case"], r["backend"] != "triton"): r for r in rows
               if r["backend"] in ("triton", "triton, alternating") and r["ms"] != ""}
        for r in rows:
            ref = tri.get((r["case"], r["backend"].endswith(", alternating")))
            ratio = f"{r['ms'] / ref['ms']:.2f}x" if ref and r["ms"] != "" and r["ms"] else ""
            ms = f"{r['ms']:.2f}" if r["ms"] != "" else "-"
            peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] != "" else "-"
            f.write(f"| {r['block']} | {r['n_res']} | {r['n_seq'] or '-'} | {r['backend']} | {ms} | {peak} | "
                    f"{ratio} | {r['note']} |\n")
        if brk:
            f.write("\n## Where the triton-backend block's time goes (each sub-module alone, fwd+bwd)\n\n")
            f.write("| case | sub-module | ms | peak GiB |\n|---|---|---|---|\n")
            for case, name, ms, peak in brk:
                f.write(f"| {case} | {name} | {ms:.2f} | {peak:.2f} |\n")
        for n in notes:
            f.write(f"\n{n}\n")


def _empty_row(case: str, backend: str) -> dict:
    kind, n, s_rows = CASES[case]
    return dict(block=kind, case=case, n_res=n, n_seq=s_rows or "", backend=backend, ms="", peak_gib="", note="")


def alternating_rows(case: str, backends, dev, args) -> list:
    """The eager rows of ``case`` (``backends`` without ``+compile``) built at once and timed in ``args.rounds``
    alternating rounds (``bench_patch.alternate``); one row per backend, the rounds' spread in its note."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_patch import alternate

    variants, rows = [], []
    for backend in backends:
        if backend.endswith("+compile") or (backend.startswith("boltz") and CASES[case][0] != "pairformer"):
            continue
        try:
            mod, inputs, fwd = build_case(case, backend, dev)
        except Exception as exc:  # a missing peer: its row says so
            rows.append(dict(_empty_row(case, backend + ", alternating"), note=f"failed: {type(exc).__name__}: {exc}"))
            continue
        _randomize(mod)
        variants.append((backend, lambda: None, train_step(mod, inputs, fwd)))
    timer = argparse.Namespace(device=dev, iters=args.iters)
    for backend, (ms, lo, hi) in alternate(timer, variants, args.rounds).items():
        rows.append(dict(_empty_row(case, backend + ", alternating"), ms=ms,
                         note=f"median of {args.rounds} rounds of {args.iters} steps, rounds {lo:.2f}-{hi:.2f} ms"))
    variants.clear()
    torch.cuda.empty_cache()
    return rows


def _run_item(case, backend, dev, args, t0):
    row = _empty_row(case, backend)
    if time.time() - t0 > args.time_limit:
        row["note"] = "skipped: time limit"
        return row
    t1 = time.time()
    mod = inputs = fwd = None
    try:
        mod, inputs, fwd = build_case(case, backend, dev, args.compile_mode, args.compile_dynamic)
        _randomize(mod)
        graphs = backend.endswith("+graphs") or (
            backend.endswith("+compile") and args.compile_mode in ("reduce-overhead", "max-autotune"))
        row["ms"], row["peak_gib"] = measure(mod, inputs, fwd, args.iters, args.warmup, graph_pool=graphs)
        if backend.endswith("+compile") or backend == "flex":
            row["note"] = f"{time.time() - t1:.0f} s incl. compilation"
            if args.compile_mode and backend.endswith("+compile"):
                row["note"] += f", mode={args.compile_mode}"
            if args.compile_dynamic and backend.endswith("+compile"):
                row["note"] += ", dynamic=True"
    except Exception as exc:  # OOM, unsupported shape, missing peer: record and go on
        row["note"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        traceback.print_exc()
    finally:
        mod = inputs = fwd = None
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    return row


_ROW_TAG = "BLOCK_ROW_JSON "
ROW_WORKER_TIMEOUT_S = 1800  # a compiled row takes ~1 min (compile included)


def _row_in_subprocess(case: str, backend: str, args) -> dict:
    """One table row measured in a fresh Python process (``--isolate``): a compiled step's host time grows with what
    the process compiled and ran before it (docs/bench/blocks_h200.md), which a training process that
    compiles one model never pays."""
    cmd = [sys.executable, os.path.abspath(__file__), "--row-worker", case, backend, "--iters", str(args.iters),
           "--warmup", str(args.warmup)] + (["--compile-mode", args.compile_mode] if args.compile_mode else []) + (
        ["--compile-dynamic"] if args.compile_dynamic else [])
    try:
        return _worker_result(cmd, _ROW_TAG, ROW_WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # one hung row must not cost the rest of the table
        return dict(_empty_row(case, backend), note=f"failed: worker timed out after {ROW_WORKER_TIMEOUT_S} s")
    except RuntimeError as exc:
        return dict(_empty_row(case, backend), note=f"failed: {exc}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--breakdown", nargs="*", default=None, choices=list(CASES),
                   help="first time each sub-module of the triton-backend block for these cases")
    p.add_argument("--profile", nargs="*", default=None, choices=list(CASES),
                   help="write the top CUDA kernels of the block to profile_CASE.txt")
    p.add_argument("--profile-backend", default="triton", choices=[b for b in BACKENDS if not b.startswith("boltz")],
                   help="the backend of the --profile runs (a +compile backend profiles the compiled block)")
    p.add_argument("--compile-dynamic", action="store_true",
                   help="compile +compile rows for symbolic lengths (default: one compile per case's length)")
    p.add_argument("--isolate", action="store_true",
                   help="measure every table row in a fresh process (as a training process that compiles one model)")
    p.add_argument("--row-worker", nargs=2, metavar=("CASE", "BACKEND"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--compile-mode", default=None,
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="torch.compile mode of the +compile backends (default: torch's default)")
    p.add_argument("--rounds", type=int, default=0,
                   help="time the eager rows of each case again in R alternating rounds (see above)")
    p.add_argument("--profile-rows", type=int, default=40, help="kernels listed per --profile table")
    p.add_argument("--time-limit", type=float, default=None,
                   help=f"start nothing new after this many s (default 400; --varlen: {VARLEN_TIME_LIMIT:.0f}, "
                        "shared out among the backends)")
    p.add_argument("--varlen", action="store_true", help="the varlen run instead of the table (see above)")
    p.add_argument("--varlen-backends", nargs="+", default=list(VARLEN_BACKENDS), choices=list(VARLEN_CHOICES))
    p.add_argument("--varlen-count", type=int, default=40, help="distinct lengths of the varlen run")
    p.add_argument("--varlen-seed", type=int, default=0)
    p.add_argument("--varlen-empty-cache", action="store_true",
                   help="empty the allocator's cache after each length (the runs before 2026-11-26 did)")
    p.add_argument("--varlen-multiple", type=int, default=1,
                   help="pad every varlen length to a multiple of this (masked), as data.length_multiple does")
    p.add_argument("--varlen-warmup", action="store_true",
                   help="one step at each padded length of the range before the timed steps (counted as compile)")
    p.add_argument("--varlen-no-ahead", action="store_true",
                   help="--varlen-warmup without attn_ops.compile_ahead (kernels compile one by one as met)")
    p.add_argument("--varlen-worker", default=None, choices=list(VARLEN_CHOICES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.time_limit is None:
        args.time_limit = VARLEN_TIME_LIMIT if args.varlen or args.varlen_worker else 400.0
    if args.varlen_multiple < 1:
        p.error(f"--varlen-multiple must be >= 1, got {args.varlen_multiple}")
    if args.varlen_no_ahead and not args.varlen_warmup:
        p.error("--varlen-no-ahead changes --varlen-warmup: give both")
    try:
        varlen_lengths(args.varlen_count, args.varlen_seed)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_blocks.py needs a CUDA device")
    if args.varlen_worker:
        _varlen_worker(args.varlen_worker, varlen_lengths(args.varlen_count, args.varlen_seed), args.time_limit,
                       empty_cache=args.varlen_empty_cache, multiple=args.varlen_multiple, warmup=args.varlen_warmup,
                       ahead=not args.varlen_no_ahead)
        return
    if args.row_worker:
        row = _run_item(*args.row_worker, torch.device("cuda"), args, time.time())
        print(_ROW_TAG + json.dumps(row), flush=True)
        return
    dev = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    env = env_lines()
    print("\n".join(env), flush=True)
    if args.varlen:
        run_varlen(args, dev, env[:4])
        return
    t0 = time.time()
    rows, brk, notes = [], [], []
    md_path = os.path.join(args.out, "blocks.md")
    for case in args.breakdown or []:
        try:
            for name, ms, peak in breakdown(case, dev, args.iters, args.warmup):
                brk.append((case, name, ms, peak))
                print(case, name, f"{ms:.2f} ms", f"{peak:.2f} GiB", flush=True)
        except Exception as exc:
            notes.append(f"breakdown of {case} failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        torch.cuda.empty_cache()
    for case in args.profile or []:
        try:
            kernel_profile(case, dev, os.path.join(args.out, f"profile_{case}.txt"), args.profile_backend,
                           compile_mode=args.compile_mode, rows=args.profile_rows)
        except Exception as exc:
            notes.append(f"profile of {case} failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        torch.cuda.empty_cache()
    # cheap rows for every case first, then the ones that compile (flex, torch.compile), so a time limit
    # cuts the slow extras rather than whole cases
    tier = lambda b: 2 if b.endswith("+compile") else 1 if b == "flex" else 0  # noqa: E731
    items = [(tier(b), ci, bi, c, b) for ci, c in enumerate(args.cases) for bi, b in enumerate(args.backends)
             if not (b.startswith("boltz") and CASES[c][0] != "pairformer")]
    fields = ["block", "case", "n_res", "n_seq", "backend", "ms", "peak_gib", "note"]
    with open(os.path.join(args.out, "blocks.csv"), "w", newline="") as fcsv:
        w = csv.DictWriter(fcsv, fieldnames=fields)
        w.writeheader()
        for _, ci, bi, case, backend in sorted(items):
            if args.isolate and time.time() - t0 <= args.time_limit:
                row = _row_in_subprocess(case, backend, args)
            else:
                row = _run_item(case, backend, dev, args, t0)
            row["_order"] = (ci, bi)
            print({k: v for k, v in row.items() if k != "_order"}, f"[{time.time() - t0:.0f} s]", flush=True)
            rows.append(row)
            w.writerow({k: v for k, v in row.items() if k != "_order"})
            fcsv.flush()
            write_markdown(md_path, sorted(rows, key=lambda r: r["_order"]), brk, env, notes)
        for ci, case in enumerate(args.cases if args.rounds else ()):
            for bi, row in enumerate(alternating_rows(case, args.backends, dev, args)):
                row["_order"] = (ci, len(args.backends) + bi)
                print({k: v for k, v in row.items() if k != "_order"}, f"[{time.time() - t0:.0f} s]", flush=True)
                rows.append(row)
                w.writerow({k: v for k, v in row.items() if k != "_order"})
                fcsv.flush()
                write_markdown(md_path, sorted(rows, key=lambda r: r["_order"]), brk, env, notes)
    print(open(md_path).read())


if __name__ == "__main__":
    main()
