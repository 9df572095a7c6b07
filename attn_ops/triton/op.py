"""The ``triton`` backend's entry points (:func:`triton_attention`, :func:`triton_lse_backward`: any leading batch
dims brought to the kernels' canonical ``[B, R, H, L, D]``), the ``torch.library`` custom ops around the kernel
launches (fake impls for torch.compile) and their autograd.

``attn_zoo::triton_attn_fwd`` and ``attn_zoo::triton_attn_bwd`` take canonical 5-D tensors ``[B, R, H, L, D]``;
bias and mask keep their own shapes ``[B|1, R|1, H|1, Lq|1, Lk|1]``.

:func:`attend` is the entry point: under ``torch.compile`` it calls the custom op (traceable, no graph break);
in eager mode a plain ``autograd.Function`` around the same two bodies (``attn_forward``/``_backward_impl``),
which skips the custom op's dispatch (its autograd wrapper, redispatch, aliasing checks): host time a small shape
is bound by (docs/bench/history.md). Both paths run the same launches, so they give the same bits.
"""
from __future__ import annotations

import functools
import operator
import weakref
from typing import List, Optional, Tuple

import torch

from .launch import STATE, empty_in_order
from .passes import attn_backward, attn_forward, segment_tables_flat, split_tables
from .tuning import compiling_ahead as _compiling_ahead

Tensor = torch.Tensor


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                    scale: float, causal: bool, fused_bwd: bool, atomic_dbias: bool, q_seg: Optional[Tensor] = None,
                    k_seg: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """out ``[B, R, H, Lq, Dv]`` (q.dtype, in q's dim order) and lse ``[B, R, H, Lq]`` (fp32, natural log, -inf on
    empty rows).

    ``fused_bwd`` and ``atomic_dbias`` only select the backward's variant (one pass with dQ by atomics vs split
    kernels; a broadcast bias's gradient by atomics vs the deterministic reduction kernel). ``q_seg``/``k_seg``:
    segment id tables ``[B|1, R|1, 3, L]`` int32 (``op.segment_tables``) or None.
    """
    return attn_forward(q, k, v, bias, mask, scale, causal, q_seg, k_seg)


# the custom op and the eager Function (below) run this one body
triton_attn_fwd = torch.library.custom_op("attn_zoo::triton_attn_fwd", _forward_impl, mutates_args=())


@triton_attn_fwd.register_fake
def _(q, k, v, bias, mask, scale, causal, fused_bwd, atomic_dbias, q_seg=None, k_seg=None):
    return empty_in_order(q, q.shape[:-1] + v.shape[-1:], q.dtype), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("attn_zoo::triton_attn_bwd", mutates_args=())
