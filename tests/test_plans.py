"""Launch plans (attn_ops/triton/launch.py): a call replayed from its geometry's plan gives the bits of a call that
runs the launchers afresh, with the new call's tensors; anything a plan depends on gives a new plan.

Two halves: the real kernels under TRITON_INTERPRET=1 (the replay launches through the plain path there), and the
GPU's direct path (``launch.bound``) with a stand-in for Triton's compiled kernels that logs every launch, so the
arguments a replay hands the kernels are checked on the CPU too.
"""
import gc
import os
import types
import weakref

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest does the same)

pytest.importorskip("triton")

from attn_ops import settings  # noqa: E402
from attn_ops.settings import kernel_settings  # noqa: E402
from attn_ops.triton import launch, passes, tuning, triton_attention  # noqa: E402
from helpers import ids_from_lengths, make_inputs  # noqa: E402

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton interpreter tests (CPU): run with TRITON_INTERPRET=1")

L = 21
# (name, batch, H, Lq, Lk, D, bias_shape, mask_shape, causal, options, segments)
CASES = [
    ("pair_bias_reduction", (1, 3), 2, L, L, 16, (1, 1, 2, L, L), (1, 3, 1, 1, L), False, {}, False),
    ("pair_bias_atomic", (1, 3), 2, L, L, 16, (1, 1, 2, L, L), (1, 3, 1, 1, L), False, {"deterministic": False},
     False),
    ("fused", (2,), 2, L, 17, 24, (1, 2, L, 17), None, False, {"deterministic": False, "bwd": "fused"}, False),
    ("full_bias_causal", (2,), 2, L, L, 16, (2, 2, L, L), (2, 1, 1, L), True, {}, False),
    ("no_bias_segments", (2,), 2, L, L, 16, None, None, True, {}, True),
    ("key_bias_row_mask", (1, 2), 2, 17, L, 16, (1, 1, 2, 1, L), (1, 2, 1, 17, L), False, {}, False),
]


@pytest.fixture
def fresh_plans(monkeypatch):
    monkeypatch.setattr(launch.STATE, "plans", {})
    return launch.STATE.plans


def _inputs(case, seed):
    _, batch, h, lq, lk, d, bias_shape, mask_shape, causal, options, segments = case
    q, k, v, bias, mask = make_inputs(batch, h, lq, lk, d, bias_shape=bias_shape, mask_shape=mask_shape, seed=seed)
    ids = None
    if segments:
        ids = ids_from_lengths([7, 9, 3], lq).expand(*batch, lq)
    return q, k, v, bias, mask, causal, options, ids


def _grads(q, k, v, bias, mask, causal, options, ids, seed):
    seg = None if ids is None else (ids, ids)
    out, lse = triton_attention(q, k, v, bias, mask, 0.3, causal, segment_ids=seg, **options)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    leaves = [t for t in (q, k, v, bias) if t is not None]
    grads = torch.autograd.grad((out * g).sum() + torch.where(lse.isfinite(), lse, 0).sum(), leaves)
    return [out.detach(), lse.detach(), *grads]


@interpreter
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_replayed_call_gives_the_bits_of_a_fresh_one(case, fresh_plans):
    """Record on one set of values; replay on other values of the same geometry: the same bits as running the
    launchers afresh on those values; the replay adds no plan and replaces none (it ran the recorded one)."""
    first = _inputs(case, seed=1)
    recorded = _grads(*first, seed=1)
    kept = [t.clone() for t in recorded]
    plans = dict(fresh_plans)
    assert len(plans) == 2  # a forward and a backward
    second = _inputs(case, seed=2)
    replayed = _grads(*second, seed=2)
    assert fresh_plans.keys() == plans.keys() and all(fresh_plans[key] is plans[key] for key in plans)
    fresh_plans.clear()
    fresh = _grads(*second, seed=2)
    for a, b in zip(replayed, fresh):  # (a replay on the first call's inputs would differ)
        assert torch.equal(a, b)
    for a, b in zip(recorded, kept):  # the replay wrote into buffers of its own, not the first call's results
        assert torch.equal(a, b)


