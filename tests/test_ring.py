"""Ring attention on gloo (2 and 4 CPU processes) against single-process attention.

One ``torch.multiprocessing.spawn`` per world size runs every case; each rank builds the same full
inputs from a shared seed, runs the ring on its shard, and compares its shard of the output, lse and of
every gradient (q, k, v, bias tensor, bias-module parameters) with the float64 single-process result.
"""

import pytest
import torch
import torch.distributed as dist

from gloo_harness import spawn_gloo

from attn_ops import registry
from attn_ops.reference import attention_reference
from attn_ops.ring import (block_parts, local_segments, plan_part, ring_attention, ring_positions, shard_sequence,
                           split_rows, unshard_sequence, zigzag_merge, zigzag_split)


class RelBias(torch.nn.Module):
    """A learned per-head table indexed by clamped relative distance (enough to exercise the callable path)."""

    def __init__(self, heads, max_dist):
        super().__init__()
        self.max_dist = max_dist
        self.table = torch.nn.Parameter(torch.randn(heads, 2 * max_dist + 1, dtype=torch.float64))

    def forward(self, q_pos, k_pos):
        rel = (k_pos[None, :] - q_pos[:, None]).clamp(-self.max_dist, self.max_dist) + self.max_dist
        return self.table[:, rel]  # [H, Lq, Lk]


CASES = [
    # name, causal, layout, bias kind, mask kind, dtype, loss on lse
    ("plain", False, "contiguous", None, None, torch.float64, False),
    ("causal_zigzag_bias_keymask", True, "zigzag", "full", "keys", torch.float64, True),
    ("causal_contiguous_rowmask", True, "contiguous", None, "rows", torch.float64, False),
    ("keybias_broadcast_zigzag", False, "zigzag", "keys", "keys", torch.float64, True),
    ("headbias_rows_causal", True, "zigzag", "rows", None, torch.float64, False),
    ("module_bias_causal", True, "zigzag", "module", "keys", torch.float64, True),
    ("dead_rows", False, "contiguous", "full", "dead", torch.float64, True),
    ("fp32_causal_bias", True, "zigzag", "full", "keys", torch.float32, True),
    ("querybias_cols_broadcast", True, "zigzag", "queries", None, torch.float64, False),
    ("msa_rows_5d_value_dim", True, "zigzag", "shared5d", "keys5d", torch.float64, True),
]


def _inputs(case, world, seed):
    name, causal, layout, bias_kind, mask_kind, dtype, lse_loss = case
    g = torch.Generator().manual_seed(seed)
    B, H, L, D = 2, 2, 8 * world, 8
    lead = (B, 3) if name.startswith("msa") else (B,)  # [B, R, H, L, D] like Evoformer rows
    Dv = 5 if name.startswith("msa") else D  # a value head dim of its own
    q, k = (torch.randn(*lead, H, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(*lead, H, L, Dv, generator=g, dtype=torch.float64)
    bias = {
        None: None,
        "full": torch.randn(B, H, L, L, generator=g, dtype=torch.float64),
        "keys": torch.randn(1, H, 1, L, generator=g, dtype=torch.float64) * 3,  # uneven per-key offsets
        "rows": torch.randn(1, 1, L, L, generator=g, dtype=torch.float64).triu() * 2,  # asymmetric pattern
        "queries": torch.randn(B, H, L, 1, generator=g, dtype=torch.float64),  # one value per query row
        "shared5d": torch.randn(B, 1, H, L, L, generator=g, dtype=torch.float64),  # shared by the R rows
        "module": None,
    }[bias_kind]
    mask = {
        None: None,
        "keys": torch.rand(B, 1, 1, L, generator=g) > 0.3,
        "rows": torch.rand(B, 1, L, L, generator=g) > 0.3,
        "dead": torch.rand(B, 1, L, L, generator=g) > 0.3,
        "keys5d": torch.rand(B, 3, 1, 1, L, generator=g) > 0.3,
    }[mask_kind]
    if mask_kind == "dead":
        mask[:, :, 3] = False  # query row 3 sees nothing: out 0, lse -inf, zero grads
    if mask is not None and mask_kind != "dead":
        mask[..., 0] = True  # every row keeps a key, so the float64 comparison is well defined
    do = torch.randn(*lead, H, L, Dv, generator=g, dtype=torch.float64)
    dl = torch.randn(*lead, H, L, generator=g, dtype=torch.float64) if lse_loss else None
    module = RelBias(H, 5) if bias_kind == "module" else None
    if module is not None:
        with torch.no_grad():
            module.table.copy_(torch.randn(module.table.shape, generator=g, dtype=torch.float64))
    return q, k, v, bias, mask, do, dl, module


def _loss(out, lse, do, dl):
    loss = (out.double() * do).sum()
    if dl is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse.double(), torch.zeros_like(lse.double())) * dl).sum()
    return loss


