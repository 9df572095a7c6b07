"""MSA + distogram data: A3M alignments (masked-MSA targets) and mmCIF structures (a single-sequence
MSA plus a distogram target). The bundled sample's alignments and structures are different proteins,
so an example has either MSA depth or a structure, and the task weighs each loss by its mask.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset

from .alphabet import encode, encode_msa
from .base import SplitDataModule
from ..shapes import check_multiple
from .batching import collate_msa
from .parsers import read_a3m
from .sample import DataError
from .sources import (DataReport, check_disjoint, check_readable, gather_sources, protein_name, read_clusters,
                      read_each, split_proteins)
from .structure import distogram_bins, read_mmcif
from .transforms import bert_mask, crop_start, subsample_msa


@dataclass
class Entry:
    """One protein: ``msa`` ``[S, L]`` tokens; ``distogram`` ``[L, L]`` bins and ``distogram_mask``
    ``[L, L]`` (all False without a structure); ``residue_index`` ``[L]`` (None: 0..L-1)."""

    name: str
    msa: torch.Tensor
    distogram: torch.Tensor
    distogram_mask: torch.Tensor
    residue_index: Optional[torch.Tensor] = None


def load_entries(msa_dir=None, mmcif_dir=None, max_msa_rows: int | None = None,
                 report: DataReport | None = None) -> list[Entry]:
    """Parse every ``.a3m`` (``.a3m.gz``) under ``msa_dir`` and every ``.cif``/``.mmcif`` (``.gz``) under
    ``mmcif_dir``, subfolders included ('sample' = bundled; None = that source unused). A structure
    whose sequence is an alignment's query joins that protein; exact duplicates and structures without
    a usable protein chain are dropped, each recorded in ``report`` with why."""
    report = report if report is not None else DataReport()
    found = gather_sources({"msa_dir": msa_dir, "mmcif_dir": mmcif_dir},
                           {"msa_dir": (".a3m",), "mmcif_dir": (".cif", ".mmcif")})
    for opt, f in found.items():
        if f.root is not None:
            report.add_source(opt, f)
    entries = []
    msa_root = found["msa_dir"].root

    def read_structure(path):
        try:
            return read_mmcif(path)
        except ValueError as err:
            if "no protein chain with" not in str(err):
                raise  # malformed or truncated: the user fixes the file
            return err  # a file without a protein chain: dropped below, with why

    bad: list[str] = []  # every unreadable file, alignments and structures, named in one error
    msas = read_each(found["msa_dir"].files, lambda p: encode_msa(read_a3m(p, max_rows=max_msa_rows).aligned), bad)
    structures = read_each(found["mmcif_dir"].files, read_structure, bad)
    check_readable(bad)
    for path, tokens in msas:  # tokens [S, L]
        n = tokens.shape[1]
        entries.append(Entry(protein_name(path, msa_root), tokens, torch.zeros(n, n, dtype=torch.long),
                             torch.zeros(n, n, dtype=torch.bool)))
    by_query = {tuple(e.msa[0].tolist()): e for e in entries}
    cif_root = found["mmcif_dir"].root
    for path, s in structures:
        name = protein_name(path, cif_root)
        if isinstance(s, ValueError):
            report.drop(name, str(s).split(": ", 1)[-1])
            continue
        bins, pair_mask = distogram_bins(s.coords, s.mask)  # [N, N], [N, N]
        key = tuple(encode(s.sequence).tolist())
        match = by_query.get(key)
        if match is not None and not match.distogram_mask.any():
            # the structure of a protein that has an alignment: its distogram joins that MSA
            match.distogram, match.distogram_mask, match.residue_index = bins, pair_mask, s.residue_index
            report.notes.append(f"structure {name} joined alignment {match.name} (same sequence)")
        elif match is None:
            by_query[key] = Entry(name, encode(s.sequence)[None], bins, pair_mask, s.residue_index)
            entries.append(by_query[key])
        else:
            report.drop(name, f"same sequence as {match.name}, which already has a structure")
    # exact duplicates of an earlier protein are dropped (the sample has 3zee and 4i6p, the same chain),
    # so one copy cannot sit in train and the other in val
    seen, unique = {}, []
    for e in entries:
        key = tuple(e.msa[0].tolist())
        if key in seen:
            report.drop(e.name, f"same query sequence as {seen[key]}")
            continue
        seen[key] = e.name
        unique.append(e)
    report.kept = len(unique)
    if not unique:
        raise DataError(f"no usable proteins in msa_dir={msa_dir!r} / mmcif_dir={mmcif_dir!r}: "
                         + "; ".join(f"{n}: {w}" for n, w in report.dropped))
    return unique


class MSADataset(Dataset):
    """Random crops of proteins: ``num_samples`` examples cycling over ``entries``.

    With ``seed=None`` crops, MSA rows and masked positions come from torch's global RNG (training:
    new every epoch, reproducible under ``seed_everything``); with a seed, example i is the same every
    epoch (validation).
    """

    def __init__(self, entries, crop_size=64, msa_depth=32, mask_prob=0.15, num_samples=None, seed=None):
        if not entries:
            raise ValueError("MSADataset: entries is empty")
        self.entries, self.crop_size, self.msa_depth = entries, crop_size, msa_depth
        self.mask_prob, self.seed = mask_prob, seed
        self.num_samples = num_samples or len(entries)

    def __len__(self) -> int:
        return self.num_samples

    def _per_example(self, per_entry: list[int]) -> list[int]:
        """A value per entry -> one per example (examples cycle over the entries)."""
        return [per_entry[i % len(per_entry)] for i in range(self.num_samples)]

    def lengths(self) -> list[int]:
        """Each example's residue count (crops are at most ``crop_size``)."""
        return self._per_example([min(e.msa.shape[1], self.crop_size or e.msa.shape[1]) for e in self.entries])

    def depths(self) -> list[int]:
        """Each example's MSA row count (at most ``msa_depth``): a batch has the most of its examples'."""
        return self._per_example([min(e.msa.shape[0], self.msa_depth) for e in self.entries])

    def __getitem__(self, i: int) -> dict:
        e = self.entries[i % len(self.entries)]
        g = None if self.seed is None else torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        n = e.msa.shape[1]
        s0 = crop_start(n, self.crop_size, g)
        crop = slice(s0, s0 + (self.crop_size or n))
        msa = subsample_msa(e.msa[:, crop], self.msa_depth, g)  # [S', L']
        corrupted, chosen = bert_mask(msa, self.mask_prob, g)
        return {
            "msa": corrupted,
            "msa_target": msa,
            "msa_loss_mask": chosen,
            "residue_index": (torch.arange(n) if e.residue_index is None else e.residue_index)[crop],
            "distogram": e.distogram[crop, crop],
            "distogram_mask": e.distogram_mask[crop, crop],
        }


