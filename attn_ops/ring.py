"""Ring (context-parallel) attention over a ``torch.distributed`` process group.

The sequence of length ``L`` is sharded over the ``W`` ranks of a group; each rank holds ``n = L / W``
queries, keys and values (its *local shard*). K/V blocks travel around the ring (rank r sends to r+1,
receives from r-1) in parts, each prefetched with asynchronous point-to-point ops while the previous part is
computed; every part runs ``attn_ops.attention(..., return_lse=True)`` of the local queries against the
visiting keys and the partial results merge in place by their log-sum-exp (the online-softmax identity,
exact).

The backward is a custom ``autograd.Function``: K/V travel around the ring once more, and the dK/dV
contribution of each visiting part goes straight back to its owner, so per-rank memory stays O(local) (no
received K/V is kept from the forward). Each call's gradient is exact for the *merged* softmax: a backend
that declares ``lse_backward`` (triton, chunked) runs its backward with the merged (out, lse); any other
backend recomputes the call and receives the upstream gradients that the lse merge sends it
(see :func:`_call_grads`).

The plan (layouts and shard maps, the parts and calls of every step, what each rank sends when) is pure and
lives in ``ring_plan.py``; this module runs it over the process group.
"""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .inputs import check_inputs, narrow_bcast, segment_order_violation, segments_checked
from .ring_plan import (LAYOUTS, Call, Part, block_parts, call_keys, check_layout, ids_meet, local_segments,
                        plan_part, ring_positions, ring_schedule, shard_sequence, split_rows, unshard_sequence,
                        zigzag_merge, zigzag_split)

__all__ = ["LAYOUTS", "block_parts", "local_segments", "plan_part", "ring_attention", "ring_positions",
           "shard_sequence", "split_rows", "unshard_sequence", "zigzag_merge", "zigzag_split"]

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------------
# Bias / mask tiles
# ----------------------------------------------------------------------------------------------------
def _rows(t: Optional[Tensor], lo: int, hi: int) -> Optional[Tensor]:
    return narrow_bcast(t, -2, lo, hi)


def _cols(t: Optional[Tensor], start: int, stop: int) -> Optional[Tensor]:
    return narrow_bcast(t, -1, start, stop)


@dataclass
class _Spec:
    group: object
    world: int
    rank: int
    peers: List[int]  # global rank of each group rank
    layout: str
    causal: bool
    scale: float
    attn_kwargs: dict
    bias_fn: Optional[Callable]
    kv_parts: int
    q_chunk: Optional[int]
    grad_dtype: Optional[torch.dtype]
    # segment ids: every rank's local ids (on the device, gathered once) and their host copies (for skipping calls)
    seg_all: Optional[List[Tensor]] = None
    seg_host: Optional[List[Tensor]] = None

    def peer(self, group_rank: int) -> int:
        return self.peers[group_rank % self.world]


def _positions(spec: _Spec, n: int, rank: int, device) -> Optional[Tensor]:
    """Global positions of rank ``rank``'s shard, only when a bias callable needs them."""
    if spec.bias_fn is None:
        return None
    return ring_positions(n, spec.world, rank % spec.world, spec.layout, device=device)


def _call_ids(spec: _Spec, t: int, part: Part, call: Call):
    """(q ids, k ids) of one call on the device, or None without segment ids; "skip" when no batch row's query
    ids meet its key ids (decided on the host copies: no device sync per step)."""
    if spec.seg_all is None:
        return None
    owner = (spec.rank - t) % spec.world
    kl = call_keys(call, part)
    qh = spec.seg_host[spec.rank][..., call.q_lo:call.q_hi]
    kh = spec.seg_host[owner][..., part.lo:part.lo + kl]
    if not ids_meet(qh, kh):
        return "skip"
    return spec.seg_all[spec.rank][..., call.q_lo:call.q_hi], spec.seg_all[owner][..., part.lo:part.lo + kl]


def _tiles(spec: _Spec, bias, mask, q_pos, k_pos, part: Part, call: Call):
    """(bias tile, mask tile) for one call; the bias tile comes from ``bias_fn`` when one is given."""
    kl = call_keys(call, part)
    k0, k1 = part.start, part.start + kl
    if spec.bias_fn is not None:
        b = spec.bias_fn(q_pos[call.q_lo:call.q_hi], k_pos[part.lo:part.lo + kl])
    else:
        b = _cols(_rows(bias, call.q_lo, call.q_hi), k0, k1)
    return b, _cols(_rows(mask, call.q_lo, call.q_hi), k0, k1)


