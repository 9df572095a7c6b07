"""Pairformer: shapes, padding invariance (values and gradients), backends agree (torch / chunked / sdpa /
triton under the interpreter; triton and flex on a GPU), checkpointed and chunked runs equal plain ones and
really checkpoint / chunk, attention with pair bias against its definition; on a GPU, torch.compile(fullgraph=True)
of a block with the triton backend."""
import pytest
import torch

from attn_ops.reference import attention_reference
from attn_zoo.models.pairformer import AttentionPairBias, PairformerBlock, PairformerStack
from test_primitives import (
    compare_backend_to_torch,
    param_grads,
    randomize_,
    rel_err,
    skip_unless_backend,
    weighted_sum,
)
from test_evoformer import FLEX, check_chunked, spy_checkpoint, spy_chunk_rows

# head dims 16 (c_s / num_heads_single and c_hidden_pair) so that triton can serve every attention
W = dict(c_s=32, c_z=8, num_heads_single=2, num_heads_pair=2, c_hidden_pair=16, c_hidden_mul=8, transition_n=2)


def _inputs(B=1, N=6, seed=0, hole_p=0.2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, N, W["c_s"], generator=g, dtype=dtype)
    z = torch.randn(B, N, N, W["c_z"], generator=g, dtype=dtype)
    single_mask = torch.rand(B, N, generator=g) > hole_p
    single_mask[:, :2] = True
    pair_mask = (single_mask[:, :, None] & single_mask[:, None, :]) & (torch.rand(B, N, N, generator=g) > hole_p / 2)
    return s, z, single_mask, pair_mask


def test_shapes_and_bad_masks():
    s, z, single_mask, pair_mask = _inputs(B=2, N=5, dtype=torch.float32)
    stack = PairformerStack(**W, num_blocks=2, attention="torch")
    s2, z2 = stack(s, z, single_mask, pair_mask)
    assert s2.shape == s.shape and z2.shape == z.shape and s2.dtype == torch.float32
    s3, _ = stack(s, z)
    assert torch.isfinite(s3).all()
    with pytest.raises(TypeError, match="single_mask must be bool"):
        stack(s, z, single_mask.int(), pair_mask)
    with pytest.raises(ValueError, match=r"s \(2, 5, 32\).*z \(2, 4, 4, 8\)"):
        stack(s, z[:, :4, :4])


def test_padding_does_not_change_real_positions():
    N, N_pad = 6, 9
    s, z, single_mask, pair_mask = _inputs(N=N, seed=1)
    sp, zp, single_mask_p, pair_mask_p = _inputs(N=N_pad, seed=2, hole_p=0.0)
    sp[:, :N], zp[:, :N, :N] = s, z
    single_mask_p[:] = False
    single_mask_p[:, :N] = single_mask
    pair_mask_p[:] = False
    pair_mask_p[:, :N, :N] = pair_mask

    block = randomize_(PairformerBlock(**W, attention="torch", pair_dropout=0.0), seed=3).double()
    s_out, z_out = block(s, z, single_mask, pair_mask)
    weighted_sum([s_out, z_out]).backward()
    grads = param_grads(block)
    block.zero_grad()
    sp_out, zp_out = block(sp, zp, single_mask_p, pair_mask_p)
    weighted_sum([sp_out[:, :N], zp_out[:, :N, :N]]).backward()
    grads_p = param_grads(block)

    assert rel_err(sp_out[:, :N], s_out) < 1e-12
    assert rel_err(zp_out[:, :N, :N], z_out) < 1e-12
    assert grads.keys() == grads_p.keys() and len(grads) == len(list(block.parameters()))
    for name in grads:
        assert rel_err(grads_p[name], grads[name], floor=1.0) < 1e-10, name


@pytest.mark.parametrize("backend", ["chunked", "sdpa", "triton"])
def test_backends_agree_with_torch(backend):
    skip_unless_backend(backend)
    opts = {"chunk_size": 2} if backend == "chunked" else {}
    s, z, single_mask, pair_mask = _inputs(N=5, seed=4)
    compare_backend_to_torch(
        lambda attn: PairformerBlock(**W, attention={"backend": attn, **(opts if attn == backend else {})}),
        [s, z], [single_mask, pair_mask], backend, seed=5,
    )


