"""``attention``: the one public entry point; validates, picks a backend through the registry, calls it."""
from __future__ import annotations

from typing import Optional

import torch

from . import registry
from .inputs import check_bias_values, check_inputs, check_segment_ids, describe

Tensor = torch.Tensor


class _Empty(torch.autograd.Function):
    """Attention with Lq = 0 or Lk = 0 (or no batch element or head): out zeros ``[*batch, H, Lq, Dv]`` (empty when
    Lq = 0; every row has no key when Lk = 0), lse -inf ``[*batch, H, Lq]``; gradients zeros shaped as q, k, v and
    the bias."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor]):
        ctx.shapes = [None if t is None else (t.shape, t.dtype, t.device) for t in (q, k, v, bias)]
        out = q.new_zeros(q.shape[:-1] + v.shape[-1:])  # [*batch, H, Lq, Dv]
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype, device=q.device)  # [*batch, H, Lq]
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        return tuple(None if sh is None or not need else torch.zeros(sh[0], dtype=sh[1], device=sh[2])
                     for sh, need in zip(ctx.shapes, ctx.needs_input_grad))


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = True,
    segment_ids=None,
    **options,
):
    """Scaled dot-product attention with a trainable, broadcastable bias and a differentiable lse.

    Args:
        q: ``[*batch, H, Lq, D]``. k: ``[*batch, H, Lk, D]``. v: ``[*batch, H, Lk, Dv]``. Same dtype and device;
            any number of leading batch dims (Evoformer: ``[B, R, H, L, D]``).
        bias: float tensor (any float dtype) broadcastable to ``[*batch, H, Lq, Lk]``, added to the scaled
            logits. Its gradient has the bias's own shape (summed over broadcast dims); no expanded copy is made
            by the fused backends.
        mask: bool tensor broadcastable to ``[*batch, H, Lq, Lk]``; True = attend.
        scale: logit scale, default ``D ** -0.5``.
        causal: query i attends key j iff ``j <= i + (Lk - Lq)``.
        return_lse: also return lse.
        backend: ``"auto"`` or a name from :func:`attn_ops.backends`; see :mod:`attn_ops.registry`.
        deterministic: require a bitwise-reproducible backward (the default).
        segment_ids: packed variable-length rows. An integer tensor ``[*batch, L]`` (Lq == Lk; broadcastable
            over the leading batch dims like the mask, no head dim) or a pair ``(q_ids [*batch, Lq], k_ids
            [*batch, Lk])``. A query attends a key only when their ids are equal (and, with ``causal``, the key
            is not later: within a packed row, earlier keys of its own sequence). Negative ids mark padding:
            such queries give out 0, lse -inf and zero gradients, such keys are never attended. Within a row
            the non-negative ids must be non-decreasing (a segment never returns after another started); this
            is checked in eager mode (one host sync per new ids tensor) and not under torch.compile or CUDA
            graph capture. Composes with bias, mask and causal; the triton kernels skip tiles whose id ranges
            cannot meet, so a packed row costs what its sequences cost alone. Pass one ids tensor to every layer:
            triton builds its per-position tables once per ids tensor (rebuilt if it changes in place).
        **options: backend options (``chunk_size`` for ``chunked``, ``bwd`` for ``triton``).

    Returns:
        out ``[*batch, H, Lq, Dv]`` in q's dtype; with ``return_lse``, also lse ``[*batch, H, Lq]`` float32
        (float64 for float64 inputs): the natural log of the softmax denominator of the scaled, biased,
        masked logits. lse is differentiable (d lse / d logits = softmax). A query row with no key to attend
        gives out 0, lse -inf and zero gradients. Lq = 0 gives empty out and lse; Lk = 0 makes every row such a row
        (out 0, lse -inf), as SDPA; the gradients are zeros shaped as q, k, v and the bias, for every backend.

    Bias values: -inf masks a key; +inf at an attended position is invalid (softmax would be inf/inf: NaN out,
    lse and gradients); at a masked position any value is ignored (padding garbage). A ValueError naming ``bias``
    reports such a +inf on the CPU (one reduction over the bias, no device sync); on an accelerator it is not
    checked (a check would cost a host sync per call) and gives NaN. Nor under torch.compile.
    """
    bias_ndim = getattr(bias, "ndim", None)
    bias, mask, scale = check_inputs(q, k, v, bias, mask, scale)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    segment_ids = check_segment_ids(segment_ids, q, k)
    check_bias_values(bias, mask, causal, segment_ids, q.shape[-2], k.shape[-2], bias_ndim)
    inputs = describe(q, k, v, bias, mask, causal, return_lse, deterministic, segment_ids)
    chosen = registry.select(backend, inputs)
    unknown = set(options) - chosen.options
    if unknown:
        raise TypeError(
            f"backend {chosen.name!r} got unknown option(s) {sorted(unknown)}; "
            f"it accepts {sorted(chosen.options) or 'none'}"
        )
    if q.numel() == 0 or k.numel() == 0:  # one answer for every backend, before any kernel sees a 0 size
        out, lse = _Empty.apply(q, k, v, bias)
        return (out, lse) if return_lse else out
    if segment_ids is not None:  # backends that declare segment_ids take them as a keyword
        options["segment_ids"] = segment_ids
    out, lse = chosen.load()(q, k, v, bias, mask, scale, causal, deterministic, **options)
    return (out, lse) if return_lse else out
