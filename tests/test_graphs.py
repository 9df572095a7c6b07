"""models.graphs.CUDAGraphs: one capture per input signature, LRU eviction, results that behave like the module's.

On the CPU a stand-in for ``torch.cuda.make_graphed_callables`` records each capture and, like the real one, sets the
module's forward and hands out its outputs and gradients in buffers it rewrites at every call (the gradients already
at the next forward): the wrapper must give copies. The GPU test runs the real capture against the plain eager block."""
import copy

import pytest
import torch

from attn_zoo.models import graphs
from attn_zoo.models.graphs import CUDAGraphs
from attn_zoo.models.pairformer import PairformerBlock

from test_primitives import randomize_

W = dict(c_s=32, c_z=8, num_heads_single=2, num_heads_pair=2, c_hidden_pair=16, c_hidden_mul=8, transition_n=2)


class _Reused(torch.autograd.Function):
    """Identity whose outputs and input gradients are written into fixed buffers (as a replayed graph's are)."""

    @staticmethod
    def forward(ctx, bufs, *xs):
        ctx.bufs = bufs
        outs = []
        for i, x in enumerate(xs):
            key = ("out", i)
            if key not in bufs or bufs[key].shape != x.shape:
                bufs[key] = torch.empty_like(x)
            bufs[key].copy_(x)
            outs.append(bufs[key].detach())
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        res = []
        for i, g in enumerate(gs):
            key = ("grad", i)
            if g is None:
                res.append(None)
                continue
            if key not in ctx.bufs or ctx.bufs[key].shape != g.shape:
                ctx.bufs[key] = torch.empty_like(g)
            ctx.bufs[key].copy_(g)
            res.append(ctx.bufs[key].detach())
        return (None,) + tuple(res)


class _StandIn:
    """Records captures; sets ``module.forward`` to the module's own forward with every output and every parameter's
    and input's gradient routed through reused buffers."""

    def __init__(self):
        self.captures = []

    def __call__(self, module, args, num_warmup_iters=3):
        assert not (torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled())  # as the real one checks
        self.captures.append(tuple(a.shape for a in args))
        with torch.no_grad():  # the real one runs warm-up iterations and the capture here, inside the caller's context
            module(*args)
        bufs_in, bufs_out = {}, {}
        names = [n for n, _ in module.named_parameters()]
        samples = list(args)
        grad_idx = [i for i, x in enumerate(args) if x.requires_grad]
        for j, i in enumerate(grad_idx):  # the graph's input buffers are the sample tensors themselves
            bufs_in[("out", j)] = samples[i]

        def new_fwd(*a):
            # later inputs are copied into the samples; the inputs and parameters enter through reused buffers, so
            # their gradients come back in them (the wrapper has put the module's own forward back by now:
            # functional_call runs that one)
            with torch.no_grad():
                # the real forward graph's temporaries share one memory pool with the backward's gradient outputs:
                # a replay rewrites what the last backward handed out
                for key, buf in bufs_in.items():
                    if key[0] == "grad":
                        buf.fill_(float("nan"))
                for i, x in enumerate(a):
                    if i not in grad_idx and samples[i].data_ptr() != x.data_ptr():
                        samples[i].copy_(x)
            ins = iter(_Reused.apply(bufs_in, *[a[i] for i in grad_idx], *module.parameters()))
            xs = [next(ins) if i in grad_idx else samples[i] for i in range(len(a))]
            out = torch.func.functional_call(module, dict(zip(names, ins)), tuple(xs))
            res = _Reused.apply(bufs_out, *(out if isinstance(out, tuple) else (out,)))
            return res if isinstance(out, tuple) else res[0]  # (a module returning one tensor gets one back)

        module.forward = new_fwd
        return module


@pytest.fixture
def stand_in(monkeypatch):
    s = _StandIn()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", s)
    monkeypatch.setattr(graphs, "CAPTURE_DEVICES", ("cuda", "cpu"))
    return s


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, n, W["c_s"], generator=g, requires_grad=True)
    z = torch.randn(1, n, n, W["c_z"], generator=g, requires_grad=True)
    real = torch.ones(1, n, dtype=torch.bool)
    real[:, -2:] = False
    return s, z, real, real[:, :, None] & real[:, None, :]


