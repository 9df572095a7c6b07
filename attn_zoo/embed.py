"""Embed a FASTA file with an ESM-2 the zoo loads (``attn-zoo-embed`` installed, ``python scripts/embed.py``).

    attn-zoo-embed --model esm2_t33_650M_UR50D.pt --fasta proteins.fasta --out emb/ --include mean per_tok
    attn-zoo-embed --model hf_esm2_folder/ --fasta x.fa --out emb/ --repr-layers -1 20 --include contacts \\
        --device cuda --dtype bf16 --attention triton

``--model``: a fair-esm ``.pt``, a Hugging Face ESM-2 folder, a checkpoint trained here or an ESM-2 state_dict
(:func:`attn_zoo.models.zoo.load_esm2`), or an ESM C (a Hugging Face ``EsmcForMaskedLM`` folder, or its or the esm
package's state_dict: :func:`attn_zoo.models.zoo.load_language_model`; no contacts). Writes one file per
protein, ``OUT/<name>.pt``, holding a dict (as fair-esm's ``extract.py``): ``label``, ``sequence``,
``representations {layer: [L, C]}`` (``per_tok``), ``mean_representations {layer: [C]}`` (``mean``: over the
residues, ``<cls>``/``<eos>`` left out) and ``contacts [L, L]`` (``contacts``), float32 on the CPU.

File names: the label (the FASTA header's first word) with every character outside ``A-Za-z0-9._-`` replaced by
``_`` (a leading ``.`` too); when that changed the label, ``-`` and 8 hex digits of its SHA-1 are appended, so different labels never
share a file; the exact label is stored inside. Duplicate labels are an error before any work.

Proteins are sorted by length and batched up to ``--toks-per-batch`` tokens (padded length x proteins; a longer
protein runs alone). A protein's embedding does not depend on its batch (padding is masked). Files are written
atomically (a temporary file renamed, with the user's umask), so an interrupted run never leaves a partial file
(stale ``.partial-*`` files of a killed run are removed on the next). ``OUT/manifest.json`` records what the
folder was written with (the model's size and a digest of its weights, the layers, ``--include``, ``--dtype``,
``--truncate`` and the attn-zoo version): a rerun with the same settings skips the proteins whose file exists
(resuming), one with other settings is refused unless ``--overwrite`` recomputes every protein. There is no length
limit (rotary positions): a sequence longer than the model's training crops runs as it is unless ``--truncate N``
cuts it. Contacts need every layer's attention maps (about 6 x layers x heads x L^2 x 4 bytes for an L-token
batch row): batches that would not fit in the device's free memory are refused before any work, naming the
``--truncate`` that would fit.

The model file is read as data (``torch.load(weights_only=True)``, registered network classes only): a file
that pickles other Python objects is refused (re-save it as plain tensors, or load it from your own code with
``zoo.load_language_model(path, allow_globals=[YourClass])`` and call :func:`embed`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

INCLUDE = ("mean", "per_tok", "contacts")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MANIFEST = "manifest.json"
# manifest keys that change what a protein's file holds: a rerun must match them to add to the folder
COMPARED = ("version", "model", "repr_layers", "include", "dtype", "truncate")
_PEAK_PER_MAP = 6  # live copies of the stacked attention maps while contacts are computed (measured, CPU fp32)


@dataclass
class EmbedSummary:
    """What a run did: proteins written, skipped (file already there) and the output folder."""

    out: Path
    written: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)


def file_name(label: str) -> str:
    """The output file name of ``label`` (see the module docstring)."""
    safe = _UNSAFE.sub("_", label)
    if safe.startswith("."):  # no hidden files, no '.' / '..'
        safe = "_" + safe[1:]
    if safe != label:
        safe = f"{safe}-{hashlib.sha1(label.encode()).hexdigest()[:8]}"
    return safe + ".pt"


def read_proteins(fasta: str | os.PathLike, truncate: Optional[int] = None) -> List[Tuple[str, str]]:
    """``[(label, sequence)]`` of a FASTA file; every error names ``file:line`` (bad characters, a sequence before
    the first header, an empty record, a residue ESM-2 has no token for, a duplicate label)."""
    from .models.data.parsers import read_fasta
    from .models.esm2 import ALPHABET

    path = Path(fasta)
    if not path.is_file():
        raise FileNotFoundError(f"--fasta {str(path)!r}: no such file")
    out, seen, names = [], {}, {}
    for rec in read_fasta(path):
        label = rec.header.split()[0] if rec.header.split() else ""
        if not label:
            raise ValueError(f"{path}:{rec.line}: a record without a label (nothing after '>')")
        try:
            ALPHABET.encode(rec.sequence)
        except ValueError as exc:
            raise ValueError(f"{path}:{rec.line}: record {label!r}: {exc}") from None
        if label in seen:
            raise ValueError(f"{path}:{rec.line}: duplicate label {label!r} (first at line {seen[label]})")
        seen[label] = rec.line
        name = file_name(label).lower()  # case-insensitive file systems (macOS, Windows) fold names
        if name in names:
            raise ValueError(f"{path}:{rec.line}: label {label!r} and {names[name]!r} differ only in letter case: "
                             "their files would collide on a case-insensitive file system")
        names[name] = label
        out.append((label, rec.sequence[:truncate] if truncate else rec.sequence))
    return out


def batches(proteins: Sequence[Tuple[str, str]], toks_per_batch: int,
            length_multiple: int = 1) -> Iterator[List[Tuple[str, str]]]:
    """Length-sorted batches (longest first) of at most ``toks_per_batch`` padded tokens (``<cls>``/``<eos>``
    counted, the width rounded up to ``length_multiple``); a protein longer than the budget forms a batch alone."""
    if toks_per_batch < 1:
        raise ValueError(f"toks_per_batch must be >= 1, got {toks_per_batch}")
    from .models.shapes import check_multiple, round_up

    check_multiple(length_multiple)  # before any work
    batch: List[Tuple[str, str]] = []
    width = 0
    for item in sorted(proteins, key=lambda p: -len(p[1])):
        n = round_up(len(item[1]) + 2, length_multiple)
        if batch and max(width, n) * (len(batch) + 1) > toks_per_batch:
            yield batch
            batch, width = [], 0
        batch.append(item)
        width = max(width, n)
    if batch:
        yield batch


def _layers(repr_layers: Iterable[int], num_layers: int) -> List[int]:
    """fair-esm's rule: negative layers count from the end (-1 = the last); 0 is the embedding."""
    out = []
    for i in repr_layers:
        if not -(num_layers + 1) <= i <= num_layers:
            raise ValueError(f"--repr-layers {i} outside [-{num_layers + 1}, {num_layers}] for a {num_layers}-layer "
                             "model")
        out.append((i + num_layers + 1) % (num_layers + 1))
    return sorted(set(out))


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: put it straight back
    os.umask(mask)
    return mask


