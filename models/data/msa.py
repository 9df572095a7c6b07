"""MSA + distogram data: A3M alignments (masked-MSA targets) and mmCIF structures (a single-sequence
MSA plus a distogram target). The bundled sample's alignments and structures are different proteins,
so an example has either MSA depth or a structure, and the task weighs each loss by its mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from .alphabet import encode, encode_msa
from .batching import collate_msa
from .parsers import read_a3m
from .sample import list_files, resolve, split_names
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


def load_entries(msa_dir=None, mmcif_dir=None, max_msa_rows: int | None = None) -> list[Entry]:
    """Parse every ``.a3m`` in ``msa_dir`` and every ``.cif`` in ``mmcif_dir`` ('sample' = bundled)."""
    entries = []
    for path in list_files(resolve(msa_dir, "msa"), (".a3m",)):
        msa = read_a3m(path, max_rows=max_msa_rows)
        tokens = encode_msa(msa.aligned)  # [S, L]
        n = tokens.shape[1]
        entries.append(
            Entry(path.stem, tokens, torch.zeros(n, n, dtype=torch.long), torch.zeros(n, n, dtype=torch.bool))
        )
    by_query = {tuple(e.msa[0].tolist()): e for e in entries}
    for path in list_files(resolve(mmcif_dir, "mmcif"), (".cif", ".mmcif")):
        s = read_mmcif(path)
        bins, pair_mask = distogram_bins(s.coords, s.mask)  # [N, N], [N, N]
        key = tuple(encode(s.sequence).tolist())
        match = by_query.get(key)
        if match is not None and not match.distogram_mask.any():
            # the structure of a protein that has an alignment: its distogram joins that MSA
            match.distogram, match.distogram_mask, match.residue_index = bins, pair_mask, s.residue_index
        elif match is None:
            by_query[key] = Entry(path.stem, encode(s.sequence)[None], bins, pair_mask, s.residue_index)
            entries.append(by_query[key])
    # exact duplicates of an earlier protein are dropped (the sample has 3zee and 4i6p, the same chain),
    # so one copy cannot sit in train and the other in val
    seen, unique = set(), []
    for e in entries:
        key = tuple(e.msa[0].tolist())
        if key not in seen:
            seen.add(key)
            unique.append(e)
    entries = unique
    if not entries:
        raise ValueError(f"no .a3m files in msa_dir={msa_dir!r} and no .cif files in mmcif_dir={mmcif_dir!r}")
    return entries


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


class MSADataModule(L.LightningDataModule):
    """Masked-MSA + distogram data from A3M and mmCIF directories.

    ``msa_dir`` / ``mmcif_dir``: a directory (or one file), ``"sample"`` for the bundled real data, or
    None to leave that source out. Proteins are split into train/val by name (``val_fraction``); the
    test set is the validation set (the sample is small).
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
        val_fraction: float = 0.2,
        split_seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.train_set = self.val_set = None

    def setup(self, stage=None):
        if self.train_set is not None:
            return
        h = self.hparams
        entries = load_entries(h.msa_dir, h.mmcif_dir, h.max_msa_rows)
        # split MSAs and structures separately so both kinds land in train and val
        train, val = [], []
        for has_structure in (False, True):
            group = [e for e in entries if bool(e.distogram_mask.any()) == has_structure]
            tr, va = split_names([e.name for e in group], h.val_fraction, h.split_seed)
            train += [e for e in group if e.name in tr]
            val += [e for e in group if e.name in va]
        self.train_names, self.val_names = [e.name for e in train], [e.name for e in val]
        common = dict(crop_size=h.crop_size, msa_depth=h.msa_depth, mask_prob=h.mask_prob)
        self.train_set = MSADataset(train, num_samples=h.train_samples, seed=None, **common)
        self.val_set = MSADataset(val, num_samples=h.val_samples, seed=h.split_seed + 1, **common)

    def _loader(self, ds, shuffle):
        return DataLoader(
            ds, batch_size=self.hparams.batch_size, shuffle=shuffle, collate_fn=collate_msa,
            num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0,
        )

    def train_dataloader(self):
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self):
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self):
        return self._loader(self.val_set, shuffle=False)
