"""The ``cudnn`` backend (cuDNN's fused attention through NVIDIA's cuDNN frontend, deterministic backward).

On the CPU: the registry's rules for it (what it refuses and why, where ``auto`` puts it, the workspace bound) and
the adapter's plumbing through stand-in ``cudnn::sdpa_fwd`` / ``sdpa_bwd`` ops of the frontend's schema computed in
float64 (leading dims, scale, the causal diagonal's alignment, lse, the deterministic flag). On a GPU with the
frontend installed: against the reference, bitwise-repeatable gradients, and under ``torch.compile``.
"""
from dataclasses import replace

import pytest
import torch

import attn_ops
from attn_ops import adapters, registry
from attn_ops.inputs import describe
from attn_ops.reference import attention_reference

from helpers import check_against_reference, make_inputs

REQUIRES = "cudnn.sdpa.fwd.torch_op"


def _cuda_inputs(**changes):
    """What a deterministic bf16 training call without bias or mask asks, on CUDA (a long-context LM's shape)."""
    q = torch.zeros(1, 16, 4096, 128)
    base = replace(describe(q, q, q, None, None, False, False, True), device="cuda", dtype=torch.bfloat16,
                   needs_grad=True)
    return replace(base, **changes)


@pytest.fixture
def cudnn_importable(monkeypatch):
    """The registry as if the frontend imported (the probe's answer is cached per module name)."""
    monkeypatch.setitem(registry._PROBED, REQUIRES, None)


def test_auto_takes_cudnn_for_deterministic_training_without_bias_within_the_workspace(cudnn_importable):
    if registry.get("triton").unavailable_reason():
        pytest.skip("triton does not import here")
    inputs = _cuda_inputs()
    assert registry.select("auto", inputs).name == "cudnn"
    # inference and deterministic=False keep torch's SDPA (cuDNN or flash, faster without the deterministic path)
    assert registry.select("auto", replace(inputs, needs_grad=False)).name == "sdpa"
    assert registry.select("auto", replace(inputs, deterministic=False)).name == "sdpa"
    # lse, a bias, a mask or segment ids: triton
    for change in (dict(needs_lse=True), dict(has_bias=True), dict(has_mask=True), dict(has_segments=True)):
        assert registry.select("auto", replace(inputs, **change)).name == "triton", change
    # where cudnn was not measured faster than triton: head dim 64, or fewer than 2^28 attended pairs in all
    assert registry.select("auto", replace(inputs, head_dim=64, head_dim_v=64)).name == "triton"
    assert registry.select("auto", replace(inputs, lk=4095)).name == "triton"
    assert registry.select("auto", replace(inputs, causal=True)).name == "triton"  # causal: half the pairs
    assert registry.select("auto", replace(inputs, causal=True, problems=32)).name == "cudnn"
    assert registry.select("auto", replace(inputs, problems=64, lq=2048, lk=2048)).name == "cudnn"
    assert registry.priority(replace(inputs, head_dim=64))[:2] == ("sdpa", "triton")
    # 16 heads of 16384^2 need an 8 GiB workspace: above the default bound, triton serves; a larger bound admits it
    long = replace(inputs, lq=16384, lk=16384)
    reasons = registry.not_supported_reasons("cudnn", long)
    assert any("8.00 GiB workspace" in r and "cudnn_workspace_gib=2" in r for r in reasons), reasons
    assert registry.select("auto", long).name == "triton"
    with attn_ops.kernel_settings(cudnn_workspace_gib=9):
        assert registry.select("auto", long).name == "cudnn"
    assert registry.select("auto", replace(long, deterministic=False)).name == "sdpa"