def _save_atomic(obj, path: Path, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".partial-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(obj, bytes):
                f.write(obj)
            else:
                torch.save(obj, f)
        os.chmod(tmp, mode)  # mkstemp makes 0600; a written file gets the permissions open() would give
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - lightning brings tqdm
        return None
    return tqdm(total=total, unit="protein", file=sys.stderr)


def model_digest(model) -> Dict[str, Any]:
    """What identifies ``model`` in a manifest: its size and a SHA-256 of every tensor's name, shape, dtype and
    first and last 1024 values (fine-tuning changes every tensor; hashing all of a 15B model would take minutes)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(torch.cat([flat[:1024], flat[-1024:]]).float().cpu().numpy().tobytes())
    return {"layers": model.num_layers, "embed_dim": model.embed_dim, "heads": model.attention_heads,
            "weights_sha256": h.hexdigest()}


def _differences(old: Any, new: Any, key: str) -> List[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) for d in _differences(old.get(k), new.get(k), f"{key}.{k}")]
    short = lambda v: f"{v[:12]}..." if isinstance(v, str) and len(v) > 16 else repr(v)  # noqa: E731
    return [] if old == new else [f"{key} {short(old)} -> {short(new)}"]


def check_folder(out: Path, settings: Dict[str, Any], overwrite: bool) -> None:
    """Refuse to add files to ``out`` when its manifest records other settings (``COMPARED``), or when it holds
    ``.pt`` files but no manifest (their settings are unknown), unless ``overwrite``."""
    written = sorted(p.name for p in out.glob("*.pt") if not p.name.startswith("."))
    path = out / MANIFEST
    if overwrite or not (path.exists() or written):
        return
    if not path.exists():
        raise ValueError(f"--out {str(out)!r} holds {len(written)} .pt file(s) ({', '.join(written[:3])}...) but no "
                         f"{MANIFEST}: written by another tool or an older attn-zoo-embed, with unknown settings; "
                         "pass --overwrite to recompute every protein, or choose another --out")
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--out {str(out)!r}: cannot read {MANIFEST} ({e}): pass --overwrite to recompute every "
                         "protein, or choose another --out") from None
    if not isinstance(old, dict):
        old = {}
    diff = [d for k in COMPARED for d in _differences(old.get(k), settings[k], k)]
    if diff:
        raise ValueError(f"--out {str(out)!r} was written with other settings ({'; '.join(diff)}): adding to it "
                         "would mix them; pass --overwrite to recompute every protein, or choose another --out")


def free_memory(device: torch.device) -> Optional[int]:
    """Bytes a forward can still allocate on ``device`` (CUDA: free plus cached by PyTorch; CPU: the OS's
    MemAvailable), or None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.virtual_memory().available)
    return None


