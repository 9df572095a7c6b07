"""Benchmark zoo models converted to this project's blocks against the originals: same process, same weights.

Cases (bf16 autocast, fp32 parameters, random weights; time = median step, peak = ``torch.cuda.max_memory_allocated``
of the timed steps with only the measured model on the device, parameters and gradients included; first step = the
first call's wall time, compiles and autotuning included):
- ``esmc``: ESM C 600M (36 layers, 1152 wide, 18 heads). Hugging Face ``EsmcForMaskedLM`` with ``attn_implementation``
  ``sdpa`` / ``flash_attention_2`` (when ``flash_attn`` imports) / ``attn_zoo.patch``, against ours
  (``models/esmc.py``, built by ``from_esmc`` from the HF model's weights) on the triton backend: a masked-LM
  training step (fwd + bwd, no optimizer) at 4 x 1024 padded from random lengths 300-1024; tokens/s counts real
  (non-padding) tokens. ``diff_vs_ref``: the first step's loss against HF sdpa's.
- ``af2-evoformer``: one ``EvoformerBlock(variant="alphafold2")`` (c_m 256, c_z 128), 512 MSA sequences (the last 48
  padding), N = 384 (the last 37 residues padding): a training step (fwd + bwd into the inputs, dropout on) and
  inference (eval, no grad) per attention backend (triton, torch, flex). ``diff_vs_ref``: the first step's loss
  (training) or the pair output on real positions (inference) against the first backend's. AlphaFold 2's own
  Evoformer is JAX/Haiku: its row is not measured and says which of jax, a JAX CUDA plugin, dm-haiku and
  alphafold the Python running the bench has.

Writes ``zoo.csv`` and ``zoo.md`` to ``--out`` (default ``$OUT`` or ``bench_out``), rewritten after every row.

    python scripts/bench_zoo.py                  # on a GPU
    python scripts/bench_zoo.py --smoke          # tiny shapes on any device: checks that the script runs
On a device without CUDA the triton backend runs as ``torch`` (the Triton interpreter's bf16 is wrong).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import astuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attn_zoo  # noqa: E402
from attn_ops.registry import BACKENDS  # noqa: E402
from attn_ops import wait_compiles  # noqa: E402
from attn_zoo.models.compiling import compile_module  # noqa: E402
from attn_zoo.models.esmc import ESMC_CONFIGS  # noqa: E402
from bench_blocks import _randomize, attention_config  # noqa: E402
from bench_patch import (cleanup, emitter, env_lines, is_oom, mlm_batch, mlm_step, parser, profile_step,  # noqa: E402
                         rel_diff, start)

FIELDS = ["case", "shape", "variant", "ms", "tokens_per_s", "peak_gib", "first_step_s", "diff_vs_ref", "note"]
EVO_BACKENDS = ("triton", "torch", "flex")
HF_ATTN = ("sdpa", "flash_attention_2", "attn_zoo.patch")

FULL = dict(
    esmc=dict(zip(("layers", "width", "heads", "ffn"), astuple(ESMC_CONFIGS["600M"]))),
    esmc_shape=(4, 1024, (300, 1024)),
    evo=dict(c_m=256, c_z=128),
    evo_shape=(512, 48, 384, 37),  # MSA rows, padded rows, residues, padded residues
)
SMOKE = dict(
    esmc=dict(layers=2, width=64, heads=4, ffn=192),
    esmc_shape=(3, 24, (9, 24)),
    evo=dict(c_m=32, c_z=16, num_heads_msa=2, c_hidden_msa=16, num_heads_pair=2, c_hidden_pair=16, c_hidden_opm=8,
             c_hidden_mul=16),
    evo_shape=(6, 2, 12, 3),
)


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend a row runs on: triton needs CUDA, else it runs as torch (the fastest attn_ops backend at smoke
    sizes on a CPU; the Triton interpreter computes bf16 wrongly, so TRITON_INTERPRET=1 does not bring triton)."""
    if name == "triton" and device.type != "cuda":
        return "torch"
    return name


def first_timed(fn, device):
    """``fn`` whose first call also records its wall time (s) in ``.seconds``; background kernel compiles it
    started are waited for, so that the timed steps run the final kernels."""
    state = {}

    def wrapped():
        if "s" in state:
            return fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        state["s"] = time.perf_counter() - t0
        wait_compiles()
        return out

    wrapped.state = state
    return wrapped


def run_row(emit, timer, device, row, fn, ref, tokens=None):
    """Time one variant into ``row``; returns the first step's result (the reference for later variants)."""
    fn = first_timed(fn, device)
    try:
        ms, peak, first = timer(fn)
        row.update(ms=f"{ms:.2f}", peak_gib="" if peak != peak else f"{peak:.2f}", first_step_s=f"{fn.state['s']:.2f}")
        if tokens:
            row["tokens_per_s"] = f"{tokens / ms * 1e3:.0f}"
        if ref is not None:
            row["diff_vs_ref"] = f"{rel_diff(first, ref):.2e}"
        ref = first if ref is None else ref
    except Exception as exc:  # an OOM (or a failure) is a row, not the end of the run
        row["note"] = (row.get("note", "") + " " if row.get("note") else "") + (
            "OOM" if is_oom(exc) else f"failed: {type(exc).__name__}: {exc}")
        if not is_oom(exc):
            import traceback

            traceback.print_exc()
    cleanup(device)
    emit(row)
    return ref


