"""Ring (context-parallel) attention over a ``torch.distributed`` process group.

The sequence of length ``L`` is sharded over the ``W`` ranks of a group; each rank holds ``n = L / W``
queries, keys and values (its *local shard*). K/V blocks travel around the ring (rank r sends to r+1,
receives from r-1) with asynchronous point-to-point ops that overlap the current step's compute; every
step runs ``attn_ops.attention(..., return_lse=True)`` of the local queries against the visiting keys and
the partial results merge by their log-sum-exp (the online-softmax identity, exact).

The backward is a custom ``autograd.Function``: it sends K/V around the ring once more together with the
dK/dV accumulators for that block, so per-rank memory stays O(local) (no received K/V is kept from the
forward). Each step's gradient is exact for the *merged* softmax: with ``w = exp(lse_step - lse)`` the step
receives upstream gradients ``w * dO`` for its output and ``w * (rowsum(dO * o_step) - D)`` for its lse,
``D = rowsum(dO * O) - dlse``, which makes its internal softmax gradient equal the full one.

Layouts (positions of the local shard in the full sequence):
    ``contiguous``: rank r holds ``[r n, (r+1) n)``.
    ``zigzag``: the sequence is cut in 2W chunks of ``c = n / 2``; rank r holds chunks r and 2W-1-r, so
    causal work is the same on every rank. :func:`zigzag_split` / :func:`zigzag_merge` convert.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .inputs import causal_mask, check_inputs
from .merge import merge_partials

Tensor = torch.Tensor
LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------------------------------
def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def local_segments(layout: str, world: int, rank: int, n_local: int) -> List[Tuple[int, int]]:
    """``[(global_start, length), ...]`` of the local shard, in local order."""
    _check_layout(layout)
    if layout == "contiguous":
        return [(rank * n_local, n_local)]
    if n_local % 2:
        raise ValueError(f"zigzag layout needs an even local length, got {n_local}")
    c = n_local // 2
    return [(rank * c, c), ((2 * world - 1 - rank) * c, c)]


def ring_positions(n_local: int, world: int, rank: int, layout: str = "contiguous", device=None) -> Tensor:
    """Long ``[n_local]``: global sequence positions of rank ``rank``'s local shard, in local order."""
    segs = local_segments(layout, world, rank, n_local)
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in segs])


