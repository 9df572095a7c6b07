"""Evoformer and extra-MSA blocks: shapes, padding invariance (values and gradients), backends agree
(torch / chunked / sdpa / triton under the interpreter; triton and flex on a GPU), checkpointed and chunked
runs equal plain ones and really checkpoint / chunk, the named MSA and pair transitions,
the ending-node / incoming modules equal the starting-node / outgoing ones on transposed input,
and the outer product mean and global column attention against their definitions."""
import contextlib
import copy

import pytest
import torch
from torch import nn

import attn_zoo.models.evoformer
import attn_zoo.models.pairformer
import attn_zoo.models.primitives
import attn_zoo.models.triangle
from attn_zoo.models.evoformer import (
    EvoformerBlock,
    EvoformerStack,
    ExtraMSABlock,
    ExtraMSAStack,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    MSATransition,
    OuterProductMean,
    PairTransition,
)
from attn_zoo.models.primitives import Transition
from attn_zoo.models.triangle import (
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
# flex's bias gradient uses atomics: it serves a trainable bias only with deterministic=False
FLEX = {"backend": "flex", "deterministic": False}


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


def spy_checkpoint(monkeypatch, blocks):
    """Wrap the ``torch.utils.checkpoint.checkpoint`` that ``attn_zoo.models.primitives.run_blocks`` calls (the real one
    still runs) and count block forwards. Returns ``(segments, forwards)``: ``segments`` holds, per checkpoint
    call, the indices of the blocks run inside it; ``forwards[i]`` counts block i's forward runs, so a
    checkpointed block shows 1 after the forward and 2 after the backward (its recompute)."""
    real = attn_zoo.models.primitives.torch.utils.checkpoint.checkpoint
    segments, forwards, inside = [], [0] * len(blocks), []

    def checkpoint(fn, *args, **kwargs):
        segments.append([])
        inside.append(True)
        try:
            return real(fn, *args, **kwargs)
        finally:
            inside.pop()

    def count(i):
        def hook(module, args):
            forwards[i] += 1
            if inside:
                segments[-1].append(i)
        return hook

    for i, blk in enumerate(blocks):
        blk.register_forward_pre_hook(count(i))
    monkeypatch.setattr(attn_zoo.models.primitives.torch.utils.checkpoint, "checkpoint", checkpoint)
    return segments, forwards


def spy_chunk_rows(monkeypatch):
    """Wrap ``chunk_rows`` in every models module that calls it (the real one still runs). Returns a list that
    gets, per call, the row counts of the slices its function was run on (a broadcast argument, row dim of size
    1, counts as no rows)."""
    real = attn_zoo.models.primitives.chunk_rows
    calls = []

    def chunk_rows(fn, args, dims, chunk_size, out_dim):
        rows = []
        calls.append(rows)

        def run(*part):
            rows.append(max(a.shape[d] for a, d in zip(part, dims) if a is not None and d is not None))
            return fn(*part)

        return real(run, args, dims, chunk_size, out_dim)

    for mod in (attn_zoo.models.primitives, attn_zoo.models.triangle, attn_zoo.models.evoformer, attn_zoo.models.pairformer):
        monkeypatch.setattr(mod, "chunk_rows", chunk_rows)
    return calls


def split_rows(n, chunk):
    """Row counts of the slices of n rows in chunks of ``chunk``: split_rows(7, 3) = [3, 3, 1]."""
    return [min(chunk, n - start) for start in range(0, n, chunk)]


def check_chunked(plain_calls, chunked_calls, chunk, calls_per_run):
    """The chunked run called every row-chunked sub-module on slices of ``chunk`` rows (each more than one
    slice); the plain run called the same sub-modules, each once on all its rows."""
    assert len(plain_calls) == len(chunked_calls) == calls_per_run, (len(plain_calls), len(chunked_calls))
    assert all(len(rows) == 1 for rows in plain_calls), plain_calls
    assert [sum(rows) for rows in chunked_calls] == [rows[0] for rows in plain_calls]
    for rows in chunked_calls:
        assert len(rows) > 1 and rows == split_rows(sum(rows), chunk), chunked_calls


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


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["chunked", "sdpa", "triton"])
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_backends_agree_with_torch(kind, backend):
    skip_unless_backend(backend)
    opts = {"chunk_size": 2} if backend == "chunked" else {}
    m, z, msa_mask, pair_mask = _inputs(S=3, N=5, seed=4)
    compare_backend_to_torch(
        lambda attn: _block(kind, attention={"backend": attn, **(opts if attn == backend else {})}),
        [m, z], [msa_mask, pair_mask], backend, seed=5,
    )


