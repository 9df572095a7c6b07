"""Ring attention planning: pure functions of (layout, world size, rank, local length), no communication.

Which global positions each rank holds (the layouts and their shard maps), how a K/V block is cut into the parts
that travel around the ring, which attention calls one part needs on a rank (causal alignment, query chunks),
whether packed-row segment ids let a call be skipped, and the step schedule: what every rank computes, sends
and frees at each step of the forward and what dK/dV contribution it sends in the backward. ``ring.py`` runs
this plan over a process group; everything here is checked without one (``tests/test_ring_plan.py``).

Layouts (positions of the local shard in the full sequence):
    ``contiguous``: rank r holds ``[r n, (r+1) n)``.
    ``zigzag``: the sequence is cut in 2W chunks of ``c = n / 2``; rank r holds chunks r and 2W-1-r, so
    causal work is the same on every rank. :func:`zigzag_split` / :func:`zigzag_merge` convert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor
LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------------------------------
# Layouts and shard maps
# ----------------------------------------------------------------------------------------------------
def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def local_segments(layout: str, world: int, rank: int, n_local: int) -> List[Tuple[int, int]]:
    """``[(global_start, length), ...]`` of the local shard, in local order."""
    check_layout(layout)
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
    if check_layout(layout) == "zigzag":
        return zigzag_split(x, dim, world, rank)
    if x.shape[dim] % world:
        raise ValueError(f"shard_sequence: x.shape[{dim}] = {x.shape[dim]} is not divisible by world = {world}")
    return x.chunk(world, dim)[rank].contiguous()


def unshard_sequence(shards: Sequence[Tensor], dim: int, layout: str = "contiguous") -> Tensor:
    """Inverse of :func:`shard_sequence` given every rank's shard."""
    if check_layout(layout) == "zigzag":
        return zigzag_merge(shards, dim)
    return torch.cat(list(shards), dim)


# ----------------------------------------------------------------------------------------------------
# Planning: the K/V parts that visit a rank, and the attention calls one part needs
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    lo: int  # local rows [lo, hi) of the owner's K/V block
    hi: int
    start: int  # global position of row lo (a part never crosses a segment, so it is contiguous)


@dataclass(frozen=True)
class Call:
    q_lo: int  # local query rows [q_lo, q_hi)
    q_hi: int
    causal: bool  # bottom-right aligned: query i sees part key j iff j <= i + (Lk - Lq)
    k_len: Optional[int] = None  # use only the part's first k_len keys (None: all)