def _step(block, n, seed, backward_passes=1):
    """Outputs (copies), input gradients (copies) and parameter gradients after ``backward_passes`` passes."""
    outs = []
    for i in range(backward_passes):
        s, z, single, pair = _inputs(n, seed + 100 * i)  # other inputs: gradients that differ between the passes
        out = block(s, z, single, pair)
        (out[0].square().sum() + out[1].sin().sum()).backward()
        outs.append((out, s.grad, z.grad))
    return outs, {k.removeprefix("module."): p.grad.clone() for k, p in block.named_parameters() if p.grad is not None}


def test_captures_per_signature_with_lru_and_same_results(stand_in):
    torch.manual_seed(0)
    plain = randomize_(PairformerBlock(**W, pair_dropout=0.0, attention="torch"))
    wrapped = CUDAGraphs(copy.deepcopy(plain), max_graphs=2)
    for n in (9, 11, 9, 13, 9, 11):
        plain.zero_grad(set_to_none=True)
        wrapped.zero_grad(set_to_none=True)
        (want, want_g), (got, got_g) = _step(plain, n, n), _step(wrapped, n, n)
        for (wo, ws, wz), (go, gs, gz) in zip(want, got):
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(wo + (ws, wz), go + (gs, gz)))
        assert want_g.keys() == got_g.keys()
        assert all(torch.allclose(want_g[k], got_g[k], atol=1e-6) for k in want_g)
    # 9 and 11 captured; 9 replayed; 13 evicted 11 (least recently used); 9 replayed; 11 captured again
    assert stand_in.captures == [((1, 9, 32), (1, 9, 9, 8), (1, 9), (1, 9, 9)),
                                 ((1, 11, 32), (1, 11, 11, 8), (1, 11), (1, 11, 11)),
                                 ((1, 13, 32), (1, 13, 13, 8), (1, 13), (1, 13, 13)),
                                 ((1, 11, 32), (1, 11, 11, 8), (1, 11), (1, 11, 11))]
    assert wrapped.num_graphs == 2
    assert "forward" not in wrapped.module.__dict__  # the module's own forward is left in place


def test_outputs_and_gradients_are_not_the_replay_buffers(stand_in):
    """Outputs kept from one call survive the next; two backward passes accumulate (the buffers would double)."""
    torch.manual_seed(0)
    plain = randomize_(PairformerBlock(**W, pair_dropout=0.0, attention="torch"))
    wrapped = CUDAGraphs(copy.deepcopy(plain))
    want, want_g = _step(plain, 9, 1, backward_passes=2)
    got, got_g = _step(wrapped, 9, 1, backward_passes=2)
    first = got[0][0][1].detach().clone()
    _step(wrapped, 9, 2)  # another replay rewrites the buffers
    assert torch.equal(got[0][0][1].detach(), first)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want[0][0] + want[0][1:], got[0][0] + got[0][1:]))
    assert all(torch.allclose(want_g[k], got_g[k], atol=1e-6) for k in want_g)


def test_train_eval_and_autocast_are_part_of_the_signature(stand_in):
    wrapped = CUDAGraphs(randomize_(PairformerBlock(**W, pair_dropout=0.0, attention="torch")), max_graphs=4)
    s, z, single, pair = _inputs(9, 0)
    wrapped(s, z, single, pair)
    wrapped.eval()
    wrapped(s, z, single, pair)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = wrapped(s, z, single, pair)
    assert out[1].dtype == torch.float32  # the block's residual stream keeps z's dtype
    assert len(stand_in.captures) == 3 and wrapped.num_graphs == 3
    wrapped.reset()
    assert wrapped.num_graphs == 0


def test_runs_the_module_where_it_cannot_capture(stand_in, monkeypatch):
    wrapped = CUDAGraphs(randomize_(PairformerBlock(**W, pair_dropout=0.0, attention="torch")))
    s, z, single, pair = _inputs(9, 0)
    want = wrapped.module(s, z, single, pair)
    with torch.no_grad():
        got = wrapped(s, z, single, pair)  # no backward to capture
    got2 = wrapped(s, z, single_mask=single, pair_mask=pair)  # keyword arguments
    monkeypatch.setattr(graphs, "CAPTURE_DEVICES", ("cuda",))
    got3 = wrapped(s, z, single, pair)  # a CPU tensor
    assert stand_in.captures == []
    for out in (got, got2, got3):
        assert all(torch.equal(a, b) for a, b in zip(want, out))


