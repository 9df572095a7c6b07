"""Packed variable-length rows (``segment_ids``): every backend on a packed batch equals the same sequences run one
by one through the float64 reference (outputs, lse and the gradients of q, k, v, bias, also through lse).

The triton backend runs under TRITON_INTERPRET=1 with tiny shapes (its tiles there are 32 queries x 16 keys, so
rows of 40-70 tokens span several tiles and tile skipping is exercised). Errors are bounded as in tests/helpers.py:
a small multiple of plain PyTorch's own error in the same dtype on the same packed inputs.
"""
import os

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest does the same)
# The triton tests on CPU tensors need the interpreter; on a GPU machine setting it here would switch every GPU test
# collected with this file to the interpreter's launch path, so they skip there unless TRITON_INTERPRET=1 was set.
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="triton on CPU tensors: run with TRITON_INTERPRET=1")

import attn_ops  # noqa: E402
from attn_ops import registry  # noqa: E402
from attn_ops.inputs import check_segment_ids  # noqa: E402
from attn_ops.reference import attention_reference  # noqa: E402
from helpers import bound, ids_from_lengths, max_err  # noqa: E402


def spans(lengths):
    out, pos = [], 0
    for n in lengths:
        out.append((pos, pos + n))
        pos += n
    return out


# (name, per-row sequence lengths (query side), per-row lengths on the key side or None (= same ids), L, Lk,
#  bias kind, key mask, causal)
CASES = [
    # odd lengths, a length-1 sequence, padding at the end; a row holding one sequence
    ("mixed_full_bias", [[7, 1, 13, 4], [25]], None, 27, 27, "full", False, False),
    ("mixed_full_bias_causal", [[7, 1, 13, 4], [25]], None, 27, 27, "full", False, True),
    # a bias shared by the batch rows (its gradient sums rows packed differently) and a key mask with holes
    ("shared_bias_key_mask", [[3, 9, 1, 5], [11, 10]], None, 23, 23, "shared", True, False),
    ("no_bias_causal_key_mask", [[3, 9, 1, 5], [11, 10]], None, 23, 23, None, True, True),
    # queries and keys packed differently (a pair of ids): cross attention between packed sets
    ("pair_ids_cross", [[4, 1, 6], [9, 2]], [[5, 7, 2], [3, 10]], 13, 15, "full", False, False),
]
# triton: rows over several 32 x 16 tiles, sequences that straddle tile edges and some that fit in one tile
TRITON_CASES = [
    ("tiles_full_bias", [[17, 1, 30, 5, 12], [64]], None, 70, 70, "full", False, False),
    ("tiles_full_bias_causal", [[17, 1, 30, 5, 12], [64]], None, 70, 70, "full", False, True),
    ("tiles_shared_bias_key_mask", [[33, 2, 20], [9, 40, 1, 3]], None, 57, 57, "shared", True, False),
    ("tiles_pair_ids", [[20, 3, 11], [9, 30]], [[6, 40, 2], [21, 5]], 41, 50, "full", False, False),
]


def make_packed(case, dtype, seed=0, grad=True):
    name, qlens, klens, L, Lk, bias_kind, key_mask, causal = case
    g = torch.Generator().manual_seed(seed)
    B, H, D = len(qlens), 2, 16

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)

    q, k, v = rnd(B, H, L, D), rnd(B, H, Lk, D), rnd(B, H, Lk, D)
    bias = {None: None, "full": lambda: rnd(B, H, L, Lk), "shared": lambda: rnd(1, H, L, Lk)}[bias_kind]
    bias = bias() if bias is not None else None
    qids = torch.stack([ids_from_lengths(n, L) for n in qlens])
    kids = qids if klens is None else torch.stack([ids_from_lengths(n, Lk) for n in klens])
    mask = None
    if key_mask:
        mask = torch.rand(B, 1, 1, Lk, generator=g) > 0.25
        for b, lens in enumerate(klens or qlens):  # keep each sequence's first key, so no live row is empty
            for s, _ in spans(lens):
                mask[b, 0, 0, s] = True
    seg = qids if klens is None else (qids, kids)
    return q, k, v, bias, mask, seg, causal


