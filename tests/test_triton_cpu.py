"""The triton backend on CPU under TRITON_INTERPRET=1: outputs, lse and every gradient vs the float64 reference.

Tiny shapes (the interpreter is slow); errors are bounded by a small multiple of plain PyTorch's own error in
the same dtype (tests/helpers.py). fp32 and fp16 only (bf16 is broken in the interpreter).
"""
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does the same)
# On a GPU machine this file runs only with TRITON_INTERPRET=1 set for the whole run: setting it here would switch
# the launch path of every GPU test collected with it to the interpreter's.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton interpreter tests (CPU): run with TRITON_INTERPRET=1")

pytest.importorskip("triton")

import attn_ops  # noqa: E402
from attn_ops.settings import kernel_settings  # noqa: E402
from attn_ops.reference import attention_reference  # noqa: E402
from attn_ops.triton import triton_attention  # noqa: E402
from attn_ops.triton import triton_lse_backward  # noqa: E402
from helpers import (  # noqa: E402
    GARBAGE_IDS, GARBAGE_RUNS, check_against_reference, check_garbage_at_masked_keys,
    check_row_under_huge_additive_bias, empty_some_rows, make_inputs,
)

L = 37  # odd: partial query and key tiles
# (name, batch, H, Lq, Lk, D, Dv, bias_shape, mask_shape, causal)
CASES = [
    ("pair_bias_over_rows", (2, 3), 2, L, L, 24, 24, (2, 1, 2, L, L), (2, 3, 1, 1, L), False),
    ("full_bias", (2,), 2, L, L, 16, 16, (2, 2, L, L), None, False),
    ("head_bias_over_batch", (2,), 2, L, L, 16, 16, (1, 2, L, L), (2, 1, L, L), False),
    ("key_bias_over_rows_and_q", (), 3, 20, L, 16, 24, (3, 1, L), (3, 20, L), False),
    ("query_bias_over_keys", (2,), 2, L, 20, 24, 16, (1, 1, L, 1), None, False),
    ("causal_lq_lt_lk", (2,), 2, 20, L, 16, 16, (2, 2, 20, L), (2, 1, 1, L), True),
    ("causal_square_full_bias_row_mask", (2,), 2, L, L, 16, 16, (2, 2, L, L), (2, 1, L, 1), True),
    ("causal_pair_bias_over_rows", (1, 3), 2, L, L, 16, 16, (1, 1, 2, L, L), (1, 3, 1, 1, L), True),
    ("causal_lq_gt_lk_empty_rows", (), 2, L, 20, 16, 16, (1, 20), None, True),
    ("three_lead_dims_loop", (2, 2, 3), 1, 17, 17, 16, 16, (2, 1, 3, 1, 17, 17), (1, 2, 1, 1, 1, 17), False),
    # few dBias tiles (L=20), 8 rows share them: the reduction splits over programs; causal with a row mask
    ("pair_bias_split_reduction", (1, 8), 2, 20, 20, 16, 16, (1, 1, 2, 20, 20), (1, 8, 1, 1, 20), False),
    ("causal_pair_bias_row_mask", (1, 4), 2, 20, L, 16, 24, (1, 1, 2, 20, L), (1, 4, 1, 20, L), True),
    # a key bias (broadcast over Lq) over few tiles, 8 rows share them: the reduction's LOOP_M path, split
    ("key_bias_split_reduction", (1, 8), 2, 20, 20, 16, 16, (1, 1, 2, 1, 20), (1, 8, 1, 1, 20), False),
    # a key mask without a bias: the mask alone is the logits' additive term
    ("key_mask_no_bias", (2, 3), 2, 20, L, 16, 16, None, (2, 3, 1, 1, L), False),
    # every tile in range and D = its block: the kernels' unmasked-load paths (the interpreter's tiles are 32 x 16)
    ("pair_bias_even_tiles", (1, 3), 2, 32, 32, 16, 16, (1, 1, 2, 32, 32), (1, 3, 1, 1, 32), False),
    ("causal_even_tiles", (2,), 2, 32, 64, 16, 16, (2, 2, 32, 64), (2, 1, 1, 64), True),
    ("causal_even_tiles_shared_bias", (2,), 2, 32, 64, 16, 16, (1, 2, 32, 64), (2, 1, 1, 64), True),
    ("pair_bias_over_batch_even_tiles", (2, 3), 2, 32, 32, 16, 16, (1, 1, 2, 32, 32), (2, 3, 1, 1, 32), False),
    # in-range tiles with D, Dv that do not fill their blocks: rows unmasked, columns masked
    ("even_tiles_d24", (1, 3), 2, 32, 32, 24, 24, (1, 1, 2, 32, 32), None, False),
    # a bias shared over heads only (full over batch, Lq, Lk): dBias sums the heads in the reduction's tile loop
    ("bias_shared_over_heads", (2,), 3, 20, L, 16, 16, (2, 1, 20, L), (2, 1, 1, L), False),
    # one query row (decoding) under a shared bias: the atomic accumulator's one row still has its padded pitch
    ("single_query_pair_bias", (2, 3), 2, 1, L, 16, 16, (1, 1, 2, 1, L), (2, 3, 1, 1, L), False),
]


# every case in fp32 and fp16 with the split backward; the fused backward on a few (the CPU budget)
FUSED = ("pair_bias_over_rows", "causal_lq_lt_lk", "query_bias_over_keys", "causal_pair_bias_over_rows",
         "key_mask_no_bias")
RUNS = [(c, dt, "split") for c in CASES for dt in (torch.float32, torch.float16)]
RUNS += [(c, torch.float32, "fused") for c in CASES if c[0] in FUSED]
RUNS += [(c, torch.float16, "fused") for c in CASES if c[0] in FUSED[:2]]
# split dq with the broadcast bias's gradient summed by atomics (deterministic=False: in the dQ kernel here)
ATOMIC = ("pair_bias_over_rows", "causal_pair_bias_over_rows", "pair_bias_even_tiles", "bias_shared_over_heads",
          "single_query_pair_bias")
RUNS += [(c, dt, "atomic") for c in CASES if c[0] in ATOMIC for dt in (torch.float32, torch.float16)]


@pytest.mark.parametrize("case,dtype,variant", RUNS, ids=[f"{c[0]}-{str(d)[6:]}-{v}" for c, d, v in RUNS])
def test_matches_reference(case, dtype, variant):
    _, batch, h, lq, lk, d, dv, bshape, mshape, causal = case
    q, k, v, bias, mask = make_inputs(batch, h, lq, lk, d, dv, dtype=dtype, bias_shape=bshape, mask_shape=mshape,
                                      seed=zlib.crc32(case[0].encode()) % 1000)
    opts = {"split": dict(bwd="split"), "fused": dict(bwd="fused", deterministic=False),
            "atomic": dict(bwd="split", deterministic=False)}[variant]
    check_against_reference("triton", q, k, v, bias, mask, causal=causal, **opts)