def zigzag_split(x: Tensor, dim: int, world: int, rank: int) -> Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` along ``dim``: chunks ``rank`` and ``2*world-1-rank`` of 2*world.

    ``x.shape[dim]`` must be divisible by ``2 * world``. Returns a new tensor of length ``shape[dim] / world``.
    """
    size = x.shape[dim]
    if size % (2 * world):
        raise ValueError(f"zigzag_split: x.shape[{dim}] = {size} is not divisible by 2 * world = {2 * world}")
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def zigzag_merge(shards: Sequence[Tensor], dim: int) -> Tensor:
    """Inverse of :func:`zigzag_split`: ``shards[r]`` is rank r's shard; returns the full tensor in order."""
    world = len(shards)
    halves = [s.chunk(2, dim) for s in shards]
    ordered = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
    return torch.cat(ordered, dim)


def shard_sequence(x: Tensor, dim: int, world: int, rank: int, layout: str = "contiguous") -> Tensor:
    """Rank ``rank``'s shard of a full-sequence tensor in ``layout`` (contiguous: plain ``chunk``)."""
    if _check_layout(layout) == "zigzag":
        return zigzag_split(x, dim, world, rank)
    if x.shape[dim] % world:
        raise ValueError(f"shard_sequence: x.shape[{dim}] = {x.shape[dim]} is not divisible by world = {world}")
    return x.chunk(world, dim)[rank].contiguous()


def unshard_sequence(shards: Sequence[Tensor], dim: int, layout: str = "contiguous") -> Tensor:
    """Inverse of :func:`shard_sequence` given every rank's shard."""
    if _check_layout(layout) == "zigzag":
        return zigzag_merge(shards, dim)
    return torch.cat(list(shards), dim)


# ----------------------------------------------------------------------------------------------------
# Step planning: which (query range, key range, causal) attention calls one ring step makes
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Call:
    q_lo: int  # local query rows [q_lo, q_hi)
    q_hi: int
    k_lo: int  # local rows of the visiting K/V block [k_lo, k_hi)
    k_hi: int
    causal: bool  # aligned causal: query i sees key j <= i + (Lk - Lq) within the call


def _plan_step(q_segs, k_segs, causal: bool) -> List[_Call]:
    """Attention calls for local queries (segments ``q_segs``) against a K/V block (segments ``k_segs``).

    Segments are ``(global_start, length)`` in local order. Under ``causal`` a key segment is skipped when
    entirely in the future of a query segment, taken whole when entirely in its past, and taken with an
    aligned causal mask when it covers the same positions; the layouts here produce no other case.
    """
    def offsets(segs):
        out, pos = [], 0
        for s, n in segs:
            out.append(pos)
            pos += n
        return out

    q_off, k_off = offsets(q_segs), offsets(k_segs)
    per_q = []  # for each query segment: list of (k_lo, k_hi, causal)
    for (qs, qn) in q_segs:
        groups: List[list] = []
        for (ks, kn), ko in zip(k_segs, k_off):
            if not causal or ks + kn - 1 <= qs:
                kind = "full"
            elif ks > qs + qn - 1:
                continue  # every key is in the future of every query
            elif ks == qs and kn == qn:
                kind = "diag"
            else:
                raise NotImplementedError(
                    f"ring_attention: key segment [{ks}, {ks + kn}) partially overlaps query segment "
                    f"[{qs}, {qs + qn}); use the contiguous or zigzag layout")
            # Extend the previous group when the keys are adjacent locally and the previous group is full.
            if groups and groups[-1][1] == ko and not groups[-1][2]:
                groups[-1][1] = ko + kn
                groups[-1][2] = kind == "diag"
            else:
                groups.append([ko, ko + kn, kind == "diag"])
        per_q.append([tuple(g) for g in groups])
    calls: List[_Call] = []
    prev = None
    for (qs, qn), qo, groups in zip(q_segs, q_off, per_q):
        mergeable = all(not g[2] for g in groups)
        if prev is not None and mergeable and prev[2] == groups and prev[1] == qo:
            prev[1] = qo + qn  # same full key ranges as the previous, locally adjacent query segment
            continue
        if prev is not None:
            calls += [_Call(prev[0], prev[1], lo, hi, c) for lo, hi, c in prev[2]]
        prev = [qo, qo + qn, groups] if mergeable else None
        if not mergeable:
            calls += [_Call(qo, qo + qn, lo, hi, c) for lo, hi, c in groups]
    if prev is not None:
        calls += [_Call(prev[0], prev[1], lo, hi, c) for lo, hi, c in prev[2]]
    return calls


def _global_ranges(segs, lo: int, hi: int) -> List[Tuple[int, int]]:
    """Global ``[start, stop)`` ranges covered by local rows ``[lo, hi)`` of a shard with segments ``segs``."""
    out, pos = [], 0
    for s, n in segs:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((s + a - pos, s + b - pos))
        pos += n
    return out


# ----------------------------------------------------------------------------------------------------
# Bias / mask tiles
# ----------------------------------------------------------------------------------------------------
def _rows(t: Optional[Tensor], lo: int, hi: int) -> Optional[Tensor]:
    if t is None or t.shape[-2] == 1:
        return t
    return t[..., lo:hi, :]


def _cols(t: Optional[Tensor], ranges) -> Optional[Tensor]:
    if t is None or t.shape[-1] == 1:
        return t
    if len(ranges) == 1:
        return t[..., ranges[0][0]:ranges[0][1]]
    return torch.cat([t[..., a:b] for a, b in ranges], -1)


def _add_tile(dst: Tensor, tile: Tensor, lo: int, hi: int, ranges) -> None:
    """``dst[rows lo:hi, cols ranges] += tile`` for a bias gradient (broadcast dims are not sliced)."""
    rows = dst if dst.shape[-2] == 1 else dst[..., lo:hi, :]
    if dst.shape[-1] == 1:
        rows += tile
        return
    pos = 0
    for a, b in ranges:
        rows[..., a:b] += tile[..., pos:pos + b - a]
        pos += b - a


@dataclass
class _Spec:
    group: object
    world: int
    rank: int
    prev: int  # global rank we receive from
    next: int  # global rank we send to
    layout: str
    causal: bool
    scale: float
    attn_kwargs: dict
    bias_fn: Optional[Callable]
    n_bias_params: int
    grad_dtype: Optional[torch.dtype]


def _tiles(spec: _Spec, bias, mask, q_pos, k_pos, q_segs, k_segs, call: _Call):
    """(bias tile, mask tile) for one call; the bias tile comes from ``bias_fn`` when one is given."""
    ranges = _global_ranges(k_segs, call.k_lo, call.k_hi)
    if spec.bias_fn is not None:
        b = spec.bias_fn(q_pos[call.q_lo:call.q_hi], k_pos[call.k_lo:call.k_hi])
    else:
        b = _cols(_rows(bias, call.q_lo, call.q_hi), ranges)
    m = _cols(_rows(mask, call.q_lo, call.q_hi), ranges)
    return b, m, ranges


# ----------------------------------------------------------------------------------------------------
# Communication
# ----------------------------------------------------------------------------------------------------
def _exchange(spec: _Spec, send: Sequence[Tensor]) -> Tuple[list, List[Tensor]]:
    """Post sends of ``send`` to the next rank and receives of same-shaped buffers from the previous one."""
    recv = [torch.empty_like(t) for t in send]
    ops = [dist.P2POp(dist.isend, t, spec.next, spec.group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, spec.prev, spec.group) for t in recv]
    return dist.batch_isend_irecv(ops), recv


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


# ----------------------------------------------------------------------------------------------------
# One step's gradient for the merged softmax
# ----------------------------------------------------------------------------------------------------
def _lse_backward(spec: _Spec, q, k, v, b, m, causal, need_b):
    """The selected backend's backward-given-(out, lse), if its registry entry declares one (else None).

    A backend opts in with a ``lse_backward = "module:function"`` field taking
    ``(q, k, v, bias, mask, scale, causal, out, lse, d_out, d_lse, need_dbias, **options)`` with canonical
    bias/mask and returning ``(dq, dk, dv, dbias)``. Called with the *merged* out and lse it gives this step's
    exact share of the gradient without recomputing the step's forward.
    """
    from . import registry
    from .inputs import describe

    opts = dict(spec.attn_kwargs)
    name = opts.pop("backend", "auto")
    det = opts.pop("deterministic", True)
    info = replace(describe(q, k, v, b, m, causal, True, det), needs_grad=True, lse_needs_grad=True,
                   bias_needs_grad=need_b)
    chosen = registry.select(name, info)
    fn = chosen.load_lse_backward()
    return None if fn is None else functools.partial(fn, **opts)


def _step_grads(spec: _Spec, q, k, v, b, m, causal, out, lse, dout, dlse, delta, need_b):
    """Gradients of the merged attention w.r.t. one step's (q, k, v, bias tile).

    ``out``, ``lse``: the merged forward results for these query rows; ``dout``, ``dlse``: their upstream
    gradients; ``delta = rowsum(dout * out) - dlse``. With a backend that declares ``lse_backward`` this is
    one backward call with the merged (out, lse). Otherwise it recomputes the step's ``(o, lse_step)`` with
    ``attn_ops.attention`` and backpropagates the upstream gradients that the lse merge sends it (see the
    module docstring): exact for any backend that returns a differentiable lse.
    """
    from .api import attention

    b_c, m_c, _ = check_inputs(q, k, v, b if b is None else b.detach(), m, spec.scale)
    fast = _lse_backward(spec, q, k, v, b_c, m_c, causal, need_b)
    if fast is not None:
        dq, dk, dv, db = fast(q, k, v, b_c, m_c, spec.scale, causal, out, lse, dout, dlse, need_b)
        return dq, dk, dv, (db.reshape(b.shape) if need_b else None)
    with torch.enable_grad():
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
        bd = None if b is None else (b.detach().requires_grad_(need_b) if need_b else b.detach())
        o, l = attention(qd, kd, vd, bd, m, scale=spec.scale, causal=causal, return_lse=True,
                         **spec.attn_kwargs)
        acc = l.dtype
        finite = torch.isfinite(l) & torch.isfinite(lse)
        w = torch.where(finite, torch.exp(torch.where(finite, l - lse, torch.zeros_like(l))),
                        torch.zeros_like(l))  # [*b, H, Lq]
        g_o = (w.unsqueeze(-1) * dout.to(acc)).to(o.dtype)
        g_l = w * ((dout.to(acc) * o.detach().to(acc)).sum(-1) - delta)
        inputs = [qd, kd, vd] + ([bd] if need_b else [])
        grads = torch.autograd.grad([o, l], inputs, [g_o, g_l], allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]
    return grads[0], grads[1], grads[2], (grads[3] if need_b else None)


# ----------------------------------------------------------------------------------------------------
# The autograd function
# ----------------------------------------------------------------------------------------------------
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, q, k, v, bias, mask, *bias_params):
        W, r = spec.world, spec.rank
        n = q.shape[-2]
        q_segs = local_segments(spec.layout, W, r, n)
        q_pos = ring_positions(n, W, r, spec.layout, device=q.device)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc, device=q.device)  # [*b, H, n, Dv]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # [*b, H, n]
        kv = (k.contiguous(), v.contiguous())  # p2p sends need contiguous buffers
        for t in range(W):
            s = (r - t) % W
            reqs, nxt = _exchange(spec, kv) if t < W - 1 else ([], None)
            k_segs = local_segments(spec.layout, W, s, n)
            k_pos = ring_positions(n, W, s, spec.layout, device=q.device)
            for call in _plan_step(q_segs, k_segs, spec.causal):
                b, m, _ = _tiles(spec, bias, mask, q_pos, k_pos, q_segs, k_segs, call)
                o_c, l_c = _attention_nograd(spec, q[..., call.q_lo:call.q_hi, :],
                                             kv[0][..., call.k_lo:call.k_hi, :],
                                             kv[1][..., call.k_lo:call.k_hi, :], b, m, call.causal)
                rows = slice(call.q_lo, call.q_hi)
                o_m, l_m = merge_partials([out[..., rows, :], o_c], [lse[..., rows], l_c.to(acc)])
                out[..., rows, :] = o_m
                lse[..., rows] = l_m
            _wait(reqs)
            if nxt is not None:
                kv = tuple(nxt)
        out = out.to(q.dtype)
        lse = lse if q.dtype == torch.float64 else lse.float()
        ctx.spec = spec
        ctx.bias_params = bias_params  # leaf parameters of bias_fn (kept as objects, not saved copies)
        ctx.save_for_backward(q, k, v, bias, mask, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        spec: _Spec = ctx.spec
        q, k, v, bias, mask, out, lse = ctx.saved_tensors
        bias_params = ctx.bias_params
        W, r = spec.world, spec.rank
        n = q.shape[-2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        need = ctx.needs_input_grad
        need_b_tensor = bias is not None and need[4]
        need_params = spec.bias_fn is not None and any(need[6:])
        need_kv = need[2] or need[3]
        if d_out is None:
            d_out = torch.zeros_like(out)
        if d_lse is None:
            d_lse = torch.zeros_like(lse)
        delta = (d_out.to(acc) * out.to(acc)).sum(-1) - d_lse.to(acc)  # [*b, H, n]
        grad_dtype = spec.grad_dtype or acc
        q_segs = local_segments(spec.layout, W, r, n)
        q_pos = ring_positions(n, W, r, spec.layout, device=q.device)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        db = torch.zeros(bias.shape, dtype=acc, device=q.device) if need_b_tensor else None
        dparams = [torch.zeros_like(p) for p in bias_params] if need_params else None
        kv = (k.contiguous(), v.contiguous())  # p2p sends need contiguous buffers
        dkv_reqs, dkv_in = [], None
        for t in range(W):
            s = (r - t) % W
            reqs, nxt = _exchange(spec, kv) if t < W - 1 else ([], None)
            k_segs = local_segments(spec.layout, W, s, n)
            k_pos = ring_positions(n, W, s, spec.layout, device=q.device)
            dk_c = torch.zeros(k.shape, dtype=grad_dtype, device=q.device) if need_kv else None
            dv_c = torch.zeros(v.shape, dtype=grad_dtype, device=q.device) if need_kv else None
            for call in _plan_step(q_segs, k_segs, spec.causal):
                rows = slice(call.q_lo, call.q_hi)
                with torch.enable_grad() if need_params else torch.no_grad():
                    b, m, ranges = _tiles(spec, bias, mask, q_pos, k_pos, q_segs, k_segs, call)
                need_b = need_b_tensor or (need_params and b is not None and b.requires_grad)
                g_q, g_k, g_v, g_b = _step_grads(
                    spec, q[..., rows, :], kv[0][..., call.k_lo:call.k_hi, :],
                    kv[1][..., call.k_lo:call.k_hi, :], b, m, call.causal, out[..., rows, :], lse[..., rows],
                    d_out[..., rows, :], d_lse[..., rows], delta[..., rows], need_b)
                dq[..., rows, :] += g_q
                if need_kv:
                    dk_c[..., call.k_lo:call.k_hi, :] += g_k
                    dv_c[..., call.k_lo:call.k_hi, :] += g_v
                if need_b_tensor:
                    _add_tile(db, g_b, call.q_lo, call.q_hi, ranges)
                elif need_b:
                    gp = torch.autograd.grad(b, bias_params, g_b, allow_unused=True)
                    for acc_p, g in zip(dparams, gp):
                        if g is not None:
                            acc_p += g
            if need_kv:
                # The accumulator for this K/V block arrives from the previous holder; add, pass it on.
                _wait(dkv_reqs)
                if dkv_in is not None:
                    dk_c += dkv_in[0]
                    dv_c += dkv_in[1]
                if W > 1:
                    dkv_reqs, dkv_in = _exchange(spec, (dk_c, dv_c))
                else:
                    dkv_in = (dk_c, dv_c)
            _wait(reqs)
            if nxt is not None:
                kv = tuple(nxt)
        if need_kv:
            _wait(dkv_reqs)  # after W hops every accumulator is back with its owner
            dk, dv = dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)
        else:
            dk = dv = None
        grads = [None, dq.to(q.dtype), dk, dv,
                 None if db is None else db.to(bias.dtype), None]
        if bias_params:
            grads += [None if dparams is None else g for g in dparams]
        return tuple(grads)


def _attention_nograd(spec: _Spec, q, k, v, b, m, causal):
    from .api import attention

    with torch.no_grad():
        return attention(q, k, v, b, m, scale=spec.scale, causal=causal, return_lse=True, **spec.attn_kwargs)


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


def _agree(group, world: int, rank: int, error: Optional[str], meta) -> None:
    """All ranks exchange (error, meta); raise the same ValueError on every rank if any failed or differ."""
    if world == 1:
        if error:
            raise ValueError(f"ring_attention: {error}")
        return
    gathered = [None] * world
    dist.all_gather_object(gathered, (rank, error, meta), group=group)
    errors = [f"rank {g[0]}: {g[1]}" for g in gathered if g[1]]
    if errors:
        raise ValueError("ring_attention: bad input on " + "; ".join(errors))
    metas = [g[2] for g in gathered]
    if any(m != metas[0] for m in metas):
        detail = "; ".join(f"rank {g[0]}: {g[2]}" for g in gathered)
        raise ValueError(f"ring_attention: ranks disagree on shapes/options ({detail})")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, bias=None, mask: Optional[Tensor] = None, *,
                   group=None, causal: bool = False, layout: str = "contiguous", scale: Optional[float] = None,
                   backend: str = "auto", return_lse: bool = False, grad_dtype: Optional[torch.dtype] = None,
                   check: bool = True, **options):
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
        grad_dtype: dtype of the dK/dV accumulators that travel in the backward (default float32, float64 for
            float64 inputs; ``q.dtype`` halves that traffic and memory at low precision).
        check: exchange a validity flag and the shapes across ranks first, so that a rank with bad input makes
            every rank raise the same ValueError instead of hanging in a point-to-point op.

    Returns:
        out ``[*batch, H, n, Dv]`` in q's dtype (local rows), and with ``return_lse`` also lse.
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        world, rank, prev, nxt = 1, 0, 0, 0
    else:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        prev = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
        nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    bias_fn = None
    error, meta = None, None
    try:
        _check_layout(layout)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        _, _, scale = check_inputs(q, k, v, None, None, scale)
        if k.shape[-2] != q.shape[-2]:
            raise ValueError(f"ring_attention needs local q and k of the same length, got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}")
        n_total = q.shape[-2] * world
        local_segments(layout, world, rank, q.shape[-2])  # zigzag: even local length
        if callable(bias) and not isinstance(bias, torch.Tensor):
            bias_fn, bias = bias, None
        elif bias is not None:
            bias = _check_side("bias", bias, q, n_total, is_mask=False)
        if mask is not None:
            mask = _check_side("mask", mask, q, n_total, is_mask=True)
        meta = (tuple(q.shape), tuple(k.shape), tuple(v.shape), str(q.dtype), layout, causal, scale,
                None if bias is None else tuple(bias.shape), bias_fn is not None,
                None if mask is None else tuple(mask.shape), backend)
    except (TypeError, ValueError, NotImplementedError) as exc:
        if world == 1 or not check:
            raise
        error = f"{type(exc).__name__}: {exc}"
    if check:
        _agree(group, world, rank, error, meta)
    params = _fn_params(bias_fn) if bias_fn is not None else ()
    spec = _Spec(group=group, world=world, rank=rank, prev=prev, next=nxt, layout=layout, causal=causal,
                 scale=scale, attn_kwargs=dict(backend=backend, **options), bias_fn=bias_fn,
                 n_bias_params=len(params), grad_dtype=grad_dtype)
    out, lse = _RingAttention.apply(spec, q, k, v, bias, mask, *params)
    return (out, lse) if return_lse else out