def per_sequence(case, q, k, v, bias, mask, g_out, g_lse):
    """out, lse and grads of q, k, v, bias of the packed batch computed one sequence at a time (float64)."""
    _, qlens, klens, L, Lk, _, _, causal = case
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    b64 = None if bias is None else bias.detach().double()
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    grads = [torch.zeros_like(q64), torch.zeros_like(k64), torch.zeros_like(v64)]
    grads.append(None if b64 is None else torch.zeros_like(b64))
    for b, lens in enumerate(qlens):
        for (qs, qe), (ks, ke) in zip(spans(lens), spans(klens[b] if klens else lens)):
            leaves = [q64[b, :, qs:qe].clone().requires_grad_(), k64[b, :, ks:ke].clone().requires_grad_(),
                      v64[b, :, ks:ke].clone().requires_grad_()]
            bb = None if b64 is None else b64[b if b64.shape[0] > 1 else 0, :, qs:qe, ks:ke].clone().requires_grad_()
            m = None if mask is None else mask[b, :, :, ks:ke]
            o, l = attention_reference(*leaves, bb, m, None, causal)
            out[b, :, qs:qe], lse[b, :, qs:qe] = o.detach(), l.detach()
            loss = (o * g_out[b, :, qs:qe]).sum() + (torch.where(torch.isfinite(l), l, 0.0) * g_lse[b, :, qs:qe]).sum()
            gs = torch.autograd.grad(loss, leaves + ([bb] if bb is not None else []))
            grads[0][b, :, qs:qe] += gs[0]
            grads[1][b, :, ks:ke] += gs[1]
            grads[2][b, :, ks:ke] += gs[2]
            if bb is not None:
                grads[3][b if b64.shape[0] > 1 else 0, :, qs:qe, ks:ke] += gs[3]
    return out, lse, grads


def _loss(out, lse, g_out, g_lse):
    loss = (out.double() * g_out).sum()
    if lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse.double(), 0.0) * g_lse).sum()
    return loss


def check_packed(backend, case, dtype, seed=0, **options):
    """The packed call on ``backend`` vs the sequences one by one: out, lse, and (where the backend has a
    backward here) dq, dk, dv, dbias with a loss on out and on lse."""
    info = registry.get(backend)
    grad = "cpu" in (info.grad_devices or info.devices)
    q, k, v, bias, mask, seg, causal = make_packed(case, dtype, seed, grad=grad)
    g = torch.Generator().manual_seed(seed + 1)
    g_out = torch.randn(q.shape[:-1] + v.shape[-1:], generator=g, dtype=torch.float64)
    g_lse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64) if info.lse else torch.zeros(q.shape[:-1])
    leaves = [t for t in (q, k, v, bias) if t is not None]
    if info.lse:
        out, lse = attn_ops.attention(q, k, v, bias, mask, causal=causal, return_lse=True, backend=backend,
                                      segment_ids=seg, **options)
    else:
        out, lse = attn_ops.attention(q, k, v, bias, mask, causal=causal, backend=backend, segment_ids=seg,
                                      **options), None
    got = list(torch.autograd.grad(_loss(out, lse, g_out, g_lse), leaves)) if grad else []
    ref_out, ref_lse, ref_grads = per_sequence(case, q, k, v, bias, mask, g_out, g_lse)
    ref_grads = [t for t in ref_grads if t is not None]
    # plain PyTorch in the same dtype on the packed inputs (the yardstick of acceptable error)
    lp_leaves = [None if t is None else t.detach().clone().requires_grad_(grad) for t in (q, k, v, bias)]
    lp_out, lp_lse = attention_reference(*lp_leaves, mask, None, causal, upcast=False,
                                         segment_ids=check_segment_ids(seg, q, k))
    lp = list(torch.autograd.grad(_loss(lp_out, lp_lse, g_out, g_lse), [t for t in lp_leaves if t is not None])
              ) if grad else []
    names = ["out"] + (["lse"] if lse is not None else []) + ["dq", "dk", "dv", "dbias"][:len(got)]
    outs = [out] + ([lse] if lse is not None else []) + got
    refs = [ref_out] + ([ref_lse] if lse is not None else []) + ref_grads[:len(got)]
    lps = [lp_out] + ([lp_lse] if lse is not None else []) + lp
    assert torch.isfinite(ref_lse).any()
    for name, a, r, p in zip(names, outs, refs, lps):
        assert a.shape == r.shape, (name, a.shape, r.shape)
        assert not torch.isnan(a).any(), f"{backend}: NaN in {name}"
        err, base = max_err(a, r), max_err(p, r)
        allowed = bound(dtype, r, base, backend)
        assert err <= allowed, f"{backend} {dtype} {case[0]}: {name} error {err:.3g} > {allowed:.3g} (torch {base:.3g})"
    # padding rows: out exactly 0, lse -inf, zero gradient
    qids = seg[0] if isinstance(seg, tuple) else seg
    pad = qids < 0  # [B, L]
    assert torch.equal(out.transpose(1, 2)[pad], torch.zeros_like(out.transpose(1, 2)[pad]))
    if lse is not None:
        assert (lse.transpose(1, 2)[pad] == float("-inf")).all()
    if got:
        assert torch.equal(got[0].transpose(1, 2)[pad], torch.zeros_like(got[0].transpose(1, 2)[pad]))
    return out, lse, got