# Head widths below tl.dot's 16 and between powers of two, D != Dv, at lengths 1, 15, 17, 33, 129 (ragged against
# the interpreter's 32 x 16 tiles), each with a key mask whose first slice is fully masked (rows with no key).
# The kernels pad D, Dv to blocks of a power of two >= 16: every masked column load and store is on these paths.
# (name, batch, H, Lq, Lk, D, Dv, bias_shape, mask_shape, causal)
WIDTH_CASES = [
    ("d8_pair_bias_over_rows", (1, 3), 2, 17, 17, 8, 8, (1, 1, 2, 17, 17), (1, 3, 1, 1, 17), False),
    ("d12_dv8_full_bias", (2,), 2, 15, 33, 12, 8, (2, 2, 15, 33), (2, 1, 1, 33), False),
    ("d24_dv40_lq1_bias_over_batch", (2,), 2, 1, 33, 24, 40, (1, 2, 1, 33), (2, 1, 1, 33), False),
    ("d40_key_bias_over_rows", (), 3, 33, 15, 40, 40, (3, 1, 15), (3, 1, 15), False),
    ("d48_dv12_lq129_bias_over_heads", (), 2, 129, 17, 48, 12, (1, 129, 17), (2, 1, 17), False),
    ("d8_dv24_causal_lk129", (1, 2), 1, 33, 129, 8, 24, (1, 1, 1, 33, 129), (1, 2, 1, 1, 129), True),
    # every tile in range: rows load unmasked, the padded columns stay masked
    ("d8_even_tiles_shared_bias", (1, 2), 2, 32, 32, 8, 8, (1, 1, 2, 32, 32), (1, 2, 1, 1, 32), False),
]
WIDTH_RUNS = [(c, dt, "split") for c in WIDTH_CASES for dt in (torch.float32, torch.float16)]
WIDTH_RUNS += [(c, torch.float32, "fused") for c in WIDTH_CASES
               if c[0] in ("d8_pair_bias_over_rows", "d12_dv8_full_bias", "d8_dv24_causal_lk129")]
WIDTH_RUNS += [(c, torch.float16, "fused") for c in WIDTH_CASES if c[0] == "d48_dv12_lq129_bias_over_heads"]
WIDTH_RUNS += [(c, dt, "atomic") for c in WIDTH_CASES if c[0] == "d8_pair_bias_over_rows"
               for dt in (torch.float32, torch.float16)]


@pytest.mark.parametrize("case,dtype,variant", WIDTH_RUNS,
                         ids=[f"{c[0]}-{str(d)[6:]}-{v}" for c, d, v in WIDTH_RUNS])
def test_head_widths_match_reference(case, dtype, variant):
    _, batch, h, lq, lk, d, dv, bshape, mshape, causal = case
    q, k, v, bias, mask = make_inputs(batch, h, lq, lk, d, dv, dtype=dtype, bias_shape=bshape, mask_shape=mshape,
                                      seed=zlib.crc32(case[0].encode()) % 1000)
    empty_some_rows(mask)
    opts = {"split": dict(bwd="split"), "fused": dict(bwd="fused", deterministic=False),
            "atomic": dict(bwd="split", deterministic=False)}[variant]
    check_against_reference("triton", q, k, v, bias, mask, causal=causal, **opts)


def test_registry_takes_head_dims_8_to_256():
    """triton serves every head width in [8, 256] (tl.dot's 16 is padded inside the kernels) and names the rest."""
    from attn_ops import registry
    from attn_ops.inputs import describe

    def reasons(d, dv):
        q, k, v, _, _ = make_inputs((1,), 1, 2, 3, d, dv)
        return registry.not_supported_reasons("triton", describe(q, k, v, None, None, False, True, True))

    for d, dv in ((8, 8), (8, 256), (12, 24), (256, 8)):
        assert reasons(d, dv) == [], (d, dv)
    assert reasons(7, 8) == ["q/k head dim 7 outside [8, 256]"]
    assert reasons(8, 257) == ["v head dim 257 outside [8, 256]"]


def test_fully_masked_row_gives_zero_output_and_finite_zero_grads():
    q, k, v, bias, mask = make_inputs((2,), 2, 19, 23, 16, bias_shape=(1, 2, 19, 23), mask_shape=(2, 1, 19, 23))
    mask[1, 0, 5] = False  # batch 1, query row 5: no key, every head
    mask[:, 0, 18] = False  # row 18 empty in both batches: its shared bias row gets no gradient
    out, lse = attn_ops.attention(q, k, v, bias, mask, return_lse=True, backend="triton")
    assert torch.equal(out[1, :, 5], torch.zeros_like(out[1, :, 5]))
    assert torch.isinf(lse[1, :, 5]).all() and (lse[1, :, 5] < 0).all()
    assert torch.isfinite(lse[0, :, :18]).all() and torch.isinf(lse[:, :, 18]).all()
    (out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for t in (q, k, v, bias):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[1, :, 5], torch.zeros_like(q.grad[1, :, 5]))
    assert torch.equal(bias.grad[0, :, 18], torch.zeros_like(bias.grad[0, :, 18]))
    assert q.grad[0, :, 5].abs().sum() > 0  # the same row in the other batch is live


