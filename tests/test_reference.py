"""The reference itself: float64 gradcheck/gradgradcheck (incl. through lse) and an independent softmax check."""
import pytest
import torch

from attn_ops.reference import attention_reference
from helpers import make_inputs


def _fn(mask, causal):
    def f(q, k, v, bias):
        out, lse = attention_reference(q, k, v, bias, mask, causal=causal)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return f


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_with_broadcast_bias_mask_and_lse(causal):
    q, k, v, bias, mask = make_inputs((2, 2), 2, 5, 7, 4, dtype=torch.float64, bias_shape=(2, 1, 2, 5, 7),
                                      mask_shape=(2, 2, 1, 1, 7), seed=3)
    mask[0, 0] = False  # a row set with no key at all
    assert torch.autograd.gradcheck(_fn(mask, causal), (q, k, v, bias))
    assert torch.autograd.gradgradcheck(_fn(mask, causal), (q, k, v, bias))


def test_matches_plain_softmax_and_fully_masked_rows():
    q, k, v, bias, mask = make_inputs((3,), 2, 6, 9, 8, dtype=torch.float64, bias_shape=(2, 6, 9),
                                      mask_shape=(3, 1, 6, 9), seed=4)
    mask[1, 0, 2] = False  # one query row of batch 1 sees nothing
    out, lse = attention_reference(q, k, v, bias, mask)
    s = (q @ k.transpose(-1, -2)) * 8 ** -0.5 + bias
    s = s.masked_fill(~mask, float("-inf"))
    live = mask.any(-1).expand(3, 2, 6)
    p = torch.softmax(s, -1)
    ref_out = torch.where(live[..., None], torch.nan_to_num(p) @ v, 0.0)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse[live], torch.logsumexp(s, -1)[live])
    assert torch.isneginf(lse[~live]).all() and (out[~live] == 0).all()
    gq, gb = torch.autograd.grad((out.sum() + torch.where(live, lse, 0.0).sum()), (q, bias))
    assert torch.isfinite(gq).all() and torch.isfinite(gb).all()
    assert (gq[1, :, 2] == 0).all()


def test_causal_offset_when_lq_differs_from_lk():
    q, k, v, _, _ = make_inputs((), 1, 3, 5, 4, dtype=torch.float64, seed=5)
    out, _ = attention_reference(q, k, v, causal=True)
    # query i sees keys j <= i + 2: the last query sees all 5 keys, the first sees 3
    full, _ = attention_reference(q[:, 2:], k, v)
    torch.testing.assert_close(out[:, 2:], full)
    first, _ = attention_reference(q[:, :1], k[:, :3], v[:, :3])
    torch.testing.assert_close(out[:, :1], first)
