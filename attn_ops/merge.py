"""Exact merging of attention over disjoint key sets by their log-sum-exp, and blockwise attention.

If ``(o_i, lse_i)`` is attention of the same queries over key set ``K_i``, attention over the union is
``o = sum_i exp(lse_i - lse) o_i`` with ``lse = log sum_i exp(lse_i)``. Both outputs are differentiable
in every ``o_i`` and ``lse_i``, so autograd through a differentiable lse gives exact gradients: each block's
backward sees the *merged* lse (through the weights), which hand-written blockwise backwards that reuse
the block's own lse get wrong.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .inputs import causal_mask, check_inputs, check_segment_ids, narrow_bcast, narrow_ids, segments_checked

Tensor = torch.Tensor


def merge_partials(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """Combine partial attention results over disjoint key sets.

    Args:
        outs: each ``[..., Lq, Dv]`` (any float dtype, all the same shape).
        lses: each ``[..., Lq]`` natural-log denominators (float32/64); -inf marks a row with no keys in that part.

    Returns:
        ``(out, lse)``: out in ``outs[0]``'s dtype, lse float32 (float64 if the lses are); rows empty in every
        part give out 0 and lse -inf with zero gradients.
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"merge_partials needs as many outs as lses (>= 1), got {len(outs)} and {len(lses)}")
    for i, (o, l) in enumerate(zip(outs, lses)):
        if o.shape[:-1] != l.shape:
            raise ValueError(f"outs[{i}] {tuple(o.shape)} does not match lses[{i}] {tuple(l.shape)} (want [..., Lq])")
        if o.shape != outs[0].shape:
            raise ValueError(f"outs[{i}] {tuple(o.shape)} differs from outs[0] {tuple(outs[0].shape)}")
    acc = torch.float64 if any(l.dtype == torch.float64 for l in lses) else torch.float32
    lse_stack = torch.stack([l.to(acc) for l in lses])  # [P, ..., Lq]
    m = lse_stack.amax(0).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_stack - m)  # [P, ..., Lq]
    total = w.sum(0)
    ok = total > 0
    safe_total = torch.where(ok, total, torch.ones_like(total))
    lse = torch.where(ok, m + torch.log(safe_total), torch.full_like(total, float("-inf")))
    out = sum((w[i] / safe_total).unsqueeze(-1) * outs[i].to(acc) for i in range(len(outs)))
    return out.to(outs[0].dtype), lse


def blockwise_attention(q, k, v, bias=None, mask=None, *, kv_chunk: int, q_chunk: Optional[int] = None,
                        scale=None, causal: bool = False, return_lse: bool = False, backend: str = "auto",
                        segment_ids=None, **options):
    """Attention computed block by block (query chunks x key chunks) and merged by lse.

    Same contract as :func:`attn_ops.attention`; each block runs ``attention(..., return_lse=True)`` on the
    chosen backend. Blocks that causality leaves empty are skipped. ``segment_ids`` (as in ``attention``) are
    checked once; each block gets its query rows' and key chunk's slices of the ids.
    """
    from .api import attention

    for name, val in (("kv_chunk", kv_chunk), ("q_chunk", q_chunk)):
        if (val is not None or name == "kv_chunk") and (not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    bias, mask, scale = check_inputs(q, k, v, bias, mask, scale)
    segment_ids = check_segment_ids(segment_ids, q, k)
    lq, lk = q.shape[-2], k.shape[-2]
    q_chunk = q_chunk or lq
    outs: List[Tensor] = []
    lses: List[Tensor] = []
    for qs in range(0, lq, q_chunk):
        qe = min(qs + q_chunk, lq)
        parts_o, parts_l = [], []
        for ks in range(0, lk, kv_chunk):
            ke = min(ks + kv_chunk, lk)
            if causal and ks > (qe - 1) + (lk - lq):
                break  # every later key block is in the future of every query of this chunk
            m = narrow_bcast(narrow_bcast(mask, -2, qs, qe), -1, ks, ke)
            if causal:
                cm = causal_mask(qe - qs, ke - ks, q.device, q_offset=qs + lk - lq, k_offset=ks)
                m = cm if m is None else m & cm
            seg = narrow_ids(segment_ids, qs, qe, ks, ke)
            with segments_checked():  # slices of ids checked above
                o, l = attention(q[..., qs:qe, :], k[..., ks:ke, :], v[..., ks:ke, :],
                                 narrow_bcast(narrow_bcast(bias, -2, qs, qe), -1, ks, ke), m, scale=scale,
                                 return_lse=True, backend=backend, segment_ids=seg, **options)
            parts_o.append(o)
            parts_l.append(l)
        if not parts_o:  # the whole query chunk sees no key
            o = q.new_zeros(q.shape[:-2] + (qe - qs, v.shape[-1]))
            l = torch.full(q.shape[:-2] + (qe - qs,), float("-inf"), device=q.device,
                           dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        else:
            o, l = merge_partials(parts_o, parts_l)
        outs.append(o)
        lses.append(l)
    out, lse = torch.cat(outs, -2), torch.cat(lses, -1)
    return (out, lse) if return_lse else out
