"""Third-party attention kernels behind the op's contract (imports stay inside the functions); flex has its
own module, :mod:`attn_ops.flex`.

Each adapter takes canonical inputs (bias/mask already have q.ndim dims) and returns ``(out, lse)``;
``lse`` is None for kernels that do not produce one.
"""
from __future__ import annotations

import inspect
import math
from typing import Tuple

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


def _cudnn_operand(t: Tensor) -> Tensor:
    """``t`` as cuDNN's descriptors take it: a dense last dim, no broadcast (stride-0) dim, a 16-byte-aligned start.
    Made so here rather than inside the frontend, whose fake (compile-time) outputs follow the input's strides.
    (The start's alignment is not read under torch.compile, where ``storage_offset`` breaks the graph.)"""
    misaligned = not torch.compiler.is_compiling() and (t.storage_offset() * t.element_size()) % 16
    if t.stride(-1) != 1 or 0 in t.stride() or misaligned:
        return t.clone(memory_format=torch.contiguous_format)  # (contiguous() may return t itself)
    return t


# cuDNN's frontend breaks a CUDA graph capture: its two ops are wrapped in ops of ours that carry the
# cudagraph_unsafe tag, so that torch.compile's CUDA graphs (reduce-overhead) run around them, not through them.
# (the tag and custom_op's tags argument: torch 2.8 and later)
_TAGS = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") and \
    "tags" in inspect.signature(torch.library.custom_op).parameters else {}


def _frontend_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                  bottom_right: bool) -> Tuple[Tensor, Tensor]:
    """(out, lse ``[N, H, Lq, 1]`` float32) of the frontend's ``cudnn::sdpa_fwd``."""
    return torch.ops.cudnn.sdpa_fwd(q, k, v, scale, is_causal=causal, causal_bottom_right=bottom_right,
                                    return_lse=True)


def _frontend_bwd(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                  causal: bool, bottom_right: bool, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the frontend's ``cudnn::sdpa_bwd``, cuDNN's deterministic algorithm when asked."""
    return torch.ops.cudnn.sdpa_bwd(d_out, q, k, v, out, lse, scale, is_causal=causal,
                                    causal_bottom_right=bottom_right, is_deterministic=deterministic)


# Each body serves as its own fake too: on fake tensors the frontend's ops give their fakes, whose strides are the
# real outputs'.
cudnn_sdpa_fwd = torch.library.custom_op("attn_zoo::cudnn_sdpa_fwd", _frontend_fwd, mutates_args=(), **_TAGS)
cudnn_sdpa_fwd.register_fake(_frontend_fwd)
cudnn_sdpa_bwd = torch.library.custom_op("attn_zoo::cudnn_sdpa_bwd", _frontend_bwd, mutates_args=(), **_TAGS)
cudnn_sdpa_bwd.register_fake(_frontend_bwd)


class _CudnnAttention(torch.autograd.Function):
    """cuDNN's fused attention through NVIDIA's cuDNN frontend (``torch.ops.cudnn.sdpa_fwd`` / ``sdpa_bwd``, the
    package ``nvidia-cudnn-frontend``), with the backward's ``deterministic`` choice passed per call: PyTorch's own
    SDPA reaches cuDNN with no such option (its backward is not reproducible), the frontend takes cuDNN's
    deterministic algorithm. q, k, v ``[N, H, L, D]`` (any strides with a dense last dim)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, deterministic):
        # our causal convention aligns the diagonal bottom-right (key j <= i + Lk - Lq): cuDNN's top-left when Lq == Lk
        bottom_right = causal and q.shape[-2] != k.shape[-2]
        out, lse = cudnn_sdpa_fwd(q, k, v, scale, causal, bottom_right)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.bottom_right, ctx.deterministic = scale, causal, bottom_right, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # (the frontend's backward op has no gradient of its own)
    def backward(ctx, d_out, _d_lse):  # lse carries no gradient here (the backend declares lse_grad=False)
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = cudnn_sdpa_bwd(d_out, q, k, v, out, lse, ctx.scale, ctx.causal, ctx.bottom_right,
                                    ctx.deterministic)
        return dq, dk, dv, None, None, None


def cudnn_attention(q, k, v, bias, mask, scale, causal, deterministic=True):
    """cuDNN's fused attention (no bias, no mask; causal), deterministic backward when asked: see
    :class:`_CudnnAttention`. Leading batch dims flatten into one (a view where their strides allow)."""
    if bias is not None or mask is not None:  # the registry declares neither; a direct call must not drop them
        raise ValueError("cudnn_attention takes neither bias nor mask (the registry routes those elsewhere)")
    if causal and q.shape[-2] > k.shape[-2]:
        raise ValueError(f"cudnn_attention: causal with Lq {q.shape[-2]} > Lk {k.shape[-2]} leaves queries without a "
                         "key, which it does not serve (the registry routes those elsewhere)")
    lead = q.shape[:-3]
    n = math.prod(lead) if lead else 1
    q4, k4, v4 = (_cudnn_operand(t.reshape((n,) + t.shape[-3:])) for t in (q, k, v))
    out, lse = _CudnnAttention.apply(q4, k4, v4, float(scale), bool(causal), bool(deterministic))
    return out.reshape(q.shape[:-1] + v.shape[-1:]), lse.reshape(q.shape[:-1])