@pytest.mark.parametrize("change, reason", [
    (dict(dtype=torch.float32), "dtype torch.float32 not supported"),
    (dict(head_dim=36, head_dim_v=36), "q/k head dim 36 not a multiple of 8"),
    (dict(head_dim_v=160), "v head dim 160 outside [8, 128]"),
    (dict(problems=64, lq=8192, lk=8192), "deterministic backward needs a 8.00 GiB workspace"),
    (dict(problems=128, lq=4096, lk=4096, causal=True), "deterministic backward needs a 4.00 GiB workspace"),
    (dict(has_bias=True), "bias not supported"),
    (dict(has_mask=True), "mask not supported"),
    (dict(has_segments=True), "segment_ids (packed variable-length rows) not supported"),
    (dict(causal=True, lq=1024, lk=1000), "causal with Lq 1024 > Lk 1000 (queries without a key) not supported"),
    (dict(device="cpu"), "device cpu not supported"),
])
def test_cudnn_refuses_what_it_cannot_serve_with_the_reason(cudnn_importable, change, reason):
    reasons = registry.not_supported_reasons("cudnn", _cuda_inputs(**change))
    assert any(reason in r for r in reasons), reasons
    assert not registry.not_supported_reasons("cudnn", _cuda_inputs())
    assert not registry.not_supported_reasons("cudnn", _cuda_inputs(causal=True, lq=4000, lk=4096))
    assert not registry.not_supported_reasons("cudnn", _cuda_inputs(problems=64, lq=8192, lk=8192,
                                                                   deterministic=False))


def test_cudnn_without_the_frontend_names_the_missing_module(monkeypatch):
    monkeypatch.setitem(registry._PROBED, REQUIRES, f"{REQUIRES} cannot be imported (ModuleNotFoundError: x)")
    with pytest.raises(registry.UnsupportedInputs, match=f"cudnn: {REQUIRES} cannot be imported"):
        registry.select("cudnn", _cuda_inputs())


def test_workspace_bound_is_a_checked_setting():
    for bad in (-1, True, "2"):
        with pytest.raises(TypeError, match="cudnn_workspace_gib"):
            with attn_ops.kernel_settings(cudnn_workspace_gib=bad):
                pass


# -- the adapter through stand-ins of the frontend's two ops (CPU, float64) ------------------------------------


def _masked_logits(q, k, scale, is_causal, bottom_right):
    s = (q @ k.transpose(-1, -2)) * scale
    if is_causal:
        lq, lk = q.shape[-2], k.shape[-2]
        shift = lk - lq if bottom_right else 0
        keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + shift
        s = s.masked_fill(~keep, float("-inf"))
    return s


@pytest.fixture
def stand_in_ops():
    """``cudnn::sdpa_fwd`` / ``sdpa_bwd`` with the frontend's schemas, computed in float64 on the CPU; yields the
    list of each call's (op, is_causal, causal_bottom_right, is_deterministic)."""
    if hasattr(torch.ops.cudnn, "sdpa_fwd"):
        pytest.skip("the real cuDNN frontend ops are registered in this process")
    calls = []
    lib = torch.library.Library("cudnn", "DEF")
    lib.define("sdpa_fwd(Tensor q, Tensor k, Tensor v, float attn_scale, bool is_causal=False, "
               "bool causal_bottom_right=False, int window_left=-1, int window_right=-1, Tensor? sinks=None, "
               "Tensor? seq_len_q=None, Tensor? seq_len_kv=None, Tensor? cu_seqlens_q=None, "
               "Tensor? cu_seqlens_kv=None, int max_seqlen_q=0, int max_seqlen_kv=0, bool return_lse=True) "
               "-> (Tensor, Tensor)")
    lib.define("sdpa_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, float attn_scale, "
               "bool is_causal=False, bool causal_bottom_right=False, int window_left=-1, int window_right=-1, "
               "Tensor? sinks=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, int max_seqlen_q=0, "
               "int max_seqlen_kv=0, bool is_deterministic=False) -> (Tensor, Tensor, Tensor)")

    def descriptor_ready(*ts):  # what cuDNN's descriptors need (the adapter makes it so)
        for t in ts:
            assert t.ndim == 4, "the frontend's dense path takes [B, H, S, D]"
            assert t.stride(-1) == 1 and 0 not in t.stride() and t.storage_offset() * t.element_size() % 16 == 0

    def fwd(q, k, v, attn_scale, is_causal=False, causal_bottom_right=False, window_left=-1, window_right=-1,
            sinks=None, seq_len_q=None, seq_len_kv=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=0,
            max_seqlen_kv=0, return_lse=True):
        descriptor_ready(q, k, v)
        calls.append(("fwd", is_causal, causal_bottom_right, None))
        s = _masked_logits(q.double(), k.double(), attn_scale, is_causal, causal_bottom_right)
        lse = torch.logsumexp(s, -1, keepdim=True)
        o = torch.exp(s - lse) @ v.double()
        return o.to(q.dtype), lse.float()

    def bwd(grad_out, q, k, v, o, lse, attn_scale, is_causal=False, causal_bottom_right=False, window_left=-1,
            window_right=-1, sinks=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=0, max_seqlen_kv=0,
            is_deterministic=False):
        calls.append(("bwd", is_causal, causal_bottom_right, is_deterministic))
        descriptor_ready(q, k, v)
        B, H, Sq, _ = q.shape
        assert o.shape == (B, H, Sq, v.shape[-1]) and lse.shape == (B, H, Sq, 1) and lse.dtype == torch.float32
        # from the saved forward results, as cuDNN's backward: p from lse, delta = rowsum(dO * o)
        q64, k64, v64, o64, do64 = (t.double() for t in (q, k, v, o, grad_out))
        p = torch.exp(_masked_logits(q64, k64, attn_scale, is_causal, causal_bottom_right) - lse.double())
        dv = p.transpose(-1, -2) @ do64
        ds = p * (do64 @ v64.transpose(-1, -2) - (do64 * o64).sum(-1, keepdim=True)) * attn_scale
        dq, dk = ds @ k64, ds.transpose(-1, -2) @ q64
        return tuple(g.to(t.dtype) for g, t in zip((dq, dk, dv), (q, k, v)))

    lib.impl("sdpa_fwd", fwd, "CPU")
    lib.impl("sdpa_bwd", bwd, "CPU")

    def fwd_fake(q, k, v, attn_scale, *args, **kwargs):
        B, H, S, _ = q.shape
        return q.new_empty(B, H, S, v.shape[-1]), q.new_empty(B, H, S, 1, dtype=torch.float32)

    def bwd_fake(grad_out, q, k, v, *args, **kwargs):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    torch.library.register_fake("cudnn::sdpa_fwd", fwd_fake, lib=lib)
    torch.library.register_fake("cudnn::sdpa_bwd", bwd_fake, lib=lib)
    yield calls
    lib._destroy()


