"""Input checks and canonical forms shared by every backend.

``check_inputs`` raises a ``TypeError``/``ValueError`` that names the argument and the shapes seen;
afterwards bias and mask have ``q.ndim`` dims (left-padded with size-1 dims, a view), so a backend can
rely on every dim being either 1 (broadcast) or the full size.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class AttnInputs:
    """What a backend is asked to do; the registry checks capabilities against it."""

    device: str
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    has_bias: bool
    has_mask: bool
    causal: bool
    needs_lse: bool
    needs_grad: bool
    bias_needs_grad: bool
    bias_is_broadcast: bool
    lse_needs_grad: bool
    deterministic: bool
    has_segments: bool = False
    # sizes, for backends whose limits depend on them (0: not known, e.g. a planner's question)
    problems: int = 0  # attention problems: the product of the batch dims and the heads
    lq: int = 0
    lk: int = 0


def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def _check_broadcast(name: str, t: Tensor, target: tuple) -> None:
    if t.ndim > len(target):
        raise ValueError(
            f"{name} has {t.ndim} dims {_shape(t)} but must broadcast to [*batch, H, Lq, Lk] = {target}"
        )
    bad = []
    for i in range(1, t.ndim + 1):
        if t.shape[-i] not in (1, target[-i]):
            bad.append(f"dim {t.ndim - i} (size {t.shape[-i]} vs {target[-i]})")
    if bad:
        raise ValueError(
            f"{name} of shape {_shape(t)} is not broadcastable to [*batch, H, Lq, Lk] = {target}: "
            + ", ".join(bad)
        )


def _pad_dims(t: Tensor, ndim: int) -> Tensor:
    return t if t.ndim == ndim else t.reshape((1,) * (ndim - t.ndim) + tuple(t.shape))


def check_inputs(q, k, v, bias, mask, scale):
    """Validate q, k, v, bias, mask; return (bias, mask, scale) in canonical form."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.ndim < 3:
            raise ValueError(f"{name} must have shape [*batch, H, L, D] (>= 3 dims), got {_shape(t)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"q, k, v must have the same number of dims, got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
        )
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            "q, k, v must share the leading [*batch, H] dims, got "
            f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)} (mismatched heads or batch)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: q {_shape(q)} vs k {_shape(k)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same key length Lk: k {_shape(k)} vs v {_shape(v)}")
    # (Lq = 0 or Lk = 0 are valid: attention() answers them before any backend, as SDPA does)
    for name, size in (("head dim D of q", q.shape[-1]), ("head dim of v", v.shape[-1])):
        if size == 0:
            raise ValueError(f"{name} is 0 (q {_shape(q)}, k {_shape(k)}, v {_shape(v)}): nothing to attend")
    target = tuple(q.shape[:-1]) + (k.shape[-2],)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError(f"bias must be a floating-point tensor, got {getattr(bias, 'dtype', type(bias))}")
        if bias.device != q.device:
            raise ValueError(f"bias is on {bias.device} but q is on {q.device}")
        _check_broadcast("bias", bias, target)
        bias = _pad_dims(bias, q.ndim)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(
                f"mask must be a bool tensor (True = attend), got {getattr(mask, 'dtype', type(mask))}"
            )
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
        _check_broadcast("mask", mask, target)
        mask = _pad_dims(mask, q.ndim)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    else:
        scale = float(scale)
        if not (scale > 0 and scale < float("inf")):
            raise ValueError(f"scale must be a positive finite number, got {scale}")
    return bias, mask, scale


_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def check_bias_values(bias: Optional[Tensor], mask: Optional[Tensor], causal: bool,
                      segment_ids: Optional["SegmentIds"], lq: int, lk: int, shown_ndim: Optional[int] = None) -> None:
    """Raise a ValueError naming ``bias`` if it holds +inf at an attended position, where that costs no device sync.

    +inf is not a valid bias: softmax over a row holding it is inf/inf, so out, lse and the gradients would be
    NaN (-inf is valid: that key is masked). Anything at a masked position (mask, causal, segment ids) is never
    read, as padding garbage. Checked for CPU tensors, one reduction over the bias (which every CPU backend reads
    in full anyway; the masks only when that finds a +inf), outside torch.compile and functorch transforms; not
    on accelerators, where the answer would cost a host sync per call: there a +inf gives NaN. ``bias`` and
    ``mask`` in canonical form (``check_inputs``); ``shown_ndim``: the caller's bias dims, for the message.
    """
    if bias is None or bias.device.type != "cpu" or bias.numel() == 0:
        return
    if torch.compiler.is_compiling() or _FUNCTORCH_ACTIVE():  # (a data-dependent bool would break either)
        return
    with torch.no_grad():
        if not bool(torch.isposinf(bias.amax())):
            return
        bad = torch.isposinf(bias)
        full = combine_masks(fold_segments(mask, segment_ids), causal, lq, lk, bias.device)
        if full is not None:
            # attended anywhere along the dims the bias is broadcast over (bounded by the mask's and the bias's sizes)
            full = _pad_dims(full, bias.ndim)
            dims = tuple(i for i in range(bias.ndim) if bias.shape[i] == 1 and full.shape[i] > 1)
            if dims:
                full = full.any(dim=dims, keepdim=True)
            bad = bad & full
        if not bool(bad.any()):
            return
        count = int(bad.sum())
        where = tuple(bad.nonzero()[0].tolist())
    drop = bias.ndim - (shown_ndim or bias.ndim)  # the leading size-1 dims check_inputs added
    where, shape = where[drop:], _shape(bias)[drop:]
    raise ValueError(
        f"bias of shape {shape} holds +inf at {count} attended entries (the first at index {where}): +inf is not a "
        "valid bias (softmax gives NaN); mask keys with mask=False or a -inf bias"
    )


def describe(q, k, v, bias, mask, causal, return_lse, deterministic, segment_ids=None) -> AttnInputs:
    grad_on = torch.is_grad_enabled()
    qkv_grad = grad_on and any(t.requires_grad for t in (q, k, v))
    bias_grad = grad_on and bias is not None and bias.requires_grad
    return AttnInputs(
        device=q.device.type,
        dtype=q.dtype,
        head_dim=q.shape[-1],
        head_dim_v=v.shape[-1],
        has_bias=bias is not None,
        has_mask=mask is not None,
        causal=causal,
        needs_lse=return_lse,
        needs_grad=qkv_grad or bias_grad,
        bias_needs_grad=bias_grad,
        bias_is_broadcast=bias is not None and any(
            b == 1 and t != 1 for b, t in zip(bias.shape[:-2], q.shape[:-2])
        ),
        lse_needs_grad=return_lse and (qkv_grad or bias_grad),
        deterministic=deterministic,
        has_segments=segment_ids is not None,
        problems=math.prod(q.shape[:-2]),
        lq=q.shape[-2],
        lk=k.shape[-2],
    )


def narrow_bcast(t: Optional[Tensor], dim: int, start: int, stop: int) -> Optional[Tensor]:
    """``t`` narrowed to [start, stop) along ``dim``, unless it is None or broadcast (size 1) there."""
    if t is None or t.shape[dim] == 1:
        return t
    return t.narrow(dim, start, stop - start)


def causal_mask(lq: int, lk: int, device, q_offset: int = 0, k_offset: int = 0) -> Tensor:
    """Bool [lq, lk]: query i (global index q_offset + i) sees key j when j <= i + (Lk_total - Lq_total).

    The caller folds the global (Lk - Lq) shift into ``q_offset``.
    """
    qi = torch.arange(lq, device=device)[:, None] + q_offset
    kj = torch.arange(lk, device=device)[None, :] + k_offset
    return kj <= qi


def combine_masks(mask: Optional[Tensor], causal: bool, lq: int, lk: int, device) -> Optional[Tensor]:
    """Fold ``causal`` (with its Lk - Lq offset) into a bool mask broadcastable to [..., Lq, Lk]."""
    if not causal:
        return mask
    cm = causal_mask(lq, lk, device, q_offset=lk - lq)
    return cm if mask is None else mask & cm


# ----------------------------------------------------------------------------------------------------
# Segment ids: packed variable-length rows
# ----------------------------------------------------------------------------------------------------
SegmentIds = Tuple[Tensor, Tensor]
_CHECKED: List[Tuple[weakref.ref, int]] = []  # id tensors whose contents passed the contiguity check
_TRUSTED = [False]


@contextlib.contextmanager
def segments_checked():
    """Inside this block the contiguity check of segment ids is skipped: for callers (ring attention,
    blockwise attention) that checked the whole row once and pass slices of it."""
    old = _TRUSTED[0]
    _TRUSTED[0] = True
    try:
        yield
    finally:
        _TRUSTED[0] = old


def _needs_sync_free() -> bool:
    """Under torch.compile or CUDA graph capture a data-dependent check would need a host sync: skipped there."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def segment_order_violation(ids: Tensor) -> Tensor:
    """Bool ``ids.shape[:-1]``: True where a row's non-negative ids decrease somewhere (a segment that returns
    after another one started), computed on ids' device."""
    valid = ids >= 0
    run_max = torch.cummax(torch.where(valid, ids, torch.full_like(ids, -1)), -1).values
    return (valid & (ids < run_max)).any(-1)