def triton_attn_bwd(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    lse: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float, causal: bool,
                    fused: bool, need_dbias: bool, atomic_dbias: bool, q_seg: Optional[Tensor] = None,
                    k_seg: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (q, k, v's shapes and strides) and dbias (bias's own shape and dtype; empty when not needed)."""
    dq, dk, dv, dbias = _backward_impl(dout, dlse, q, k, v, out, lse, bias, mask, scale, causal, fused, need_dbias,
                                       atomic_dbias, q_seg, k_seg)
    return dq, dk, dv, (q.new_empty((0,)) if dbias is None else dbias)


def _backward_impl(dout, dlse, q, k, v, out, lse, bias, mask, scale, causal, fused, need_dbias, atomic_dbias,
                   q_seg=None, k_seg=None):
    """The backward launches; dbias None when not needed."""
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dlse = None if dlse is None else dlse.contiguous()  # indexed as [B, R, H, Lq]; autograd may hand an expanded view
    return attn_backward(dout, dlse, q, k, v, out, lse, bias, mask, scale, causal, fused,
                         need_dbias and bias is not None, atomic_dbias, q_seg, k_seg)


@triton_attn_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, bias, mask, scale, causal, fused, need_dbias, atomic_dbias, q_seg=None,
      k_seg=None):
    dbias = bias.new_empty(bias.shape) if (need_dbias and bias is not None) else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


@torch.library.custom_op("attn_zoo::triton_segment_tables", mutates_args=())
def triton_segment_tables(q_ids: Tensor, k_ids: Tensor, shared: bool) -> Tensor:
    """The query and key segment tables in one int32 tensor ``[B', R', 3 * (Lq + Lk)]`` (``3 * Lq`` when
    ``shared``), see ``passes.segment_tables_flat``."""
    return segment_tables_flat(q_ids, k_ids, shared)


@triton_segment_tables.register_fake
def _(q_ids, k_ids, shared):
    batch = torch.broadcast_shapes(q_ids.shape[:-1], k_ids.shape[:-1])
    width = 3 * q_ids.shape[-1] if shared else 3 * (q_ids.shape[-1] + k_ids.shape[-1])
    return q_ids.new_empty(tuple(batch) + (width,), dtype=torch.int32)


def segment_tables(q_ids: Tensor, k_ids: Tensor) -> Tuple[Tensor, Tensor]:
    """The kernels' (query, key) segment tables of canonical ids ``[B|1, R|1, L]``, one table when ``k_ids is
    q_ids``: the custom op under torch.compile (see :func:`_through_custom_op`), else its body.

    Eager calls reuse the tables of the same ids (the same tensor, or the same view of it, on the same memory and
    unchanged since by PyTorch ops: its version counter): a model passes one ids tensor to every layer, so the
    tables are built once per batch, as a flex BlockMask is, instead of once per attention call. Writes that bypass
    the version counter (``ids.data[...] = ``, through numpy or DLPack) are not seen: call
    :func:`clear_segment_tables` after them. Entries of freed ids are dropped at the next insert."""
    shared = k_ids is q_ids
    Lq, Lk = q_ids.shape[-1], k_ids.shape[-1]
    if _through_custom_op(q_ids):
        return split_tables(torch.ops.attn_zoo.triton_segment_tables(q_ids, k_ids, shared), Lq, Lk, shared)
    key = None if _compiling_ahead() else _tables_key(q_ids, k_ids, shared)  # (ahead: the tables are garbage)
    tables = STATE.tables
    if key is not None:
        for entry_key, refs, flat in tables:
            if entry_key == key and refs[0]() is _root(q_ids) and refs[1]() is _root(k_ids):
                return split_tables(flat, Lq, Lk, shared)
    flat = segment_tables_flat(q_ids, k_ids, shared)
    if key is not None:
        with STATE.lock:
            tables[:] = [e for e in tables if e[1][0]() is not None and e[1][1]() is not None][:_TABLES_MAX - 1]
            tables.insert(0, (key, (weakref.ref(_root(q_ids)), weakref.ref(_root(k_ids))), flat))
    return split_tables(flat, Lq, Lk, shared)


_TABLES_MAX = 4  # ids tensors whose tables are kept (``STATE.tables``)


def clear_segment_tables() -> None:
    """Forget every cached segment table (after writing ids in a way PyTorch's version counter does not see)."""
    with STATE.lock:
        STATE.tables.clear()


def _root(t: Tensor) -> Tensor:
    return t if t._base is None else t._base


def _tables_key(q_ids: Tensor, k_ids: Tensor, shared: bool):
    """What identifies the tables of these ids: each side's base tensor, its version and the view's geometry;
    None where nothing may be cached (inference tensors have no version counter; tables made during CUDA graph
    capture live in the graph's memory pool)."""
    if q_ids.is_inference() or k_ids.is_inference() or (q_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    side = lambda t: (id(_root(t)), t._version, t.untyped_storage().data_ptr(), t.shape, t.stride(),  # noqa
                      t.storage_offset(), t.dtype, t.device)
    return (shared, side(q_ids), side(k_ids))


def _setup_context(ctx, inputs, output):
    q, k, v, bias, mask, scale, causal, fused_bwd, atomic_dbias = inputs[:9]
    q_seg, k_seg = (tuple(inputs[9:]) + (None, None))[:2]
    ctx.save_for_backward(q, k, v, bias, mask, *output, q_seg, k_seg)  # output: (out, lse)
    ctx.scale, ctx.causal, ctx.fused, ctx.atomic_dbias = scale, causal, fused_bwd, atomic_dbias
    ctx.set_materialize_grads(False)  # an unused lse sends None, not a zeros buffer


def _grads(ctx, dout, dlse, run_backward):
    """The autograd backward of both paths; ``run_backward`` is the custom op (compiled) or its body (eager)."""
    q, k, v, bias, mask, out, lse, q_seg, k_seg = ctx.saved_tensors
    need_dbias = bias is not None and ctx.needs_input_grad[3]
    dout = torch.zeros_like(out) if dout is None else dout  # None: only lse was used
    dq, dk, dv, dbias = run_backward(dout, dlse, q, k, v, out, lse, bias, mask, ctx.scale, ctx.causal, ctx.fused,
                                     need_dbias, ctx.atomic_dbias, q_seg, k_seg)
    return (dq, dk, dv, (dbias if need_dbias else None)) + (None,) * (len(ctx.needs_input_grad) - 4)


def _backward(ctx, dout, dlse):
    return _grads(ctx, dout, dlse, torch.ops.attn_zoo.triton_attn_bwd)


torch.library.register_autograd("attn_zoo::triton_attn_fwd", _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager path: the custom op's forward, setup and backward without its dispatch."""

    forward = staticmethod(_forward_impl)
    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, dout, dlse):
        return _grads(ctx, dout, dlse, _backward_impl)


_C_APPLY = super(torch.autograd.Function, _EagerAttention).apply
_unwrap_dead = torch._functorch.utils.unwrap_dead_wrappers


def _through_custom_op(q: Tensor) -> bool:
    """Under ``torch.compile``, and for tensor subclasses (fake tensors of ``torch.export`` / ``make_fx`` tracing,
    functional wrappers), which need the custom op's fake impl; plain eager tensors skip its dispatch."""
    return torch.compiler.is_compiling() or type(q) is not torch.Tensor


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float,
           causal: bool, fused_bwd: bool, atomic_dbias: bool, q_seg: Optional[Tensor] = None,
           k_seg: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse) of canonical 5-D inputs: the custom op (see :func:`_through_custom_op`) or the eager Function."""
    if _through_custom_op(q):
        seg = () if q_seg is None else (q_seg, k_seg)  # without ids, the calls are exactly the ones before them
        return torch.ops.attn_zoo.triton_attn_fwd(q, k, v, bias, mask, scale, causal, fused_bwd, atomic_dbias, *seg)
    args = (q, k, v, bias, mask, scale, causal, fused_bwd, atomic_dbias, q_seg, k_seg)
    if torch._C._are_functorch_transforms_active():
        return _EagerAttention.apply(*args)
    # Function.apply binds the arguments to forward's signature (inspect.signature, slow per call) before this
    # same C-level apply; every argument is given positionally here, so there is nothing to bind
    return _C_APPLY(*_unwrap_dead(args))


def backward(dout, dlse, q, k, v, out, lse, bias, mask, scale, causal, fused, need_dbias, atomic_dbias, q_seg=None,
             k_seg=None):
    """dq, dk, dv, dbias (None when not needed) from a saved (out, lse): the custom op (see
    :func:`_through_custom_op`) or its body."""
    seg = () if q_seg is None else (q_seg, k_seg)
    if _through_custom_op(q):
        dq, dk, dv, dbias = torch.ops.attn_zoo.triton_attn_bwd(
            dout, dlse, q, k, v, out, lse, bias, mask, scale, causal, fused, need_dbias, atomic_dbias, *seg)
        return dq, dk, dv, (dbias if need_dbias and bias is not None else None)
    return _backward_impl(dout, dlse, q, k, v, out, lse, bias, mask, scale, causal, fused, need_dbias, atomic_dbias,
                          q_seg, k_seg)


# ---------------------------------------------------------------------------------------------------------------
# The backend's entry points: any leading batch dims brought to the canonical [B, R, H, L, D] and the op called.

BWD_VARIANTS = ("auto", "split", "fused")


def _dense(t: Tensor) -> Tensor:
    """``t`` itself if its last dim is contiguous and it is non-overlapping and dense, else a dense copy.

    Gradients are allocated with the input's strides, which is only safe for such layouts. The copy keeps
    ``t``'s dim order (``empty_like`` keeps it): a head-split view of a fused projection ``[*, L, H*C]`` seen as
    ``[*, H, L, C]`` becomes dense ``[*, L, H, C]`` memory by a coalesced gather, not a transposing copy, and the
    gradients the op returns in that order flow back into the projection without a transpose either.
    """
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    if t.is_contiguous() or _non_overlapping_and_dense(t):
        return t
    copy = torch.empty_like(t)  # t's dim order (clone's rule), decided before any data is copied
    # an overlapping input (e.g. unfold windows, another dim of stride 1) may get its last dim ordered outwards by
    # that rule; the kernels need it contiguous
    return copy.copy_(t) if copy.stride(-1) == 1 else t.contiguous()


def _non_overlapping_and_dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory exactly once, in some dim order.

    Written as a search for the dim with the next expected stride rather than a sort of the strides: Dynamo cannot
    sort symbolic strides, and with dynamic shapes (variable sequence lengths) this runs on symbolic ones.
    """
    dims = [(st, n) for n, st in zip(t.shape, t.stride()) if n != 1]  # two C calls, not two per dim (host time)
    expected = 1
    while dims:
        nxt = next((i for i, (st, _) in enumerate(dims) if st == expected), None)
        if nxt is None:
            return False
        expected *= dims.pop(nxt)[1]
    return True


def _merge_plan(q: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], seg=None) -> List[List[int]]:
    """Groups of adjacent leading dims (size-1 dims of q dropped) that share bias/mask/segment-id broadcast
    patterns."""
    groups: List[List[int]] = []
    last = None  # the broadcast pattern of the last group
    for d in range(q.ndim - 3):
        if q.shape[d] == 1:
            continue
        pattern = tuple(t is not None and t.shape[d] != 1 for t in (bias, mask, *(seg or (None, None))))
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
    return t.reshape(tuple(functools.reduce(operator.mul, [t.shape[d] for d in g]) for g in groups) +
                     tuple(t.shape[-tail:]))


def _check_bwd(bwd: str, deterministic: bool) -> Tuple[bool, bool]:
    """Validate the ``bwd`` option: (fused, atomic_dbias). "auto" is split, which was faster on every shape
    measured on an H100; ``deterministic=False`` also lets a broadcast bias's gradient be summed by atomics."""
    if bwd not in BWD_VARIANTS:
        raise ValueError(f"bwd must be one of {BWD_VARIANTS}, got {bwd!r}")
    if bwd == "fused" and deterministic:
        raise ValueError("bwd='fused' accumulates dq with atomics and is not bitwise deterministic; "
                         "pass deterministic=False to use it, or bwd='split'")
    return bwd == "fused", not deterministic


def _lpad(t: Optional[Tensor], ndim: int) -> Optional[Tensor]:
    """``t`` with unit dims prepended up to ``ndim`` dims (a view; ``t`` itself if it has them); None stays None."""
    return t if t is None or t.ndim >= ndim else t.reshape((1,) * (ndim - t.ndim) + tuple(t.shape))


def _row(t: Optional[Tensor], i: int) -> Optional[Tensor]:
    """Index ``i`` of ``t``'s dim 0, or its only index where that dim broadcasts; None stays None."""
    return None if t is None else t[i if t.shape[0] > 1 else 0]


def _seg_tables(seg):
    """Segment ids ``(q_ids, k_ids)`` (unit dims prepended up to ``[B|1, R|1, L]``) -> the kernels' tables, one
    shared table when both sides are the same tensor."""
    if seg is None:
        return ()
    q_ids = _lpad(seg[0], 3)
    return segment_tables(q_ids, q_ids if seg[1] is seg[0] else _lpad(seg[1], 3))


def _canonical_call(q, k, v, bias, mask, scale, causal, mode, tables=()) -> Tuple[Tensor, Tensor]:
    """q, k, v with exactly two leading dims -> (out, lse) via the custom op; ``mode`` = (fused, atomic_dbias)."""
    return attend(_dense(q), _dense(k), _dense(v), bias, mask, float(scale), bool(causal), *mode, *tables)


def _seg_index(seg, i):
    return None if seg is None else tuple(_row(t, i) for t in seg)


def _attend(q, k, v, bias, mask, scale, causal, mode, seg=None) -> Tuple[Tensor, Tensor]:
    n = q.ndim - 3
    if n == 2:  # canonical already (bias and mask have q's ndim): no views to make
        return _canonical_call(q, k, v, bias, mask, scale, causal, mode, _seg_tables(seg))
    lead = q.shape[:n]
    if n < 2:  # [B, R, H, L, D] with unit dims prepended (views)
        q5, k5, v5, b5, m5 = (_lpad(t, 5) for t in (q, k, v, bias, mask))
        out, lse = _canonical_call(q5, k5, v5, b5, m5, scale, causal, mode, _seg_tables(seg))
        return out.reshape(lead + out.shape[2:]), lse.reshape(lead + lse.shape[2:])
    groups = _merge_plan(q, bias, mask, seg)
    if len(groups) <= 2:
        # [G1, G2, H, L, D]: each group of leading dims merged into one
        qm, km, vm, bm, mm = (_merge(t, groups, 3) for t in (q, k, v, bias, mask))
        sm = None if seg is None else (_merge(seg[0], groups, 1), _merge(seg[1], groups, 1))
        if seg is not None and seg[1] is seg[0]:
            sm = (sm[0], sm[0])
        out, lse = _attend(qm, km, vm, bm, mm, scale, causal, mode, sm)
        return out.reshape(lead + out.shape[-3:]), lse.reshape(lead + lse.shape[-2:])
    # More than two broadcast patterns: loop over dim 0 (autograd sums a shared bias's gradient).
    parts = [_attend(q[i], k[i], v[i], _row(bias, i), _row(mask, i), scale, causal, mode, _seg_index(seg, i))
             for i in range(q.shape[0])]
    return torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts])


