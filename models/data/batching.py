"""Batching with padding masks.

Examples are dicts of tensors with different lengths; ``pad_stack`` pads every dimension to the
batch maximum. Masks are bool, True = real (attend / score), False = padding.
"""
from __future__ import annotations

import torch

from .alphabet import PAD


def pad_stack(tensors: list[torch.Tensor], value) -> torch.Tensor:
    """Stack tensors of equal rank and any sizes into ``[B, *max_sizes]``, filling with ``value``."""
    if not tensors:
        raise ValueError("pad_stack: empty list")
    ranks = {t.dim() for t in tensors}
    if len(ranks) != 1:
        raise ValueError(f"pad_stack: tensors have different ranks {sorted(ranks)}")
    sizes = [max(t.shape[d] for t in tensors) for d in range(tensors[0].dim())]
    out = torch.full([len(tensors), *sizes], value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[(i, *[slice(0, s) for s in t.shape])] = t
    return out


def collate_msa(examples: list[dict]) -> dict:
    """MSA examples -> batch.

    Per example: msa / msa_target ``[S, L]`` long, msa_loss_mask ``[S, L]`` bool, residue_index
    ``[L]`` long, distogram ``[L, L]`` long, distogram_mask ``[L, L]`` bool.
    Batch: msa, msa_target ``[B, S, N]``; msa_mask, msa_loss_mask ``[B, S, N]`` bool;
    seq_mask ``[B, N]``; pair_mask ``[B, N, N]``; residue_index ``[B, N]``; distogram ``[B, N, N]``;
    distogram_mask ``[B, N, N]``; has_structure ``[B]`` bool.
    """
    msa = pad_stack([e["msa"] for e in examples], PAD)  # [B, S, N]
    real = pad_stack([torch.ones_like(e["msa"], dtype=torch.bool) for e in examples], False)  # [B, S, N]
    seq_mask = real[:, 0]  # [B, N]
    return {
        "msa": msa,
        "msa_target": pad_stack([e["msa_target"] for e in examples], PAD),
        "msa_mask": real,
        "msa_loss_mask": pad_stack([e["msa_loss_mask"] for e in examples], False),
        "seq_mask": seq_mask,
        "pair_mask": seq_mask[:, :, None] & seq_mask[:, None, :],  # [B, N, N]
        "residue_index": pad_stack([e["residue_index"] for e in examples], 0),
        "distogram": pad_stack([e["distogram"] for e in examples], 0),
        "distogram_mask": pad_stack([e["distogram_mask"] for e in examples], False),
        "has_structure": torch.tensor([bool(e["distogram_mask"].any()) for e in examples]),
    }


def collate_lm(examples: list[dict]) -> dict:
    """LM examples (tokens, target ``[L]`` long; loss_mask ``[L]`` bool) -> batch with
    tokens, target ``[B, L]``, loss_mask ``[B, L]`` and pad_mask ``[B, L]`` (True = real token)."""
    tokens = pad_stack([e["tokens"] for e in examples], PAD)  # [B, L]
    return {
        "tokens": tokens,
        "target": pad_stack([e["target"] for e in examples], PAD),
        "loss_mask": pad_stack([e["loss_mask"] for e in examples], False),
        "pad_mask": pad_stack([torch.ones_like(e["tokens"], dtype=torch.bool) for e in examples], False),
    }
