"""Protein language-model data: masked LM (ESM-2 style) and causal LM over concatenated proteins.

Sequences come from FASTA files and from A3M files (the query only, or every row with its
insertions kept and gaps removed). Train/val are split by group (a FASTA record, or a whole MSA
family) so validation proteins are unseen.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.data import DataLoader, Dataset

from .alphabet import GAP, encode
from .base import SplitDataModule
from ..shapes import check_multiple
from .packing import TokenBudgetSampler, check_frame, collate_packed, collate_with_segments
from .parsers import read_a3m, read_fasta
from .sample import DataError
from .sources import DataReport, check_readable, gather_sources, protein_name, read_clusters, read_each, split_proteins
from .transforms import bert_mask


def load_sequences(fasta="sample", msa_dir="sample", msa_rows: str = "query",
                   report: DataReport | None = None) -> list[tuple[str, str]]:
    """-> [(group, sequence)], exact duplicates dropped (recorded in ``report``). ``msa_rows``: 'query'
    or 'all'. A group (the unit of the train/val/test split) is one FASTA record or one whole A3M file."""
    if msa_rows not in ("query", "all"):
        raise ValueError(f"msa_rows must be 'query' or 'all', got {msa_rows!r}")
    report = report if report is not None else DataReport()
    found = gather_sources({"fasta": fasta, "msa_dir": msa_dir},
                           {"fasta": (".fasta", ".fa", ".faa"), "msa_dir": (".a3m",)})
    for opt, f in found.items():
        if f.root is not None:
            report.add_source(opt, f)
    out, seen, rows_dropped = [], {}, [0]

    def add(group, seq, first=True):
        if seq in seen:
            if first and seen[seq] != group:  # a record or an alignment's query
                report.drop(group, f"same sequence as {seen[seq]}")
            elif not first:
                rows_dropped[0] += 1
            return
        seen[seq] = group
        out.append((group, seq))

    bad: list[str] = []  # every unreadable file named in one error
    msas = read_each(found["msa_dir"].files, read_a3m, bad)
    fastas = read_each(found["fasta"].files, read_fasta, bad)
    check_readable(bad)
    for path, msa in msas:
        for i, seq in enumerate(msa.unaligned if msa_rows == "all" else msa.unaligned[:1]):
            add(f"msa:{protein_name(path, found['msa_dir'].root)}", seq, first=i == 0)
    for path, records in fastas:
        labels: dict[str, tuple[str, int]] = {}  # folded label -> (label, line): a label names one protein
        for rec in records:
            label = rec.header.split()[0] if rec.header.split() else str(rec.line)
            if label.lower() in labels:
                first, line = labels[label.lower()]
                what = f"duplicate label {label!r}" if first == label else \
                    f"label {label!r} differs from {first!r} only in letter case"
                raise DataError(f"{path}:{rec.line}: {what} (first at line {line}): FASTA labels name the proteins "
                                "of the train/val/test split; give each record its own")
            labels[label.lower()] = (label, rec.line)
            add(f"fasta:{protein_name(path, found['fasta'].root)}:{label}", rec.sequence)
    report.kept = len({g for g, _ in out})
    if rows_dropped[0]:
        report.notes.append(f"{rows_dropped[0]} alignment row(s) dropped: exact copies of an earlier sequence")
    if not out:
        raise DataError(f"no sequences found (fasta={fasta!r}, msa_dir={msa_dir!r})")
    return out


def split_sequences(seqs, val_fraction, seed, test_fraction=0.0, clusters=None, val_names=None, test_names=None):
    """Split [(group, seq)] by group -> {'train', 'val', 'test'}: lists of sequences (and ``.groups``)."""
    groups = sorted({g for g, _ in seqs})
    splits = split_proteins(groups, val_fraction=val_fraction, test_fraction=test_fraction, seed=seed,
                            clusters=clusters, val_names=val_names, test_names=test_names)
    return {k: [s for g, s in seqs if g in set(v)] for k, v in splits.items()}, splits


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

    def lengths(self) -> list[int]:
        """Each example's token count (crops are at most ``max_len``), for packing."""
        return [min(len(self.tokens[i % len(self.tokens)]), self.max_len) for i in range(self.num_samples)]

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

    def __init__(self, seqs: list[str], seq_len=256, num_samples=None, seed=None, segments: bool = False):
        parts = []
        for s in seqs:
            parts += [encode(s), torch.tensor([GAP])]
        self.stream = torch.cat(parts)  # [T]
        if len(self.stream) < seq_len + 1:
            raise ValueError(f"CausalLMDataset: {len(self.stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.seq_len, self.seed, self.segments = seq_len, seed, segments
        self.num_samples = num_samples or max(1, len(self.stream) // (seq_len + 1))

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        g = None if self.seed is None else torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        s0 = int(torch.randint(0, len(self.stream) - self.seq_len, (1,), generator=g))
        w = self.stream[s0 : s0 + self.seq_len + 1]
        tokens = w[:-1]
        example = {"tokens": tokens, "target": w[1:], "loss_mask": torch.ones(self.seq_len, dtype=torch.bool)}
        if self.segments:  # packed: each protein attends to itself (a new segment after every separator)
            sep = tokens == GAP
            example["segment_ids"] = torch.cat([torch.zeros(1, dtype=torch.long), sep[:-1].long().cumsum(0)])
            example["loss_mask"] = ~sep  # a separator's next token starts another protein: not predictable
        return example


class _LMDataModule(SplitDataModule):
    """Shared LM data plumbing. Splits are by group (a FASTA record or an A3M file), see ``MSADataModule``
    for ``val_fraction`` / ``test_fraction`` / ``val_names`` / ``test_names`` / ``cluster_file``; group
    names are ``fasta:<file>:<record id>`` and ``msa:<file>``."""

    def _datasets(self, seqs, kind):
        raise NotImplementedError

    def setup(self, stage=None):
        if self.train_set is not None:
            return
        from .msa import _names

        h = self.hparams
        report = DataReport()
        seqs = load_sequences(h.fasta, h.msa_dir, h.msa_rows, report=report)
        clusters = read_clusters(h.cluster_file) if h.cluster_file else None
        by_split, names = split_sequences(seqs, h.val_fraction, h.split_seed, h.test_fraction, clusters,
                                          _names(h.val_names), _names(h.test_names))
        report.splits = names
        report.emit()
        self.report = report
        self.train_set = self._datasets(by_split["train"], "train")
        self.val_set = self._datasets(by_split["val"], "val") if by_split["val"] else None
        self.test_set = self._datasets(by_split["test"], "test") if by_split["test"] else None

    def _loader(self, ds, shuffle):
        if ds is None:
            return []
        h = self.hparams
        workers = dict(num_workers=h.num_workers, persistent_workers=h.num_workers > 0)
        if h.get("packing") and isinstance(ds, MaskedLMDataset):
            # batch_size rows of max_len (+ frame) tokens, filled with as many crops as fit (the padded batch's
            # memory); a crop with its frame slots takes len + frame
            frame = h.get("packing_frame", 0)
            sampler = TokenBudgetSampler([n + frame for n in ds.lengths()], h.batch_size, h.max_len + frame,
                                         shuffle=shuffle, seed=h.split_seed)
            return DataLoader(ds, batch_sampler=sampler, collate_fn=functools.partial(
                collate_packed, rows=h.batch_size, width=h.max_len + frame, frame=frame), **workers)
        collate = functools.partial(collate_with_segments, length_multiple=h.get("length_multiple", 1))
        return DataLoader(ds, batch_size=h.batch_size, shuffle=shuffle, collate_fn=collate, **workers)

    def _samples(self, kind):
        h = self.hparams
        return {"train": h.train_samples, "val": h.val_samples, "test": h.test_samples or h.val_samples}[kind]

    def _seed(self, kind):
        return {"train": None, "val": self.hparams.split_seed + 1, "test": self.hparams.split_seed + 2}[kind]


class MaskedLMDataModule(_LMDataModule):
    """ESM-2-style masked LM on FASTA + MSA query sequences ('sample' = bundled).

    ``packing=True``: each batch is ``batch_size`` rows of ``max_len`` tokens holding as many crops as fit
    (``models/data/packing.py``; the padded batch's memory, more proteins), with ``segment_ids`` and
    per-protein ``positions``; the loss counts real masked tokens either way. ``packing_frame=2`` keeps a slot
    before and after each packed crop (rows of ``max_len + 2``) for a model's ``<cls>`` and ``<eos>`` (ESM-2, ESM C);
    without packing it has no effect."""

    def __init__(self, fasta="sample", msa_dir="sample", msa_rows="query", max_len=128, mask_prob=0.15,
                 batch_size=8, train_samples=512, val_samples=64, test_samples=None, val_fraction=0.2,
                 test_fraction=0.1, val_names=None, test_names=None, cluster_file=None, split_seed=0, num_workers=0,
                 packing=False, length_multiple=1, packing_frame=0):
        super().__init__()
        check_frame(packing_frame, "packing_frame")
        if check_multiple(length_multiple) > 1 and packing:
            raise ValueError(f"length_multiple={length_multiple} has no effect with packing=True (packed rows are "
                             f"max_len={max_len} tokens wide): set one of them")
        self.save_hyperparameters(logger=False)
        self.train_set = self.val_set = self.test_set = None
        self.report = DataReport()

    def _datasets(self, seqs, kind):
        h = self.hparams
        return MaskedLMDataset(seqs, h.max_len, h.mask_prob, self._samples(kind), self._seed(kind))


class CausalLMDataModule(_LMDataModule):
    """Causal LM on proteins concatenated into one stream (default: every MSA row + FASTA).

    ``packing=True``: the windows carry ``segment_ids`` (a new protein after each separator), so a protein
    attends only to itself and its positions restart; the separator's next-token prediction is not scored."""

    def __init__(self, fasta="sample", msa_dir="sample", msa_rows="all", seq_len=256, batch_size=8,
                 train_samples=512, val_samples=64, test_samples=None, val_fraction=0.2, test_fraction=0.1,
                 val_names=None, test_names=None, cluster_file=None, split_seed=0, num_workers=0, packing=False):
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.train_set = self.val_set = self.test_set = None
        self.report = DataReport()

    def _datasets(self, seqs, kind):
        h = self.hparams
        return CausalLMDataset(seqs, h.seq_len, self._samples(kind), self._seed(kind), segments=bool(h.packing))