# ----------------------------------------------------------------------------------------------------
# The K/V stream: runs a rank's RingSchedule (ring_plan.py) with point-to-point ops
# ----------------------------------------------------------------------------------------------------
class _KVStream:
    """Holds the K/V parts of :class:`ring_plan.RingSchedule` and posts its exchanges: one grouped batch
    ``{send to r+1, receive from r-1}`` per step, prefetching step i+1's part while step i computes.

    A rank holds the part being computed, the one arriving and, for W > 2, the previous block (which it forwards
    one part at a time); for W = 2 only two parts are alive beyond its own K/V.
    """

    def __init__(self, spec: _Spec, k: Tensor, v: Tensor):
        self.spec, self.k, self.v = spec, k, v
        self.plan = ring_schedule(spec.layout, spec.world, spec.rank, k.shape[-2], spec.kv_parts)
        self.steps = self.plan.steps
        self.held = {}  # (block t >= 1, part p) -> received (k, v)
        self.pending = None

    def _own(self, part: Part):
        return self.k[..., part.lo:part.hi, :], self.v[..., part.lo:part.hi, :]

    def prefetch(self, i: int) -> None:
        """Post the exchange that brings step i+1's part (if it comes from another rank)."""
        nxt = self.plan.prefetch(i)
        if nxt is None:
            self.pending = None
            return
        st, sp = self.plan.sends(*nxt)
        send = self._own(self.plan.wire[0][sp]) if st == 0 else self.held[st, sp]
        recv = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in send]
        ops = [dist.P2POp(dist.isend, x.contiguous(), self.spec.peer(self.spec.rank + 1), self.spec.group)
               for x in send]
        ops += [dist.P2POp(dist.irecv, x, self.spec.peer(self.spec.rank - 1), self.spec.group) for x in recv]
        self.pending = (dist.batch_isend_irecv(ops), nxt, recv, ops)

    def finish(self, i: int) -> None:
        """Wait for the prefetch of step i+1 and drop what no later step needs."""
        if self.pending is not None:
            reqs, nxt, recv, _ = self.pending
            _wait(reqs)
            self.held[nxt] = tuple(recv)
            self.pending = None
        for done in self.plan.freed_after(i):
            self.held.pop(done, None)

    def part(self, i: int):
        t, p = self.steps[i]
        part = self.plan.part(i)
        return t, p, part, (self._own(part) if t == 0 else self.held[t, p])


def _wait(reqs) -> None:
    for r in reqs or ():
        r.wait()


# ----------------------------------------------------------------------------------------------------
# One call's gradient for the merged softmax
# ----------------------------------------------------------------------------------------------------
def _check_ring_backend(backend, q, k, v) -> None:
    """Refuse, before the forward, a named backend whose lse carries no gradient when this ring call will need
    one: every step's backward goes through the lse merge (otherwise the forward would run and the backward fail)."""
    from . import registry

    if backend == registry.AUTO:
        return
    b = registry.get(backend)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)) and not (b.lse and b.lse_grad):
        raise ValueError(f"ring_attention with gradients needs a backend with an lse gradient; backend={backend!r} "
                         "has none (backend='auto' or 'triton' has)")


def _lse_backward(spec: _Spec, q, k, v, b, m, causal, need_b, seg=None):
    """The selected backend's backward-given-(out, lse) (registry field ``lse_backward``), or None.

    Called with the *merged* out and lse it gives this call's exact share of the gradient without
    recomputing the call's forward.
    """
    from . import registry
    from .inputs import describe

    opts = dict(spec.attn_kwargs)
    name = opts.pop("backend", "auto")
    det = opts.pop("deterministic", True)
    info = replace(describe(q, k, v, b, m, causal, True, det, seg), needs_grad=True, lse_needs_grad=True,
                   bias_needs_grad=need_b)
    fn = registry.select(name, info).load_lse_backward()
    if fn is None:
        return None
    if "deterministic" in spec.attn_kwargs:
        opts["deterministic"] = det
    if seg is not None:
        opts["segment_ids"] = seg
    return functools.partial(fn, **opts)


