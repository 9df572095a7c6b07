"""Ring attention's plan (attn_ops/ring_plan.py) without a process group: shard maps, the step schedule that
every rank follows, what it sends to whom and when, and the skipping of packed-row calls.

The schedule tests run every rank's schedule side by side over a simulated ring: at each step index every
rank's posted send must be exactly what its neighbour receives (same owner, same rows), every part a rank
computes must be present, nothing freed may be used again, and every backward contribution must reach the
owner of its rows once from each other rank.
"""

import pytest
import torch

from attn_ops.ring_plan import (Part, block_parts, call_keys, check_layout, ids_meet, local_segments, plan_part,
                                ring_positions, ring_schedule, shard_sequence, split_rows, unshard_sequence)

CASES = [(layout, world, n, parts) for layout in ("contiguous", "zigzag") for world in (1, 2, 3, 4)
         for n, parts in ((8, 1), (8, 2), (12, 3))]


def test_layouts_partition_the_sequence():
    for layout in ("contiguous", "zigzag"):
        for world in (1, 2, 4):
            n = 6
            pos = torch.cat([ring_positions(n, world, r, layout) for r in range(world)])
            assert torch.equal(pos.sort().values, torch.arange(n * world)), (layout, world)
            x = torch.arange(3 * n * world).reshape(3, n * world)
            shards = [shard_sequence(x, 1, world, r, layout) for r in range(world)]
            for r in range(world):  # a shard holds the columns at its rank's positions, in local order
                assert torch.equal(shards[r][0], ring_positions(n, world, r, layout))
            assert torch.equal(unshard_sequence(shards, 1, layout), x)
    with pytest.raises(ValueError, match="layout must be one of"):
        check_layout("striped")
    with pytest.raises(ValueError, match="even local length"):
        local_segments("zigzag", 2, 0, 5)
    with pytest.raises(ValueError, match="not divisible by world"):
        shard_sequence(torch.zeros(2, 7), 1, 2, 0)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_block_parts_cover_the_block_in_segments(layout):
    world, n = 3, 12
    for r in range(world):
        pos = ring_positions(n, world, r, layout)
        for kv_parts in (1, 2, 5, 6):
            parts = block_parts(layout, world, r, n, kv_parts)
            assert [p.lo for p in parts] == [0] + [p.hi for p in parts[:-1]] and parts[-1].hi == n
            for p in parts:  # a part never crosses a segment: its positions are contiguous from its start
                assert torch.equal(pos[p.lo:p.hi], torch.arange(p.start, p.start + p.hi - p.lo))
            assert len(parts) == kv_parts * len(local_segments(layout, world, r, n))


def test_split_rows_keeps_the_causal_alignment():
    """Chunks of a bottom-right aligned causal call see exactly the keys the whole call gave their rows."""
    part = Part(0, 10, 0)
    call = plan_part([(4, 6)], Part(0, 6, 4), True)[0]  # 6 query rows at positions 4..9 vs keys 4..9
    full = torch.ones(6, call_keys(call, part)).tril(call_keys(call, part) - 6)
    for q_chunk in (1, 2, 4, 6):
        got = torch.zeros_like(full)
        for c in split_rows([call], part, q_chunk):
            kl, nq = call_keys(c, part), c.q_hi - c.q_lo
            got[c.q_lo:c.q_hi, :kl] += torch.ones(nq, kl).tril(kl - nq)
        assert torch.equal(got, full), q_chunk