@interpreter
def test_what_a_plan_depends_on_makes_a_new_one(fresh_plans):
    q, k, v, bias, mask = make_inputs((1, 2), 2, L, L, 16, bias_shape=(1, 1, 2, L, L), mask_shape=(1, 2, 1, 1, L))

    def forward(q, k, v, bias=bias, mask=mask, scale=0.3, causal=False):
        with torch.no_grad():
            return triton_attention(q, k, v, bias, mask, scale, causal)

    ref = forward(q, k, v)
    assert len(fresh_plans) == 1
    forward(q.clone(), k.clone(), v.clone())
    assert len(fresh_plans) == 1
    # strides: q in another dim order (same values)
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(forward(qt, k, v)[0], ref[0], rtol=0, atol=0)
    assert len(fresh_plans) == 2
    # 16-byte alignment of a data pointer
    buf = torch.empty(q.numel() + 1)
    q_odd = buf[1:].view(q.shape).copy_(q.detach())
    torch.testing.assert_close(forward(q_odd, k, v)[0], ref[0], rtol=0, atol=0)
    assert len(fresh_plans) == 3
    # scale, causal, dtype, mask presence, the bias's broadcast pattern
    forward(q, k, v, scale=0.25)
    forward(q, k, v, causal=True)
    forward(q.half(), k.half(), v.half())
    forward(q, k, v, mask=None)
    forward(q, k, v, bias=bias.expand(1, 2, 2, L, L).contiguous())
    assert len(fresh_plans) == 8
    # other settings: a plan of their own, and the first one stays for when they come back
    first = next(iter(fresh_plans))
    before = fresh_plans[first]
    with kernel_settings(tma=False):
        out = forward(q, k, v)[0]
    torch.testing.assert_close(out, ref[0], rtol=0, atol=0)
    assert len(fresh_plans) == 9 and fresh_plans[first] is before
    assert [key[-1].tma for key in fresh_plans].count(False) == 1
    # settings equal by value (a context manager per call makes a new object each time) replay the same plans
    plans = dict(fresh_plans)
    for _ in range(2):
        with kernel_settings():
            forward(q, k, v)
        with kernel_settings(tma=False):
            forward(q, k, v)
    assert fresh_plans.keys() == plans.keys() and all(fresh_plans[key] is plans[key] for key in plans)
    launch.clear_plans()
    assert not launch.STATE.plans