def test_loss_on_lse_only_reaches_q_k_bias():
    q, k, v, bias, mask = make_inputs((2,), 2, 21, 21, 16, bias_shape=(1, 2, 21, 21), mask_shape=(2, 1, 1, 21))
    _, lse = triton_attention(q, k, v, bias, mask, 0.25, False)
    gq, gk, gb = torch.autograd.grad(torch.where(torch.isfinite(lse), lse, 0.0).sum() * 0.5, (q, k, bias))
    q64, k64, b64 = (t.detach().double().requires_grad_() for t in (q, k, bias))
    _, rlse = attention_reference(q64, k64, v.detach().double(), b64, mask, 0.25, False)
    rq, rk, rb = torch.autograd.grad(torch.where(torch.isfinite(rlse), rlse, 0.0).sum() * 0.5, (q64, k64, b64))
    for got, ref in ((gq, rq), (gk, rk), (gb, rb)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


FP32_ATOMIC_DBIAS = (1, 2)  # the dK/dV kernel's ATOMIC_DBIAS values that add dS by fp32 atomics (element, TMA)


def _spy_backward_flags(monkeypatch):
    """(kernel name, constexpr flags) of every dK/dV and dQ kernel launch from here on (``_launch`` wrapped)."""
    from attn_ops.triton import launch
    from attn_ops.triton.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel

    seen = []
    real = launch.launch_kernel
    names = {attn_bwd_dkdv_kernel: "dkdv", attn_bwd_dq_kernel: "dq"}

    def spy(kernel, grid, args, num_warps, num_stages, **constexprs):
        if kernel in names:
            seen.append((names[kernel], constexprs))
        real(kernel, grid, args, num_warps, num_stages, **constexprs)

    monkeypatch.setattr(launch, "launch_kernel", spy)
    return seen


def _adds_by_atomics(name: str, flags: dict) -> bool:
    """Whether a dK/dV or dQ launch adds a bias gradient or dQ with fp32 atomics (not bit-repeatable on a GPU)."""
    if name == "dkdv":
        return bool(flags["FUSED_DQ"]) or flags["ATOMIC_DBIAS"] in FP32_ATOMIC_DBIAS
    return flags["DIRECT_DBIAS"] == 2


@pytest.mark.parametrize("bias_shape", [(2, 1, 2, 33, 33), (1, 1, 2, 33, 33), (2, 3, 2, 33, 33)],
                         ids=["over_rows", "over_batch_and_rows", "full"])
@pytest.mark.slow
def test_split_backward_is_bitwise_deterministic(bias_shape, monkeypatch):
    """Repeated calls give the same bits. The interpreter runs atomics in order, so that alone cannot fail on the
    CPU: the launches are also checked for the atomic variants (fused dQ, a broadcast bias's gradient by atomics in
    the dQ kernel, or in the dK/dV kernel by TMA reductions on a GPU), which deterministic=False takes for the
    broadcast biases."""
    q, k, v, bias, mask = make_inputs((2, 3), 2, 33, 33, 16, bias_shape=bias_shape, mask_shape=(2, 3, 1, 1, 33))
    g = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(3))
    seen = _spy_backward_flags(monkeypatch)

    def grads(deterministic=True):
        out, lse = triton_attention(q, k, v, bias, mask, 0.3, False, deterministic=deterministic)
        return torch.autograd.grad((out * g).sum() + lse[..., :4].sum(), (q, k, v, bias))

    first, second = grads(), grads()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert first[3].shape == bias.shape
    assert len(seen) == 4 and not any(_adds_by_atomics(*s) for s in seen), seen
    seen.clear()
    grads(deterministic=False)
    broadcast = tuple(bias.shape) != tuple(q.shape[:-1]) + (33,)
    assert [s[0] for s in seen] == ["dkdv", "dq"] and not seen[0][1]["FUSED_DQ"], seen
    assert any(_adds_by_atomics(*s) for s in seen) == broadcast, seen
    # per-element atomics run along the accumulator's rows in the dQ kernel (TMA reductions stay in dK/dV's)
    assert (seen[1][1]["DIRECT_DBIAS"] == 2) == broadcast and seen[0][1]["ATOMIC_DBIAS"] == 0, seen


def test_bias_gradient_keeps_bias_dtype():
    q, k, v, _, mask = make_inputs((2,), 2, 17, 17, 16, mask_shape=(2, 1, 1, 17))
    bias = torch.randn(1, 2, 17, 17, dtype=torch.float64, requires_grad=True)
    out = attn_ops.attention(q, k, v, bias, mask, backend="triton")
    out.sum().backward()
    assert bias.grad.dtype == torch.float64 and bias.grad.shape == bias.shape
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    b64 = bias.detach().clone().requires_grad_()
    ref, _ = attention_reference(q64, k64, v64, b64, mask, None, False)
    ref.sum().backward()
    torch.testing.assert_close(bias.grad, b64.grad, rtol=1e-4, atol=1e-5)


def test_bad_bwd_option_is_rejected():
    q, k, v, _, _ = make_inputs((), 1, 16, 16, 16)
    with pytest.raises(ValueError, match="bwd must be one of"):
        triton_attention(q, k, v, None, None, 0.25, False, bwd="both")
    with pytest.raises(ValueError, match="deterministic=False"):
        triton_attention(q, k, v, None, None, 0.25, False, deterministic=True, bwd="fused")