def memory_estimate(model, rows: int, width: int, include: Sequence[str], kept_layers: int) -> int:
    """Bytes the forward of ``rows`` x ``width`` tokens needs beyond the weights: the activations (the kept layers'
    ``[rows, width, C]`` plus a layer's working set, about 16 of them) and, for contacts, every layer's float32
    attention maps ``[rows, layers, heads, width, width]``, alive in about ``_PEAK_PER_MAP`` copies at the peak."""
    c, layers, heads = model.embed_dim, model.num_layers, model.attention_heads
    need = rows * width * c * 4 * (kept_layers + 16)
    if "contacts" in include:
        need += (_PEAK_PER_MAP * layers + 2) * rows * heads * width * width * 4
    return need


def _too_big(model, batch, width: int, need: int, budget: int, device, include, kept: int, multiple: int) -> str:
    from .models.shapes import round_up

    label, seq = max(batch, key=lambda p: len(p[1]))
    fits = lambda n: memory_estimate(model, 1, round_up(n + 2, multiple), include, kept) <= budget  # noqa: E731
    lo, hi = 0, len(seq)
    while lo < hi:  # the longest single protein that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    what = "contacts" if "contacts" in include else "embeddings"
    rows = f", in a batch of {len(batch)} padded to {width} tokens" if len(batch) > 1 else ""
    fix = [f"--truncate {lo} (the longest that fits)" if lo > 0 else None,
           "--include mean per_tok (no contacts: their maps grow as L^2)" if "contacts" in include else
           "--include mean" if "per_tok" in include else None,
           "a smaller --toks-per-batch" if len(batch) > 1 and fits(len(seq)) else None,
           "--device cpu" if device.type == "cuda" else None]
    return (f"{what} of {label!r} ({len(seq)} residues{rows}) need about {need / 2**30:.1f} GiB on {device}, "
            f"{budget / 2**30:.1f} GiB is free: pass " + ", or ".join(f for f in fix if f))


