"""Benchmark zoo models converted to this project's blocks against the originals: same process, same weights.

Cases (bf16 autocast, fp32 parameters, random weights; time = median step, peak = ``torch.cuda.max_memory_allocated``
of the timed steps with only the measured model on the device, parameters and gradients included; first step = the
first call's wall time, compiles and autotuning included):
- ``esmc``: ESM C 600M (36 layers, 1152 wide, 18 heads). Hugging Face ``EsmcForMaskedLM`` with ``attn_implementation``
  ``sdpa`` / ``flash_attention_2`` (when ``flash_attn`` imports) / ``attn_zoo.patch``, against ours
  (``models/esmc.py``, built by ``from_esmc`` from the HF model's weights) on the triton backend: a masked-LM
  training step (fwd + bwd, no optimizer) at 4 x 1024 padded from random lengths 300-1024, ours also with its
  activation checkpointing, replayed as CUDA graphs (``models.graphs.CUDAGraphs``), and packed: the same sequences
  in one row of their real tokens (``sequence_id``; rotary positions run on over the row, which changes no score:
  rotary attention depends on position differences within a sequence), padded to a multiple of 256 so that a
  packing loader's fixed budget can replay one capture; tokens/s counts real (non-padding) tokens. ``diff_vs_ref``:
  the first step's loss against HF sdpa's. HF sdpa also runs as CUDA graphs, as ours. CUDA-graph rows share the
  capture's gradient memory (``share_grad_memory``); their peak adds the capture's private memory pool (memory
  reserved beyond what is allocated once the cache is emptied).
- ``af2-evoformer``: one ``EvoformerBlock(variant="alphafold2")`` (c_m 256, c_z 128), 512 MSA sequences (the last 48
  padding), N = 384 (the last 37 residues padding): a training step (fwd + bwd into the inputs, dropout on) and
  inference (eval, no grad) per attention backend (triton, torch, flex). ``diff_vs_ref``: the first step's loss
  (training) or the pair output on real positions (inference) against the first backend's. AlphaFold 2's own
  Evoformer is JAX/Haiku: its row is not measured and says which of jax, a JAX CUDA plugin, dm-haiku and
  alphafold the Python running the bench has.
- ``of3-pairformer`` / ``protenix-pairformer``: a stack of 2 Pairformer blocks at the published widths (c_s 384,
  c_z 128, 16 single heads, triangle attention 4 x 32, products 128 wide, transitions 4x), random weights, built
  from openfold3 0.5.0's ``PairFormerStack`` / protenix 2.0.0's ``PairformerStack`` and converted by
  ``from_openfold3`` / ``from_protenix``: a training step (fwd + bwd into the parameters and the inputs s and z of a
  mean square of s and z at real positions; dropout 0 on both sides, so that their outputs compare) at N = 384
  and at N = 299 with its last 21 residues padding (single and pair masks). Rows: the original on its default
  attention path (plain PyTorch), its kernel switches (OpenFold3's ``use_triton_triangle_kernels``,
  ``use_cueq_triangle_kernels``, ``use_deepspeed_evo_attention``; Protenix's ``triangle_attention`` "triattention",
  "cuequivariance" (with its triangle multiplication), "deepspeed"), each skipped with the reason where it cannot
  run, and ours per ``--pf-backends`` (triton; torch as a sanity row). ``diff_vs_ref``: the largest relative error
  (max abs over max abs) of s, z and the input gradients at real positions, first step, against the original's
  default path in the same dtype (bf16 autocast). Protenix runs its trunk unpadded and its single attention takes
  no mask: at N = 299 its rows attend the padded residues, and the reference is Protenix on the 278 real ones.
  Protenix's layer norm is its PyTorch one (``LAYERNORM_TYPE=torch`` unless set: the fused one is a CUDA
  extension compiled at import). Where biotite / rdkit are missing (a GPU machine given only
  ``scripts/prepare_whl_zoo.sh``'s packages), the originals import with a stand-in for each (see
  :func:`import_original`), and their rows say so.

Writes ``zoo.csv`` and ``zoo.md`` to ``--out`` (default ``$OUT`` or ``bench_out``), rewritten after every row.

    python scripts/bench_zoo.py                  # on a GPU
    python scripts/bench_zoo.py --smoke          # tiny shapes on any device: checks that the script runs
    bash scripts/prepare_whl_zoo.sh && PYTHONPATH=.whl/site python scripts/bench_zoo.py \
        --cases of3-pairformer protenix-pairformer  # the originals' packages for a machine without them
On a device without CUDA the triton backend runs as ``torch`` (the Triton interpreter's bf16 is wrong).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import sys
import time
import types
from dataclasses import astuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attn_zoo  # noqa: E402
from attn_ops.registry import BACKENDS  # noqa: E402
from attn_ops import wait_compiles  # noqa: E402
from attn_zoo.models.compiling import compile_module  # noqa: E402
from attn_zoo.models.esmc import ESMC_CONFIGS, EsmcLogits  # noqa: E402
from attn_zoo.models.graphs import CUDAGraphs, Logits  # noqa: E402
from bench_blocks import _randomize, attention_config  # noqa: E402
from bench_patch import (cleanup, cuequivariance_available, emit_alternated, emitter, env_lines, is_oom,  # noqa: E402
                         mlm_batch, mlm_step, parser, profile_step, rel_diff, start)

FIELDS = ["case", "shape", "variant", "ms", "tokens_per_s", "peak_gib", "first_step_s", "diff_vs_ref", "note"]
EVO_BACKENDS = ("triton", "torch", "flex")
PF_CASES = ("of3-pairformer", "protenix-pairformer")
CASES = ("esmc", "af2-evoformer") + PF_CASES
HF_ATTN = ("sdpa", "flash_attention_2", "attn_zoo.patch")

FULL = dict(
    esmc=dict(zip(("layers", "width", "heads", "ffn"), astuple(ESMC_CONFIGS["600M"]))),
    esmc_shape=(4, 1024, (300, 1024)),
    evo=dict(c_m=256, c_z=128),
    evo_shape=(512, 48, 384, 37),  # MSA rows, padded rows, residues, padded residues
    # the published trunk widths; 2 blocks, as the zoo tests' stacks
    of3=dict(c_s=384, c_z=128, c_hidden_pair_bias=24, no_heads_pair_bias=16, c_hidden_mul=128, c_hidden_pair_att=32,
             no_heads_pair=4, no_blocks=2, transition_n=4),
    protenix=dict(n_heads=16, c_z=128, c_s=384, c_hidden_mul=128, c_hidden_pair_att=32, no_heads_pair=4,
                  num_intermediate_factor=4),
    pf_blocks=2,
    pf_shapes=((384, 0), (299, 21)),  # residues, padded residues (at the end)
)
SMOKE = dict(
    esmc=dict(layers=2, width=64, heads=4, ffn=192),
    esmc_shape=(3, 24, (9, 24)),
    evo=dict(c_m=32, c_z=16, num_heads_msa=2, c_hidden_msa=16, num_heads_pair=2, c_hidden_pair=16, c_hidden_opm=8,
             c_hidden_mul=16),
    evo_shape=(6, 2, 12, 3),
    of3=dict(c_s=32, c_z=8, c_hidden_pair_bias=16, no_heads_pair_bias=2, c_hidden_mul=8, c_hidden_pair_att=16,
             no_heads_pair=2, no_blocks=2, transition_n=2),
    protenix=dict(n_heads=2, c_z=8, c_s=32, c_hidden_mul=8, c_hidden_pair_att=16, no_heads_pair=2,
                  num_intermediate_factor=4),  # Protenix's single transition is 4 wide whatever the factor
    pf_blocks=2,
    pf_shapes=((16, 0), (13, 3)),
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


def run_row(emit, timer, device, row, fn, ref, tokens=None, diff=rel_diff, graphs=False):
    """Time one variant into ``row``; returns the first step's result (the reference for later variants, compared
    by ``diff``). ``graphs``: the step replays CUDA graphs, whose private memory pool (reserved, not allocated,
    between replays) is added to the peak."""
    fn = first_timed(fn, device)
    try:
        ms, peak, first = timer(fn)
        if graphs and device.type == "cuda":
            torch.cuda.empty_cache()
            peak += (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / 2.0 ** 30
        row.update(ms=f"{ms:.2f}", peak_gib="" if peak != peak else f"{peak:.2f}", first_step_s=f"{fn.state['s']:.2f}")
        if tokens:
            row["tokens_per_s"] = f"{tokens / ms * 1e3:.0f}"
        if ref is not None:
            row["diff_vs_ref"] = f"{diff(first, ref):.2e}"
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


def pack_rows(inp, tokens, target, real, multiple: int = 256):
    """The rows of a padded MLM batch as one row of their real tokens (``sequence_id`` = the row index, then
    ``<pad>`` with -1 up to a multiple of ``multiple``): (input ids, target ids, target positions, sequence ids),
    each ``[1, T]``."""
    from attn_zoo.models.esmc import ALPHABET

    keep = real.bool()
    ids = torch.arange(inp.shape[0], device=inp.device)[:, None].expand_as(inp)
    parts = [inp[keep], tokens[keep], target[keep], ids[keep]]
    pad = -len(parts[0]) % multiple
    fill = (ALPHABET.padding_idx, ALPHABET.padding_idx, False, -1)
    return tuple(torch.cat([p, torch.full((pad,), f, dtype=p.dtype, device=p.device)])[None]
                 for p, f in zip(parts, fill))


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
        if attn == "sdpa":  # the same model replayed as CUDA graphs, as ours below
            hf_graphed = CUDAGraphs(Logits(hf, "attention_mask"), max_graphs=1, share_grad_memory=True)
            fn = lambda: mlm_step(lambda _: hf_graphed(inp, am), hf, tokens, target, device)  # noqa: E731
            run_row(emit, timer, device, dict(row, variant="HF sdpa, CUDA graphs"), fn, ref, real, graphs=True)
            hf_graphed.reset()
            del hf_graphed
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
    ours.activation_checkpointing = True  # each layer recomputed in the backward: the memory a user can trade for time
    run_row(emit, timer, device, dict(row, variant=row["variant"] + ", activation checkpointing"), fn, ref, real)
    ours.activation_checkpointing = False
    # the host-bound eager step replayed as CUDA graphs; then the batch packed (real tokens only), eager and graphed
    graphed = CUDAGraphs(EsmcLogits(ours), max_graphs=1, share_grad_memory=True)
    packed = pack_rows(inp, tokens, target, am)
    variants = {
        "CUDA graphs": lambda: mlm_step(lambda t: graphed(inp), ours, tokens, target, device),
        "packed": lambda: mlm_step(lambda t: ours(packed[0], sequence_id=packed[3])["logits"], ours, packed[1],
                                   packed[2], device),
        "packed, CUDA graphs": lambda: mlm_step(lambda t: graphed(packed[0], packed[3]), ours, packed[1], packed[2],
                                                device),
    }
    for name, step in variants.items():
        run_row(emit, timer, device, dict(row, variant=f"{row['variant']}, {name}"), step, ref, real,
                graphs="graphs" in name)
        graphed.reset()
    ours.activation_checkpointing = True
    run_row(emit, timer, device, dict(row, variant=f"{row['variant']}, packed, activation checkpointing, CUDA graphs"),
            variants["packed, CUDA graphs"], ref, real, graphs=True)
    graphed.reset()
    ours.activation_checkpointing = False
    if cfg.get("rotary_ab"):  # the same model with q/k norm + rotary in PyTorch ops instead of the one kernel
        import attn_zoo.models.kernels as kernels_module

        kernel = kernels_module.rotary_qk
        kernels_module.rotary_qk = lambda *a, **kw: kernels_module.rotary_qk_reference(*a, **kw)
        try:
            run_row(emit, timer, device, dict(row, variant=row["variant"] + ", rotary in PyTorch ops"), fn, ref, real)
        finally:
            kernels_module.rotary_qk = kernel
        run_row(emit, timer, device, dict(row, variant=row["variant"] + " (again)"), fn, ref, real)
    if cfg.get("profile"):
        profile_step(cfg["profile"], f"esmc {shape} {row['variant']}", fn, device)
    if cfg.get("rounds"):  # HF (eager and as CUDA graphs) and ours again, in turns, both models on the device
        hf.to(device)
        hf_graphed = CUDAGraphs(Logits(hf, "attention_mask"), max_graphs=1, share_grad_memory=True)

        def hf_as(attn):
            hf_graphed.reset()
            attn_zoo.unpatch(hf)
            if attn == "attn_zoo.patch":
                attn_zoo.patch(hf, backend=backend)
            else:
                hf.set_attn_implementation(attn)

        def ours_as(checkpointing):  # a fresh capture per round: the flag is not part of a capture's signature
            graphed.reset()
            ours.activation_checkpointing = checkpointing

        hf_step = lambda: mlm_step(hf_logits, hf, tokens, target, device)  # noqa: E731
        turns = [(f"HF {a}", lambda a=a: hf_as(a), hf_step) for a in ("sdpa", "attn_zoo.patch")]
        turns.append(("HF sdpa, CUDA graphs", lambda: hf_as("sdpa"),
                      lambda: mlm_step(lambda _: hf_graphed(inp, am), hf, tokens, target, device)))
        turns.append((row["variant"], lambda: ours_as(False), fn))
        for ckpt in (False, True):
            turns.append((row["variant"] + ", packed" + (", activation checkpointing" if ckpt else "") + ", CUDA graphs",
                          lambda ckpt=ckpt: ours_as(ckpt), variants["packed, CUDA graphs"]))
        emit_alternated(emit, "esmc", shape, turns, cfg["rounds"], timer)
        ours_as(False)
        hf_graphed.reset()
        attn_zoo.unpatch(hf)
        hf.to("cpu")
        del hf_graphed
        cleanup(device)
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
# AF3-style Pairformers: OpenFold3's and Protenix's stacks vs ours
# ------------------------------------------------------------------------------------------------
# rdkit's periodic table symbols 1-118, the one thing protenix.data.constants reads from rdkit (its element list)
ELEMENTS = ("H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge As Se Br Kr "
            "Rb Sr Y Zr Nb Mo Tc Ru Rh Pd Ag Cd In Sn Sb Te I Xe Cs Ba La Ce Pr Nd Pm Sm Eu Gd Tb Dy Ho Er Tm Yb Lu "
            "Hf Ta W Re Os Ir Pt Au Hg Tl Pb Bi Po At Rn Fr Ra Ac Th Pa U Np Pu Am Cm Bk Cf Es Fm Md No Lr Rf Db Sg "
            "Bh Hs Mt Ds Rg Cn Nh Fl Mc Lv Ts Og").split()


class _PeriodicTable:
    def GetElementSymbol(self, z):  # noqa: N802 (rdkit's name)
        return ELEMENTS[z - 1]


def _standin_biotite():
    """biotite.structure with an ``AtomArray`` class: openfold3.core.utils.tensor_utils imports it for one
    ``isinstance`` test, which no object can pass where biotite is missing."""
    structure = types.ModuleType("biotite.structure")
    structure.AtomArray = type("AtomArray", (), {"__doc__": "stand-in: biotite is not installed"})
    top = types.ModuleType("biotite")
    top.structure = structure
    return {"biotite": top, "biotite.structure": structure}


def _standin_rdkit():
    """rdkit.Chem with ``GetPeriodicTable``: protenix.data.constants builds its element list from it at import
    (rdkit's symbols, so the constants come out as with rdkit)."""
    chem = types.ModuleType("rdkit.Chem")
    chem.GetPeriodicTable = _PeriodicTable
    top = types.ModuleType("rdkit")
    top.Chem = chem
    return {"rdkit": top, "rdkit.Chem": chem}


# case -> (package, module its Pairformer imports from, {missing heavy package: its stand-in})
ORIGINALS = {
    "of3-pairformer": ("openfold3", "openfold3.core.model.latent.pairformer", {"biotite": _standin_biotite}),
    "protenix-pairformer": ("protenix", "protenix.model.modules.pairformer", {"rdkit": _standin_rdkit}),
}


@contextlib.contextmanager
def _standins(wanted):
    """Put the stand-ins of the packages in ``wanted`` that do not import into ``sys.modules`` for the duration of
    the block, then take them out again (nothing imported later sees a fake package). Yields their names."""
    added = {}
    for name, make in wanted.items():
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            added.update(make())
    sys.modules.update(added)
    try:
        yield sorted({k.split(".")[0] for k in added})
    finally:
        for k in added:
            if sys.modules.get(k) is added[k]:
                del sys.modules[k]


def import_original(case):
    """(module, notes) of the original Pairformer of ``case``; raises ImportError when it does not import.

    The originals' import chains name heavy binary packages their Pairformers never use (the ``ORIGINALS`` table):
    where one is missing, a stand-in takes its place for the import alone and a note says so. Protenix's layer
    norm module compiles a CUDA extension at import unless ``LAYERNORM_TYPE`` names another: its PyTorch one is
    picked here unless the variable is set."""
    package, module, wanted = ORIGINALS[case]
    notes = []
    if case == "protenix-pairformer":
        os.environ.setdefault("LAYERNORM_TYPE", "torch")
        notes.append(f"LAYERNORM_TYPE={os.environ['LAYERNORM_TYPE']}")
    with _standins(wanted) as used:
        mod = importlib.import_module(module)
    if used:
        notes.append(f"{', '.join(used)} not installed: imported with a stand-in (bench_zoo.import_original)")
    return mod, notes


def pf_train(forward, module, s, z, real):
    """A training step of a Pairformer stack ``forward(s, z) -> (s, z)``: bf16 autocast, the mean square of s and z
    at the ``real`` positions, backward into the parameters and the inputs. The first call returns s, z and the
    inputs' gradients at real positions (float32), later calls nothing (no copies in the timed steps)."""
    state = {"first": True}

    def step():
        sg, zg = s.clone().requires_grad_(True), z.clone().requires_grad_(True)
        with torch.autocast(s.device.type, dtype=torch.bfloat16):
            so, zo = forward(sg, zg)
        so, zo = so[0, real].float(), zo[0][real][:, real].float()
        (so.square().mean() + zo.square().mean()).backward()
        module.zero_grad(set_to_none=True)
        if state.pop("first", False):
            return so.detach(), zo.detach(), sg.grad[0, real].float(), zg.grad[0][real][:, real].float()
        return None

    return step


def pf_diff(a, b) -> float:
    """The largest :func:`rel_diff` of the tensors of two :func:`pf_train` first results."""
    return max(rel_diff(x, y) for x, y in zip(a, b))


def pf_variants(case, device):
    """[(label, forward keyword flags, why it cannot run or None)]: the original's default path first, then its
    kernel switches (each needs CUDA, and the cuEquivariance and DeepSpeed ones their packages)."""
    cuda = device.type == "cuda"

    def why(have, what):
        return "needs CUDA" if not cuda else None if have else f"needs {what}, not installed"

    ds4s = "deepspeed's DS4Sci_EvoformerAttention"
    if case == "of3-pairformer":
        attn = sys.modules["openfold3.core.model.primitives.attention"]  # the flags its own dispatch reads
        return [
            ("", {}, None),
            ("use_triton_triangle_kernels", dict(use_triton_triangle_kernels=True),
             why(attn.TRITON_AVAILABLE, "triton")),
            ("use_cueq_triangle_kernels", dict(use_cueq_triangle_kernels=True),
             why(attn.cueq_is_installed, "cuequivariance_torch and cuequivariance_ops_torch")),
            ("use_deepspeed_evo_attention", dict(use_deepspeed_evo_attention=True), why(attn.ds4s_is_installed, ds4s)),
        ]
    return [
        ("", {}, None),
        ("triangle_attention=triattention", dict(triangle_attention="triattention"), why(True, "")),
        ("cuequivariance", dict(triangle_attention="cuequivariance", triangle_multiplicative="cuequivariance"),
         why(cuequivariance_available(device), "cuequivariance_torch")),
        ("triangle_attention=deepspeed", dict(triangle_attention="deepspeed"),
         why(importlib.util.find_spec("deepspeed") is not None, ds4s)),
    ]


def bench_pairformer(case, cfg, device, timer, backends, emit):
    """One AF3-style case (``of3-pairformer`` or ``protenix-pairformer``); see the module's docstring."""
    from attn_zoo.models.zoo import from_openfold3, from_protenix

    package = ORIGINALS[case][0]
    try:
        mod, notes = import_original(case)
        version = importlib.metadata.version(package)
    except ImportError as exc:
        emit(dict(case=case, note=f"skipped: {package} does not import ({type(exc).__name__}: {exc}); on a machine "
                                  "without it: bash scripts/prepare_whl_zoo.sh, PYTHONPATH=.whl/site"))
        return
    of3 = case == "of3-pairformer"
    name = f"{'OpenFold3' if of3 else 'Protenix'} {version}"
    torch.manual_seed(0)
    if of3:
        theirs = mod.PairFormerStack(**cfg["of3"], transition_type="swiglu", pair_dropout=0.0,
                                     fuse_projection_weights=False, blocks_per_ckpt=None, inf=1e9)
        c_s, c_z = cfg["of3"]["c_s"], cfg["of3"]["c_z"]
    else:  # Protenix's stack fixes its blocks' triangle widths: its own blocks of the wanted ones replace them
        c = cfg["protenix"]
        theirs = mod.PairformerStack(n_blocks=0, n_heads=c["n_heads"], c_z=c["c_z"], c_s=c["c_s"], dropout=0.0)
        theirs.blocks = torch.nn.ModuleList(mod.PairformerBlock(**c, dropout=0.0) for _ in range(cfg["pf_blocks"]))
        c_s, c_z = c["c_s"], c["c_z"]
    _randomize(theirs)  # their inits zero the output layers and gates: the gradients would hide the attention's work
    theirs.train()
    load = from_openfold3 if of3 else from_protenix
    ours, done = [], set()
    for b in backends:
        be = resolve_backend(b, device)
        if be not in done:  # triton standing in as torch on a CPU
            done.add(be)
            ours.append((be, load(theirs, attention={"backend": be}, pair_dropout=0.0).train()))
    variants = pf_variants(case, device)
    for label, _, why in variants:
        if why:
            emit(dict(case=case, variant=f"{name} {label}", note=f"skipped: {why}"))
    blocks = len(theirs.blocks)
    for N, pad in cfg["pf_shapes"]:
        g = torch.Generator().manual_seed(1)
        s = torch.randn(1, N, c_s, generator=g).to(device)
        z = torch.randn(1, N, N, c_z, generator=g).to(device)
        real = torch.arange(N, device=device) < N - pad
        mask, pair_mask = real[None], (real[:, None] & real[None, :])[None]
        shape = f"N={N}{f' ({pad} padded)' if pad else ''}, {blocks} blocks, train step"
        ref, note = None, list(notes)
        theirs.to(device)
        if of3:
            def their_fwd(flags):
                return lambda s_, z_: theirs(s_, z_, mask.float(), pair_mask.float(), **flags)
        else:
            def their_fwd(flags, pm=pair_mask):
                return lambda s_, z_: theirs(s_, z_, pm.float(), **flags)
            if pad:  # Protenix's own way of running a padded sequence: unpadded, the reference of every row here
                cut = real.nonzero().squeeze(-1)
                ref = pf_train(lambda s_, z_: theirs(s_, z_, pair_mask[:, cut][:, :, cut].float()), theirs,
                               s[:, cut], z[:, cut][:, :, cut], torch.ones(len(cut), dtype=torch.bool,
                                                                           device=device))()
                note.append(f"attends the {pad} padded residues (no single mask); diff_vs_ref against Protenix on "
                            f"the {N - pad} real ones")
                cleanup(device)
        for label, flags, why in variants:
            if why:
                continue
            row = dict(case=case, shape=shape, variant=f"{name} {label}".rstrip(), note="; ".join(note))
            ref = run_row(emit, timer, device, row, pf_train(their_fwd(flags), theirs, s, z, real), ref,
                          diff=pf_diff)
        theirs.to("cpu")
        cleanup(device)
        for be, stack in ours:
            stack.to(device)
            row = dict(case=case, shape=shape, variant=f"ours {load.__name__} ({be})")
            fwd = lambda s_, z_, st=stack: st(s_, z_, mask, pair_mask)  # noqa: E731
            run_row(emit, timer, device, row, pf_train(fwd, stack, s, z, real), ref, diff=pf_diff)
            stack.to("cpu")
            cleanup(device)


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------
def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--cases", nargs="+", default=["esmc", "af2-evoformer"], choices=list(CASES))
    p.add_argument("--backends", nargs="+", default=list(EVO_BACKENDS), choices=list(EVO_BACKENDS),
                   help="the Evoformer's attention backends (the first is the reference of diff_vs_ref)")
    p.add_argument("--pf-backends", nargs="+", default=["triton", "torch"], choices=list(EVO_BACKENDS),
                   help="the attention backends of ours in the OpenFold3 / Protenix cases")
    p.add_argument("--hf-attn", nargs="+", default=list(HF_ATTN), choices=list(HF_ATTN),
                   help="the Hugging Face ESM C's attention (the first is the reference of diff_vs_ref)")
    p.add_argument("--profile", action="store_true", help="also profile each ESM C step (zoo_profile.txt)")
    p.add_argument("--rotary-ab", action="store_true",
                   help="ESM C: ours also with its q/k norm and rotary in PyTorch ops, then the kernel again")
    p.add_argument("--compile", action="store_true",
                   help="ESM C also compiled: Hugging Face's under torch.compile, ours under compile_module (default "
                        "and reduce-overhead)")
    p.add_argument("--rounds", type=int, default=0,
                   help="ESM C: then HF sdpa, HF patched and ours again in this many alternating rounds")
    args, device, timer = start(p, argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    if args.profile:
        cfg["profile"] = os.path.join(args.out, "zoo_profile.txt")
    cfg["rotary_ab"], cfg["rounds"] = args.rotary_ab, args.rounds
    backend = resolve_backend("triton", device)
    env = env_lines(device, backend)[:-1] + [
        f"- bf16 autocast, fp32 parameters, random weights; ours on {backend}; "
        f"{timer.iters} timed steps after {timer.warmup} warm-up"]
    rows = []
    emit = emitter(args.out, "zoo", "Zoo models: converted vs original", env, rows, FIELDS)

    for name in args.cases:
        if name == "esmc":
            bench_esmc(cfg, device, timer, backend, emit, args.hf_attn, args.compile)
        elif name == "af2-evoformer":
            bench_evoformer(cfg, device, timer, args.backends, emit)
        else:
            bench_pairformer(name, cfg, device, timer, args.pf_backends, emit)
    return rows


if __name__ == "__main__":
    main()