def test_custom_op_registration_opcheck():
    q, k, v, bias, mask = make_inputs((1, 2), 2, 17, 17, 16, bias_shape=(1, 1, 2, 17, 17),
                                      mask_shape=(1, 2, 1, 1, 17))
    torch.library.opcheck(torch.ops.attn_zoo.triton_attn_fwd.default, (q, k, v, bias, mask, 0.25, False, False, False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    # the backward op with the atomic bias gradient (deterministic=False), as autograd calls it
    out, lse = torch.ops.attn_zoo.triton_attn_fwd(q, k, v, bias, mask, 0.25, False, False, True)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.attn_zoo.triton_attn_bwd.default,
                          (dout, None, q, k, v, out, lse, bias, mask, 0.25, False, False, True, True),
                          test_utils=("test_schema", "test_faketensor"))
    # q in [B, L, H, C] memory order: the fake output must take the same dim order as the real one
    qv, kv, vv = (t.detach().clone() for t in _head_split_views(2, 17, 2, 16))
    torch.library.opcheck(torch.ops.attn_zoo.triton_attn_fwd.default,
                          (qv[:, None], kv[:, None], vv[:, None], None, None, 0.25, False, False, False),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("use_out", [True, False], ids=["out_and_lse", "lse_only"])
def test_eager_path_equals_the_custom_op(use_out):
    """Eager calls skip the custom op's dispatch (op.attend); both run the same launches: the same bits for out,
    lse and every gradient (through lse too), and an unused output sends no gradient work either way."""
    from attn_ops.triton import op

    q, k, v, bias, mask = make_inputs((1, 2), 2, 17, 17, 16, bias_shape=(1, 1, 2, 17, 17),
                                      mask_shape=(1, 2, 1, 1, 17))
    mask[..., 5] = False
    g = torch.Generator().manual_seed(3)
    w_out, w_lse = torch.randn(1, 2, 2, 17, 16, generator=g), torch.randn(1, 2, 2, 17, generator=g)
    results = []
    for call in (op.attend, torch.ops.attn_zoo.triton_attn_fwd):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        out, lse = call(*leaves, mask, 0.25, False, False, False)
        loss = (lse * w_lse).sum() + ((out.float() * w_out).sum() if use_out else 0)
        loss.backward()
        results.append([out, lse] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_fake_tensors_take_the_custom_op():
    """Tracing with fake tensors (torch.export, make_fx) must reach the custom op's fake impl, not the launchers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attn_ops.triton import op

    with FakeTensorMode():
        q, k, v = (torch.empty(1, 2, 2, 17, 16, requires_grad=True) for _ in range(3))
        bias = torch.empty(1, 1, 2, 17, 17, requires_grad=True)
        out, lse = op.attend(q, k, v, bias, None, 0.25, False, False, False)
        assert out.shape == (1, 2, 2, 17, 16) and lse.shape == (1, 2, 2, 17) and lse.dtype == torch.float32
        dq, dk, dv, db = op.backward(torch.empty_like(out), None, q, k, v, out, lse, bias, None, 0.25, False, False,
                                     True, False)
        assert dq.shape == q.shape and db.shape == bias.shape


def _head_split_views(B, L, H, C, seed=0):
    """q, k, v ``[B, H, L, C]`` as head-split views of one fused projection ``[B, L, 3*H*C + 5]`` (the blocks' way)."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(B, L, 3 * H * C + 5, generator=g, requires_grad=True)
    return [proj[..., i * H * C:(i + 1) * H * C].unflatten(-1, (H, C)).transpose(-2, -3) for i in range(3)]


def test_head_split_views_keep_their_dim_order():
    """Views of a fused projection: output and gradients in ``[B, L, H, C]`` order (merging heads is a view, the
    gradients flow into the projection without a transpose), all matching the reference."""
    B, H, L, C = 2, 2, 19, 16
    q, k, v = _head_split_views(B, L, H, C)
    _, _, _, bias, mask = make_inputs((B,), H, L, L, C, bias_shape=(B, H, L, L), mask_shape=(B, 1, 1, L), seed=3)
    assert not q.transpose(-2, -3).is_contiguous()  # a strided view, not dense
    out, lse, grads = check_against_reference("triton", q, k, v, bias, mask)
    assert out.transpose(-2, -3).is_contiguous(), f"out strides {out.stride()}: heads not mergeable as a view"
    for name, g in zip("qkv", grads[:3]):
        assert g.transpose(-2, -3).is_contiguous(), f"d{name} strides {g.stride()}"


def test_dense_layout_check_agrees_with_torch():
    """The op's check of "fills its memory exactly once, in some dim order" against torch's own, over permuted,
    sliced, expanded, size-1 and overlapping layouts."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as torch_check

    from attn_ops.triton.op import _non_overlapping_and_dense

    base = torch.randn(2, 3, 4, 5)
    cases = [base, base.permute(0, 2, 1, 3), base.transpose(1, 2), base[:, :2], base[..., ::2], base[:, :1],
             base[:1].expand(3, 3, 4, 5), torch.randn(1, 3, 1, 5).transpose(0, 2), torch.randn(6).unfold(0, 3, 1),
             torch.randn(4, 1, 5)[:, :, 1:], base.permute(3, 1, 0, 2)[:, :, :, 1:]]
    for t in cases:
        assert _non_overlapping_and_dense(t) == torch_check(t), (tuple(t.shape), t.stride())


def test_overlapping_windows_as_inputs():
    """q, k, v as overlapping sliding windows (``unfold``: the last dim and the length dim both have stride 1): the
    dense copy must still have a contiguous last dim."""
    g = torch.Generator().manual_seed(6)
    L, D = 5, 16
    q, k, v = (torch.randn(1, 2, L + D - 1, generator=g).unfold(-1, D, 1).requires_grad_() for _ in range(3))
    check_against_reference("triton", q, k, v, None, None)


def test_compiles_without_graph_breaks():
    q, k, v, bias, mask = make_inputs((1, 2), 2, 17, 17, 16, bias_shape=(1, 1, 2, 17, 17),
                                      mask_shape=(1, 2, 1, 1, 17))

    def f(q, k, v, bias):
        out, lse = triton_attention(q, k, v, bias, mask, 0.25, False)
        return out.float().sum() + lse.sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias))
    want = torch.autograd.grad(f(q, k, v, bias), (q, k, v, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_compiles_with_dynamic_shapes():
    """Variable sequence lengths (proteins of different sizes) under ``torch.compile(dynamic=True)``: the graphs
    traced on symbolic shapes and strides for contiguous inputs and head-split views are reused for a second length
    (no recompile) and match eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def f(q, k, v, bias, mask):
        out, lse = triton_attention(q, k, v, bias, mask, 0.25, False)
        return out.float().sum() + lse.sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    rows = 3  # the pair-bias layout [1, R, H, n, C] with few rows: the interpreter's time grows with the programs
    for n in (17, 21):
        _, _, _, bias, mask = make_inputs((1, rows), 2, n, n, 16, bias_shape=(1, 1, 2, n, n),
                                          mask_shape=(1, rows, 1, 1, n))
        views = [t[None] for t in _head_split_views(rows, n, 2, 16, seed=n)]  # [1, R, H, n, C] over [1, R, n, 3HC+5]
        for q, k, v in (make_inputs((1, rows), 2, n, n, 16, seed=n)[:3], views):
            leaves = (q, k, v, bias)
            got = torch.autograd.grad(compiled(q, k, v, bias, mask), leaves)
            want = torch.autograd.grad(f(q, k, v, bias, mask), leaves)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[1] == frames[0], f"recompiled for a new length: graphs after each {frames}"


@pytest.mark.parametrize("batch", [(2, 3), (2, 2, 3)], ids=["two_lead_dims", "three_lead_dims"])
def test_lse_backward_matches_autograd(batch):
    """The backward-from-(out, lse) entry (ring attention) equals autograd through the forward."""
    bshape = batch[:-1] + (1, 2, 19, 19)
    q, k, v, bias, mask = make_inputs(batch, 2, 19, 19, 16, bias_shape=bshape, mask_shape=batch + (1, 1, 19))
    out, lse = triton_attention(q, k, v, bias, mask, 0.3, True)
    g = torch.Generator().manual_seed(5)
    d_out, d_lse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    want = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v, bias))
    got = triton_lse_backward(q.detach(), k.detach(), v.detach(), bias.detach(), mask, 0.3, True, out.detach(),
                              lse.detach(), d_out, d_lse, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("deterministic", [True, False], ids=["reduction", "atomic"])
def test_bias_gradient_of_non_finite_input_is_nan(deterministic):
    """A NaN in v at an attended key reaches dS: the shared bias's gradient must show it, not hide it."""
    q, k, v, bias, _ = make_inputs((1, 3), 2, 17, 17, 16, bias_shape=(1, 1, 2, 17, 17), seed=10)
    with torch.no_grad():
        v[0, 1, 0, 3, 2] = float("nan")
    out, _ = triton_attention(q, k, v, bias, None, 0.25, False, deterministic=deterministic)
    (dbias,) = torch.autograd.grad(out.sum(), (bias,))
    assert torch.isnan(dbias).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_bias,opts", GARBAGE_RUNS, ids=GARBAGE_IDS)
def test_garbage_at_masked_keys_changes_nothing(with_bias, opts, dtype):
    """Padding garbage at masked keys (NaN / inf in the shared bias's padded columns, NaN in k's padded rows)
    gives exactly the bits of the same inputs with zeros there, as the reference's masked_fill would: output,
    lse and the gradients of q, k, v and bias. (A NaN in v at a masked key still propagates, as in PyTorch.)"""
    check_garbage_at_masked_keys(with_bias, opts, dtype=dtype, device="cpu")


@pytest.mark.parametrize("with_bias,opts", GARBAGE_RUNS, ids=GARBAGE_IDS)
def test_garbage_at_masked_keys_even_tiles(with_bias, opts):
    """As above with every tile in range (32 x 32: the kernels load K/V/bias tiles without range masks there, so
    only the key mask keeps the garbage out)."""
    check_garbage_at_masked_keys(with_bias, opts, dtype=torch.float32, device="cpu", lq=32, lk=32)


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e9], ids=["float32_min", "minus_1e9"])
def test_row_under_huge_additive_bias(fill):
    """A huge negative additive bias over a whole query row (the additive-mask convention; float32 min overflows in
    the kernels' log2 domain) leaves everything finite and every other row and gradient unchanged (helpers.py)."""
    check_row_under_huge_additive_bias(fill, torch.float32, "cpu")


@pytest.mark.parametrize("splits", [1, 4], ids=["one_program_per_tile", "two_splits"])
def test_dbias_split_counts_match_reference(splits, monkeypatch):
    """The dBias reduction with a split aim chosen by the tuner (``Cfg.splits``; the interpreter's config
    otherwise always takes the launcher's default): one program per tile writes the bias's dtype directly; 4 per
    (interpreter) SM gives 2 programs per tile here, adding fp32 partials in a fixed order; even tiles and a
    ragged shape."""
    from attn_ops.triton import passes, tuning

    monkeypatch.setattr(tuning, "_INTERPRETER", tuning._INTERPRETER._replace(splits=splits))
    counts = []
    real = passes._even_splits

    def even_splits(n_steps, want):
        per, n = real(n_steps, want)
        counts.append(n)
        return per, n

    monkeypatch.setattr(passes, "_even_splits", even_splits)
    for lq, seed in ((32, 1), (21, 2)):
        q, k, v, bias, mask = make_inputs((2, 3), 2, lq, lq, 16, bias_shape=(1, 1, 2, lq, lq),
                                          mask_shape=(2, 3, 1, 1, lq), seed=seed)
        check_against_reference("triton", q, k, v, bias, mask)
    assert counts and set(counts) == {1 if splits == 1 else 2}


def test_bias_tma_layout_rules(monkeypatch):
    """Which biases the kernels read through a tensor descriptor (slice stride, slices, batch strides in slices)
    and which keep pointer loads: a dim broadcast inside the tile, rows that are not 16-byte multiples, a
    misaligned base, batch strides that are not whole slices, fp64, and the settings' tma switch."""
    from attn_ops.triton.passes import bias_tma

    shared = torch.zeros(1, 1, 4, 40, 24)
    assert bias_tma(shared, 40, 24) == (960, 4, (0, 0, 1))
    assert bias_tma(shared.expand(2, 3, 4, 40, 24), 40, 24) == (960, 4, (0, 0, 1))
    assert bias_tma(torch.zeros(2, 3, 4, 40, 24), 40, 24) == (960, 24, (12, 4, 1))
    heads_inside = torch.zeros(1, 1, 40, 4, 24).permute(0, 1, 3, 2, 4)  # [.., L, H, L] memory: slices interleave
    assert bias_tma(heads_inside, 40, 24) == (24, 4, (0, 0, 1))
    assert bias_tma(torch.zeros(1, 1, 4, 1, 24), 40, 24) is None  # broadcast over Lq
    assert bias_tma(torch.zeros(1, 1, 4, 40, 1), 40, 24) is None  # broadcast over Lk
    assert bias_tma(torch.zeros(1, 1, 4, 40, 21), 40, 21) is None  # 84-byte rows
    assert bias_tma(torch.zeros(1, 1, 4, 1, 24).expand(1, 1, 4, 40, 24), 40, 24) is None  # one row repeated
    assert bias_tma(torch.zeros(1, 1, 40, 24, 4).permute(0, 1, 4, 2, 3), 40, 24) is None  # Lk not contiguous
    assert bias_tma(torch.zeros(1, 1, 4, 40, 24, dtype=torch.float64), 40, 24) is None
    assert bias_tma(torch.zeros(4 * 960 + 1)[1:].view(1, 1, 4, 40, 24), 40, 24) is None  # 4-byte offset base
    uneven = torch.zeros(4000).as_strided((2, 1, 2, 40, 24), (1928, 0, 960, 24, 1))
    assert bias_tma(uneven, 40, 24) is None
    with kernel_settings(tma=False):
        assert bias_tma(shared, 40, 24) is None
    assert bias_tma(shared, 40, 24) is not None  # restored after the block


# Biases whose tiles go through a tensor descriptor: 16-byte rows (Lk = 24 in fp32 and fp16), ragged tiles both ways
# against the interpreter's 32 x 16 tiles (Lq = 40, Lk = 24), a bias shared over rows, a full one (its gradient
# written directly) and one broadcast over the batch with a mask that varies over Lq.
TMA_CASES = {
    "shared_over_rows": ((1, 3), (1, 1, 2, 40, 24), (1, 3, 1, 1, 24)),
    "full": ((2, 2), (2, 2, 2, 40, 24), None),
    "over_batch_q_mask": ((2, 3), (1, 3, 2, 40, 24), (2, 3, 1, 40, 24)),
}
TMA_RUNS = [(n, dt, "split") for n in TMA_CASES for dt in (torch.float32, torch.float16)]
TMA_RUNS += [(n, torch.float32, v) for n in ("shared_over_rows", "full") for v in ("fused", "atomic")]


@pytest.mark.parametrize("name,dtype,variant", TMA_RUNS, ids=[f"{n}-{str(d)[6:]}-{v}" for n, d, v in TMA_RUNS])
def test_tma_bias_tiles_equal_pointer_loads(name, dtype, variant, monkeypatch):
    """The descriptor path gives the same bits as pointer loads (out, lse and every gradient), and each run took
    the path it was meant to; the pointer path itself is held to the reference by test_matches_reference, and
    one descriptor case is checked against the reference here too."""
    from attn_ops.triton import passes

    batch, bshape, mshape = TMA_CASES[name]
    q, k, v, bias, mask = make_inputs(batch, 2, 40, 24, 16, dtype=dtype, bias_shape=bshape, mask_shape=mshape,
                                      seed=zlib.crc32(name.encode()) % 1000)
    opts = {"split": dict(bwd="split"), "fused": dict(bwd="fused", deterministic=False),
            "atomic": dict(bwd="split", deterministic=False)}[variant]
    g = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(5)).to(dtype)
    seen = []
    real = passes.bias_tma
    monkeypatch.setattr(passes, "bias_tma", lambda *a: seen.append(real(*a)) or seen[-1])

    def run():
        seen.clear()
        out, lse = triton_attention(q, k, v, bias, mask, 0.3, False, **opts)
        grads = torch.autograd.grad((out * g).sum() + lse.masked_fill(lse.isinf(), 0).sum(), (q, k, v, bias))
        return (out, lse) + grads, list(seen)

    with_tma, paths = run()
    assert paths and all(p is not None for p in paths)
    with kernel_settings(tma=False):
        plain, paths = run()
    assert paths and all(p is None for p in paths)
    for a, b in zip(with_tma, plain):
        assert torch.equal(a, b)
    if name == "shared_over_rows" and variant == "split":
        check_against_reference("triton", q, k, v, bias, mask, **opts)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["heads_last", "odd_rows"])
