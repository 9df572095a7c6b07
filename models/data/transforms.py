"""Per-example transforms: cropping, MSA subsampling, BERT-style masking.

All take an optional ``torch.Generator`` so validation examples are the same every epoch.
"""
from __future__ import annotations

import torch

from .alphabet import GAP, MASK

NUM_RESIDUE_TYPES = 20  # random replacements are drawn from the 20 amino acids


def crop_start(length: int, crop_size: int, generator: torch.Generator | None = None) -> int:
    """A uniformly random start for a contiguous crop of ``crop_size`` (0 if the protein is shorter)."""
    if crop_size is None or length <= crop_size:
        return 0
    return int(torch.randint(0, length - crop_size + 1, (1,), generator=generator))


def subsample_msa(msa: torch.Tensor, depth: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Keep the query (row 0) plus up to ``depth - 1`` random other rows.

    msa ``[S, L]`` long -> ``[min(S, depth), L]``. Rows that are all gaps (e.g. outside a crop) are
    drawn only when there are not enough informative rows.
    """
    if msa.dim() != 2:
        raise ValueError(f"subsample_msa: msa must be [S, L], got shape {tuple(msa.shape)}")
    if depth < 1:
        raise ValueError(f"subsample_msa: depth must be >= 1, got {depth}")
    others = torch.arange(1, msa.shape[0])
    informative = (msa[1:] != GAP).any(dim=1)
    order = torch.randperm(len(others), generator=generator)
    order = torch.cat([order[informative[order]], order[~informative[order]]])  # informative rows first
    keep = torch.cat([torch.zeros(1, dtype=torch.long), others[order[: depth - 1]]])
    return msa[keep]


def bert_mask(
    tokens: torch.Tensor,
    mask_prob: float,
    generator: torch.Generator | None = None,
    maskable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: choose ``mask_prob`` of the maskable positions; of those 80% -> <mask>,
    10% -> a random amino acid, 10% unchanged.

    tokens ``[*]`` long -> (corrupted ``[*]`` long, chosen ``[*]`` bool: positions the loss scores).
    ``maskable`` ``[*]`` bool (default: every position).
    """
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"bert_mask: mask_prob must be in [0, 1], got {mask_prob}")
    u = torch.rand(tokens.shape, generator=generator)
    chosen = u < mask_prob
    if maskable is not None:
        chosen &= maskable
    action = torch.rand(tokens.shape, generator=generator)
    random_aa = torch.randint(0, NUM_RESIDUE_TYPES, tokens.shape, generator=generator)
    out = tokens.clone()
    out = torch.where(chosen & (action < 0.8), torch.full_like(tokens, MASK), out)
    out = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_aa, out)
    return out, chosen
