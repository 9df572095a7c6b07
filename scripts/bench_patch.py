"""Benchmark ``attn_zoo.patch`` on other projects' models: the same model and weights, patched vs its own attention.

Cases (bf16 autocast, fp32 parameters; time = median step, peak = ``torch.cuda.max_memory_allocated`` of the timed
steps, parameters and gradients included):
- ``hf-esm2``: Hugging Face ``EsmForMaskedLM`` shaped as ESM-2 650M (33 layers, 1280 wide, 20 heads), random
  weights; an MLM training step (fwd + bwd) with ``attn_implementation`` ``sdpa`` vs ``attn_zoo``; 4 x 1024 padded
  from random lengths 300-1024 (``attention_mask``), and 1 x 4096.
- ``boltz2-pairformer``: Boltz-2's ``PairformerLayer`` at its default widths (c_s 384, c_z 128, 16 heads; pair
  heads 4 x 32): its own layer, with cuEquivariance (``use_kernels``, when ``cuequivariance_torch`` imports), patched,
  and patched beside cuEquivariance's triangle multiplication; a training step (fwd + bwd) and inference (no grad,
  Boltz's own ``chunk_size_tri_attn`` rule), at N = 384 and N = 299 with its last 42 tokens padded; then one layer's
  bf16 inference at N = 4096, Boltz's and patched, beside our PairformerBlock's memory-bounded path.
- ``fair-esm``: fair-esm ``ESM2(33, 1280, 20)`` (650M-shaped, random init), own attention vs patched, MLM step at
  4 x 1024 padded from the same lengths.
Each pair of rows also gives the first step's loss (or output) difference, patched vs unpatched.

Needs torch, triton, einops and transformers; the fair-esm and Boltz cases run when ``esm`` / ``boltz`` import
(boltz==2.2.1 installs with ``--no-deps``), else their rows say why they were skipped. Writes ``patch.csv`` and
``patch.md`` to ``--out`` (default ``$OUT`` or ``bench_out``), rewritten after every row.

    python scripts/bench_patch.py                  # on a GPU
    python scripts/bench_patch.py --smoke          # tiny shapes on any device: checks that the script runs
"""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import platform
import re
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attn_zoo  # noqa: E402
from attn_ops import wait_compiles  # noqa: E402

GIB = 2.0 ** 30
FIELDS = ["case", "shape", "variant", "ms", "peak_gib", "diff_vs_unpatched", "note"]

FULL = dict(
    esm=dict(hidden=1280, layers=33, heads=20, ffn=5120),
    esm_shapes=(("4x1024 padded (300-1024)", 4, 1024, (300, 1024)), ("1x4096", 1, 4096, None)),
    boltz=dict(token_s=384, token_z=128, num_heads=16, pairwise_head_width=32, pairwise_num_heads=4),
    boltz_shapes=(("N=384", 384, 0), ("N=299, 42 padded", 299, 42)),
    long_n=4096,
    fair_shapes=(("4x1024 padded (300-1024)", 4, 1024, (300, 1024)),),
)
SMOKE = dict(
    esm=dict(hidden=32, layers=2, heads=2, ffn=64),
    esm_shapes=(("3x24 padded (9-24)", 3, 24, (9, 24)), ("1x40", 1, 40, None)),
    boltz=dict(token_s=32, token_z=16, num_heads=2, pairwise_head_width=16, pairwise_num_heads=2),
    boltz_shapes=(("N=12", 12, 0), ("N=11, 3 padded", 11, 3)),
    long_n=20,
    fair_shapes=(("3x24 padded (9-24)", 3, 24, (9, 24)),),
)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------
class Timer:
    """Median wall time of ``fn`` (CUDA events on a GPU) and the peak memory of the timed calls."""

    def __init__(self, device: torch.device, iters: int, warmup: int):
        self.device, self.iters, self.warmup = device, iters, warmup

    def __call__(self, fn):
        cuda = self.device.type == "cuda"
        first = fn()
        for _ in range(self.warmup - 1):
            fn()
        if cuda and wait_compiles() > 1e-3:
            fn()  # the variants compiled in the background since the first call: one step with them before timing
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(self.iters):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t))
        peak = torch.cuda.max_memory_allocated() / GIB if cuda else float("nan")
        return statistics.median(times), peak, first


