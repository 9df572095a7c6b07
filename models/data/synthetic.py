"""Synthetic data for benchmarks: random MSAs with random distogram targets, random token streams.

Fixed shapes (no padding) so throughput numbers measure the model, not the data. Every example i is
drawn from a generator seeded by i, so runs are reproducible.
"""
from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from .batching import collate_lm, collate_msa
from .structure import NUM_DISTOGRAM_BINS
from .transforms import NUM_RESIDUE_TYPES, bert_mask


class SyntheticMSADataset(Dataset):
    """``num_samples`` MSA examples of depth ``msa_depth`` and length ``length`` (see collate_msa)."""

    def __init__(self, num_samples=64, msa_depth=32, length=64, mask_prob=0.15):
        self.num_samples, self.msa_depth, self.length, self.mask_prob = num_samples, msa_depth, length, mask_prob

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        msa = torch.randint(0, NUM_RESIDUE_TYPES, (self.msa_depth, self.length), generator=g)  # [S, L]
        corrupted, chosen = bert_mask(msa, self.mask_prob, g)
        return {
            "msa": corrupted, "msa_target": msa, "msa_loss_mask": chosen,
            "residue_index": torch.arange(self.length),
            "distogram": torch.randint(0, NUM_DISTOGRAM_BINS, (self.length, self.length), generator=g),
            "distogram_mask": torch.ones(self.length, self.length, dtype=torch.bool),
        }


class SyntheticLMDataset(Dataset):
    """``num_samples`` random token windows of ``seq_len`` (target = next token, all scored)."""

    def __init__(self, num_samples=64, seq_len=1024):
        self.num_samples, self.seq_len = num_samples, seq_len

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        w = torch.randint(0, NUM_RESIDUE_TYPES, (self.seq_len + 1,), generator=g)
        return {"tokens": w[:-1], "target": w[1:], "loss_mask": torch.ones(self.seq_len, dtype=torch.bool)}


class _SyntheticDataModule(L.LightningDataModule):
    collate = None

    def __init__(self, batch_size=1, train_samples=64, val_samples=8, **shape):
        super().__init__()
        self.batch_size, self.train_samples, self.val_samples, self.shape = batch_size, train_samples, val_samples, shape

    def setup(self, stage=None):
        pass

    def _loader(self, n):
        return DataLoader(self.make(n, **self.shape), batch_size=self.batch_size, collate_fn=type(self).collate)

    def train_dataloader(self):
        return self._loader(self.train_samples)

    def val_dataloader(self):
        return self._loader(self.val_samples)

    def test_dataloader(self):
        return self._loader(self.val_samples)


class SyntheticMSADataModule(_SyntheticDataModule):
    """Random MSAs: ``SyntheticMSADataModule(batch_size, train_samples, val_samples, msa_depth=, length=)``."""

    collate = staticmethod(collate_msa)
    make = staticmethod(SyntheticMSADataset)


class SyntheticLMDataModule(_SyntheticDataModule):
    """Random token windows: ``SyntheticLMDataModule(batch_size, train_samples, val_samples, seq_len=)``."""

    collate = staticmethod(collate_lm)
    make = staticmethod(SyntheticLMDataset)
