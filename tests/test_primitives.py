"""attn_zoo.models.primitives: the attention config, AlphaFold inits, gated Attention against a float64 reference,
shared-mask dropout, row chunking. Also holds small helpers the block tests import."""
import math

import pytest
import torch

from attn_ops.reference import attention_reference
from attn_zoo.models import primitives
from attn_zoo.models.primitives import (
    Attention,
    AttentionConfig,
    Linear,
    SharedDropout,
    SwiGLUTransition,
    Transition,
    chunk_rows,
    fused_linear,
)


# ----------------------------------------------------------------------------------------------
# helpers shared with test_evoformer.py / test_pairformer.py
# ----------------------------------------------------------------------------------------------
def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter with fresh random values.

    AlphaFold's inits zero the last layer of every update (and set gates open), which would make
    outputs and most gradients trivially equal across backends; tests need every path to matter.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.ndim >= 2:
                r = r / math.sqrt(p.shape[-1])
            elif name.endswith("weight"):  # layer-norm scale
                r = 1.0 + 0.2 * r
            else:
                r = 0.2 * r
            p.copy_(r.to(p.dtype))
    return module


def weighted_sum(tensors, seed=123):
    """A scalar loss with fixed random weights (float64), so every output element gets its own gradient."""
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for t in tensors:
        w = torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device)
        total = total + (t.double() * w).sum()
    return total


