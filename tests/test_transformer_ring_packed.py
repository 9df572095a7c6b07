"""Packed rows in context-parallel mode: TransformerLM / TransformerBlock on gloo ranks (2 and 4, one
spawn each) with segment ids sharded like the tokens give the single-process model's logits and parameter
gradients on the full packed row (causal zigzag and bidirectional contiguous, RoPE restarting at each sequence,
relative-position bias), which equal the sequences run one by one; bad ids raise the same ValueError on every rank.
"""

import pytest
import torch
import torch.distributed as dist

from gloo_harness import spawn_gloo

from attn_ops.ring import shard_sequence
from attn_zoo.models.primitives import segment_positions
from attn_zoo.models.transformer import TransformerBlock, context_parallel_segment_positions
from test_packing import LENGTHS, pack
from test_transformer import _lm, _perturb_final_linears

WIDTH = 40  # sum(LENGTHS) = 34: 6 padding tokens at the end; divisible by 2W for W = 2 and 4 (zigzag)
ROW_ORDERS = [[0, 1, 2, 3, 4], [4, 2, 1, 0, 3]]  # two rows: sequences of LENGTHS in these orders
VOCAB = 11


def _packed_batch(seed):
    """tokens, segment ids [2, WIDTH] and the per-row sequences (odd lengths, a length-1 sequence, padding at the
    end; sequences cross rank boundaries in both layouts for W = 2 and 4)."""
    g = torch.Generator().manual_seed(seed)
    rows, ids, seqs = [], [], []
    for order in ROW_ORDERS:
        pieces = [torch.randint(0, VOCAB, (LENGTHS[i],), generator=g) for i in order]
        row, row_ids, pad = pack(pieces, WIDTH)
        rows.append(torch.cat([row, torch.zeros(pad, dtype=torch.long)]))
        ids.append(row_ids)
        seqs.append(pieces)
    return torch.stack(rows), torch.stack(ids), seqs


def test_packed_rows_cross_rank_boundaries():
    """The fixture is what the distributed test claims: for every world size and layout some sequence spans two
    ranks, one has length 1, and every row ends with padding."""
    _, ids, _ = _packed_batch(0)
    assert (ids[:, -1] < 0).all() and 1 in LENGTHS and any(n % 2 for n in LENGTHS)
    for world in (2, 4):
        for layout in ("zigzag", "contiguous"):
            full_owner = torch.empty(2, WIDTH, dtype=torch.long)  # the rank holding each natural position
            for r in range(world):
                pos = shard_sequence(torch.arange(WIDTH)[None].expand(2, -1), 1, world, r, layout)
                full_owner[:, pos[0]] = r
            crossing = (ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0) & (full_owner[:, 1:] != full_owner[:, :-1])
            assert crossing.any(), (world, layout)
    assert torch.equal(context_parallel_segment_positions(ids, None), segment_positions(ids))


def _check_lm(rank, world, causal, layout, checkpoint=False):
    group = dist.group.WORLD
    kw = dict(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, causal=causal, rel_pos_bias=True,
              attention="chunked", layout=layout, checkpoint=checkpoint,
              ring_options={"kv_parts": 2} if causal else None)
    single = _perturb_final_linears(_lm(seed=21, **kw))
    cp = _perturb_final_linears(_lm(seed=21, process_group="world" if causal else group, **kw))
    tokens, ids, seqs = _packed_batch(22)
    weight = torch.randn(2, WIDTH, VOCAB, generator=torch.Generator().manual_seed(23), dtype=torch.float64)
    weight[ids < 0] = 0  # padding is not scored (so the sequences alone get the same loss)
    shard = lambda t: shard_sequence(t, 1, world, rank, layout)  # noqa: E731

    # the single-process packed row equals the sequences run one by one (test_packing checks this too)
    ref = single(tokens, segment_ids=ids)
    (ref * weight).sum().backward()
    alone_grads = [torch.zeros_like(p) for p in single.parameters()]
    for b, pieces in enumerate(seqs):
        at = 0
        for s in pieces:
            alone = single(s[None])
            assert torch.allclose(ref[b, at:at + len(s)], alone[0], rtol=0, atol=1e-10)
            gs = torch.autograd.grad((alone * weight[b:b + 1, at:at + len(s)]).sum(), list(single.parameters()))
            alone_grads = [a + g for a, g in zip(alone_grads, gs)]
            at += len(s)
    for (name, p), g in zip(single.named_parameters(), alone_grads):
        assert torch.allclose(p.grad, g, rtol=1e-9, atol=1e-10), f"single vs alone {name}"

    # this rank's RoPE positions restart at each sequence of the whole row (sequences start on other ranks)
    ids_loc = shard(ids)
    pos_loc = context_parallel_segment_positions(ids_loc, group, layout)
    assert torch.equal(pos_loc, shard(segment_positions(ids))), (rank, pos_loc)

    # context parallel, as the training step calls it: shard_batch (default keys) then net(tokens, pad_mask, ids, pos)
    batch = {"tokens": tokens, "pad_mask": ids >= 0, "segment_ids": ids, "positions": segment_positions(ids),
             "weight": weight}
    local = cp.shard_batch(batch)
    assert torch.equal(local["segment_ids"], ids_loc) and torch.equal(local["positions"], pos_loc)
    out = cp(local["tokens"], local["pad_mask"], segment_ids=local["segment_ids"], positions=local["positions"])
    out_default = cp(shard(tokens), segment_ids=ids_loc)  # positions computed from the gathered ids
    assert torch.equal(out_default, out)
    (out * shard(weight)).sum().backward()
    err = (out - shard(ref.detach())).abs().max().item()
    assert err <= 1e-10, f"logits (world {world}, rank {rank}, causal={causal}, {layout}): error {err:.3e}"
    for (name, p), q in zip(cp.named_parameters(), single.parameters()):
        total = p.grad.clone()
        dist.all_reduce(total)  # replicated parameters: the gradient is the sum over ranks
        assert torch.allclose(total, q.grad, rtol=1e-9, atol=1e-10), f"{name}: {(total - q.grad).abs().max():.3e}"
    table = [p.grad for n, p in single.named_parameters() if n.endswith("rel_bias.table.weight")]
    assert table and table[0].abs().sum() > 0


