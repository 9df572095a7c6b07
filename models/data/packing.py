"""Packed batches: several sequences per row, told apart by segment ids (``attn_ops.attention(segment_ids=...)``).

A packed batch has the padded batch's keys (tokens, target, loss_mask ``[R, W]``, pad_mask True on real tokens)
plus ``segment_ids`` ``[R, W]`` long (0, 1, ... per sequence along a row, -1 on padding) and ``positions``
``[R, W]`` long (restarting at 0 at each sequence). Sequences are placed first-fit decreasing, so a batch of
``rows`` rows of ``width`` tokens holds what several padded batches would.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import torch
from torch.utils.data import Sampler

from .alphabet import PAD
from ..shapes import segment_positions
from .batching import collate_lm, pad_stack


def first_fit(lengths: Sequence[int], rows: int, width: int) -> Optional[List[List[int]]]:
    """Indices of ``lengths`` per row, first-fit decreasing into ``rows`` rows of ``width`` tokens; None when they
    do not fit. Raises for a single length over ``width``."""
    placed: List[List[int]] = [[] for _ in range(rows)]
    free = [width] * rows
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        if n > width:
            raise ValueError(f"a sequence of {n} tokens does not fit a packed row of {width} (raise the row width)")
        r = next((r for r in range(rows) if free[r] >= n), None)
        if r is None:
            return None
        placed[r].append(i)
        free[r] -= n
    return placed


def check_frame(frame, name: str) -> int:
    """``frame`` if it is 0 or 2 (the slots kept around each packed sequence), else ValueError naming ``name``."""
    if frame not in (0, 2):
        raise ValueError(f"{name} must be 0 or 2 (slots around each packed sequence), got {frame!r}")
    return frame


def collate_packed(examples: List[dict], rows: int, width: int, pad: int = PAD, frame: int = 0) -> dict:
    """LM examples (tokens, target, loss_mask ``[L]``) -> a packed batch of exactly ``rows`` x ``width`` tokens
    (the padded batch's memory whatever the lengths), ``pad`` in tokens and target past the sequences. Raises if
    they do not fit.

    ``frame`` (0 or 2): slots kept around each sequence for a model's own begin and end tokens (ESM's ``<cls>`` and
    ``<eos>``): a sequence of n tokens takes n + 2 slots, the first and the last carrying its segment id with
    ``pad`` tokens and pad_mask False (the model's task writes its tokens there); positions count from the first."""
    check_frame(frame, "frame")
    placed = first_fit([len(e["tokens"]) + frame for e in examples], rows, width)
    if placed is None:
        raise ValueError(f"{len(examples)} sequences ({sum(len(e['tokens']) + frame for e in examples)} tokens"
                         f"{' with their frames' if frame else ''}) do not fit {rows} rows of {width}")
    batch = {
        "tokens": torch.full((rows, width), pad, dtype=torch.long),
        "target": torch.full((rows, width), pad, dtype=torch.long),
        "loss_mask": torch.zeros(rows, width, dtype=torch.bool),
        "pad_mask": torch.zeros(rows, width, dtype=torch.bool),
        "segment_ids": torch.full((rows, width), -1, dtype=torch.long),
    }
    for r, members in enumerate(placed):
        at = 0
        for s, i in enumerate(sorted(members)):  # dataset order within a row
            e, n = examples[i], len(examples[i]["tokens"])
            lo = at + frame // 2  # the sequence's first token
            for key in ("tokens", "target", "loss_mask"):
                batch[key][r, lo:lo + n] = e[key]
            batch["pad_mask"][r, lo:lo + n] = True
            batch["segment_ids"][r, at:at + n + frame] = s
            at += n + frame
    batch["positions"] = segment_positions(batch["segment_ids"])
    return batch


def collate_with_segments(examples: List[dict], length_multiple: int = 1) -> dict:
    """``collate_lm`` that also stacks the examples' ``segment_ids`` (padding -1) and their positions."""
    batch = collate_lm(examples, length_multiple)
    if "segment_ids" in examples[0]:
        batch["segment_ids"] = pad_stack([e["segment_ids"] for e in examples], -1, (batch["tokens"].shape[1],))
        batch["positions"] = segment_positions(batch["segment_ids"])
    return batch


class TokenBudgetSampler(Sampler[List[int]]):
    """Batches of dataset indices whose sequences pack into ``rows`` rows of ``width`` tokens (online first-fit:
    the next index joins the batch while the batch still packs, else starts the next batch).

    ``lengths[i]``: the token count of example ``i``. ``shuffle``: a new order each epoch from ``seed`` and the
    epoch number (deterministic, so ``len()`` is exact); otherwise the dataset order.
    """

    def __init__(self, lengths: Sequence[int], rows: int, width: int, shuffle: bool = True, seed: int = 0):
        if rows < 1 or width < 1:
            raise ValueError(f"packing needs rows >= 1 and width >= 1, got rows={rows}, width={width}")
        too_long = [(i, n) for i, n in enumerate(lengths) if n > width]
        if too_long:
            raise ValueError(f"{len(too_long)} example(s) longer than the packed row width {width} "
                             f"(first: index {too_long[0][0]}, {too_long[0][1]} tokens)")
        self.lengths, self.rows, self.width = list(lengths), rows, width
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def _plan(self, epoch: int) -> List[List[int]]:
        order = list(range(len(self.lengths)))
        if self.shuffle:
            order = torch.randperm(len(order), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        batches, current = [], []
        for i in order:
            if current and first_fit([self.lengths[j] for j in current + [i]], self.rows, self.width) is None:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
        return batches

    def __iter__(self) -> Iterator[List[int]]:
        plan = self._plan(self.epoch)
        self.epoch += 1
        return iter(plan)

    def __len__(self) -> int:
        return len(self._plan(self.epoch))