def _call_grads(spec: _Spec, q, k, v, b, m, causal, out, lse, dout, dlse, need_b, seg=None):
    """Gradients of the merged attention w.r.t. one call's (q, k, v, bias tile).

    ``out``, ``lse``: the merged forward results for these query rows; ``dout``, ``dlse``: their upstream
    gradients. With a backend that declares ``lse_backward`` this is one backward call with the merged
    (out, lse). Otherwise the call's ``(o, lse_call)`` is recomputed with ``attn_ops.attention`` and given
    the upstream gradients that the lse merge sends it, ``w dO`` and ``w (rowsum(dO o) - D)`` with
    ``w = exp(lse_call - lse)``, ``D = rowsum(dO out) - dlse``: exact for any backend with a differentiable lse.
    """
    from .api import attention

    b_c, m_c, _ = check_inputs(q, k, v, b if b is None else b.detach(), m, spec.scale)
    fast = _lse_backward(spec, q, k, v, b_c, m_c, causal, need_b, seg)
    if fast is not None:
        dq, dk, dv, db = fast(q, k, v, b_c, m_c, spec.scale, causal, out, lse, dout, dlse, need_b)
        return dq, dk, dv, (db.reshape(b.shape) if need_b else None)
    with torch.enable_grad():
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
        bd = None if b is None else b.detach().requires_grad_(need_b)
        with segments_checked():
            o, l = attention(qd, kd, vd, bd, m, scale=spec.scale, causal=causal, return_lse=True,
                             segment_ids=seg, **spec.attn_kwargs)
        acc = l.dtype
        delta = (dout.to(acc) * out.to(acc)).sum(-1) - dlse.to(acc)  # [*b, H, Lq]
        finite = torch.isfinite(l) & torch.isfinite(lse)
        w = torch.where(finite, torch.exp(torch.where(finite, l - lse, torch.zeros_like(l))),
                        torch.zeros_like(l))  # [*b, H, Lq]
        g_o = (w.unsqueeze(-1) * dout.to(acc)).to(o.dtype)
        g_l = w * ((dout.to(acc) * o.detach().to(acc)).sum(-1) - delta)
        inputs = [qd, kd, vd] + ([bd] if need_b else [])
        grads = torch.autograd.grad([o, l], inputs, [g_o, g_l], allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]
    return grads[0], grads[1], grads[2], (grads[3] if need_b else None)