def _reference(case, world, seed):
    """Single-process float64 attention on the full sequence: out, lse and gradients."""
    causal = case[1]
    q, k, v, bias, mask, do, dl, module = _inputs(case, world, seed)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    if bias is not None:
        bias.requires_grad_()
    L = q.shape[-2]
    pos = torch.arange(L)
    full_bias = module(pos, pos) if module is not None else bias
    out, lse = attention_reference(q, k, v, full_bias, mask, None, causal)
    _loss(out, lse, do, dl).backward()
    grads = [t.grad for t in leaves] + [None if bias is None else bias.grad,
                                        None if module is None else module.table.grad]
    return out.detach(), lse.detach(), grads


def _check_case(case, world, rank, seed, backend="chunked", kv_parts=1, q_chunk=None):
    name, causal, layout, bias_kind, mask_kind, dtype, lse_loss = case
    out_ref, lse_ref, g_ref = _reference(case, world, seed)
    q, k, v, bias, mask, do, dl, module = _inputs(case, world, seed)
    shard = lambda t, dim=-2: shard_sequence(t, dim, world, rank, layout)  # noqa: E731
    ql, kl, vl = (shard(t).to(dtype).requires_grad_() for t in (q, k, v))
    bl = None
    if bias is not None:
        bl = (shard(bias) if bias.shape[-2] > 1 else bias.clone()).requires_grad_()
    ml = None if mask is None else (shard(mask) if mask.shape[-2] > 1 else mask)
    strided = lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)  # noqa: E731 (non-contiguous view)
    out, lse = ring_attention(ql, strided(kl), strided(vl), module if module is not None else bl, ml, causal=causal,
                              layout=layout, return_lse=True, backend=backend, kv_parts=kv_parts,
                              q_chunk=q_chunk)
    _loss(out, lse, shard(do).to(dtype), None if dl is None else shard(dl, -1)).backward()
    # float64: rounding only. float32: a few times plain float32 PyTorch's own error on these inputs.
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    checks = [("out", out, shard(out_ref)), ("lse", lse, shard(lse_ref, -1)),
              ("dq", ql.grad, shard(g_ref[0])), ("dk", kl.grad, shard(g_ref[1])), ("dv", vl.grad, shard(g_ref[2]))]
    if bias is not None:
        ref_db = shard(g_ref[3]) if bias.shape[-2] > 1 else None
        if ref_db is None:  # broadcast rows: each rank holds the gradient of its own rows; their sum is the total
            total = bl.grad.clone()
            dist.all_reduce(total)
            checks.append(("dbias(sum over ranks)", total, g_ref[3]))
        else:
            checks.append(("dbias", bl.grad, ref_db))
    if module is not None:
        total = module.table.grad.clone()
        dist.all_reduce(total)
        checks.append(("dtable(sum over ranks)", total, g_ref[4]))
    for what, got, ref in checks:
        got, ref = got.double(), ref.double()
        assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), f"{name}: {what} inf pattern differs"
        got, ref = torch.nan_to_num(got, neginf=0.0), torch.nan_to_num(ref, neginf=0.0)
        err = (got - ref).abs().max().item()
        scale = ref.abs().max().item() + 1e-30
        assert err <= tol * max(scale, 1.0), f"{name} (world {world}, rank {rank}): {what} error {err:.3e}"
    if mask_kind == "dead":
        assert not torch.isnan(ql.grad).any()