@pytest.mark.slow
def test_checkpointed_stack_equals_plain_with_dropout(monkeypatch):
    """Checkpointing every 2 of 3 blocks gives the plain run's values and gradients (same dropout masks in the
    recompute), and really checkpoints: two torch.utils.checkpoint segments, blocks [0, 1] and [2], every block
    run again in the backward; the plain run never checkpoints and runs each block once."""
    s, z, single_mask, pair_mask = _inputs(N=5, seed=6)
    results = []
    for every, want_segments, want_forwards in ((0, [], [1, 1, 1]), (2, [[0, 1], [2]], [2, 2, 2])):
        stack = randomize_(PairformerStack(**W, num_blocks=3, attention="torch", checkpoint_every=every,
                                           pair_dropout=0.3), seed=7).double().train()
        segments, forwards = spy_checkpoint(monkeypatch, stack.blocks)
        si, zi = s.clone().requires_grad_(), z.clone().requires_grad_()
        torch.manual_seed(11)
        s2, z2 = stack(si, zi, single_mask, pair_mask)
        assert segments == want_segments and forwards == [1, 1, 1], (every, segments, forwards)
        weighted_sum([s2, z2]).backward()
        assert forwards == want_forwards, (every, forwards)
        results.append((s2, z2, si.grad, zi.grad, param_grads(stack)))
    (*a, a_p), (*b, b_p) = results
    for x, y in zip(a, b):
        assert rel_err(y, x) < 1e-12
    assert a_p.keys() == b_p.keys()
    for name in a_p:
        assert rel_err(b_p[name], a_p[name], floor=1.0) < 1e-12, name


def test_chunked_stack_equals_plain(monkeypatch):
    """chunk_size=3 gives the plain result, and really chunks: each block's 2 triangle multiplications, 2 triangle
    attentions, pair transition, attention with pair bias (over queries) and single transition run on slices of
    3 of the N = 7 rows."""
    s, z, single_mask, pair_mask = _inputs(N=7, seed=8)
    plain = randomize_(PairformerStack(**W, num_blocks=2, attention="torch"), seed=9).double().eval()
    plain.configure_inference(mode="plain")  # today's path, as the chunked stack below
    chunked = PairformerStack(**W, num_blocks=2, attention="torch", chunk_size=3).double().eval()
    # today's row-chunked path (without grad in eval mode the stack would take the in-place one)
    chunked.configure_inference(mode="plain")
    chunked.load_state_dict(plain.state_dict())
    calls = spy_chunk_rows(monkeypatch)
    with torch.no_grad():
        a_s, a_z = plain(s, z, single_mask, pair_mask)
        plain_calls = calls[:]
        del calls[:]
        b_s, b_z = chunked(s, z, single_mask, pair_mask)
    assert rel_err(b_s, a_s) < 1e-13 and rel_err(b_z, a_z) < 1e-13
    check_chunked(plain_calls, calls, 3, 2 * 7)


def test_attention_pair_bias_matches_definition():
    s, z, single_mask, _ = _inputs(N=6, seed=10)
    mod = randomize_(AttentionPairBias(W["c_s"], W["c_z"], 2, attention="torch"), seed=11).double()
    att = mod.mha
    sn = mod.layer_norm_s(s)
    heads = lambda x: x.unflatten(-1, (2, 16)).transpose(1, 2)  # noqa: E731  [B, H, N, C]
    bias = mod.linear_z(mod.layer_norm_z(z)).permute(0, 3, 1, 2)  # [B, H, N, N]
    o, _ = attention_reference(heads(att.linear_q(sn)), heads(att.linear_k(sn)), heads(att.linear_v(sn)),
                               bias, single_mask[:, None, None, :])
    want = att.linear_o(o.transpose(1, 2).flatten(-2) * torch.sigmoid(att.linear_g(sn)))
    assert att.linear_q.bias is not None and att.linear_o.bias is None
    assert rel_err(mod(s, z, single_mask), want) < 1e-13


def test_dropout_placement_follows_the_paper():
    """AF3 Alg. 17: row-wise dropout (shared over rows) on the triangle multiplications and the starting
    node, column-wise on the ending node, none on the single track."""
    block = PairformerBlock(**W, pair_dropout=0.25)
    assert block.pair_dropout_row.shared_dim == -3 and block.pair_dropout_col.shared_dim == -2
    assert block.pair_dropout_row.p == block.pair_dropout_col.p == 0.25
    s, z, single_mask, pair_mask = _inputs(N=5, seed=15, dtype=torch.float32)
    randomize_(block).train()
    torch.manual_seed(0)
    s1, _ = block(s, z, single_mask, pair_mask)
    torch.manual_seed(1)
    s2, z2 = block(s, z, single_mask, pair_mask)
    assert not torch.equal(s1, s2)  # dropout is on (through z)
    block.eval()
    assert torch.equal(block(s, z, single_mask, pair_mask)[1], block(s, z, single_mask, pair_mask)[1])


def test_block_traces_without_graph_break_under_autocast():
    """Dynamo captures the whole block in one graph, also under bf16 autocast (our LayerNorm queries the
    autocast state): no graph break in the model code (chunked backend on CPU)."""
    s, z, single_mask, pair_mask = _inputs(N=6, seed=12, dtype=torch.float32)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(PairformerBlock(**W, attention="chunked"))(s, z, single_mask, pair_mask)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.slow