def _merge_into(out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> None:
    """In place: (out, lse) <- exact merge of (out, lse) with a partial (o, l) over disjoint keys."""
    l = l.to(lse.dtype)
    new = torch.logaddexp(lse, l)
    ok = torch.isfinite(new)
    safe = torch.where(ok, new, torch.zeros_like(new))
    a = torch.where(ok, torch.exp(lse - safe), torch.zeros_like(new))  # [*b, H, Lq]
    c = torch.where(ok, torch.exp(l - safe), torch.zeros_like(new))
    out.mul_(a.unsqueeze(-1)).addcmul_(o, c.unsqueeze(-1).to(out.dtype))
    lse.copy_(new)


# ----------------------------------------------------------------------------------------------------
# The autograd function
# ----------------------------------------------------------------------------------------------------
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, q, k, v, bias, mask, *bias_params):
        W, r, n = spec.world, spec.rank, q.shape[-2]
        q_segs = local_segments(spec.layout, W, r, n)
        q_pos = _positions(spec, n, r, q.device)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc, device=q.device)  # [*b, H, n, Dv]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # [*b, H, n]
        stream = _KVStream(spec, k, v)
        for i in range(len(stream.steps)):
            stream.prefetch(i)
            t, p, part, (k_p, v_p) = stream.part(i)
            k_pos = _positions(spec, n, r - t, q.device)
            for call in split_rows(plan_part(q_segs, part, spec.causal), part, spec.q_chunk):
                seg = _call_ids(spec, t, part, call)
                if seg == "skip":  # no query of this call shares a segment with the part's keys
                    continue
                b, m = _tiles(spec, bias, mask, q_pos, k_pos, part, call)
                rows = slice(call.q_lo, call.q_hi)
                with torch.no_grad():
                    kl = call_keys(call, part)
                    o_c, l_c = _attention(spec, q[..., rows, :], k_p[..., :kl, :], v_p[..., :kl, :], b, m,
                                          call.causal, seg)
                _merge_into(out[..., rows, :], lse[..., rows], o_c, l_c)
            stream.finish(i)
        out = out.to(q.dtype)
        lse = lse if q.dtype == torch.float64 else lse.float()
        ctx.spec = spec
        ctx.bias_params = bias_params  # leaf parameters of bias_fn (kept as objects, not saved copies)
        ctx.save_for_backward(q, k, v, bias, mask, out, lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_lse):
        spec: _Spec = ctx.spec
        q, k, v, bias, mask, out, lse = ctx.saved_tensors
        bias_params = ctx.bias_params
        W, r, n = spec.world, spec.rank, q.shape[-2]
        need = ctx.needs_input_grad  # (spec, q, k, v, bias, mask, *params)
        need_b_tensor = bias is not None and need[4]
        need_params = spec.bias_fn is not None and any(need[6:])
        need_kv = need[2] or need[3]
        if d_out is None:
            d_out = torch.zeros_like(out)
        if d_lse is None:
            d_lse = torch.zeros_like(lse)
        gdt = spec.grad_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
        q_segs = local_segments(spec.layout, W, r, n)
        q_pos = _positions(spec, n, r, q.device)
        dq = torch.zeros(q.shape, dtype=gdt, device=q.device)
        dk = torch.zeros(k.shape, dtype=gdt, device=q.device) if need_kv else None
        dv = torch.zeros(v.shape, dtype=gdt, device=q.device) if need_kv else None
        # Each (query, key) pair lies in exactly one call, so a bias with full row and column dims gets every
        # element written once (kept in its own dtype); a broadcast bias sums over calls (in gdt).
        db_once = need_b_tensor and bias.shape[-2] == n and bias.shape[-1] == n * W
        db = torch.zeros(bias.shape, dtype=bias.dtype if db_once else gdt, device=q.device) if need_b_tensor else None
        dparams = [torch.zeros_like(p) for p in bias_params] if need_params else None
        stream = _KVStream(spec, k, v)
        sent = None  # the contribution exchange of the previous step, still in flight
        for i in range(len(stream.steps)):
            stream.prefetch(i)
            t, p, part, (k_p, v_p) = stream.part(i)
            k_pos = _positions(spec, n, r - t, q.device)
            dk_p = dv_p = None
            if need_kv and t == 0:  # own K/V: accumulate in place
                dk_p, dv_p = dk[..., part.lo:part.hi, :], dv[..., part.lo:part.hi, :]
            elif need_kv:
                dk_p = torch.zeros(k_p.shape, dtype=gdt, device=q.device)
                dv_p = torch.zeros(v_p.shape, dtype=gdt, device=q.device)
            for call in split_rows(plan_part(q_segs, part, spec.causal), part, spec.q_chunk):
                seg = _call_ids(spec, t, part, call)
                if seg == "skip":  # as in the forward: this call adds nothing
                    continue
                rows = slice(call.q_lo, call.q_hi)
                with torch.enable_grad() if need_params else torch.no_grad():
                    b, m = _tiles(spec, bias, mask, q_pos, k_pos, part, call)
                need_b = need_b_tensor or (need_params and b is not None and b.requires_grad)
                kl = call_keys(call, part)
                g_q, g_k, g_v, g_b = _call_grads(spec, q[..., rows, :], k_p[..., :kl, :], v_p[..., :kl, :], b, m,
                                                 call.causal,
                                                 out[..., rows, :], lse[..., rows], d_out[..., rows, :],
                                                 d_lse[..., rows], need_b, seg)
                dq[..., rows, :] += g_q
                if need_kv:
                    dk_p[..., :kl, :] += g_k
                    dv_p[..., :kl, :] += g_v
                if need_b_tensor:
                    k0 = part.start
                    tile = _cols(_rows(db, call.q_lo, call.q_hi), k0, k0 + kl)
                    if db_once:  # every element has exactly one writer
                        tile.copy_(g_b)
                    else:
                        tile += g_b
                elif need_b:
                    for acc_p, g in zip(dparams, torch.autograd.grad(b, bias_params, g_b, allow_unused=True)):
                        if g is not None:
                            acc_p += g
            if need_kv and t > 0:
                # Send this part's dK/dV contribution to its owner r - t; receive the contribution of rank r + t
                # to this rank's own part p (every rank posts this pair at the same step index).
                _finish_sent(sent, dk, dv)
                sent = _send_contribution(spec, stream.plan.contribution(i), dk_p, dv_p)
            stream.finish(i)
        _finish_sent(sent, dk, dv)
        grads = [None, dq.to(q.dtype), None if dk is None else dk.to(k.dtype),
                 None if dv is None else dv.to(v.dtype), None if db is None else db.to(bias.dtype), None]
        return tuple(grads + (list(dparams) if dparams is not None else [None] * len(bias_params)))