def test_shared_bias_is_copied_into_tma_rows(layout, monkeypatch):
    """A pair bias shared over rows whose own layout TMA cannot read (heads-last memory, the blocks' projection
    layout; rows of 21 fp32 = 84 bytes) is copied into 16-byte rows for the kernels: same bits as the pointer path,
    the gradient in the bias's own shape, and the reference holds."""
    from attn_ops.triton import passes

    lk = 24 if layout == "heads_last" else 21
    q, k, v, _, mask = make_inputs((1, 3), 2, 40, lk, 16, mask_shape=(1, 3, 1, 1, lk), seed=11)
    base = torch.randn(1, 1, 40, lk, 2, generator=torch.Generator().manual_seed(12))
    bias = (base.permute(0, 1, 4, 2, 3) if layout == "heads_last" else base[..., 0].reshape(1, 1, 1, 40, lk)
            .expand(1, 1, 2, 40, lk).contiguous()).requires_grad_()
    assert passes.bias_tma(bias.detach(), 40, lk) is None
    seen = []
    real = passes.bias_for_tiles
    monkeypatch.setattr(passes, "bias_for_tiles", lambda *a: seen.append(real(*a)) or seen[-1])

    def run():
        seen.clear()
        out, lse = triton_attention(q, k, v, bias, mask, 0.3, False)
        grads = torch.autograd.grad(out.square().sum() + lse.masked_fill(lse.isinf(), 0).sum(), (q, k, v, bias))
        return (out, lse) + grads, [r[1] for r in seen]

    copied, paths = run()
    assert paths and all(t is not None for t in paths)
    assert copied[-1].shape == bias.shape
    with kernel_settings(tma=False):
        plain, paths = run()
    assert paths and all(t is None for t in paths)
    for a, b in zip(copied, plain):
        assert torch.equal(a, b)
    check_against_reference("triton", q, k, v, bias, mask)


