"""Evoformer and extra-MSA blocks: shapes, padding invariance (values and gradients), backends agree
(torch / chunked / triton under the interpreter), checkpointed and chunked runs equal plain ones,
the ending-node / incoming modules equal the starting-node / outgoing ones on transposed input,
and the outer product mean and global column attention against their definitions."""
import pytest
import torch

from models.evoformer import (
    EvoformerBlock,
    EvoformerStack,
    ExtraMSABlock,
    ExtraMSAStack,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    OuterProductMean,
)
from models.triangle import (
    TriangleAttentionEndingNode,
    _ChannelsLast,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)
from test_primitives import (
    compare_backend_to_torch,
    param_grads,
    randomize_,
    rel_err,
    skip_unless_backend,
    weighted_sum,
)

# Small widths; head dims 16 so that the triton backend (head dim >= 16) can serve every attention.
W = dict(c_m=16, c_z=8, num_heads_msa=2, c_hidden_msa=16, num_heads_pair=2, c_hidden_pair=16, c_hidden_opm=4,
         c_hidden_mul=8, transition_n=2)
BLOCKS = {"evoformer": EvoformerBlock, "extra_msa": ExtraMSABlock}


def _block(kind, attention="torch", dropout=0.0):
    return BLOCKS[kind](**W, msa_dropout=dropout, pair_dropout=dropout, attention=attention)