def param_grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def rel_err(a, b, floor=1e-30):
    """max |a - b| / max(max |b|, floor). A floor of 1 makes it an absolute error for tensors that are
    analytically zero (e.g. the gradient of a layer-norm bias feeding only a softmax-invariant shift)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def skip_unless_backend(name):
    """Skip (with the reason) unless ``attn_ops`` lists backend ``name`` here and its entry point loads."""
    import attn_ops
    from attn_ops import registry

    if name not in attn_ops.backends():
        pytest.skip(f"attn_ops.backends() does not list {name!r} here: {attn_ops.backends()}")
    if "cpu" not in registry.get(name).devices:  # e.g. triton on a GPU machine without TRITON_INTERPRET
        pytest.skip(f"backend {name!r} does not run on CPU in this process (devices {sorted(registry.get(name).devices)})")
    try:
        registry.get(name).load()
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"backend {name!r} is listed but its entry {registry.get(name).entry} does not load: {exc}")


def compare_backend_to_torch(build, float_inputs, masks, backend, seed=0, device="cpu", autocast=None):
    """Run the module ``build(attention)`` with ``backend`` and with ``torch`` in float32 and with ``torch``
    in float64, all on the same random parameters and inputs, and compare outputs and every gradient
    (inputs and parameters) to float64 (STYLE.md item 6, ``tol`` from the registry):

    - each tensor: error <= tol * PyTorch's float32 error, where PyTorch's error is the larger of its
      error on that tensor and its worst relative error anywhere in the block times the tensor's scale
      (a block chains ~30 ops, so on a single tensor PyTorch's rounding can cancel by luck; a different
      but equally exact summation order then looks several times worse on that tensor alone), plus 8 ulps;
    - on average over all tensors: relative error <= tol * PyTorch's.
    A wrong mask, bias broadcast or gradient shows up as relative errors of 1e-3 or more, far above both.
    With ``autocast`` (e.g. torch.bfloat16) the float32 runs use autocast on ``device`` and the ulp floor
    is that dtype's.
    """
    from attn_ops import registry
    from helpers import ULP

    import contextlib

    state = randomize_(build("torch"), seed=seed).state_dict()
    xs32 = [x.float() for x in float_inputs]
    masks = [m.to(device) for m in masks]

    def run(attention, dtype):
        mod = build(attention)
        mod.load_state_dict(state)
        mod = mod.to(device=device, dtype=dtype).eval()
        xs = [x.detach().to(device=device, dtype=dtype).requires_grad_(True) for x in xs32]
        amp = autocast is not None and dtype != torch.float64
        ctx = torch.autocast(torch.device(device).type, dtype=autocast) if amp else contextlib.nullcontext()
        with ctx:
            outs = mod(*xs, *masks)
        outs = outs if isinstance(outs, tuple) else (outs,)
        names = [n for n, _ in mod.named_parameters()]
        grads = torch.autograd.grad(weighted_sum(outs), xs + list(mod.parameters()))
        named = [(f"out{i}", o) for i, o in enumerate(outs)]
        named += [(f"d input{i}", g) for i, g in enumerate(grads[: len(xs)])]
        named += [(f"d {n}", g) for n, g in zip(names, grads[len(xs):])]
        return named

    ref = run("torch", torch.float64)
    base = run("torch", torch.float32)
    got = run(backend, torch.float32)
    low = autocast or torch.float32
    tol = registry.get(backend).tolerance[low]
    ulp = ULP[low]
    rows, nonzero = [], 0
    for (name, r), (_, b), (_, a) in zip(ref, base, got):
        assert a.shape == r.shape, name
        assert torch.isfinite(a).all(), f"{backend}: non-finite {name}"
        peak = r.abs().max().item()
        nonzero += peak > 1e-12
        scale = max(peak, 1.0)
        rows.append((name, (a.double() - r).abs().max().item(), (b.double() - r).abs().max().item(), scale))
    worst_rel = max(b / s for _, _, b, s in rows)
    for name, err, base_err, scale in rows:
        allowed = tol * max(base_err, worst_rel * scale) + 8 * ulp * scale
        assert err <= allowed, (
            f"{backend}: {name} error {err:.3g} > allowed {allowed:.3g} (torch fp32 {base_err:.3g} on it, "
            f"worst relative {worst_rel:.3g} in the block)"
        )
    mean_rel = sum(e / s for _, e, _, s in rows) / len(rows)
    mean_rel_torch = sum(b / s for _, _, b, s in rows) / len(rows)
    assert mean_rel <= tol * mean_rel_torch, f"{backend}: mean relative error {mean_rel:.3g} > {tol} x torch's {mean_rel_torch:.3g}"
    assert nonzero >= len(rows) - 2, "too many outputs/gradients are exactly zero for the comparison to mean much"


# ----------------------------------------------------------------------------------------------
# AttentionConfig
# ----------------------------------------------------------------------------------------------
def test_attention_config_coerce_forms():
    assert AttentionConfig.coerce(None) == AttentionConfig("auto", {})
    assert AttentionConfig.coerce("torch") == AttentionConfig("torch")
    cfg = AttentionConfig.coerce({"backend": "chunked", "chunk_size": 256})
    assert cfg.backend == "chunked" and cfg.options == {"chunk_size": 256}
    cfg2 = AttentionConfig.coerce({"backend": "chunked", "options": {"chunk_size": 8}, "_target_": "x"})
    assert cfg2 == AttentionConfig("chunked", {"chunk_size": 8})
    assert AttentionConfig.coerce(cfg) is cfg
    assert hash(cfg) == hash(AttentionConfig("chunked", {"chunk_size": 256}))


def test_attention_config_from_dictconfig():
    omegaconf = pytest.importorskip("omegaconf")
    dc = omegaconf.OmegaConf.create({"backend": "triton", "bwd": "split"})
    cfg = AttentionConfig.coerce(dc)
    assert cfg == AttentionConfig("triton", {"bwd": "split"})
    assert type(cfg.options) is dict


def test_attention_config_rejects_unknown_backend_with_valid_names():
    with pytest.raises(ValueError, match="tritonn") as info:
        AttentionConfig.coerce("tritonn")
    for name in ("torch", "chunked", "triton"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="valid names"):
        Attention(8, 8, 4, 2, attention={"backend": "flash3"})
    with pytest.raises(TypeError, match="attention must be"):
        AttentionConfig.coerce(3)
    with pytest.raises(ValueError, match="both flat and under"):
        AttentionConfig.coerce({"backend": "chunked", "chunk_size": 2, "options": {"chunk_size": 4}})


def test_unknown_backend_option_fails_at_call_naming_it():
    att = Attention(8, 8, 4, 2, attention={"backend": "torch", "chunk_size": 4})
    x = torch.randn(2, 5, 8)
    with pytest.raises(TypeError, match="chunk_size"):
        att(x, x)


# ----------------------------------------------------------------------------------------------
# Linear inits
# ----------------------------------------------------------------------------------------------
def test_linear_inits():
    torch.manual_seed(0)
    fan_in, fan_out = 512, 256
    final = Linear(fan_in, fan_out, init="final")
    assert torch.count_nonzero(final.weight) == 0 and torch.count_nonzero(final.bias) == 0
    gate = Linear(fan_in, fan_out, init="gating")
    assert torch.count_nonzero(gate.weight) == 0 and torch.all(gate.bias == 1)
    for init, var in (("default", 1.0 / fan_in), ("relu", 2.0 / fan_in), ("glorot", 2.0 / (fan_in + fan_out))):
        w = Linear(fan_in, fan_out, init=init).weight
        assert abs(w.var().item() / var - 1) < 0.05, (init, w.var().item(), var)
    w = Linear(fan_in, fan_out, init="default").weight
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    assert w.abs().max() <= 2 * std + 1e-6  # truncated at 2 std of the underlying normal
    with pytest.raises(ValueError, match="init must be one of"):
        Linear(4, 4, init="he")
    with pytest.raises(ValueError, match="gating"):
        Linear(4, 4, bias=False, init="gating")


# ----------------------------------------------------------------------------------------------
# Attention vs a float64 hand computation
# ----------------------------------------------------------------------------------------------
def _manual_attention(att: Attention, q_x, kv_x, bias, mask):
    """The module's math spelled out in float64 on top of the reference op."""
    H, C = att.num_heads, att.c_hidden
    q = att.linear_q(q_x).unflatten(-1, (H, C)).transpose(-2, -3)
    k = att.linear_k(kv_x).unflatten(-1, (H, C)).transpose(-2, -3)
    v = att.linear_v(kv_x).unflatten(-1, (H, C)).transpose(-2, -3)
    o, _ = attention_reference(q, k, v, bias, mask)
    o = o.transpose(-2, -3).flatten(-2) * torch.sigmoid(att.linear_g(q_x))
    return att.linear_o(o)