def _check_order(name: str, ids: Tensor) -> None:
    """Raise if ``ids`` is not contiguous per row; checked once per tensor object and version (one host sync in
    eager mode; skipped under torch.compile / CUDA graph capture and inside :func:`segments_checked`)."""
    if _TRUSTED[0] or _needs_sync_free() or type(ids) is not torch.Tensor or ids.numel() == 0:
        return
    inference = ids.is_inference()  # inference tensors have no version counter: checked on every call
    for ref, version in _CHECKED:
        if not inference and ref() is ids and version == ids._version:
            return
    bad = segment_order_violation(ids)
    top = ids.max()
    if bool(bad.any() | (top >= 2 ** 31 - 1)):
        if int(top) >= 2 ** 31 - 1:
            raise ValueError(f"{name} holds id {int(top)}: ids must be below 2**31 - 1")
        where = tuple(bad.nonzero()[0].tolist())
        row = ids[where] if where else ids
        shown = row.tolist() if row.numel() <= 32 else row.tolist()[:32] + ["..."]
        raise ValueError(
            f"{name} must be contiguous within each row (non-negative ids non-decreasing: a segment never "
            f"returns after another started); row {where} of {name} {_shape(ids)} is {shown}"
        )
    if not inference:
        _CHECKED.append((weakref.ref(ids), ids._version))
        del _CHECKED[:-8]