def _inputs(B=1, S=3, N=6, seed=0, hole_p=0.2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(B, S, N, W["c_m"], generator=g, dtype=dtype)
    z = torch.randn(B, N, N, W["c_z"], generator=g, dtype=dtype)
    msa_mask = torch.rand(B, S, N, generator=g) > hole_p
    res = torch.rand(B, N, generator=g) > hole_p
    res[:, :2] = True
    pair_mask = res[:, :, None] & res[:, None, :]
    assert not msa_mask.all() or hole_p == 0
    return m, z, msa_mask, pair_mask


def test_stack_shapes_dtypes_and_default_masks():
    m, z, msa_mask, pair_mask = _inputs(B=2, S=3, N=5, dtype=torch.float32)
    stack = EvoformerStack(**W, num_blocks=2, attention="torch")
    m2, z2 = stack(m, z, msa_mask, pair_mask)
    assert m2.shape == m.shape and z2.shape == z.shape and m2.dtype == z2.dtype == torch.float32
    m3, z3 = stack(m, z)  # no masks = every position real
    assert m3.shape == m.shape and torch.isfinite(z3).all()
    extra = ExtraMSAStack(**W, num_blocks=1, attention="chunked")
    e2, ez2 = extra(m, z, msa_mask, pair_mask)
    assert e2.shape == m.shape and ez2.shape == z.shape
    with pytest.raises(TypeError, match="msa_mask must be bool"):
        stack(m, z, msa_mask.float(), pair_mask)
    with pytest.raises(ValueError, match=r"pair_mask has shape \(2, 5, 4\)"):
        stack(m, z, msa_mask, pair_mask[..., :4])


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_padding_does_not_change_real_positions(kind):
    """Pad a real input with extra residues and MSA rows (random values, mask False): outputs at real
    positions and all parameter gradients of a loss on real positions are unchanged."""
    S, N, S_pad, N_pad = 3, 6, 5, 9
    m, z, msa_mask, pair_mask = _inputs(S=S, N=N, seed=1)
    mp, zp, msa_mask_p, pair_mask_p = _inputs(S=S_pad, N=N_pad, seed=2, hole_p=0.0)
    mp[:, :S, :N], zp[:, :N, :N] = m, z
    msa_mask_p[:] = False
    msa_mask_p[:, :S, :N] = msa_mask
    pair_mask_p[:] = False
    pair_mask_p[:, :N, :N] = pair_mask

    block = randomize_(_block(kind), seed=3).double()
    m_out, z_out = block(m, z, msa_mask, pair_mask)
    weighted_sum([m_out, z_out]).backward()
    grads = param_grads(block)
    block.zero_grad()
    mp_out, zp_out = block(mp, zp, msa_mask_p, pair_mask_p)
    weighted_sum([mp_out[:, :S, :N], zp_out[:, :N, :N]]).backward()
    grads_p = param_grads(block)

    assert rel_err(mp_out[:, :S, :N], m_out) < 1e-12
    assert rel_err(zp_out[:, :N, :N], z_out) < 1e-12
    assert grads.keys() == grads_p.keys() and len(grads) == len(list(block.parameters()))
    for name in grads:
        assert rel_err(grads_p[name], grads[name], floor=1.0) < 1e-10, name


@pytest.mark.parametrize("backend", ["chunked", "triton"])
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_backends_agree_with_torch(kind, backend):
    skip_unless_backend(backend)
    opts = {"chunk_size": 2} if backend == "chunked" else {}
    m, z, msa_mask, pair_mask = _inputs(S=3, N=5, seed=4)
    compare_backend_to_torch(
        lambda attn: _block(kind, attention={"backend": attn, **(opts if attn == backend else {})}),
        [m, z], [msa_mask, pair_mask], backend, seed=5,
    )


def test_checkpointed_stack_equals_plain_with_dropout():
    """Checkpointing recomputes the blocks in the backward with the same dropout masks."""
    m, z, msa_mask, pair_mask = _inputs(S=3, N=5, seed=6)
    results = []
    for every in (0, 1):
        stack = randomize_(EvoformerStack(**W, num_blocks=2, attention="torch", checkpoint_every=every,
                                          msa_dropout=0.3, pair_dropout=0.3), seed=7).double().train()
        mi, zi = m.clone().requires_grad_(), z.clone().requires_grad_()
        torch.manual_seed(11)
        m2, z2 = stack(mi, zi, msa_mask, pair_mask)
        weighted_sum([m2, z2]).backward()
        results.append((m2, z2, mi.grad, zi.grad, param_grads(stack)))
    (a_m, a_z, a_gm, a_gz, a_p), (b_m, b_z, b_gm, b_gz, b_p) = results
    for a, b in ((a_m, b_m), (a_z, b_z), (a_gm, b_gm), (a_gz, b_gz)):
        assert rel_err(b, a) < 1e-12
    assert a_p.keys() == b_p.keys()
    for name in a_p:
        assert rel_err(b_p[name], a_p[name], floor=1.0) < 1e-12, name
    # dropout really was on: a different seed gives a different result
    torch.manual_seed(12)
    stack.zero_grad()
    assert rel_err(stack(m, z, msa_mask, pair_mask)[1], a_z) > 1e-3


@pytest.mark.parametrize("stack_cls", [EvoformerStack, ExtraMSAStack])
def test_chunked_stack_equals_plain(stack_cls):
    m, z, msa_mask, pair_mask = _inputs(S=4, N=7, seed=8)
    plain = randomize_(stack_cls(**W, num_blocks=2, attention="torch"), seed=9).double().eval()
    chunked = stack_cls(**W, num_blocks=2, attention="torch", chunk_size=3).double().eval()
    chunked.load_state_dict(plain.state_dict())
    with torch.no_grad():
        a_m, a_z = plain(m, z, msa_mask, pair_mask)
        b_m, b_z = chunked(m, z, msa_mask, pair_mask)
    assert rel_err(b_m, a_m) < 1e-13 and rel_err(b_z, a_z) < 1e-13


def _transposed(t):
    return t.transpose(1, 2)


def test_ending_node_equals_starting_node_on_transposed_input():
    g = torch.Generator().manual_seed(10)
    z = torch.randn(2, 6, 6, 8, generator=g, dtype=torch.float64)
    pair_mask = torch.rand(2, 6, 6, generator=g) > 0.3  # not symmetric: the transpose matters
    start = randomize_(TriangleAttentionStartingNode(8, 16, 2, attention="torch"), seed=11).double()
    end = TriangleAttentionEndingNode(8, 16, 2, attention="torch").double()
    end.load_state_dict(start.state_dict())
    want = _transposed(start(_transposed(z), _transposed(pair_mask)))
    got = end(z, pair_mask)
    assert rel_err(got, want) < 1e-13
    assert rel_err(start(z, pair_mask), want) > 1e-3  # the transpose is not a no-op


def test_incoming_equals_outgoing_on_transposed_input():
    """incoming(z) = outgoing(z^T)^T with the a and b projections swapped."""
    g = torch.Generator().manual_seed(12)
    z = torch.randn(2, 6, 6, 8, generator=g, dtype=torch.float64)
    pair_mask = torch.rand(2, 6, 6, generator=g) > 0.3
    inc = randomize_(TriangleMultiplicationIncoming(8, 4), seed=13).double()
    out = TriangleMultiplicationOutgoing(8, 4).double()
    state = dict(inc.state_dict())
    for key in ("linear_ab_p.weight", "linear_ab_p.bias", "linear_ab_g.weight", "linear_ab_g.bias"):
        a, b = state[key].chunk(2, dim=0)
        state[key] = torch.cat([b, a], dim=0)
    out.load_state_dict(state)
    want = _transposed(out(_transposed(z), _transposed(pair_mask)))
    assert rel_err(inc(z, pair_mask), want) < 1e-13
    assert rel_err(inc(z, pair_mask), out(z, pair_mask)) > 1e-3


def test_triangle_matmul_output_gradient_comes_back_channels_first():
    """The channels-last view of the triangle matmul's output hands its gradient back contiguous [*, C, I, J]
    (the layout the matmul's backward multiplies), with the same values as a plain movedim."""
    g = torch.Generator().manual_seed(14)
    x = torch.randn(2, 4, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    y = _ChannelsLast.apply(x)
    assert torch.equal(y, x.movedim(-3, -1))
    grad_y = torch.randn(y.shape, generator=g, dtype=torch.float64)  # contiguous channels-last
    (grad_x,) = torch.autograd.grad(y, x, grad_y)
    assert grad_x.is_contiguous() and torch.equal(grad_x, grad_y.movedim(-1, -3))
    # torch.func transforms compose with it (per-sample gradients over a batch dim)
    per_sample = torch.func.vmap(torch.func.grad(lambda t: (_ChannelsLast.apply(t) * grad_y[0]).sum()))(x.detach())
    assert torch.equal(per_sample, grad_y[0].movedim(-1, -3).expand_as(x))


def test_triangle_attention_starting_node_matches_definition():
    """AF2 Alg. 13: o_ij = g_ij * sum_k softmax_k(q_ij . k_ik / sqrt(c) + b_jk, masked by mask_ik) v_ik."""
    g = torch.Generator().manual_seed(20)
    z = torch.randn(2, 5, 5, 8, generator=g, dtype=torch.float64)
    pair_mask = torch.rand(2, 5, 5, generator=g) > 0.3
    mod = randomize_(TriangleAttentionStartingNode(8, 16, 2, attention="torch"), seed=21).double()
    att = mod.mha
    zn = mod.layer_norm(z)
    q, k, v = (lin(zn).unflatten(-1, (2, 16)) for lin in (att.linear_q, att.linear_k, att.linear_v))  # [b,i,j,h,c]
    b = mod.linear_bias(zn)  # [b, j, k, h]
    logits = torch.einsum("bijhc,bikhc->bihjk", q, k) / 4.0 + b.permute(0, 3, 1, 2)[:, None]
    logits = logits.masked_fill(~pair_mask[:, :, None, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(logits, -1))
    o = torch.einsum("bihjk,bikhc->bijhc", p, v).flatten(-2) * torch.sigmoid(att.linear_g(zn))
    assert rel_err(mod(z, pair_mask), att.linear_o(o)) < 1e-13


def test_msa_row_attention_with_pair_bias_matches_definition():
    """AF2 Alg. 7: o_si = g_si * sum_j softmax_j(q_si . k_sj / sqrt(c) + b_ij, masked by msa_mask_sj) v_sj."""
    m, z, msa_mask, _ = _inputs(S=3, N=5, seed=24)
    mod = randomize_(MSARowAttentionWithPairBias(W["c_m"], W["c_z"], 16, 2, attention="torch"), seed=25).double()
    att = mod.mha
    mn = mod.layer_norm_m(m)
    q, k, v = (lin(mn).unflatten(-1, (2, 16)) for lin in (att.linear_q, att.linear_k, att.linear_v))  # [b,s,i,h,c]
    b = mod.linear_z(mod.layer_norm_z(z))  # [b, i, j, h]
    logits = torch.einsum("bsihc,bsjhc->bshij", q, k) / 4.0 + b.permute(0, 3, 1, 2)[:, None]
    logits = logits.masked_fill(~msa_mask[:, :, None, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(logits, -1))
    o = torch.einsum("bshij,bsjhc->bsihc", p, v).flatten(-2) * torch.sigmoid(att.linear_g(mn))
    assert rel_err(mod(m, z, msa_mask), att.linear_o(o)) < 1e-13


def test_triangle_multiplication_outgoing_matches_definition():
    """AF2 Alg. 11: x_ij = sum_k a_ik b_jk, a = sigmoid(gate) * proj (masked), out = g * Linear(LN(x))."""
    g = torch.Generator().manual_seed(22)
    z = torch.randn(2, 5, 5, 8, generator=g, dtype=torch.float64)
    pair_mask = torch.rand(2, 5, 5, generator=g) > 0.3
    mod = randomize_(TriangleMultiplicationOutgoing(8, 4), seed=23).double()
    zn = mod.layer_norm_in(z)
    ab = torch.sigmoid(mod.linear_ab_g(zn)) * mod.linear_ab_p(zn) * pair_mask[..., None]
    a, b = ab[..., :4], ab[..., 4:]
    x = torch.einsum("bikc,bjkc->bijc", a, b)
    want = torch.sigmoid(mod.linear_g(zn)) * mod.linear_z(mod.layer_norm_out(x))
    assert rel_err(mod(z, pair_mask), want) < 1e-13
    assert rel_err(mod(z, pair_mask, chunk_size=2), want) < 1e-13


@pytest.mark.parametrize("cls", [TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming])
def test_triangle_multiplication_compiled_form_equals_eager(cls):
    """The gated projection has a compiled form (channels-last GEMM, fused gate + transpose) and an eager one
    (channels-first baddbmm): under torch.compile (fullgraph, traced by Dynamo) the module equals eager, values
    and input/parameter gradients, with a pair mask with holes."""
    g = torch.Generator().manual_seed(24)
    z = torch.randn(2, 5, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    pair_mask = torch.rand(2, 5, 5, generator=g) > 0.3
    mod = randomize_(cls(8, 4), seed=25).double()
    torch._dynamo.reset()
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=True)
    results = []
    for run in (mod, compiled):
        out = run(z, pair_mask)
        loss = weighted_sum([out])
        grads = torch.autograd.grad(loss, [z, *mod.parameters()])
        results.append((out, grads))
    (want, want_grads), (got, got_grads) = results
    assert rel_err(got, want) < 1e-13
    for a, b in zip(got_grads, want_grads):
        assert rel_err(a, b, floor=1.0) < 1e-13


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_dropout_placement_follows_the_paper(kind):
    """Row-wise (mask shared over rows, dim -3) on MSA row attention, triangle multiplications and the
    starting node; column-wise (shared over columns, dim -2) on the ending node (AF2 Alg. 6)."""
    block = _block(kind, dropout=0.25)
    assert block.msa_dropout_row.shared_dim == -3 and block.pair_dropout_row.shared_dim == -3
    assert block.pair_dropout_col.shared_dim == -2
    assert block.msa_dropout_row.p == block.pair_dropout_row.p == block.pair_dropout_col.p == 0.25


def test_outer_product_mean_matches_definition():
    m, _, msa_mask, _ = _inputs(S=4, N=5, seed=14)
    opm = randomize_(OuterProductMean(W["c_m"], W["c_z"], 3), seed=15).double()
    w = msa_mask[..., None].double()
    mn = opm.layer_norm(m)
    a, b = opm.linear_a(mn) * w, opm.linear_b(mn) * w
    outer = torch.einsum("bsic,bsjd->bijcd", a, b).flatten(-2)
    count = torch.einsum("bsi,bsj->bij", w[..., 0], w[..., 0])[..., None]
    want = opm.linear_out(outer / (count + opm.eps))
    assert rel_err(opm(m, msa_mask), want) < 1e-13
    assert rel_err(opm(m, msa_mask, chunk_size=2), want) < 1e-13


def test_global_column_attention_matches_definition():
    m, _, msa_mask, _ = _inputs(S=4, N=5, seed=16)
    msa_mask[:, :, 0] = False  # a column with no real sequence: output gets only the projection bias
    mod = randomize_(MSAColumnGlobalAttention(W["c_m"], 16, 2, attention="torch"), seed=17).double()
    mt = mod.layer_norm(m.transpose(1, 2))  # [B, N, S, c]
    w = msa_mask.transpose(1, 2)[..., None].double()
    q = mod.linear_q((mt * w).sum(2) / (w.sum(2) + mod.eps)).unflatten(-1, (2, 16))  # [B, N, H, C]
    k, v = mod.linear_k(mt), mod.linear_v(mt)  # [B, N, S, C]
    logits = torch.einsum("bnhc,bnsc->bnhs", q, k) / 4.0
    logits = logits.masked_fill(w[..., 0][:, :, None, :] == 0, float("-inf"))
    p = torch.nan_to_num(torch.softmax(logits, -1))
    o = torch.einsum("bnhs,bnsc->bnhc", p, v).flatten(-2)[:, :, None, :]  # [B, N, 1, H*C]
    want = mod.linear_o(torch.sigmoid(mod.linear_g(mt)) * o).transpose(1, 2)
    assert rel_err(mod(m, msa_mask), want) < 1e-13


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_block_traces_without_graph_break(kind):
    """Dynamo captures the whole block (chunked backend on CPU) in one graph: no graph break in the model code."""
    m, z, msa_mask, pair_mask = _inputs(S=3, N=5, seed=18, dtype=torch.float32)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_block(kind, attention="chunked"))(m, z, msa_mask, pair_mask)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.gpu
def test_compiled_evoformer_block_with_triton_fullgraph():
    """torch.compile(fullgraph=True) raises on any graph break; compiled and eager agree in fp32."""
    torch.manual_seed(0)
    dev = "cuda"
    block = randomize_(_block("evoformer", attention="triton"), seed=1).to(dev)
    m, z, msa_mask, pair_mask = (t.to(dev) for t in _inputs(S=4, N=24, seed=19, dtype=torch.float32))
    m.requires_grad_(True)
    torch._dynamo.reset()
    cm, cz = torch.compile(block, fullgraph=True)(m, z, msa_mask, pair_mask)
    em, ez = block(m, z, msa_mask, pair_mask)
    (cm.sum() + cz.sum()).backward()
    assert torch.isfinite(m.grad).all()
    assert rel_err(cm, em) < 1e-4 and rel_err(cz, ez) < 1e-4
