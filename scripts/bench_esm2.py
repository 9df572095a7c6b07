"""Benchmark ESM-2 650M training steps: attn-zoo (triton backend) vs fair-esm and Hugging Face, same weights.

One process, one set of weights: fair-esm's own randomly initialised ``ESM2(33, 1280, 20)`` (no download),
converted with ``models/zoo.py`` into attn-zoo's ESM-2 (``from_fair_esm``) and into Hugging Face's
``EsmForMaskedLM`` (``to_hf_esm``; ``attn_implementation`` sdpa and eager). Every model runs the same MLM step:
random residues, 12% replaced by ``<mask>``, cross-entropy on the masked positions, forward + backward under
bf16 autocast with fp32 parameters, gradients to None between steps. Only the model being measured sits on
the GPU, so peak memory is the whole step's (parameters, gradients and activations).

1. Parity on the GPU: fp32 logits / last representation of attn-zoo (triton, fp32) vs fair-esm fp32 (max
   relative error < 1e-5); bf16: attn-zoo's error vs fair-esm fp32 within 2x fair-esm bf16's own error.
2. Throughput (tokens/s) and peak memory at 8 x 512, 4 x 1024, 1 x 4096 (OOM recorded, not fatal).
3. Longest length that fits (batch 1), a doubling search from 1024 with OOM caught and a time cap per model.

``attn-zoo+ckpt`` is the same attn-zoo module with ``activation_checkpointing=True``. ``+compile``: the whole model
under ``torch.compile`` (default mode); ``+graphs``: ``mode="reduce-overhead"`` (CUDA graphs: no host time per
kernel; its peak counts the memory the graphs' pool keeps reserved). Compiling happens in the warm-up steps,
outside the timed ones; compiled rows skip the longest-length search (every length would compile afresh).
Writes ``esm2.csv`` and ``esm2.md`` to ``--out`` (default ``$OUT`` or ``bench_out``), rewritten after every
row. Imports: torch, triton, attn_zoo, ``esm`` (fair-esm) and ``transformers`` (with its dependencies
huggingface-hub, tokenizers, safetensors, regex, pyyaml, tqdm, typer, packaging).

    python scripts/bench_esm2.py                       # the full run (H100: ~6 min)
    python scripts/bench_esm2.py --size 8M --max-len 8192 --search-time 20     # a quick look
"""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attn_zoo.models.esm2 import ALPHABET, esm2_config  # noqa: E402
from attn_zoo.models.zoo import from_fair_esm, to_hf_esm  # noqa: E402

GIB = 2.0 ** 30
MODELS = ("attn-zoo", "attn-zoo+ckpt", "attn-zoo+compile", "attn-zoo+graphs", "fair-esm", "fair-esm+compile",
          "fair-esm+graphs", "hf-sdpa", "hf-eager")
COMPILE_MODES = {"+compile": "default", "+graphs": "reduce-overhead"}  # name suffix -> torch.compile mode
SHAPES = ((8, 512), (4, 1024), (1, 4096))  # (batch, length incl. <cls>/<eos>)
RESIDUES = [ALPHABET.get_idx(c) for c in "LAGVSERTIDPKQNFYMHWC"]


# ------------------------------------------------------------------------------------------------
# Models and inputs
# ------------------------------------------------------------------------------------------------
def build_models(size: str, models, attention: str = "triton"):
    """fair-esm's random init, and the same weights in attn-zoo (its attention on backend ``attention``) and
    Hugging Face (all fp32, on the CPU)."""
    import esm
    from esm.model.esm2 import ESM2 as FairESM2

    cfg = esm2_config(size)
    torch.manual_seed(0)
    fair = FairESM2(cfg.num_layers, cfg.embed_dim, cfg.attention_heads,
                    esm.data.Alphabet.from_architecture("ESM-1b")).eval()
    ours = from_fair_esm(fair.state_dict(), attention=attention)
    out = {"fair-esm": fair, "attn-zoo": ours}
    hf_names = [m for m in models if m.startswith("hf-")]
    if hf_names:
        from transformers import EsmConfig, EsmForMaskedLM

        sd, config = to_hf_esm(ours)
        for name in hf_names:
            hf = EsmForMaskedLM._from_config(EsmConfig(**config), attn_implementation=name[len("hf-"):])
            hf.load_state_dict(sd, strict=True)
            out[name] = hf.eval()
    return out


