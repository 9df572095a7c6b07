"""Memory-bounded inference (attn_zoo.models.inference): the in-place chunked path equals the plain path (float64
at small N with chunk sizes 1, sizes that do not divide N and N; masks with holes and fully masked residues;
triton under the interpreter in fp32 / fp16), really chunks, leaves its inputs alone unless asked, takes over only
without grad in eval mode; offload; errors; the planning arithmetic. On a GPU: N=1024 blocks against the plain
path and the chunk-size choice against a budget, measured with the CUDA allocator's peak."""
import os

import pytest
import torch

import attn_zoo.models.inference as inference
from attn_zoo.models.evoformer import EvoformerBlock, EvoformerStack, ExtraMSAStack
from attn_zoo.models.inference import Dims, InferenceSettings, estimate_inference_memory, plan_inference
from attn_zoo.models.pairformer import PairformerBlock, PairformerStack
from test_primitives import randomize_, rel_err, skip_unless_backend

PW = dict(c_s=32, c_z=8, num_heads_single=2, num_heads_pair=2, c_hidden_pair=16, c_hidden_mul=8, transition_n=2)
EW = dict(c_m=16, c_z=8, num_heads_msa=2, c_hidden_msa=16, num_heads_pair=2, c_hidden_pair=16, c_hidden_opm=4,
          c_hidden_mul=8, transition_n=2)
GIB = 2 ** 30


def _masks(B, N, g, S=None):
    """Residue mask with a hole and a fully masked residue, pair mask with extra holes, MSA mask with holes."""
    res = torch.rand(B, N, generator=g) > 0.25
    res[:, :2] = True
    res[:, -2] = False  # a fully masked row / column of the pair tensor
    pair = res[:, :, None] & res[:, None, :] & (torch.rand(B, N, N, generator=g) > 0.15)
    assert not pair.all() and pair.any()
    msa = None if S is None else torch.rand(B, S, N, generator=g) > 0.2
    return res, pair, msa


def _pair_inputs(B=2, N=7, seed=0, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, N, PW["c_s"], generator=g, dtype=dtype)
    z = torch.randn(B, N, N, PW["c_z"], generator=g, dtype=dtype)
    res, pair, _ = _masks(B, N, g)
    return [t.to(device) for t in (s, z, res, pair)]


def _msa_inputs(B=2, S=5, N=7, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(B, S, N, EW["c_m"], generator=g, dtype=dtype)
    z = torch.randn(B, N, N, EW["c_z"], generator=g, dtype=dtype)
    _, pair, msa = _masks(B, N, g, S)
    return m, z, msa, pair


def _spy_spans(monkeypatch):
    """Record the (length, chunk) of every chunk loop of the in-place path."""
    calls, real = [], inference._spans

    def spans(n, chunk):
        calls.append((n, chunk))
        return real(n, chunk)

    monkeypatch.setattr(inference, "_spans", spans)
    return calls


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 64])
def test_pairformer_stack_inplace_equals_plain(chunk, monkeypatch):
    s, z, res, pair = _pair_inputs(N=7, seed=1)
    stack = randomize_(PairformerStack(**PW, num_blocks=2, attention="torch"), seed=2).double().eval()
    s0, z0 = s.clone(), z.clone()
    with torch.no_grad():
        want = stack.configure_inference(mode="plain")(s, z, res, pair)
        calls = _spy_spans(monkeypatch)
        got = stack.configure_inference(mode="bounded", chunk_size=chunk)(s, z, res, pair)
    assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12
    assert torch.equal(s, s0) and torch.equal(z, z0)  # the inputs are untouched
    # every pair loop ran over the 7 rows in chunks of `chunk`: 2 blocks x (2 x 2 triangle multiplication loops
    # per batch entry (B=2), 2 x 2 triangle attention loops (bias, rows), transition, attention-pair-bias bias);
    # a chunk covering all 7 rows runs the triangle modules whole (no loop), the transition and bias still by rows
    assert calls and all(c == (7, chunk) for c in calls), calls
    assert len(calls) == 2 * (2 * 4 + 6 if chunk < 7 else 2), len(calls)


def test_boltz2_variant_inplace_equals_plain():
    """Boltz-2's variant (no biases in triangle multiplication / gates, post-norm of s) through the bounded path."""
    s, z, res, pair = _pair_inputs(N=7, seed=3)
    stack = PairformerStack(**PW, num_blocks=2, attention="torch", variant="boltz2", post_norm_s=True)
    stack = randomize_(stack, seed=4).double().eval()
    with torch.no_grad():
        want = stack.configure_inference(mode="plain")(s, z, res, pair)
        got = stack.configure_inference(mode="bounded", chunk_size=3)(s, z, res, pair)
    assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12


@pytest.mark.parametrize("stack_cls", [EvoformerStack, ExtraMSAStack])
@pytest.mark.parametrize("chunk,msa_chunk", [(1, 1), pytest.param(3, 2, marks=pytest.mark.slow),
                                             pytest.param(4, 5, marks=pytest.mark.slow), (7, 7), (2, 64)])
def test_msa_stacks_inplace_equal_plain(stack_cls, chunk, msa_chunk):
    m, z, msa, pair = _msa_inputs(S=5, N=7, seed=3)
    stack = randomize_(stack_cls(**EW, num_blocks=2, attention="torch"), seed=4).double().eval()
    m0, z0 = m.clone(), z.clone()
    with torch.no_grad():
        want = stack.configure_inference(mode="plain")(m, z, msa, pair)
        got = stack.configure_inference(mode="bounded", chunk_size=chunk, msa_chunk_size=msa_chunk)(m, z, msa, pair)
    assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12
    assert torch.equal(m, m0) and torch.equal(z, z0)