def _check_bad_input(world, rank):
    """Rank 1 passes a wrong-length k: every rank must raise the same ValueError naming rank 1, not hang."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 5 if rank == 1 else 4, 8, dtype=torch.float64)
    try:
        ring_attention(q, k, torch.randn_like(k), causal=True, layout="zigzag")
    except ValueError as exc:
        assert "rank 1" in str(exc) and "(1, 2, 5, 8)" in str(exc), str(exc)
    else:
        raise AssertionError("bad input on rank 1 did not raise")
    # Ranks that disagree on options (one causal, one not) also fail together.
    try:
        ring_attention(q, torch.randn_like(q), torch.randn_like(q), causal=(rank == 0))
    except ValueError as exc:
        assert "disagree" in str(exc), str(exc)
    else:
        raise AssertionError("ranks that disagree on causal did not raise")


def _packed_ids(B, L):
    """Long [B, L]: row 0 packs 4 documents of odd lengths (one of length 1) and ends in padding, row 1 holds 4
    of a quarter of the row each (the last one 2 shorter, then padding)."""
    ids = torch.full((B, L), -1, dtype=torch.long)
    for b, lens in enumerate(([5, 1, L // 3, L // 4], [L // 4] * 3 + [L // 4 - 2])[:B]):
        pos = 0
        for i, n in enumerate(lens):
            ids[b, pos:pos + n] = i
            pos += n
    return ids


def _check_packed(world, rank, seed, causal, layout, backend, with_bias):
    """Packed rows over the ring (segment_ids sharded like q) == the float64 reference on the full sequence; the
    reference with ids equals the sequences one by one (tests/test_segments.py). Calls whose ids cannot meet are
    skipped: fewer attention calls than without ids."""
    import attn_ops.ring as ring_mod
    from attn_ops.inputs import check_segment_ids

    g = torch.Generator().manual_seed(seed)
    B, H, L, D = 2, 2, 8 * world, 8
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    bias = torch.randn(B, H, L, L, generator=g, dtype=torch.float64).requires_grad_() if with_bias else None
    ids = _packed_ids(B, L)
    do = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    dl = torch.randn(B, H, L, generator=g, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, bias, None, None, causal, segment_ids=check_segment_ids(ids, q, k))
    leaves = [t for t in (q, k, v, bias) if t is not None]
    ref = torch.autograd.grad(_loss(out, lse, do, dl), leaves)
    shard = lambda t, dim=-2: shard_sequence(t, dim, world, rank, layout)  # noqa: E731
    local = [shard(t.detach()).requires_grad_() for t in leaves]
    calls = []
    real = ring_mod._attention
    ring_mod._attention = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        o, l = ring_attention(*local[:3], local[3] if with_bias else None, causal=causal, layout=layout,
                              return_lse=True, backend=backend, segment_ids=shard(ids, -1), kv_parts=2)
        got = torch.autograd.grad(_loss(o, l, shard(do), shard(dl, -1)), local)
        n_packed = len(calls)
        ring_attention(*[t.detach() for t in local[:3]], causal=causal, layout=layout, backend=backend, kv_parts=2)
        n_dense = len(calls) - n_packed
    finally:
        ring_mod._attention = real
    counts = torch.tensor([n_packed, n_dense])
    dist.all_reduce(counts)
    assert counts[0] < counts[1], counts.tolist()
    for what, a, r in [("out", o, shard(out)), ("lse", l, shard(lse, -1))] + [
            (f"d{n}", a, shard(r)) for n, a, r in zip("q k v bias".split(), got, ref)]:
        a, r = a.detach(), r.detach()
        assert torch.equal(torch.isfinite(a), torch.isfinite(r)), f"packed {layout}: {what} inf pattern differs"
        err = (torch.nan_to_num(a, neginf=0.0) - torch.nan_to_num(r, neginf=0.0)).abs().max().item()
        assert err <= 1e-10, f"packed {layout} causal={causal} (world {world}, rank {rank}): {what} error {err:.3e}"
    # a segment that returns on another rank fails on every rank alike
    bad = ids.clone()
    bad[0, -1] = 0
    try:
        ring_attention(*[t.detach() for t in local[:3]], layout=layout, segment_ids=shard(bad, -1))
    except ValueError as exc:
        assert "contiguous" in str(exc), str(exc)
    else:
        raise AssertionError("non-contiguous segment ids over the ring did not raise")


def _ring_checks(rank, world):
    for i, case in enumerate(CASES):
        _check_case(case, world, rank, seed=1000 + i)
    # K/V streamed in 2 parts per segment (prefetch one part while computing the previous one).
    for i in (0, 1, 2, 5):
        _check_case(CASES[i], world, rank, seed=3000 + i, kv_parts=2, q_chunk=3 if i % 2 else None)
    _check_bad_input(world, rank)
    # The cases above use chunked, whose registry entry has an lse_backward (one backward call per step
    # with the merged out/lse). The torch backend has none: the ring recomputes each step's forward.
    assert registry.get("chunked").lse_backward and registry.get("torch").lse_backward is None
    for i in (1, 5, 6):
        _check_case(CASES[i], world, rank, seed=2000 + i, backend="torch")
    # packed rows (segment ids): chunked has an lse_backward with ids, torch recomputes each call
    _check_packed(world, rank, 4000, True, "zigzag", "chunked", True)
    _check_packed(world, rank, 4001, False, "contiguous", "chunked", True)
    _check_packed(world, rank, 4002, True, "zigzag", "torch", False)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_single_process(world):
    spawn_gloo(_ring_checks, world)


def test_zigzag_split_merge_roundtrip_and_positions():
    x = torch.arange(2 * 24).reshape(2, 24)
    for world in (1, 2, 3):
        shards = [zigzag_split(x, 1, world, r) for r in range(world)]
        assert torch.equal(zigzag_merge(shards, 1), x)
        for r in range(world):
            assert torch.equal(shards[r][0], ring_positions(24 // world, world, r, "zigzag"))
        cont = [shard_sequence(x, 1, world, r) for r in range(world)]
        assert torch.equal(unshard_sequence(cont, 1), x)
    with pytest.raises(ValueError, match="divisible"):
        zigzag_split(x, 1, 5, 0)


@pytest.mark.parametrize("layout,parts,q_chunk", [("zigzag", 1, None), ("zigzag", 3, None), ("contiguous", 2, None),
                                                  ("zigzag", 2, 5)])
def test_plan_covers_exactly_the_causal_pairs(layout, parts, q_chunk):
    """Causal: the calls of all parts attend each (query, key) pair with key <= query exactly once and no
    other; with zigzag every rank does the same amount of work."""
    world, n = 4, 12
    work = []
    for r in range(world):
        qpos = ring_positions(n, world, r, layout)
        seen = torch.zeros(n, n * world, dtype=torch.long)
        for s in range(world):
            kpos = ring_positions(n, world, s, layout)
            for part in block_parts(layout, world, s, n, parts):
                for c in split_rows(plan_part(local_segments(layout, world, r, n), part, True), part, q_chunk):
                    kl = part.hi - part.lo if c.k_len is None else c.k_len
                    qq, kk = qpos[c.q_lo:c.q_hi], kpos[part.lo:part.lo + kl]
                    allowed = torch.ones(len(qq), len(kk), dtype=torch.bool)
                    if c.causal:
                        allowed = torch.ones_like(allowed).tril(kl - len(qq))
                    seen[c.q_lo:c.q_hi][:, kk] += allowed.long()
        want = (torch.arange(n * world)[None, :] <= qpos[:, None]).long()
        assert torch.equal(seen, want), (r, seen - want)
        work.append(int(seen.sum()))
    if layout == "zigzag":
        assert len(set(work)) == 1, work


def test_world1_without_process_group_matches_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = ring_attention(q, k, v, causal=True)
    ref, _ = attention_reference(q, k, v, None, None, None, True)
    assert torch.allclose(out, ref, atol=1e-12)
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, k, v, layout="striped")
    with pytest.raises(ValueError, match="bias"):
        ring_attention(q, k, v, torch.randn(1, 2, 6, 5, dtype=torch.float64))
