"""Plain PyTorch attention: the ground truth for every test and the ``torch`` backend.

Materialises the ``[*batch, H, Lq, Lk]`` scores, so it is meant for small inputs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .inputs import combine_masks, fold_segments

Tensor = torch.Tensor


def safe_lse(s: Tensor) -> Tensor:
    """log(sum(exp(s), -1)) that gives -inf (and zero gradient, never NaN) for rows that are all -inf."""
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.exp(s - m).sum(-1)
    ok = total > 0
    log_total = torch.log(torch.where(ok, total, torch.ones_like(total)))
    return torch.where(ok, m.squeeze(-1) + log_total, torch.full_like(total, float("-inf")))


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = False,
    upcast: bool = True,
    segment_ids=None,
) -> Tuple[Tensor, Tensor]:
    """softmax(q k^T * scale + bias, masked) v, and its log-sum-exp.

    Args:
        q: ``[*batch, H, Lq, D]``; k: ``[*batch, H, Lk, D]``; v: ``[*batch, H, Lk, Dv]``.
        bias: float, broadcastable to ``[*batch, H, Lq, Lk]``.
        mask: bool, broadcastable to ``[*batch, H, Lq, Lk]``, True = attend.
        causal: query i sees key j when ``j <= i + (Lk - Lq)``.
        upcast: compute in float32 when the inputs are fp16/bf16 (False reproduces plain low-precision
            PyTorch, which tests use as the yardstick of acceptable error).
        segment_ids: None or ``(q_ids, k_ids)``, each ``[*batch, L]`` ints broadcastable over the batch dims
            (as :func:`attn_ops.inputs.check_segment_ids` returns them): a query attends only keys with its own
            non-negative id; materialised as a mask.

    Returns:
        out ``[*batch, H, Lq, Dv]`` in q's dtype, and lse ``[*batch, H, Lq]`` in float32 (float64 for
        float64 inputs): the natural log of the softmax denominator; -inf (with output 0) for a row with no
        key to attend.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    cdt = torch.float32 if (upcast and q.dtype in (torch.float16, torch.bfloat16)) else q.dtype
    s = torch.matmul(q.to(cdt), k.to(cdt).transpose(-1, -2)) * scale  # [*batch, H, Lq, Lk]
    if bias is not None:
        s = s + bias.to(cdt)
    full_mask = combine_masks(fold_segments(mask, segment_ids), causal, q.shape[-2], k.shape[-2], q.device)
    if full_mask is not None:
        s = s.masked_fill(~full_mask, float("-inf"))
    lse = safe_lse(s)  # [*batch, H, Lq]
    lse_sub = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    p = torch.exp(s - lse_sub.unsqueeze(-1))  # rows with lse = -inf give exactly 0
    out = torch.matmul(p, v.to(cdt))  # [*batch, H, Lq, Dv]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def attention_reference_backend(q, k, v, bias, mask, scale, causal, deterministic=True, segment_ids=None):
    """The ``torch`` backend: :func:`attention_reference` with float32 accumulation."""
    return attention_reference(q, k, v, bias, mask, scale, causal, segment_ids=segment_ids)