@pytest.mark.parametrize("inplace", [False, True])
def test_blocks_forward_inference(inplace):
    """Block-level path: equal to forward in eval mode; ``inplace`` overwrites z (and m) with the result."""
    s, z, res, pair = _pair_inputs(N=6, seed=5)
    blk = randomize_(PairformerBlock(**PW, attention="torch"), seed=6).double().eval()
    with torch.no_grad():
        want = blk(s, z, res, pair)
    z_in = z.clone()
    got = blk.forward_inference(s, z_in, res, pair, chunk_size=4, inplace=inplace, mode="bounded")
    assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12
    assert (got[1].data_ptr() == z_in.data_ptr()) == inplace
    assert torch.equal(z_in, got[1] if inplace else z)

    m, z, msa, pair = _msa_inputs(S=4, N=6, seed=7)
    blk = randomize_(EvoformerBlock(**EW, attention="torch"), seed=8).double().eval()
    with torch.no_grad():
        want = blk(m, z, msa, pair)
    m_in, z_in = m.clone(), z.clone()
    got = blk.forward_inference(m_in, z_in, msa, pair, chunk_size=5, inplace=inplace, mode="bounded")
    assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12
    assert torch.equal(m_in, got[0] if inplace else m) and torch.equal(z_in, got[1] if inplace else z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_block_inplace_within_dtype_rounding(dtype):
    """Triton under the interpreter: the in-place path's error against the float64 result is at most twice the
    plain path's in the same dtype."""
    skip_unless_backend("triton")
    s, z, res, pair = _pair_inputs(B=1, N=6, seed=9)
    ref = randomize_(PairformerBlock(**PW, attention="torch"), seed=10).double().eval()
    blk = randomize_(PairformerBlock(**PW, attention="triton"), seed=10).to(dtype).eval()
    with torch.no_grad():
        exact = ref(s, z, res, pair)
        plain = blk(s.to(dtype), z.to(dtype), res, pair)
        got = blk.forward_inference(s.to(dtype), z.to(dtype), res, pair, chunk_size=4, mode="bounded")
    eps = torch.finfo(dtype).eps
    for g, p, e in zip(got, plain, exact):
        assert rel_err(g, e) <= 2 * rel_err(p, e) + 4 * eps, (rel_err(g, e), rel_err(p, e))


def test_autocast_bf16_within_dtype_rounding():
    """fp32 parameters and inputs under bf16 autocast (the stored projection is bf16): error against float64 at
    most twice the plain path's."""
    s, z, res, pair = _pair_inputs(B=1, N=9, seed=17)
    ref = randomize_(PairformerStack(**PW, num_blocks=2, attention="torch"), seed=18).double().eval()
    stack = randomize_(PairformerStack(**PW, num_blocks=2, attention="torch"), seed=18).eval()
    with torch.no_grad():
        exact = ref(s, z, res, pair)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = stack.configure_inference(mode="plain")(s.float(), z.float(), res, pair)
            got = stack.configure_inference(mode="bounded", chunk_size=4)(s.float(), z.float(), res, pair)
    for g, p, e in zip(got, plain, exact):
        assert g.dtype == p.dtype
        assert rel_err(g, e) <= 2 * rel_err(p, e) + 1e-3, (rel_err(g, e), rel_err(p, e))


def test_stack_takes_the_bounded_path_only_without_grad_in_eval(monkeypatch):
    s, z, res, pair = _pair_inputs(N=5, seed=11)
    stack = randomize_(PairformerStack(**PW, num_blocks=2, attention="torch"), seed=12).double()
    runs = []
    real = inference.pairformer_block_
    monkeypatch.setattr(inference, "pairformer_block_", lambda *a: runs.append(1) or real(*a))
    stack.eval()
    with torch.no_grad():
        stack(s, z, res, pair)  # auto: the plain path fits
        assert not runs and stack.last_inference.path == "plain"
        scores = inference.score_bytes_of(stack.blocks[0], z.device, z.dtype)
        budget = estimate_inference_memory(stack.inference_dims(), 5, 1, batch=2, dtype=z.dtype, scores=scores).extra
        stack.configure_inference(memory_budget=budget)  # the bounded path's chunks of one row: plain does not fit
        stack(s, z, res, pair)
        assert stack.last_inference.path == "bounded"
    stack.configure_inference(memory_budget=None)
    assert len(runs) == 2
    stack(s, z, res, pair)  # grad enabled: today's path
    stack.train()
    with torch.no_grad():
        stack(s, z, res, pair)  # train mode: today's path (dropout)
    assert len(runs) == 2
    zi = z.clone().requires_grad_()
    stack(s, zi, res, pair)[1].sum().backward()  # training still differentiates
    assert zi.grad is not None and zi.grad.abs().sum() > 0
    stack.configure_inference(mode="bounded")
    with pytest.raises(ValueError, match="eval"):
        stack(s, z, res, pair)
    stack.eval()
    out = stack(s, z, res, pair)  # explicit flag: bounded even with grad enabled (no graph)
    assert len(runs) == 4 and not out[1].requires_grad


@pytest.mark.parametrize("kind", ["pairformer", "evoformer"])
def test_auto_runs_plain_when_it_fits_and_bounded_when_not(kind, monkeypatch):
    """auto: the plain path when its estimate fits the budget (on the CPU by default half the available host
    memory), the bounded path when the budget is small; both give the plain result (float64); the choice is
    reported before (inference_choice) and after (last_inference) the run."""
    if kind == "pairformer":
        x, z, m1, m2 = _pair_inputs(N=9, seed=21)
        stack = randomize_(PairformerStack(**PW, num_blocks=2, attention="torch"), seed=22).double().eval()
        n_seq = 0
    else:
        x, z, m1, m2 = _msa_inputs(S=5, N=9, seed=21)
        stack = randomize_(EvoformerStack(**EW, num_blocks=2, attention="torch"), seed=22).double().eval()
        n_seq = 5
    monkeypatch.setattr(inference, "available_host_memory", lambda: 8 * GIB)
    with torch.no_grad():
        want = stack.configure_inference(mode="plain")(x, z, m1, m2)
        stack.configure_inference(mode="auto")
        ahead = stack.inference_choice(9, batch=2, dtype=z.dtype, n_seq=n_seq)
        got = stack(x, z, m1, m2)
        assert ahead.path == stack.last_inference.path == "plain", stack.last_inference
        assert stack.last_inference.budget == int(0.5 * 8 * GIB)  # half the available host memory
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        plain = stack.last_inference.plain
        assert plain.extra <= stack.last_inference.budget and plain.n == 9
        # a budget below the plain estimate but above the bounded path's: bounded, same result
        bounded_need = stack.plan_inference(9, None, batch=2, dtype=z.dtype, n_seq=n_seq, chunk_size=1,
                                            msa_chunk_size=1 if n_seq else None).estimate.extra
        assert bounded_need < plain.extra
        stack.configure_inference(memory_budget=bounded_need)
        assert stack.inference_choice(9, batch=2, dtype=z.dtype, n_seq=n_seq).path == "bounded"
        got = stack(x, z, m1, m2)
        choice = stack.last_inference
        assert choice.path == "bounded" and choice.budget == bounded_need and choice.plan.chunk_size == 1
        assert "does not fit" in choice.reason
        assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12
        # forward_inference: the plain path with inplace writes the result into the caller's z (and m)
        stack.configure_inference(memory_budget=None)
        x_in, z_in = x.clone(), z.clone()
        got = stack.forward_inference(x_in, z_in, m1, m2, inplace=True)
        assert stack.last_inference.path == "plain" and got[1] is z_in and torch.equal(z_in, want[1])
        assert (got[0] is x_in) == (kind == "evoformer") and torch.equal(got[0], want[0])
        got = stack.forward_inference(x, z, m1, m2, mode="bounded")
        assert stack.last_inference.path == "bounded" and stack.last_inference.reason == "mode='bounded'"
        assert rel_err(got[1], want[1]) < 1e-12


def test_block_forward_inference_auto_and_modes():
    """The block's forward_inference: auto runs forward itself when it fits, the in-place chunks when given a
    small budget; the same result either way."""
    s, z, res, pair = _pair_inputs(N=8, seed=23)
    blk = randomize_(PairformerBlock(**PW, attention="chunked"), seed=24).double().eval()
    with torch.no_grad():
        want = blk(s, z, res, pair)
    got = blk.forward_inference(s, z, res, pair)
    assert blk.last_inference.path == "plain" and torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    scores = inference.score_bytes_of(blk, z.device, z.dtype)
    small = estimate_inference_memory(Dims.of(blk), 8, 2, batch=2, dtype=z.dtype, scores=scores).extra
    got = blk.forward_inference(s, z, res, pair, memory_budget=small)
    assert blk.last_inference.path == "bounded" and blk.last_inference.plan.chunk_size == 2
    assert rel_err(got[1], want[1]) < 1e-12 and rel_err(got[0], want[0]) < 1e-12
    blk.forward_inference(s, z, res, pair, mode="plain", memory_budget=small)
    assert blk.last_inference.path == "plain"
    with pytest.raises(ValueError, match="mode must be one of"):
        blk.forward_inference(s, z, res, pair, mode="fast")


def test_plain_estimate_arithmetic():
    """AF3 widths, bf16: the plain path's estimate grows with N^2 for a fused backend, shrinks with a row chunk,
    exceeds the bounded path's, and counts a materialising backend's scores (which grow with N^3)."""
    d, n = Dims(c_s=384), 1024
    whole = inference.estimate_plain_memory(d, n)
    chunked = inference.estimate_plain_memory(d, n, 128)
    z = whole.z_bytes
    assert z == n * n * 128 * 2 and whole.working == z and whole.inputs >= z
    assert chunked.extra < whole.extra and chunked.chunk_size == 128 and whole.chunk_size == n
    assert chunked.extra > plan_inference(d, n, None).estimate.extra
    # the row-chunked plain block measured 10x z beyond its inputs at N=1024 (docs/bench/memory_h100.md)
    assert 10 * z <= chunked.extra <= 12 * z
    twice = inference.estimate_plain_memory(d, 2 * n)
    assert 3.5 * whole.extra < twice.extra < 4.5 * whole.extra

    def torch_scores(problems, lq, lk):
        return 3 * 4 * problems * lq * lk

    full = inference.estimate_plain_memory(d, n, scores=torch_scores)
    # the triangle attention's scores: 4 heads x N rows x N x N logits, 3 float32 buffers
    assert full.extra - whole.extra >= 3 * 4 * 4 * n ** 3 - whole.extra
    boltz = inference.estimate_plain_memory(d, n, single_fp32=True)
    assert dict(boltz.modules)["attention_pair_bias"] - dict(whole.modules)["attention_pair_bias"] >= 2 * z
    ev = inference.estimate_plain_memory(Dims(c_m=256), 512, n_seq=128)
    assert dict(ev.modules)["outer_product_mean"] > 0 and ev.working == ev.z_bytes + 128 * 512 * 256 * 2
    with pytest.raises(ValueError, match="n_seq"):
        inference.estimate_plain_memory(Dims(c_m=256), 512)


def test_registry_scratch_bytes_per_backend():
    """The score tiles the planners count: full [Lq, Lk] buffers for torch, key chunks for chunked (its option),
    none for the fused kernels; auto as resolved for the device."""
    from attn_ops import registry

    kw = dict(device="cpu", dtype=torch.float32, head_dim=32, batch=8, lq=100, lk=1000)
    assert registry.forward_scratch_bytes("torch", **kw) == 3 * 4 * 8 * 100 * 1000
    assert registry.forward_scratch_bytes("chunked", **kw) == 4 * 4 * 8 * 100 * 256
    assert registry.forward_scratch_bytes("chunked", options={"chunk_size": 64}, **kw) == 4 * 4 * 8 * 100 * 64
    assert registry.forward_scratch_bytes("auto", **kw) == registry.forward_scratch_bytes("chunked", **kw)
    assert registry.forward_scratch_bytes("flex", **kw) == 0
    assert registry.forward_scratch_bytes("triton", **dict(kw, device="cuda")) == 0


def test_large_budget_plans_fewer_chunks():
    """With room in the budget the bounded path takes larger chunks (half of what the budget leaves beyond
    chunks of one row), never more than the budget."""
    d, n = Dims(c_s=384), 1024
    small = plan_inference(d, n, None)
    big = plan_inference(d, n, 100 * GIB)
    assert small.chunk_size == 64 and big.chunk_size == n and big.estimate.extra <= 100 * GIB
    mid = plan_inference(d, 4096, 40 * GIB)
    base = estimate_inference_memory(d, 4096, 1)
    assert mid.estimate.transient - base.transient <= 0.5 * (40 * GIB - base.extra)
    assert mid.chunk_size > plan_inference(d, 4096, None).chunk_size


@pytest.mark.slow
def test_offload_equals_device_path():
    """offload keeps z on the host between blocks; on a CPU-only machine the data path is the same copy."""
    s, z, res, pair = _pair_inputs(N=7, seed=13)
    stack = randomize_(PairformerStack(**PW, num_blocks=3, attention="torch"), seed=14).double().eval()
    z0 = z.clone()
    with torch.no_grad():
        want = stack.configure_inference(mode="plain")(s, z, res, pair)
        got = stack.configure_inference(mode="auto", chunk_size=3, offload=True)(s, z, res, pair)
    assert rel_err(got[1], want[1]) < 1e-12 and rel_err(got[0], want[0]) < 1e-12
    assert torch.equal(z, z0) and got[1].device == z.device


def test_offload_inplace_and_host_memory_check(monkeypatch):
    """offload with inplace writes the result into the caller's host z (no other host copy, so no host memory is
    needed); without inplace the one host copy must fit the available host memory, else a clear ValueError."""
    s, z, res, pair = _pair_inputs(N=7, seed=13)
    stack = randomize_(PairformerStack(**PW, num_blocks=2, attention="torch"), seed=14).double().eval()
    seen, real = [], inference.plan_inference
    monkeypatch.setattr(inference, "plan_inference", lambda *a, **k: seen.append(k) or real(*a, **k))
    z_bytes = z.numel() * z.element_size()
    monkeypatch.setattr(inference, "available_host_memory", lambda: z_bytes)  # 95% of it: less than one copy
    with torch.no_grad():
        want = stack.configure_inference(mode="plain")(s, z, res, pair)
        stack.configure_inference(mode="auto", chunk_size=3, offload=True)
        with pytest.raises(ValueError, match=r"N=7 does not fit in host memory: offload keeps one copy of z on the "
                                             r"host, 0\.00 GiB.*host_budget=0\.00 GiB"):
            stack(s, z, res, pair)
        assert seen[-1]["host_budget"] == int(0.95 * z_bytes) and seen[-1]["z_on_host"] and not seen[-1]["pin"]
        z_in = z.clone()
        got = stack.forward_inference(s, z_in, res, pair, inplace=True)
    assert seen[-1]["inplace"] and seen[-1]["offload"]
    assert got[1].data_ptr() == z_in.data_ptr() and torch.equal(got[1], z_in)
    assert rel_err(got[1], want[1]) < 1e-12 and rel_err(got[0], want[0]) < 1e-12


def test_offload_msa_stack_counts_its_m_copy(monkeypatch):
    """Evoformer with offload and without inplace copies m on the device: the plan is made with inplace=False, so
    the estimate's working memory counts that copy (it used to be planned as inplace)."""
    m, z, msa, pair = _msa_inputs(S=5, N=7, seed=3)
    stack = randomize_(EvoformerStack(**EW, num_blocks=2, attention="torch"), seed=4).double().eval()
    seen, real = [], inference.plan_inference
    monkeypatch.setattr(inference, "plan_inference", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    m0, z0 = m.clone(), z.clone()
    with torch.no_grad():
        want = stack.configure_inference(mode="plain")(m, z, msa, pair)
        got = stack.configure_inference(mode="bounded", chunk_size=3, msa_chunk_size=2, offload=True)(m, z, msa, pair)
    assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12
    assert torch.equal(m, m0) and torch.equal(z, z0)
    est = seen[-1].estimate
    m_bytes, z_bytes = m.numel() * 8, z.numel() * 8
    assert est.working == z_bytes + m_bytes and est.host == z_bytes  # a CPU run pins nothing


def test_offload_estimate_counts_host_memory():
    """AF3 widths at N=12288 (z 36 GiB in bf16): the offload path holds one device copy of z per block and one host
    copy, pinned in torch's power-of-two block (64 GiB), none with inplace and z on the host."""
    d, n = Dims(c_s=384), 12288
    z = n * n * 128 * 2
    assert z == 36 * GIB
    assert estimate_inference_memory(d, n, 128).host == 0
    off = estimate_inference_memory(d, n, 128, offload=True)
    assert off.host == 64 * GIB and "host 64.00 GiB" in str(off)
    assert off.working == z and off.inputs < GIB  # the device: the block's copy of z, not the caller's
    assert estimate_inference_memory(d, n, 128, offload=True, pin=False).host == z
    assert estimate_inference_memory(d, n, 128, offload=True, inplace=True).host == 0
    assert estimate_inference_memory(d, n, 128, offload=True, inplace=True, z_on_host=False).host == 64 * GIB
    assert inference.pinned_host_bytes(11776 * 11776 * 256) == 64 * GIB
    assert inference.pinned_host_bytes(16 * GIB) == 16 * GIB and inference.pinned_host_bytes(1) == 1


def test_offload_plan_checks_host_memory(monkeypatch):
    """The plan pins the host copy when its power-of-two block fits the host budget, falls back to a pageable copy
    when only z itself fits, and refuses N naming the budget and the bytes when not even that fits."""
    d, n, dev = Dims(c_s=384), 12288, 77 * GIB
    plan = plan_inference(d, n, dev, offload=True, host_budget=100 * GIB)
    assert plan.pinned and plan.estimate.host == 64 * GIB and plan.fits and plan.host_budget == 100 * GIB
    plan = plan_inference(d, n, dev, offload=True, host_budget=50 * GIB)
    assert not plan.pinned and plan.estimate.host == 36 * GIB and plan.fits
    assert not plan_inference(d, n, dev, offload=True, host_budget=100 * GIB, pin=False).pinned
    with pytest.raises(ValueError, match=r"N=12288 does not fit in host memory: offload keeps one copy of z on the "
                                         r"host, 36\.00 GiB \(pinned: 64\.00 GiB.*host_budget=30\.00 GiB;"):
        plan_inference(d, n, dev, offload=True, host_budget=30 * GIB)
    assert plan_inference(d, n, dev, offload=True, inplace=True, host_budget=1).estimate.host == 0
    with pytest.raises(ValueError, match="host_budget must be a positive number of bytes"):
        plan_inference(d, n, dev, offload=True, host_budget=0)
    # the default host budget: the available host memory; without offload the host is not checked
    monkeypatch.setattr(inference, "available_host_memory", lambda: 8 * GIB)
    with pytest.raises(ValueError, match=r"N=12288 does not fit in host memory.*host_budget=8\.00 GiB \(the "
                                         r"available host memory\)"):
        plan_inference(d, n, dev, offload=True)
    stack = PairformerStack(**PW, num_blocks=1, attention="torch")  # c_z=8: z is 16 GiB at N=32768
    with pytest.raises(ValueError, match="N=32768 does not fit in host memory"):
        stack.plan_inference(32768, offload=True)
    assert plan_inference(d, n, dev).estimate.host == 0


def test_available_host_memory():
    avail = inference.available_host_memory()
    if os.path.exists("/proc/meminfo"):
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        assert isinstance(avail, int) and 0 < avail <= total


def test_bad_settings_get_clear_errors():
    stack = PairformerStack(**PW, num_blocks=1, attention="torch").eval()
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"chunk_size must be a positive int or None, got {bad}"):
            stack.configure_inference(chunk_size=bad)
    for bad in (2.5, True, "8"):
        with pytest.raises(TypeError, match="chunk_size must be a positive int"):
            stack.configure_inference(chunk_size=bad)
    with pytest.raises(ValueError, match="msa_chunk_size"):
        InferenceSettings(msa_chunk_size=0)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="memory_budget must be a positive number of bytes"):
            stack.configure_inference(memory_budget=bad)
    with pytest.raises(TypeError, match="memory_budget must be a number of bytes"):
        stack.configure_inference(memory_budget="10GiB")
    with pytest.raises(ValueError, match="mode must be one of"):
        stack.configure_inference(mode="fast")
    with pytest.raises(TypeError, match="unknown inference setting"):
        stack.configure_inference(chunksize=4)
    with pytest.raises(TypeError, match="offload must be a bool"):
        stack.configure_inference(offload=1)
    blk = PairformerBlock(**PW, attention="torch").eval()
    s, z, res, pair = _pair_inputs(B=1, N=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="chunk_size must be a positive int or None, got 0"):
        blk.forward_inference(s, z, res, pair, chunk_size=0)
    # a budget too small for even one row names N, the budget and what is needed
    with pytest.raises(ValueError, match=r"N=5 does not fit in memory_budget=.*even chunks of 1 need"):
        blk.forward_inference(s, z, res, pair, memory_budget=1000)
    with pytest.raises(ValueError, match="N=4096 does not fit"):
        plan_inference(Dims(c_s=384), 4096, 4 * GIB)
    with pytest.raises(ValueError, match="chunk_size=4096 does not fit"):
        plan_inference(Dims(c_s=384), 4096, 20 * GIB, chunk_size=4096)
    with pytest.raises(ValueError, match="n_seq"):
        estimate_inference_memory(Dims(c_m=256), 256, 16)


