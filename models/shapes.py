"""Length arithmetic shared by the data layer and the blocks: padding to a multiple, positions within packed
segments. Kept apart from the blocks so that data loading does not import them."""
from __future__ import annotations

from typing import Any

import torch


def check_multiple(length_multiple: Any) -> int:
    """``length_multiple`` if it is an int >= 1, else a ValueError naming it."""
    if isinstance(length_multiple, bool) or not isinstance(length_multiple, int) or length_multiple < 1:
        raise ValueError(f"length_multiple must be an int >= 1, got {length_multiple!r}")
    return length_multiple


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``n`` (padding lengths to a few shapes)."""
    return -(-n // check_multiple(multiple)) * multiple



def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Long positions restarting at 0 where the id changes along the last dim (contiguous segments); 0 on
    padding (negative ids)."""
    n = segment_ids.shape[-1]
    idx = torch.arange(n, device=segment_ids.device).expand_as(segment_ids)
    start = torch.ones_like(segment_ids, dtype=torch.bool)
    start[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(-1).values  # index of each segment's start
    return torch.where(segment_ids >= 0, idx - first, torch.zeros_like(idx))