def _send_contribution(spec: _Spec, contribution, dk_p: Tensor, dv_p: Tensor):
    to, frm, own_part = contribution  # group ranks (ring_plan.RingSchedule.contribution)
    shape_k = dk_p.shape[:-2] + (own_part.hi - own_part.lo,) + dk_p.shape[-1:]
    shape_v = dv_p.shape[:-2] + (own_part.hi - own_part.lo,) + dv_p.shape[-1:]
    recv = [torch.empty(shape_k, dtype=dk_p.dtype, device=dk_p.device),
            torch.empty(shape_v, dtype=dv_p.dtype, device=dv_p.device)]
    to, frm = spec.peer(to), spec.peer(frm)
    ops = [dist.P2POp(dist.isend, dk_p, to, spec.group), dist.P2POp(dist.isend, dv_p, to, spec.group),
           dist.P2POp(dist.irecv, recv[0], frm, spec.group), dist.P2POp(dist.irecv, recv[1], frm, spec.group)]
    return dist.batch_isend_irecv(ops), own_part, recv, (dk_p, dv_p)


def _finish_sent(sent, dk, dv) -> None:
    if sent is None:
        return
    reqs, part, recv, _ = sent
    _wait(reqs)
    dk[..., part.lo:part.hi, :] += recv[0]
    dv[..., part.lo:part.hi, :] += recv[1]


def _attention(spec: _Spec, q, k, v, b, m, causal, seg=None):
    from .api import attention

    with segments_checked():  # the whole sequence's ids were checked once (_gather_ids)
        return attention(q, k, v, b, m, scale=spec.scale, causal=causal, return_lse=True, segment_ids=seg,
                         **spec.attn_kwargs)


def _gather_ids(ids: Tensor, group, world: int, layout: str) -> Tuple[List[Tensor], List[Tensor]]:
    """Every rank's local segment ids (one all_gather of a few ints per token) on the device and on the host,
    after checking that the whole sequence's segments are contiguous (the same ValueError on every rank)."""
    ids = ids.contiguous()
    if world == 1:
        parts = [ids]
    else:
        parts = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(parts, ids, group=group)
    host = [p.cpu() for p in parts]
    full = unshard_sequence(host, -1, layout)
    bad = segment_order_violation(full)
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"ring_attention: segment_ids must be contiguous within each row of the whole sequence "
                         f"(non-negative ids non-decreasing); row {where} is {full[where].tolist()[:64]}")
    return parts, host


# ----------------------------------------------------------------------------------------------------
# Validation: every rank checks its inputs, then all ranks agree before any point-to-point op
# ----------------------------------------------------------------------------------------------------
def _check_side(name: str, t, q: Tensor, n_total: int, *, is_mask: bool):
    """Validate a bias/mask tensor ``[..., Lq_local or 1, L_total or 1]``; return it with q.ndim dims."""
    from .inputs import _check_broadcast, _pad_dims

    if is_mask:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = attend), got {getattr(t, 'dtype', type(t))}")
    elif not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"bias must be a floating-point tensor or a callable, got {getattr(t, 'dtype', type(t))}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    target = tuple(q.shape[:-1]) + (n_total,)
    try:
        _check_broadcast(name, t, target)
    except ValueError as exc:
        raise ValueError(f"{exc} (ring_attention: {name} holds this rank's query rows and all "
                         f"{n_total} key columns in sequence order)") from None
    return _pad_dims(t, q.ndim)


def _fn_params(bias_fn) -> Tuple[Tensor, ...]:
    params = getattr(bias_fn, "parameters", None)
    if params is None:
        return ()
    return tuple(p for p in params() if p.requires_grad)