@pytest.mark.parametrize("self_attention", [False, True], ids=["cross", "self"])
@pytest.mark.parametrize("backend", ["torch", "chunked"])
def test_attention_matches_manual_float64(backend, self_attention):
    torch.manual_seed(1)
    B, R, Lq, Lk, c, H, C = 2, 3, 5, 7, 12, 2, 4
    c_kv = c if self_attention else 10
    Lk = Lq if self_attention else Lk
    opts = {"chunk_size": 3} if backend == "chunked" else {}
    att = randomize_(Attention(c, c_kv, C, H, attention={"backend": backend, **opts}), seed=2).double()
    q_x = torch.randn(B, R, Lq, c, dtype=torch.float64, requires_grad=True)
    kv_x = q_x if self_attention else torch.randn(B, R, Lk, c_kv, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(B, 1, H, Lq, Lk, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(B, R, 1, 1, Lk) > 0.3
    out = att(q_x, kv_x, bias=bias, mask=mask)
    assert out.shape == (B, R, Lq, c)
    ref = _manual_attention(att, q_x, kv_x, bias, mask)
    leaves = [q_x, kv_x, bias] + list(att.parameters())
    g = torch.autograd.grad(weighted_sum([out]), leaves)
    g_ref = torch.autograd.grad(weighted_sum([ref]), leaves)
    assert rel_err(out, ref) < 1e-12
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-12
    assert bias.grad is None and g[2].shape == bias.shape  # gradient in the bias's own (broadcast) shape


def test_attention_rejects_mismatched_batch_dims():
    att = Attention(8, 8, 4, 2, attention="torch")
    with pytest.raises(ValueError, match=r"q_x \(2, 3, 5, 8\).*kv_x \(2, 4, 5, 8\)"):
        att(torch.randn(2, 3, 5, 8), torch.randn(2, 4, 5, 8))
    with pytest.raises(ValueError, match="bias"):
        att(torch.randn(2, 5, 8), torch.randn(2, 5, 8), bias=torch.randn(2, 3, 5, 5))


# ----------------------------------------------------------------------------------------------
# Dropout, chunking, transitions
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shared_dim", [-3, -2])
def test_shared_dropout_shares_mask_along_dim(shared_dim):
    torch.manual_seed(0)
    drop = SharedDropout(0.5, shared_dim=shared_dim).train()
    x = torch.ones(2, 6, 7, 16)
    y = drop(x)
    assert set(torch.unique(y).tolist()) == {0.0, 2.0}
    first = y.narrow(shared_dim, 0, 1)
    assert torch.equal(y, first.expand_as(y))  # identical along the shared dim
    assert not torch.equal(y, y.narrow(-1, 0, 1).expand_as(y))  # but not along the others
    assert torch.equal(drop.eval()(x), x)


@pytest.mark.parametrize("widths,biases", [((8, 8, 8, 8, 4), (False, False, False, True, False)), ((5, 3), (True, True)),
                                           ((16, 16), (True, False))], ids=["516_like_width", "odd_width", "aligned"])
def test_fused_linear_equals_separate_layers(widths, biases):
    """One matmul on the concatenated (zero-padded to a multiple of 8) weights gives each layer's own output and
    the same gradients into x, weights and biases; the outputs are views of one buffer with an aligned width."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(12, w, bias=b).double() for w, b in zip(widths, biases)]
    x = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
    outs = fused_linear(x, layers)
    assert [o.shape[-1] for o in outs] == list(widths)
    assert outs[0]._base is not None and outs[0]._base.shape[-1] % 8 == 0
    ref = [lin(x) for lin in layers]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    gs = [torch.randn_like(r) for r in ref]
    params = [x] + [p for lin in layers for p in lin.parameters()]
    got = torch.autograd.grad(outs, params, gs)
    want = torch.autograd.grad(ref, params, gs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for buf in primitives._ZEROS.values():  # the shared zero padding is read, never written
        assert not buf.any()


def test_fused_linear_padding_allocates_once(monkeypatch):
    """The zero rows and missing biases that pad the concatenated weights are views of one cached buffer per
    device and dtype (no allocation or fill per call), grown when a wider pad asks; inference mode does not leak an
    inference tensor into later training calls."""
    monkeypatch.setattr(primitives, "_ZEROS", {})
    monkeypatch.setattr(primitives, "_ZEROS_OUTGROWN", [])
    layers = [torch.nn.Linear(12, w, bias=b) for w, b in ((8, False), (3, True), (6, False))]  # pad 7 rows
    x = torch.randn(4, 12, requires_grad=True)
    with torch.inference_mode():
        fused_linear(torch.randn(4, 12), layers)
    assert len(primitives._ZEROS) == 1
    buf = next(iter(primitives._ZEROS.values()))
    assert not buf.is_inference() and buf.numel() >= 12 * 8
    outs = fused_linear(x, layers)
    sum(o.sum() for o in outs).backward()  # a training call after the inference one
    assert next(iter(primitives._ZEROS.values())) is buf
    wide = [torch.nn.Linear(2000, 3, bias=False), torch.nn.Linear(2000, 2, bias=False)]  # pad 3 x 2000 > the buffer
    fused_linear(torch.randn(1, 2000), wide)
    assert next(iter(primitives._ZEROS.values())).numel() >= 6000 and not primitives._ZEROS[(buf.device, buf.dtype)].any()
    assert primitives._ZEROS_OUTGROWN == [buf]  # the smaller buffer stays alive (a captured CUDA graph may read it)


def test_chunk_rows_matches_unchunked():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 5, 3)
    shared = torch.randn(2, 1, 5, 3)
    fn = lambda a, b: (a * b).cumsum(-2)  # noqa: E731
    want = fn(x, shared)
    for cs in (1, 3, 7, 100):
        assert torch.equal(chunk_rows(fn, [x, shared], [-3, -3], cs, out_dim=-3), want)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_rows(fn, [x, shared], [-3, -3], 0, out_dim=-3)


@pytest.mark.parametrize("cls", [Transition, SwiGLUTransition])
def test_transition_chunked_equals_plain(cls):
    torch.manual_seed(0)
    tr = randomize_(cls(6, 2)).double()
    for shape in ((2, 5, 4, 6), (2, 5, 6)):
        x = torch.randn(*shape, dtype=torch.float64)
        assert rel_err(tr(x, chunk_size=2), tr(x)) < 1e-14


@pytest.mark.parametrize("offset", [0.5, 100.0])  # 100: a drifted residual stream, where a bf16 cast first fails
def test_layer_norm_under_autocast_returns_low_precision_within_bound(offset):
    """Under autocast our LayerNorm returns bf16, where nn.LayerNorm returns float32 that the next linear
    rounds to bf16; the error vs float64 stays within 3x of that rounded PyTorch result's."""
    from attn_zoo.models.primitives import LayerNorm

    g = torch.Generator().manual_seed(0)
    ln = LayerNorm(128)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.3 * torch.randn(128, generator=g))
        ln.bias.copy_(0.3 * torch.randn(128, generator=g))
    x = torch.randn(64, 128, generator=g) * 2 + offset
    ref = torch.nn.functional.layer_norm(x.double(), (128,), ln.weight.double(), ln.bias.double(), 1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = ln(x)
        plain = torch.nn.LayerNorm.forward(ln, x)
    assert ours.dtype == torch.bfloat16 and plain.dtype == torch.float32
    err = (ours.double() - ref).abs().max().item()
    base = (plain.to(torch.bfloat16).double() - ref).abs().max().item()
    assert 0 < err <= 3 * base
    assert torch.equal(ln(x), plain)  # without autocast: exactly nn.LayerNorm


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["rows", "transposed", "channels_last", "slice"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float16), (torch.float16, torch.float16)])
def test_triton_layer_norm_with_backward_against_float64(layout, dtypes, monkeypatch):
    """The blocks' training layer norm (Triton, CPU interpreter): output and the gradients of the input, weight and
    bias against float64, on every layout the blocks feed it (an odd channel count: padded lanes; tiny tiles and
    one SM, so programs take several row tiles and the last one is partial). A dense view's gradient keeps its
    strides (the ending node's transpose, the triangle product's channels-last view); a slice's is contiguous."""
    from attn_zoo.models import kernels

    real_tiles = kernels._tiles
    monkeypatch.setattr(kernels, "_tiles", lambda c: (real_tiles(c)[0], 4))
    monkeypatch.setattr(kernels, "_sm_count", lambda device: 1)
    monkeypatch.setattr(kernels, "_PLANS", {})  # no plan of another test's tiles for these shapes
    x_dtype, out_dtype = dtypes
    g = torch.Generator().manual_seed(7)
    C, N = 24, 6
    norm = torch.nn.LayerNorm(C)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(C, generator=g))
        norm.bias.copy_(0.3 * torch.randn(C, generator=g))
    base = torch.randn(N, N + 1, C, generator=g) * 2 + 1.5
    if layout == "channels_last":
        base = torch.randn(C, N, N + 1, generator=g) * 2 + 1.5
    base = base.to(x_dtype).requires_grad_()
    x = {"rows": lambda t: t, "transposed": lambda t: t.transpose(0, 1), "channels_last": lambda t: t.movedim(0, -1),
         "slice": lambda t: t[:, 1:5]}[layout](base)
    dy = torch.randn(x.shape, generator=g)
    y = kernels.layer_norm(x, norm, out_dtype, force=True)
    assert y is not None and y.dtype == out_dtype and y.is_contiguous() and y.shape == x.shape
    dx, dw, db = torch.autograd.grad(y, [x, norm.weight, norm.bias], dy.to(out_dtype))
    assert dx.stride() == (x.stride() if layout != "slice" else x.contiguous().stride())
    x64 = x.detach().double().requires_grad_()
    w64, b64 = norm.weight.detach().double().requires_grad_(), norm.bias.detach().double().requires_grad_()
    y64 = torch.nn.functional.layer_norm(x64, (C,), w64, b64, norm.eps)
    want = torch.autograd.grad(y64, [x64, w64, b64], dy.double())
    tol = 1e-5 if out_dtype == torch.float32 else 2e-3  # one fp16 rounding of the output (and of dy, x)
    assert rel_err(y, y64) < tol, rel_err(y, y64)
    for got, ref in zip((dx, dw, db), want):
        assert rel_err(got, ref) < 5 * tol, (rel_err(got, ref), got.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_layer_norm_trains_like_the_module(monkeypatch):
    """The blocks' LayerNorm on CUDA (the Triton kernels, here from any row count) against PyTorch's path under
    bf16 autocast, on a pair tensor and its transposed and channels-last views: output and every gradient within
    2x PyTorch's own error against float64 (plus a bf16 rounding of the output)."""
    from attn_zoo.models import kernels
    from attn_zoo.models.primitives import LayerNorm

    monkeypatch.setattr(kernels, "LAYER_NORM_MIN_ROWS", 0)
    launched = []
    real = kernels._LayerNorm.apply
    monkeypatch.setattr(kernels._LayerNorm, "apply", lambda *a: launched.append(1) or real(*a))

    g = torch.Generator().manual_seed(11)
    ln = LayerNorm(128).cuda()
    with torch.no_grad():
        ln.weight.copy_(1 + 0.3 * torch.randn(128, generator=g))
        ln.bias.copy_(0.3 * torch.randn(128, generator=g))
    for shape, view in (((129, 131, 128), lambda t: t), ((129, 131, 128), lambda t: t.transpose(0, 1)),
                        ((128, 129, 131), lambda t: t.movedim(0, -1))):
        base = (torch.randn(*shape, generator=g) * 2 + 1).cuda().requires_grad_()
        x = view(base)
        dy = torch.randn(x.shape, generator=g).cuda().bfloat16()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = ln(x)
        got = torch.autograd.grad(y, [base, ln.weight, ln.bias], dy)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_y = torch.nn.LayerNorm.forward(ln, x).bfloat16()
        ref = torch.autograd.grad(ref_y, [base, ln.weight, ln.bias], dy)
        x64 = base.detach().double().requires_grad_()
        w64, b64 = ln.weight.detach().double().requires_grad_(), ln.bias.detach().double().requires_grad_()
        y64 = torch.nn.functional.layer_norm(view(x64), (128,), w64, b64, ln.eps)
        want = torch.autograd.grad(y64, [x64, w64, b64], dy.double())
        assert y.dtype == torch.bfloat16 and y.is_contiguous()
        assert rel_err(y, y64) <= 2 * rel_err(ref_y, y64) + 1e-6
        for a, b, w in zip(got, ref, want):
            assert rel_err(a, w) <= 2 * rel_err(b, w) + 1e-6, (rel_err(a, w), rel_err(b, w))
    assert len(launched) == 3  # the kernels ran, not the module


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_layer_norm_routes_views_to_the_kernels(monkeypatch):
    """Below ``LAYER_NORM_MIN_ROWS`` a contiguous input takes PyTorch's layer norm, while a transposed or
    channels-last view takes the kernels (they read it in place; PyTorch would copy it first), with the module's
    result; ``LAYER_NORM_STRIDED`` False sends the views to PyTorch too."""
    from attn_zoo.models import kernels
    from attn_zoo.models.primitives import LayerNorm

    launched = []
    real = kernels._LayerNorm.apply
    monkeypatch.setattr(kernels._LayerNorm, "apply", lambda *a: launched.append(1) or real(*a))
    ln = LayerNorm(32).cuda()
    z = torch.randn(20, 21, 32, device="cuda")
    assert z.numel() < kernels.LAYER_NORM_MIN_ROWS * 32
    for x, want in ((z, 0), (z.transpose(0, 1), 1), (torch.randn(32, 20, 21, device="cuda").movedim(0, -1), 1)):
        launched.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = ln(x)
            ref = torch.nn.LayerNorm.forward(ln, x).bfloat16()
        assert len(launched) == want and y.dtype == torch.bfloat16
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)  # one bf16 rounding apart
    monkeypatch.setattr(kernels, "LAYER_NORM_STRIDED", False)
    launched.clear()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ln(z.transpose(0, 1))
    assert not launched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_linear_bias_gradient_by_matmul(monkeypatch):
    """The blocks' Linear on CUDA under bf16 autocast with the matmul bias gradient (here from any row count) against
    F.linear: output and every gradient within 2x PyTorch's own error against float64 (its matmul's error for the
    bias, a sum over the rows)."""
    monkeypatch.setattr(primitives, "BIAS_GRAD_MATMUL_MIN_ROWS", 0)
    g = torch.Generator().manual_seed(3)
    lin = Linear(128, 96).cuda()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 128, generator=g) * 128 ** -0.5)
        lin.bias.copy_(torch.randn(96, generator=g))
    x = torch.randn(7, 61, 128, generator=g).cuda().requires_grad_()
    dy = torch.randn(7, 61, 96, generator=g).cuda().bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = lin(x)
        plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    assert "LinearBiasByMatmul" in type(ours.grad_fn).__name__ and ours.dtype == torch.bfloat16
    got = torch.autograd.grad(ours, [x, lin.weight, lin.bias], dy)
    ref = torch.autograd.grad(plain, [x, lin.weight, lin.bias], dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, lin.weight, lin.bias))
    want = torch.autograd.grad(torch.nn.functional.linear(x64, w64, b64), [x64, w64, b64], dy.double())
    dy2 = dy.reshape(-1, 96)
    own = rel_err(dy2.new_ones(1, dy2.shape[0]) @ dy2, want[2][None])
    for a, r, t, extra in zip(got, ref, want, (0.0, 0.0, own)):
        assert a.dtype == torch.float32
        assert rel_err(a, t) <= 2 * max(rel_err(r, t), extra) + 1e-6, (rel_err(a, t), rel_err(r, t), extra)