def alternate(timer, variants, rounds: int):
    """Median step time of each of ``variants`` (``(name, setup, fn)``: ``setup()`` makes ``fn`` that variant's step)
    timed in turns: every round runs each variant once (one step, then ``timer.iters`` timed), the order rotating by
    round, so that a drift in the host's speed (host-bound steps moved 25% between repeats in one process) falls on
    all variants alike. Returns ``{name: (median of the rounds' medians, fastest round, slowest round)}``."""
    t = Timer(timer.device, timer.iters, 1)
    seen = {name: [] for name, _, _ in variants}
    for r in range(rounds):
        k = r % len(variants)
        for name, setup, fn in variants[k:] + variants[:k]:
            setup()
            seen[name].append(t(fn)[0])
    return {name: (statistics.median(v), min(v), max(v)) for name, v in seen.items()}


def emit_alternated(emit, case, shape, variants, rounds, timer):
    """:func:`alternate` as one row per variant (``variant, alternating``), the spread of the rounds in its note."""
    for name, (ms, lo, hi) in alternate(timer, variants, rounds).items():
        emit(dict(case=case, shape=shape, variant=f"{name}, alternating", ms=f"{ms:.2f}",
                  note=f"median of {rounds} rounds of {timer.iters} steps, rounds {lo:.2f}-{hi:.2f} ms"))


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def cleanup(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rel_diff(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------
# Inputs and steps
# ------------------------------------------------------------------------------------------------
def mlm_batch(B, L, lengths, device, seed=0):
    """Random residues (token ids 4-23), 15% of real positions as targets; padding after each sequence's length
    (id 1, fair-esm's and ESM-2's padding index); a 0/1 mask of real positions."""
    g = torch.Generator().manual_seed(seed)
    n = torch.full((B,), L) if lengths is None else torch.randint(lengths[0], lengths[1] + 1, (B,), generator=g)
    real = torch.arange(L)[None] < n[:, None]
    tokens = torch.randint(4, 24, (B, L), generator=g).masked_fill(~real, 1)
    target = (torch.rand(B, L, generator=g) < 0.15) & real
    return tokens.to(device), target.to(device), real.long().to(device)


def mlm_step(logits_fn, model, tokens, target, device):
    torch.manual_seed(0)  # the same dropout draws in every step and variant
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = logits_fn(tokens)
    loss = torch.nn.functional.cross_entropy(logits[target].float(), tokens[target])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------
def hf_esm2(cfg, device, timer, backend, emit):
    import transformers

    c = cfg["esm"]
    config = transformers.EsmConfig(vocab_size=33, hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                                    num_attention_heads=c["heads"], intermediate_size=c["ffn"],
                                    max_position_embeddings=max(s[2] for s in cfg["esm_shapes"]) + 2,
                                    position_embedding_type="rotary", pad_token_id=1, mask_token_id=32,
                                    token_dropout=True, emb_layer_norm_before=False,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # as ESM-2's configs
    torch.manual_seed(0)
    model = transformers.EsmForMaskedLM(config).to(device).train()
    for shape, B, L, lengths in cfg["esm_shapes"]:
        tokens, target, am = mlm_batch(B, L, lengths, device)
        ref = None
        for variant in ("sdpa", "attn_zoo"):
            attn_zoo.unpatch(model)
            if variant == "attn_zoo":
                attn_zoo.patch(model, backend=backend)
            else:
                model.set_attn_implementation("sdpa")
            fn = lambda: mlm_step(lambda t: model(input_ids=t, attention_mask=am).logits, model, tokens, target, device)  # noqa: E731
            ref = run_row(emit, timer, device, "hf-esm2", shape, variant, fn, ref)
            if cfg.get("profile"):
                profile_step(cfg["profile"], f"hf-esm2 {shape} {variant}", fn, device)
    attn_zoo.unpatch(model)
    del model
    cleanup(device)


def fair_esm(cfg, device, timer, backend, emit):
    try:
        from esm.model.esm2 import ESM2
    except ImportError as exc:
        emit(dict(case="fair-esm", note=f"skipped: fair-esm does not import ({exc})"))
        return
    c = cfg["esm"]
    torch.manual_seed(0)
    model = ESM2(num_layers=c["layers"], embed_dim=c["hidden"], attention_heads=c["heads"]).to(device).train()
    for shape, B, L, lengths in cfg["fair_shapes"]:
        tokens, target, _ = mlm_batch(B, L, lengths, device)
        ref = None
        for variant in ("fair-esm", "patched"):
            attn_zoo.unpatch(model)
            if variant == "patched":
                attn_zoo.patch(model, backend=backend)
            fn = lambda: mlm_step(lambda t: model(t)["logits"], model, tokens, target, device)  # noqa: E731
            ref = run_row(emit, timer, device, "fair-esm", shape, variant, fn, ref)
    attn_zoo.unpatch(model)
    del model
    cleanup(device)


def cuequivariance_available(device) -> bool:
    """Whether Boltz's ``use_kernels`` path can run: cuequivariance's torch ops import and the device is a GPU."""
    if device.type != "cuda":
        return False
    try:
        import cuequivariance_torch  # noqa: F401
    except ImportError:
        return False
    return True


def boltz2_pairformer(cfg, device, timer, backend, emit):
    try:
        from boltz.data import const
        from boltz.model.layers.pairformer import PairformerLayer
    except ImportError as exc:
        emit(dict(case="boltz2-pairformer", note=f"skipped: boltz does not import ({exc})"))
        return
    c = cfg["boltz"]
    torch.manual_seed(0)
    layer = PairformerLayer(**c, v2=True).to(device)
    with torch.no_grad():  # Boltz zero-initialises its output projections: random weights make the diff meaningful
        for prm in layer.parameters():
            if prm.ndim >= 2:
                prm.normal_(0.0, prm.shape[-1] ** -0.5)
    # (name, patched, Boltz's kernel flags): its own layer, with cuEquivariance for both triangle ops
    # (use_kernels, Boltz's fastest), and patched, alone or beside cuEquivariance's triangle multiplication
    variants = [("boltz", False, {})]
    cue = cuequivariance_available(device)
    if cue:
        variants.append(("boltz+cue", False, dict(use_kernels=True)))
    variants.append(("patched", True, {}))
    if cue:
        variants.append(("patched+cue-mul", True, dict(use_cuequiv_mul=True)))
    else:
        print("boltz2-pairformer: cuequivariance rows skipped (cuequivariance_torch does not import, or no GPU)",
              flush=True)
    for shape, N, pad in cfg["boltz_shapes"]:
        s, z, mask, pair_mask, real = boltz_inputs(N, pad, c, device)
        chunk = 128 if N > const.chunk_size_threshold else 512  # Boltz's own inference rule

        def train(flags):
            layer.train()
            torch.manual_seed(0)  # the same dropout masks in every step and variant
            sg, zg = s.clone().requires_grad_(True), z.clone().requires_grad_(True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                so, zo = layer(sg, zg, mask, pair_mask, **flags)
            loss = so[0, real].float().square().mean() + zo[0][real][:, real].float().square().mean()
            loss.backward()
            layer.zero_grad(set_to_none=True)
            return loss.detach()

        def infer(flags):
            layer.eval()
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                so, zo = layer(s, z, mask, pair_mask, chunk_size_tri_attn=chunk, **flags)
            return zo[0][real][:, real].float()

        for mode, step in (("train step", train), (f"inference (chunk {chunk})", infer)):
            ref = None
            for variant, patched, flags in variants:
                attn_zoo.unpatch(layer)
                if patched:
                    attn_zoo.patch(layer, backend=backend)
                ref = run_row(emit, timer, device, "boltz2-pairformer", f"{shape}, {mode}", variant,
                              lambda: step(flags), ref)
                if cfg.get("profile") and step is train and variant in ("boltz+cue", "patched"):
                    profile_step(cfg["profile"], f"boltz2-pairformer {shape} train {variant}", lambda: step(flags),
                                 device)
        if cfg.get("rounds"):  # the train steps again, in turns
            def setup(patched):
                attn_zoo.unpatch(layer)
                if patched:
                    attn_zoo.patch(layer, backend=backend)

            turns = [(v, lambda p=p: setup(p), lambda f=f: train(f)) for v, p, f in variants]
            emit_alternated(emit, "boltz2-pairformer", f"{shape}, train step", turns, cfg["rounds"], timer)
    attn_zoo.unpatch(layer)
    if cfg["long_n"]:
        long_inference(layer, cfg, device, timer, backend, emit, const)
    del layer
    cleanup(device)


def boltz_inputs(N, pad, c, device):
    """Random s, z of Boltz's widths; the last ``pad`` tokens masked out."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(1, N, c["token_s"], generator=g).to(device)
    z = torch.randn(1, N, N, c["token_z"], generator=g).to(device)
    mask = (torch.arange(N) < N - pad).float()[None].to(device)
    pair_mask = mask[:, :, None] * mask[:, None, :]
    return s, z, mask, pair_mask, mask[0] > 0


def long_inference(layer, cfg, device, timer, backend, emit, const):
    """One layer's inference at a long N in bf16 (inputs bf16 too): Boltz's own (chunk 128), patched, and our
    PairformerBlock of the same widths on its memory-bounded path, whose peak the patched layer should stay within."""
    from attn_zoo.models.pairformer import PairformerBlock

    c, N = cfg["boltz"], cfg["long_n"]
    shape = f"N={N}, inference bf16"
    s, z, mask, pair_mask, _ = boltz_inputs(N, 0, c, device)
    s, z = s.bfloat16(), z.bfloat16()
    layer.eval()
    chunk = 128 if N > const.chunk_size_threshold else 512
    ref = None
    for variant in ("boltz", "patched"):
        attn_zoo.unpatch(layer)
        if variant == "patched":
            attn_zoo.patch(layer, backend=backend)

        def infer():
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                return layer(s, z, mask, pair_mask, chunk_size_tri_attn=chunk)[1][0, :64, :64].float()

        ref = run_row(emit, timer, device, "boltz2-pairformer", shape, variant, infer, ref)
    attn_zoo.unpatch(layer)
    ours = PairformerBlock(c_s=c["token_s"], c_z=c["token_z"], attention=backend).to(device, torch.bfloat16).eval()

    def bounded():
        with torch.no_grad():
            ours.forward_inference(s, z, mask > 0, pair_mask > 0, mode="bounded")

    run_row(emit, timer, device, "boltz2-pairformer", shape, "attn-zoo block, bounded", bounded, None)
    del ours
    cleanup(device)


def profile_step(path, title, fn, device):
    """Append one step's kernels by device time, its host calls by CPU time and the CUDA runtime calls that block
    the host (torch.profiler), then the Python stacks of the step's synchronizing calls
    (``torch.cuda.set_sync_debug_mode``), to ``path``: a step slower than both its CPU and its device time waits
    somewhere, and these say where."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()  # after the rows' cleanup the allocator is empty: one step refills its cache, or the profile counts mallocs
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    events = prof.key_averages()
    blocking = [e for e in events if re.match(r"cuda(Stream|Device|Event)Synchronize|cudaMemcpy|cudaMalloc|cudaFree"
                                              r"|cudaHostAlloc", e.key)]
    with open(path, "a") as f:
        f.write(f"## {title}\n\nprofiled wall {wall:.1f} ms\n\n")
        f.write(events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=25,
                             max_name_column_width=60) + "\n\n")
        f.write("### by host time\n\n" + events.table(sort_by="self_cpu_time_total", row_limit=25,
                                                         max_name_column_width=60) + "\n\n")
        f.write("### runtime calls that can block the host\n\n")
        for e in blocking:
            f.write(f"- {e.key}: {e.count} calls, {e.self_cpu_time_total / 1e3:.2f} ms\n")
        f.write("\n" if blocking else "- none\n\n")
        if cuda:
            f.write("### synchronizing calls (set_sync_debug_mode), by Python stack\n\n")
            for stack, n in sync_sites(fn).most_common(12):
                f.write(f"- {n} x\n```\n{stack}```\n")
            f.write("\n")


def sync_sites(fn):
    """Counter of the Python stacks (last frames) at which one call of ``fn`` synchronised with the device."""
    import collections
    import traceback
    import warnings

    sites = collections.Counter()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            sites["".join(traceback.format_stack(limit=9)[:-2])] += 1
        else:
            show(message, category, filename, lineno, file, line)

    torch.cuda.synchronize()
    with warnings.catch_warnings():  # (restores showwarning and the filters on exit)
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def run_row(emit, timer, device, case, shape, variant, fn, ref):
    """Time one variant; returns the first step's result (the reference for the next variant)."""
    row = dict(case=case, shape=shape, variant=variant)
    try:
        ms, peak, first = timer(fn)
        row.update(ms=f"{ms:.2f}", peak_gib="" if peak != peak else f"{peak:.2f}")
        if ref is not None:
            row["diff_vs_unpatched"] = f"{rel_diff(first, ref):.2e}"
        ref = first if ref is None else ref
    except Exception as exc:  # an OOM (or a failure) is a row, not the end of the run
        row["note"] = "OOM" if is_oom(exc) else f"failed: {type(exc).__name__}: {exc}"
        if not is_oom(exc):
            traceback.print_exc()
    cleanup(device)
    emit(row)
    return ref


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------
def env_lines(device, backend):
    lines = [f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M')}"]
    if device.type == "cuda":
        import triton

        props = torch.cuda.get_device_properties(device)
        lines.append(f"- GPU: {props.name}, {props.total_memory / GIB:.0f} GiB; torch {torch.__version__}, triton "
                     f"{triton.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}")
    else:
        lines.append(f"- device: {device}; torch {torch.__version__}, python {platform.python_version()}")
    lines.append(f"- attn_zoo.patch(backend={backend!r}); bf16 autocast, fp32 parameters; random weights")
    return lines


def write(out, name, title, env, rows, fields):
    """``out/name.csv`` and ``out/name.md`` (a table under ``title`` and the ``env`` lines): the rows so far."""
    with open(os.path.join(out, f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(f"# {title}\n\n" + "\n".join(env) + "\n\n")
        f.write("| " + " | ".join(fields) + " |\n|" + "---|" * len(fields) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r.get(k, "")) for k in fields) + " |\n")


def emitter(out, name, title, env, rows, fields):
    """``emit(row)``: appends the row to ``rows``, prints its filled fields and rewrites the tables (:func:`write`),
    so a run cut short keeps what it measured."""
    def emit(row):
        rows.append(row)
        print(" | ".join(f"{k}={row[k]}" for k in fields if row.get(k)), flush=True)
        write(out, name, title, env, rows, fields)

    return emit


def parser(doc):
    """The arguments every bench script takes first: --out and --smoke (its own follow, then :func:`start`'s)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    return p


def start(p, argv):
    """Parse (with --iters / --warmup), pick the device (CUDA, or any with --smoke), make the output folder:
    (args, device, timer)."""
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        p.error("no CUDA device: run on a GPU, or pass --smoke")
    timer = Timer(device, args.iters or (2 if args.smoke else 10), args.warmup or (1 if args.smoke else 3))
    os.makedirs(args.out, exist_ok=True)
    return args, device, timer


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--backend", default="auto", help="attn_ops backend the patched models use")
    p.add_argument("--cases", nargs="+", default=["hf-esm2", "boltz2-pairformer", "fair-esm"],
                   choices=["hf-esm2", "boltz2-pairformer", "fair-esm"])
    p.add_argument("--profile", action="store_true",
                   help="also profile each hf-esm2 step and the Boltz train steps (patch_profile.txt)")
    p.add_argument("--rounds", type=int, default=0,
                   help="then time the Boltz train-step variants again in this many alternating rounds")
    p.add_argument("--long-n", type=int, default=None, help="N of the Boltz one-layer inference rows (0: none)")
    args, device, timer = start(p, argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    if args.profile:
        cfg["profile"] = os.path.join(args.out, "patch_profile.txt")
    cfg["rounds"] = args.rounds
    if args.long_n is not None:
        cfg["long_n"] = args.long_n
    env, rows = env_lines(device, args.backend), []
    emit = emitter(args.out, "patch", "attn_zoo.patch: patched vs unpatched", env, rows, FIELDS)

    cases = {"hf-esm2": hf_esm2, "boltz2-pairformer": boltz2_pairformer, "fair-esm": fair_esm}
    for name in args.cases:
        cases[name](cfg, device, timer, args.backend, emit)
    return rows


if __name__ == "__main__":
    main()