def _out_of_memory(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def embed(model, proteins: Sequence[Tuple[str, str]], out: str | os.PathLike, *, repr_layers: Sequence[int] = (-1,),
          include: Sequence[str] = ("mean",), toks_per_batch: int = 4096, device: str | torch.device = "cpu",
          dtype: torch.dtype = torch.float32, overwrite: bool = False, progress: bool = True,
          length_multiple: int = 1, truncate: Optional[int] = None, source: Optional[str] = None,
          memory_budget: Optional[int] = None) -> EmbedSummary:
    """Embed ``proteins`` ``[(label, sequence)]`` with an ESM-2 ``model`` into ``out`` (one file per protein).

    ``length_multiple``: pad each batch's token width to a multiple (e.g. 32), so a file of many lengths runs
    in a few shapes and per-shape first-call costs are paid once per multiple; embeddings do not change.
    ``truncate`` (the cut ``proteins`` were read with) and ``source`` (the model's path) go into the manifest;
    ``truncate`` is compared on a rerun (see ``check_folder``). ``memory_budget``: bytes a batch may need
    (default: the device's free memory); a batch that needs more is refused (``MemoryError``) before any work."""
    from .models.esm2 import ALPHABET
    from .models.shapes import round_up

    unknown = sorted(set(include) - set(INCLUDE))
    if unknown or not include:
        raise ValueError(f"include must be a non-empty subset of {INCLUDE}, got {list(include)}")
    if "contacts" in include and not hasattr(model, "contact_head"):
        raise ValueError(f"--include contacts: {type(model).__name__} has no contact head (ESM-2 has one)")
    if "contacts" in include and not getattr(model.contact_head, "loaded", True):
        raise ValueError("--include contacts: this model has no contact regression (fair-esm ships it in a separate "
                         "contact-regression file, and masked-LM training does not learn one): --include mean per_tok")
    ALPHABET = getattr(model, "alphabet", ALPHABET)  # ESM C's adds the chain break '|'  # noqa: N806
    device = torch.device(device)
    layers = _layers(repr_layers, model.num_layers)
    out = Path(out)
    from . import __version__

    settings = json.loads(json.dumps({  # as the manifest stores them
        "version": __version__, "model": model_digest(model), "repr_layers": layers, "include": sorted(include),
        "dtype": str(dtype).replace("torch.", ""), "truncate": truncate}))
    if out.is_dir():
        check_folder(out, settings, overwrite)
    todo, skipped = [], []
    for label, seq in proteins:
        if not overwrite and (out / file_name(label)).exists():
            skipped.append(label)
        else:
            todo.append((label, seq))
    planned = list(batches(todo, toks_per_batch, length_multiple))
    budget = free_memory(device) if memory_budget is None else memory_budget
    if memory_budget is None and budget is not None:  # the weights still to be moved there take their share
        budget -= sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                      if t.device.type != device.type)
    peak = 0
    for batch in planned:
        width = round_up(max(len(s) for _, s in batch) + 2, length_multiple)
        need = memory_estimate(model, len(batch), width, include, len(layers))
        peak = max(peak, need)
        if budget is not None and need > budget:
            raise MemoryError(_too_big(model, batch, width, need, budget, device, include, len(layers),
                                       length_multiple))
    if progress and planned:  # one batch's memory at a time: the largest batch sets the peak
        free = "" if budget is None else f" of {budget / 2**30:.1f} GiB free"
        print(f"[embed] {len(todo)} protein(s) in {len(planned)} batch(es); the largest needs about "
              f"{peak / 2**30:.2f} GiB{free} on {device}", file=sys.stderr)

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".partial-*"):  # left by a killed run (an interrupted one removes its own)
        stale.unlink(missing_ok=True)
    mode = 0o666 & ~_umask()
    manifest = {"tool": "attn-zoo-embed", **settings,
                "run": {"source": source, "attention": getattr(getattr(model, "attention", None), "backend", None),
                        "device": str(device)}}
    if overwrite or not (out / MANIFEST).exists():  # a resumed folder keeps the record it was started with
        _save_atomic(json.dumps(manifest, indent=1).encode() + b"\n", out / MANIFEST, mode)
    summary = EmbedSummary(out, skipped=skipped)
    model = model.to(device).eval()
    converter = ALPHABET.get_batch_converter()
    bar = _progress(len(todo), progress)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    with torch.no_grad():
        for batch in planned:
            labels, seqs, tokens = converter(batch)
            tokens = F.pad(tokens, (0, round_up(tokens.shape[1], length_multiple) - tokens.shape[1]),
                           value=ALPHABET.padding_idx)
            try:
                with autocast:
                    result = model(tokens.to(device), repr_layers=layers, return_contacts="contacts" in include)
            except (RuntimeError, MemoryError) as err:
                if not _out_of_memory(err):
                    raise
                need = memory_estimate(model, len(batch), tokens.shape[1], include, len(layers))
                raise MemoryError(_too_big(model, batch, tokens.shape[1], need, free_memory(device) or 0, device,
                                           include, len(layers), length_multiple)) from err
            for i, (label, seq) in enumerate(zip(labels, seqs)):
                n = int(tokens[i].ne(ALPHABET.padding_idx).sum()) - 2  # residues: <cls>, <eos> left out
                item = {"label": label, "sequence": seq}
                if "per_tok" in include:
                    item["representations"] = {
                        k: result["representations"][k][i, 1:n + 1].float().cpu().clone() for k in layers}
                if "mean" in include:
                    item["mean_representations"] = {
                        k: result["representations"][k][i, 1:n + 1].float().mean(0).cpu() for k in layers}
                if "contacts" in include:
                    item["contacts"] = result["contacts"][i, :n, :n].float().cpu().clone()
                _save_atomic(item, out / file_name(label), mode)
                summary.written.append(label)
            del result, item  # the maps of this batch must be gone before the next forward (peak = one batch)
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    return summary


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring's layout kept; every option that has a default shows it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.required or action.default in (None, False, argparse.SUPPRESS):
            return text
        default = " ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
        return f"{text} (default: {default})"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attn-zoo-embed", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=_HelpFormatter)
    p.add_argument("--model", required=True,
                   help="fair-esm .pt, Hugging Face folder, or a checkpoint train.py wrote for a network with one "
                        "ESM-2 (experiment=esm2_mlm: <run>/checkpoints/last.ckpt)")
    p.add_argument("--fasta", required=True, help="proteins to embed (labels: the header's first word, unique)")
    p.add_argument("--out", required=True, help="output folder (one .pt per protein)")
    p.add_argument("--repr-layers", type=int, nargs="+", default=[-1], help="layers to keep (-1: last; 0: embedding)")
    p.add_argument("--include", nargs="+", choices=INCLUDE, default=["mean"],
                   help="what each file holds (contacts: memory grows as layers x heads x L^2, checked before the run)")
    p.add_argument("--toks-per-batch", type=int, default=4096, help="padded tokens per forward")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, or auto (cuda when there is one)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="autocast dtype of the forward")
    p.add_argument("--attention", default="auto", help="attention backend: auto, triton, torch, chunked, sdpa, flex")
    p.add_argument("--length-multiple", type=int, default=1,
                   help="pad each batch's width to a multiple of this (e.g. 32): fewer shapes, fewer first-call costs")
    p.add_argument("--truncate", type=int, default=None, help="cut sequences to this many residues (default: no cut)")
    p.add_argument("--overwrite", action="store_true",
                   help="recompute every protein, also into a folder written with other settings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(argv: Optional[Sequence[str]] = None) -> EmbedSummary:
    """The command line as a function: parse ``argv``, embed, return what was done; errors raise."""
    from .models.zoo import load_language_model

    args = parser().parse_args(argv)
    if args.truncate is not None and args.truncate < 1:
        raise SystemExit(f"--truncate must be >= 1, got {args.truncate}")
    if args.length_multiple < 1:
        raise SystemExit(f"--length-multiple must be >= 1, got {args.length_multiple}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    proteins = read_proteins(args.fasta, args.truncate)  # every FASTA error before the model loads
    model = load_language_model(args.model, attention=args.attention)
    summary = embed(model, proteins, args.out, repr_layers=args.repr_layers, include=args.include,
                    toks_per_batch=args.toks_per_batch, device=device, dtype=DTYPES[args.dtype],
                    overwrite=args.overwrite, progress=not args.no_progress, length_multiple=args.length_multiple,
                    truncate=args.truncate, source=str(Path(args.model).expanduser().resolve()))
    print(f"{len(summary.written)} written, {len(summary.skipped)} skipped (already in {summary.out})",
          file=sys.stderr)
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``attn-zoo-embed`` entry point: 0 on success; on bad input (files, arguments, memory) one line on
    stderr and 1; argparse's usage errors exit 2. Other exceptions keep their traceback (a bug to report)."""
    from .models.zoo import ZooCheckpointError

    try:
        run(argv)
    except (ZooCheckpointError, ValueError, OSError, MemoryError) as err:
        text = str(err).strip() or type(err).__name__
        print(f"attn-zoo-embed: error: {' '.join(text.split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("attn-zoo-embed: interrupted (files written so far are complete; rerun to resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
