"""``torch.library`` custom ops around the kernel launches (fake impls for torch.compile) and their autograd.

``attn_zoo::triton_attn_fwd`` and ``attn_zoo::triton_attn_bwd`` take canonical 5-D tensors
``[B, R, H, L, D]`` (see ``api.py`` for the reshaping); bias and mask keep their own shapes
``[B|1, R|1, H|1, Lq|1, Lk|1]``.

:func:`attend` is the entry point: under ``torch.compile`` it calls the custom op (traceable, no graph break);
in eager mode a plain ``autograd.Function`` around the same two bodies (``attn_forward``/``_backward_impl``),
which skips the custom op's dispatch (its autograd wrapper, redispatch, aliasing checks): host time a small shape
is bound by (docs/bench/history.md). Both paths run the same launches, so they give the same bits.
"""
from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch

from .launch import STATE, empty_in_order
from .passes import attn_backward, attn_forward, segment_tables_flat, split_tables
from .tuning import compiling_ahead as _compiling_ahead

Tensor = torch.Tensor


@torch.library.custom_op("attn_zoo::triton_attn_fwd", mutates_args=())
def triton_attn_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                    scale: float, causal: bool, fused_bwd: bool, atomic_dbias: bool, q_seg: Optional[Tensor] = None,
                    k_seg: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """out ``[B, R, H, Lq, Dv]`` (q.dtype, in q's dim order) and lse ``[B, R, H, Lq]`` (fp32, natural log, -inf on
    empty rows).

    ``fused_bwd`` and ``atomic_dbias`` only select the backward's variant (one pass with dQ by atomics vs split
    kernels; a broadcast bias's gradient by atomics vs the deterministic reduction kernel). ``q_seg``/``k_seg``:
    segment id tables ``[B|1, R|1, 3, L]`` int32 (``op.segment_tables``) or None.
    """
    return attn_forward(q, k, v, bias, mask, scale, causal, q_seg, k_seg)


@triton_attn_fwd.register_fake
def _(q, k, v, bias, mask, scale, causal, fused_bwd, atomic_dbias, q_seg=None, k_seg=None):
    out = empty_in_order(q, q.shape[:-1] + v.shape[-1:], q.dtype)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return out, lse


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
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()  # the kernels index it as [B, R, H, Lq]; autograd may hand an expanded view
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
    if q_ids.is_inference() or k_ids.is_inference() or (
            q_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    side = lambda t: (id(_root(t)), t._version, t.untyped_storage().data_ptr(), t.shape, t.stride(),  # noqa
                      t.storage_offset(), t.dtype, t.device)
    return (shared, side(q_ids), side(k_ids))


def _setup_context(ctx, inputs, output):
    q, k, v, bias, mask, scale, causal, fused_bwd, atomic_dbias = inputs[:9]
    q_seg, k_seg = (tuple(inputs[9:]) + (None, None))[:2]
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, mask, out, lse, q_seg, k_seg)
    ctx.scale, ctx.causal, ctx.fused, ctx.atomic_dbias = scale, causal, fused_bwd, atomic_dbias
    ctx.set_materialize_grads(False)  # an unused lse sends None, not a zeros buffer


def _grads(ctx, dout, dlse, run_backward):
    """The autograd backward of both paths; ``run_backward`` is the custom op (compiled) or its body (eager)."""
    q, k, v, bias, mask, out, lse, q_seg, k_seg = ctx.saved_tensors
    need_dbias = bias is not None and ctx.needs_input_grad[3]
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dq, dk, dv, dbias = run_backward(
        dout, dlse, q, k, v, out, lse, bias, mask, ctx.scale, ctx.causal, ctx.fused, need_dbias, ctx.atomic_dbias,
        q_seg, k_seg)
    return (dq, dk, dv, (dbias if need_dbias else None)) + (None,) * (len(ctx.needs_input_grad) - 4)


def _backward(ctx, dout, dlse):
    return _grads(ctx, dout, dlse, torch.ops.attn_zoo.triton_attn_bwd)


torch.library.register_autograd("attn_zoo::triton_attn_fwd", _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager path: the custom op's forward, setup and backward without its dispatch."""

    @staticmethod
    def forward(q, k, v, bias, mask, scale, causal, fused_bwd, atomic_dbias, q_seg=None, k_seg=None):
        return attn_forward(q, k, v, bias, mask, scale, causal, q_seg, k_seg)

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
