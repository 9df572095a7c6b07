"""Long-context transformer blocks: shapes, causality, relative-position bias gradients, backend agreement,
and the context-parallel block on 2 gloo ranks against the single-process block."""

import pytest
import torch
import torch.distributed as dist

from gloo_harness import spawn_gloo

from attn_zoo.models.transformer import (RotaryEmbedding, SwiGLU, TransformerBlock, TransformerLM,
                                esm2_like, gather_sequence, relative_position_bucket, shard_for_context_parallel)


def _lm(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(vocab_size=11, d_model=32, num_layers=2, num_heads=4, attention="chunked")
    args.update(kw)
    return TransformerLM(**args).double()


def _perturb_final_linears(model, seed=1):
    """``final`` init zeroes the residual outputs; randomise them so every path carries signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    return model


def test_shapes_and_esm2_factory():
    tokens = torch.randint(0, 11, (2, 12))
    pad = torch.rand(2, 12) > 0.3
    pad[:, 0] = True
    assert _lm()(tokens, pad).shape == (2, 12, 11)
    enc = esm2_like(vocab_size=33, d_model=16, num_layers=1, num_heads=2, attention="chunked")
    assert not enc.blocks[0].causal
    assert enc(torch.randint(0, 33, (3, 7))).shape == (3, 7, 33)
    x = torch.randn(2, 5, 16)
    assert SwiGLU(16)(x).shape == x.shape
    assert RotaryEmbedding(8)(torch.randn(2, 3, 5, 8), torch.arange(5)).shape == (2, 3, 5, 8)
    with pytest.raises(ValueError, match="valid names"):
        TransformerBlock(16, 2, attention="nope")
    with pytest.raises(TypeError, match="Long"):
        _lm()(torch.randn(2, 4))
    with pytest.raises(ValueError, match="max_len"):
        _lm(max_len=8)(torch.randint(0, 11, (1, 9)))


@pytest.mark.parametrize("causal", [True, False])
def test_causal_blocks_see_no_future(causal):
    model = _perturb_final_linears(_lm(causal=causal, rel_pos_bias=True)).eval()
    tokens = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(3))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 11
    a, b = model(tokens), model(changed)
    diff = (a - b).abs().amax(dim=(0, 2))  # [L]
    assert diff[10:].max() > 1e-6  # the perturbation is visible at and after position 10
    if causal:
        assert diff[:10].max() == 0.0, diff
    else:
        assert diff[:10].min() > 1e-6  # a bidirectional encoder sees it everywhere


@pytest.mark.parametrize("causal", [True, False])
def test_padded_positions_do_not_change_real_ones(causal):
    # pad tokens anywhere (not only at the end) are keys nobody attends: changing them leaves real outputs
    model = _perturb_final_linears(_lm(causal=causal, rel_pos_bias=True)).eval()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 11, (2, 16), generator=g)
    real = torch.rand(2, 16, generator=g) > 0.3
    real[:, 0] = True
    assert (~real).any()
    changed = torch.where(real, tokens, torch.randint(0, 11, (2, 16), generator=g))
    assert not torch.equal(changed, tokens)
    a, b = model(tokens, real), model(changed, real)
    torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-5)


def test_rope_is_relative():
    """<rope(q, i), rope(k, j)> depends only on i - j."""
    rope = RotaryEmbedding(8).double()
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    dot = lambda i, j: (rope(q[None], torch.tensor([i])) * rope(k[None], torch.tensor([j]))).sum()  # noqa: E731
    assert torch.allclose(dot(5, 2), dot(103, 100), atol=1e-10)
    assert not torch.allclose(dot(5, 2), dot(5, 3), atol=1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("packed", [False, True])
def test_block_rotation_on_the_kernels_matches_the_rope_module(packed, monkeypatch):
    """The block rotates q and k (and splits v off) with ``kernels.rotary_qkv``; on the Triton kernels (the CPU
    interpreter) its output and every gradient equal the block written with ``RotaryEmbedding.forward`` on the
    qkv projection's views, for global positions and for per-row positions of packed rows."""
    from attn_zoo.models import kernels

    torch.manual_seed(3)
    block = TransformerBlock(d_model=32, num_heads=4, attention="chunked", rel_pos_bias=True, causal=True)
    _perturb_final_linears(block)
    B, n = 2, 9
    x = torch.randn(B, n, 32, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]] * B) if packed else torch.arange(n)
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2]] * B) if packed else None

    def run():
        out = block(x, positions=positions, segment_ids=ids)
        grads = torch.autograd.grad(out, [x] + list(block.parameters()), torch.ones_like(out), allow_unused=True)
        return out, grads

    def by_module(y, C, cos, sin, heads, *args, **kw):  # the rotation as RotaryEmbedding.forward does it
        qkv = y.unflatten(-1, (3, heads, C // heads)).permute(2, 0, 3, 1, 4)  # [3, B, H, n, Dh]
        q, k = (block.rope(t, positions).transpose(1, 2).flatten(2) for t in (qkv[0], qkv[1]))
        return q, k, qkv[2].transpose(1, 2).flatten(2)

    real = kernels.rotary_qkv
    calls = []
    monkeypatch.setattr(kernels, "rotary_qkv", by_module)
    ref, ref_g = run()
    monkeypatch.setattr(kernels, "rotary_qkv", lambda *a, **kw: calls.append(1) or real(*a, **kw, force=True))
    got, got_g = run()
    assert calls
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, ref_g):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_relative_position_buckets():
    rel = torch.arange(-300, 301)
    b = relative_position_bucket(rel, True, 32, 128)
    assert b.min() == 0 and b.max() == 31
    assert torch.equal(b[300 - torch.arange(8)], torch.arange(8))  # exact buckets for keys 0..7 to the left
    assert b[301] == 16 + 1  # keys to the right use the upper half
    assert (b[:300].diff() <= 0).all()  # farther left: same or larger bucket
    causal = relative_position_bucket(rel, False, 32, 128)
    assert (causal[301:] == 0).all() and causal[0] == 31


def test_rel_pos_bias_gets_gradient_and_backends_agree():
    """torch (reference) and chunked backends give the same output and every parameter gradient,
    including the relative-position table, whose gradient comes from the op's bias gradient."""
    tokens = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(5))
    pad = torch.rand(2, 12, generator=torch.Generator().manual_seed(6)) > 0.3
    pad[:, 0] = True
    grads = {}
    for backend in ("torch", "chunked"):
        model = _perturb_final_linears(_lm(causal=True, rel_pos_bias=True, attention=backend))
        out = model(tokens, pad)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads[backend] = (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    table = grads["chunked"][1]["blocks.0.rel_bias.table.weight"]
    assert table.abs().sum() > 0
    assert torch.allclose(grads["torch"][0], grads["chunked"][0], atol=1e-12)
    for name, g in grads["torch"][1].items():
        assert torch.allclose(g, grads["chunked"][1][name], atol=1e-10), name


def test_checkpointing_gives_same_gradients():
    tokens = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(7))
    gs = []
    for ckpt in (False, True):
        model = _perturb_final_linears(_lm(checkpoint=ckpt)).train()
        model(tokens).square().mean().backward()
        gs.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*gs):
        assert torch.allclose(a, b, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# Context parallel on 2 gloo ranks
# --------------------------------------------------------------------------------------------------
def _cp_case(rank, world, causal, layout):
    kw = dict(vocab_size=11, d_model=32, num_layers=2, num_heads=4, causal=causal, rel_pos_bias=True,
              attention="chunked", layout=layout, ring_options={"kv_parts": 2} if causal else None)
    single = _perturb_final_linears(_lm(seed=11, **kw))
    cp = _perturb_final_linears(_lm(seed=11, process_group="world" if causal else dist.group.WORLD, **kw))
    g = torch.Generator().manual_seed(12)
    tokens = torch.randint(0, 11, (2, 16), generator=g)
    pad = torch.rand(2, 16, generator=g) > 0.3
    pad[:, 0] = True
    weight = torch.randn(2, 16, 11, generator=g, dtype=torch.float64)
    ref = single(tokens, pad)
    (ref * weight).sum().backward()
    local = cp.shard_batch({"tokens": tokens, "pad_mask": pad, "weight": weight},
                           keys=("tokens", "pad_mask", "weight"))
    t_loc, p_loc, w_loc = local["tokens"], local["pad_mask"], local["weight"]
    out = cp(t_loc, p_loc)
    (out * w_loc).sum().backward()
    ref_loc, = shard_for_context_parallel([ref.detach()], layout=layout)
    assert torch.allclose(out, ref_loc, atol=1e-10), (out - ref_loc).abs().max()
    assert torch.equal(gather_sequence(out.detach(), dist.group.WORLD, layout), ref.detach()) or torch.allclose(
        gather_sequence(out.detach(), dist.group.WORLD, layout), ref.detach(), atol=1e-10)
    for (name, p), q in zip(cp.named_parameters(), single.parameters()):
        total = p.grad.clone()
        dist.all_reduce(total)  # replicated parameters: the gradient is the sum over ranks
        assert torch.allclose(total, q.grad, atol=1e-9), f"{name}: {(total - q.grad).abs().max():.3e}"


def _cp_checks(rank, world):
    _cp_case(rank, world, causal=True, layout="zigzag")
    _cp_case(rank, world, causal=False, layout="contiguous")


@pytest.mark.slow
def test_context_parallel_lm_matches_single_process():
    spawn_gloo(_cp_checks, 2)