def _check_block(rank, world):
    """The block alone: segment ids and restarting positions as this rank's shards."""
    group, layout = dist.group.WORLD, "zigzag"
    torch.manual_seed(31)
    single = TransformerBlock(32, 4, causal=True, rel_pos_bias=True, attention="chunked").double()
    cp = TransformerBlock(32, 4, causal=True, rel_pos_bias=True, attention="chunked", process_group=group,
                          layout=layout).double()
    _perturb_final_linears(single)
    cp.load_state_dict(single.state_dict())
    _, ids, _ = _packed_batch(32)
    x = torch.randn(2, WIDTH, 32, generator=torch.Generator().manual_seed(33), dtype=torch.float64)
    shard = lambda t: shard_sequence(t, 1, world, rank, layout)  # noqa: E731
    ref = single(x, positions=segment_positions(ids), segment_ids=ids)
    ids_loc = shard(ids)
    out = cp(shard(x), positions=context_parallel_segment_positions(ids_loc, group, layout), segment_ids=ids_loc)
    assert torch.allclose(out, shard(ref), rtol=0, atol=1e-10), (out - shard(ref)).abs().max()
    with pytest.raises(ValueError, match="segment_ids"):  # the ring names the argument, on every rank alike
        cp(shard(x), segment_ids=ids)


def _raises_everywhere(fn, *patterns):
    try:
        fn()
    except ValueError as exc:
        for p in patterns:
            assert p in str(exc), (p, str(exc))
    else:
        raise AssertionError(f"no ValueError (expected {patterns})")


def _check_bad_ids(rank, world):
    layout = "zigzag"
    net = _lm(seed=41, causal=True, process_group=dist.group.WORLD, layout=layout)
    tokens, ids, _ = _packed_batch(42)
    shard = lambda t: shard_sequence(t, 1, world, rank, layout)  # noqa: E731
    t_loc, n = shard(tokens), WIDTH // world
    # the whole row's ids instead of this rank's shard: named, with both shapes
    _raises_everywhere(lambda: net(t_loc, segment_ids=ids), "segment_ids", f"(2, {n})", f"(2, {WIDTH})")
    _raises_everywhere(lambda: net(t_loc, segment_ids=shard(ids).double()), "segment_ids", "integer")
    # one rank alone is wrong: every rank raises (no hang), naming it
    bad = shard(ids)[:, :-1] if rank == world - 1 else shard(ids)
    _raises_everywhere(lambda: net(t_loc, segment_ids=bad), "segment_ids", f"rank {world - 1}",
                       f"(2, {n - 1})")
    # positions must be this rank's shard too
    _raises_everywhere(lambda: net(t_loc, segment_ids=shard(ids), positions=segment_positions(ids)), "positions",
                       f"(2, {WIDTH})")
    # a sequence that comes back after another one started (on another rank): the whole row is checked
    back = ids.clone()
    back[0, -1] = 0
    _raises_everywhere(lambda: net(t_loc, segment_ids=shard(back)), "segment_ids", "contiguous")
    # ids sharded with the other layout make some sequence non-contiguous in natural order
    _raises_everywhere(lambda: net(t_loc, segment_ids=shard_sequence(ids, 1, world, rank, "contiguous")),
                       "segment_ids", "contiguous", "layout='zigzag'")
    net(t_loc, segment_ids=shard(ids))  # and the group still works afterwards


def _packed_checks(rank, world):
    _check_lm(rank, world, causal=True, layout="zigzag")
    _check_lm(rank, world, causal=False, layout="contiguous", checkpoint=world == 2)
    _check_block(rank, world)
    _check_bad_ids(rank, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_packed_lm_matches_single_process(world):
    spawn_gloo(_packed_checks, world)