def test_inputs_stay_the_callers_and_two_forwards_before_a_backward(stand_in):
    """Later calls do not write into the capture call's inputs; a second call while the first awaits its backward
    runs the module itself (a replay would overwrite the first call's activations): gradients as without graphs."""
    torch.manual_seed(0)
    plain = randomize_(PairformerBlock(**W, pair_dropout=0.0, attention="torch"))
    wrapped = CUDAGraphs(copy.deepcopy(plain))
    first, second = _inputs(9, 1), _inputs(9, 2)
    results = []
    for block in (plain, wrapped):
        block.zero_grad(set_to_none=True)
        xs = [[t.detach().clone().requires_grad_(t.requires_grad) for t in inp] for inp in (first, second)]
        if block is wrapped:
            with pytest.warns(UserWarning, match="before the backward"):
                outs = [block(*x) for x in xs]
        else:
            outs = [block(*x) for x in xs]
        sum(o[0].square().sum() + o[1].sin().sum() for o in outs).backward()
        results.append([t.grad for x in xs for t in x[:2]] + [p.grad for p in block.parameters()])
    assert len(stand_in.captures) == 1
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*results))
    captured_with = xs[0]  # the wrapped block's capture call
    kept = [t.detach().clone() for t in captured_with]
    wrapped(*second)  # a replay with other inputs
    assert all(torch.equal(a, b) for a, b in zip(captured_with, kept))


def test_copies_start_without_captures_and_unfrozen_parameters_recapture(stand_in):
    torch.manual_seed(0)
    wrapped = CUDAGraphs(randomize_(PairformerBlock(**W, pair_dropout=0.0, attention="torch")))
    lin = wrapped.module.single_transition.linear_out
    lin.weight.requires_grad_(False)
    _step(wrapped, 9, 0)
    twin = copy.deepcopy(wrapped)
    assert wrapped.num_graphs == 1 and twin.num_graphs == 0
    _step(twin, 9, 0)  # its own capture, on its own parameters
    assert all(p.grad is not None for p in twin.parameters() if p.requires_grad)
    lin.weight.requires_grad_(True)
    wrapped.zero_grad(set_to_none=True)
    _, grads = _step(wrapped, 9, 0)
    assert len(stand_in.captures) == 3 and "single_transition.linear_out.weight" in grads
    plain = copy.deepcopy(wrapped.module)
    plain.zero_grad(set_to_none=True)
    _, want = _step(plain, 9, 0)
    assert all(torch.allclose(want[k], grads[k], atol=1e-6) for k in want)


def test_shared_gradient_memory_is_the_buffer_and_accumulates_right(stand_in):
    """share_grad_memory: a step's first gradients are the capture's buffers (no copy); accumulating over two backward
    passes, over steps without zeroing, and gradients kept between steps give what the plain block gives."""
    torch.manual_seed(0)
    plain = randomize_(PairformerBlock(**W, pair_dropout=0.0, attention="torch"))
    wrapped = CUDAGraphs(copy.deepcopy(plain), share_grad_memory=True)
    for block in (plain, wrapped):
        block.zero_grad(set_to_none=True)
    _, want = _step(plain, 9, 1)
    _, got = _step(wrapped, 9, 1)
    assert all(torch.allclose(want[k], got[k], atol=1e-6) for k in want)
    params = dict(wrapped.module.named_parameters())
    shared = [k for k in got if params[k].grad.data_ptr() == wrapped._shared.get(id(params[k]))]
    assert len(shared) == len(got)  # every gradient is its capture buffer: nothing was copied
    # no zeroing: the next step accumulates into the gradients, which the replay must not rewrite first
    _, want2 = _step(plain, 9, 5, backward_passes=2)
    _, got2 = _step(wrapped, 9, 5, backward_passes=2)
    assert all(torch.allclose(want2[k], got2[k], atol=1e-5) for k in want2)
    # zeroed to None: a kept gradient is a copy once the next call has run
    wrapped.zero_grad(set_to_none=True)
    _step(wrapped, 9, 7)
    kept = {k: p.grad for k, p in wrapped.module.named_parameters()}
    before = {k: g.clone() for k, g in kept.items()}
    wrapped.zero_grad(set_to_none=True)
    _step(wrapped, 9, 8)
    assert not all(torch.equal(kept[k], before[k]) for k in kept)  # (kept buffers are rewritten: documented)
    assert len(stand_in.captures) == 1
    # twice through one replay (retain_graph), then autograd.grad through it: .grad accumulates g1 + g2 and is
    # left alone by autograd.grad, as without graphs
    for block in (plain, wrapped):
        block.zero_grad(set_to_none=True)
    sums = []
    for block in (plain, wrapped):
        s, z, single, pair = _inputs(9, 11)
        out = block(s, z, single, pair)
        out[1].sin().sum().backward(retain_graph=True)
        out[0].square().sum().backward(retain_graph=True)
        torch.autograd.grad(out[1].cos().sum(), [z])
        sums.append({k.removeprefix("module."): p.grad.clone() for k, p in block.named_parameters()
                     if p.grad is not None})
    assert sums[0].keys() == sums[1].keys()
    assert all(torch.allclose(sums[0][k], sums[1][k], atol=1e-5) for k in sums[0])