def test_reference_with_ids_equals_sequences_one_by_one():
    """The float64 reference's materialised id mask gives exactly the per-sequence results (to rounding)."""
    for case in CASES:
        q, k, v, bias, mask, seg, causal = make_packed(case, torch.float64)
        g = torch.Generator().manual_seed(5)
        g_out = torch.randn(q.shape[:-1] + v.shape[-1:], generator=g, dtype=torch.float64)
        g_lse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64)
        out, lse = attention_reference(q, k, v, bias, mask, None, causal, segment_ids=check_segment_ids(seg, q, k))
        leaves = [t for t in (q, k, v, bias) if t is not None]
        got = torch.autograd.grad(_loss(out, lse, g_out, g_lse), leaves)
        r_out, r_lse, r_grads = per_sequence(case, q, k, v, bias, mask, g_out, g_lse)
        for a, b in zip([out, lse, *got], [r_out, r_lse, *[t for t in r_grads if t is not None]]):
            assert max_err(a, b) < 1e-12, case[0]


CPU_BACKENDS = ["torch", "chunked", "sdpa", "flex"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_torch_backends_match_sequences(backend, case):
    if backend not in attn_ops.backends():
        pytest.skip(f"{backend} not available")
    opts = dict(chunk_size=5) if backend == "chunked" else {}  # many chunks, some inside one sequence
    check_packed(backend, case, torch.float32, **opts)


TRITON_RUNS = [(c, torch.float32) for c in TRITON_CASES] + [(c, torch.float16) for c in TRITON_CASES[1:3]]


@interpreter
@pytest.mark.parametrize("case,dtype", TRITON_RUNS, ids=[f"{c[0]}-{str(d)[6:]}" for c, d in TRITON_RUNS])
def test_triton_matches_sequences(case, dtype):
    check_packed("triton", case, dtype)


def _tiles_meeting(qids, kids, bm, bn):
    """Python count of the (query tile, key tile) pairs of one row whose id ranges meet."""
    def rng(ids):
        ok = ids[ids >= 0]
        return (int(ok.min()), int(ok.max())) if ok.numel() else None
    n = 0
    for m0 in range(0, qids.numel(), bm):
        for n0 in range(0, kids.numel(), bn):
            a, b = rng(qids[m0:m0 + bm]), rng(kids[n0:n0 + bn])
            n += a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]
    return n