def _canonical_ids(segment_ids, q: Tensor):
    """``(q_ids, k_ids)`` with ``q.ndim - 2`` dims (left-padded; the API does this already), or None."""
    if segment_ids is None:
        return None
    qi, ki = (_lpad(t, q.ndim - 2) for t in segment_ids)
    return (qi, qi) if segment_ids[1] is segment_ids[0] else (qi, ki)


def triton_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float,
                     causal: bool, deterministic: bool = True, bwd: str = "auto",
                     segment_ids=None) -> Tuple[Tensor, Tensor]:
    """Fused attention with a broadcastable trainable bias and a differentiable lse (Triton kernels).

    Args (already validated by ``attn_ops.attention``):
        q ``[*batch, H, Lq, D]``, k ``[*batch, H, Lk, D]``, v ``[*batch, H, Lk, Dv]``: fp16/bf16/fp32, one device,
            8 <= D, Dv <= 256, any value (the kernels pad to blocks of a power of two >= 16, tl.dot's minimum).
            fp32 inputs use full fp32 products (no TF32).
        bias: None or float (any float dtype) broadcastable to ``[*batch, H, Lq, Lk]``: every dim 1 (broadcast, read
            with stride 0) or full; fewer dims than q are left-padded with 1s;
            its gradient comes back in its own shape and dtype, summed over broadcast dims.
        mask: None or bool with the same rule; True = attend. Under a key mask (size 1 along Lq) whatever the
            bias or k hold at a masked key (NaN or inf padding included) reaches neither the output, lse nor any
            gradient: their logits are set to -inf by a select and their K rows, where a gradient multiplies them,
            are read as zeros. A mask that varies along Lq is applied by a select, which keeps garbage out of the
            output, lse, dk, dv and dbias, but dq still computes 0 * k at masked keys (NaN for a non-finite k), as
            the reference's masked_fill does.
            A NaN in v at a masked key propagates (0 * NaN), as in PyTorch.
        scale: logit scale. causal: query i sees key j iff ``j <= i + (Lk - Lq)``.
        deterministic: True (default) gives bitwise-identical gradients on repeated calls (no atomics); the
            tile configs are tuned once per length bucket (and cached on disk), so for the same bits across
            processes set ``attn_ops.settings.update(tune=False)`` (the first candidate config everywhere). False
            sums the gradient of a bias broadcast over batch dims with fp32 atomics in the backward's passes (one
            pass fewer: the dQ kernel's vector atomics, or TMA bulk reductions in dK/dV on large steps) and allows
            ``bwd="fused"``.
        bwd: ``"split"`` (dK/dV and dQ kernels), ``"fused"`` (one pass, dQ by fp32 atomics; needs
            ``deterministic=False``) or ``"auto"`` (split: faster on every shape measured on an H100).
        segment_ids: None or ``(q_ids, k_ids)``, int ``[*batch, Lq]`` / ``[*batch, Lk]`` (size 1 on broadcast batch
            dims; contiguous segments, negative = padding: see ``attn_ops.attention``). Every kernel visits only the
            tiles whose id ranges meet and masks unequal ids inside a tile.

    Returns:
        out ``[*batch, H, Lq, Dv]`` in q's dtype; lse ``[*batch, H, Lq]`` float32, the natural log of the softmax
        denominator of ``q k^T * scale + bias`` over attended keys. A row with no key gives out 0, lse -inf and
        zero, finite gradients.
    """
    mode = _check_bwd(bwd, deterministic)
    if bias is not None and bias.ndim < q.ndim:  # the API pads already; direct callers may not
        bias = bias.reshape((1,) * (q.ndim - bias.ndim) + tuple(bias.shape))
    if mask is not None and mask.ndim < q.ndim:
        mask = mask.reshape((1,) * (q.ndim - mask.ndim) + tuple(mask.shape))
    return _attend(q, k, v, bias, mask, scale, causal, mode, _canonical_ids(segment_ids, q))