def test_captures_pick_kernels_for_device_time(stand_in):
    """The capture runs inside kernels.device_bound (a replay has no host time): the layer-norm and bias-gradient
    kernels' row thresholds drop to DEVICE_BOUND_MIN_ROWS there, and only there."""
    from attn_zoo.models import kernels

    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            seen.append(kernels.min_rows(kernels.LAYER_NORM_MIN_ROWS))
            return (x * self.w,)

    wrapped = CUDAGraphs(Probe())
    x = torch.randn(2, 3, requires_grad=True)
    wrapped(x)[0].sum().backward()  # captured (the stand-in runs the module's forward inside the capture call)
    wrapped(x)[0].sum().backward()  # replayed
    assert len(stand_in.captures) == 1
    assert seen[-1] == kernels.LAYER_NORM_MIN_ROWS  # the replay's forward runs outside
    assert kernels.DEVICE_BOUND_MIN_ROWS in seen
    assert kernels.min_rows(kernels.LAYER_NORM_MIN_ROWS) == kernels.LAYER_NORM_MIN_ROWS
    with kernels.device_bound():
        assert kernels.min_rows(1 << 20) == kernels.DEVICE_BOUND_MIN_ROWS and kernels.min_rows(8) == 8
        # autograd's device threads run a capture's backward (and checkpoint recomputes): they see it too
        import threading

        got = []
        t = threading.Thread(target=lambda: got.append(kernels.min_rows(1 << 20)))
        t.start()
        t.join()
        assert got == [kernels.DEVICE_BOUND_MIN_ROWS]
    assert kernels.min_rows(1 << 20) == 1 << 20


@pytest.mark.parametrize("kw", [{"max_graphs": 0}, {"max_graphs": 1.5}, {"warmup_iters": 0}])
def test_bad_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        CUDAGraphs(torch.nn.Linear(2, 2), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("share", [False, True])
def test_cuda_graphs_equal_the_eager_block(share):
    """The real capture, bf16 autocast, the triton backend: outputs, input and parameter gradients bitwise the plain
    eager block's, with two backward passes accumulating, over two lengths taking turns (one is evicted and captured
    again); outputs kept from one step, and the inputs of every call, intact after the later replays."""
    torch.manual_seed(0)
    dev = "cuda"
    eager = randomize_(PairformerBlock(**W, pair_dropout=0.0, attention="triton"), seed=3).to(dev)
    wrapped = CUDAGraphs(copy.deepcopy(eager), max_graphs=1, share_grad_memory=share)
    kept, inputs = [], []
    for step, n in enumerate((37, 37, 45, 37)):
        res = []
        for block in (eager, wrapped):
            block.zero_grad(set_to_none=True)
            outs = []
            for i in range(2):
                s, z, single, pair = (t.to(dev) for t in _inputs(n, seed=10 * step + i))
                s, z = s.detach().requires_grad_(), z.detach().requires_grad_()
                inputs.append((z, z.detach().clone()))  # the caller's inputs stay theirs (no graph buffer)
                with torch.autocast(dev, dtype=torch.bfloat16, cache_enabled=False):
                    out_s, out_z = block(s, z, single, pair)
                (out_s.float().square().sum() + out_z.float().sin().sum()).backward()
                outs += [out_s.detach(), out_z.detach(), s.grad, z.grad]
            res.append(outs + [p.grad for p in block.parameters()])
        for i, (a, b) in enumerate(zip(*res)):
            assert torch.equal(a, b), (step, i)
        kept.append((res[1][1], res[1][1].clone()))
    assert all(torch.equal(a, b) for a, b in kept + inputs)
    assert wrapped.num_graphs == 1