# ------------------------------------------------------------------------------------------------
# ESM C: Hugging Face EsmcForMaskedLM vs ours
# ------------------------------------------------------------------------------------------------
def esmc_batch(B, L, lengths, device):
    """MLM inputs in ESM C's alphabet: ``<cls>`` residues ``<eos>`` then ``<pad>``; 15% of the residues are
    targets, replaced by ``<mask>`` in the input. (input ids, target ids, target positions, 0/1 real mask)"""
    from attn_zoo.models.esmc import ALPHABET

    tokens, target, real = mlm_batch(B, L, lengths, device)
    n = real.sum(1)
    pos = torch.arange(L, device=device)[None]
    tokens = tokens.masked_fill(pos == 0, ALPHABET.cls_idx).masked_fill(pos == n[:, None] - 1, ALPHABET.eos_idx)
    target = target & (pos > 0) & (pos < n[:, None] - 1)
    return tokens.masked_fill(target, ALPHABET.mask_idx), tokens, target, real


def bench_esmc(cfg, device, timer, backend, emit, hf_attn=HF_ATTN, compiled=False):
    import transformers

    from attn_zoo.models.zoo import from_esmc  # (zoo re-exports it; importing zoo_esmc first is circular)

    if not hasattr(transformers, "EsmcForMaskedLM"):
        emit(dict(case="esmc", note=f"skipped: transformers {transformers.__version__} has no EsmcForMaskedLM"))
        return
    c = cfg["esmc"]
    config = transformers.EsmcConfig(hidden_size=c["width"], intermediate_size=c["ffn"], num_hidden_layers=c["layers"],
                                     num_attention_heads=c["heads"])
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.EsmcForMaskedLM(config).float().train()
    ours = from_esmc(hf.state_dict(), config=config, attention={"backend": backend}).float().train()
    B, L, lengths = cfg["esmc_shape"]
    inp, tokens, target, am = esmc_batch(B, L, lengths, device)
    real = int(am.sum())
    shape = f"{B}x{L} padded ({lengths[0]}-{lengths[1]}), {real} real tokens"
    ref = None

    def hf_logits(_):
        return hf(input_ids=inp, attention_mask=am).logits

    for attn in hf_attn:
        row = dict(case="esmc", shape=shape, variant=f"HF {attn}")
        if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            emit(dict(row, note="skipped: flash_attn is not installed"))
            continue
        hf.to(device)
        attn_zoo.unpatch(hf)
        try:
            if attn == "attn_zoo.patch":
                attn_zoo.patch(hf, backend=backend)
                row["variant"] = f"HF attn_zoo.patch({backend})"
            else:
                hf.set_attn_implementation(attn)
        except Exception as exc:  # e.g. flash-attention refusing this device
            emit(dict(row, note=f"skipped: {type(exc).__name__}: {exc}"))
            continue
        fn = lambda: mlm_step(hf_logits, hf, tokens, target, device)  # noqa: E731
        ref = run_row(emit, timer, device, row, fn, ref, real)
        if cfg.get("profile"):
            profile_step(cfg["profile"], f"esmc {shape} {row['variant']}", fn, device)
        if compiled and attn == "sdpa":  # the same model under torch.compile (Inductor), its first step compiling
            hf_compiled = torch.compile(hf)
            fn = lambda: mlm_step(lambda _: hf_compiled(input_ids=inp, attention_mask=am).logits, hf, tokens,  # noqa: E731
                                  target, device)
            run_row(emit, timer, device, dict(case="esmc", shape=shape, variant="HF sdpa, torch.compile"), fn, ref,
                    real)
            torch._dynamo.reset()
    attn_zoo.unpatch(hf)
    hf.to("cpu")
    cleanup(device)
    ours.to(device)
    row = dict(case="esmc", shape=shape, variant=f"ours from_esmc ({backend})")
    fn = lambda: mlm_step(lambda t: ours(inp)["logits"], ours, tokens, target, device)  # noqa: E731
    run_row(emit, timer, device, row, fn, ref, real)
    if cfg.get("profile"):
        profile_step(cfg["profile"], f"esmc {shape} {row['variant']}", fn, device)
    for mode in (("default", "reduce-overhead") if compiled else ()):
        ours_compiled = compile_module(ours, mode=None if mode == "default" else mode)
        fn = lambda: mlm_step(lambda t: ours_compiled(inp)["logits"], ours, tokens, target, device)  # noqa: E731
        run_row(emit, timer, device, dict(case="esmc", shape=shape, variant=f"ours from_esmc ({backend}), "
                                          f"compile_module {mode}"), fn, ref, real)
        torch._dynamo.reset()
    del hf, ours
    cleanup(device)