@pytest.mark.parametrize("lead, lq, lk, causal, deterministic", [
    ((2, 3), 9, 9, False, True),
    ((2, 3), 9, 9, True, True),
    ((2,), 5, 11, True, False),  # Lq < Lk: the diagonal aligned bottom-right, as the op's causal convention
    ((), 7, 7, False, True),
])
def test_cudnn_adapter_matches_the_reference_through_the_stand_in_ops(stand_in_ops, lead, lq, lk, causal,
                                                                         deterministic):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*lead, 2, n, 8, generator=g, dtype=torch.float64).requires_grad_()
               for n in (lq, lk, lk))
    # a [B, L, H, D]-ordered q (heads split from one projection): the adapter must not need contiguous inputs
    q = q.detach().transpose(-2, -3).contiguous().transpose(-2, -3).requires_grad_()
    scale = 0.3
    out, lse = adapters.cudnn_attention(q, k, v, None, None, scale, causal, deterministic)
    d_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), d_out)
    ref_out, ref_lse = attention_reference(q, k, v, None, None, scale=scale, causal=causal)
    ref = torch.autograd.grad(ref_out, (q, k, v), d_out)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape == q.shape[:-1]
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)  # float32, as cuDNN's stats
    for a, r in zip(got, ref):  # the backward reads cuDNN's float32 lse: float32 rounding, not 1e-10
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)
    assert stand_in_ops == [("fwd", causal, causal and lq != lk, None),
                            ("bwd", causal, causal and lq != lk, deterministic)]


def test_cudnn_adapter_refuses_what_it_would_get_wrong(stand_in_ops):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="neither bias nor mask"):
        adapters.cudnn_attention(q, q, q, torch.zeros(1, 2, 4, 4), None, 1.0, False)
    with pytest.raises(ValueError, match="neither bias nor mask"):
        adapters.cudnn_attention(q, q, q, None, torch.ones(1, 1, 1, 4, dtype=torch.bool), 1.0, False)
    with pytest.raises(ValueError, match="causal with Lq 4 > Lk 3"):
        adapters.cudnn_attention(q, q[..., :3, :], q[..., :3, :], None, None, 1.0, True)
    assert stand_in_ops == []