@pytest.mark.slow
@interpreter
def test_triton_skips_tiles_whose_segments_cannot_meet(monkeypatch):
    """Count the score tiles each kernel computes (forward, dQ, dK/dV and the dBias reduction of a bias shared by
    the batch rows): with segment ids exactly the tile pairs whose id ranges meet, far fewer than the dense ones,
    and the results still match the sequences one by one."""
    from attn_ops.triton import backward, common, dbias, forward  # noqa: F401

    counts = {"logits": 0, "logits_t": 0, "ds": 0}

    def counting(name, real):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(common, "logits", counting("logits", common.logits))  # forward and dQ (kv_scores)
    monkeypatch.setattr(backward, "logits_t", counting("logits_t", backward.logits_t))  # dK/dV
    monkeypatch.setattr(dbias, "_ds_step", counting("ds", dbias._ds_step))  # dBias reduction
    L, H = 128, 2
    lens = [[16] * 7 + [15], [7, 1, 40, 9, 30, 25]]  # padding at the end of both rows
    case = ("count", lens, None, L, L, "shared", False, False)
    q, k, v, bias, mask, ids, _ = make_packed(case, torch.float32)
    bm, bn = 32, 16  # the interpreter's tiles (attn_ops/triton/tuning.py)
    meet = sum(_tiles_meeting(ids[b], ids[b], bm, bn) for b in range(len(lens))) * H
    dense = (L // bm) * (L // bn) * len(lens) * H
    assert meet < 0.5 * dense, (meet, dense)
    out, lse = attn_ops.attention(q, k, v, bias, return_lse=True, backend="triton", segment_ids=ids)
    assert counts["logits"] == meet, (counts, meet)
    (out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    assert counts == {"logits": 2 * meet, "logits_t": meet, "ds": meet}, (counts, meet)
    counts["logits"] = 0
    attn_ops.attention(q.detach(), k.detach(), v.detach(), bias.detach(), backend="triton")  # dense: every tile
    assert counts["logits"] == dense, (counts, dense)


@interpreter
def test_segment_tables_give_each_position_exactly_its_segment_on_the_other_side():
    """op.segment_tables (one Triton launch, segtable.py): per position, [lo, hi) on the other side covers exactly the
    positions with its id (empty when the id is absent there or the position is padding), for ids shared by q and
    k, for a pair of different lengths with padding between segments, for ids broadcast over a batch dim, and for
    rows longer than the kernel's 1024-position chunks (its scans carry across chunks)."""
    from attn_ops.triton.op import segment_tables

    def check(own_table, other_ids):
        ids, lo, hi = (t.reshape(-1, t.shape[-1]) for t in own_table.unbind(-2))
        other = other_ids.expand(own_table.shape[:-2] + other_ids.shape[-1:]).reshape(-1, other_ids.shape[-1])
        for row in range(ids.shape[0]):
            span = {}
            for j, x in enumerate(other[row].tolist()):
                if x >= 0:
                    span[x] = (span.get(x, (j, j))[0], j + 1)
            got = list(zip(ids[row].tolist(), lo[row].tolist(), hi[row].tolist()))
            for i, (x, a, b) in enumerate(got):
                if x >= 0 and x in span:
                    assert (a, b) == span[x], (row, i, x, a, b, span[x])
                else:
                    assert b <= a, (row, i, x, a, b)

    g = torch.Generator().manual_seed(3)
    ids = ids_from_lengths([5, 1, 9, 3], 22)[None].repeat(2, 1)
    ids[1] = torch.where(torch.rand(22, generator=g) < 0.3, -1, ids[1])  # padding inside and between segments
    rows = ids[:, None]
    qt, kt = segment_tables(rows, rows)
    assert qt is kt and qt.dtype == torch.int32 and qt.shape == (2, 1, 3, 22)
    check(qt, rows)
    q_ids = torch.tensor([[0, 0, 2, 2, 2, -1, 5, 7]])  # [1, Lq]: broadcast over the key ids' batch
    k_ids = torch.tensor([[-1, 0, 1, 1, 2, -1, 2, 7, 7, -1], [2, 2, 3, 5, 5, 5, -1, -1, 8, 8]])
    qt, kt = segment_tables(q_ids[:, None], k_ids[:, None])
    assert qt.shape == (2, 1, 3, 8) and kt.shape == (2, 1, 3, 10)
    check(qt, k_ids[:, None])
    check(kt, q_ids[:, None])
    # long rows: 2500 and 2200 positions of sequences 1-400 long, padding between some of them
    long_q = ids_from_lengths(torch.randint(1, 400, (12,), generator=g).tolist(), 2500)
    long_k = ids_from_lengths(torch.randint(1, 400, (10,), generator=g).tolist(), 2200)
    long_k = torch.where(torch.rand(2200, generator=g) < 0.05, -1, long_k)
    long_q[1000:1500] = long_k[1000:1500] = -1  # padding across a chunk boundary: the scans' carries count
    qt, kt = segment_tables(long_q[None, None], long_k[None, None])
    check(qt, long_k[None, None])
    check(kt, long_q[None, None])


@interpreter
def test_triton_reuses_segment_tables_of_unchanged_ids(monkeypatch):
    """The tables are built once per ids tensor (as a model's layers share one), rebuilt after an in-place change
    of the ids (results follow the new ids) and for another tensor; never reused for a pair of other ids."""
    from attn_ops.triton import op as triton_op

    built = []
    real = triton_op.segment_tables_flat
    monkeypatch.setattr(triton_op, "segment_tables_flat", lambda *a: built.append(1) or real(*a))
    monkeypatch.setattr(triton_op.STATE, "tables", [])
    q, k, v = _qkv(lq=12, lk=12, b=2)
    ids = ids_from_lengths([5, 4, 3], 12)[None].repeat(2, 1)
    run = lambda i: attn_ops.attention(q, k, v, backend="triton", segment_ids=i)  # noqa: E731
    first = run(ids)
    assert torch.equal(run(ids), first) and len(built) == 1
    ids[:, 5:] = 7  # the last two sequences become one
    changed = run(ids)
    assert len(built) == 2
    expected = attention_reference(q, k, v, segment_ids=(ids, ids))[0]
    assert max_err(changed, expected) < 1e-5 and max_err(changed, first) > 1e-3
    run(ids.clone())
    assert len(built) == 3
    k_ids = ids_from_lengths([9, 3], 12)[None].repeat(2, 1)
    pair = attn_ops.attention(q, k, v, backend="triton", segment_ids=(ids, k_ids))
    assert len(built) == 4
    assert max_err(pair, attention_reference(q, k, v, segment_ids=(ids, k_ids))[0]) < 1e-5
    ids.data = ids_from_lengths([2, 10], 12)[None].repeat(2, 1)  # new memory behind the same tensor: rebuilt
    assert max_err(run(ids), attention_reference(q, k, v, segment_ids=(ids, ids))[0]) < 1e-5 and len(built) == 5
    ids.data[:, 6:] = 9  # unseen by the version counter: clear_segment_tables() is the documented remedy
    triton_op.clear_segment_tables()
    assert max_err(run(ids), attention_reference(q, k, v, segment_ids=(ids, ids))[0]) < 1e-5 and len(built) == 6
    k2 = ids_from_lengths([3, 9], 12)[None].repeat(2, 1)
    attn_ops.attention(q, k, v, backend="triton", segment_ids=(ids, k2))
    assert len(triton_op.STATE.tables) == 2
    del k2  # its entry goes at the next insert
    other = ids.clone()
    run(other)
    assert len(triton_op.STATE.tables) == 2 and all(e[1][0]() is not None and e[1][1]() is not None
                                               for e in triton_op.STATE.tables)


def _qkv(lq=6, lk=6, b=2):
    return torch.randn(b, 2, lq, 16), torch.randn(b, 2, lk, 16), torch.randn(b, 2, lk, 16)


def test_bad_segment_ids_are_rejected_with_clear_errors():
    q, k, v = _qkv()
    ids = torch.tensor([[0, 0, 1, 1, 2, -1], [0, 0, 0, 0, 0, 0]])
    with pytest.raises(TypeError, match=r"segment_ids must be an integer tensor.*got torch.float32"):
        attn_ops.attention(q, k, v, segment_ids=ids.float())
    with pytest.raises(TypeError, match=r"segment_ids must be an integer tensor.*got torch.bool"):
        attn_ops.attention(q, k, v, segment_ids=ids >= 0)
    with pytest.raises(ValueError, match=r"segment_ids of shape \(2, 5\) is not broadcastable.*dim 1 \(size 5 vs 6\)"):
        attn_ops.attention(q, k, v, segment_ids=ids[:, :5])
    with pytest.raises(ValueError, match=r"segment_ids of shape \(2, 2, 6\) must have 1 to 2 dims.*no head dim"):
        attn_ops.attention(q, k, v, segment_ids=ids[:, None].expand(2, 2, 6))
    with pytest.raises(ValueError, match=r"segment_ids of shape \(3, 6\) is not broadcastable.*dim 0 \(size 3 vs 2\)"):
        attn_ops.attention(q, k, v, segment_ids=torch.zeros(3, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="segment_ids is on meta but q is on cpu"):
        attn_ops.attention(q, k, v, segment_ids=ids.to("meta"))
    # a segment that returns after another started (id 0 again after id 1), also across padding
    for bad in ([0, 0, 1, 0, 2, 2], [0, 1, -1, -1, 0, 1]):
        with pytest.raises(ValueError, match=r"segment_ids must be contiguous within each row.*row \(1,\)"):
            attn_ops.attention(q, k, v, segment_ids=torch.stack([ids[0], torch.tensor(bad)]))
    with pytest.raises(ValueError, match="below 2"):
        attn_ops.attention(q, k, v, segment_ids=torch.full((6,), 2 ** 31 - 1))
    # q and k of different lengths need a pair
    q2, k2, v2 = _qkv(lq=4)
    with pytest.raises(ValueError, match=r"needs Lq == Lk.*pass a pair"):
        attn_ops.attention(q2, k2, v2, segment_ids=ids)
    with pytest.raises(ValueError, match=r"segment_ids\[0\] \(query ids\) of shape \(2, 6\)"):
        attn_ops.attention(q2, k2, v2, segment_ids=(ids, ids))
    with pytest.raises(ValueError, match="pair needs"):
        attn_ops.attention(q, k, v, segment_ids=(ids, ids, ids))
    # fine: padding anywhere, broadcast over the batch, int32
    attn_ops.attention(q, k, v, segment_ids=torch.tensor([-1, 0, -1, 0, 1, -1], dtype=torch.int32))


def test_backend_without_segment_support_refuses_with_a_reason(monkeypatch):
    import dataclasses

    q, k, v = _qkv()
    ids = torch.tensor([0, 0, 1, 1, 2, -1])
    monkeypatch.setitem(registry.BACKENDS, "sdpa", dataclasses.replace(registry.BACKENDS["sdpa"], segment_ids=False))
    with pytest.raises(registry.UnsupportedInputs, match=r"sdpa: segment_ids \(packed variable-length rows\) not"):
        attn_ops.attention(q, k, v, backend="sdpa", segment_ids=ids)
    attn_ops.attention(q, k, v, backend="sdpa")  # without ids it still serves
    assert not registry.get("sdpa").segment_ids and all(registry.get(n).segment_ids for n in ("torch", "chunked", "triton", "flex"))


@interpreter
def test_triton_custom_op_with_ids_under_compile_and_opcheck():
    """The custom op takes the id tables (fake impl included): opcheck, and torch.compile gives the eager bits."""
    from attn_ops.triton.op import segment_tables

    q, k, v = (t.requires_grad_() for t in _qkv(lq=20, lk=20, b=1))
    ids = ids_from_lengths([7, 1, 9], 20)[None]
    table, _ = segment_tables(ids[:, None], ids[:, None])  # [B, R=1, 3, L]
    for shared in (True, False):
        torch.library.opcheck(torch.ops.attn_zoo.triton_segment_tables.default, (ids[:, None], ids[:, None], shared),
                              test_utils=("test_schema", "test_faketensor"))
    q5, k5, v5 = (t[:, None].detach() for t in (q, k, v))
    torch.library.opcheck(torch.ops.attn_zoo.triton_attn_fwd.default,
                          (q5, k5, v5, None, None, 0.25, True, False, False, table, table),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))

    def f(q, k, v, ids):
        out, lse = attn_ops.attention(q, k, v, causal=True, return_lse=True, backend="triton", segment_ids=ids)
        return out, lse

    eager = f(q, k, v, ids)
    compiled = torch.compile(f, fullgraph=True)(q, k, v, ids)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    g_e = torch.autograd.grad(eager[0].sum() + eager[1][torch.isfinite(eager[1])].sum(), (q, k, v))
    g_c = torch.autograd.grad(compiled[0].sum() + compiled[1][torch.isfinite(compiled[1])].sum(), (q, k, v))
    for a, b in zip(g_e, g_c):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_attention_passes_ids_per_block(causal):
    """blockwise_attention with segment ids (each key chunk slices the key ids) == the sequences one by one."""
    case = ("blockwise", [[7, 1, 13, 4], [25]], None, 27, 27, "full", False, causal)
    q, k, v, bias, mask, ids, _ = make_packed(case, torch.float64)
    g = torch.Generator().manual_seed(2)
    g_out = torch.randn(q.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64)
    out, lse = attn_ops.blockwise_attention(q, k, v, bias, kv_chunk=6, q_chunk=10, causal=causal, return_lse=True,
                                            backend="chunked", segment_ids=ids)
    got = torch.autograd.grad(_loss(out, lse, g_out, g_lse), (q, k, v, bias))
    r_out, r_lse, r_grads = per_sequence(case, q, k, v, bias, mask, g_out, g_lse)
    for a, b in zip([out, lse, *got], [r_out, r_lse, *r_grads]):
        assert max_err(a, b) < 1e-10


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_gpu_packed_matches_sequences(dtype, causal):
    """On the GPU with the tuned tiles: a packed batch of protein-like lengths (bias of the packed length, padding at
    the end) vs the sequences one by one in float64; errors bounded by plain PyTorch's in the same dtype."""
    lens = [[300, 1, 517, 77, 129], [1000], [255, 256, 257]]
    case = ("gpu", lens, None, 1031, 1031, "full", False, causal)
    q, k, v, bias, mask, ids, _ = make_packed(case, dtype, seed=7)
    dev = [t.detach().cuda().requires_grad_() for t in (q, k, v, bias)]
    g = torch.Generator().manual_seed(8)
    g_out = torch.randn(q.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64)
    out, lse = attn_ops.attention(*dev[:3], dev[3], causal=causal, return_lse=True, backend="triton",
                                  segment_ids=ids.cuda())
    got = torch.autograd.grad(_loss(out, lse, g_out.cuda(), g_lse.cuda()), dev)
    r_out, r_lse, r_grads = per_sequence(case, q, k, v, bias, None, g_out, g_lse)
    lp_leaves = [t.detach().cuda().requires_grad_() for t in (q, k, v, bias)]
    lp_out, lp_lse = attention_reference(*lp_leaves, None, None, causal, upcast=False,
                                         segment_ids=check_segment_ids(ids.cuda(), lp_leaves[0], lp_leaves[1]))
    lp = torch.autograd.grad(_loss(lp_out, lp_lse, g_out.cuda(), g_lse.cuda()), lp_leaves)
    for name, a, r, p in zip(["out", "lse", "dq", "dk", "dv", "dbias"], [out, lse, *got], [r_out, r_lse, *r_grads],
                             [lp_out, lp_lse, *lp]):
        a, p = a.cpu(), p.cpu()
        err, base = max_err(a, r), max_err(p, r)
        assert err <= bound(dtype, r, base, "triton"), f"{name} {dtype}: {err:.3g} vs torch {base:.3g}"


def test_segment_ids_made_under_inference_mode():
    """Ids created under ``torch.inference_mode`` (validation loops) have no version counter: still checked."""
    from attn_ops import attention

    q = torch.randn(1, 2, 6, 8)
    with torch.inference_mode():
        ids = torch.tensor([[0, 0, 0, 1, 1, -1]])
        out = attention(q, q, q, segment_ids=ids, backend="torch")
        assert out.shape == q.shape
        with pytest.raises(ValueError, match="contiguous"):
            attention(q, q, q, segment_ids=torch.tensor([[0, 1, 0, 1, 1, 1]]), backend="torch")
