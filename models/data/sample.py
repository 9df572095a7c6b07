"""Location of the bundled real sample (``models/data/sample``) and resolution of user data paths."""
from __future__ import annotations

from pathlib import Path

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
SAMPLE = {
    "msa": SAMPLE_DIR / "msa",
    "mmcif": SAMPLE_DIR / "mmcif",
    "fasta": SAMPLE_DIR / "some_proteins.fasta",
}


class DataError(ValueError):
    """The data a run names cannot be used: a missing path, no files, unreadable files (all of them named), no
    usable proteins, or a split that cannot be made. The message says what to change; no traceback needed."""


def resolve(path, kind: str) -> Path | None:
    """``"sample"`` -> the bundled sample for ``kind`` (msa, mmcif, fasta); None/'' -> None (source
    unused); anything else -> that path, which must exist."""
    if path is None or str(path) in ("", "none", "None"):
        return None
    if str(path) == "sample":
        return SAMPLE[kind]
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{kind} path {str(p)!r} does not exist (use 'sample' for the bundled data)")
    return p


def list_files(path: Path | None, suffixes: tuple[str, ...]) -> list[Path]:
    """A single file, or the sorted files in a directory with one of ``suffixes``."""
    if path is None:
        return []
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in suffixes)


def split_names(names: list[str], val_fraction: float, seed: int = 0) -> tuple[set[str], set[str]]:
    """Split item names into (train, val) sets: a seeded permutation, at least one of each when
    there are two or more names (a single item is used for both)."""
    import random

    names = sorted(names)
    if len(names) < 2:
        return set(names), set(names)
    order = names[:]
    random.Random(seed).shuffle(order)
    n_val = min(len(names) - 1, max(1, round(val_fraction * len(names))))
    return set(order[n_val:]), set(order[:n_val])
