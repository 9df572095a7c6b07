"""Batching with padding masks.

Examples are dicts of tensors with different lengths; ``pad_stack`` pads every dimension to the
batch maximum. Masks are bool, True = real (attend / score), False = padding.

``length_multiple`` (the collate functions, the data modules, ``attn-zoo-embed``) pads the residue / token
length further, to a multiple: batches then come in a few lengths instead of every length, so each of cuBLAS's
per-shape choices (paid on a shape's first call, docs/bench/varlen_h100.md) and every other per-shape cost is
paid once per multiple. Outputs at real positions do not change (padding is masked).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..shapes import round_up
from .alphabet import PAD


def pad_stack(tensors: list[torch.Tensor], value, sizes: Optional[Sequence[Optional[int]]] = None) -> torch.Tensor:
    """Stack tensors of equal rank and any sizes into ``[B, *max_sizes]``, filling with ``value``.

    ``sizes``: per dimension, a size to pad to instead of the batch maximum (None: the maximum); at least the
    maximum."""
    if not tensors:
        raise ValueError("pad_stack: empty list")
    ranks = {t.dim() for t in tensors}
    if len(ranks) != 1:
        raise ValueError(f"pad_stack: tensors have different ranks {sorted(ranks)}")
    sizes_max = [max(t.shape[d] for t in tensors) for d in range(tensors[0].dim())]
    if sizes is None:
        sizes = sizes_max
    else:
        if len(sizes) != len(sizes_max):
            raise ValueError(f"pad_stack: sizes {list(sizes)} do not match the tensors' rank {len(sizes_max)}")
        if any(s is not None and s < m for s, m in zip(sizes, sizes_max)):
            raise ValueError(f"pad_stack: sizes {list(sizes)} below the batch maximum {sizes_max}")
        sizes = [m if s is None else s for s, m in zip(sizes, sizes_max)]
    out = torch.full([len(tensors), *sizes], value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[(i, *[slice(0, s) for s in t.shape])] = t
    return out


def collate_msa(examples: list[dict], length_multiple: int = 1) -> dict:
    """MSA examples -> batch (the residue dimension ``N`` padded to a multiple of ``length_multiple``).

    Per example: msa / msa_target ``[S, L]`` long, msa_loss_mask ``[S, L]`` bool, residue_index
    ``[L]`` long, distogram ``[L, L]`` long, distogram_mask ``[L, L]`` bool.
    Batch: msa, msa_target ``[B, S, N]``; msa_mask, msa_loss_mask ``[B, S, N]`` bool;
    seq_mask ``[B, N]``; pair_mask ``[B, N, N]``; residue_index ``[B, N]``; distogram ``[B, N, N]``;
    distogram_mask ``[B, N, N]``; has_structure ``[B]`` bool.
    """
    n = round_up(max(e["msa"].shape[-1] for e in examples), length_multiple)
    rows, pair = (None, n), (n, n)
    msa = pad_stack([e["msa"] for e in examples], PAD, rows)  # [B, S, N]
    real = pad_stack([torch.ones_like(e["msa"], dtype=torch.bool) for e in examples], False, rows)  # [B, S, N]
    seq_mask = real[:, 0]  # [B, N]
    return {
        "msa": msa,
        "msa_target": pad_stack([e["msa_target"] for e in examples], PAD, rows),
        "msa_mask": real,
        "msa_loss_mask": pad_stack([e["msa_loss_mask"] for e in examples], False, rows),
        "seq_mask": seq_mask,
        "pair_mask": seq_mask[:, :, None] & seq_mask[:, None, :],  # [B, N, N]
        "residue_index": pad_stack([e["residue_index"] for e in examples], 0, (n,)),
        "distogram": pad_stack([e["distogram"] for e in examples], 0, pair),
        "distogram_mask": pad_stack([e["distogram_mask"] for e in examples], False, pair),
        "has_structure": torch.tensor([bool(e["distogram_mask"].any()) for e in examples]),
    }


def collate_lm(examples: list[dict], length_multiple: int = 1) -> dict:
    """LM examples (tokens, target ``[L]`` long; loss_mask ``[L]`` bool) -> batch with
    tokens, target ``[B, L]``, loss_mask ``[B, L]`` and pad_mask ``[B, L]`` (True = real token); ``L`` padded to
    a multiple of ``length_multiple``."""
    cols = (round_up(max(e["tokens"].shape[0] for e in examples), length_multiple),)
    tokens = pad_stack([e["tokens"] for e in examples], PAD, cols)  # [B, L]
    return {
        "tokens": tokens,
        "target": pad_stack([e["target"] for e in examples], PAD, cols),
        "loss_mask": pad_stack([e["loss_mask"] for e in examples], False, cols),
        "pad_mask": pad_stack([torch.ones_like(e["tokens"], dtype=torch.bool) for e in examples], False, cols),
    }