@pytest.mark.interpreter
def test_triton_layer_norm_compiles_nothing_per_length(monkeypatch):
    """Two protein lengths launch the layer norm kernels with the same compile-time arguments, and every argument
    that follows the length is left unspecialised (a new length must not stall on a Triton compile)."""
    from attn_zoo.models import kernels

    seen = []
    real = kernels._fast_launch

    def spy(kernel, grid, args, num_warps, num_stages, **constexprs):
        seen.append((kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), tuple(constexprs.items())))
        return real(kernel, grid, args, num_warps, num_stages, **constexprs)

    monkeypatch.setattr(kernels, "_fast_launch", spy)
    monkeypatch.setattr(kernels, "_sm_count", lambda device: 1)  # 8 programs at most: rows per program varies
    monkeypatch.setattr(kernels, "_PLANS", {})
    ln = torch.nn.LayerNorm(16)
    for n in (5, 40):  # 25 and 1600 rows: one program of 64 rows, eight of 256
        z = torch.randn(n, n, 16, requires_grad=True)
        for x in (z, z.transpose(0, 1)):  # the starting and the ending node's layouts
            y = kernels.layer_norm(x, ln, torch.float32, force=True)
            torch.autograd.grad(y.sum(), [z, ln.weight])
    half = len(seen) // 2
    assert half == 4 and seen[:half] == seen[half:], seen
    for kernel, names in ((kernels._layer_norm_kernel, {"M", "B", "sa", "sb"}),
                          (kernels._layer_norm_bwd_kernel, {"M", "B", "sa", "sb", "da", "db", "ROWS"})):
        marked = getattr(kernel, "kwargs", None) or {}  # the interpreter keeps the decorator's arguments here
        unspecialised = {kernel.arg_names[i] if isinstance(i, int) else i
                         for i in marked.get("do_not_specialize") or kernel.do_not_specialize}
        assert names <= unspecialised, (kernel, names - unspecialised)