def forward_fn(name: str, model):
    """tokens -> logits for each kind of model (no padding in these batches: HF gets no attention mask)."""
    mode = next((m for suffix, m in COMPILE_MODES.items() if name.endswith(suffix)), None)
    if mode is not None:
        torch._dynamo.reset()
        compiled = torch.compile(model, mode=mode)
        return lambda tokens: compiled(tokens)["logits"]
    if name.startswith("hf-"):
        return lambda tokens: model(input_ids=tokens).logits
    return lambda tokens: model(tokens)["logits"]


def mlm_batch(batch: int, length: int, device, seed: int = 0):
    """``<cls>`` + random residues + ``<eos>``; 12% of residues replaced by ``<mask>`` (the loss positions)."""
    g = torch.Generator().manual_seed(seed)
    res = torch.tensor(RESIDUES)[torch.randint(0, len(RESIDUES), (batch, length - 2), generator=g)]
    target = torch.cat([torch.full((batch, 1), ALPHABET.cls_idx), res, torch.full((batch, 1), ALPHABET.eos_idx)], 1)
    masked = torch.zeros_like(target, dtype=torch.bool)
    masked[:, 1:-1] = torch.rand(batch, length - 2, generator=g) < 0.12
    tokens = target.masked_fill(masked, ALPHABET.mask_idx)
    return tokens.to(device), target.to(device), masked.to(device)


def train_step(fwd, model, tokens, target, masked):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = fwd(tokens)
    loss = torch.nn.functional.cross_entropy(logits[masked].float(), target[masked])
    loss.backward()
    model.zero_grad(set_to_none=True)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def cleanup():
    gc.collect()
    torch.cuda.empty_cache()


def measure(name, model, batch, length, iters, warmup):
    """(median ms per step, peak GiB of a step, all on the GPU)."""
    model.train()
    fwd = forward_fn(name, model)
    tokens, target, masked = mlm_batch(batch, length, "cuda")
    compiled = any(name.endswith(suffix) for suffix in COMPILE_MODES)
    if compiled and name.startswith("fair-esm"):
        # fair-esm caches its rotary tables on the module at the first call of each length: made inside a CUDA graph
        # (reduce-overhead) they are graph outputs that the next replay overwrites, so build them here, eagerly, as
        # any earlier call of that length would have
        with torch.no_grad():
            model(tokens[:1])
    for _ in range(max(warmup, 3) if compiled else warmup):  # CUDA graphs: a warm-up run, a recording, a replay
        train_step(fwd, model, tokens, target, masked)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        train_step(fwd, model, tokens, target, masked)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    peak = torch.cuda.max_memory_allocated()
    if name.endswith("+graphs"):
        # reduce-overhead keeps the step's tensors in CUDA graphs' private pool, outside the allocated peak after a
        # reset: the memory still reserved once the cache is emptied counts instead where larger (an upper bound,
        # fragmentation included: the row's note says so)
        torch.cuda.empty_cache()
        peak = max(peak, torch.cuda.memory_reserved())
    return statistics.median(times), peak / GIB


