"""Where a run's data comes from and how it is split: file discovery (recursive, gzip), the rule that
bundled sample data is used only where named, a record of what was found, kept and dropped, and a
train/val/test split by protein (cluster-aware) that refuses a test set overlapping training.
"""
from __future__ import annotations

import gzip
import json
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .sample import SAMPLE_DIR, DataError, resolve

log = logging.getLogger("attn_zoo.data")

SPLITS = ("train", "val", "test")


def read_text(path: str | Path) -> str:
    """A text file's content: gzip-compressed if its name ends in ``.gz``; a UTF-8 BOM dropped; CRLF and
    CR line ends read as LF."""
    path = Path(path)
    raw = gzip.open(path, "rb").read() if path.suffix.lower() == ".gz" else path.read_bytes()
    text = raw.decode("utf-8-sig", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def data_suffix(path: Path) -> str:
    """The data suffix without a trailing ``.gz`` (``x.a3m.gz`` -> ``.a3m``), lower-case."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    return Path(name).suffix


def protein_name(path: Path, root: Path) -> str:
    """A protein's name: its path under ``root`` without the data suffixes (``sub/1abc`` for
    ``root/sub/1abc.cif.gz``); a single named file is its stem."""
    rel = path.relative_to(root) if path != root else Path(path.name)
    name = rel.as_posix()
    if name.lower().endswith(".gz"):
        name = name[:-3]
    return name[: -len(data_suffix(path))] if data_suffix(path) else name


@dataclass
class Found:
    """Files of one kind under one path: ``files`` matched; ``ignored`` other files (relative names)."""

    kind: str
    root: Path | None
    files: list[Path] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def find_files(path: Path | None, suffixes: tuple[str, ...], kind: str) -> Found:
    """A single file (which must have one of ``suffixes``, optionally ``.gz``), or every such file in a
    directory and its subfolders (hidden ones skipped), sorted. Other files are listed as ignored."""
    found = Found(kind, path)
    if path is None:
        return found
    if path.is_file():
        (found.files if data_suffix(path) in suffixes else found.ignored).append(path if data_suffix(path) in suffixes
                                                                              else path.name)
        return found
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if data_suffix(p) in suffixes:
            found.files.append(p)
        else:
            found.ignored.append(rel.as_posix())
    return found


def resolve_sources(named: Mapping[str, object]) -> dict[str, Path | None]:
    """{option: path} for each data option (``msa_dir``, ``mmcif_dir``, ``fasta``) -> resolved paths.

    ``"sample"`` is the bundled demo data; mixing it with your own files is refused (the usual cause
    is naming one option and leaving another at its default ``sample``), so a run trains on exactly
    the sources you named."""
    kinds = {"msa_dir": "msa", "mmcif_dir": "mmcif", "fasta": "fasta"}
    sample = [k for k, v in named.items() if v is not None and str(v) == "sample"]
    own = [k for k, v in named.items() if v is not None and str(v) not in ("", "none", "None", "sample")]
    if sample and own:
        raise DataError(
            f"data.{', data.'.join(own)} names your data but data.{', data.'.join(sample)} is 'sample' (the bundled "
            f"demo data): set {' '.join(f'data.{k}=null' for k in sample)} to train on your data only, or point "
            f"{'it' if len(sample) == 1 else 'them'} at your own files"
        )
    out, missing = {}, []
    for k, v in named.items():  # every missing path named at once
        try:
            out[k] = resolve(v, kinds[k])
        except DataError as err:
            missing.append(f"data.{k}: {err}")
    if missing:
        raise DataError("; ".join(missing))
    return out


def gather_sources(named: Mapping[str, object], suffixes: Mapping[str, tuple[str, ...]]) -> dict[str, Found]:
    """Resolve each named source (``resolve_sources``) and find its files. A source that yields no file is
    an error naming it, unless another source with the same path has files (the configs point
    ``mmcif_dir`` at ``msa_dir`` by default: one folder may hold both kinds)."""
    kinds = {"msa_dir": "msa", "mmcif_dir": "mmcif", "fasta": "fasta"}
    paths = resolve_sources(named)
    found = {opt: find_files(p, suffixes[opt], kinds[opt]) for opt, p in paths.items()}
    empty = []
    for opt, f in found.items():
        if f.root is None or f.files:
            continue
        if any(o != opt and g.root == f.root and g.files for o, g in found.items()):
            continue
        others = f"; it holds {len(f.ignored)} other file(s): {', '.join(f.ignored[:5])}" if f.ignored else ""
        empty.append(
            f"data.{opt}={named[opt]}: no {'/'.join(suffixes[opt])} files (optionally .gz; subfolders searched){others}"
        )
    if empty:
        raise DataError("; ".join(empty))
    if not any(f.files for f in found.values()):
        raise DataError(
            "no data: " + ", ".join(f"data.{o}={named[o]!r}" for o in named)
            + " (name a folder or file of your own, or 'sample' for the bundled demo data)"
        )
    return found


def read_each(paths: Iterable[Path], read, bad: list[str]) -> list[tuple[Path, object]]:
    """[(path, ``read(path)``)] for the files that read; each one that cannot be read is added to ``bad`` (its
    name, line and what is wrong) and the reading goes on, so ``check_readable`` names every bad file at once."""
    out = []
    for path in paths:
        try:
            out.append((path, read(path)))
        except (ValueError, OSError, EOFError) as err:  # parser errors; unreadable files, truncated .gz
            why = str(err) or type(err).__name__
            bad.append(why if str(path) in why else f"{path}: {why}")
    return out


def check_readable(bad: Sequence[str]) -> None:
    """One DataError naming every file ``read_each`` could not read (none: nothing)."""
    if bad:
        raise DataError(f"{len(bad)} data file(s) cannot be read: " + "; ".join(bad))


def read_clusters(path: str | Path) -> dict[str, str]:
    """Cluster ids from a text file: two columns per line, ``cluster_id member`` (MMseqs2's
    ``createtsv`` / ``easy-cluster`` ``*_cluster.tsv`` layout, tab or space separated; '#' comments).
    Members are matched to protein names (also by the last part of a name and case-insensitively)."""
    out: dict[str, str] = {}
    for lineno, line in enumerate(read_text(path).split("\n"), start=1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        parts = s.split()
        if len(parts) != 2:
            raise DataError(f"{path}:{lineno}: a cluster line needs 2 columns (cluster_id member), got {len(parts)}")
        out[parts[1]] = parts[0]
    if not out:
        raise DataError(f"{path}: no cluster lines")
    return out


_UNIREF = re.compile(r"UniRef(50|90)_[A-Za-z0-9]+")


def cluster_of(names: Iterable[str], clusters: Mapping[str, str] | None) -> dict[str, str]:
    """Each protein's cluster id: from ``clusters`` (by full name, last path part, or lower-case); else the
    UniRef50 / UniRef90 cluster id its name carries (``UniRef50_P12345``: a FASTA record and an alignment
    of one UniRef cluster stay together); else its own name (a singleton cluster)."""
    lower = {k.lower(): v for k, v in (clusters or {}).items()}
    out = {}
    for n in names:
        short = n.rsplit("/", 1)[-1]
        cid = None
        for key in (n, short):
            if clusters and key in clusters:
                cid = clusters[key]
                break
            if key.lower() in lower:
                cid = lower[key.lower()]
                break
        if cid is None:
            m = _UNIREF.search(n)
            cid = m.group(0) if m else None
        out[n] = f"cluster:{cid}" if cid is not None else n
    return out


def split_proteins(
    names: Sequence[str],
    *,
    val_fraction: float,
    test_fraction: float,
    seed: int = 0,
    clusters: Mapping[str, str] | None = None,
    strata: Mapping[str, str] | None = None,
    val_names: Sequence[str] | None = None,
    test_names: Sequence[str] | None = None,
) -> dict[str, list[str]]:
    """Split proteins into {'train', 'val', 'test'} by cluster (every member of a cluster lands in one
    split; without cluster ids each protein is its own cluster).

    ``val_names`` / ``test_names`` fix those splits (their clusters come along); otherwise a seeded
    shuffle of clusters gives each split ``round(fraction * clusters)`` of them, at least one where the
    fraction is > 0, stratified by ``strata`` (e.g. with / without a structure) so each kind is spread
    over the splits. Raises ValueError when there are too few clusters for the requested splits, when a
    named protein is unknown, or when a cluster would be in two splits.
    """
    names = sorted(names)
    known = set(names)
    cid = cluster_of(names, clusters)
    members: dict[str, list[str]] = {}
    for n in names:
        members.setdefault(cid[n], []).append(n)
    fixed: dict[str, str] = {}  # cluster -> split
    for split, listed in (("val", val_names), ("test", test_names)):
        if listed is None:
            continue
        unknown = sorted(set(listed) - known)
        if unknown:
            raise DataError(f"data.{split}_names: {unknown} are not among the proteins read ({len(names)}: "
                             f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''})")
        for n in listed:
            c = cid[n]
            if fixed.get(c, split) != split:
                raise DataError(
                    f"protein {n!r} (cluster {c}: {', '.join(members[c])}) is in data.{split}_names and also in "
                    f"data.{fixed[c]}_names: the splits must not overlap"
                )
            fixed[c] = split
    out = {s: [] for s in SPLITS}
    for c, s in fixed.items():
        out[s] += members[c]
    free = sorted(c for c in members if c not in fixed)
    want = {"val": val_fraction if val_names is None else 0.0, "test": test_fraction if test_names is None else 0.0}
    n_total = len(members)
    need = 1 + sum(1 for s in ("val", "test") if want[s] > 0)
    if len(free) < need:
        asked = " and ".join(f"data.{s}_fraction={want[s]}" for s in ("val", "test") if want[s] > 0)
        raise DataError(
            f"{len(names)} protein(s) in {n_total} cluster(s) cannot be split into train"
            f"{''.join(', ' + s for s in ('val', 'test') if want[s] > 0)} ({asked}): every split needs its own "
            f"proteins. Add data, or set data.test_fraction=0 / data.val_fraction=0 to drop a split"
        )
    by_stratum: dict[str, list[str]] = {}
    for c in free:
        key = (strata or {}).get(members[c][0], "")
        by_stratum.setdefault(key, []).append(c)
    rng = random.Random(seed)
    assigned: dict[str, list[str]] = {s: [] for s in SPLITS}  # clusters
    for key in sorted(by_stratum):
        group = by_stratum[key]
        rng.shuffle(group)
        n = len(group)
        k = {s: round(want[s] * n) if n >= need else 0 for s in ("val", "test")}
        while k["val"] + k["test"] >= n and n:  # keep one to train on
            s = "val" if k["val"] >= k["test"] else "test"
            k[s] -= 1
        assigned["test"] += group[: k["test"]]
        assigned["val"] += group[k["test"] : k["test"] + k["val"]]
        assigned["train"] += group[k["test"] + k["val"] :]
    for s in ("test", "val"):  # a split asked for gets at least one cluster
        if want[s] > 0 and not assigned[s]:
            assigned[s].append(assigned["train"].pop())
    for s in SPLITS:
        for c in assigned[s]:
            out[s] += members[c]
    check_disjoint(out, cid)
    return {s: sorted(v) for s, v in out.items()}


def check_disjoint(splits: Mapping[str, Sequence[str]], cluster_ids: Mapping[str, str] | None = None,
                   sequences: Mapping[str, str] | None = None) -> None:
    """Raise ValueError if a protein, a cluster or an identical sequence is in two splits (named)."""
    seen: dict[tuple[str, str], str] = {}
    for split in SPLITS:
        for n in splits.get(split, ()):
            keys = [("protein", n)]
            if cluster_ids and cluster_ids.get(n, n) != n:
                keys.append(("cluster", cluster_ids[n]))
            if sequences and n in sequences:
                keys.append(("sequence", sequences[n]))
            for key in keys:
                other = seen.setdefault(key, f"{split}:{n}")
                if other.split(":", 1)[0] != split:
                    what = key[0] if key[0] != "sequence" else "identical sequence"
                    raise DataError(
                        f"the {split} set overlaps the {other.split(':', 1)[0]} set: {split} protein {n!r} and "
                        f"{other.split(':', 1)[0]} protein {other.split(':', 1)[1]!r} share a {what}"
                        + (f" ({key[1]})" if key[0] == "cluster" else "")
                    )


@dataclass
class DataReport:
    """What a DataModule read: files per source, proteins kept and dropped (with why), split sizes."""

    sources: dict[str, dict] = field(default_factory=dict)
    kept: int = 0
    dropped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    splits: dict[str, list[str]] = field(default_factory=dict)

    def add_source(self, option: str, found: Found) -> None:
        root = found.root
        shown = "sample (bundled)" if root is not None and SAMPLE_DIR in (root, *root.parents) else str(root)
        self.sources[option] = {
            "path": shown, "files": [str(f) for f in found.files], "ignored": found.ignored,
        }

    def drop(self, name: str, why: str) -> None:
        self.dropped.append((name, why))

    def lines(self) -> list[str]:
        out = []
        for option, s in self.sources.items():
            names = [Path(f).name for f in s["files"]]
            shown = ", ".join(names[:6]) + (f", ... ({len(names) - 6} more)" if len(names) > 6 else "")
            ign = f"; ignored {len(s['ignored'])} other file(s): {', '.join(s['ignored'][:4])}" if s["ignored"] else ""
            out.append(f"data.{option}={s['path']}: {len(names)} file(s){': ' + shown if names else ''}{ign}")
        out.append(f"proteins: {self.kept} kept, {len(self.dropped)} dropped"
                   + "".join(f"\n  dropped {n}: {why}" for n, why in self.dropped))
        out += self.notes
        if self.splits:
            out.append("split by protein: " + ", ".join(f"{s} {len(v)}" for s, v in self.splits.items())
                       + "".join(f"\n  {s}: {', '.join(v[:10])}{' ...' if len(v) > 10 else ''}"
                                 for s, v in self.splits.items() if s != "train" and v))
        return out

    def emit(self) -> None:
        logged = bool(logging.getLogger().handlers)  # under Hydra: console and the run's train.log
        for line in self.lines():
            if logged:
                log.info(line)
            else:
                print(f"[data] {line}", flush=True)

    def to_dict(self) -> dict:
        return {"sources": self.sources, "kept": self.kept, "dropped": [dict(name=n, why=w) for n, w in self.dropped],
                "notes": self.notes, "splits": self.splits}

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "data.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path