@pytest.mark.slow
def test_checkpointed_stack_equals_plain_with_dropout(monkeypatch):
    """Checkpointing recomputes the blocks in the backward with the same dropout masks. The checkpointed run
    really checkpoints: one torch.utils.checkpoint call per block (checkpoint_every=1), each block run again in
    the backward; the plain run calls it never and runs each block once."""
    m, z, msa_mask, pair_mask = _inputs(S=3, N=5, seed=6)
    results = []
    for every, want_segments, want_forwards in ((0, [], [1, 1]), (1, [[0], [1]], [2, 2])):
        stack = randomize_(EvoformerStack(**W, num_blocks=2, attention="torch", checkpoint_every=every,
                                          msa_dropout=0.3, pair_dropout=0.3), seed=7).double().train()
        segments, forwards = spy_checkpoint(monkeypatch, stack.blocks)
        mi, zi = m.clone().requires_grad_(), z.clone().requires_grad_()
        torch.manual_seed(11)
        m2, z2 = stack(mi, zi, msa_mask, pair_mask)
        assert segments == want_segments and forwards == [1, 1], (every, segments, forwards)
        weighted_sum([m2, z2]).backward()
        assert forwards == want_forwards, (every, forwards)
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


# row-chunked sub-modules per block: MSA row attention, MSA column attention (the extra-MSA block's global
# column attention is not chunked), MSA transition, outer product mean, 2 triangle multiplications, 2 triangle
# attentions, pair transition
CHUNKED_PER_BLOCK = {EvoformerStack: 9, ExtraMSAStack: 8}


@pytest.mark.parametrize("stack_cls", [EvoformerStack, ExtraMSAStack])
def test_chunked_stack_equals_plain(stack_cls, monkeypatch):
    """chunk_size=3 gives the plain result, and really chunks: every row-chunked sub-module of every block runs
    on slices of 3 rows (S = 4 MSA rows, N = 7 residues)."""
    m, z, msa_mask, pair_mask = _inputs(S=4, N=7, seed=8)
    plain = randomize_(stack_cls(**W, num_blocks=2, attention="torch"), seed=9).double().eval()
    plain.configure_inference(mode="plain")  # today's path, as the chunked stack below
    chunked = stack_cls(**W, num_blocks=2, attention="torch", chunk_size=3).double().eval()
    # today's row-chunked path (without grad in eval mode the stack would take the in-place one)
    chunked.configure_inference(mode="plain")
    chunked.load_state_dict(plain.state_dict())
    calls = spy_chunk_rows(monkeypatch)
    with torch.no_grad():
        a_m, a_z = plain(m, z, msa_mask, pair_mask)
        plain_calls = calls[:]
        del calls[:]
        b_m, b_z = chunked(m, z, msa_mask, pair_mask)
    assert rel_err(b_m, a_m) < 1e-13 and rel_err(b_z, a_z) < 1e-13
    check_chunked(plain_calls, calls, 3, 2 * CHUNKED_PER_BLOCK[stack_cls])


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


@contextlib.contextmanager
def _nan_filled_empty():
    """``torch.empty`` and friends return NaN-filled memory inside (PyTorch's deterministic mode)."""
    was = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0])
        torch.utils.deterministic.fill_uninitialized_memory = was[1]