# ------------------------------------------------------------------------------------------------
# Parity
# ------------------------------------------------------------------------------------------------
def rel_err(x, ref):
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def parity(models, length: int, device: str = "cuda"):
    """fp32 and bf16 checks of attn-zoo (triton) against fair-esm on the GPU; rows for the table."""
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the peer's matmuls too
    fair, ours = models["fair-esm"].to(device).eval(), models["attn-zoo"].to(device).eval()
    layers = ours.num_layers
    bc = ALPHABET.get_batch_converter()
    g = torch.Generator().manual_seed(1)
    seqs = ["".join(ALPHABET.get_tok(RESIDUES[i]) for i in torch.randint(0, 20, (n,), generator=g).tolist())
            for n in (length - 2, length // 2 + 3)]
    seqs[0] = seqs[0][:10] + "<mask>" + seqs[0][11:]
    tokens = bc([("a", seqs[0]), ("b", seqs[1])])[2].to(device)  # the second row padded: real key-mask holes
    rows = []
    with torch.no_grad():
        ref = fair(tokens, repr_layers=[layers])
        mine = ours(tokens, repr_layers=[layers])
        for what, a, b in (("logits", mine["logits"], ref["logits"]),
                           (f"representation {layers}", mine["representations"][layers], ref["representations"][layers])):
            e = rel_err(a, b)
            rows.append(dict(check=f"fp32 {what}: attn-zoo triton vs fair-esm", value=f"{e:.2e}",
                             bound="1e-5", ok=e < 1e-5))
        with torch.autocast(device, dtype=torch.bfloat16):
            fair16 = fair(tokens, repr_layers=[layers])
            mine16 = ours(tokens, repr_layers=[layers])
        for what, key in (("logits", None), (f"representation {layers}", layers)):
            pick = (lambda o: o["logits"]) if key is None else (lambda o, k=key: o["representations"][k])
            e_fair, e_mine = rel_err(pick(fair16), pick(ref)), rel_err(pick(mine16), pick(ref))
            rows.append(dict(check=f"bf16 {what} vs fair-esm fp32: attn-zoo triton {e_mine:.2e}, "
                                   f"fair-esm bf16 {e_fair:.2e}", value=f"{e_mine / e_fair:.2f}x",
                             bound="2x", ok=e_mine <= 2 * e_fair))
    fair.cpu(), ours.cpu()
    cleanup()
    return rows


# ------------------------------------------------------------------------------------------------
# Longest length
# ------------------------------------------------------------------------------------------------
def longest(name, model, max_len: int, time_cap: float, deadline: float):
    """Doubling search (batch 1) from 1024: (longest length that trained, why the search stopped)."""
    fwd = forward_fn(name, model)
    model.train()
    best, length, t0, last = 0, 1024, time.time(), 0.0
    while length <= max_len:
        left = min(t0 + time_cap, deadline) - time.time()
        if last and 4.5 * last > left:  # attention time grows ~4x per doubling
            return best, f"time cap before {length}"
        try:
            t1 = time.time()
            tokens, target, masked = mlm_batch(1, length, "cuda")
            train_step(fwd, model, tokens, target, masked)
            torch.cuda.synchronize()
            last = time.time() - t1
            best = length
        except Exception as exc:
            if not is_oom(exc):
                traceback.print_exc()
            why = "OOM" if is_oom(exc) else f"{type(exc).__name__}"
            tokens = target = masked = None
            model.zero_grad(set_to_none=True)
            cleanup()
            return best, f"{why} at {length}"
        length *= 2
    return best, f"reached --max-len {max_len}"


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------
def env_lines(size):
    import triton

    props = torch.cuda.get_device_properties(0)
    return [
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M')}",
        f"- GPU: {props.name}, {props.total_memory / GIB:.0f} GiB; torch {torch.__version__}, triton "
        f"{triton.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}",
        f"- ESM-2 {size}, fair-esm's random init converted to each model; MLM step fwd+bwd, bf16 autocast, fp32 params;",
        "  time = median step; peak = torch.cuda.max_memory_allocated over the timed steps (params + grads + activations)",
    ]


def write(out, env, parity_rows, rows, search_rows, notes):
    with open(os.path.join(out, "esm2.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["section", "model", "batch", "length", "ms", "tokens_per_s", "peak_gib", "note"])
        w.writeheader()
        for r in parity_rows:
            w.writerow(dict(section="parity", model=r["check"], note=f"{r['value']} (bound {r['bound']}) "
                                                                      f"{'PASS' if r['ok'] else 'FAIL'}"))
        for r in rows:
            w.writerow(dict(section="throughput", **r))
        for r in search_rows:
            w.writerow(dict(section="longest", model=r["model"], length=r["length"], note=r["note"]))
    with open(os.path.join(out, "esm2.md"), "w") as f:
        f.write("# ESM-2 benchmark (scripts/bench_esm2.py)\n\n" + "\n".join(env) + "\n\n## Parity on the GPU\n\n")
        f.write("| check | value | bound | |\n|---|---|---|---|\n")
        for r in parity_rows:
            f.write(f"| {r['check']} | {r['value']} | {r['bound']} | {'PASS' if r['ok'] else 'FAIL'} |\n")
        f.write("\n## Training step\n\n| model | batch x length | ms/step | tokens/s | peak GiB | vs fair-esm "
                "(tokens/s, peak) | note |\n|---|---|---|---|---|---|---|\n")
        fair = {(r["batch"], r["length"]): r for r in rows if r["model"] == "fair-esm" and r["ms"] != ""}
        for r in rows:
            ref = fair.get((r["batch"], r["length"]))
            vs = (f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x, {r['peak_gib'] / ref['peak_gib']:.2f}x"
                  if ref and r["ms"] != "" else "")
            ms = f"{r['ms']:.1f}" if r["ms"] != "" else "-"
            tps = f"{r['tokens_per_s']:,.0f}" if r["ms"] != "" else "-"
            peak = f"{r['peak_gib']:.2f}" if r["ms"] != "" else "-"
            f.write(f"| {r['model']} | {r['batch']} x {r['length']} | {ms} | {tps} | {peak} | {vs} | {r['note']} |\n")
        f.write("\n## Longest length that trains (batch 1, doubling from 1024)\n\n| model | longest | vs fair-esm | "
                "stopped by |\n|---|---|---|---|\n")
        fair_len = next((r["length"] for r in search_rows if r["model"] == "fair-esm"), None)
        for r in search_rows:
            vs = f"{r['length'] / fair_len:.0f}x" if fair_len and r["length"] else ""
            f.write(f"| {r['model']} | {r['length'] or '-'} | {vs} | {r['note']} |\n")
        for n in notes:
            f.write(f"\n{n}\n")


def targets(rows, search_rows):
    """The targets against fair-esm (speed, memory, longest length), as lines for the markdown."""
    get = {(r["model"], r["batch"], r["length"]): r for r in rows if r["ms"] != ""}
    lines = []
    ours, fair = get.get(("attn-zoo", 4, 1024)), get.get(("fair-esm", 4, 1024))
    if ours and fair:
        t, m = ours["tokens_per_s"] / fair["tokens_per_s"], ours["peak_gib"] / fair["peak_gib"]
        lines.append(f"- 4 x 1024: attn-zoo {t:.2f}x fair-esm's tokens/s (target >= 2x: {'met' if t >= 2 else 'MISSED'}),"
                     f" {m:.2f}x its peak memory (target <= 0.5x: {'met' if m <= 0.5 else 'MISSED'})")
    lens = {r["model"]: r["length"] for r in search_rows}
    if lens.get("fair-esm"):
        best = max(lens.get("attn-zoo", 0), lens.get("attn-zoo+ckpt", 0))
        lines.append(f"- longest: attn-zoo {best} vs fair-esm {lens['fair-esm']} ({best / lens['fair-esm']:.0f}x; "
                     f"target >= 4x: {'met' if best >= 4 * lens['fair-esm'] else 'MISSED'})")
    return ["## Targets\n\n" + "\n".join(lines)] if lines else []


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--size", default="650M")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--attention", default="triton",
                   help="attn-zoo's attention backend (default triton; cudnn: cuDNN's deterministic backward, "
                        "unpadded batches only)")
    p.add_argument("--shapes", nargs="+", default=[f"{b}x{n}" for b, n in SHAPES],
                   help="batch x length pairs, e.g. 4x1024 (default: %(default)s)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--parity-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=131072, help="the doubling search stops here")
    p.add_argument("--search-time", type=float, default=60.0, help="seconds of doubling search per model")
    p.add_argument("--time-limit", type=float, default=450.0, help="start nothing new after this many s")
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    except ValueError:
        p.error(f"--shapes takes BATCHxLENGTH pairs such as 4x1024, got {args.shapes}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_esm2.py needs a CUDA device")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.time_limit
    env = env_lines(args.size)
    models = build_models(args.size, args.models, args.attention)
    notes = [f"- models built in {time.time() - t0:.0f} s; attn-zoo rows on attention backend {args.attention!r}"]
    parity_rows, rows, search_rows = [], [], []
    try:
        parity_rows = parity(models, args.parity_len)
    except Exception as exc:
        traceback.print_exc()
        notes.append(f"- parity failed: {type(exc).__name__}: {exc}")
    write(args.out, env, parity_rows, rows, search_rows, notes)

    for name in args.models:
        model = models[name.split("+")[0]]
        if name.startswith("attn-zoo"):
            model.activation_checkpointing = name.endswith("+ckpt")
        model.cuda()
        for batch, length in shapes:
            row = dict(model=name, batch=batch, length=length, ms="", tokens_per_s="", peak_gib="", note="")
            if time.time() > deadline:
                row["note"] = "skipped: time limit"
            else:
                try:
                    row["ms"], row["peak_gib"] = measure(name, model, batch, length, args.iters, args.warmup)
                    row["tokens_per_s"] = batch * length / (row["ms"] / 1e3)
                    if name.endswith("+graphs"):
                        row["note"] = "peak: memory reserved after the cache is emptied (the graphs' pool)"
                except Exception as exc:
                    row["note"] = "OOM" if is_oom(exc) else f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                    if not is_oom(exc):
                        traceback.print_exc()
                    model.zero_grad(set_to_none=True)
                    cleanup()
            rows.append(row)
            print(row, flush=True)
            write(args.out, env, parity_rows, rows, search_rows, notes + targets(rows, search_rows))
        if time.time() < deadline and "+compile" not in name and "+graphs" not in name:
            best, why = longest(name, model, args.max_len, args.search_time, deadline)
            search_rows.append(dict(model=name, length=best, note=why))
            print(search_rows[-1], flush=True)
        model.cpu()
        cleanup()
        write(args.out, env, parity_rows, rows, search_rows, notes + targets(rows, search_rows))
    notes.append(f"- total {time.time() - t0:.0f} s")
    write(args.out, env, parity_rows, rows, search_rows, notes + targets(rows, search_rows))


if __name__ == "__main__":
    main()
