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
<<<<<<< HEAD
=======


@lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _call_flex(device_type: str, q, k, v, score_mod, scale, block_mask=None):
    import warnings

    from torch.nn.attention import flex_attention as fa

    def call(fn):
        if hasattr(fa, "AuxRequest"):
            out, aux = fn(q, k, v, score_mod=score_mod, scale=scale, block_mask=block_mask,
                          return_aux=fa.AuxRequest(lse=True))
            return out, aux.lse
        return fn(q, k, v, score_mod=score_mod, scale=scale, block_mask=block_mask, return_lse=True)

    if device_type == "cuda":
        return call(_compiled_flex())
    with warnings.catch_warnings():
        # Off CUDA, flex runs unfused (materialised scores): acceptable for the CPU fallback it is there.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return call(fa.flex_attention)


def _index(t: Tensor, lead_sizes, b, *tail):
    """``t[b0, b1, ..., *tail]`` for a flattened batch index ``b`` (``tail`` = h, q_idx[, kv_idx]); dims of
    size 1 (broadcast) are read at 0."""
    idx = []
    rest = b
    for i in range(len(lead_sizes) - 1, -1, -1):
        idx.append(0 if t.shape[i] == 1 else rest % lead_sizes[i])
        rest = rest // lead_sizes[i]
    idx.reverse()
    n = len(lead_sizes)
    idx += [0 if t.shape[n + j] == 1 else x for j, x in enumerate(tail)]
    return t[tuple(idx)]


def _segment_block_mask(segment_ids, lead, n, lq, lk, causal, device):
    """A flex ``BlockMask`` from a mask_mod on the ids: key blocks that share no id with a query block are
    skipped (the document mask of packed rows); the score_mod still applies the exact mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    qi, ki = segment_ids
    shift = lk - lq

    def mask_mod(b, h, q_idx, kv_idx):
        a = _index(qi, lead, b, q_idx)
        keep = (a == _index(ki, lead, b, kv_idx)) & (a >= 0)
        if causal:
            keep = keep & (kv_idx <= q_idx + shift)
        return keep

    return create_block_mask(mask_mod, n, None, lq, lk, device=device)


def flex_attention(q, k, v, bias, mask, scale, causal, deterministic=True, segment_ids=None):
    """``flex_attention`` (compiled on CUDA) with a score_mod that reads bias and mask through indices; segment
    ids add a block mask from a mask_mod on the ids (and their mask to the score_mod's)."""
    lead = tuple(q.shape[:-3])
    n = math.prod(lead) if lead else 1
    lq, lk = q.shape[-2], k.shape[-2]
    shift = lk - lq
    block_mask = None
    if segment_ids is not None:
        block_mask = _segment_block_mask(segment_ids, lead, n, lq, lk, causal, q.device)
        mask = fold_segments(mask, segment_ids)
    full_mask = combine_masks(mask, causal, lq, lk, q.device)
    live = None if full_mask is None else _live_rows(full_mask)  # [..., Lq, 1]
    live_idx = None if live is None else live.squeeze(-1)  # [..., Lq], broadcast dims of size 1
    if live_idx is not None and live_idx.ndim < q.ndim - 1:
        live_idx = live_idx.reshape((1,) * (q.ndim - 1 - live_idx.ndim) + tuple(live_idx.shape))
    bias_c, mask_c = bias, mask

    def score_mod(score, b, h, q_idx, kv_idx):
        if bias_c is not None:
            score = score + _index(bias_c, lead, b, h, q_idx, kv_idx).to(score.dtype)
        keep = None
        if mask_c is not None:
            keep = _index(mask_c, lead, b, h, q_idx, kv_idx)
        if causal:
            c = kv_idx <= q_idx + shift
            keep = c if keep is None else keep & c
        if keep is not None:
            dead_row = ~_index(live_idx, lead, b, h, q_idx)
            score = torch.where(keep | dead_row, score, -float("inf"))
        return score

    q4, k4, v4 = (t.reshape((n,) + t.shape[-3:]) for t in (q, k, v))
    out, lse = _call_flex(q.device.type, q4, k4, v4, score_mod, scale, block_mask)
    out = out.reshape(q.shape[:-1] + v.shape[-1:])
    lse = lse.reshape(q.shape[:-1]).float()
    if live is not None:
        out = torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))
        lse = torch.where(live.squeeze(-1), lse, torch.full((), float("-inf"), device=lse.device))
    return out, lse

>>>>>>> seg