def _flag_device(group) -> torch.device:
    """Where the agreement flags live: CPU when the group has gloo (no GPU synchronisation), else the
    current CUDA device (one tiny NCCL all-reduce)."""
    g = dist.group.WORLD if group is None else group
    if "gloo" in str(dist.get_backend(g)) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _agree(group, world: int, rank: int, error: Optional[str], meta) -> None:
    """Every rank learns whether any rank failed its checks or sees other shapes/options; if so all raise the
    same ValueError (before any point-to-point op, so nobody hangs).

    Fast path: one all-reduce (max) of (failed flag, digest, -digest); only on disagreement are the messages
    gathered.
    """
    if world == 1:
        if error:
            raise ValueError(f"ring_attention: {error}")
        return
    digest = zlib.crc32(repr(meta).encode()) if error is None else -1
    flags = torch.tensor([int(error is not None), digest, -digest], dtype=torch.int64, device=_flag_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    failed, hi, neg_lo = flags.tolist()
    if failed == 0 and hi == -neg_lo:  # no rank failed and every digest is the same
        return
    gathered = [None] * world
    dist.all_gather_object(gathered, (rank, error, meta), group=group)
    errors = [f"rank {g[0]}: {g[1]}" for g in gathered if g[1]]
    if errors:
        raise ValueError("ring_attention: bad input on " + "; ".join(errors))
    detail = "; ".join(f"rank {g[0]}: {g[2]}" for g in gathered)
    raise ValueError(f"ring_attention: ranks disagree on shapes/options ({detail})")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, bias=None, mask: Optional[Tensor] = None, *,
                   group=None, causal: bool = False, layout: str = "contiguous", scale: Optional[float] = None,
                   backend: str = "auto", return_lse: bool = False, kv_parts: int = 1,
                   q_chunk: Optional[int] = None, grad_dtype: Optional[torch.dtype] = None, check: bool = True,
                   segment_ids: Optional[Tensor] = None, **options):
    """Attention over a sequence sharded across the ranks of ``group`` (every rank calls it).

    Args:
        q: ``[*batch, H, n, D]``, this rank's local queries, ``n = L / W`` (W = group size), in ``layout`` order.
        k, v: ``[*batch, H, n, D]`` / ``[*batch, H, n, Dv]``, this rank's local keys and values (same positions).
        bias: one of
            - None;
            - a float tensor broadcastable to ``[*batch, H, n, L]``: the rows for this rank's local queries (in
              local order, e.g. ``shard_sequence(full_bias, -2, W, rank, layout)``) and **every** key column in
              natural sequence order (size L, or 1 to broadcast). May require grad; its gradient has its shape.
            - a callable ``bias_fn(q_pos, k_pos) -> Tensor`` broadcastable to ``[*batch, H, len(q_pos),
              len(k_pos)]``, given Long global positions of a query tile and a key tile; the ring materialises
              only the tiles it needs (a learned relative-position table, say). If it has ``.parameters()``
              (an ``nn.Module``) those parameters get exact gradients; other tensors it closes over get none.
        mask: bool, broadcastable to ``[*batch, H, n, L]`` like a bias tensor (local query rows, all key
            columns in sequence order), True = attend; the usual key-padding mask is ``[B, 1, 1, L]``.
        group: the process group (default: the world); without an initialised process group W = 1.
        causal: query at global position i sees keys at positions <= i (use ``layout="zigzag"`` to balance work).
        layout: ``"contiguous"`` (rank r holds positions [r n, (r+1) n)) or ``"zigzag"`` (chunks r and 2W-1-r
            of 2W; see :func:`zigzag_split`).
        scale: logit scale, default ``D ** -0.5``.
        backend, **options: the local op used by every step (:func:`attn_ops.attention`); needs lse with grad.
        return_lse: also return lse ``[*batch, H, n]`` (float32; float64 for float64 inputs), natural log of the
            softmax denominator over the whole sequence; differentiable. A row with no key: out 0, lse -inf.
        kv_parts: every K/V segment travels as this many parts, each prefetched while the previous one is
            computed: with W = 2 the extra memory is about 2 parts instead of a whole K/V block (see
            :class:`_KVStream`); bias and mask tiles are per part too.
        q_chunk: at most this many query rows per attention call (None: no limit); bounds the per-call
            temporaries (the call's dQ, a copy of its query rows) at the cost of more, smaller calls.
        grad_dtype: dtype of the dQ/dK/dV accumulators and of the dK/dV contributions sent in the backward
            (default float32, float64 for float64 inputs; ``q.dtype`` halves that memory and traffic at low
            precision at the cost of one rounding per contribution).
        check: exchange a validity flag and the shapes across ranks first, so that a rank with bad input makes
            every rank raise the same ValueError instead of hanging in a point-to-point op.
        segment_ids: packed rows (several documents along the sequence): an integer tensor ``[*batch, n]`` of this
            rank's local positions (in ``layout`` order, sharded like q), equal ids attend, negative = padding,
            contiguous over the whole sequence (checked once per call). The ids of all ranks are gathered once
            (one all_gather of n ints per rank, cheaper than sending them with every K/V part); every attention
            call gets its query rows' and key part's ids, and calls whose id ranges cannot meet are skipped
            (forward and backward). Zigzag keeps its balance of causal work; with packed rows the work per rank
            then depends on where the documents fall.

    Returns:
        out ``[*batch, H, n, Dv]`` in q's dtype (local rows), and with ``return_lse`` also lse.

    Limits: the backward is once-differentiable; ``torch.compile`` graph-breaks around the ring (the inner op
    compiles); an error that strikes one rank *after* the agreement (out of memory, say) leaves the others in a
    point-to-point op until the process group's timeout.
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        world, rank, peers = 1, 0, [0]
    else:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        peers = [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]
    bias_fn = None
    error, meta = None, None
    try:
        check_layout(layout)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        _, _, scale = check_inputs(q, k, v, None, None, scale)
        if k.shape[-2] != q.shape[-2]:
            raise ValueError(f"ring_attention needs local q and k of the same length, got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}")
        n_total = q.shape[-2] * world
        local_segments(layout, world, rank, q.shape[-2])  # zigzag: even local length
        if not isinstance(kv_parts, int) or not 1 <= kv_parts <= q.shape[-2] // (2 if layout == "zigzag" else 1):
            raise ValueError(f"kv_parts must be an int in [1, segment length], got {kv_parts!r}")
        if q_chunk is not None and (not isinstance(q_chunk, int) or q_chunk < 1):
            raise ValueError(f"q_chunk must be None or a positive int, got {q_chunk!r}")
        _check_ring_backend(backend, q, k, v)
        if callable(bias) and not isinstance(bias, torch.Tensor):
            bias_fn, bias = bias, None
        elif bias is not None:
            bias = _check_side("bias", bias, q, n_total, is_mask=False)
        if mask is not None:
            mask = _check_side("mask", mask, q, n_total, is_mask=True)
        if segment_ids is not None:
            from .inputs import _check_one_ids

            with segments_checked():  # contiguity is checked over the whole sequence once gathered
                segment_ids = _check_one_ids("segment_ids", segment_ids, q, q.shape[-2], "n (local)")
        meta = (tuple(q.shape), tuple(k.shape), tuple(v.shape), str(q.dtype), layout, causal, scale,
                None if bias is None else tuple(bias.shape), bias_fn is not None,
                None if mask is None else tuple(mask.shape), backend, kv_parts, q_chunk,
                None if segment_ids is None else tuple(segment_ids.shape))
    except (TypeError, ValueError, NotImplementedError) as exc:
        if world == 1 or not check:
            raise
        error = f"{type(exc).__name__}: {exc}"
    if check:
        _agree(group, world, rank, error, meta)
    params = _fn_params(bias_fn) if bias_fn is not None else ()
    seg_all = seg_host = None
    if segment_ids is not None:
        seg_all, seg_host = _gather_ids(segment_ids, group, world, layout)
    spec = _Spec(group=group, world=world, rank=rank, peers=peers, layout=layout, causal=causal, scale=scale,
                 attn_kwargs=dict(backend=backend, **options), bias_fn=bias_fn, kv_parts=kv_parts,
                 q_chunk=q_chunk, grad_dtype=grad_dtype, seg_all=seg_all, seg_host=seg_host)
    out, lse = _RingAttention.apply(spec, q, k, v, bias, mask, *params)
    return (out, lse) if return_lse else out