def test_cudnn_adapter_hands_cudnn_dense_operands_and_refuses_double_backward(stand_in_ops):
    g = torch.Generator().manual_seed(4)
    base = torch.randn(2, 2, 6, 16, generator=g, dtype=torch.float64)
    q = base[..., ::2].requires_grad_()  # a strided last dim
    k = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, 2, 1, 8, generator=g, dtype=torch.float64).expand(2, 2, 9, 8)  # stride 0 along keys
    k2 = k.expand(2, 2, 9, 8)
    out, _ = adapters.cudnn_attention(q, k2, v, None, None, 0.5, False)  # the stand-ins assert the layout
    ref, _ = attention_reference(q, k2, v, None, None, scale=0.5)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()


def test_cudnn_ops_are_cudagraph_unsafe_and_trace_through_their_fakes(stand_in_ops):
    """torch.compile's CUDA graphs must run around the frontend (it breaks a capture): our wrapping ops carry the
    cudagraph_unsafe tag; under torch.compile they trace through the frontend's fakes in one graph."""
    if adapters._TAGS:
        for op in (torch.ops.attn_zoo.cudnn_sdpa_fwd, torch.ops.attn_zoo.cudnn_sdpa_bwd):
            assert torch.Tag.cudagraph_unsafe in op.default.tags
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    k = k.detach()[..., :1, :].expand(2, 2, 6, 8).requires_grad_()  # a broadcast operand: copied inside the graph

    def f(q, k, v):
        return adapters.cudnn_attention(q, k, v, None, None, 0.4, True)[0].square().sum()

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_describe_counts_the_attention_problems():
    q = torch.zeros(2, 3, 4, 10, 8)
    k = torch.zeros(2, 3, 4, 12, 8)
    info = describe(q, k, k, None, None, False, False, True)
    assert (info.problems, info.lq, info.lk) == (24, 10, 12)


def test_ring_attention_refuses_a_named_backend_without_an_lse_gradient_before_the_forward():
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pytest.raises(ValueError, match="backend='cudnn' has none"):
        attn_ops.ring_attention(q, q, q, backend="cudnn")
    with torch.no_grad():  # without gradients its forward is all a ring call needs; here it refuses the device
        with pytest.raises(registry.UnsupportedInputs, match="cudnn"):
            attn_ops.ring_attention(q, q, q, backend="cudnn")


# -- on a GPU with the frontend ---------------------------------------------------------------------------------

gpu = pytest.mark.gpu
GPU_SHAPES = {  # (batch dims, H, Lq, Lk, D, causal)
    "esm-like": ((2,), 4, 96, 96, 64, False),
    "causal-odd": ((1, 3), 2, 77, 77, 128, True),
    "causal-lq<lk": ((2,), 2, 33, 80, 32, True),
    "odd-lengths": ((3,), 2, 45, 131, 64, False),
    "one-query": ((2,), 2, 1, 50, 64, True),
}


def _need_cudnn():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if "cudnn" not in attn_ops.backends():
        pytest.skip(registry.get("cudnn").unavailable_reason() or "cudnn backend unavailable")


@gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_cudnn_matches_reference(name, dtype):
    _need_cudnn()
    batch, h, lq, lk, d, causal = GPU_SHAPES[name]
    q, k, v, _, _ = make_inputs(batch, h, lq, lk, d, dtype=dtype, seed=5, device="cuda")
    check_against_reference("cudnn", q, k, v, None, None, causal=causal)
    with torch.no_grad():  # lse, forward only (the backend gives no gradient through it)
        _, lse = attn_ops.attention(q, k, v, causal=causal, return_lse=True, backend="cudnn")
        _, ref = attention_reference(q.double(), k.double(), v.double(), None, None, causal=causal)
    torch.testing.assert_close(lse.double(), ref, rtol=0, atol=2e-2)