@pytest.mark.interpreter
def test_triton_layer_norm_declines_what_it_cannot_serve():
    """None (the module runs instead) off CUDA unless forced, for a norm over more than the last dim and for a view
    of three strided row dims; the module's own path then gives nn.LayerNorm's result."""
    from attn_zoo.models import kernels
    from attn_zoo.models.primitives import LayerNorm

    ln = LayerNorm(8)
    x = torch.randn(4, 5, 8)
    assert kernels.layer_norm(x, ln, torch.float32) is None  # CPU, not forced
    assert kernels.layer_norm(torch.randn(4, 6, 8, 8)[::2, ::2, ::2], ln, torch.float32, force=True) is None
    assert kernels.layer_norm(torch.randn(4, 3, 8), torch.nn.LayerNorm((3, 8)), torch.float32, force=True) is None
    assert torch.equal(ln(x), torch.nn.LayerNorm.forward(ln, x))
    empty = torch.randn(0, 3, 8, requires_grad=True)  # no rows: an empty result, zero weight and bias gradients
    y = kernels.layer_norm(empty, ln, torch.float32, force=True)
    assert y.shape == (0, 3, 8)
    real_empty = torch.empty
    with pytest.MonkeyPatch.context() as mp:  # fresh buffers full of NaN: the zeros must be written
        mp.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
        dx, dw, db = torch.autograd.grad(y, [empty, ln.weight, ln.bias], torch.ones_like(y))
    assert dx.shape == empty.shape and torch.equal(dw, torch.zeros(8)) and torch.equal(db, torch.zeros(8))