def triton_lse_backward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float,
                        causal: bool, out: Tensor, lse: Tensor, d_out: Optional[Tensor], d_lse: Optional[Tensor],
                        need_dbias: bool, bwd: str = "auto", deterministic: bool = True, segment_ids=None):
    """Gradients (dq, dk, dv, dbias or None) of attention given its saved (out, lse), without a forward.

    Same shapes as :func:`triton_attention`; ``out`` ``[*batch, H, Lq, Dv]`` and ``lse`` ``[*batch, H, Lq]`` may be
    the merged results over a larger key set (ring attention): the result is then this key block's share.
    ``d_out``/``d_lse`` None mean zero. dbias has the bias's own shape and dtype. ``segment_ids``: as in
    :func:`triton_attention`.
    """
    fused, atomic = _check_bwd(bwd, deterministic)
    seg = _canonical_ids(segment_ids, q)
    d_out = torch.zeros_like(out, dtype=v.dtype) if d_out is None else d_out.to(v.dtype)  # dots need v's dtype
    if q.ndim > 5:  # loop over dim 0: simple and exact; the merge plan of _attend is a later optimisation
        parts = [triton_lse_backward(q[i], k[i], v[i], _row(bias, i), _row(mask, i), scale, causal, out[i], lse[i],
                                     d_out[i], _row(d_lse, i), need_dbias, bwd, deterministic, _seg_index(seg, i))
                 for i in range(q.shape[0])]
        dq, dk, dv = (torch.stack([p[j] for p in parts]) for j in range(3))
        db = None
        if need_dbias:
            dbs = [p[3] for p in parts]
            db = torch.stack(dbs) if bias.shape[0] > 1 else sum(dbs[1:], dbs[0]).unsqueeze(0)
        return dq, dk, dv, db
    # [B, R, H, ...] views with unit dims prepended
    q5, k5, v5 = (_dense(_lpad(t, 5)) for t in (q, k, v))
    out5 = _lpad(out if out.stride(-1) == 1 else out.contiguous(), 5)
    lse4 = _lpad(lse, 4).float().contiguous()
    dlse4 = None if d_lse is None else _lpad(d_lse, 4).float().contiguous()
    dq, dk, dv, db = backward(
        _lpad(d_out, 5), dlse4, q5, k5, v5, out5, lse4, _lpad(bias, 5), _lpad(mask, 5), float(scale), bool(causal),
        fused, bool(need_dbias and bias is not None), atomic, *_seg_tables(seg))
    db = db.reshape(bias.shape) if db is not None else None
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), db