@gpu
@pytest.mark.parametrize("layout", ["heads-split", "unmergeable-batch", "dv-differs"])
def test_gpu_cudnn_matches_reference_on_the_layouts_models_pass(layout):
    _need_cudnn()
    g = torch.Generator(device="cpu").manual_seed(8)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    if layout == "heads-split":  # [B, H, L, D] views of one [B, L, 3, H, D] projection
        qkv = rnd(2, 70, 3, 4, 64).requires_grad_()
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        leaves = [qkv]
    elif layout == "unmergeable-batch":  # [B, R, H, L, D] with R the slowest dim: no view flattens B and R
        q, k, v = (rnd(3, 2, 2, 40, 32).transpose(0, 1).requires_grad_() for _ in range(3))
        leaves = [q, k, v]
    else:
        q, k = (rnd(2, 2, 40, 64).requires_grad_() for _ in range(2))
        v = rnd(2, 2, 40, 32).requires_grad_()
        leaves = [q, k, v]
    out = attn_ops.attention(q, k, v, backend="cudnn")
    d_out = torch.randn(out.shape, generator=g).to("cuda", out.dtype)
    got = torch.autograd.grad(out, leaves, d_out)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    if layout == "heads-split":
        q64, k64, v64 = (leaves64[0][:, :, i].transpose(1, 2) for i in range(3))
    else:
        q64, k64, v64 = leaves64
    ref, _ = attention_reference(q64, k64, v64, None, None)
    want = torch.autograd.grad(ref, leaves64, d_out.double())
    low, _ = attention_reference(q.detach(), k.detach(), v.detach(), None, None, upcast=False)
    base = (low.double() - ref).abs().max().item()  # PyTorch's own bf16 error on these inputs
    assert (out.double() - ref).abs().max().item() <= 2 * base + 1e-2
    for a, r in zip(got, want):
        assert (a.double() - r).abs().max().item() <= 4e-2 * max(r.abs().max().item(), 1.0)


@gpu
def test_gpu_cudnn_is_refused_inside_a_cuda_graph_capture_and_auto_takes_triton_there():
    """The frontend's execute breaks a capture (cudaErrorStreamCaptureImplicit on an H200): inside one the registry
    refuses cudnn by name, and auto, which takes it outside, takes triton."""
    _need_cudnn()
    q, k, v, _, _ = make_inputs((1,), 16, 4096, 4096, 128, dtype=torch.bfloat16, seed=9, device="cuda")
    assert registry.select("auto", describe(q, k, v, None, None, False, False, True)).name == "cudnn"
    seen = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attn_ops.attention(q, k, v, backend="triton")  # warm: triton's kernels compiled before the capture
        attn_ops.wait_compiles()
        attn_ops.attention(q, k, v, backend="triton")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seen["auto"] = registry.select("auto", describe(q, k, v, None, None, False, False, True)).name
        seen["named"] = registry.not_supported_reasons("cudnn", describe(q, k, v, None, None, False, False, True))
        out = attn_ops.attention(q, k, v, backend="auto")
    graph.replay()
    torch.cuda.synchronize()
    assert seen["auto"] == "triton" and "cannot run inside a CUDA graph capture" in seen["named"]
    torch.testing.assert_close(out, attn_ops.attention(q, k, v, backend="triton"), rtol=0, atol=0)


@gpu
def test_gpu_cudnn_backward_is_bitwise_repeatable_and_auto_routes_there():
    _need_cudnn()
    q, k, v, _, _ = make_inputs((1,), 16, 4096, 4096, 128, dtype=torch.bfloat16, seed=6, device="cuda")
    assert registry.select("auto", describe(q, k, v, None, None, False, False, True)).name == "cudnn"
    d_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    noise = torch.randn(2048, 2048, device="cuda")
    first = None
    for i in range(6):
        noise[: 512 + 256 * i] @ noise[: 512 + 256 * i].T  # other work in flight between runs
        out = attn_ops.attention(q, k, v, backend="auto")
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        if first is None:
            first = grads
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, grads)), f"run {i} differs"


@gpu
def test_gpu_cudnn_compiles_in_one_graph():
    _need_cudnn()
    q, k, v, _, _ = make_inputs((2,), 4, 128, 128, 64, dtype=torch.bfloat16, seed=7, device="cuda")

    def f(q, k, v):
        return attn_ops.attention(q, k, v, causal=True, backend="cudnn").float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@gpu
def test_gpu_cudnn_under_reduce_overhead_compile_runs_outside_its_cuda_graphs():
    """The wrapping ops' cudagraph_unsafe tag: torch.compile's CUDA graphs leave the cudnn calls out (a capture
    through them would fail) and the step gives the eager bits."""
    _need_cudnn()
    q, k, v, _, _ = make_inputs((2,), 4, 256, 256, 128, dtype=torch.bfloat16, seed=10, device="cuda")

    def f(q, k, v):
        return attn_ops.attention(q, k, v, causal=True, backend="cudnn").float().square().sum()

    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    torch._dynamo.reset()
    compiled = torch.compile(f, mode="reduce-overhead")
    for _ in range(3):  # warm-up, recording, replay
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