@pytest.mark.interpreter
def test_triton_layer_norm_without_affine_parameters():
    """``elementwise_affine=False`` (no weight, no bias): the kernels' HAS_W / HAS_B off, the input gradient against
    float64, and a double backward refused rather than silently first-order."""
    from attn_zoo.models import kernels

    norm = torch.nn.LayerNorm(24, elementwise_affine=False)
    x = (torch.randn(7, 5, 24) * 3 + 1).requires_grad_()
    dy = torch.randn(7, 5, 24)
    y = kernels.layer_norm(x, norm, torch.float32, force=True)
    (dx,) = torch.autograd.grad(y, [x], dy)
    x64 = x.detach().double().requires_grad_()
    y64 = torch.nn.functional.layer_norm(x64, (24,), eps=norm.eps)
    (want,) = torch.autograd.grad(y64, [x64], dy.double())
    assert rel_err(y, y64) < 1e-5 and rel_err(dx, want) < 1e-4
    y = kernels.layer_norm(x, norm, torch.float32, force=True)
    (g,) = torch.autograd.grad(y, [x], dy, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_triton_layer_norm_plans_once_per_layout(monkeypatch):
    """The training layer norm works out its row view, tiles and backward split once per input shape and strides
    (the host path of every later call is a dict lookup): equal layouts share a plan, a transposed view gets its
    own, a view the kernels cannot read is remembered as None."""
    from attn_zoo.models import kernels

    monkeypatch.setattr(kernels, "_PLANS", {})
    z = torch.randn(6, 7, 16)
    plan = kernels._plan(z)
    assert plan is kernels._plan(torch.randn(6, 7, 16)) and plan.view == (1, 42, 16, 0, 16, 1)  # rows merged
    t = kernels._plan(z.transpose(0, 1))
    assert t is not plan and t.view == (7, 6, 16, 16, 112, 1)
    assert plan.rows % plan.block_m == 0 and plan.programs * plan.rows >= 42
    odd = torch.randn(4, 6, 8, 8)[::2, ::2, ::2]
    assert kernels._plan(odd) is None and len(kernels._PLANS) == 3


@pytest.mark.parametrize("autocast", [False, True])
def test_linear_bias_gradient_by_matmul_matches_linear(autocast):
    """``_LinearBiasByMatmul`` (the blocks' eager CUDA linear on large inputs, here called directly on the CPU) gives
    F.linear's output dtype and every gradient in its input's dtype, against float64 within 2x PyTorch's own error
    (fp32, and bf16 autocast with fp32 parameters, as the blocks train)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 37, 24, generator=g, requires_grad=True)
    w = (torch.randn(20, 24, generator=g) / 5).requires_grad_()
    b = torch.randn(20, generator=g).requires_grad_()
    dy = torch.randn(3, 37, 20, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ours = primitives._LinearBiasByMatmul.apply(x, w, b)
        plain = torch.nn.functional.linear(x, w, b)
    assert ours.dtype == plain.dtype == (torch.bfloat16 if autocast else torch.float32)
    got = torch.autograd.grad(ours, [x, w, b], dy.to(ours.dtype))
    ref = torch.autograd.grad(plain, [x, w, b], dy.to(plain.dtype))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = torch.nn.functional.linear(x64, w64, b64)
    want = torch.autograd.grad(y64, [x64, w64, b64], dy.to(ours.dtype).double())
    assert rel_err(ours, y64) <= 2 * rel_err(plain, y64) + 1e-7
    # the bias gradient is a matmul over the rows now: PyTorch's own error for it is that of its matmul (sequential
    # accumulation), which can exceed its pairwise column sum's
    dy2 = dy.to(ours.dtype).reshape(-1, 20)
    own = rel_err(torch.ones(1, dy2.shape[0], dtype=dy2.dtype) @ dy2, want[2][None])
    for a, r, t, leaf, extra in zip(got, ref, want, (x, w, b), (0.0, 0.0, own)):
        assert a.dtype == leaf.dtype
        assert rel_err(a, t) <= 2 * max(rel_err(r, t), extra) + 1e-7, (rel_err(a, t), rel_err(r, t), extra)


def test_linear_takes_the_matmul_bias_gradient_only_where_it_applies(monkeypatch):
    """``primitives.linear`` keeps F.linear off CUDA, below the row threshold, without a trainable bias and for
    mixed dtypes outside autocast (F.linear's own error then)."""
    x = torch.randn(4, 8)
    lin = Linear(8, 3)
    monkeypatch.setattr(primitives, "BIAS_GRAD_MATMUL_MIN_ROWS", 0)
    assert type(lin(x).grad_fn).__name__ == "AddmmBackward0"  # CPU: F.linear's own autograd
    assert not primitives._autocast_or_one_dtype(x.bfloat16(), lin.weight, lin.bias)
    assert primitives._autocast_or_one_dtype(x, lin.weight, lin.bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert primitives._autocast_or_one_dtype(x.bfloat16(), lin.weight, lin.bias)
        assert not primitives._autocast_or_one_dtype(x.double(), lin.weight, lin.bias)


def test_linear_bias_by_matmul_keeps_only_what_gradients_need():
    """A frozen weight keeps no copy of the input alive (F.linear's addmm does the same); the input's and bias's
    gradients are still right."""
    x = torch.randn(5, 6, requires_grad=True)
    w = torch.randn(4, 6)  # frozen
    b = torch.randn(4, requires_grad=True)
    y = primitives._LinearBiasByMatmul.apply(x, w, b)
    saved = y.grad_fn.saved_tensors
    assert saved[0] is None and saved[1] is not None
    dx, db = torch.autograd.grad(y, [x, b], torch.ones(5, 4))
    torch.testing.assert_close(dx, torch.ones(5, 4) @ w)
    torch.testing.assert_close(db, torch.full((4,), 5.0))


@pytest.mark.interpreter
def test_triton_layer_norm_declines_forward_mode_ad():
    """The kernels are first-order: under forward-mode AD the module's own (differentiable) path runs."""
    import torch.autograd.forward_ad as fwAD

    from attn_zoo.models import kernels

    ln = torch.nn.LayerNorm(8)
    x = torch.randn(3, 4, 8)
    assert kernels.layer_norm(x, ln, torch.float32, force=True) is not None
    with fwAD.dual_level():
        assert kernels.layer_norm(x, ln, torch.float32, force=True) is None