@pytest.mark.parametrize("cls", [TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming])
def test_triangle_multiplication_padded_product_equals_unpadded(cls, monkeypatch):
    """Under torch.compile (fullgraph) the triangle product runs on zero-padded ``[N', N']`` matrices
    (``gemm_pad``: rows 16 bytes apart for cuBLAS's aligned kernels at odd N) and gives the unpadded eager
    module's values and gradients, with a pair mask with holes, every padded row and column dropped again."""
    g = torch.Generator().manual_seed(26)
    z = torch.randn(2, 7, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    pair_mask = torch.rand(2, 7, 7, generator=g) > 0.3
    mod = randomize_(cls(8, 4), seed=27).double()
    assert attn_zoo.models.triangle.gemm_pad(7, z.device) is None  # the CPU keeps the plain product
    assert attn_zoo.models.triangle.gemm_pad(299, torch.device("cuda")) == 5
    assert attn_zoo.models.triangle.gemm_pad(304, torch.device("cuda")) == 0
    assert attn_zoo.models.triangle.gemm_pad(63, torch.device("cuda")) == 0

    def run(fn):
        out = fn(z, pair_mask)
        return out, torch.autograd.grad(weighted_sum([out]), [z, *mod.parameters()])

    want, want_grads = run(mod)
    calls = []

    def cuda_rule(n, device, symbolic=False):  # gemm_pad as on CUDA
        calls.append(symbolic)
        return -n % 8 if symbolic or n >= 64 else 0

    monkeypatch.setattr(attn_zoo.models.triangle, "gemm_pad", lambda n, device, symbolic=False: cuda_rule(
        n + 64 if isinstance(n, int) else n, device, symbolic))  # 7 -> 71: padded
    graphs = []

    def backend(gm, example_inputs):  # the traced graph, run as it is
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    got, got_grads = run(torch.compile(mod, backend=backend, fullgraph=True))
    torch._dynamo.reset()
    assert calls == [True]  # the compiled form pads without a guard on N (eager PyTorch does not pad)
    assert len(graphs) == 1 and "pad" in graphs[0] and "narrow" in graphs[0]  # the product really is padded
    assert got.shape == want.shape and rel_err(got, want) < 1e-13
    for a, b in zip(got_grads, want_grads):
        assert rel_err(a, b, floor=1.0) < 1e-13


def test_triangle_multiplication_padding_adds_no_graph_per_length(monkeypatch):
    """Compiled for symbolic lengths (``dynamic=True``) with the CUDA padding rule, lengths that are and are not
    multiples of 8, above and below 64, share one graph, which pads."""
    monkeypatch.setattr(attn_zoo.models.triangle, "gemm_pad",
                        lambda n, device, symbolic=False: -n % 8 if symbolic or n >= 64 else 0)
    mod = TriangleMultiplicationOutgoing(8, 4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    run = torch.compile(mod, backend=backend, dynamic=True, fullgraph=True)
    for n in (67, 69, 72, 80, 40, 50):
        z = torch.randn(1, n, n, 8, requires_grad=True)
        run(z, torch.rand(1, n, n) > 0.3).sum().backward()
    torch._dynamo.reset()
    assert len(graphs) == 1 and "pad" in graphs[0], len(graphs)  # one padded graph for every length


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("masked", [True, False])
def test_gate_channels_first_kernel_matches_pytorch(dtype, masked):
    """The Triton gating pass (interpreter): ``sigmoid(gate) * proj * mask`` of a channels-last ``[B, N*N, 2*C2]``
    into channels-first ``[B, C2, M, M]`` with zeros past N (C2 = 40: a partial channel block; N = 5, M = 8), and
    its gradient, against PyTorch's ops; the output's padding is written, not left to the allocator."""
    from attn_zoo.models import kernels

    g = torch.Generator().manual_seed(40)
    n, m, c2 = 5, 8, 40
    y = torch.randn(2, n * n, 2 * c2, generator=g).to(dtype).requires_grad_(True)
    mask = (torch.rand(2, n * n, generator=g) > 0.3).to(dtype) if masked else None
    assert kernels.use_gate_kernel(y, force=True) and not kernels.use_gate_kernel(y)
    with _nan_filled_empty():
        got = kernels.gate_channels_first(y, mask, n, m)
    gate, proj = y.float().split(c2, dim=-1)
    want = torch.sigmoid(gate) * proj * (1.0 if mask is None else mask.float()[..., None])
    want = nn.functional.pad(want.transpose(1, 2).reshape(2, c2, n, n), (0, m - n, 0, m - n))
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert got.shape == (2, c2, m, m) and got.dtype == dtype and rel_err(got.float(), want) < tol
    grad = torch.randn(got.shape, generator=g).to(dtype)
    (dy,) = torch.autograd.grad(got, y, grad)
    if masked:  # a broadcast (stride 0) or wrongly shaped mask is refused by name, not read out of bounds
        with pytest.raises(ValueError, match="mask must be a contiguous"):
            kernels.gate_channels_first(y, mask[:1].expand(2, -1), n, m)
    with pytest.raises(ValueError, match="y must be a contiguous"):
        kernels.gate_channels_first(y.transpose(0, 1), mask, n, m)
    (want_dy,) = torch.autograd.grad(want, y, grad.float())
    assert rel_err(dy.float(), want_dy.float()) < tol


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", [TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming])
def test_triangle_multiplication_gating_kernel_path_equals_pytorch(cls, monkeypatch):
    """The eager CUDA form of the module (channels-last GEMM, the Triton gating pass writing the padded product's
    operands, the product on ``[N', N']`` matrices), run here on the interpreter with the padding forced, equals the
    plain module in fp32: values and gradients, with a pair mask with holes (also one broadcast over the batch) and
    without."""
    from attn_zoo.models import kernels

    g = torch.Generator().manual_seed(41)
    z2 = torch.randn(2, 7, 7, 8, generator=g, requires_grad=True)
    pair_mask = torch.rand(2, 7, 7, generator=g) > 0.3
    mod = randomize_(cls(8, 4), seed=42)
    # one leading element: the operands padded to 8; two: not padded (the product's slice would have three strided
    # row dims: layer_norm_out would copy it); the last mask broadcast over the batch
    for z, mask, m in ((z2[:1], pair_mask[:1], 8), (z2, pair_mask, 7), (z2[1:], None, 8), (z2, pair_mask[:1], 7)):
        monkeypatch.undo()
        want = mod(z, mask)
        want_grads = torch.autograd.grad(weighted_sum([want]), [z2, *mod.parameters()])
        monkeypatch.setattr(attn_zoo.models.triangle, "gemm_pad", lambda n, device, symbolic=False: -n % 8)
        monkeypatch.setattr(attn_zoo.models.triangle, "use_gate_kernel", lambda t: kernels.use_gate_kernel(t, True))
        calls = []
        real = kernels.gate_channels_first
        monkeypatch.setattr(attn_zoo.models.triangle, "gate_channels_first",
                            lambda *a: calls.append(a[2:]) or real(*a))
        with _nan_filled_empty():
            got = mod(z, mask)
            got_grads = torch.autograd.grad(weighted_sum([got]), [z2, *mod.parameters()])
        assert calls == [(7, m)]
        assert rel_err(got, want) < 1e-5
        for a, b in zip(got_grads, want_grads):
            assert rel_err(a, b, floor=1.0) < 1e-5


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


def test_msa_and_pair_transitions_are_the_af2_transitions():
    """MSATransition (AF2 Alg. 9) and PairTransition (Alg. 15) are the plain Transition with AF2's n = 4 by
    default: same parameters, the same outputs, chunked too."""
    g = torch.Generator().manual_seed(26)
    for cls, c in ((MSATransition, W["c_m"]), (PairTransition, W["c_z"])):
        named = randomize_(cls(c), seed=27).double()
        assert isinstance(named, Transition) and named.linear_1.out_features == 4 * c
        plain = Transition(c, n=4).double()
        plain.load_state_dict(named.state_dict())  # strict: the same keys and shapes
        x = torch.randn(1, 5, 7, c, generator=g, dtype=torch.float64)
        assert named(x).abs().max() > 1e-3  # randomized: not the zero update of the "final" init
        assert torch.equal(named(x), plain(x)) and torch.equal(named(x, chunk_size=2), plain(x, chunk_size=2))


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_block_builds_named_transitions_with_unchanged_state_dict(kind):
    """The blocks build MSATransition / PairTransition under the attribute names the plain Transitions had, so
    the state_dict keys (and saved checkpoints) are unchanged: a block with plain Transitions swapped back in
    has the same keys and shapes, loads strictly, and computes the same."""
    block = randomize_(_block(kind), seed=28).double()
    assert type(block.msa_transition) is MSATransition and type(block.pair_transition) is PairTransition
    assert block.msa_transition.linear_1.out_features == W["transition_n"] * W["c_m"]
    assert block.pair_transition.linear_1.out_features == W["transition_n"] * W["c_z"]
    assert [k for k in block.state_dict() if "transition" in k] == [
        f"{t}.{p}.{w}" for t in ("msa_transition", "pair_transition")
        for p in ("layer_norm", "linear_1", "linear_2") for w in ("weight", "bias")
    ]
    before = _block(kind).double()
    before.msa_transition = Transition(W["c_m"], W["transition_n"])  # what the blocks built before
    before.pair_transition = Transition(W["c_z"], W["transition_n"])
    before.double().load_state_dict(block.state_dict())
    assert [(k, v.shape) for k, v in before.state_dict().items()] == [
        (k, v.shape) for k, v in block.state_dict().items()
    ]
    m, z, msa_mask, pair_mask = _inputs(S=3, N=5, seed=29)
    for a, b in zip(block(m, z, msa_mask, pair_mask), before(m, z, msa_mask, pair_mask)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_block_traces_without_graph_break(kind):
    """Dynamo captures the whole block (chunked backend on CPU) in one graph: no graph break in the model code."""
    m, z, msa_mask, pair_mask = _inputs(S=3, N=5, seed=18, dtype=torch.float32)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_block(kind, attention="chunked"))(m, z, msa_mask, pair_mask)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming])
