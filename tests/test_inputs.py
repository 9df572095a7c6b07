"""Bad input raises the documented error naming the argument and shapes; NaN propagates; backends explain refusals."""
import pytest
import torch

import attn_ops


def qkv(b=(2,), h=2, lq=5, lk=6, d=8, dv=None, dtype=torch.float32):
    return (torch.randn(*b, h, lq, d, dtype=dtype), torch.randn(*b, h, lk, d, dtype=dtype),
            torch.randn(*b, h, lk, dv or d, dtype=dtype))


def test_mismatched_heads():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"leading \[\*batch, H\].*q \(2, 2, 5, 8\), k \(2, 3, 6, 8\)"):
        attn_ops.attention(q, torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8))


def test_mismatched_head_dims_and_lengths():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="q and k head dims differ"):
        attn_ops.attention(q, torch.randn(2, 2, 6, 4), v)
    with pytest.raises(ValueError, match="same key length"):
        attn_ops.attention(q, k, torch.randn(2, 2, 7, 8))


def test_dtype_mismatch():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q, k, v must share a dtype.*float16"):
        attn_ops.attention(q, k.half(), v)
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        attn_ops.attention(q.long(), k, v)


def test_bias_not_broadcastable_names_dims():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"bias of shape \(2, 5, 7\).*dim 2 \(size 7 vs 6\)"):
        attn_ops.attention(q, k, v, bias=torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="bias has 5 dims"):
        attn_ops.attention(q, k, v, bias=torch.randn(1, 2, 2, 5, 6))
    with pytest.raises(TypeError, match="bias must be a floating-point tensor"):
        attn_ops.attention(q, k, v, bias=torch.ones(5, 6, dtype=torch.int32))


def test_mask_must_be_bool_and_broadcastable():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"mask must be a bool tensor \(True = attend\), got torch.float32"):
        attn_ops.attention(q, k, v, mask=torch.ones(5, 6))
    with pytest.raises(ValueError, match=r"mask of shape \(3, 1, 1, 6\).*dim 0 \(size 3 vs 2\)"):
        attn_ops.attention(q, k, v, mask=torch.ones(3, 1, 1, 6, dtype=torch.bool))


def test_mask_and_bias_on_another_device():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="mask is on meta but q is on cpu"):
        attn_ops.attention(q, k, v, mask=torch.ones(5, 6, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="bias is on meta but q is on cpu"):
        attn_ops.attention(q, k, v, bias=torch.ones(5, 6, device="meta"))


@pytest.mark.parametrize("shape_kw,what", [(dict(d=0), "head dim D of q is 0"), (dict(lq=0), "query length Lq is 0"),
                                          (dict(lk=0), "key length Lk is 0")])
def test_empty_sizes(shape_kw, what):
    q, k, v = qkv(**shape_kw)
    with pytest.raises(ValueError, match=what):
        attn_ops.attention(q, k, v)


def test_too_few_dims_and_non_tensors():
    with pytest.raises(ValueError, match=r"q must have shape \[\*batch, H, L, D\]"):
        attn_ops.attention(torch.randn(5, 8), torch.randn(6, 8), torch.randn(6, 8))
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        attn_ops.attention(q, [1.0], v)


@pytest.mark.parametrize("backend", ["torch", "chunked"])  # sdpa's CPU kernel turns a NaN row into 0s itself
def test_nan_is_propagated_not_hidden(backend):
    q, k, v = qkv()
    q[0, 1, 2, 3] = float("nan")
    out = attn_ops.attention(q, k, v, backend=backend)
    assert torch.isnan(out[0, 1, 2]).all()
    assert not torch.isnan(out[1]).any()


def test_unknown_backend_and_option():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="unknown attention backend 'fast'; valid names: auto, torch, chunked"):
        attn_ops.attention(q, k, v, backend="fast")
    with pytest.raises(TypeError, match=r"backend 'chunked' got unknown option\(s\) \['bwd'\]"):
        attn_ops.attention(q, k, v, backend="chunked", bwd="split")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        attn_ops.attention(q, k, v, backend="chunked", chunk_size=0)


def test_refusal_lists_every_backend_reason():
    q, k, v = qkv(d=8)
    bias = torch.randn(5, 6, requires_grad=True)
    with pytest.raises(ValueError, match=r"flex: .*(head dim 8 outside|no backward on cpu)"):
        attn_ops.attention(q.requires_grad_(), k, v, bias, backend="flex")


def test_backends_lists_cpu_capable_ones():
    names = attn_ops.backends()
    assert {"torch", "chunked", "sdpa"} <= set(names)
