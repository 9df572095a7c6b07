"""The triton backend on a GPU: the CPU test matrix in bf16/fp16/fp32 at realistic sizes (skipped without CUDA).

Errors are bounded by a small multiple of plain PyTorch's error in the same dtype (tests/helpers.py); fp32 inputs
use full fp32 products in the kernels (no TF32), like PyTorch's default matmul.
"""
import dataclasses
import os
import re

import pytest
import torch

from attn_ops.settings import kernel_settings
from helpers import (
    GARBAGE_IDS, GARBAGE_RUNS, check_against_reference, check_garbage_at_masked_keys,
    check_row_under_huge_additive_bias, empty_some_rows, ids_from_lengths, make_inputs,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _one_config_per_kernel(monkeypatch):
    """settings.tune False for this file's tests only, unless ATTN_ZOO_NO_TUNE is set: one config per kernel keeps
    this file's compile time small; other GPU test modules in the same run still tune, and the untuned picks stay in
    a cache of this test's own."""
    from attn_ops import settings
    from attn_ops.triton import tuning

    if "ATTN_ZOO_NO_TUNE" not in os.environ:
        monkeypatch.setattr(settings, "_current", dataclasses.replace(settings.get(), tune=False))
    monkeypatch.setattr(tuning.TUNER, "picks", {})

# (name, batch, H, Lq, Lk, D, Dv, bias_shape, mask_shape, causal)
CASES = [
    ("triangle_pair_bias", (1, 24), 4, 160, 160, 32, 32, (1, 1, 4, 160, 160), (1, 24, 1, 1, 160), False),
    ("msa_rows_odd_L", (2, 6), 8, 203, 203, 32, 32, (2, 1, 8, 203, 203), (2, 6, 1, 1, 203), False),
    ("dense_full_bias_d128", (2,), 4, 256, 256, 128, 128, (2, 4, 256, 256), None, False),
    ("head_bias_over_batch_d64", (3,), 4, 300, 300, 64, 64, (1, 4, 300, 300), (3, 1, 1, 300), False),
    ("relpos_bias_h1lk_d80", (), 4, 129, 257, 80, 80, (4, 1, 257), None, False),
    ("causal_lq_lt_lk_d96", (2,), 4, 200, 333, 96, 96, (2, 4, 200, 333), (2, 1, 1, 333), True),
    ("causal_lq_gt_lk_d48", (2,), 2, 300, 190, 48, 48, (1, 2, 1, 190), None, True),
    ("causal_nobias_d128", (1,), 8, 512, 512, 128, 128, None, None, True),
    ("d256", (1,), 2, 130, 130, 256, 256, (1, 2, 130, 130), (1, 1, 1, 130), False),
    ("d16_dv40", (2,), 2, 100, 77, 16, 40, (2, 1, 100, 1), (2, 2, 100, 77), False),
    ("key_mask_no_bias_d64", (2, 5), 4, 150, 177, 64, 64, None, (2, 5, 1, 1, 177), False),
    ("triangle_even_tiles", (1, 8), 4, 256, 256, 32, 32, (1, 1, 4, 256, 256), (1, 8, 1, 1, 256), False),
]
RUNS = [(c, torch.bfloat16, "split") for c in CASES]
RUNS += [(c, torch.bfloat16, "fused") for c in CASES if c[0] in ("triangle_pair_bias", "dense_full_bias_d128",
                                                                   "causal_lq_lt_lk_d96", "d256",
                                                                   "key_mask_no_bias_d64")]
RUNS += [(c, dt, "split") for c in CASES for dt in (torch.float16, torch.float32)
         if c[0] in ("msa_rows_odd_L", "relpos_bias_h1lk_d80", "causal_lq_gt_lk_d48", "d16_dv40")]
# deterministic=False with the split dq: a broadcast bias's gradient summed by atomics (dQ kernel; dK/dV's with TMA)
RUNS += [(c, dt, "atomic") for c in CASES for dt in (torch.bfloat16, torch.float32)
         if c[0] in ("triangle_pair_bias", "msa_rows_odd_L", "head_bias_over_batch_d64", "triangle_even_tiles")]


@pytest.mark.parametrize("case,dtype,variant", RUNS, ids=[f"{c[0]}-{str(d)[6:]}-{v}" for c, d, v in RUNS])
def test_matches_reference_gpu(case, dtype, variant):
    _, batch, h, lq, lk, d, dv, bshape, mshape, causal = case
    q, k, v, bias, mask = make_inputs(batch, h, lq, lk, d, dv, dtype=dtype, bias_shape=bshape, mask_shape=mshape,
                                      seed=len(case[0]), device="cuda")
    opts = {"split": dict(bwd="split"), "fused": dict(bwd="fused", deterministic=False),
            "atomic": dict(bwd="split", deterministic=False)}[variant]
    check_against_reference("triton", q, k, v, bias, mask, causal=causal, **opts)


# Head widths below tl.dot's 16 and between powers of two (AF2's extra-MSA c_hidden 8), D != Dv, ragged crop lengths
# with key padding whose first slice is fully masked. The fused runs take the TMA dq reduction on Hopper with a
# [*, 16]-column box over an 8-column accumulator.
WIDTH_CASES = [
    ("d8_pair_bias_over_rows", (1, 8), 8, 203, 203, 8, 8, (1, 1, 8, 203, 203), (1, 8, 1, 1, 203), False),
    ("d24_pair_bias_over_rows_crop", (1, 12), 4, 300, 300, 24, 24, (1, 1, 4, 300, 300), (1, 12, 1, 1, 300), False),
    ("d48_dv24_full_bias", (2,), 4, 257, 200, 48, 24, (2, 4, 257, 200), (2, 1, 1, 200), False),
    ("d8_dv48_causal_lq1", (3,), 2, 1, 129, 8, 48, (1, 2, 1, 129), (3, 1, 1, 129), True),
    ("d24_dv8_key_bias_over_rows", (2,), 4, 190, 333, 24, 8, (4, 1, 333), (2, 4, 1, 333), False),
]
WIDTH_RUNS = [(c, torch.bfloat16, v) for c in WIDTH_CASES for v in ("split", "fused")]
WIDTH_RUNS += [(c, torch.bfloat16, "atomic") for c in WIDTH_CASES if "over_rows" in c[0]]
WIDTH_RUNS += [(c, torch.float32, v) for c in WIDTH_CASES[:1] for v in ("split", "fused")]


@pytest.mark.parametrize("case,dtype,variant", WIDTH_RUNS, ids=[f"{c[0]}-{str(d)[6:]}-{v}" for c, d, v in WIDTH_RUNS])
def test_head_widths_match_reference_gpu(case, dtype, variant):
    _, batch, h, lq, lk, d, dv, bshape, mshape, causal = case
    q, k, v, bias, mask = make_inputs(batch, h, lq, lk, d, dv, dtype=dtype, bias_shape=bshape, mask_shape=mshape,
                                      seed=len(case[0]), device="cuda")
    empty_some_rows(mask)
    opts = {"split": dict(bwd="split"), "fused": dict(bwd="fused", deterministic=False),
            "atomic": dict(bwd="split", deterministic=False)}[variant]
    check_against_reference("triton", q, k, v, bias, mask, causal=causal, **opts)


# q, k, v as head views of [*, L, H, C] memory, the blocks' layout: the head stride is C, which Triton does not
# specialise unless 16 divides it, so the kernels take the strides' alignment from the launcher (ALIGN: 8 for
# C = 8, 24, 40; 16 for 48; 4 for 12, 20; 1 for 17) and keep 16-byte vector loads where it allows them. The
# contiguous layout [*, H, L, C] (row stride C) is the WIDTH_CASES above.
VIEW_WIDTHS = [8, 12, 17, 20, 24, 40, 48]


@pytest.mark.parametrize("variant", ["split", "fused", "atomic"])
@pytest.mark.parametrize("c", VIEW_WIDTHS, ids=[f"c{c}" for c in VIEW_WIDTHS])
def test_head_views_of_any_width_match_reference_gpu(c, variant):
    from attn_ops.triton import launch

    R, H, L = 6, 4, 203
    g = torch.Generator().manual_seed(c)

    def heads(*shape):  # [1, R, L, H, C] memory seen as [1, R, H, L, C]
        base = torch.randn(*shape, generator=g, dtype=torch.float64).to("cuda", torch.bfloat16).requires_grad_()
        return base.transpose(2, 3)

    q, k, v = heads(1, R, L, H, c), heads(1, R, L, H, c), heads(1, R, L, H, c)
    assert launch._align(q, k, v) == min(16, c & -c)
    bias = torch.randn(1, 1, H, L, L, generator=g, dtype=torch.float64).to("cuda", torch.bfloat16).requires_grad_()
    mask = empty_some_rows((torch.rand(1, R, 1, 1, L, generator=g) > 0.3).cuda())
    opts = {"split": dict(bwd="split"), "fused": dict(bwd="fused", deterministic=False),
            "atomic": dict(bwd="split", deterministic=False)}[variant]
    check_against_reference("triton", q, k, v, bias, mask, **opts)


@pytest.fixture
def two_rows_only(monkeypatch):
    """Offer the tuner only two-rows-per-program dK/dV configs for pair biases (an untuned pick would take one row)."""
    from attn_ops.triton import tuning

    original = tuning.candidates

    def two_rows(kernel, head_dim, lq, lk, pair=False):
        return [c for c in original(kernel, head_dim, lq, lk, pair) if c.rows == 2 or not pair]

    monkeypatch.setattr(tuning, "candidates", two_rows)
    monkeypatch.setattr(tuning.TUNER, "picks", {})
    return tuning


@pytest.mark.parametrize("rows", [24, 7], ids=["even_R", "odd_R"])
def test_atomic_dbias_two_rows_per_program_gpu(rows, two_rows_only, monkeypatch):
    """The tuner picks two rows per dK/dV program for pair biases with deterministic=False where the dK/dV kernel
    adds the bias gradient (TMA reductions: forced here, the case is small); untuned, the file's other cases run
    one row, so this case offers only two-row configs (an odd R repeats its last row)."""
    from attn_ops.triton import launch

    tuning = two_rows_only
    monkeypatch.setattr(launch.STATE, "tma_min_scores", 0)
    q, k, v, bias, mask = make_inputs((1, rows), 4, 160, 160, 32, dtype=torch.bfloat16, bias_shape=(1, 1, 4, 160, 160),
                                      mask_shape=(1, rows, 1, 1, 160), seed=rows, device="cuda")
    check_against_reference("triton", q, k, v, bias, mask, bwd="split", deterministic=False)
    assert any(key[0] == "dkdv" and key[1] and cfg.rows == 2 for key, cfg in tuning.chosen().items())


@pytest.mark.parametrize("bias_shape", [(1, 1, 4, 192, 192), (1, 32, 4, 192, 192), (4, 1, 192)],
                         ids=["pair_bias_over_rows", "full", "relpos_h1lk"])
def test_split_backward_is_bitwise_deterministic_gpu(bias_shape):
    from attn_ops.triton import triton_attention

    q, k, v, bias, mask = make_inputs((1, 32), 4, 192, 192, 32, dtype=torch.bfloat16, bias_shape=bias_shape,
                                      mask_shape=(1, 32, 1, 1, 192), device="cuda")
    g = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

    def grads():
        out, lse = triton_attention(q, k, v, bias, mask, 32 ** -0.5, False, deterministic=True)
        return torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v, bias))

    first = grads()
    for _ in range(3):
        for a, b in zip(first, grads()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("splits", [0, 1])
def test_direct_launch_equals_triton_launch_gpu(monkeypatch, splits):
    """Every kernel of a forward + backward runs through the direct call on the second call (the entries
    exist), and gives the same bits as Triton's own launch path (settings.fast_launch False)."""
    from attn_ops.triton import launch, tuning, triton_attention
    from attn_ops.triton.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_preprocess_kernel
    from attn_ops.triton.dbias import attn_bwd_dbias_kernel, sum_splits_kernel
    from attn_ops.triton.forward import attn_fwd_kernel

    monkeypatch.setattr(tuning, "_DBIAS_SPLITS", (splits,))
    monkeypatch.setattr(tuning.TUNER, "picks", {})
    q, k, v, bias, mask = make_inputs((1, 12), 4, 150, 150, 32, dtype=torch.bfloat16, bias_shape=(1, 1, 4, 150, 150),
                                      mask_shape=(1, 12, 1, 1, 150), device="cuda")
    g = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

    def run():
        out, lse = triton_attention(q, k, v, bias, mask, 32 ** -0.5, False)
        return (out, lse) + torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v, bias))

    with kernel_settings(fast_launch=False):
        plain = run()
    monkeypatch.setattr(launch.STATE, "compiled", {})
    monkeypatch.setattr(launch.STATE, "exact", {})  # earlier tests' exact entries would bypass it
    run()  # remembers the compiled kernels
    direct = run()
    kernels = {key[0] for key in launch.STATE.compiled}
    expected = {attn_fwd_kernel, bwd_preprocess_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_dbias_kernel}
    assert kernels == expected | ({sum_splits_kernel} if splits != 1 else set())  # 0: 8 per SM, split here
    for a, b in zip(plain, direct):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph_gpu():
    from attn_ops.triton import triton_attention

    q, k, v, bias, mask = make_inputs((1, 8), 4, 96, 96, 32, dtype=torch.bfloat16, bias_shape=(1, 1, 4, 96, 96),
                                      mask_shape=(1, 8, 1, 1, 96), device="cuda")

    def f(q, k, v, bias):
        out, lse = triton_attention(q, k, v, bias, mask, 0.2, False)
        return out.float().square().sum() + lse.sum()

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v, bias), (q, k, v, bias))
    want = torch.autograd.grad(f(q, k, v, bias), (q, k, v, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("deterministic", [True, False], ids=["split", "atomic"])
def test_cuda_graph_capture_replays_the_op_gpu(deterministic):
    """Forward + backward of the op captured in a CUDA graph (after a warm-up that picks the tiles, as
    ``torch.compile(mode="reduce-overhead")`` does) replays on new values copied into the captured inputs and gives
    what an eager call on those values gives: nothing in the launches syncs the host or depends on values seen at
    capture. Triangle layout: shared bias through a TMA descriptor, key mask, dBias reduction with split partials."""
    from attn_ops.triton import triton_attention

    shapes = dict(bias_shape=(1, 1, 4, 96, 96), mask_shape=(1, 16, 1, 1, 96), dtype=torch.bfloat16, device="cuda")
    q, k, v, bias, mask = make_inputs((1, 16), 4, 96, 96, 32, seed=1, **shapes)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    g_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    g_lse = torch.randn(q.shape[:-1], device="cuda")

    def step(ts):
        for t in ts:
            t.grad = None
        out, lse = triton_attention(*ts, mask, 0.2, False, deterministic=deterministic)
        torch.autograd.backward((out, lse), (g_out, g_lse))
        return out, lse

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(leaves)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(leaves)

    fresh = make_inputs((1, 16), 4, 96, 96, 32, seed=2, **shapes)[:4]
    with torch.no_grad():
        for t, f in zip(leaves, fresh):
            t.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    eager = [f.detach().clone().requires_grad_() for f in fresh]
    want_out, want_lse = step(eager)
    got = [out, lse] + [t.grad for t in leaves]
    want = [want_out, want_lse] + [t.grad for t in eager]
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dbias"], got, want):
        if deterministic or name != "dbias":
            assert torch.equal(a, b), name
        else:  # deterministic=False sums the shared bias's gradient by atomics: the last bits vary run to run
            assert (a.float() - b.float()).abs().max() <= 2.0 ** -7 * b.float().abs().max(), name


def test_bias_slice_over_2_31_elements_gpu():
    # A [L, L] bias slice with L^2 > 2^31 elements: row/column offsets must be 64-bit.
    from attn_ops.reference import attention_reference
    from attn_ops.triton import triton_attention

    L, tail = 46400, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 1, L, 16, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    bias = torch.randn(1, 1, L, L, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    out, lse = triton_attention(q, k, v, bias, None, 0.25, False)
    g_out = torch.zeros_like(out)
    g_out[..., -tail:, :] = torch.randn(1, 1, tail, 16, device="cuda", dtype=torch.bfloat16, generator=g)
    dq, db = torch.autograd.grad(out, (q, bias), g_out)
    ref_out, ref_lse = attention_reference(q[..., -tail:, :].float(), k.float(), v.float(),
                                           bias[..., -tail:, :].float(), None, 0.25)
    torch.testing.assert_close(out[..., -tail:, :].float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[..., -tail:], ref_lse, atol=2e-2, rtol=1e-3)
    rdq, rdb = torch.autograd.grad(ref_out, (q, bias), g_out[..., -tail:, :].float())
    torch.testing.assert_close(dq[..., -tail:, :].float(), rdq[..., -tail:, :].float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(db[..., -tail:, :].float(), rdb[..., -tail:, :].float(), atol=1e-3, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("with_bias,opts", GARBAGE_RUNS, ids=GARBAGE_IDS)
def test_garbage_at_masked_keys_changes_nothing_gpu(with_bias, opts, dtype):
    """NaN / inf padding in the bias and k at masked keys: the same bits as zeros there (helpers.py)."""
    check_garbage_at_masked_keys(with_bias, opts, dtype=dtype, device="cuda", lq=130, lk=203, rows=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fill", ["dtype_min", -1e9], ids=["dtype_min", "minus_1e9"])
def test_row_under_huge_additive_bias_gpu(fill, dtype):
    """A huge negative additive bias over a whole query row, several key tiles long (the GPU fuses each
    exponential's multiply-subtract, so a running-max rescale that is not exactly 1 would compound over tiles):
    finite everywhere, other rows and every gradient unchanged (helpers.py)."""
    fill = torch.finfo(dtype).min if fill == "dtype_min" else fill
    check_row_under_huge_additive_bias(fill, dtype, "cuda", lq=70, lk=300)


@pytest.mark.parametrize("with_bias,opts", GARBAGE_RUNS, ids=GARBAGE_IDS)
def test_garbage_at_masked_keys_even_tiles_gpu(with_bias, opts):
    """The same where every tile is in range (256 x 256): K/V/bias tiles load without range masks there."""
    check_garbage_at_masked_keys(with_bias, opts, dtype=torch.bfloat16, device="cuda", lq=256, lk=256, rows=8)


def test_garbage_at_masked_keys_two_rows_per_program_gpu(two_rows_only, monkeypatch):
    """The same with the two-rows-per-program dK/dV path (each row selects with its own key mask on the shared
    bias tile; the dK/dV kernel adds the bias gradient where TMA reductions take it: forced here, Lk % 4 == 0)."""
    from attn_ops.triton import launch

    monkeypatch.setattr(launch.STATE, "tma_min_scores", 0)
    check_garbage_at_masked_keys(True, dict(deterministic=False), dtype=torch.bfloat16, device="cuda", lq=130,
                                 lk=204, rows=8)
    assert any(key[0] == "dkdv" and key[1] and cfg.rows == 2 for key, cfg in two_rows_only.chosen().items())


@pytest.mark.parametrize("variant", ["split", "atomic"])
def test_tma_and_pointer_bias_loads_both_match_reference_gpu(variant, monkeypatch):
    """A shared pair bias with 16-byte rows (bf16, L = 200: ragged against every tile) is read through a TMA
    descriptor by default and through pointers with settings.tma False; both paths match the reference, and each
    run took the path it was meant to."""
    from attn_ops.triton import launch, passes

    seen = []
    real = passes.bias_tma
    monkeypatch.setattr(passes, "bias_tma", lambda *a: seen.append(real(*a)) or seen[-1])
    monkeypatch.setattr(launch.STATE, "tma_min_scores", 0)  # this small shape would skip TMA (host-bound rule)
    opts = dict(bwd="split") if variant == "split" else dict(bwd="split", deterministic=False)
    q, k, v, bias, mask = make_inputs((1, 6), 4, 200, 200, 32, dtype=torch.bfloat16, bias_shape=(1, 1, 4, 200, 200),
                                      mask_shape=(1, 6, 1, 1, 200), device="cuda")
    check_against_reference("triton", q, k, v, bias, mask, **opts)
    assert seen and all(p is not None for p in seen)
    seen.clear()
    with kernel_settings(tma=False):
        check_against_reference("triton", q, k, v, bias, mask, **opts)
    assert seen and all(p is None for p in seen)


@pytest.mark.parametrize("variant", ["fused", "atomic"])
def test_tma_reduce_and_element_atomics_both_match_reference_gpu(variant, monkeypatch):
    """The atomic accumulators (dq of the fused backward, a shared bias's gradient with deterministic=False) take one
    bulk TMA reduction per tile on Hopper and per-element atomics elsewhere: both match the reference on a ragged
    pair-bias case (L = 200 against every tile), and each run took the path it was meant to."""
    from attn_ops.triton import launch, passes

    made = []
    real = passes._reduce_desc
    monkeypatch.setattr(passes, "_reduce_desc", lambda *a: made.append(a[1:3]) or real(*a))
    monkeypatch.setattr(launch.STATE, "tma_min_scores", 0)  # this small case is host-bound: TMA would be skipped
    opts = dict(bwd="fused", deterministic=False) if variant == "fused" else dict(bwd="split", deterministic=False)
    q, k, v, bias, mask = make_inputs((1, 6), 4, 200, 200, 32, dtype=torch.bfloat16, bias_shape=(1, 1, 4, 200, 200),
                                      mask_shape=(1, 6, 1, 1, 200), device="cuda")
    check_against_reference("triton", q, k, v, bias, mask, **opts)
    want = (200, 32) if variant == "fused" else (200, 200)  # (rows, cols) of the accumulator's slices
    assert want in made
    made.clear()
    monkeypatch.setattr(passes, "_tma_reduce", lambda device: False)
    monkeypatch.setattr(launch.STATE, "plans", {})  # the plans made above hold the TMA path
    check_against_reference("triton", q, k, v, bias, mask, **opts)
    assert not made


@pytest.mark.parametrize("length", [100, 101], ids=["rows_of_16_bytes", "padded_rows"])
def test_bias_gradient_atomics_are_16_byte_vectors_gpu(length):
    """deterministic=False adds a shared bias's gradient in the dQ kernel (a small step: no TMA) with 16-byte vector
    atomics, also for a length whose accumulator rows are padded to 4 floats; it matches the reference."""
    from attn_ops.triton.backward import attn_bwd_dq_kernel

    q, k, v, bias, mask = make_inputs((1, 6), 4, length, length, 32, dtype=torch.bfloat16,
                                      bias_shape=(1, 1, 4, length, length), mask_shape=(1, 6, 1, 1, length),
                                      device="cuda", seed=length)
    check_against_reference("triton", q, k, v, bias, mask, bwd="split", deterministic=False)
    ptx = [c.asm["ptx"] for cache in attn_bwd_dq_kernel.device_caches.values() for c in cache[0].values()]
    atomic = [p for p in ptx if "atom.global" in p]
    assert atomic and all("add.v4.f32" in p and "add.f32" not in p for p in atomic), [
        sorted(set(re.findall(r"atom\.global[a-z0-9.]*", p))) for p in atomic]


def _compiled_counts():
    """Compiled binaries per kernel in Triton's in-process cache (JITFunction.device_caches[device][0])."""
    from attn_ops.triton.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_preprocess_kernel
    from attn_ops.triton.dbias import attn_bwd_dbias_kernel, sum_splits_kernel
    from attn_ops.triton.forward import attn_fwd_kernel

    kernels = (attn_fwd_kernel, bwd_preprocess_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel,
               attn_bwd_dbias_kernel, sum_splits_kernel)
    return {k.fn.__name__: sum(len(c[0]) for c in k.device_caches.values()) for k in kernels}


@pytest.mark.parametrize("variant", ["split", "atomic"])
def test_lengths_differing_mod_16_reuse_compiled_kernels_gpu(variant):
    """Lengths 193-207 (one tuning bucket, ragged against every tile) run on the kernels compiled for 200: the
    length args and length-proportional strides are not specialised, so Triton compiles nothing new, and the direct
    launch cache gains no entry. (The atomic variant's TMA reduction of dbias needs Lk % 4 == 0: its lengths keep
    that.)"""
    from attn_ops.triton import launch

    opts = dict(bwd="split") if variant == "split" else dict(bwd="split", deterministic=False)

    def step(L):
        q, k, v, bias, mask = make_inputs((1, 4), 4, L, L, 32, dtype=torch.bfloat16, bias_shape=(1, 1, 4, L, L),
                                          mask_shape=(1, 4, 1, 1, L), seed=L, device="cuda")
        check_against_reference("triton", q, k, v, bias, mask, **opts)

    step(200)
    compiled, direct = _compiled_counts(), len(launch.STATE.compiled)
    assert sum(compiled.values()) > 0
    for L in ((207, 193, 204) if variant == "split" else (196, 204)):
        step(L)
        assert _compiled_counts() == compiled, L
        assert len(launch.STATE.compiled) == direct, L


def test_tile_multiple_runs_the_general_variant_while_its_own_compiles_gpu(monkeypatch):
    """A length that is a multiple of its bucket's tiles (256, with the untuned configs' 64- and 128-wide tiles)
    after a ragged one of the same bucket (200): its EVEN_M / EVEN_N kernels compile on the background thread while the compiled general ones give the
    call's results (its plan kept with the pending compiles); once they are ready, the next call records its plan
    anew with them. Every call matches the reference."""
    from attn_ops.triton import launch, tuning

    monkeypatch.setattr(launch.STATE, "plans", {})
    monkeypatch.setattr(tuning.TUNER, "jobs", {})
    # kernels that earlier tests of the process compiled (their EVEN variants among them) are forgotten: Triton's
    # own cache still has them, so the general ones are at hand again after the 200 step
    monkeypatch.setattr(launch.STATE, "compiled", {})
    monkeypatch.setattr(launch.STATE, "exact", {})
    asked = []
    real_launch = launch.launch_kernel

    def spy(kernel, grid, args, num_warps, num_stages, **constexprs):
        if "EVEN_M" in constexprs:
            asked.append(bool(constexprs["EVEN_M"] or constexprs["EVEN_N"]))
        return real_launch(kernel, grid, args, num_warps, num_stages, **constexprs)

    monkeypatch.setattr(launch, "launch_kernel", spy)
    with kernel_settings(tune=False):
        def step(L):
            del asked[:]
            q, k, v, bias, mask = make_inputs((1, 4), 4, L, L, 32, dtype=torch.bfloat16,
                                              bias_shape=(1, 1, 4, L, L), mask_shape=(1, 4, 1, 1, L), seed=L,
                                              device="cuda")
            check_against_reference("triton", q, k, v, bias, mask)
            return list(asked)

        assert not any(step(200))
        plans = len(launch.STATE.plans)
        first = step(256)
        assert len(launch.STATE.plans) == plans + 2  # stand-ins ran: the plans are kept with their pending compiles
        jobs = list(tuning.TUNER.jobs.values())
        assert jobs and first.count(False) == len(jobs)  # each general stand-in left its EVEN variant compiling
        for job in jobs:
            job.result(timeout=300)
        assert all(step(256)) and len(launch.STATE.plans) == plans + 2  # recorded anew with the EVEN variants
        assert not any(p.pending for p in launch.STATE.plans.values())


def test_small_steps_read_the_bias_without_tma_gpu():
    """Below ``TMA_MIN_SCORES`` attention scores per launch the bias goes by pointer loads (the host's descriptor
    encoding costs more than TMA saves there); at and above it, through a descriptor on a Hopper GPU."""
    from attn_ops.triton import passes

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper GPU")
    for n, want_tma in ((256, False), (512, True)):
        q = torch.empty(1, n, 4, n, 32, device="cuda", dtype=torch.bfloat16)
        bias = torch.empty(1, 1, 4, n, n, device="cuda", dtype=torch.bfloat16)
        _, tma, _ = passes.bias_for_tiles(bias, q, n, n)
        assert (tma is not None) == want_tma, n


def test_tuning_measure_orders_work_by_gpu_time_gpu():
    """tuning.measure (the tuner's timer): a GEMM with 8x the work measures several times longer, and the median
    of a sub-microsecond launch stays far below a millisecond (the buffer clear before each run is not timed)."""
    from attn_ops.triton.tuning import measure

    a, b = torch.randn(2048, 2048, device="cuda"), torch.randn(4096, 4096, device="cuda")
    small, big = measure(lambda: a @ a), measure(lambda: b @ b)
    assert 0 < small < big and big / small > 4, (small, big)
    tiny = torch.zeros(16, device="cuda")
    assert measure(lambda: tiny.add_(1)) < 0.1


def _spans_brute_force(own, other):
    """Per position of ``own`` [n, Lo] the (first, last + 1) positions of ``other`` [n, Lt] with its id; (-1, -1)
    where it has none or is padding."""
    match = (own[:, :, None] == other[:, None, :]) & (own >= 0)[:, :, None]
    pos = torch.arange(other.shape[-1], device=own.device)
    first = torch.where(match, pos, other.shape[-1]).amin(-1)
    last = torch.where(match, pos, -1).amax(-1)
    found = match.any(-1)
    return torch.where(found, first, -1), torch.where(found, last + 1, -1), found


def _ids(lengths, total, pad_every=0, g=None):
    """ids_from_lengths, with about one position in ``pad_every`` turned into padding (ids -1)."""
    ids = ids_from_lengths(lengths, total)
    if pad_every:
        ids[torch.rand(total, generator=g) < 1 / pad_every] = -1
    return ids


def test_segment_tables_compiled_match_brute_force_gpu():
    """The compiled segment-table kernel (chunk carries, reverse scans, the barrier between its phases): per
    position the exact span of its id on the other side, for shared int64 ids over several 1024-position chunks
    with padding across a chunk boundary, a pair of int32 ids broadcast over different batch dims (q [1, R, Lq],
    k [B, 1, Lk]), Lq = 1 against Lk = 1025, and ids with a last-dim stride of 2."""
    from attn_ops.triton.op import segment_tables

    g = torch.Generator().manual_seed(0)
    long_ids = _ids(torch.randint(150, 250, (12,), generator=g).tolist(), 3000, pad_every=20, g=g)
    long_ids[900:1100] = -1
    shared = long_ids.view(1, 1, -1).cuda()
    q3 = torch.stack([_ids([300, 200, 200], 700), _ids([50, 600], 700), _ids([700], 700)]).int()
    k2 = torch.stack([_ids([900, 1000, 600], 2500, pad_every=9, g=g), _ids([2, 2400], 2500)]).int()
    strided = _ids([5, 900, 100, 20], 1030).repeat_interleave(2).view(1, 1, -1).cuda()[..., ::2]
    cases = [(shared, shared), (q3[None].cuda(), k2[:, None].cuda()),
             (torch.tensor([[[0]]], device="cuda"), _ids([1025], 1025).view(1, 1, -1).cuda()), (strided, strided)]
    for q_ids, k_ids in cases:
        qt, kt = segment_tables(q_ids, k_ids)
        batch = torch.broadcast_shapes(q_ids.shape[:-1], k_ids.shape[:-1])
        for table, own, other in ((qt, q_ids, k_ids), (kt, k_ids, q_ids)):
            own_b = own.expand(batch + own.shape[-1:]).reshape(-1, own.shape[-1]).long()
            other_b = other.expand(batch + other.shape[-1:]).reshape(-1, other.shape[-1]).long()
            ids, lo, hi = (t.reshape(-1, t.shape[-1]).long() for t in table.unbind(-2))
            first, end, found = _spans_brute_force(own_b, other_b)
            assert torch.equal(ids, torch.where(own_b >= 0, own_b, -1))
            assert torch.equal(torch.where(found, lo, -1), first) and torch.equal(torch.where(found, hi, -1), end)
            assert bool((hi[~found] <= lo[~found]).all())


@pytest.mark.parametrize("n", [200, 203], ids=["rows_16_bytes", "rows_copied"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointer_loads", "tma"])
@pytest.mark.parametrize("variant", ["split", "atomic", "fused"])
def test_replayed_launch_plans_match_fresh_calls_gpu(variant, tma, n, monkeypatch):
    """A call replayed from its geometry's launch plan (direct launches of the compiled kernels, buffers allocated
    by the plan, per-call TMA descriptors and bias row copies) gives what running the launchers afresh gives on the
    same values: the same bits for the deterministic split backward, equal within fp32 atomics' reordering else."""
    from attn_ops.triton import launch, triton_attention

    monkeypatch.setattr(launch.STATE, "plans", {})
    if tma:
        monkeypatch.setattr(launch.STATE, "tma_min_scores", 0)  # this small case is host-bound: TMA would be skipped
    opts = {"split": {}, "atomic": {"deterministic": False}, "fused": {"deterministic": False, "bwd": "fused"}}[variant]

    def grads(seed):
        q, k, v, bias, mask = make_inputs((1, 6), 4, n, n, 32, dtype=torch.bfloat16, bias_shape=(1, 1, 4, n, n),
                                          mask_shape=(1, 6, 1, 1, n), device="cuda", seed=seed)
        out, lse = triton_attention(q, k, v, bias, mask, 0.2, False, **opts)
        loss = out.float().square().sum() + torch.where(lse.isfinite(), lse, 0).sum()
        return [out, lse, *torch.autograd.grad(loss, (q, k, v, bias))]

    grads(1)  # records the forward's and the backward's plans
    replayed = grads(2)
    assert len(launch.STATE.plans) == 2
    launch.STATE.plans.clear()
    fresh = grads(2)
    for a, b in zip(replayed, fresh):
        if variant == "split":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tune", [False, True])
def test_compile_ahead_then_real_calls_are_exact_gpu(tune, monkeypatch):
    """Throwaway fwd + bwd calls under ``compile_ahead`` (the backward's kernels launched from autograd's device
    thread), then real calls: every kernel it compiled has its launcher and module loaded, these calls compile
    nothing, match the float64 reference, and give the bits of the same calls made again with no launch plan or
    direct-launch entry kept."""
    import attn_ops
    from attn_ops.triton import launch, triton_attention
    from triton.runtime.jit import JITFunction

    lengths = (77, 141) if tune else (75, 139)
    dtype, width = torch.bfloat16, 32
    cases = [make_inputs((1, 3), 2, n, n, width, dtype=dtype, bias_shape=(1, 1, 2, n, n),
                         mask_shape=(1, 3, 1, 1, n), device="cuda") for n in lengths]

    def call(q, k, v, bias, mask):
        out, lse = triton_attention(q, k, v, bias, mask, width ** -0.5, False)
        return [out, lse, *torch.autograd.grad((out.float() ** 2).sum() + lse.sum(), (q, k, v, bias))]

    compiles = []
    real_compile = JITFunction._do_compile

    def counted(self, *a, **kw):
        compiles.append(self.fn.__name__)
        return real_compile(self, *a, **kw)

    monkeypatch.setattr(JITFunction, "_do_compile", counted)
    with kernel_settings(tune=tune, cache_dir=None):
        with attn_ops.compile_ahead():
            for c in cases:
                call(*c)
        assert not attn_ops.compiling_ahead()  # (other tests may have compiled these variants already)
        assert all(getattr(k, "module", True) is not None for k in launch.STATE.compiled.values())
        compiles.clear()
        got = [call(*c) for c in cases]
        assert compiles == []
        for c in cases:
            check_against_reference("triton", *c)
        launch.clear_plans()
        launch.STATE.exact.clear()
        again = [call(*c) for c in cases]
    for g, a in zip(got, again):
        for x, y in zip(g, a):
            assert torch.equal(x, y)