def _check_one_ids(name: str, t, q: Tensor, length: int, what: str) -> Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an integer tensor [*batch, L] or a pair of them, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32/int64 ids, negative = padding), got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    batch = tuple(q.shape[:-3])
    target = batch + (length,)
    if t.ndim < 1 or t.ndim > len(target):
        raise ValueError(
            f"{name} of shape {_shape(t)} must have 1 to {len(target)} dims broadcasting to [*batch, {what}] = "
            f"{target} (q {_shape(q)}; segment ids have no head dim)"
        )
    bad = [f"dim {t.ndim - i} (size {t.shape[-i]} vs {target[-i]})" for i in range(1, t.ndim + 1)
           if t.shape[-i] != target[-i] and not (i > 1 and t.shape[-i] == 1)]
    if bad:
        raise ValueError(
            f"{name} of shape {_shape(t)} is not broadcastable to [*batch, {what}] = {target}: " + ", ".join(bad)
        )
    _check_order(name, t)
    return t.reshape((1,) * (len(target) - t.ndim) + tuple(t.shape))


def check_segment_ids(segment_ids, q: Tensor, k: Tensor) -> Optional[SegmentIds]:
    """Validate ``segment_ids`` (a tensor ``[*batch, L]`` when Lq == Lk, or a pair ``(q_ids [*batch, Lq],
    k_ids [*batch, Lk])``) and return the pair with ``q.ndim - 2`` dims each (size 1 where broadcast)."""
    if segment_ids is None:
        return None
    lq, lk = q.shape[-2], k.shape[-2]
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"segment_ids as a pair needs (q_ids, k_ids), got {len(segment_ids)} items")
        qi = _check_one_ids("segment_ids[0] (query ids)", segment_ids[0], q, lq, "Lq")
        ki = _check_one_ids("segment_ids[1] (key ids)", segment_ids[1], q, lk, "Lk")
        return qi, ki
    if isinstance(segment_ids, torch.Tensor) and lq != lk:
        raise ValueError(
            f"segment_ids as one tensor needs Lq == Lk, got q {_shape(q)} and k {_shape(k)}: "
            "pass a pair (q_ids [*batch, Lq], k_ids [*batch, Lk])"
        )
    ids = _check_one_ids("segment_ids", segment_ids, q, lq, "L")
    return ids, ids


def segment_mask(segment_ids: Optional[SegmentIds], q_lo: int = 0, q_hi: Optional[int] = None, k_lo: int = 0,
                 k_hi: Optional[int] = None) -> Optional[Tensor]:
    """Bool ``[*batch, 1, Lq, Lk]`` (rows [q_lo, q_hi), keys [k_lo, k_hi)): True where the query's and the
    key's ids are equal and non-negative. None without segment ids."""
    if segment_ids is None:
        return None
    qi, ki = segment_ids
    qi, ki = qi[..., q_lo:q_hi], ki[..., k_lo:k_hi]
    m = (qi[..., :, None] == ki[..., None, :]) & (qi >= 0)[..., :, None]  # [*batch, Lq, Lk]
    return m.unsqueeze(-3)


def fold_segments(mask: Optional[Tensor], segment_ids: Optional[SegmentIds]) -> Optional[Tensor]:
    """``mask`` and the segment mask (materialised [*batch, 1, Lq, Lk]): for the backends that take a mask."""
    seg = segment_mask(segment_ids)
    if seg is None:
        return mask
    return seg if mask is None else mask & seg


def narrow_ids(segment_ids: Optional[SegmentIds], q_lo: int, q_hi: int, k_lo: int, k_hi: int
               ) -> Optional[SegmentIds]:
    """The pair sliced to query rows [q_lo, q_hi) and keys [k_lo, k_hi)."""
    if segment_ids is None:
        return None
    return segment_ids[0][..., q_lo:q_hi], segment_ids[1][..., k_lo:k_hi]