# ------------------------------------------------------------------------------------------------
# AF2 Evoformer block per backend
# ------------------------------------------------------------------------------------------------
def jax_note() -> str:
    """Why the original (AlphaFold 2's JAX/Haiku Evoformer) has no row: which of its packages this Python lacks.
    Only looked up, never imported: JAX would claim most of the GPU's memory beside torch."""
    have = {name: importlib.util.find_spec(mod) is not None for name, mod in (
        ("jax", "jax"), ("a JAX CUDA plugin", "jax_plugins"), ("dm-haiku", "haiku"), ("alphafold", "alphafold"))}
    return ("not measured: the original Evoformer is AlphaFold 2's JAX/Haiku code, not run in this torch process; "
            + ", ".join(f"{k} {'found' if v else 'missing'}" for k, v in have.items()))


def bench_evoformer(cfg, device, timer, backends, emit):
    from attn_zoo.models.evoformer import EvoformerBlock

    emit(dict(case="af2-evoformer", variant="AlphaFold 2 (JAX)", note=jax_note()))
    S, S_pad, N, N_pad = cfg["evo_shape"]
    c = cfg["evo"]
    g = torch.Generator().manual_seed(1)
    m = torch.randn(1, S, N, c["c_m"], generator=g).to(device)
    z = torch.randn(1, N, N, c["c_z"], generator=g).to(device)
    res = torch.arange(N, device=device) < N - N_pad  # [N]
    seq = torch.arange(S, device=device) < S - S_pad  # [S]
    msa_mask = (seq[:, None] & res[None, :])[None]  # [1, S, N]
    pair_mask = (res[:, None] & res[None, :])[None]  # [1, N, N]
    shape = f"S={S} ({S_pad} padded), N={N} ({N_pad} padded)"
    torch.manual_seed(0)
    state = None
    refs, done = {}, set()
    for name in backends:
        be = resolve_backend(name, device)
        if be in done:  # triton standing in as torch on a CPU
            continue
        done.add(be)
        block = EvoformerBlock(**c, attention=attention_config(be), variant="alphafold2")
        if state is None:
            _randomize(block)  # AF2's zero-initialised output layers would hide the attention's work
            state = {k: v.clone() for k, v in block.state_dict().items()}
        block.load_state_dict(state)
        block.to(device)
        mf, sf = msa_mask[..., None].float(), pair_mask[..., None].float()

        def train():
            block.train()
            torch.manual_seed(0)  # the same dropout masks for every backend
            mg, zg = m.clone().requires_grad_(True), z.clone().requires_grad_(True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                mo, zo = block(mg, zg, msa_mask, pair_mask)
            loss = (mo.float().square() * mf).sum() / mf.sum() + (zo.float().square() * sf).sum() / sf.sum()
            loss.backward()
            block.zero_grad(set_to_none=True)
            return loss.detach()

        def infer():
            block.eval()
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                _, zo = block(m, z, msa_mask, pair_mask)
            return zo[0][res][:, res].float()

        grad_devices = BACKENDS[be].grad_devices or BACKENDS[be].devices
        for mode, fn in (("train step", train), ("inference", infer)):
            row = dict(case="af2-evoformer", shape=f"{shape}, {mode}", variant=be)
            if mode == "train step" and device.type not in grad_devices:
                emit(dict(row, note=f"skipped: {be} has no backward on {device.type}"))
                continue
            refs[mode] = run_row(emit, timer, device, row, fn, refs.get(mode))
        del block
        cleanup(device)


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------
def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--cases", nargs="+", default=["esmc", "af2-evoformer"], choices=["esmc", "af2-evoformer"])
    p.add_argument("--backends", nargs="+", default=list(EVO_BACKENDS), choices=list(EVO_BACKENDS),
                   help="the Evoformer's attention backends (the first is the reference of diff_vs_ref)")
    p.add_argument("--hf-attn", nargs="+", default=list(HF_ATTN), choices=list(HF_ATTN),
                   help="the Hugging Face ESM C's attention (the first is the reference of diff_vs_ref)")
    p.add_argument("--profile", action="store_true", help="also profile each ESM C step (zoo_profile.txt)")
    p.add_argument("--compile", action="store_true",
                   help="ESM C also compiled: Hugging Face's under torch.compile, ours under compile_module (default "
                        "and reduce-overhead)")
    args, device, timer = start(p, argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    if args.profile:
        cfg["profile"] = os.path.join(args.out, "zoo_profile.txt")
    backend = resolve_backend("triton", device)
    env = env_lines(device, backend)[:-1] + [
        f"- bf16 autocast, fp32 parameters, random weights; ours on {backend}; "
        f"{timer.iters} timed steps after {timer.warmup} warm-up"]
    rows = []
    emit = emitter(args.out, "zoo", "Zoo models: converted vs original", env, rows, FIELDS)

    for name in args.cases:
        if name == "esmc":
            bench_esmc(cfg, device, timer, backend, emit, args.hf_attn, args.compile)
        else:
            bench_evoformer(cfg, device, timer, args.backends, emit)
    return rows


if __name__ == "__main__":
    main()