def _nan_padded(t, dims, pad=8, fill=float("nan")):
    """``t`` as a view into a bigger buffer filled with ``fill`` past its end along ``dims`` (strides grow, the
    last dim stays contiguous): a kernel that reads past Lq, Lk or D meets the fill."""
    shape = list(t.shape)
    for d in dims:
        shape[d] += pad
    buf = torch.full(shape, fill, dtype=t.dtype)
    view = buf[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    return view


# B, R, H, Lq, Lk, D, Dv, bias shape, mask shape, causal
READS_IN_RANGE = {
    "even_tiles": (1, 3, 2, 32, 32, 16, 16, (1, 1, 2, 32, 32), (1, 3, 1, 1, 32), False),
    "even_tiles_bias_over_batch": (2, 3, 2, 32, 32, 16, 16, (1, 1, 2, 32, 32), (2, 3, 1, 1, 32), False),
    "even_tiles_d24": (1, 3, 2, 32, 32, 24, 16, (1, 1, 2, 32, 32), (1, 3, 1, 1, 32), False),
    "even_tiles_d8_dv12": (1, 3, 2, 32, 32, 8, 12, (1, 1, 2, 32, 32), (1, 3, 1, 1, 32), False),
    "even_tiles_dv24_causal": (1, 3, 2, 32, 32, 16, 24, (1, 1, 2, 32, 32), (1, 3, 1, 1, 32), True),
    "even_lq_odd_lk": (1, 3, 2, 32, 37, 16, 16, (1, 1, 2, 32, 37), (1, 3, 1, 1, 37), False),
    "odd_lq_even_lk_causal": (1, 3, 2, 37, 32, 16, 16, (1, 1, 2, 37, 32), None, True),
}


@pytest.mark.parametrize("variant", ["split", "atomic"])
@pytest.mark.parametrize("name", list(READS_IN_RANGE))
def test_kernels_read_only_inside_lq_lk_d(name, variant):
    """Launchers called on views whose buffers hold NaN past Lq, Lk and D (and True past a mask's end): every
    output must have the bits of the same call on dense copies, so no load outside [Lq, Lk, D] is used, with or
    without the unmasked in-range paths (the op itself would make such views dense first). Reads that only feed
    rows >= Lq, which are never stored, stay invisible here; the tile flags' docstrings carry that reasoning."""
    from attn_ops.triton.passes import attn_backward, attn_forward

    B, R, H, Lq, Lk, D, Dv, bshape, mshape, causal = READS_IN_RANGE[name]
    g = torch.Generator().manual_seed(5)
    q, do = torch.randn(B, R, H, Lq, D, generator=g), torch.randn(B, R, H, Lq, Dv, generator=g)
    k, v = torch.randn(B, R, H, Lk, D, generator=g), torch.randn(B, R, H, Lk, Dv, generator=g)
    bias = torch.randn(*bshape, generator=g)
    mask = None if mshape is None else torch.rand(*mshape, generator=g) > 0.3
    atomic = variant == "atomic"

    def run(q, k, v, do, bias, mask):
        out, lse = attn_forward(q, k, v, bias, mask, 0.3, causal)
        return (out, lse) + attn_backward(do, None, q, k, v, out.contiguous(), lse, bias, mask, 0.3, causal, False,
                                          True, atomic)

    want = run(q, k, v, do, bias, mask)
    padded_mask = None if mask is None else _nan_padded(mask, [d for d in (3, 4) if mask.shape[d] > 1], fill=True)
    got = run(*(_nan_padded(t, (3, 4)) for t in (q, k, v, do)),
              _nan_padded(bias, [d for d in (3, 4) if bias.shape[d] > 1]), padded_mask)
    for name_t, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), want, got):
        assert torch.isfinite(b).all() or name_t == "lse", name_t  # lse is -inf on a row with no key
        if atomic and name_t == "dbias":  # atomic sums: order may differ between the two calls
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(a, b), name_t