def block_parts(layout: str, world: int, rank: int, n_local: int, kv_parts: int) -> List[Part]:
    """Rank ``rank``'s K/V block cut into parts: every segment split into ``kv_parts`` near-equal pieces."""
    parts, pos = [], 0
    for start, length in local_segments(layout, world, rank, n_local):
        cuts = [length * i // kv_parts for i in range(kv_parts + 1)]
        for a, b in zip(cuts[:-1], cuts[1:]):
            if b > a:
                parts.append(Part(pos + a, pos + b, start + a))
        pos += length
    return parts


def split_rows(calls: List[Call], part: Part, q_chunk: Optional[int]) -> List[Call]:
    """Cut every call into calls of at most ``q_chunk`` query rows (smaller per-call temporaries).

    A bottom-right aligned causal call keeps its alignment: rows [s, e) of a call with Lq rows and kl keys
    need the first ``e + kl - Lq`` keys.
    """
    if not q_chunk:
        return calls
    out = []
    for c in calls:
        nq = c.q_hi - c.q_lo
        kl = part.hi - part.lo if c.k_len is None else c.k_len
        for s in range(0, nq, q_chunk):
            e = min(nq, s + q_chunk)
            if c.causal:
                out.append(Call(c.q_lo + s, c.q_lo + e, True, e + kl - nq))
            else:
                out.append(Call(c.q_lo + s, c.q_lo + e, False, c.k_len))
    return out


def plan_part(q_segs, part: Part, causal: bool) -> List[Call]:
    """Attention calls of the local queries (segments ``(global_start, length)`` in local order) against one
    contiguous K/V part. Non-causal: one call over all rows. Causal, per query segment: rows before the part
    see nothing; rows inside it see the part's keys up to themselves (one bottom-right aligned causal call
    over the keys before them); rows after it see the whole part. Adjacent whole-part calls are merged.
    """
    k0, k1 = part.start, part.start + part.hi - part.lo
    total = sum(n for _, n in q_segs)
    if not causal:
        return [Call(0, total, False)]
    calls: List[Call] = []
    pos = 0
    for qs, qn in q_segs:
        qe = qs + qn
        o0, o1 = max(qs, k0), min(qe, k1)  # query rows at positions inside the part
        if o0 < o1:
            # rows [o0, o1) vs part keys [k0, o1) (later keys are in their future): query i sees k0 + j iff
            # k0 + j <= o0 + i, i.e. j <= i + (o1 - k0) - (o1 - o0): bottom-right aligned causal.
            calls.append(Call(pos + o0 - qs, pos + o1 - qs, True, o1 - k0))
        a = max(qs, k1)  # rows after the part see all of it
        if a < qe:
            lo, hi = pos + a - qs, pos + qn
            if calls and not calls[-1].causal and calls[-1].q_hi == lo and calls[-1].k_len is None:
                calls[-1] = Call(calls[-1].q_lo, hi, False)
            else:
                calls.append(Call(lo, hi, False))
        pos += qn
    return calls



def call_keys(call: Call, part: Part) -> int:
    """How many of the part's keys (its first ones) the call reads."""
    return part.hi - part.lo if call.k_len is None else call.k_len


# ----------------------------------------------------------------------------------------------------
# Packed rows: whether a call can be skipped
# ----------------------------------------------------------------------------------------------------
def id_range(ids: Tensor) -> Tuple[Tensor, Tensor]:
    """(smallest, largest) non-negative id of every row of ``ids`` ``[*batch, n]``; a row of padding only (all
    ids negative) gives (2**62, -1), a range that meets nothing."""
    valid = ids >= 0
    return (torch.where(valid, ids, torch.full_like(ids, 2 ** 62)).amin(-1),
            torch.where(valid, ids, torch.full_like(ids, -1)).amax(-1))


def ids_meet(q_ids: Tensor, k_ids: Tensor) -> bool:
    """Whether some batch row's query id range meets its key id range (``[*batch, nq]``, ``[*batch, nk]``).

    With contiguous segments a query and a key of one row can share an id only if the ranges overlap, so False
    means the call attends nothing and is skipped; True may still hold calls with no common id (they run).
    """
    (q_lo, q_hi), (k_lo, k_hi) = id_range(q_ids), id_range(k_ids)
    return bool(((q_lo <= k_hi) & (k_lo <= q_hi)).any())


# ----------------------------------------------------------------------------------------------------
# The step schedule: what a rank computes, receives, sends and frees at every step
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RingSchedule:
    """One rank's walk over the K/V blocks of a ring of ``world`` ranks.

    Step i computes ``steps[i] = (t, p)``: part p of block t, the K/V of rank ``rank - t`` (block 0 is this
    rank's own). Block 0 needs no communication and is computed one whole segment at a time (``local``); every
    other block travels in ``kv_parts`` parts per segment (``wire[t]``, the same cut on every rank for a given
    owner). Before step i computes, the exchange that brings step i+1's part is posted (:meth:`prefetch`): every
    rank sends to rank + 1 what it will need (:meth:`sends`) and receives its own from rank - 1, at the same step
    index on every rank, so the pairing is symmetric (no deadlock under in-order point-to-point) and a part is sent
    just before its receiver needs it. In the backward, step i with t > 0 also returns the dK/dV of its part to the
    owner (:meth:`contribution`).
    """

    world: int
    rank: int
    wire: Tuple[Tuple[Part, ...], ...]  # wire[t]: the parts block t travels in
    local: Tuple[Part, ...]  # block 0 as computed: one part per segment
    steps: Tuple[Tuple[int, int], ...]  # (block t, part p) in compute order

    def owner(self, t: int) -> int:
        """The rank whose K/V is block t."""
        return (self.rank - t) % self.world

    def part(self, i: int) -> Part:
        t, p = self.steps[i]
        return (self.local if t == 0 else self.wire[t])[p]

    def prefetch(self, i: int) -> Optional[Tuple[int, int]]:
        """(t, p) received from rank - 1 while step i computes: step i+1's part, or None (no step i+1, or it is
        this rank's own K/V)."""
        if i + 1 >= len(self.steps) or self.steps[i + 1][0] == 0:
            return None
        return self.steps[i + 1]

    @staticmethod
    def sends(t: int, p: int) -> Tuple[int, int]:
        """(block, part) sent to rank + 1 while receiving (t, p): rank + 1 needs at block t what this rank had at
        block t - 1 (block 0: its own rows ``wire[0][p]``)."""
        return t - 1, p

    def freed_after(self, i: int) -> List[Tuple[int, int]]:
        """Received parts (t >= 1) that no later step needs once step i has computed and step i+1's part has
        arrived: the one forwarded by that exchange, and step i's own part when its block is the last one (never
        forwarded)."""
        out = []
        nxt = self.prefetch(i)
        if nxt is not None and nxt[0] - 1 > 0:
            out.append(self.sends(*nxt))
        t, p = self.steps[i]
        if t == self.world - 1 and t > 0:
            out.append((t, p))
        return out

    def contribution(self, i: int) -> Optional[Tuple[int, int, Part]]:
        """Backward of step i (t > 0): (rank the part's dK/dV goes to, rank whose contribution to this rank's own
        part arrives, that own part ``wire[0][p]``); None for this rank's own block."""
        t, p = self.steps[i]
        if t == 0:
            return None
        return (self.rank - t) % self.world, (self.rank + t) % self.world, self.wire[0][p]


def ring_schedule(layout: str, world: int, rank: int, n_local: int, kv_parts: int) -> RingSchedule:
    """The :class:`RingSchedule` of rank ``rank`` with ``n_local`` rows per rank, segments cut in ``kv_parts``."""
    wire = tuple(tuple(block_parts(layout, world, (rank - t) % world, n_local, kv_parts)) for t in range(world))
    local = tuple(block_parts(layout, world, rank, n_local, 1))
    counts = [len(local)] + [len(w) for w in wire[1:]]
    steps = tuple((t, p) for t in range(world) for p in range(counts[t]))
    return RingSchedule(world, rank, wire, local, steps)
