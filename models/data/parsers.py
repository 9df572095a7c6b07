"""Parsers for A3M alignments and FASTA files.

Every parser raises ``ValueError("<file>:<line>: <what is wrong>")`` on malformed input, so a user
with a directory of their own files knows which line to fix. mmCIF structures live in ``structure.py``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_A3M_OK = re.compile(r"^[A-Za-z\-.*]*$")
_FASTA_OK = re.compile(r"^[A-Za-z\-*]*$")


@dataclass
class Record:
    """One FASTA/A3M record: header text (without '>'), sequence, and the line its header is on."""

    header: str
    sequence: str
    line: int


@dataclass
class MSA:
    """A parsed alignment.

    ``aligned``: rows of equal length L (the query's length): upper-case residues and '-' gaps,
    insertions (lower-case, '.') removed. ``unaligned``: each row's full sequence (insertions kept,
    upper-cased, gaps removed), for language-model data. Row 0 is the query.
    """

    name: str
    aligned: list[str]
    unaligned: list[str] = field(default_factory=list)
    headers: list[str] = field(default_factory=list)

    @property
    def query(self) -> str:
        return self.aligned[0]

    def __len__(self) -> int:
        return len(self.aligned)


def _records(path: Path, allowed: re.Pattern, kind: str) -> list[Record]:
    """Split a FASTA-like file into records, checking every sequence line against ``allowed``."""
    from .sources import read_text  # gzip, a UTF-8 BOM and CRLF line ends handled there

    records: list[Record] = []
    for lineno, raw in enumerate(read_text(path).split("\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith(">"):
            records.append(Record(line[1:].strip(), "", lineno))
            continue
        if line.startswith(";") or line.startswith("#"):
            continue  # comment lines (old FASTA, HHsuite '#' lines)
        if not records:
            raise ValueError(f"{path}:{lineno}: {kind} sequence data before the first '>' header")
        if not allowed.match(line):
            bad = next(c for c in line if not allowed.match(c))
            raise ValueError(
                f"{path}:{lineno}: invalid character {bad!r} in {kind} sequence "
                f"(allowed: letters, '-'{', .' if kind == 'A3M' else ''} and '*')"
            )
        records[-1].sequence += line
    if not records:
        raise ValueError(f"{path}:1: no '>' records found in {kind} file")
    for r in records:
        if not r.sequence.rstrip("*"):
            raise ValueError(f"{path}:{r.line}: {kind} record {r.header!r} has an empty sequence")
    return records


def read_fasta(path: str | Path) -> list[Record]:
    """Read a FASTA file into records (sequence upper-cased, a trailing '*' stop removed)."""
    path = Path(path)
    records = _records(path, _FASTA_OK, "FASTA")
    for r in records:
        r.sequence = r.sequence.rstrip("*").upper()
    return records


def read_a3m(path: str | Path, max_rows: int | None = None) -> MSA:
    """Read an A3M alignment (first record = query; lower-case/'.' = insertions; '-' = gap); ``.a3m.gz`` too.

    An all-lower-case query makes the whole file a plain alignment (letters upper-cased, each a column).

    ``max_rows`` keeps the query plus the first ``max_rows - 1`` hits. Every aligned row must have the
    query's length after insertions are dropped; otherwise the error names the row's header line.
    """
    path = Path(path)
    records = _records(path, _A3M_OK, "A3M")
    if max_rows is not None:
        records = records[:max_rows]
    query = records[0].sequence
    if not any(c.isupper() for c in query) and any(c.islower() for c in query):
        # an all-lowercase query has no match columns in A3M terms: the file is a plain (case-free)
        # alignment, so every letter is a column; rows must then have the query's length
        import logging

        logging.getLogger("attn_zoo.data").warning(
            "%s: the query is all lower-case: reading the file as a plain alignment (every letter a column)", path)
        for r in records:
            r.sequence = r.sequence.upper()
    aligned, unaligned, headers = [], [], []
    length = None
    for r in records:
        seq = r.sequence.rstrip("*")
        row = "".join(c for c in seq if c.isupper() or c == "-")
        if length is None:
            if not row.replace("-", ""):
                raise ValueError(f"{path}:{r.line}: A3M query is all gaps")
            length = len(row)
        elif len(row) != length:
            raise ValueError(
                f"{path}:{r.line}: A3M row {r.header[:40]!r} has {len(row)} aligned columns after "
                f"dropping insertions, but the query (first record) has {length}"
            )
        aligned.append(row)
        unaligned.append("".join(c for c in seq if c not in "-.").upper())
        headers.append(r.header)
    from .sources import protein_name

    return MSA(name=protein_name(path, path), aligned=aligned, unaligned=unaligned, headers=headers)