@pytest.mark.parametrize("layout", ["contiguous", "pitch_33", "offset_base", "heads_last", "contiguous_tma"])
@pytest.mark.parametrize("variant", ["split", "fused"])
def test_bias_alignment_of_pointer_loads(layout, variant, monkeypatch):
    """Bias tiles read by pointer loads at lengths that are multiples of the tiles: the launcher tells the kernels
    the bias strides' alignment (BIAS_ALIGN) only where base, batch strides and row stride have it, and the
    interpreter runs the kernels' ``(s // BIAS_ALIGN) * BIAS_ALIGN``, so a wrong claim would change the strides and
    the results. Rows of 33 elements, a base 4 bytes past an aligned one, heads-last memory: no claim; nor for
    tiles read through a tensor descriptor (TMA on), whose batch strides count slices. (The bias is full over the
    batch, so the kernels read it as it is: a shared one would be copied, test_padded_bias_copy_*.)"""
    from attn_ops.triton import passes

    n, h = 32, 2  # multiples of the interpreter's 32 x 16 tiles
    q, k, v, _, mask = make_inputs((1, 3), h, n, n, 16, mask_shape=(1, 3, 1, 1, n), seed=len(layout))
    g = torch.Generator().manual_seed(3)
    if layout.startswith("contiguous"):
        bias = torch.randn(1, 3, h, n, n, generator=g)
    elif layout == "pitch_33":
        bias = torch.randn(1, 3, h, n, n + 1, generator=g)[..., :n]
    elif layout == "offset_base":
        bias = torch.randn(1 + 3 * h * n * n, generator=g)[1:].view(1, 3, h, n, n)
    else:
        bias = torch.randn(1, 3, n, n, h, generator=g).movedim(-1, -3)
    bias.requires_grad_()
    claims = []
    real = passes._bias_align
    monkeypatch.setattr(passes, "_bias_align", lambda *a: claims.append(real(*a)) or claims[-1])
    opts = {"split": dict(bwd="split"), "fused": dict(bwd="fused", deterministic=False)}[variant]
    with kernel_settings(tma=layout == "contiguous_tma"):
        check_against_reference("triton", q, k, v, bias, mask, **opts)
    assert claims and set(claims) == ({4} if layout == "contiguous" else {1}), claims


PADDED_CASES = {  # batch, Lq, Lk, bias shape, mask shape, causal (against the interpreter's 32 x 16 tiles)
    "ragged_shared": ((1, 3), 40, 21, (1, 1, 2, 40, 21), (1, 3, 1, 1, 21), False),
    "heads_last_even": ((1, 3), 32, 32, "heads_last", (1, 3, 1, 1, 32), False),
    "over_batch_q_mask": ((2, 3), 37, 19, (1, 3, 2, 37, 19), (2, 3, 1, 37, 19), False),
    "causal_shared": ((1, 2), 33, 33, (1, 1, 2, 33, 33), None, True),
}
PADDED_RUNS = [("ragged_shared", torch.float32, "split"), ("ragged_shared", torch.float16, "split"),
               ("ragged_shared", torch.float32, "atomic"), ("heads_last_even", torch.float32, "split"),
               ("over_batch_q_mask", torch.float16, "split"), ("causal_shared", torch.float32, "fused")]


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,variant", PADDED_RUNS, ids=[f"{n}-{str(d)[6:]}-{v}" for n, d, v in PADDED_RUNS])
def test_padded_bias_copy_equals_plain_pointer_loads(name, dtype, variant, monkeypatch):
    """A bias shared over a batch dim, read by pointer loads (TMA off), is copied into rows padded to whole key
    tiles (HAS_BIAS 3: loads without column masks, BIAS_ALIGN at any length). With NaN in the padding the run
    gives the bits of the plain pointer path (HAS_BIAS 1, the bias as it is): the columns past Lk are read but
    never used. The reference holds too, and the gradient comes back in the bias's shape."""
    from attn_ops.triton import launch, passes

    batch, lq, lk, bshape, mshape, causal = PADDED_CASES[name]
    q, k, v, _, mask = make_inputs(batch, 2, lq, lk, 16, dtype=dtype, mask_shape=mshape, seed=len(name))
    g = torch.Generator().manual_seed(len(name))
    if bshape == "heads_last":
        bias = torch.randn(1, 1, lq, lk, 2, generator=g).to(dtype).movedim(-1, -3)
    else:
        bias = torch.randn(*bshape, generator=g).to(dtype)
    bias.requires_grad_()
    opts = {"split": dict(bwd="split"), "fused": dict(bwd="fused", deterministic=False),
            "atomic": dict(bwd="split", deterministic=False)}[variant]
    grad = torch.randn(q.shape[:-1] + v.shape[-1:], generator=g).to(dtype)
    has_bias = []
    real_launch = launch.launch_kernel

    def spy(kernel, grid, args, num_warps, num_stages, **constexprs):
        if "HAS_BIAS" in constexprs:
            has_bias.append(constexprs["HAS_BIAS"])
        return real_launch(kernel, grid, args, num_warps, num_stages, **constexprs)

    def nan_rows(bias, shape, pitch):
        rows = torch.full(shape[:4] + (pitch,), float("nan"), dtype=bias.dtype, device=bias.device)
        return rows[..., :shape[4]].copy_(bias)

    monkeypatch.setattr(launch, "launch_kernel", spy)
    monkeypatch.setattr(passes, "_rows_copy", nan_rows)
    monkeypatch.setattr(launch.STATE, "plans", {})

    def run():
        del has_bias[:]
        launch.clear_plans()  # each run records its own launches
        out, lse = triton_attention(q, k, v, bias, mask, 0.3, causal, **opts)
        grads = torch.autograd.grad((out * grad).sum() + lse.masked_fill(lse.isinf(), 0).sum(), (q, k, v, bias))
        return (out, lse) + grads

    with kernel_settings(tma=False):
        padded = run()
        assert has_bias and set(has_bias) == {3}, has_bias
        real_tiles = passes.bias_for_tiles
        monkeypatch.setattr(passes, "bias_for_tiles", lambda bias, *a: (bias, None, False))
        plain = run()
        assert set(has_bias) == {1}
        monkeypatch.setattr(passes, "bias_for_tiles", real_tiles)
        assert padded[-1].shape == bias.shape
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), padded, plain):
            if variant == "atomic" and what == "dbias":
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(a, b), what
        if name == "ragged_shared" and dtype == torch.float32 and variant == "split":
            check_against_reference("triton", q, k, v, bias, mask, causal=causal, **opts)


