"""merge_partials and blockwise_attention equal full attention, forward and every gradient."""
import pytest
import torch

import attn_ops
from attn_ops import merge_partials
from helpers import grads_of, make_inputs


def _full_and_grads(fn, leaves, seed=0):
    out, lse = fn()
    g = torch.Generator().manual_seed(seed)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    return out, lse, grads_of(out, lse, leaves, g_out, g_lse)


@pytest.mark.parametrize("backend", ["torch", "chunked"])
@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_equals_full_with_uneven_chunks(backend, causal):
    q, k, v, bias, mask = make_inputs((2, 3), 2, 23, 31, 16, dtype=torch.float64, bias_shape=(2, 1, 2, 23, 31),
                                      mask_shape=(2, 3, 1, 1, 31), seed=7)
    mask[0, 1] = False  # rows with no key at all
    leaves = [q, k, v, bias]
    full = _full_and_grads(lambda: attn_ops.attention(q, k, v, bias, mask, causal=causal, return_lse=True,
                                                      backend="torch"), leaves)
    blk = _full_and_grads(lambda: attn_ops.blockwise_attention(q, k, v, bias, mask, kv_chunk=7, q_chunk=10,
                                                               causal=causal, return_lse=True, backend=backend),
                          leaves)
    torch.testing.assert_close(blk[0], full[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(blk[1], full[1], rtol=1e-10, atol=1e-10)
    for a, b, name in zip(blk[2], full[2], "q k v bias".split()):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"grad {name}")


def test_merge_partials_over_key_split_is_exact_and_differentiable():
    q, k, v, bias, mask = make_inputs((2,), 2, 9, 20, 8, dtype=torch.float64, bias_shape=(2, 9, 20), seed=8)
    splits = [(0, 3), (3, 11), (11, 20)]
    parts = [attn_ops.attention(q, k[..., a:b, :], v[..., a:b, :], bias[..., a:b], return_lse=True,
                                backend="torch") for a, b in splits]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    ref_out, ref_lse = attn_ops.attention(q, k, v, bias, return_lse=True, backend="torch")
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    g1 = torch.autograd.grad((out ** 2).sum() + lse.sum(), (q, k, bias))
    g2 = torch.autograd.grad((ref_out ** 2).sum() + ref_lse.sum(), (q, k, bias))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_merge_with_empty_parts_gives_zero_and_neg_inf_without_nan():
    o1, o2 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True), torch.randn(3, 4, dtype=torch.float64)
    l1 = torch.tensor([0.5, float("-inf"), float("-inf")], dtype=torch.float64, requires_grad=True)
    l2 = torch.tensor([1.0, 2.0, float("-inf")], dtype=torch.float64)
    out, lse = merge_partials([o1, o2], [l1, l2])
    assert torch.isneginf(lse[2]) and (out[2] == 0).all()
    torch.testing.assert_close(out[1], o2[1])
    go, gl = torch.autograd.grad(out.sum() + lse[:2].sum(), (o1, l1))
    assert torch.isfinite(go).all() and torch.isfinite(gl).all()
    assert gl[1] == 0 and gl[2] == 0


def test_merge_rejects_mismatched_parts():
    with pytest.raises(ValueError, match="outs\\[1\\]"):
        merge_partials([torch.zeros(2, 3), torch.zeros(2, 4)], [torch.zeros(2), torch.zeros(2)])
    with pytest.raises(ValueError, match="as many outs as lses"):
        merge_partials([torch.zeros(2, 3)], [])


def test_blockwise_rejects_bad_chunks():
    q, k, v, _, _ = make_inputs((1,), 1, 4, 4, 8, seed=9)
    with pytest.raises(ValueError, match="kv_chunk must be a positive int, got None"):
        attn_ops.blockwise_attention(q, k, v, kv_chunk=None)
    with pytest.raises(ValueError, match="q_chunk must be a positive int, got 0"):
        attn_ops.blockwise_attention(q, k, v, kv_chunk=2, q_chunk=0)
