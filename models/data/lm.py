"""Protein language-model data: masked LM (ESM-2 style) and causal LM over concatenated proteins.

Sequences come from FASTA files and from A3M files (the query only, or every row with its
insertions kept and gaps removed). Train/val are split by group (a FASTA record, or a whole MSA
family) so validation proteins are unseen.
"""
from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from .alphabet import GAP, encode
from .batching import collate_lm
from .parsers import read_a3m, read_fasta
from .sample import list_files, resolve, split_names
from .transforms import bert_mask


def load_sequences(fasta="sample", msa_dir="sample", msa_rows: str = "query") -> list[tuple[str, str]]:
    """-> [(group, sequence)], exact duplicates dropped. ``msa_rows``: 'query' or 'all'."""
    if msa_rows not in ("query", "all"):
        raise ValueError(f"msa_rows must be 'query' or 'all', got {msa_rows!r}")
    out, seen = [], set()

    def add(group, seq):
        if seq and seq not in seen:
            seen.add(seq)
            out.append((group, seq))

    for path in list_files(resolve(msa_dir, "msa"), (".a3m",)):
        msa = read_a3m(path)
        for seq in msa.unaligned if msa_rows == "all" else msa.unaligned[:1]:
            add(f"msa:{path.stem}", seq)
    for path in list_files(resolve(fasta, "fasta"), (".fasta", ".fa", ".faa")):
        for rec in read_fasta(path):
            add(f"fasta:{path.stem}:{rec.header.split()[0] if rec.header else rec.line}", rec.sequence)
    if not out:
        raise ValueError(f"no sequences found (fasta={fasta!r}, msa_dir={msa_dir!r})")
    return out


def split_sequences(seqs, val_fraction, seed):
    """Split [(group, seq)] by group -> (train seqs, val seqs)."""
    train_groups, val_groups = split_names(sorted({g for g, _ in seqs}), val_fraction, seed)
    return [s for g, s in seqs if g in train_groups], [s for g, s in seqs if g in val_groups]


class MaskedLMDataset(Dataset):
    """Random crops (<= ``max_len``) of sequences with BERT masking.

    Example: tokens (corrupted), target ``[L]`` long, loss_mask ``[L]`` bool. ``seed`` fixes the
    example per index (validation); None draws from the global RNG (training).
    """

    def __init__(self, seqs: list[str], max_len=128, mask_prob=0.15, num_samples=None, seed=None):
        if not seqs:
            raise ValueError("MaskedLMDataset: no sequences")
        self.tokens = [encode(s) for s in seqs]
        self.max_len, self.mask_prob, self.seed = max_len, mask_prob, seed
        self.num_samples = num_samples or len(seqs)

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        g = None if self.seed is None else torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        t = self.tokens[i % len(self.tokens)]
        if len(t) > self.max_len:
            s0 = int(torch.randint(0, len(t) - self.max_len + 1, (1,), generator=g))
            t = t[s0 : s0 + self.max_len]
        corrupted, chosen = bert_mask(t, self.mask_prob, g)
        return {"tokens": corrupted, "target": t, "loss_mask": chosen}


class CausalLMDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens from one stream of proteins joined by the gap token.

    Example: tokens = window[:-1], target = window[1:] ``[seq_len]``, loss_mask all True.
    """

    def __init__(self, seqs: list[str], seq_len=256, num_samples=None, seed=None):
        parts = []
        for s in seqs:
            parts += [encode(s), torch.tensor([GAP])]
        self.stream = torch.cat(parts)  # [T]
        if len(self.stream) < seq_len + 1:
            raise ValueError(f"CausalLMDataset: {len(self.stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.seq_len, self.seed = seq_len, seed
        self.num_samples = num_samples or max(1, len(self.stream) // (seq_len + 1))

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        g = None if self.seed is None else torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        s0 = int(torch.randint(0, len(self.stream) - self.seq_len, (1,), generator=g))
        w = self.stream[s0 : s0 + self.seq_len + 1]
        return {"tokens": w[:-1], "target": w[1:], "loss_mask": torch.ones(self.seq_len, dtype=torch.bool)}


class _LMDataModule(L.LightningDataModule):
    def __init__(self, fasta="sample", msa_dir="sample", msa_rows="query", batch_size=8, train_samples=512,
                 val_samples=64, val_fraction=0.2, split_seed=0, num_workers=0):
        super().__init__()
        self.train_set = self.val_set = None

    def _datasets(self, train_seqs, val_seqs):
        raise NotImplementedError

    def setup(self, stage=None):
        if self.train_set is not None:
            return
        h = self.hparams
        seqs = load_sequences(h.fasta, h.msa_dir, h.msa_rows)
        train, val = split_sequences(seqs, h.val_fraction, h.split_seed)
        self.train_set, self.val_set = self._datasets(train, val)

    def _loader(self, ds, shuffle):
        return DataLoader(ds, batch_size=self.hparams.batch_size, shuffle=shuffle, collate_fn=collate_lm,
                          num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0)

    def train_dataloader(self):
        return self._loader(self.train_set, True)

    def val_dataloader(self):
        return self._loader(self.val_set, False)

    def test_dataloader(self):
        return self._loader(self.val_set, False)


class MaskedLMDataModule(_LMDataModule):
    """ESM-2-style masked LM on FASTA + MSA query sequences ('sample' = bundled)."""

    def __init__(self, fasta="sample", msa_dir="sample", msa_rows="query", max_len=128, mask_prob=0.15,
                 batch_size=8, train_samples=512, val_samples=64, val_fraction=0.2, split_seed=0, num_workers=0):
        super().__init__(fasta, msa_dir, msa_rows, batch_size, train_samples, val_samples, val_fraction,
                         split_seed, num_workers)
        self.save_hyperparameters(logger=False)

    def _datasets(self, train, val):
        h = self.hparams
        return (MaskedLMDataset(train, h.max_len, h.mask_prob, h.train_samples, None),
                MaskedLMDataset(val, h.max_len, h.mask_prob, h.val_samples, h.split_seed + 1))


class CausalLMDataModule(_LMDataModule):
    """Causal LM on proteins concatenated into one stream (default: every MSA row + FASTA)."""

    def __init__(self, fasta="sample", msa_dir="sample", msa_rows="all", seq_len=256, batch_size=8,
                 train_samples=512, val_samples=64, val_fraction=0.2, split_seed=0, num_workers=0):
        super().__init__(fasta, msa_dir, msa_rows, batch_size, train_samples, val_samples, val_fraction,
                         split_seed, num_workers)
        self.save_hyperparameters(logger=False)

    def _datasets(self, train, val):
        h = self.hparams
        return (CausalLMDataset(train, h.seq_len, h.train_samples, None),
                CausalLMDataset(val, h.seq_len, h.val_samples, h.split_seed + 1))
