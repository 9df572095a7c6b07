"""Loss and metric functions on padded batches (masks: True = scored)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.structure import CONTACT_CUTOFF, DISTOGRAM_EDGES
from .parallel import global_mean

# bins whose upper edge is <= 8 A: a "contact" in both prediction and target
CONTACT_BINS = int((DISTOGRAM_EDGES <= CONTACT_CUTOFF).sum())


def masked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                         group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over masked positions.

    logits ``[*, C]``, target ``[*]`` long, mask ``[*]`` bool -> (loss scalar (0 if nothing is
    masked), number of scored positions on this rank). Computed in float32. ``group``: a process group whose ranks
    hold the rest of the batch: the loss is this rank's share of the mean over all their positions
    (``parallel.global_mean``; every rank of the group calls it together).
    """
    ce = F.cross_entropy(logits.float().flatten(0, -2), target.flatten().clamp(max=logits.shape[-1] - 1), reduction="none")
    w = mask.flatten().float()
    n = w.sum()
    return global_mean((ce * w).sum(), n, group), n


def masked_accuracy(logits, target, mask) -> torch.Tensor:
    """Fraction of masked positions where argmax(logits) == target (0 if none)."""
    hit = (logits.argmax(-1) == target) & mask
    return hit.sum().float() / mask.sum().clamp(min=1).float()


def long_range_contact_precision(
    distogram_logits: torch.Tensor, distogram: torch.Tensor, pair_mask: torch.Tensor, min_separation: int = 24,
    residue_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Top-L long-range contact precision, averaged over the examples that have a structure.

    distogram_logits ``[B, N, N, bins]``, distogram ``[B, N, N]`` target bins, pair_mask ``[B, N, N]``
    (True where both residues are resolved). For each example the L pairs (L = resolved residues)
    with |i - j| >= ``min_separation`` and the highest P(d <= 8 A) are scored; precision = fraction
    that are true contacts. ``residue_index`` ``[B, N]`` (default 0..N-1) gives the sequence separation,
    so residues on either side of an unresolved loop count as far as they are. -> (mean precision, number
    of examples scored).
    """
    p_contact = distogram_logits.float().softmax(-1)[..., :CONTACT_BINS].sum(-1)  # [B, N, N]
    n = p_contact.shape[-1]
    if residue_index is None:
        residue_index = torch.arange(n, device=p_contact.device).expand(p_contact.shape[0], n)
    # [B, N, N], upper triangle only
    far = (residue_index[:, None, :] - residue_index[:, :, None]) >= min_separation
    precisions = []
    for b in range(p_contact.shape[0]):
        valid = pair_mask[b] & far[b]
        if not valid.any():
            continue
        length = int(pair_mask[b].diagonal().sum())
        scores = p_contact[b][valid]
        truth = distogram[b][valid] < CONTACT_BINS
        k = min(length, scores.numel())
        top = scores.topk(k).indices
        precisions.append(truth[top].float().mean())
    if not precisions:
        return torch.zeros((), device=p_contact.device), 0
    return torch.stack(precisions).mean(), len(precisions)