def test_block_compiles_once_for_variable_lengths():
    """Proteins differ in length: torch.compile(dynamic=True, fullgraph=True) of the block with the triton backend
    (interpreter on CPU) traces one graph on symbolic sizes that matches eager at two lengths."""
    skip_unless_backend("triton")
    from torch._dynamo.testing import CompileCounterWithBackend

    block = randomize_(PairformerBlock(**W, attention="triton"), seed=16).eval()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for n in (7, 10):
        s, z, single_mask, pair_mask = _inputs(N=n, seed=n, dtype=torch.float32)
        for got, want in zip(compiled(s, z, single_mask, pair_mask), block(s, z, single_mask, pair_mask)):
            assert rel_err(got, want) < 1e-6
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[1] == frames[0], f"recompiled for a new length: graphs after each {frames}"


@pytest.mark.gpu
def test_compiled_block_with_triton_has_no_graph_break():
    """torch.compile(fullgraph=True) raises on any graph break; the compiled block must match eager."""
    torch.manual_seed(0)
    dev = "cuda"
    block = PairformerBlock(c_s=64, c_z=32, num_heads_single=4, num_heads_pair=2, c_hidden_pair=16,
                            c_hidden_mul=32, pair_dropout=0.0, attention="triton")
    block = randomize_(block, seed=1).to(dev)
    N = 40
    s = torch.randn(1, N, 64, device=dev, requires_grad=True)
    z = torch.randn(1, N, N, 32, device=dev, requires_grad=True)
    single_mask = torch.rand(1, N, device=dev) > 0.2
    pair_mask = single_mask[:, :, None] & single_mask[:, None, :]
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    cs, cz = compiled(s, z, single_mask, pair_mask)
    es, ez = block(s, z, single_mask, pair_mask)
    (cs.sum() + cz.sum()).backward()
    assert s.grad is not None and torch.isfinite(s.grad).all() and torch.isfinite(z.grad).all()
    # fp32: eager and compiled run the same attention kernels; Inductor only reorders fp32 sums elsewhere
    assert rel_err(cs, es) < 1e-4 and rel_err(cz, ez) < 1e-4


@pytest.mark.gpu
def test_block_compiles_once_for_variable_lengths_on_gpu():
    """Inductor with dynamic shapes on the GPU kernels, two lengths: forward and backward agree with eager (fp32).
    (Recompilation is checked by the CPU test.)"""
    torch.manual_seed(0)
    block = randomize_(PairformerBlock(c_s=64, c_z=32, num_heads_single=4, num_heads_pair=2, c_hidden_pair=16,
                                       c_hidden_mul=32, pair_dropout=0.0, attention="triton"), seed=2).cuda()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for n in (37, 45):
        s = torch.randn(1, n, 64, device="cuda", requires_grad=True)
        z = torch.randn(1, n, n, 32, device="cuda", requires_grad=True)
        single_mask = torch.rand(1, n, device="cuda") > 0.2
        pair_mask = single_mask[:, :, None] & single_mask[:, None, :]
        cs, cz = compiled(s, z, single_mask, pair_mask)
        got = torch.autograd.grad(cs.sum() + cz.sum(), (s, z))
        es, ez = block(s, z, single_mask, pair_mask)
        want = torch.autograd.grad(es.sum() + ez.sum(), (s, z))
        assert rel_err(cs, es) < 1e-4 and rel_err(cz, ez) < 1e-4
        assert all(rel_err(a, b) < 1e-4 for a, b in zip(got, want))


@pytest.mark.gpu
def test_triton_block_agrees_with_torch_on_gpu_in_bf16():
    """On the GPU kernels (not the interpreter), under bf16 autocast: outputs and all gradients within the
    registry's bf16 tolerance of PyTorch's own bf16 error (vs float64)."""
    s, z, single_mask, pair_mask = _inputs(N=40, seed=13)
    compare_backend_to_torch(lambda attn: PairformerBlock(**W, attention=attn), [s, z], [single_mask, pair_mask],
                             "triton", seed=14, device="cuda", autocast=torch.bfloat16)


@pytest.mark.gpu
def test_flex_block_agrees_with_torch_on_gpu():
    """The flex backend (compiled flex_attention) on the GPU, fp32: outputs and all gradients within the
    registry's tolerance of PyTorch's own fp32 error (vs float64). Two compiles: triangle and single attention."""
    s, z, single_mask, pair_mask = _inputs(N=24, seed=17)
    torch._dynamo.reset()
    compare_backend_to_torch(lambda attn: PairformerBlock(**W, attention=FLEX if attn == "flex" else attn),
                             [s, z], [single_mask, pair_mask], "flex", seed=18, device="cuda")