def _simulate(layout, world, n, kv_parts):
    """Run every rank's schedule over a simulated ring; returns the largest number of received parts any rank held
    at once and each rank's received backward contributions."""
    plans = [ring_schedule(layout, world, r, n, kv_parts) for r in range(world)]
    assert len({p.steps for p in plans}) == 1, "every rank must post its exchanges at the same step indices"
    held = [dict() for _ in range(world)]  # (t, p) -> (owner, Part) of what a rank holds
    freed = [set() for _ in range(world)]
    peak = 0
    got = [[] for _ in range(world)]  # backward: (from rank, own part) received
    for i in range(len(plans[0].steps)):
        posts = []
        for r, plan in enumerate(plans):
            nxt = plan.prefetch(i)
            if nxt is None:
                posts.append(None)
                continue
            st, sp = plan.sends(*nxt)
            sent = (r, plan.wire[0][sp]) if st == 0 else held[r][st, sp]
            posts.append((nxt, sent))
        for r, plan in enumerate(plans):  # what rank r computes at step i
            t, p = plan.steps[i]
            want = (plan.owner(t), plan.part(i))
            have = (r, plan.part(i)) if t == 0 else held[r].get((t, p))
            assert have == want, (i, r, have, want)
            assert t == 0 or (t, p) not in freed[r]
            c = plan.contribution(i)
            if c is not None:
                to, frm, own = c
                # the owner of the rows receives at the same step index from this rank, into the same rows
                assert to == plan.owner(t) and plans[to].contribution(i)[1] == r
                assert plans[to].contribution(i)[2] == plan.wire[t][p]
                got[to].append((r, own))
        for r, plan in enumerate(plans):  # rank r receives what rank r - 1 posted at this index
            if posts[r] is not None:
                nxt, _ = posts[r]
                src_nxt, sent = posts[(r - 1) % world]
                assert src_nxt == nxt
                assert sent == (plan.owner(nxt[0]), plan.wire[nxt[0]][nxt[1]]), (i, r, sent)
                held[r][nxt] = sent
                peak = max(peak, len(held[r]))
            for done in plan.freed_after(i):
                held[r].pop(done)
                freed[r].add(done)
    for r in range(world):
        assert not held[r], f"rank {r} still holds {sorted(held[r])} after the last step"
    return peak, got


@pytest.mark.parametrize("layout,world,n,kv_parts", CASES)
def test_schedule_sends_what_each_neighbour_computes_next(layout, world, n, kv_parts):
    peak, got = _simulate(layout, world, n, kv_parts)
    per_block = kv_parts * (2 if layout == "zigzag" else 1)
    if world == 2:  # the part being computed and the one arriving, never a whole block
        assert peak <= min(2, per_block), peak
    else:  # plus the previous block, forwarded one part at a time
        assert peak <= per_block + 1, peak
    for r in range(world):  # each own part gets one dK/dV contribution from every other rank
        own = block_parts(layout, world, r, n, kv_parts)
        want = sorted((s, p.lo) for s in range(world) if s != r for p in own)
        assert sorted((s, p.lo) for s, p in got[r]) == want


def test_schedule_visits_own_block_first_in_whole_segments():
    plan = ring_schedule("zigzag", 4, 1, 8, 2)
    assert plan.steps[:2] == ((0, 0), (0, 1)) and plan.part(0) == Part(0, 4, 4) and plan.part(1) == Part(4, 8, 24)
    assert plan.prefetch(0) is None  # step 1 is local: nothing to receive
    assert plan.prefetch(1) == (1, 0) and plan.sends(1, 0) == (0, 0)  # own rows go to rank 2
    assert plan.owner(1) == 0 and plan.owner(3) == 2
    assert plan.contribution(0) is None and plan.contribution(2) == (0, 2, plan.wire[0][0])
    assert len(plan.steps) == 2 + 3 * 4


def test_ids_meet_skips_only_calls_whose_segments_cannot_meet():
    q = torch.tensor([[0, 0, 1, 1], [3, 3, 3, 3]])
    assert ids_meet(q, torch.tensor([[1, 2], [5, 5]]))  # row 0 shares id 1
    assert not ids_meet(q, torch.tensor([[2, 2], [4, 5]]))
    assert not ids_meet(q, torch.tensor([[-1, -1], [-1, -1]]))  # padding keys meet nothing
    assert not ids_meet(torch.full((2, 4), -1), torch.tensor([[0, 0], [3, 3]]))  # padding queries too
    assert ids_meet(torch.tensor([[-1, 2]]), torch.tensor([[2, -1]]))
