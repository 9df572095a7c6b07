"""Third-party attention kernels behind the op's contract (imports stay inside the functions); flex has its
own module, :mod:`attn_ops.flex`.

Each adapter takes canonical inputs (bias/mask already have q.ndim dims) and returns ``(out, lse)``;
``lse`` is None for kernels that do not produce one.
"""
from __future__ import annotations

import math

import torch

from .inputs import combine_masks, fold_segments

Tensor = torch.Tensor


def _live_rows(mask: Tensor) -> Tensor:
    """[..., Lq, 1] True where a query row has at least one key to attend."""
    return mask.any(-1, keepdim=True)


def sdpa_attention(q, k, v, bias, mask, scale, causal, deterministic=True, segment_ids=None):
    """``torch.nn.functional.scaled_dot_product_attention`` with bias and mask (and segment ids, as a
    materialised mask) folded into attn_mask."""
    import torch.nn.functional as F

    mask = fold_segments(mask, segment_ids)
    full_mask = combine_masks(mask, causal, q.shape[-2], k.shape[-2], q.device)
    live = None
    attn_mask = None
    if full_mask is not None:
        live = _live_rows(full_mask)
        # A row with no key would give NaN; let it attend everywhere and zero its output below.
        full_mask = full_mask | ~live
    if bias is not None:
        attn_mask = bias.to(q.dtype)
        if full_mask is not None:
            attn_mask = attn_mask.masked_fill(~full_mask, float("-inf"))
    elif full_mask is not None:
        attn_mask = full_mask
    lead = q.shape[:-3]
    n = math.prod(lead) if lead else 1
    # SDPA's fused kernels want [N, H, L, D]: leading dims flatten into N (views for q, k, v).
    q4, k4, v4 = (t.reshape((n,) + t.shape[-3:]) for t in (q, k, v))
    m4 = None
    if attn_mask is not None:
        attn_mask = attn_mask.reshape((1,) * (q.ndim - attn_mask.ndim) + tuple(attn_mask.shape))
        tail = attn_mask.shape[-3:]  # [H or 1, Lq or 1, Lk or 1]: SDPA broadcasts these itself
        if all(s == 1 for s in attn_mask.shape[:-3]):
            m4 = attn_mask.reshape((1,) + tail)
        else:  # a mask shared over some batch dims only: SDPA has no way to broadcast it, so it is copied
            m4 = attn_mask.expand(lead + tail).reshape((n,) + tail)
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=m4, scale=scale)
    out = out.reshape(q.shape[:-1] + v.shape[-1:])
    if live is not None:
        out = torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out, None