def test_triangle_multiplication_padded_on_gpu_matches_float64(cls):
    """At an odd N >= 64 the CUDA module multiplies zero-padded matrices (``gemm_pad``), eager (the Triton gating
    pass) and compiled (Inductor); in fp32 its output and every gradient match the float64 module on the CPU (the
    unpadded product) with a pair mask with holes."""
    n = 67
    assert attn_zoo.models.triangle.gemm_pad(n, torch.device("cuda")) == 5
    g = torch.Generator().manual_seed(28)
    z = torch.randn(1, n, n, 16, generator=g, dtype=torch.float64)
    pair_mask = torch.rand(1, n, n, generator=g) > 0.3
    mod = randomize_(cls(16, 8), seed=29).double()

    def run(dev, dtype, compiled):
        m = copy.deepcopy(mod).to(dev, dtype)
        zz = z.to(dev, dtype).requires_grad_(True)
        torch._dynamo.reset()
        out = (torch.compile(m, fullgraph=True) if compiled else m)(zz, pair_mask.to(dev))
        grads = torch.autograd.grad(weighted_sum([out]), [zz, *m.parameters()])
        torch._dynamo.reset()
        return out.cpu().double(), [t.cpu().double() for t in grads]

    want, want_grads = run("cpu", torch.float64, False)
    for compiled in (False, True):
        got, got_grads = run("cuda", torch.float32, compiled)
        assert rel_err(got, want) < 1e-5, compiled
        for a, b in zip(got_grads, want_grads):
            assert rel_err(a, b, floor=1.0) < 1e-5, compiled


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


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_triton_block_agrees_with_torch_on_gpu_in_bf16(kind):
    """On the GPU kernels (not the interpreter), under bf16 autocast: outputs and all gradients within the
    registry's bf16 tolerance of PyTorch's own bf16 error (vs float64). The extra-MSA block adds the global
    column attention (one query per head, k and v broadcast over heads)."""
    m, z, msa_mask, pair_mask = _inputs(S=8, N=40, seed=30)
    compare_backend_to_torch(lambda attn: _block(kind, attention=attn), [m, z], [msa_mask, pair_mask],
                             "triton", seed=31, device="cuda", autocast=torch.bfloat16)


@pytest.mark.gpu
def test_flex_block_agrees_with_torch_on_gpu():
    """The flex backend (compiled flex_attention) on the GPU, fp32: outputs and all gradients within the
    registry's tolerance of PyTorch's own fp32 error (vs float64). One compile per attention shape (MSA rows,
    MSA columns, triangle), so the sizes stay small."""
    m, z, msa_mask, pair_mask = _inputs(S=8, N=24, seed=32)
    torch._dynamo.reset()
    compare_backend_to_torch(lambda attn: _block("evoformer", attention=FLEX if attn == "flex" else attn),
                             [m, z], [msa_mask, pair_mask], "flex", seed=33, device="cuda")