@pytest.mark.slow
@interpreter
def test_what_a_backward_plan_depends_on_makes_a_new_one(fresh_plans):
    """The backward's key: whether lse has a gradient, whether the bias needs one, and the variant (atomic dBias,
    fused); each gives its own plan, and each replays the right one (checked against the torch backend)."""
    from attn_ops import attention

    q, k, v, bias, mask = make_inputs((1, 2), 2, L, L, 16, bias_shape=(1, 1, 2, L, L), mask_shape=(1, 2, 1, 1, L))
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    variants = [({}, True, True), ({}, False, True), ({}, True, False), ({"deterministic": False}, True, True),
                ({"deterministic": False, "bwd": "fused"}, True, True)]

    def grads(backend, options, lse_loss, bias_grad):
        b = bias.detach().requires_grad_(bias_grad)
        extra = options if backend == "triton" else {}
        out, lse = attention(q, k, v, b, mask, scale=0.3, return_lse=True, backend=backend, **extra)
        loss = (out * g).sum() + (lse.sum() if lse_loss else 0)
        return torch.autograd.grad(loss, (q, k, v, b) if bias_grad else (q, k, v))

    for rounds in (1, 2):  # the second round replays: every variant must still find its own plan
        for variant in variants:
            for got, want in zip(grads("triton", *variant), grads("torch", *variant)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        if rounds == 1:
            plans = dict(fresh_plans)
    backward = [key for key in plans if key[0] == "bwd"]
    assert len(backward) == len(variants)
    assert fresh_plans.keys() == plans.keys() and all(fresh_plans[key] is plans[key] for key in plans)


@interpreter
@pytest.mark.parametrize("knob", ["interpreter_config", "tma_threshold", "tuner_reset", "tuner_picks"])
def test_module_knobs_a_plan_was_made_under_remake_it(knob, fresh_plans, monkeypatch):
    """The interpreter's config, the TMA threshold and the tuner's picks are read while recording: replacing any
    (as tests and experiments do: a new picks dict, or ``TUNER.reset()``) makes the next call record again instead
    of replaying the old choice."""

    q, k, v, bias, mask = make_inputs((1, 2), 2, L, L, 16, bias_shape=(1, 1, 2, L, L), mask_shape=(1, 2, 1, 1, L))
    with torch.no_grad():
        triton_attention(q, k, v, bias, mask, 0.3, False)
    (key, before), = fresh_plans.items()
    if knob == "interpreter_config":
        monkeypatch.setattr(tuning, "_INTERPRETER", tuning.Cfg(16, 16, 4, 1))
    elif knob == "tma_threshold":
        monkeypatch.setattr(launch.STATE, "tma_min_scores", 0)
    elif knob == "tuner_reset":
        tuning.TUNER.reset()
    else:
        monkeypatch.setattr(tuning.TUNER, "picks", {})
    with torch.no_grad():
        triton_attention(q, k, v, bias, mask, 0.3, False)
    assert fresh_plans[key] is not before
    again = fresh_plans[key]
    with torch.no_grad():
        triton_attention(q, k, v, bias, mask, 0.3, False)
    assert fresh_plans[key] is again  # (and the new plan replays)


@interpreter
def test_past_the_limit_the_oldest_plan_goes(fresh_plans, monkeypatch):
    monkeypatch.setattr(launch.STATE, "plans_max", 2)
    q, k, v, bias, mask = make_inputs((1, 2), 2, L, L, 16, bias_shape=(1, 1, 2, L, L), mask_shape=(1, 2, 1, 1, L))
    keys = []
    with torch.no_grad():
        for scale in (0.1, 0.2, 0.3):
            triton_attention(q, k, v, bias, mask, scale, False)
            keys.append(next(reversed(fresh_plans)))
    assert list(fresh_plans) == keys[1:]


def test_align_is_the_largest_power_of_two_dividing_every_batch_stride():
    """The kernels' ALIGN (launch._align): the batch strides and the row stride count, batch dims of size 1 do not
    (their index is always 0); at most 16."""
    def t(shape, stride):
        return torch.empty(1 << 16).as_strided(shape, stride)

    heads = lambda c: t((1, 5, 4, 9, c), (5 * 9 * 4 * c, 9 * 4 * c, c, 4 * c, 1))  # noqa: E731 - [*, L, H, C] memory
    assert [launch._align(heads(c)) for c in (8, 12, 17, 24, 48, 64)] == [8, 4, 1, 8, 16, 16]
    assert launch._align(heads(24), heads(12)) == 4  # one hint for every tensor a kernel reads
    assert launch._align(t((1, 1, 1, 9, 24), (7, 7, 7, 24, 1))) == 8  # no batch dim: the row stride alone
    assert launch._align(t((1, 1, 1, 9, 48), (7, 7, 7, 48, 1))) == 16
    assert launch._align(t((3, 1, 2, 9, 24), (6 * 9 * 24 + 2, 5, 9 * 24, 24, 1))) == 2  # R broadcast: its 5 ignored


@interpreter
def test_plans_hold_no_tensors(fresh_plans):
    """A plan keeps geometry, never the tensors of the call that made it (no memory held after the call)."""
    q, k, v, bias, mask = make_inputs((1, 3), 2, L, L, 16, bias_shape=(1, 1, 2, L, L), mask_shape=(1, 3, 1, 1, L))
    refs = [weakref.ref(t) for t in (q, k, v, bias, mask)]
    out, lse = triton_attention(q, k, v, bias, mask, 0.3, False)
    grads = torch.autograd.grad(out.sum(), (q, k, v, bias))
    refs += [weakref.ref(t) for t in (out, lse, *grads)]
    del q, k, v, bias, mask, out, lse, grads
    gc.collect()
    assert fresh_plans and all(r() is None for r in refs)


# ---------------------------------------------------------------------------------------------------------------
# The direct path, with Triton's compiled kernels replaced by a stand-in that logs each launch


class _LoggedCompiled:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *args: self.log.append((self.name, grid, args, "direct"))


@pytest.fixture
def logged_launches(monkeypatch, fresh_plans):
    """Every JITFunction launch logs (kernel, grid, args) and returns a logging compiled kernel; nothing runs."""
    import inspect
    import types

    log = []

    def run(self, *args, grid, warmup, **kw):
        name = self.fn.__name__
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        log.append((name, grid3, args + tuple(v for k, v in kw.items() if k not in ("num_warps", "num_stages")),
                    "plain"))
        return _LoggedCompiled(log, name)

    kernels = (passes.attn_fwd_kernel, passes.attn_bwd_dkdv_kernel, passes.attn_bwd_dq_kernel,
               passes.bwd_preprocess_kernel, passes.attn_bwd_dbias_kernel,
               passes.sum_splits_kernel)
    for kernel in kernels:
        monkeypatch.setattr(type(kernel), "run", run)
        if not hasattr(kernel, "params"):  # the interpreter's kernels: their params as a JITFunction lists them
            params = [types.SimpleNamespace(name=p.name, is_constexpr="constexpr" in str(p.annotation),
                                            do_not_specialize=False)
                      for p in inspect.signature(kernel.fn).parameters.values()]
            monkeypatch.setattr(kernel, "params", params, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(settings, "_current", settings.KernelSettings(cache_dir=None, tune=False))
    for name in ("compiled", "exact", "params"):
        monkeypatch.setattr(launch.STATE, name, {})
    monkeypatch.setattr(launch, "_device", lambda: 0)  # no CUDA here
    monkeypatch.setattr(passes, "_tma_capable", lambda device: False)  # CPU tensors: pointer loads, as on older GPUs
    return log


def _describe(args, named):
    """A launch's arguments with tensors named by the call's tensor they are (or their geometry if allocated)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            name = next((n for n, t in named.items() if t is a), None)
            out.append(name or ("new", tuple(a.shape), a.stride(), a.dtype))
        else:
            out.append(a)
    return tuple(out)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_replay_launches_the_recorded_kernels_with_the_new_tensors(case, logged_launches):
    """Calls 2 and 3 replay (direct launches only): the same kernels, grids and scalars as the recorded call's final
    launches, each input position holding that call's own tensor and every buffer a new one."""
    calls = []
    for seed in (1, 2, 3):
        q, k, v, bias, mask, causal, options, ids = _inputs(case, seed)
        seg = None if ids is None else (ids, ids)
        del logged_launches[:]
        out, lse = triton_attention(q, k, v, bias, mask, 0.3, causal, segment_ids=seg, **options)
        grads = torch.autograd.grad(out.sum(), [t for t in (q, k, v, bias) if t is not None])
        named = dict(q=q, k=k, v=v, bias=bias)
        calls.append(([(n, g, _describe(a, named)) for n, g, a, _ in logged_launches], list(logged_launches),
                      (out, lse, *grads)))
    (rec, _, _), (rep2, raw2, res2), (rep3, raw3, _) = calls
    assert rep2 and rep2 == rep3
    # (the segment tables of each call's new ids tensor are built afresh: not part of a plan)
    assert all(kind == "direct" for name, *_, kind in raw2 + raw3 if name != "segment_table_kernel")
    assert all(entry in rec for entry in rep2)  # the recorded call also ran candidate trials before its launches
    mine2 = {id(t) for _, _, a, _ in raw2 for t in a if isinstance(t, torch.Tensor)}
    assert not any(id(t) in mine2 for _, _, a, _ in raw3 for t in a if isinstance(t, torch.Tensor) and t.numel() > 1)
    # the output handed back is (a view of) the buffer the kernel wrote
    assert any(isinstance(t, torch.Tensor) and t.data_ptr() == res2[0].data_ptr() for _, _, a, _ in raw2 for t in a)


_FOLDED = {  # per kernel: tensor argument -> the prefix of the strides the kernel folds ALIGN into (common.aligned)
    "attn_fwd_kernel": {"Q": "q", "K": "k", "V": "v", "Out": "o"},
    "bwd_preprocess_kernel": {"Out": "o", "dOut": "d"},
    "attn_bwd_dkdv_kernel": {"Q": "q", "K": "k", "V": "v", "dOut": "d", "dQacc": "q", "dK": "k", "dV": "v"},
    "attn_bwd_dq_kernel": {"Q": "q", "K": "k", "V": "v", "dOut": "d", "dQ": "q"},
    "attn_bwd_dbias_kernel": {"Q": "q", "K": "k", "V": "v", "dOut": "d"},
}


@pytest.mark.slow
@interpreter
@pytest.mark.parametrize("layout", ["views_c12", "views_c17", "views_c24", "contiguous_d24_dv20", "bias_pitch_33"])
@pytest.mark.parametrize("variant", ["split", "fused", "atomic"])
def test_every_stride_a_kernel_aligns_is_a_multiple_of_its_claim(layout, variant, fresh_plans, monkeypatch):
    """Each launch: the strides the kernel folds ALIGN (BIAS_ALIGN) into are multiples of it, and are those of the
    tensor passed (q's for dQ and a fused dQ accumulator, k's for dK, ...); the results match the torch backend."""
    import inspect

    from attn_ops import attention

    n, h = 32, 2
    g = torch.Generator().manual_seed(len(layout))
    if layout.startswith("views"):
        c = int(layout[7:])
        q, k, v = (torch.randn(1, 3, n, h, c, generator=g).requires_grad_().transpose(2, 3) for _ in range(3))
    else:
        d, dv = (24, 20) if layout.startswith("contiguous") else (16, 16)
        q, k = (torch.randn(1, 3, h, n, d, generator=g).requires_grad_() for _ in range(2))
        v = torch.randn(1, 3, h, n, dv, generator=g).requires_grad_()
    bias = torch.randn(1, 1, h, n, n + (layout == "bias_pitch_33"), generator=g)[..., :n].requires_grad_()
    mask = torch.rand(1, 3, 1, 1, n, generator=g) > 0.2
    seen = []
    real = launch.launch_kernel

    def check(kernel, grid, args, num_warps, num_stages, **constexprs):
        name = kernel.fn.__name__
        if name in _FOLDED:
            names = list(inspect.signature(kernel.fn).parameters)
            values = dict(zip(names, list(args) + list(constexprs.values())))
            align = constexprs["ALIGN"]
            for tensor, pre in _FOLDED[name].items():
                if tensor == "dQacc" and constexprs.get("FUSED_DQ") != 1:
                    continue
                row = "n" if pre in "kv" else "m"
                strides = tuple(values[f"s_{pre}{x}"] for x in ("b", "r", "h", row))
                assert all(s % align == 0 for s in strides), (name, tensor, strides, align)
                assert launch._rows(values[tensor]) == strides, (name, tensor)
            if constexprs.get("BIAS_ALIGN", 1) > 1:
                assert constexprs["HAS_BIAS"] in (1, 3)  # pointer loads (3: the launcher's padded copy)
                assert all(values[f"s_b{x}"] % constexprs["BIAS_ALIGN"] == 0 for x in "brhm"), name
            seen.append((name, align, constexprs.get("BIAS_ALIGN")))
        return real(kernel, grid, args, num_warps, num_stages, **constexprs)

    monkeypatch.setattr(launch, "launch_kernel", check)
    opts = {"split": {}, "fused": {"bwd": "fused", "deterministic": False}, "atomic": {"deterministic": False}}[variant]
    leaves = (q, k, v, bias)
    grads = []
    for backend in ("triton", "torch"):
        kw = opts if backend == "triton" else {}
        with kernel_settings(tma=False):
            out, lse = attention(q, k, v, bias, mask, return_lse=True, backend=backend, **kw)
            gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            grads.append([out, lse] + list(torch.autograd.grad((out * gout).sum() + lse.sum(), leaves)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert {s[0] for s in seen} >= {"attn_fwd_kernel", "bwd_preprocess_kernel", "attn_bwd_dkdv_kernel"}
    expected = {"views_c12": 4, "views_c17": 1, "views_c24": 8, "contiguous_d24_dv20": 4, "bias_pitch_33": 16}
    assert {s[1] for s in seen} == {expected[layout]}, seen
    if layout != "bias_pitch_33":
        assert any(s[2] == 4 for s in seen)  # an fp32 contiguous bias at even tiles: 16 bytes


class _HeldPool:
    """Stands in for the background compile thread: jobs wait until ``release``."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn):
        from concurrent.futures import Future

        fut = Future()
        self.jobs.append((fn, fut))
        return fut

    def release(self, fail: bool = False):
        """Run the held jobs (``fail``: each ends with a compile error instead)."""
        for fn, fut in self.jobs:
            try:
                if fail:
                    raise RuntimeError("ptxas: a compile error")
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001
                fut.set_exception(exc)
        self.jobs.clear()


@pytest.mark.parametrize("fail", [False, True])
def test_tile_multiple_runs_the_general_variant_until_its_own_compiled(logged_launches, monkeypatch, fail):
    """A length that is a multiple of its bucket's tiles asks for EVEN_M / EVEN_N variants. While those compile on
    the background thread the general variant (already compiled for another length of the bucket) runs and the
    call's plan is kept with the pending compiles (replayed meanwhile); once they have ended, the next call records
    its plan anew with the EVEN variants (``fail``: the background compiles failed, and the call compiles them
    itself, as without background compiles; the plan is kept, nothing loops). A launch whose variant is
    the general one never waits. Results stay those of a plain call (the launches here only log)."""
    from attn_ops.triton.common import LENGTH_ARGS

    # the interpreter's stand-in params: lengths unspecialised, as the kernels declare (a GPU's JITFunctions do)
    for kernel in (passes.attn_fwd_kernel, passes.attn_bwd_dkdv_kernel, passes.attn_bwd_dq_kernel,
                   passes.attn_bwd_dbias_kernel):
        if not isinstance(kernel.params[0], types.SimpleNamespace):
            continue
        monkeypatch.setattr(kernel, "params", [p.__class__(**dict(vars(p), do_not_specialize=p.name in LENGTH_ARGS))
                                               for p in kernel.params])
    monkeypatch.setattr(launch.STATE, "params", {})
    pool = _HeldPool()
    monkeypatch.setattr(tuning.TUNER, "pool", pool)
    monkeypatch.setattr(tuning.TUNER, "jobs", {})
    asked = []
    real_launch = launch.launch_kernel

    def spy(kernel, grid, args, num_warps, num_stages, **constexprs):
        asked.append((kernel.fn.__name__, constexprs.get("EVEN_M"), constexprs.get("EVEN_N")))
        return real_launch(kernel, grid, args, num_warps, num_stages, **constexprs)

    monkeypatch.setattr(launch, "launch_kernel", spy)

    def call(n):
        del asked[:]
        q, k, v, bias, mask = make_inputs((1, 2), 2, n, n, 16, bias_shape=(1, 1, 2, n, n), mask_shape=(1, 2, 1, 1, n))
        out, _ = triton_attention(q, k, v, bias, mask, 0.3, False)
        torch.autograd.grad(out.sum(), [q, k, v, bias])
        return {(name, m, n_) for name, m, n_ in asked if m is not None}

    general = call(21)  # bucket 32, 16x16 tiles (tune off): masked tiles, the general variants
    assert general and all(not m and not n_ for _, m, n_ in general)
    plans = len(launch.STATE.plans)
    assert call(32) == general  # a multiple of 16: the EVEN variants are asked for, the general ones run
    assert len(pool.jobs) == len({name for name, *_ in general})
    assert len(launch.STATE.plans) == plans + 2  # forward + backward, kept with their pending compiles
    assert all(p.pending for p in list(launch.STATE.plans.values())[-2:])
    assert call(32) == set() and len(pool.jobs) == len(general)  # still compiling: replayed, nothing submitted
    pool.release(fail=fail)
    even = call(32)  # the compiles ended: recorded anew with the EVEN variants
    assert even and all(m and n_ for _, m, n_ in even) and len(launch.STATE.plans) == plans + 2
    assert not any(p.pending for p in launch.STATE.plans.values())
    del asked[:]
    call(32)  # replayed from its plan
    assert asked == []