def test_which_shared_biases_are_copied_for_pointer_loads():
    """Pointer loads (TMA off): a bias shared over a batch dim is copied into rows padded to whole 128-column
    tiles unless its rows already fill them (then HAS_BIAS 3 as it is, the variant every length of a bucket
    uses); a bias full over the batch is read as it is (HAS_BIAS 1)."""
    from attn_ops.triton import passes

    q = torch.zeros(1, 3, 2, 40, 16)
    with kernel_settings(tma=False):
        whole = torch.zeros(1, 1, 2, 40, 128)
        assert passes.bias_for_tiles(whole, q, 40, 128) == (whole, None, True)
        read, tma, padded = passes.bias_for_tiles(torch.ones(1, 1, 2, 40, 130), q, 40, 130)
        assert padded and tma is None and read.shape == (1, 1, 2, 40, 130) and read.stride(3) == 256
        assert torch.equal(read, torch.ones(1, 1, 2, 40, 130))
        heads_last = torch.zeros(1, 1, 40, 128, 2).movedim(-1, -3)
        read, _, padded = passes.bias_for_tiles(heads_last, q, 40, 128)
        assert padded and read is not heads_last and read.stride(4) == 1
        full = torch.zeros(1, 3, 2, 40, 130)
        assert passes.bias_for_tiles(full, q, 40, 130) == (full, None, False)
        key_bias = torch.zeros(1, 1, 2, 1, 130)  # broadcast over Lq: read as it is
        assert passes.bias_for_tiles(key_bias, q, 40, 130) == (key_bias, None, False)


def test_tile_variants_off_runs_the_general_variant_with_the_same_results(monkeypatch):
    """``tile_variants=False``: at a length that is a multiple of every tile (32 here) no launch asks for an EVEN_M /
    EVEN_N variant, and outputs and every gradient are the tile variants' bits."""
    from attn_ops.triton import launch

    q, k, v, bias, mask = make_inputs((1, 3), 2, 32, 32, 16, bias_shape=(1, 1, 2, 32, 32), mask_shape=(1, 3, 1, 1, 32))
    g = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(5))
    real, flags = launch.launch_kernel, []

    def spy(kernel, grid, args, num_warps, num_stages, **constexprs):
        flags.append((constexprs.get("EVEN_M"), constexprs.get("EVEN_N")))
        real(kernel, grid, args, num_warps, num_stages, **constexprs)

    monkeypatch.setattr(launch, "launch_kernel", spy)
    results = {}
    for on in (True, False):
        flags.clear()
        with kernel_settings(tile_variants=on):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
            out, lse = triton_attention(*leaves[:3], leaves[3], mask, 0.3, False)
            torch.autograd.backward((out, lse), (g, torch.ones_like(lse)))
        results[on] = [out, lse] + [t.grad for t in leaves]
        evens = {f for f in flags if f != (None, None)}
        assert (True, True) in evens if on else evens == {(False, False)}, (on, evens)
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


def test_compile_ahead_times_and_keeps_nothing(monkeypatch):
    """Under ``compile_ahead`` (here its state set by hand: on the interpreter the block itself does nothing) a tuning
    miss launches every candidate once (their compiles), times none and caches nothing, and no launch plan is kept;
    on the interpreter the block is a no-op (calls inside compute as outside)."""
    from attn_ops.triton import launch, tuning

    q, k, v, bias, mask = make_inputs((2,), 2, 20, 20, 16, bias_shape=(2, 2, 20, 20), mask_shape=None)
    with attn_ops.compile_ahead():
        inside = triton_attention(q, k, v, bias, mask, 0.3, False)[0]
    torch.testing.assert_close(inside, triton_attention(q, k, v, bias, mask, 0.3, False)[0], rtol=0, atol=0)

    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning.TUNER, "picks", {})
    monkeypatch.setattr(tuning, "measure", lambda *a, **kw: pytest.fail("timed under compile_ahead"))
    monkeypatch.setattr(tuning.TUNER, "ahead", (None, {}, 0))
    launched = []
    with kernel_settings(cache_dir=None, shipped_configs=False):
        cfg = tuning.pick("fwd", ("k",), 64, 256, 256, launched.append)
    cands = tuning.candidates("fwd", 64, 256, 256)
    assert len(cands) > 1 and launched == cands and cfg == cands[0] and tuning.TUNER.picks == {}
    launched.clear()  # a shipped config: only it compiles, and it is not cached unchecked either
    monkeypatch.setattr(tuning, "shipped", lambda device: {tuning.DiskCache._name(("fwd", False, "k")): cands[1]})
    with kernel_settings(cache_dir=None):
        assert tuning.pick("fwd", ("k",), 64, 256, 256, launched.append) == cands[1]
    assert launched == [cands[1]] and tuning.TUNER.picks == {}
    with kernel_settings(cache_dir=None, tune=False):  # untuned: the first candidate
        assert tuning.pick("fwd", ("k",), 64, 256, 256, launched.append) == cands[0]
    assert launched == [cands[1], cands[0]] and tuning.TUNER.picks == {}
    plans = dict(launch.STATE.plans)
    launch._keep(("a key",), launch.Recorder([]), (0,))
    assert launch.STATE.plans == plans
    monkeypatch.setattr(launch, "interpreting", lambda: False)  # (the interpreter alone makes bound() None)
    assert launch.bound(None, (1,), (), 4, 1, 0) is None
    assert attn_ops.compiling_ahead()


def test_compile_ahead_warns_of_compiles_that_failed(monkeypatch):
    """A compile that fails inside ``compile_ahead`` is reported once at the block's end (count and first error);
    the block itself completes (the kernel compiles again at its first real launch)."""
    from attn_ops.triton import launch, tuning

    monkeypatch.setattr(tuning, "background_compiles", lambda: True)  # (the interpreter turns the block off)
    monkeypatch.setattr(launch, "_device", lambda: -1)

    class Broken:
        params = ()

        def warmup(self, *args, **kwargs):
            raise RuntimeError("no such kernel")

    with pytest.warns(RuntimeWarning, match=r"compile_ahead: 1 of 1 compiles failed .*no such kernel"):
        with tuning.compile_ahead(threads=1):
            launch.launch_kernel(Broken(), (1,), [], 4, 3)
    assert not tuning.compiling_ahead()


def test_compile_ahead_keeps_no_segment_tables_and_no_graph_capture(monkeypatch):
    """Under compile_ahead the segment tables (built by a kernel that then runs nothing) are not cached for the ids,
    and a CUDAGraphs-wrapped module runs its module instead of capturing (a capture would hold no kernel)."""
    from attn_ops.triton import op, tuning
    from attn_zoo.models import graphs
    from attn_zoo.models.graphs import CUDAGraphs

    ids = torch.tensor([[[0, 0, 1, 1, 1]]])
    op.clear_segment_tables()
    monkeypatch.setattr(tuning.TUNER, "ahead", (None, {}, 0))
    op.segment_tables(ids, ids)
    assert op.STATE.tables == []
    monkeypatch.setattr(graphs, "CAPTURE_DEVICES", ("cuda", "cpu"))  # (otherwise no CPU call is ever captured)
    wrapped, x = CUDAGraphs(torch.nn.Linear(3, 3)), torch.zeros(2, 3, requires_grad=True)
    assert not wrapped._can_capture((x,), {})
    monkeypatch.setattr(tuning.TUNER, "ahead", None)
    assert wrapped._can_capture((x,), {})
    op.segment_tables(ids, ids)
    assert len(op.STATE.tables) == 1
    op.clear_segment_tables()
