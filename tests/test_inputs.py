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


def test_empty_head_dim():
    q, k, v = qkv(d=0)
    with pytest.raises(ValueError, match="head dim D of q is 0"):
        attn_ops.attention(q, k, v)


def _sdpa(q, k, v, bias):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)


@pytest.mark.parametrize("backend", ["auto", "torch", "chunked", "sdpa", "flex",
                                     pytest.param("triton", marks=pytest.mark.interpreter)])  # CPU tensors
@pytest.mark.parametrize("lq,lk,b0", [(0, 6, 2), (5, 0, 2), (0, 0, 2), (5, 6, 0)])
def test_empty_lengths_as_sdpa(backend, lq, lk, b0):
    """Lq = 0: empty out and lse; Lk = 0: out zeros and lse -inf (every row has no key), as SDPA gives; a batch
    of 0: empty out and lse; zero gradients shaped as q, k, v and the broadcast bias, through out and lse."""
    if backend not in attn_ops.backends() + ["auto"]:
        pytest.skip(f"{backend} not available")
    q, k, v = qkv(b=(b0, 3), lq=lq, lk=lk, d=16, dv=24)
    bias = torch.randn(3, 2, lq, lk, requires_grad=True)  # shared over the first batch dim
    mask = torch.rand(b0, 3, 1, 1, lk) > 0.5
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    needs_grad = backend != "flex"  # flex has no CPU backward: it refuses inputs that need one
    if not needs_grad:
        q, k, v, bias = (t.detach() for t in (q, k, v, bias))
    with torch.set_grad_enabled(needs_grad):
        out, lse = attn_ops.attention(q, k, v, bias, mask, return_lse=backend != "sdpa", backend=backend) \
            if backend != "sdpa" else (attn_ops.attention(q, k, v, bias, mask, backend=backend), None)
    want = _sdpa(q.detach(), k.detach(), v.detach(), bias.detach())
    assert out.shape == want.shape == (b0, 3, 2, lq, 24) and out.dtype == q.dtype
    assert torch.equal(out, want) and torch.equal(out, torch.zeros_like(out))
    if lse is not None:
        assert lse.shape == (b0, 3, 2, lq) and lse.dtype == torch.float32
        assert bool((lse == float("-inf")).all())
    if needs_grad:
        loss = out.sum() + (0 if lse is None else lse.clamp(min=-1.0).sum())
        loss.backward()
        for t in (q, k, v, bias):
            assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


def test_empty_lengths_with_segments_causal_and_float64():
    q, k, v = qkv(lq=0, lk=4, dtype=torch.float64)
    ids = (torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    out, lse = attn_ops.attention(q, k, v, causal=True, segment_ids=ids, return_lse=True)
    assert out.shape == (2, 2, 0, 8) and out.dtype == lse.dtype == torch.float64
    q, k, v = qkv(lq=0, lk=0)
    out = attn_ops.attention(q, k, v, segment_ids=torch.zeros(2, 0, dtype=torch.long))
    assert out.shape == (2, 2, 0, 8)


@pytest.mark.parametrize("backend", ["torch", "chunked", "sdpa"])
def test_positive_inf_bias_is_refused_on_cpu(backend):
    """+inf at an attended position is not a valid bias: on the CPU the op names it (where it is, how many);
    -inf stays a valid mask."""
    q, k, v = qkv()
    bias = torch.randn(2, 5, 6)
    bias[1, 3, 2] = float("-inf")
    attn_ops.attention(q, k, v, bias, backend=backend)  # -inf: masked key, fine
    bias[0, 4, 1] = float("inf")
    with pytest.raises(ValueError, match=r"bias of shape \(2, 5, 6\) holds \+inf at 1 attended entries \(the first "
                                         r"at index \(0, 4, 1\)\): \+inf is not a valid bias"):
        attn_ops.attention(q, k, v, bias, backend=backend)
    bias[:, :, 1] = float("inf")  # a whole column, broadcast over the batch dim of q: each of 2 heads x 5 queries
    with pytest.raises(ValueError, match=r"holds \+inf at 10 attended entries"):
        attn_ops.attention(q, k, v, bias, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "chunked", "sdpa"])
def test_positive_inf_bias_at_masked_positions_is_padding(backend):
    """Anything at a masked position (key mask, causal, segment ids) is never read: a +inf there is accepted and
    gives the result of a 0 there, as NaN padding does (tests/helpers.py's garbage check for the kernels)."""
    q, k, v = qkv(b=(2,), lq=6, lk=6)
    bias = torch.randn(2, 6, 6)
    clean = bias.clone()
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[1, ..., 4] = False  # key 4 padded in batch element 1 only
    bias[1, :, 4] = float("inf")  # bias [H, Lq, Lk] shared by both batch elements: attended in element 0
    with pytest.raises(ValueError, match=r"holds \+inf at 6 attended entries"):
        attn_ops.attention(q, k, v, bias, mask, backend=backend)
    mask[0, ..., 4] = False  # now masked everywhere it is read
    clean[1, :, 4] = 0.0
    got = attn_ops.attention(q, k, v, bias, mask, backend=backend)
    assert torch.equal(got, attn_ops.attention(q, k, v, clean, mask, backend=backend))
    causal = torch.randn(2, 6, 6)
    causal[:, 0, 3] = float("inf")  # query 0 never sees key 3 when causal
    attn_ops.attention(q, k, v, causal, causal=True, backend=backend)
    with pytest.raises(ValueError, match="holds \\+inf"):
        attn_ops.attention(q, k, v, causal, backend=backend)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    seg = torch.randn(2, 6, 6)
    seg[:, 1, 4] = float("inf")  # query 1 (segment 0) never sees key 4 (segment 1)
    attn_ops.attention(q, k, v, seg, segment_ids=ids, backend=backend)


def test_positive_inf_bias_gives_nan_where_unchecked():
    """What the docstring says happens where the check does not run: the ground truth gives NaN out and lse for
    the row holding +inf (softmax is inf/inf there), and NaN gradients."""
    q, k, v = qkv()
    bias = torch.randn(2, 5, 6)
    bias[0, 4, 1] = float("inf")
    bias.requires_grad_()
    out, lse = attn_ops.attention_reference(q, k, v, bias)
    assert torch.isnan(out[:, 0, 4]).all() and not torch.isnan(out[:, 0, :4]).any()
    assert not torch.isfinite(lse[:, 0, 4]).any()
    out.sum().backward()
    assert torch.isnan(bias.grad).any()


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
