"""The rotary kernels (``models.kernels.rotary_qk``) against their PyTorch reference and the blocks' own rotary code:
outputs and the gradients of the input and of the norm weights, q and k in one launch, shared and per-row tables."""
import pytest
import torch

from attn_zoo.models import kernels
from attn_zoo.models.esm2 import RotaryEmbedding
from attn_zoo.models.esmc import _rotary_tables


def _tables(L, D, B=None, g=None):
    cos, sin = RotaryEmbedding(D).tables(L, torch.device("cpu"))
    if B is None:
        return cos, sin
    pos = torch.randint(0, L, (B, L), generator=g)  # packed rows: positions restart inside a row
    return cos[pos].contiguous(), sin[pos].contiguous()


def _fused_view(B, L, G, C, dtype, g):
    """q, k (and v) of one fused projection ``[B, L, 3C + 5]``: the kernels read the [B, L, G, C] view in place."""
    y = (torch.randn(B, L, 3 * C + 5, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    return y, y[..., : G * C].unflatten(-1, (G, C))


@pytest.mark.interpreter
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("G,per_row", [(2, False), (1, True), (2, True)])
def test_rotary_kernel_matches_reference(norm, G, per_row):
    g = torch.Generator().manual_seed(3)
    B, L, H, D = 2, 7, 3, 8
    C = H * D
    y, x = _fused_view(B, L, G, C, torch.float32, g)
    cos, sin = _tables(L, D, B if per_row else None, g)
    w = (1 + 0.3 * torch.randn(G, C, generator=g)).requires_grad_() if norm else None
    scales = (0.5, 1.0)
    out = kernels.rotary_qk(x, cos, sin, H, w, 1e-5, scales, force=True)
    assert out.shape == (G, B, L, C) and out.is_contiguous()
    ref = kernels.rotary_qk_reference(x.double(), cos.double(), sin.double(), H,
                                      None if w is None else w.double(), 1e-5, scales, torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    dout = torch.randn(out.shape, generator=g)
    wrt = [y] + ([w] if norm else [])
    got = torch.autograd.grad(out, wrt, dout)
    want = torch.autograd.grad(ref, wrt, dout.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)
    if norm:  # the weight gradient is summed in a fixed order: the same bits every run
        again = torch.autograd.grad(kernels.rotary_qk(x, cos, sin, H, w, 1e-5, scales, force=True), [w], dout)
        assert torch.equal(again[0], got[1])


@pytest.mark.interpreter
def test_rotary_kernel_half_precision_within_reference_noise():
    """fp16 in and out: the kernel (float32 inside, one rounding) is no further from the float64 result than the
    reference run in fp16's own output rounding."""
    g = torch.Generator().manual_seed(5)
    B, L, H, D = 3, 9, 2, 16
    C = H * D
    _, x = _fused_view(B, L, 2, C, torch.float16, g)
    cos, sin = _tables(L, D)
    w = (1 + 0.3 * torch.randn(2, C, generator=g)).half()
    out = kernels.rotary_qk(x, cos, sin, H, w, force=True)
    exact = kernels.rotary_qk_reference(x.double(), cos.double(), sin.double(), H, w.double(), out_dtype=torch.float64)
    rounded = exact.half().double()
    assert (out.double() - exact).abs().max() <= 1.01 * (rounded - exact).abs().max() + 1e-6


def test_reference_is_the_blocks_rotary():
    """ESM-2's (q scaled, then rotated) and ESM C's (q/k layer norm, then rotated) own code give the reference's
    result, so the models keep their parity with fair-esm and Hugging Face whichever path runs."""
    g = torch.Generator().manual_seed(1)
    B, L, H, D = 2, 6, 2, 8
    C = H * D
    q, k = torch.randn(B, L, C, generator=g), torch.randn(B, L, C, generator=g)
    x = torch.stack([q, k], 2)
    rot = RotaryEmbedding(D)

    def heads(t):
        return t.unflatten(-1, (H, D)).transpose(1, 2)

    q2, k2 = rot(heads(q * D ** -0.5), heads(k))
    out = kernels.rotary_qk_reference(x, *rot.tables(L, torch.device("cpu")), H, scales=(D ** -0.5, 1.0))
    torch.testing.assert_close(heads(out[0]), q2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(heads(out[1]), k2, rtol=1e-6, atol=1e-6)
    wq, wk = 1 + torch.randn(C, generator=g), 1 + torch.randn(C, generator=g)
    cos, sin = _rotary_tables(L, D, 10000.0, torch.device("cpu"))
    nq = torch.nn.functional.layer_norm(q, (C,), wq)
    want = heads(nq) * cos + kernels._rotate_half(heads(nq)) * sin
    out = kernels.rotary_qk_reference(x, cos, sin, H, torch.stack([wq, wk]))
    torch.testing.assert_close(heads(out[0]), want, rtol=1e-6, atol=1e-6)


@pytest.mark.interpreter
def test_rotary_declines_what_it_cannot_serve():
    """Off CUDA unless forced, for float64 or strided tables: the reference's result; shapes that do not fit: a
    ValueError naming the argument."""
    g = torch.Generator().manual_seed(2)
    cos, sin = _tables(5, 8)
    x = torch.randn(2, 5, 2, 16, generator=g)
    calls = []
    real = kernels._RotaryQK.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels._RotaryQK, "apply", lambda *a: calls.append(1) or real(*a))
        kernels.rotary_qk(x, cos, sin, 2)  # CPU, not forced
        kernels.rotary_qk(x.double(), cos, sin, 2, force=True)
        kernels.rotary_qk(x, cos.t().contiguous().t(), sin, 2, force=True)  # tables not contiguous
        three = torch.randn(2, 5, 3, 16, generator=g)  # the kernels write two groups
        torch.testing.assert_close(kernels.rotary_qk(three, cos, sin, 2, force=True),
                                   kernels.rotary_qk_reference(three, cos, sin, 2))
        assert not calls
        kernels.rotary_qk(x, cos, sin, 2, force=True)
        assert calls
    with pytest.raises(ValueError, match=r"cos and sin must be \[L, D\].*got \(5, 8\)"):
        kernels.rotary_qk(torch.randn(2, 6, 2, 16), cos, sin, 2)  # 6 rows, tables of 5
    with pytest.raises(ValueError, match="even head dim"):
        kernels.rotary_qk(torch.randn(2, 5, 2, 12), cos, sin, 4)
    with pytest.raises(ValueError, match=r"weight must be \[G, C\] = \[2, 16\]"):
        kernels.rotary_qk(x, cos, sin, 2, torch.ones(16))
    empty = torch.randn(0, 5, 2, 16, requires_grad=True)
    w = torch.ones(2, 16, requires_grad=True)
    out = kernels.rotary_qk(empty, cos, sin, 2, w, force=True)
    dx, dw = torch.autograd.grad(out, [empty, w], torch.ones_like(out))
    assert out.shape == (2, 0, 5, 16) and torch.equal(dw, torch.zeros(2, 16))


def _recording_backend(graphs):
    """A torch.compile backend that keeps AOT autograd's forward and backward graphs in ``graphs`` and runs them."""
    from torch._dynamo.backends.common import aot_autograd

    def record(fx, inputs):
        graphs.append(fx)
        return fx
    return aot_autograd(fw_compiler=record, bw_compiler=record)


def _case(seed, B, L, H, D, norm):
    """(generator, C, the fused projection and its q/k view, shared tables, a norm weight or None), float32."""
    g = torch.Generator().manual_seed(seed)
    C = H * D
    fused = _fused_view(B, L, 2, C, torch.float32, g)
    w = (1 + 0.3 * torch.randn(2, C, generator=g)).requires_grad_() if norm else None
    return g, C, fused, _tables(L, D), w


@pytest.mark.interpreter
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_custom_ops_opcheck(norm):
    """The compile path's custom ops: schema, fake impls (shapes, dtypes, strides) and autograd registration checked
    by ``torch.library.opcheck`` on the interpreter."""
    H = 2
    g, C, (y, x), (cos, sin), w = _case(6, 2, 5, H, 8, norm)
    args = (x, cos, sin, w, 1e-5, 0.5, 1.0, H, torch.float16)
    torch.library.opcheck(torch.ops.attn_zoo.rotary_qk_fwd, args)
    out, stats = torch.ops.attn_zoo.rotary_qk_fwd(*args)
    dy = torch.randn(out.shape, generator=g).half()
    w = None if w is None else w.detach()  # (the backward is first order: no autograd of its own)
    torch.library.opcheck(torch.ops.attn_zoo.rotary_qk_bwd, (dy, x.detach(), w, cos, sin, stats, 0.5, 1.0, H))


@pytest.mark.interpreter
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_under_compile_runs_the_kernels(norm):
    """Under torch.compile the custom op runs the eager Function's launches: the same bits forward and backward, with
    q and k read in place from the fused projection's view (no copy in the graph before the op)."""
    H = 3
    g, C, (y, _), (cos, sin), w = _case(7, 2, 6, H, 8, norm)
    graphs = []
    backend = _recording_backend(graphs)

    def f(y, w):
        x = y[..., : 2 * C].unflatten(-1, (2, C))
        return kernels.rotary_qk(x, cos, sin, H, w, 1e-5, (0.25, 1.0), force=True)

    eager = f(y, w)
    compiled = torch.compile(f, backend=backend, fullgraph=True)(y, w)
    assert torch.equal(compiled, eager)
    dout = torch.randn(eager.shape, generator=g)
    wrt = [y] + ([w] if norm else [])
    for a, b in zip(torch.autograd.grad(compiled, wrt, dout), torch.autograd.grad(eager, wrt, dout)):
        assert torch.equal(a, b)
    targets = [str(n.target) for fx in graphs for n in fx.graph.nodes if n.op == "call_function"]
    assert "attn_zoo.rotary_qk_fwd.default" in targets and "attn_zoo.rotary_qk_bwd.default" in targets
    assert not any("clone" in t or "contiguous" in t for t in targets), targets


def _qkv_reference(y, C, cos, sin, H, w, scales):
    """rotary_qkv's definition in float64: q, k by the PyTorch reference on the fused view, v its slice."""
    qkv = y.double()[..., : 3 * C].unflatten(-1, (3, C))
    q, k = kernels.rotary_qk_reference(qkv[:, :, :2], cos.double(), sin.double(), H,
                                       None if w is None else w.double(), 1e-5, scales, torch.float64)
    return q, k, qkv[:, :, 2]


@pytest.mark.interpreter
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("time_first,per_row", [(False, False), (True, False), (False, True)])
def test_rotary_qkv_kernels_match_reference(norm, time_first, per_row):
    """q, k rotated and v copied in one launch, the fused projection's whole gradient (q's, k's, v's parts, zeros in
    the padding) in one: against the float64 definition, a fused width with 5 padding columns, a time-first
    projection (fair-esm's [L, B, E]) and per-row tables; v's gradient is copied exactly. With a norm (the view
    path: ``rotary_qk``'s kernels on the view) the same results."""
    g = torch.Generator().manual_seed(9)
    B, L, H, D = 2, 7, 3, 8
    C = H * D
    shape = (L, B, 3 * C + 5) if time_first else (B, L, 3 * C + 5)
    leaf = (torch.randn(shape, generator=g) * 2 + 0.5).requires_grad_()
    y = leaf.transpose(0, 1) if time_first else leaf
    cos, sin = _tables(L, D, B if per_row else None, g)
    w = (1 + 0.3 * torch.randn(2, C, generator=g)).requires_grad_() if norm else None
    scales = (0.5, 1.0)
    calls = []
    real = kernels._RotaryQKV.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels._RotaryQKV, "apply", lambda *a: calls.append(1) or real(*a))
        got = kernels.rotary_qkv(y, C, cos, sin, H, w, 1e-5, scales, force=True)
    assert bool(calls) == (not norm)
    want = _qkv_reference(y, C, cos, sin, H, w, scales)
    assert all(t.shape == (B, L, C) for t in got)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    douts = [torch.randn(B, L, C, generator=g) for _ in range(3)]
    wrt = [leaf] + ([w] if norm else [])
    grads = torch.autograd.grad(got, wrt, douts)
    ref = torch.autograd.grad(want, wrt, [d.double() for d in douts])
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)
    dy = grads[0].transpose(0, 1) if time_first else grads[0]
    assert torch.equal(dy[..., 2 * C: 3 * C], douts[2]) and torch.equal(dy[..., 3 * C:], torch.zeros(B, L, 5))
    # an output left out of the loss gets zeros, not an error
    only_v = torch.autograd.grad(kernels.rotary_qkv(y, C, cos, sin, H, w, force=True)[2].sum(), leaf)[0]
    assert torch.equal(only_v[..., 2 * C: 3 * C], torch.ones_like(only_v[..., :C])) and not only_v[..., :2 * C].any()


@pytest.mark.interpreter
@pytest.mark.parametrize("time_first", [False, True])
def test_rotary_qkv_custom_ops_opcheck_and_compile(time_first):
    """The fused q/k/v ops: ``opcheck`` (schema, fake impls, autograd registration) and under torch.compile the eager
    Function's bits forward and backward, the graphs holding the two ops and no concatenation of gradients."""
    g, C, (leaf, _), (cos, sin), _ = _case(10, 2, 5, 2, 8, False)
    H = 2
    y = leaf.detach().transpose(0, 1).contiguous().transpose(0, 1) if time_first else leaf.detach()
    args = (y, cos, sin, 0.5, 1.0, H, C)
    torch.library.opcheck(torch.ops.attn_zoo.rotary_qkv_fwd, args)
    q, k, v = torch.ops.attn_zoo.rotary_qkv_fwd(*args)
    grads = tuple(torch.randn(t.shape, generator=g) for t in (q, k, v))
    torch.library.opcheck(torch.ops.attn_zoo.rotary_qkv_bwd, grads + (cos, sin, 0.5, 1.0, H, y.shape[-1], time_first))
    graphs = []
    backend = _recording_backend(graphs)

    def f(y):
        q, k, v = kernels.rotary_qkv(y * 1.5, C, cos, sin, H, None, 1e-5, (0.25, 1.0), force=True)
        return q * 2 + k * 3 + v * 4

    y.requires_grad_()
    eager = f(y)
    compiled = torch.compile(f, backend=backend, fullgraph=True)(y)
    assert torch.equal(compiled, eager)
    dout = torch.randn(eager.shape, generator=g)
    assert torch.equal(torch.autograd.grad(compiled, y, dout)[0], torch.autograd.grad(eager, y, dout)[0])
    targets = [str(n.target) for fx in graphs for n in fx.graph.nodes if n.op == "call_function"]
    assert "attn_zoo.rotary_qkv_fwd.default" in targets and "attn_zoo.rotary_qkv_bwd.default" in targets
    assert not any("cat" in t or "select_backward" in t or "slice_backward" in t for t in targets), targets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_kernel_gpu_bf16(norm):
    """bf16 on the GPU: the output within the reference's own bf16 error of the float64 result (largest entry), the
    gradients within 1.5x its error norm."""
    g = torch.Generator().manual_seed(4)
    B, L, H, D = 4, 301, 18, 64
    C = H * D
    y, x = _fused_view(B, L, 2, C, torch.bfloat16, g)
    y = y.detach().cuda().requires_grad_()
    x = y[..., : 2 * C].unflatten(-1, (2, C))
    cos, sin = (t.cuda() for t in _tables(L, D))
    w = (1 + 0.3 * torch.randn(2, C, generator=g)).cuda().requires_grad_() if norm else None
    out = kernels.rotary_qk(x, cos, sin, H, w, scales=(0.125, 1.0))
    ref = kernels.rotary_qk_reference(x, cos, sin, H, w, scales=(0.125, 1.0))
    exact = kernels.rotary_qk_reference(x.double(), cos.double(), sin.double(), H,
                                        None if w is None else w.double(), scales=(0.125, 1.0),
                                        out_dtype=torch.float64)
    assert (out.double() - exact).abs().max() <= 1.01 * (ref.double() - exact).abs().max() + 1e-6
    dout = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16)
    wrt = [y] + ([w] if norm else [])
    got = torch.autograd.grad(out, wrt, dout)
    low = torch.autograd.grad(ref, wrt, dout)
    want = torch.autograd.grad(exact, wrt, dout.double())
    for a, b, c in zip(got, low, want):  # norms, not the largest entry: one bf16 ulp is 2x wider past a power of 2
        assert (a.double() - c).norm() <= 1.5 * (b.double() - c).norm() + 1e-6 * c.norm()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_inductor_gpu_matches_eager(norm):
    """Inductor with the custom ops around the kernels: bf16, the eager Function's bits forward and backward (the
    same launches on the same inputs)."""
    g = torch.Generator().manual_seed(8)
    B, L, H, D = 3, 257, 20, 64
    C = H * D
    y = (torch.randn(B, L, 3 * C + 8, generator=g) * 2).cuda().bfloat16().requires_grad_()
    cos, sin = (t.cuda() for t in _tables(L, D))
    w = (1 + 0.3 * torch.randn(2, C, generator=g)).cuda().requires_grad_() if norm else None

    def f(y, w):
        qk = (y * 1.5)[..., : 2 * C].unflatten(-1, (2, C))  # a producer in the graph, as the fused projection is
        return kernels.rotary_qk(qk, cos, sin, H, w, 1e-5, (D ** -0.5, 1.0))

    eager = f(y, w)
    compiled = torch.compile(f, fullgraph=True)(y, w)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)
    dout = torch.randn(eager.shape, generator=g).cuda().bfloat16()
    wrt = [y] + ([w] if norm else [])
    for a, b in zip(torch.autograd.grad(compiled, wrt, dout), torch.autograd.grad(eager, wrt, dout)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("norm,time_first", [(False, False), (True, False), (False, True)])
def test_rotary_qkv_gpu_bf16_and_inductor(norm, time_first):
    """The fused q/k/v kernels on the GPU in bf16 (with a norm: rotary_qk's kernels on the view): q and k within the
    reference's own bf16 error of the float64 result, v exact, the fused gradient within 1.5x the reference's error
    norm; compiled by Inductor, the eager bits forward and backward."""
    g = torch.Generator().manual_seed(11)
    B, L, H, D = 4, 301, 20, 64
    C = H * D
    shape = (L, B, 3 * C + 6) if time_first else (B, L, 3 * C + 6)
    leaf = (torch.randn(shape, generator=g) * 2).cuda().bfloat16().requires_grad_()
    cos, sin = (t.cuda() for t in _tables(L, D))
    w = (1 + 0.3 * torch.randn(2, C, generator=g)).cuda().requires_grad_() if norm else None
    scales = (D ** -0.5, 1.0)

    def f(leaf, w):
        y = leaf.transpose(0, 1) if time_first else leaf
        return kernels.rotary_qkv(y * 1.5, C, cos, sin, H, w, 1e-5, scales)

    got = f(leaf, w)
    y = (leaf.transpose(0, 1) if time_first else leaf) * 1.5
    qkv = y[..., : 3 * C].unflatten(-1, (3, C))
    low = tuple(kernels.rotary_qk_reference(qkv[:, :, :2], cos, sin, H, w, scales=scales)) + (qkv[:, :, 2],)
    exact = _qkv_reference(y, C, cos, sin, H, w, scales)
    for a, b, c in zip(got[:2], low[:2], exact[:2]):
        assert (a.double() - c).abs().max() <= 1.01 * (b.double() - c).abs().max() + 1e-6
    assert torch.equal(got[2], low[2])
    douts = [torch.randn(B, L, C, generator=g).cuda().bfloat16() for _ in range(3)]
    wrt = [leaf] + ([w] if norm else [])
    grads = torch.autograd.grad(got, wrt, douts)
    low_g = torch.autograd.grad(low, wrt, douts, retain_graph=True)  # (y is shared with the float64 graph)
    exact_g = torch.autograd.grad(exact, wrt, [d.double() for d in douts])
    for a, b, c in zip(grads, low_g, exact_g):
        assert (a.double() - c.double()).norm() <= 1.5 * (b.double() - c.double()).norm() + 1e-6 * c.double().norm()
    compiled = torch.compile(f, fullgraph=True)(leaf, w)
    assert all(torch.equal(a, b) for a, b in zip(compiled, got))
    for a, b in zip(torch.autograd.grad(compiled, wrt, douts), grads):
        assert torch.equal(a, b)
