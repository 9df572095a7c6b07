"""``triton_attention``: the ``triton`` backend's entry point; brings any leading batch dims to the kernels'
canonical ``[B, R, H, L, D]`` and calls the custom op.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import op as _op  # registers attn_zoo::triton_attn_fwd / _bwd

Tensor = torch.Tensor
BWD_VARIANTS = ("auto", "split", "fused")


def _dense(t: Tensor) -> Tensor:
    """``t`` itself if its last dim is contiguous and it is non-overlapping and dense, else a contiguous copy.

    Gradients are allocated with the input's strides, which is only safe for such layouts.
    """
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != expected:
            return t.contiguous()
        expected *= size
    return t


def _merge_plan(q: Tensor, bias: Optional[Tensor], mask: Optional[Tensor]) -> List[List[int]]:
    """Groups of adjacent leading dims (size-1 dims of q dropped) that share bias/mask broadcast patterns."""
    groups: List[List[int]] = []
    last = None
    for d in range(q.ndim - 3):
        if q.shape[d] == 1:
            continue
        pattern = (bias is not None and bias.shape[d] != 1, mask is not None and mask.shape[d] != 1)
        if groups and pattern == last:
            groups[-1].append(d)
        else:
            groups.append([d])
        last = pattern
    return groups


def _merge(t: Optional[Tensor], groups: List[List[int]], tail: int) -> Optional[Tensor]:
    """Reshape ``t``'s leading dims to one dim per group (product of sizes; 1 where t broadcasts)."""
    if t is None:
        return None
    sizes = []
    for g in groups:
        n = 1
        for d in g:
            n *= t.shape[d]
        sizes.append(n)
    return t.reshape(tuple(sizes) + tuple(t.shape[-tail:]))


def _pick_fused(bwd: str, deterministic: bool) -> bool:
    if bwd == "fused":
        return True
    if bwd == "split":
        return False
    return not deterministic  # "auto": split (deterministic) unless atomics are allowed


def _canonical_call(q, k, v, bias, mask, scale, causal, fused) -> Tuple[Tensor, Tensor]:
    """q, k, v with exactly two leading dims -> (out, lse) via the custom op."""
    q, k, v = _dense(q), _dense(k), _dense(v)
    return torch.ops.attn_zoo.triton_attn_fwd(q, k, v, bias, mask, float(scale), bool(causal), fused)


def _attend(q, k, v, bias, mask, scale, causal, fused) -> Tuple[Tensor, Tensor]:
    n = q.ndim - 3
    lead = q.shape[:n]
    if n <= 2:
        pad = (1,) * (2 - n)
        # [B, R, H, L, D] with unit dims prepended (views)
        q5, k5, v5 = (t.reshape(pad + t.shape) for t in (q, k, v))
        b5 = None if bias is None else bias.reshape(pad + bias.shape)
        m5 = None if mask is None else mask.reshape(pad + mask.shape)
        out, lse = _canonical_call(q5, k5, v5, b5, m5, scale, causal, fused)
        return out.reshape(lead + out.shape[2:]), lse.reshape(lead + lse.shape[2:])
    groups = _merge_plan(q, bias, mask)
    if len(groups) <= 2:
        # [G1, G2, H, L, D]: each group of leading dims merged into one
        qm, km, vm = (_merge(t, groups, 3) for t in (q, k, v))
        bm, mm = _merge(bias, groups, 3), _merge(mask, groups, 3)
        out, lse = _attend(qm, km, vm, bm, mm, scale, causal, fused)
        return out.reshape(lead + out.shape[-3:]), lse.reshape(lead + lse.shape[-2:])
    # More than two broadcast patterns: loop over dim 0 (autograd sums a shared bias's gradient).
    outs, lses = [], []
    for i in range(q.shape[0]):
        bi = None if bias is None else bias[i if bias.shape[0] > 1 else 0]
        mi = None if mask is None else mask[i if mask.shape[0] > 1 else 0]
        o, s = _attend(q[i], k[i], v[i], bi, mi, scale, causal, fused)
        outs.append(o)
        lses.append(s)
    return torch.stack(outs), torch.stack(lses)


def triton_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                     scale: float, causal: bool, deterministic: bool = True, bwd: str = "auto"
                     ) -> Tuple[Tensor, Tensor]:
    """Fused attention with a broadcastable trainable bias and a differentiable lse (Triton kernels).

    Args (already validated by ``attn_ops.attention``):
        q ``[*batch, H, Lq, D]``, k ``[*batch, H, Lk, D]``, v ``[*batch, H, Lk, Dv]``: fp16/bf16/fp32, one device,
            16 <= D, Dv <= 256. fp32 dots use TF32 on GPUs.
        bias: None or float (any float dtype) with q.ndim dims, each 1 (broadcast, read with stride 0) or full;
            its gradient comes back in its own shape and dtype, summed over broadcast dims.
        mask: None or bool with the same rule; True = attend.
        scale: logit scale. causal: query i sees key j iff ``j <= i + (Lk - Lq)``.
        deterministic: True (default) gives bitwise-identical gradients on repeated calls (no atomics).
        bwd: ``"split"`` (dK/dV and dQ kernels), ``"fused"`` (one pass, dQ by fp32 atomics; needs
            ``deterministic=False``) or ``"auto"`` (split when deterministic, else fused).

    Returns:
        out ``[*batch, H, Lq, Dv]`` in q's dtype; lse ``[*batch, H, Lq]`` float32, the natural log of the softmax
        denominator of ``q k^T * scale + bias`` over attended keys. A row with no key gives out 0, lse -inf and
        zero, finite gradients.
    """
    if bwd not in BWD_VARIANTS:
        raise ValueError(f"bwd must be one of {BWD_VARIANTS}, got {bwd!r}")
    if bwd == "fused" and deterministic:
        raise ValueError(
            "bwd='fused' accumulates dq with atomics and is not bitwise deterministic; "
            "pass deterministic=False to use it, or bwd='split'"
        )
    return _attend(q, k, v, bias, mask, scale, causal, _pick_fused(bwd, deterministic))