class MSADataModule(SplitDataModule):
    """Masked-MSA + distogram data from A3M and mmCIF folders.

    ``msa_dir`` / ``mmcif_dir``: a folder (searched with its subfolders; ``.gz`` read) or one file,
    ``"sample"`` for the bundled real data, or None to leave that source out; the bundled data is never
    mixed with yours. Proteins are split into train/val/test by cluster (``cluster_file``: MMseqs2-style
    ``cluster_id member`` lines; else each protein is its own cluster): ``val_names`` / ``test_names``
    fix a split, otherwise ``val_fraction`` / ``test_fraction`` of the clusters (at least one each when
    > 0; 0 = no such split), stratified by whether a protein has a structure. ``setup`` prints what was
    found, kept, dropped and how it was split (``self.report``).
    """

    def __init__(
        self,
        msa_dir="sample",
        mmcif_dir="sample",
        crop_size: int = 64,
        msa_depth: int = 32,
        mask_prob: float = 0.15,
        max_msa_rows: int | None = None,
        batch_size: int = 4,
        train_samples: int = 256,
        val_samples: int = 32,
        test_samples: int | None = None,
        val_fraction: float = 0.2,
        test_fraction: float = 0.1,
        val_names: list | None = None,
        test_names: list | None = None,
        cluster_file: str | None = None,
        split_seed: int = 0,
        num_workers: int = 0,
        length_multiple: int = 1,
    ):
        super().__init__()
        check_multiple(length_multiple)
        self.save_hyperparameters(logger=False)
        self.train_set = self.val_set = self.test_set = None
        self.report = DataReport()

    def setup(self, stage=None):
        if self.train_set is not None:
            return
        h = self.hparams
        report = DataReport()
        entries = load_entries(h.msa_dir, h.mmcif_dir, h.max_msa_rows, report=report)
        clusters = read_clusters(h.cluster_file) if h.cluster_file else None
        strata = {e.name: "structure" if bool(e.distogram_mask.any()) else "msa" for e in entries}
        splits = split_proteins(
            [e.name for e in entries], val_fraction=h.val_fraction, test_fraction=h.test_fraction, seed=h.split_seed,
            clusters=clusters, strata=strata, val_names=_names(h.val_names), test_names=_names(h.test_names),
        )
        check_disjoint(splits, sequences={e.name: e.msa[0].numpy().tobytes().hex() for e in entries})
        report.splits = splits
        report.emit()
        self.report = report
        by_name = {e.name: e for e in entries}
        train, val, test = ([by_name[n] for n in splits[s]] for s in ("train", "val", "test"))
        self.train_names, self.val_names, self.test_names = splits["train"], splits["val"], splits["test"]
        common = dict(crop_size=h.crop_size, msa_depth=h.msa_depth, mask_prob=h.mask_prob)
        self.train_set = MSADataset(train, num_samples=h.train_samples, seed=None, **common)
        self.val_set = MSADataset(val, num_samples=h.val_samples, seed=h.split_seed + 1, **common) if val else None
        self.test_set = (MSADataset(test, num_samples=h.test_samples or max(len(test), h.val_samples),
                                    seed=h.split_seed + 2, **common) if test else None)

    def _loader(self, ds, shuffle):
        if ds is None:
            return []
        return DataLoader(
            ds, batch_size=self.hparams.batch_size, shuffle=shuffle,
            collate_fn=functools.partial(collate_msa, length_multiple=self.hparams.length_multiple),
            num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0,
        )



def _names(x):
    """A list of protein names from a config value (None, a list, or a comma-separated string)."""
    if x is None:
        return None
    if isinstance(x, str):
        return [n.strip() for n in x.split(",") if n.strip()]
    return [str(n) for n in x]
