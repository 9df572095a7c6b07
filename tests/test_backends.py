"""Every CPU-capable backend against the float64 reference: outputs, lse and gradients of q, k, v, bias
(including a loss on lse), broadcast biases, masks with holes, fully masked rows, causal with Lq != Lk,
odd sizes. Tolerances come from the registry (relative to plain PyTorch's own error)."""
import pytest
import torch

import attn_ops
from helpers import check_against_reference, empty_some_rows, make_inputs

# (batch, H, Lq, Lk, D, bias shape, mask shape, causal)
CASES = {
    "pair-bias-over-rows": ((2, 3), 2, 37, 37, 24, (2, 1, 2, 37, 37), (2, 3, 1, 1, 37), False),
    "bias-[1,H,L,L]": ((2,), 3, 19, 19, 16, (1, 3, 19, 19), (2, 1, 1, 19), False),
    "bias-[H,1,Lk]": ((2,), 2, 11, 23, 8, (2, 1, 23), None, False),
    "full-bias-causal-Lq<Lk": ((2,), 2, 13, 29, 24, (2, 2, 13, 29), None, True),
    "causal-Lq>Lk-masked": ((2,), 2, 17, 9, 16, (2, 17, 9), (2, 1, 1, 9), True),
    "no-batch-no-bias": ((), 2, 21, 33, 16, None, (21, 33), False),
}


def _case(name, dtype, seed=0, grad=True):
    batch, h, lq, lk, d, bshape, mshape, causal = CASES[name]
    q, k, v, bias, mask = make_inputs(batch, h, lq, lk, d, dtype=dtype, bias_shape=bshape, mask_shape=mshape,
                                      seed=seed, requires_grad=grad)
    if mask is not None:
        empty_some_rows(mask)
    return q, k, v, bias, mask, causal


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_chunked_matches_reference(name, dtype):
    q, k, v, bias, mask, causal = _case(name, dtype)
    check_against_reference("chunked", q, k, v, bias, mask, causal=causal, chunk_size=7)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
def test_sdpa_matches_reference(name, dtype):
    q, k, v, bias, mask, causal = _case(name, dtype, seed=2)
    check_against_reference("sdpa", q, k, v, bias, mask, causal=causal)


@pytest.mark.parametrize("name", list(CASES))
def test_flex_forward_matches_reference_on_cpu(name):
    # flex has no backward on CPU; its gradients are checked by the GPU tests.
    batch, h, lq, lk, d, *_ = CASES[name]
    if d < 16:
        pytest.skip("flex needs head dim >= 16")
    q, k, v, bias, mask, causal = _case(name, torch.float32, seed=3, grad=False)
    check_against_reference("flex", q, k, v, bias, mask, causal=causal)


def test_chunk_size_does_not_change_result():
    q, k, v, bias, mask, causal = _case("pair-bias-over-rows", torch.float64, seed=4)
    outs = [attn_ops.attention(q, k, v, bias, mask, backend="chunked", chunk_size=c) for c in (1, 5, 64)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-12, atol=1e-12)


def test_auto_picks_chunked_on_cpu_and_sdpa_cannot_give_lse():
    from attn_ops import registry
    from attn_ops.inputs import describe

    q, k, v, bias, mask, causal = _case("bias-[1,H,L,L]", torch.float32)
    info = describe(q, k, v, bias.reshape(1, *bias.shape), mask, False, True, True)
    assert registry.select("auto", info).name == "chunked"
    assert "does not return lse" in registry.not_supported_reasons("sdpa", info)
    with pytest.raises(ValueError, match="sdpa: does not return lse"):
        attn_ops.attention(q, k, v, bias, mask, backend="sdpa", return_lse=True)


def test_deterministic_chunked_backward_is_bitwise_repeatable():
    q, k, v, bias, mask, causal = _case("pair-bias-over-rows", torch.float32, seed=5)
    runs = []
    for _ in range(2):
        out, lse = attn_ops.attention(q, k, v, bias, mask, backend="chunked", return_lse=True, chunk_size=8)
        runs.append(torch.autograd.grad(out.sum() + lse[torch.isfinite(lse)].sum(), (q, k, v, bias)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_dispatch_traces_under_torch_compile_without_graph_breaks():
    # The registry's choice must be plain Python that Dynamo can trace (no importlib in the call path).
    q, k, v, bias, mask, causal = _case("pair-bias-over-rows", torch.float32, seed=6)

    def f(q, k, v, bias):
        out, lse = attn_ops.attention(q, k, v, bias, mask, return_lse=True, backend="auto", chunk_size=16)
        return out.sum() + lse[torch.isfinite(lse)].sum()

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, bias), f(q, k, v, bias))


def test_sdpa_does_not_copy_a_bias_shared_by_every_batch_dim(monkeypatch):
    import torch.nn.functional as F

    seen = {}
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen["mask_shape"] = tuple(attn_mask.shape)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v, bias, _ = make_inputs((1, 5), 2, 6, 6, 16, bias_shape=(1, 1, 2, 6, 6), seed=12)
    attn_ops.attention(q, k, v, bias, backend="sdpa")
    assert seen["mask_shape"] == (1, 2, 6, 6)  # broadcast by SDPA over the 5 rows, not copied 5 times


def test_auto_on_cuda_keeps_sdpa_for_inference_and_deterministic_training_off_it():
    from dataclasses import replace

    from attn_ops import registry
    from attn_ops.inputs import describe

    q, k, v, _, _, _ = _case("no-batch-no-bias", torch.float32)
    cpu = describe(q, k, v, None, None, True, False, True)
    cuda = replace(cpu, device="cuda")
    assert not registry.not_supported_reasons("sdpa", cpu)  # CPU kernels: deterministic
    assert "backward is not deterministic on cuda" in " ".join(registry.not_supported_reasons("sdpa", cuda))
    assert not registry.not_supported_reasons("sdpa", replace(cuda, deterministic=False))
    assert not registry.not_supported_reasons("sdpa", replace(cuda, needs_grad=False))