def test_dims_read_from_blocks():
    assert Dims.of(PairformerBlock()) == Dims(c_s=384, num_heads_single=16)
    assert Dims.of(EvoformerBlock()) == Dims(c_m=256, num_heads_msa=8, c_hidden_msa=32, c_hidden_opm=32)
    assert Dims.of(PairformerBlock(**PW)) == Dims(c_z=8, c_hidden_mul=8, num_heads_pair=2, c_hidden_pair=16,
                                                  transition_n=2, c_s=32, num_heads_single=2)


def test_planning_arithmetic():
    """AF3 widths, bf16: the estimate's terms, the planned chunk is the largest candidate within budget, larger
    budgets never give smaller chunks, and the planned block at N=4096 needs at most 2.5 z beyond its inputs."""
    d = Dims(c_s=384)
    n, e = 4096, 2
    z = n * n * 128 * e
    est = estimate_inference_memory(d, n, 128)
    mods = dict(est.modules)
    assert est.z_bytes == z
    # triangle multiplication holds one [C, N, N] projection; triangle attention its [H, N, N] bias
    assert z <= mods["triangle_multiplication"] < 1.5 * z
    assert n * n * 4 * e <= mods["triangle_attention"] < 0.5 * z
    assert est.working == z and est.inputs >= z and est.peak == est.inputs + est.extra
    assert estimate_inference_memory(d, n, 128, inplace=True).working == 0
    off = estimate_inference_memory(d, n, 128, offload=True)
    assert off.inputs < z and off.working == z
    # estimates grow with the chunk and with N
    sizes = [estimate_inference_memory(d, n, c).extra for c in (1, 16, 128, 1024, 4096)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    assert estimate_inference_memory(d, 2 * n, 128).extra > 3 * est.extra

    chunks = []
    for budget_gib in (8.5, 9, 10, 12, 16, 40, 80):
        budget = int(budget_gib * GIB)
        plan = plan_inference(d, n, budget)
        assert plan.fits and plan.estimate.extra <= budget
        bigger = [c for c in inference._candidates(n) if c > plan.chunk_size]
        if bigger:  # the next larger candidate is over the budget or over the chunk-size rule
            nxt = estimate_inference_memory(d, n, min(bigger))
            base = estimate_inference_memory(d, n, 1)
            assert nxt.extra > budget or nxt.transient - base.transient > 0.5 * z
        chunks.append(plan.chunk_size)
    assert chunks == sorted(chunks) and chunks[0] < chunks[-1], chunks
    free = plan_inference(d, n, None)
    assert free.estimate.extra <= 2.5 * z and free.estimate.extra - z <= 1.5 * z  # the memory target (2.5 z), in bytes
    assert plan_inference(d, n, None, inplace=True).estimate.extra <= 1.5 * z
    # Evoformer, AF2 widths, 512 sequences: the MSA chunk is planned too and fits its budget
    ev = plan_inference(Dims(c_m=256), n, 16 * GIB, n_seq=512)
    assert ev.msa_chunk_size is not None and ev.estimate.extra <= 16 * GIB
    assert dict(ev.estimate.modules)["outer_product_mean"] > 0


def test_auto_plan_uses_the_settings_budget(monkeypatch):
    """Without a chunk size, the stack plans against memory_budget (the CPU has no free-memory query)."""
    s, z, res, pair = _pair_inputs(N=16, seed=15, dtype=torch.float32)
    stack = randomize_(PairformerStack(**PW, num_blocks=1, attention="torch"), seed=16).eval()
    d = stack.inference_dims()
    scores = inference.score_bytes_of(stack.blocks[0], torch.device("cpu"), torch.float32)
    budgets = [estimate_inference_memory(d, 16, c, batch=2, dtype=torch.float32, scores=scores).extra
               for c in (2, 8)]
    seen = []
    for budget in budgets:
        calls = _spy_spans(monkeypatch)
        with torch.no_grad():
            stack.configure_inference(memory_budget=budget)(s, z, res, pair)
        seen.append({c for _, c in calls})
    assert seen == [{2}, {8}], seen


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------
def _gpu_pairformer(n, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    blk = randomize_(PairformerBlock(attention="triton"), seed=seed).cuda().eval()
    s = torch.randn(1, n, 384, generator=g).cuda()
    z = torch.randn(1, n, n, 128, generator=g).cuda()
    res = torch.arange(n, device="cuda")[None] < n - 13
    res[:, n // 3] = False
    pair = res[:, :, None] & res[:, None, :]
    return blk, s, z, res, pair


@pytest.mark.gpu
def test_gpu_pairformer_block_n1024_equals_plain():
    """N=1024, bf16 weights and inputs: the in-place path's error against the fp32 plain block is at most twice the
    bf16 plain block's."""
    blk, s, z, res, pair = _gpu_pairformer(1024)
    with torch.no_grad():
        exact = blk(s, z, res, pair)
        b16 = blk.to(torch.bfloat16)
        plain = b16(s.bfloat16(), z.bfloat16(), res, pair, chunk_size=256)
        got = b16.forward_inference(s.bfloat16(), z.bfloat16(), res, pair, mode="bounded")
    for gt, p, e in zip(got, plain, exact):
        assert rel_err(gt, e) <= 2 * rel_err(p, e) + 1e-3, (rel_err(gt, e), rel_err(p, e))


@pytest.mark.gpu
def test_gpu_evoformer_block_equals_plain():
    g = torch.Generator().manual_seed(1)
    n, S = 512, 64
    blk = randomize_(EvoformerBlock(attention="triton"), seed=1).cuda().eval()
    m = torch.randn(1, S, n, 256, generator=g).cuda()
    z = torch.randn(1, n, n, 128, generator=g).cuda()
    msa = (torch.rand(1, S, n, generator=g) > 0.1).cuda()
    pair = torch.ones(1, n, n, dtype=torch.bool, device="cuda")
    pair[:, -7:, :] = pair[:, :, -7:] = False
    with torch.no_grad():
        exact = blk(m, z, msa, pair)
        b16 = blk.to(torch.bfloat16)
        plain = b16(m.bfloat16(), z.bfloat16(), msa, pair)
        got = b16.forward_inference(m.bfloat16(), z.bfloat16(), msa, pair, chunk_size=96, mode="bounded")
    for gt, p, e in zip(got, plain, exact):
        assert rel_err(gt, e) <= 2 * rel_err(p, e) + 1e-3, (rel_err(gt, e), rel_err(p, e))


@pytest.mark.gpu
@pytest.mark.parametrize("budget_z", [2.3, 2.6, 3.0, 5.0])
def test_gpu_chunk_choice_respects_budget(budget_z):
    """The planned block's peak allocation beyond its inputs, measured by the CUDA allocator, stays within the
    budget (and within the estimate); smaller budgets give smaller chunks."""
    n = 1024
    blk, s, z, res, pair = _gpu_pairformer(n, seed=2)
    blk = blk.to(torch.bfloat16)
    s, z = s.bfloat16(), z.bfloat16()
    z_bytes = z.numel() * z.element_size()
    budget = int(budget_z * z_bytes + 256 * 2 ** 20)
    plan = plan_inference(Dims.of(blk), n, budget, dtype=torch.bfloat16)
    small = plan_inference(Dims.of(blk), n, int(2.3 * z_bytes + 256 * 2 ** 20), dtype=torch.bfloat16)
    assert plan.chunk_size >= small.chunk_size
    with torch.no_grad():
        blk.forward_inference(s, z, res, pair, memory_budget=budget, mode="bounded")  # warm-up: kernels, cuBLAS
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = blk.forward_inference(s, z, res, pair, memory_budget=budget, mode="bounded")
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= budget, (extra / GIB, budget / GIB, str(plan.estimate))
    assert extra <= plan.estimate.extra, (extra / GIB, str(plan.estimate))
    del out


@pytest.mark.gpu
def test_gpu_stack_offload_equals_device_and_saves_memory():
    """offload with z on the host: the same result, and the device never holds the caller's z."""
    n = 1024
    _, s, z, res, pair = _gpu_pairformer(n, seed=3)
    stack = randomize_(PairformerStack(num_blocks=2, attention="triton"), seed=3).cuda().bfloat16().eval()
    # the bounded path with the same chunks in both runs: the same bits (auto would run plain on the device here)
    stack.configure_inference(mode="bounded", chunk_size=128)
    s, z = s.bfloat16(), z.bfloat16()
    z_host = z.cpu().pin_memory()
    z_bytes = z.numel() * z.element_size()
    with torch.no_grad():
        stack(s, z, res, pair)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        want = stack(s, z, res, pair)
        torch.cuda.synchronize()
        device_peak = torch.cuda.max_memory_allocated()
        want = [t.cpu() for t in want]
        del z
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        got = stack.configure_inference(offload=True)(s, z_host, res, pair)
        torch.cuda.synchronize()
        offload_peak = torch.cuda.max_memory_allocated()
    assert got[1].device.type == "cpu"
    assert rel_err(got[1], want[1]) < 1e-6 and rel_err(got[0].cpu(), want[0]) < 1e-6
    assert offload_peak < device_peak - 0.8 * z_bytes, (offload_peak / GIB, device_peak / GIB)


def test_bench_inference_auto_script_runs_on_cpu(tmp_path):
    """scripts/bench_inference_auto.py end to end at a tiny N and widths on the CPU: three rows per N, the
    forced paths as asked, auto's choice and reason recorded, the tables written."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_inference_auto

    rows = bench_inference_auto.main(["--device", "cpu", "--n", "12", "--iters", "1", "--warmup", "0",
                                      "--c-s", "32", "--c-z", "8", "--out", str(tmp_path)])
    assert [(r["mode"], r["path"], r["status"]) for r in rows] == [
        ("plain", "plain", "ok"), ("bounded", "bounded", "ok"), ("auto", "plain", "ok")]
    assert rows[1]["chunk"] == 12 and "fits the budget" in rows[2]["note"]
    text = (tmp_path / "inference_auto.md").read_text()
    assert "| 12 | auto | plain |" in text and (tmp_path / "inference_auto.csv").exists()


@pytest.mark.slow
def test_bench_memory_script_runs_on_cpu(tmp_path):
    """scripts/bench_memory.py end to end at tiny widths on the CPU (a typo there would only show on the GPU)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_memory

    bench = bench_memory.main(["--tiny", "--device", "cpu", "--backend", "torch", "--block-n", "12", "--iters", "0",
                               "--stack-n", "12", "--stack-blocks", "2", "--step", "4", "--max-probes", "1",
                               "--evo-n", "10", "--evo-seq", "3", "--evo-blocks", "1", "--out", str(tmp_path)])
    rows = bench.rows
    assert not [r for r in rows if r["status"] == "error"], rows
    impls = {(r["section"], r["impl"]) for r in rows if r["status"] in ("ok", "result")}
    assert {("block", "bounded"), ("block", "bounded-inplace"), ("block", "plain-chunk128"),
            ("stack", "stack 2 blocks"), ("evoformer", "EvoformerStack AF2 widths")} <= impls, impls
    assert (tmp_path / "memory.csv").read_text().count("\n") == len(rows) + 1
    assert "| block | bounded | 12 |" in (tmp_path / "memory.md").read_text()


def test_bench_memory_longest_n_walks_down_past_out_of_memory(tmp_path, monkeypatch):
    """The longest-N probing: plan refusals cost no probe, device or pinned-host OOM counts as not fitting, and the
    walk goes down (or up) until an N that ran sits just below one that did not; failures are classified."""
    import argparse
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_memory

    args = argparse.Namespace(out=str(tmp_path), device="cpu", tiny=True, time_limit=1e9, step=4, max_probes=3,
                              probe_blocks=1, backend="torch")
    bench = bench_memory.Bench(args)

    def run(start, outcome):
        def stack_row(stack, n, offload, blocks_run, impl):
            status = outcome(n)
            bench.add(section="stack", impl=impl, n=n, status=status, note=f"why {n}")
            return status, 1.0 if status == "ok" else None
        monkeypatch.setattr(bench, "stack_row", stack_row)
        monkeypatch.setattr(bench, "predicted_longest", lambda stack, offload: start)
        first = len(bench.rows)
        bench.longest(None, True, "longest N, offload", {})
        return [r["n"] for r in bench.rows[first:-1]], bench.rows[-1]

    # refused by the plan above 20 (free), out of (pinned host) memory at 16 and 20, runs at 12
    probed, res = run(28, lambda n: "does not fit" if n > 20 else "OOM" if n > 12 else "ok")
    assert probed == [28, 24, 20, 16, 12] and res["status"] == "result" and res["n"] == 12, res
    assert "N=16 did not (OOM: why 16)" in res["note"]
    probed, res = run(4, lambda n: "ok" if n <= 12 else "OOM")  # up from a low prediction
    assert probed == [4, 8, 12] and res["status"] == "result" and "lower bound" in res["note"]
    args.max_probes = 5
    probed, res = run(4, lambda n: "ok" if n <= 12 else "OOM")
    assert probed == [4, 8, 12, 16] and res["n"] == 12 and "N=16 did not" in res["note"]
    probed, res = run(40, lambda n: "OOM")
    assert probed == [40, 36, 32, 28, 24] and res["status"] == "none fits" and "probe limit (5)" in res["note"]

    classify = bench_memory.classify_failure
    pinned = RuntimeError("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in ...")
    assert classify(pinned)[0] == "OOM" and "pinned host memory" in classify(pinned)[1]
    assert classify(ValueError("N=12288 does not fit in host memory"))[0] == "does not fit"
    assert classify(RuntimeError("CUDA error: an illegal memory access"))[0] == "error"
    assert classify(KeyError("bug")) == (None, None)


# --------------------------------------------------------------------------------------------------
# The inference path's Triton layer norm (interpreter on the CPU)
# --------------------------------------------------------------------------------------------------
@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["rows", "columns", "channels_first", "one_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_layer_norm_rows_equals_layer_norm(layout, dtype):
    """Every layout the inference path feeds it, against nn.LayerNorm in float64 (odd channel count: padded lanes)."""
    from attn_zoo.models import kernels

    g = torch.Generator().manual_seed(3)
    C = 24
    norm = torch.nn.LayerNorm(C)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(C, generator=g))
        norm.bias.copy_(torch.randn(C, generator=g))
    z = (torch.randn(7, 9, C, generator=g) * 3 + 2).to(dtype)
    cf = layout == "channels_first"
    # channels-first: [C, 35] with contiguous rows, a matmul output's layout
    x = {"rows": z[2:5], "columns": z[:, 3:6], "channels_first": z.reshape(-1, C)[5:40].t().contiguous(),
         "one_row": z[1, 2]}[layout]
    view = kernels._as_3d(x, cf)
    assert view is not None
    rows_shape = x.shape[1:] if cf else x.shape[:-1]
    got = kernels._launch(x, norm, view, rows_shape, dtype)
    want = norm.double()(x.double().movedim(0, -1) if cf else x.double())
    norm.float()
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_err(got, want) < tol, rel_err(got, want)


def test_triton_layer_norm_rows_refuses_unmergeable_views():
    from attn_zoo.models import kernels

    x = torch.randn(4, 5, 6, 8)[::2, ::2, ::2]  # three strided row dims: no 3-d view
    assert kernels._as_3d(x, False) is None
    assert kernels._as_3d(torch.randn(8, 4, 6)[:, :, :3], True) is None  # channels-first rows not contiguous
    # the public function falls back to the module (no CUDA here) and still returns a contiguous result
    norm = torch.nn.LayerNorm(8)
    y = kernels.layer_norm_rows(x, norm)
    assert y.is_contiguous() and torch.allclose(y, norm(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_layer_norm_rows_matches_the_module(dtype):
    """The compiled kernel on every layout of the inference path: within the dtype's rounding of nn.LayerNorm
    in float64 (bf16 output: one rounding, as the module's)."""
    from attn_zoo.models import kernels

    g = torch.Generator().manual_seed(5)
    norm = torch.nn.LayerNorm(128).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(128, generator=g))
        norm.bias.copy_(torch.randn(128, generator=g))
    z = (torch.randn(300, 301, 128, generator=g) + 1.5).cuda().to(dtype)
    cases = [(z[17:80], False), (z[:, 17:80], False), (z.reshape(-1, 128)[:5000].t().contiguous(), True),
             (z.transpose(0, 1)[3:40], False)]
    for x, cf in cases:
        assert kernels._as_3d(x, cf) is not None
        got = kernels.layer_norm_rows(x, norm, channels_first=cf)
        want = norm.double()(x.double().movedim(0, -1) if cf else x.double())
        norm.float()
        ref = norm(x.float().movedim(0, -1) if cf else x.float()).to(dtype)  # the module's own rounding
        assert got.is_contiguous() and got.dtype == dtype
        assert rel_err(got, want) <= 1.5 * rel_err(ref, want) + 1e-6, (rel_err(got, want), rel_err(ref, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_layer_norm_rows_past_int32_offsets():
    """A column chunk and a transposed row chunk of a pair tensor of more than 2**31 elements (offsets in int64)."""
    from attn_zoo.models import kernels

    n, c = 4200, 128  # 2.26e9 elements, 4.2 GiB in bf16
    z = torch.empty(n, n, c, device="cuda", dtype=torch.bfloat16)
    z[-3:].normal_()
    z[:, -3:].normal_()
    norm = torch.nn.LayerNorm(c).cuda()
    for x in (z[:, -3:], z.transpose(0, 1)[-3:]):
        got = kernels.layer_norm_rows(x, norm)
        want = norm(x.float()).to(torch.bfloat16)
        assert (got.float() - want.float()).abs().max() < 0.05
    del z
