"""Benchmark the attention op side by side: triton (this project), torch, chunked, sdpa, flex, trifast, cuequivariance.

Pair-bias shapes (PERF.md): q, k, v ``[B, R, H, L, D]`` bf16, trainable bias ``[B, 1, H, L, L]`` shared by the R
rows, key mask ``[B, R, 1, 1, L]``; gradients into q, k, v and bias. No-bias long-context shapes: ``[B, H, L, D]``,
causal or full. Per backend: forward and forward+backward median time (``triton.testing.do_bench``), TFLOP/s
(fwd+bwd counted as 3.5x the forward's 4*N*Lq*Lk*D, halved for causal), and the extra peak device memory of one
fwd+bwd step beyond the inputs (gradients included). Writes ``attention.csv``, ``attention.md`` and
``attention.png`` into ``--out`` (default ``$OUT`` or ``bench_out``), row by row.

    python scripts/bench_attention.py --set bias            # the pair-bias table
    python scripts/bench_attention.py --set long            # the no-bias long-context table
    python scripts/bench_attention.py --set bias --backends triton --profile   # per-kernel times of triton
    python scripts/bench_attention.py --set bias --backends triton --layout heads-last   # as the blocks call it
    python scripts/bench_attention.py --set crop            # triangle attention at real crop sizes (~5 min)
    python scripts/bench_attention.py --render DIR ...      # re-render md + png from CSV files

The crop set (``--set crop``; not part of ``all``): triangle layout q/k/v ``[1, N, 4, N, D]``, trainable bias
``[1, 1, 4, N, N]``, key padding mask ``[1, N, 1, 1, N]`` with the last ~10% of keys masked; N in {128, 200, 256, 300,
384, 512} at D=32 and D in {8, 16, 24, 32, 48, 64} at N=300 and 384. Per shape and peer: fwd+bwd median ms, host ms
per eager call and the first call's seconds; writes ``crop.csv`` and ``crop.md``. For cold first calls point
``ATTN_ZOO_CACHE_DIR`` at an empty folder (the on-disk tuning cache would otherwise start warm).

trifast and cuequivariance are optional imports (see ../shared/anchor-wheels/README.md).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import functools
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2.0 ** 20
H100_BF16_TFLOPS = 989.0  # dense peak, SXM
H100_HBM_TBS = 3.35
# name: (B, R, H, L, D, padded keys)
BIAS_SHAPES = {  # the shapes with targets first: a run cut short keeps them
    "triangle 1,768,4,768,32": (1, 768, 4, 768, 32, 0),
    "MSA rows 1,512,8,384,32": (1, 512, 8, 384, 32, 0),
    "dense full bias 4,1,16,2048,128": (4, 1, 16, 2048, 128, 0),
    "dense full bias 1,1,16,4096,64": (1, 1, 16, 4096, 64, 0),
    "triangle 1,256,4,256,32": (1, 256, 4, 256, 32, 0),
    "triangle 1,512,4,512,32 (13 padded keys)": (1, 512, 4, 512, 32, 13),
}
# name: (B, H, L, D, causal)
LONG_SHAPES = {
    "1,16,16384,128 causal": (1, 16, 16384, 128, True),
    "1,16,16384,128 full": (1, 16, 16384, 128, False),
    "1,16,16384,64 causal": (1, 16, 16384, 64, True),
    "1,32,32768,128 causal": (1, 32, 32768, 128, True),
}
TARGETS_MS = {  # fwd+bwd ms the op aims at on an H100, per shape
    "triangle 1,768,4,768,32": 3.9,
    "MSA rows 1,512,8,384,32": 1.5,
    "dense full bias 4,1,16,2048,128": 2.3,
    "dense full bias 1,1,16,4096,64": 2.5,
    "1,16,16384,128 causal": 8.0,
}
# crop set: triangle attention [1, N, CROP_H, N, D] at real crop lengths and head widths, ~10% of keys padded
CROP_N = (128, 200, 256, 300, 384, 512)
CROP_D = (8, 16, 24, 32, 48, 64)
CROP_D_AT = (300, 384)  # the head-width sweep runs at these N
CROP_H = 4
CROP_BACKENDS = ("triton", "triton-nondet", "flex", "flex-dynamic", "sdpa", "cuequivariance", "trifast")
CROP_TARGET_MS = {(256, 32): 0.7}  # the crop set's aim; and at every shape: triton <= flex and <= cuequivariance
CROP_FIELDS = ["shape", "n", "d", "pad", "backend", "fwdbwd_ms", "host_ms", "first_s", "note"]
CROP_TIME_LIMIT = 300.0
HOST_CALLS = 20
HOST_SLEEP_CYCLES = int(4e8)  # ~0.2 s of GPU time at H100 clocks: the GPU stays busy while the calls are enqueued
DEFAULT_BACKENDS = ["triton", "flex", "cuequivariance", "trifast", "sdpa", "sdpa cudnn", "sdpa flash", "chunked",
                    "torch"]
FIELDS = ["set", "shape", "backend", "fwd_ms", "fwdbwd_ms", "tflops", "peak_mib", "note"]


# ----------------------------------------------------------------------------------------------------- inputs
def bias_inputs(B, R, H, L, D, pad, heads_last=False, device="cuda"):
    """(q, k, v, bias, mask, leaves). ``heads_last``: q, k, v are ``[B, R, H, L, D]`` views of ``[B, R, L, H, D]``
    memory, the layout the blocks pass (heads split out of a fused projection); ``leaves`` are then the
    underlying tensors (whose gradients the step fills)."""
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()

    if heads_last:
        bases = [rnd(B, R, L, H, D) for _ in range(3)]
        q, k, v = (t.transpose(2, 3) for t in bases)
    else:
        q, k, v = bases = [rnd(B, R, H, L, D) for _ in range(3)]
    bias = rnd(B, 1, H, L, L)
    mask = torch.ones(B, R, 1, 1, L, dtype=torch.bool, device=device)
    if pad:
        mask[..., L - pad:] = False
    return q, k, v, bias, mask, list(bases) + [bias]


def long_inputs(B, H, L, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(3)]


# ----------------------------------------------------------------------------------------------- backends
def attn_ops_fn(name, q, k, v, bias, mask, causal, **opts):
    import attn_ops

    def run():
        return attn_ops.attention(q, k, v, bias, mask, causal=causal, backend=name, **opts)
    return run, [q, k, v] + ([bias] if bias is not None else [])


def flex_bias_fn(q, k, v, bias, mask, causal, dynamic=False):
    """Compiled flex with the bias and key mask in a score_mod. ``dynamic``: compiled for symbolic lengths, as
    torch.compile recompiles a function once it has seen a second length (the kernels a run over proteins of
    many lengths ends up with); False: one compile specialised to this length."""
    from torch.nn.attention.flex_attention import flex_attention

    B, R, H, L, D = q.shape
    flex = torch.compile(flex_attention, dynamic=dynamic)
    bias4 = bias.view(B, H, L, L)  # [B, H, L, L] from [B, 1, H, L, L]
    keys = mask.view(B * R, L)  # [B*R, L]

    def score_mod(score, b, h, qi, kj):
        return torch.where(keys[b, kj], score + bias4[b // R, h, qi, kj], -float("inf"))

    def run():
        out = flex(q.view(B * R, H, L, D), k.view(B * R, H, L, D), v.view(B * R, H, L, D), score_mod=score_mod)
        return out.view(B, R, H, L, D)
    return run, [q, k, v, bias]


def flex_long_fn(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    L = q.shape[2]
    bm = create_block_mask(lambda b, h, qi, kj: qi >= kj, None, None, L, L) if causal else None

    def run():
        return flex(q, k, v, block_mask=bm)
    return run, [q, k, v]


def sdpa_long_fn(q, k, v, causal, kernel):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[kernel]

    def run():
        with sdpa_kernel([which]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run, [q, k, v]


def trifast_fn(q, k, v, bias, mask, causal):
    import trifast

    B, R, H, L, D = q.shape
    # trifast layout [b, h, n, n, d], bias [b, h, n, n], mask [b, n, n] True = masked out
    qt, kt, vt = (t.detach().permute(0, 2, 1, 3, 4).contiguous().requires_grad_() for t in (q, k, v))
    bt = bias.detach().view(B, H, L, L).clone().requires_grad_()
    mt = (~mask.view(B, R, L)).contiguous()  # [b, n, n]: row i's key mask, True = masked out

    def run():
        return trifast.triangle_attention(qt, kt, vt, bt, mt)
    return run, [qt, kt, vt, bt]


def cueq_fn(q, k, v, bias, mask, causal):
    import cuequivariance_torch as cuet

    def run():
        return cuet.triangle_attention(q, k, v, bias, mask=mask)
    return run, [q, k, v, bias]


# ----------------------------------------------------------------------------------------------- measuring
def fwd_flops(n_bh, lq, lk, d, causal):
    return 4.0 * n_bh * lq * lk * d * (0.5 if causal else 1.0)


def measure(make, label):
    """(fwd ms, fwd+bwd ms, peak MiB) of the callable built by ``make()``."""
    from triton.testing import do_bench

    run, leaves = make()

    def fwd():
        return run()

    out = fwd()
    g = torch.randn_like(out)

    def step():
        o = run()
        o.backward(g)

    step()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    fwd_ms = do_bench(fwd, return_mode="median")
    step_ms = do_bench(step, grad_to_none=leaves, return_mode="median")
    for t in leaves:
        t.grad = None
    del out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MIB
    for t in leaves:
        t.grad = None
    return fwd_ms, step_ms, peak


def profile_triton(make):
    """Per-kernel CUDA time of one fwd+bwd step."""
    from torch.profiler import ProfilerActivity, profile

    run, _ = make()
    out = run()
    g = torch.randn_like(out)
    for _ in range(2):
        run().backward(g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run().backward(g)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)


# ---------------------------------------------------------------------------------------------------- sets
ATTN_OPS_BIAS_BACKENDS = ("triton", "torch", "chunked", "sdpa", "triton-fused", "triton-atomic", "triton-nondet")
ATTN_OPS_OPTIONS = {"sdpa": dict(deterministic=False),  # its CUDA backward uses atomics: allowed explicitly
                    # dq and the shared bias's gradient by atomics: one backward pass
                    "triton-fused": dict(bwd="fused", deterministic=False),
                    # split dq kernel; the shared bias's gradient by atomics
                    "triton-atomic": dict(bwd="split", deterministic=False),
                    # the backend's own choice of backward once determinism is not required
                    "triton-nondet": dict(deterministic=False)}


# the peers outside attn_ops that take the pair-bias inputs: (q, k, v, bias, mask, causal) -> (run, leaves)
PEER_BIAS_FNS = {"flex": flex_bias_fn,
                 "flex-dynamic": functools.partial(flex_bias_fn, dynamic=True),
                 "trifast": trifast_fn, "cuequivariance": cueq_fn}


def bias_run(be, q, k, v, bias, mask, leaves):
    """(run, leaves) of bench backend ``be`` on pair-bias inputs."""
    if be in ATTN_OPS_BIAS_BACKENDS:
        run, _ = attn_ops_fn(be.split("-")[0], q, k, v, bias, mask, False, **ATTN_OPS_OPTIONS.get(be, {}))
        return run, leaves
    return PEER_BIAS_FNS[be](q, k, v, bias, mask, False)


def bias_cases(names, backends, heads_last=False):
    for shape in names:
        B, R, H, L, D, pad = BIAS_SHAPES[shape]
        flops = fwd_flops(B * R * H, L, L, D, False)
        for be in backends:
            def make(be=be, B=B, R=R, H=H, L=L, D=D, pad=pad):
                q, k, v, bias, mask, leaves = bias_inputs(B, R, H, L, D, pad, heads_last)
                return bias_run(be, q, k, v, bias, mask, leaves)
            skip = None
            if heads_last and be not in ATTN_OPS_BIAS_BACKENDS:
                skip = "skipped: --layout heads-last is measured for attn_ops backends only"
            if be == "trifast" and R != L:
                skip = "skipped: triangle-only kernel (needs R == L); an illegal memory access otherwise"
            if be == "cudnn":
                skip = "skipped: no bias path"
            if be == "torch" and B * R * H * L * L * 4 * 3 > 40 * 2 ** 30:
                skip = "skipped: materialised scores > 40 GiB"
            yield "bias", shape, be, make, flops, skip


def crop_shapes():
    """(N, D) of the crop set, without repeats: the N sweep at D=32, then the head-width sweeps."""
    return list(dict.fromkeys([(n, 32) for n in CROP_N] + [(n, d) for n in CROP_D_AT for d in CROP_D]))


def crop_pad(n):
    """Padded keys of a crop of length ``n``: the last ~10%."""
    return max(1, round(0.1 * n))


def crop_name(n, d):
    return f"N={n} D={d}"


def crop_cases(shapes, backends):
    """(shape name, n, d, pad, backend, make, skip) per (N, D) in ``shapes`` and backend, shape by shape."""
    for n, d in shapes:
        pad = crop_pad(n)
        for be in backends:
            def make(be=be, n=n, d=d, pad=pad):
                q, k, v, bias, mask, leaves = bias_inputs(1, n, CROP_H, n, d, pad)
                return bias_run(be, q, k, v, bias, mask, leaves)
            skip = None
            if be not in ATTN_OPS_BIAS_BACKENDS + tuple(PEER_BIAS_FNS):
                skip = f"skipped: {be} has no pair-bias path"
            yield crop_name(n, d), n, d, pad, be, make, skip


def host_time_ms(step, leaves, calls=HOST_CALLS):
    """(host ms per call, GPU stayed busy): ``calls`` steps enqueued behind a GPU sleep kernel, timed with
    time.perf_counter without a sync, divided by ``calls``. An implicit sync shows up as a long host time."""
    torch.cuda.synchronize()
    torch.cuda._sleep(HOST_SLEEP_CYCLES)
    slept = torch.cuda.Event()
    slept.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        for t in leaves:
            t.grad = None
        step()
    host = (time.perf_counter() - t0) / calls * 1e3
    busy = not slept.query()
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    return host, busy


def measure_crop(make):
    """(first-call s, fwd+bwd median ms, host ms per call, note) of the callable built by ``make()``."""
    from triton.testing import do_bench

    run, leaves = make()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = run()  # the first call at this shape: compiles and tunes
    g = torch.randn_like(out)
    out.backward(g)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    del out
    from attn_ops import wait_compiles

    settle_s = wait_compiles()  # a tile-multiple length's EVEN variants compile meanwhile: time the settled state

    def step():
        run().backward(g)

    step_ms = do_bench(step, grad_to_none=leaves, return_mode="median")
    host_ms, busy = host_time_ms(step, leaves)
    note = "" if busy else "GPU went idle while enqueuing: host time may include waits"
    if settle_s > 0.05:
        note = "; ".join(n for n in (note, f"background compiles ended {settle_s:.1f} s after the first call") if n)
    return first_s, step_ms, host_ms, note


def long_cases(names, backends):
    for shape in names:
        B, H, L, D, causal = LONG_SHAPES[shape]
        flops = fwd_flops(B * H, L, L, D, causal)
        for be in backends:
            def make(be=be, B=B, H=H, L=L, D=D, causal=causal):
                q, k, v = long_inputs(B, H, L, D)
                if be in ("triton", "chunked"):
                    run, leaves = attn_ops_fn(be, q, k, v, None, None, causal)
                    return run, leaves
                if be == "cudnn":  # asked for by name: the workspace bound that steers auto is lifted
                    import attn_ops

                    inner, leaves = attn_ops_fn(be, q, k, v, None, None, causal)

                    def run():
                        with attn_ops.kernel_settings(cudnn_workspace_gib=1024):
                            return inner()
                    return run, leaves
                if be == "triton-fused":
                    return attn_ops_fn("triton", q, k, v, None, None, causal, bwd="fused", deterministic=False)
                if be in ("sdpa cudnn", "sdpa flash"):
                    return sdpa_long_fn(q, k, v, causal, be.split()[1])
                if be == "flex":
                    return flex_long_fn(q, k, v, causal)
                raise KeyError(be)
            skip = "skipped: no-bias long context is not its use" if be in ("torch", "trifast", "cuequivariance") \
                else None
            yield "long", shape, be, make, flops, skip


# -------------------------------------------------------------------------------------------------- output
def environment():
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{gpu}; torch {torch.__version__}; triton {triton.__version__}; "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")


def roofline(shape):
    """(fwd+bwd GFLOP, compulsory MB, bias re-read MB, ideal ms) for a target shape."""
    if shape in BIAS_SHAPES:
        B, R, H, L, D, _ = BIAS_SHAPES[shape]
        flops = 3.5 * fwd_flops(B * R * H, L, L, D, False)
        qkv = B * R * H * L * D * 2
        bias = B * H * L * L * 2
        # fwd: q k v bias in, o out; bwd: q k v o do bias in, dq dk dv dbias out (+ lse/delta, small)
        compulsory = 4 * qkv + bias + 10 * qkv + 2 * bias
        reread = 2 * (R - 1) * bias  # the shared bias read once per row in fwd and bwd (L2 may absorb it)
    else:
        B, H, L, D, causal = LONG_SHAPES[shape]
        flops = 3.5 * fwd_flops(B * H, L, L, D, causal)
        qkv = B * H * L * D * 2
        compulsory, reread = 14 * qkv, 0
    ideal_ms = max(flops / (H100_BF16_TFLOPS * 1e12), compulsory / (H100_HBM_TBS * 1e12)) * 1e3
    return flops / 1e9, compulsory / 1e6, reread / 1e6, ideal_ms


def write_md(rows, path, env):
    by_shape = {}
    for r in rows:
        by_shape.setdefault((r["set"], r["shape"]), []).append(r)
    lines = [f"# Attention op benchmark\n", f"{env}\n",
             "bf16; bias sets: q/k/v `[B, R, H, L, D]`, trainable bias `[B, 1, H, L, L]` (gradient summed over R), "
             "key mask `[B, R, 1, 1, L]`; long sets: `[B, H, L, D]`, no bias. Median of `triton.testing.do_bench`; "
             "TFLOP/s of fwd+bwd (3.5x forward FLOPs, causal halved); peak = extra memory of one fwd+bwd step.\n",
             "| shape | backend | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | peak MiB | note |",
             "|---|---|---|---|---|---|---|"]
    for (_, shape), rs in by_shape.items():
        for i, r in enumerate(rs):
            cells = [shape if i == 0 else "", r["backend"]] + [_fmt(r[f]) for f in ("fwd_ms", "fwdbwd_ms",
                                                                                     "tflops")]
            cells += [_fmt_int(r["peak_mib"]), r["note"]]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Targets and roofline", "",
              "| shape | target ms | triton ms | met | flex ms | triton peak / flex peak MiB | GFLOP | "
              "compulsory MB | shared-bias re-read MB | roofline ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape, target in TARGETS_MS.items():
        rs = {r["backend"]: r for (_, s), lst in by_shape.items() if s == shape for r in lst}
        if "triton" not in rs:
            continue
        t, f = rs["triton"], rs.get("flex", {})
        gf, comp, rer, ideal = roofline(shape)
        met = "yes" if _num(t["fwdbwd_ms"]) is not None and _num(t["fwdbwd_ms"]) <= target else "**no**"
        lines.append(f"| {shape} | {target} | {_fmt(t['fwdbwd_ms'])} | {met} | {_fmt(f.get('fwdbwd_ms', ''))} | "
                     f"{_fmt_int(t['peak_mib'])} / {_fmt_int(f.get('peak_mib', ''))} | {gf:.0f} | {comp:.0f} | "
                     f"{rer:.0f} | {ideal:.2f} |")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def crop_table(rows, field, backends=None):
    """Markdown lines of a pivot table: a row per shape, a column per backend, ``field`` in each cell (the
    note where the value is missing)."""
    backends = backends or list(dict.fromkeys(r["backend"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    cells = {(r["shape"], r["backend"]): r for r in rows}
    extra = field == "fwdbwd_ms"
    # the target's peers, then compiled flex for symbolic lengths where it ran (a ratio column, not a target)
    ratio_to = ("flex", "cuequivariance") + (("flex-dynamic",) if "flex-dynamic" in backends else ())
    head = ["shape"] + backends + ([f"triton / {p}" for p in ratio_to] + ["target met"] if extra else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape in shapes:
        line = [shape]
        for be in backends:
            r = cells.get((shape, be))
            if r is None:
                line.append("")
            elif _num(r[field]) is not None:
                line.append(_fmt(r[field]))
            else:
                line.append(_cell(r["note"]) if field == "fwdbwd_ms" else "-")
        if extra:
            t = _num(cells.get((shape, "triton"), {}).get("fwdbwd_ms"))
            ratios = {be: _num(cells.get((shape, be), {}).get("fwdbwd_ms")) for be in ratio_to}
            line += [f"{t / p:.2f}x" if t is not None and p else "" for p in ratios.values()]
            peers = {be: ratios[be] for be in ("flex", "cuequivariance")}  # the target's peers
            r0 = cells.get((shape, "triton"), {})
            target = CROP_TARGET_MS.get((int(r0["n"]), int(r0["d"]))) if r0 else None
            if t is None:
                line.append("")
            else:
                ok = all(p is None or t <= p for p in peers.values()) and (target is None or t <= target)
                line.append("yes" if ok else "**no**")
        lines.append("| " + " | ".join(line) + " |")
    return lines


def write_crop_md(rows, path, env):
    lines = ["# Attention op benchmark: crop set\n", f"{env}\n",
             f"bf16 triangle attention: q/k/v `[1, N, {CROP_H}, N, D]`, trainable pair bias `[1, 1, {CROP_H}, N, N]` "
             "(gradient summed over rows), key padding mask `[1, N, 1, 1, N]` with the last ~10% of keys masked; "
             "gradients into q, k, v and bias.\n",
             "## fwd+bwd median ms (`triton.testing.do_bench`)\n",
             "Target: triton at most compiled flex's and cuEquivariance's time at every shape; "
             "N=256 D=32 at most 0.7 ms.\n"]
    lines += crop_table(rows, "fwdbwd_ms")
    lines += ["", "## Host ms per eager fwd+bwd call\n",
              f"time.perf_counter over {HOST_CALLS} calls enqueued behind a GPU sleep kernel (GPU kept busy, no sync), "
              f"divided by {HOST_CALLS}.\n"]
    lines += crop_table(rows, "host_ms")
    lines += ["", "## First call at the shape, s (compile + tune + one fwd+bwd, synchronised)\n",
              "Every shape is new to the process; Dynamo is reset before each case (flex compiles afresh), while "
              "in-process and on-disk tuning caches stay as they are "
              "(cold: ATTN_ZOO_CACHE_DIR set to an empty folder).\n"]
    lines += crop_table(rows, "first_s")
    notes = [r for r in rows if r["note"] and _num(r["fwdbwd_ms"]) is not None]
    if notes:
        lines += ["", "Notes:"] + [f"- {r['shape']} {r['backend']}: {r['note']}" for r in notes]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def run_crop(cases, csv_path, time_limit, profile=False):
    """Measure every crop case, writing CSV rows as they come; returns the rows. ``profile``: print triton's
    per-kernel times per shape after its row."""
    rows, t0 = [], time.time()
    with open(csv_path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, CROP_FIELDS)
        wr.writeheader()
        for shape, n, d, pad, be, make, skip in cases:
            row = dict(shape=shape, n=n, d=d, pad=pad, backend=be, fwdbwd_ms="", host_ms="", first_s="",
                       note=skip or "")
            if not skip and time.time() - t0 > time_limit:
                row["note"] = "skipped: time limit"
            elif not skip:
                try:
                    torch._dynamo.reset()  # a fresh compile per shape, and no recompile limit across shapes
                    first_s, step_ms, host_ms, note = measure_crop(make)
                    row.update(fwdbwd_ms=f"{step_ms:.4f}", host_ms=f"{host_ms:.4f}", first_s=f"{first_s:.3f}",
                               note=note)
                    if profile and be.startswith("triton"):
                        print(shape, be, flush=True)
                        profile_triton(make)
                except Exception as exc:  # a peer that cannot run a shape: its reason goes in the cell
                    row["note"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                    traceback.print_exc(limit=2)
                torch.cuda.empty_cache()
            print(row, f"[{time.time() - t0:.0f} s]", flush=True)
            rows.append(row)
            wr.writerow(row)
            fh.flush()
    return rows


def _num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _fmt(x):
    n = _num(x)
    if n is None:
        return str(x or "")
    return f"{n:.3f}" if n < 10 else f"{n:.1f}"


def _fmt_int(x):
    n = _num(x)
    return "" if n is None else f"{n:.0f}"


def write_png(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot", flush=True)
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 5))
    w = 0.8 / max(1, len(backends))
    for i, be in enumerate(backends):
        xs, ys = [], []
        for j, s in enumerate(shapes):
            for r in rows:
                if r["shape"] == s and r["backend"] == be and _num(r["fwdbwd_ms"]):
                    xs.append(j + i * w)
                    ys.append(_num(r["fwdbwd_ms"]))
        ax.bar(xs, ys, w, label=be)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(shapes))])
    ax.set_xticklabels([s.replace(" (13 padded keys)", "*") for s in shapes], rotation=25, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("fwd+bwd ms (log)")
    ax.legend(fontsize=8)
    ax.set_title("attention fwd+bwd, bf16 (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=["bias", "long", "crop", "all"], default="all",
                    help="all = bias + long; the crop set runs on its own")
    ap.add_argument("--shapes", nargs="*", help="subset of shape names (substring match; crop: e.g. 'N=300 ')")
    ap.add_argument("--backends", nargs="*", default=None,
                    help=f"default: {' '.join(DEFAULT_BACKENDS)}; crop set: {' '.join(CROP_BACKENDS)}")
    ap.add_argument("--time-limit", type=float, default=None,
                    help=f"crop set: start no new case after this many s (default {CROP_TIME_LIMIT:.0f})")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--profile", action="store_true", help="print per-kernel times of triton per shape (bias, long and crop sets)")
    ap.add_argument("--layout", choices=["contiguous", "heads-last"], default="contiguous",
                    help="bias set: q, k, v as contiguous [B, R, H, L, D], or as views of [B, R, L, H, D] memory "
                         "(heads split out of a fused projection, as the blocks pass them)")
    ap.add_argument("--render", nargs="*", help="re-render md + png from these CSV files, no measuring")
    return ap


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.backends is None:
        args.backends = list(CROP_BACKENDS if args.set == "crop" else DEFAULT_BACKENDS)
    if args.time_limit is None:
        args.time_limit = CROP_TIME_LIMIT if args.set == "crop" else float("inf")
    return args


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    csv_path, md_path, png_path = (os.path.join(args.out, f"attention.{e}") for e in ("csv", "md", "png"))
    if args.render:
        rows = [r for p in args.render for r in csv.DictReader(open(p))]
        env = open(args.render[0].replace(".csv", ".env")).read().strip() if os.path.exists(
            args.render[0].replace(".csv", ".env")) else "environment: see CSV source"
        if rows and "host_ms" in rows[0]:
            write_crop_md(rows, os.path.join(args.out, "crop.md"), env)
            return
        write_md(rows, md_path, env)
        write_png(rows, png_path)
        return

    def pick(names):
        return [n for n in names if not args.shapes or any(s in n for s in args.shapes)]

    if args.set == "crop":
        env = environment()
        crop_csv = os.path.join(args.out, "crop.csv")
        with open(crop_csv.replace(".csv", ".env"), "w") as fh:
            fh.write(env + "\n")
        print(env, flush=True)
        shapes = [s for s in crop_shapes() if not args.shapes or any(x in crop_name(*s) + " " for x in args.shapes)]
        rows = run_crop(crop_cases(shapes, args.backends), crop_csv, args.time_limit, args.profile)
        write_crop_md(rows, os.path.join(args.out, "crop.md"), env)
        print(open(os.path.join(args.out, "crop.md")).read(), flush=True)
        return

    cases = []
    if args.set in ("bias", "all"):
        cases += list(bias_cases(pick(BIAS_SHAPES), [b for b in args.backends if not b.startswith("sdpa ")],
                                 heads_last=args.layout == "heads-last"))
    if args.set in ("long", "all"):
        cases += list(long_cases(pick(LONG_SHAPES), [b for b in args.backends if b not in ("sdpa",)]))
    env = environment() + ("; q, k, v heads-last views of [B, R, L, H, D]" if args.layout == "heads-last" else "")
    with open(csv_path.replace(".csv", ".env"), "w") as fh:
        fh.write(env + "\n")
    print(env, flush=True)
    rows = []
    with open(csv_path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, FIELDS)
        wr.writeheader()
        for set_name, shape, be, make, flops, skip in cases:
            row = dict(set=set_name, shape=shape, backend=be, fwd_ms="", fwdbwd_ms="", tflops="", peak_mib="",
                       note=skip or "")
            if not skip:
                try:
                    if args.profile and be.startswith("triton"):
                        profile_triton(make)
                    f_ms, s_ms, peak = measure(make, f"{shape}/{be}")
                    row.update(fwd_ms=f"{f_ms:.4f}", fwdbwd_ms=f"{s_ms:.4f}",
                               tflops=f"{3.5 * flops / (s_ms * 1e-3) / 1e12:.1f}", peak_mib=f"{peak:.0f}")
                except Exception as exc:  # a peer that fails on a shape is a result, not a crash
                    row["note"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                    traceback.print_exc(limit=2)
                torch.cuda.empty_cache()
            print(row, flush=True)
            rows.append(row)
            wr.writerow(row)
            fh.flush()
    try:
        from attn_ops.triton.tuning import chosen
        with open(os.path.join(args.out, "triton_configs.txt"), "w") as fh:
            for k, c in chosen().items():
                fh.write(f"{k}: {c}\n")
    except Exception:
        pass
    write_md(rows, md_path, env)
    write_png(rows, png_path)


if __name__ == "__main__":
    main()
