"""primitives.cast_weights: a block's linear weights cast once per forward under eager autocast.

The CPU stands in for CUDA here (``CAST_WEIGHTS_DEVICES`` gains "cpu"; CPU autocast casts to bf16 the same way):
outputs and every gradient must be bitwise those of autocast's own per-weight casts, with fewer casts."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attn_zoo.models import primitives
from attn_zoo.models.evoformer import EvoformerBlock
from attn_zoo.models.pairformer import PairformerBlock, PairformerStack

from test_primitives import randomize_

N = 10


def _pairformer(**kw):
    return PairformerBlock(c_s=32, c_z=16, num_heads_single=4, num_heads_pair=2, c_hidden_pair=8, c_hidden_mul=16,
                           attention="torch", **kw)


def _inputs(kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "evoformer":
        return [torch.randn(1, 5, N, 16, generator=g), torch.randn(1, N, N, 8, generator=g)]
    return [torch.randn(1, N, 32, generator=g), torch.randn(1, N, N, 16, generator=g)]


def _masks(kind):
    real = torch.ones(1, N, dtype=torch.bool)
    real[:, -3:] = False  # padded residues: masked rows and keys
    pair = real[:, :, None] & real[:, None, :]
    return (real[:, None, :].expand(1, 5, N).clone(), pair) if kind == "evoformer" else (real, pair)


class _Count(TorchDispatchMode):
    """Casts (``_to_copy``), casts of the given parameters themselves, multi-tensor copies."""

    def __init__(self, params=()):
        super().__init__()
        self.ids = {id(p) for p in params}
        self.casts = self.param_casts = self.foreach = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
            self.param_casts += id(args[0]) in self.ids
        elif "foreach_copy" in str(func):
            self.foreach += 1
        return func(*args, **(kwargs or {}))


def _step(model, kind, on, monkeypatch, backward_passes=1, autocast=True):
    """(outputs, input grads, parameter grads, dispatch counts) of ``backward_passes`` fwd+bwd in train mode."""
    monkeypatch.setattr(primitives, "CAST_WEIGHTS_DEVICES", ("cuda", "cpu") if on else ("cuda",))
    model.zero_grad(set_to_none=True)
    xs = [x.requires_grad_() for x in _inputs(kind)]
    count = _Count([p for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()])
    outs = None
    for _ in range(backward_passes):
        torch.manual_seed(1)  # the same dropout masks
        with count, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = model(*xs, *_masks(kind))
        with count:
            (outs[0].float().square().sum() + outs[1].float().sin().sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return [o.detach() for o in outs], [x.grad for x in xs], grads, count


def _assert_same(a, b):
    (outs_a, xg_a, pg_a, _), (outs_b, xg_b, pg_b, _) = a, b
    for u, v in zip(outs_a + xg_a, outs_b + xg_b):
        assert torch.equal(u, v), (u - v).abs().max()
    assert pg_a.keys() == pg_b.keys()
    for name in pg_a:
        u, v = pg_a[name], pg_b[name]
        assert (u is None) == (v is None), name
        assert u is None or torch.equal(u, v), (name, (u - v).abs().max())


@pytest.mark.parametrize("kind,kw", [
    ("pairformer", {}),
    ("pairformer", {"variant": "boltz2"}),  # single track with autocast off: the float32 weights there
    ("evoformer", {}),
])
def test_same_outputs_and_grads_fewer_casts(kind, kw, monkeypatch):
    torch.manual_seed(0)
    model = EvoformerBlock(c_m=16, c_z=8, attention="torch") if kind == "evoformer" else _pairformer(**kw)
    randomize_(model).train()
    off = _step(model, kind, False, monkeypatch)
    on = _step(model, kind, True, monkeypatch)
    _assert_same(off, on)
    assert off[3].foreach == 0 and on[3].foreach == 2  # the weights' cast and their gradients' cast back
    assert off[3].param_casts > 0 and on[3].param_casts == 0
    # each weight autocast cast (and its gradient's cast back) is gone, and no cast came in instead
    assert off[3].casts - on[3].casts >= 2 * off[3].param_casts


def test_frozen_weights_accumulation_and_checkpointing(monkeypatch):
    torch.manual_seed(0)
    model = PairformerStack(c_s=32, c_z=16, num_blocks=2, num_heads_single=4, num_heads_pair=2, c_hidden_pair=8,
                            c_hidden_mul=16, attention="torch", checkpoint_every=1)
    randomize_(model).train()
    frozen = model.blocks[0].tri_att_start.mha.linear_q.weight
    frozen.requires_grad_(False)
    off = _step(model, "pairformer", False, monkeypatch, backward_passes=2)
    on = _step(model, "pairformer", True, monkeypatch, backward_passes=2)
    _assert_same(off, on)  # two passes accumulate into .grad alike; checkpointed recomputes cast again
    assert on[2]["blocks.0.tri_att_start.mha.linear_q.weight"] is None
    assert on[3].foreach == 2 * 2 * 2 * 2  # 2 passes x 2 blocks x (forward + recompute) x (cast + cast back)


def test_inactive_without_autocast_and_under_no_grad(monkeypatch):
    model = randomize_(_pairformer()).train()
    plain = _step(model, "pairformer", True, monkeypatch, autocast=False)
    assert plain[3].foreach == 0 and plain[0][1].dtype == torch.float32
    monkeypatch.setattr(primitives, "CAST_WEIGHTS_DEVICES", ("cuda", "cpu"))
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(*_inputs("pairformer"), *_masks("pairformer"))
        count = _Count()
        with count:
            got = model(*_inputs("pairformer"), *_masks("pairformer"))
    assert count.foreach == 1  # cast without a graph
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    monkeypatch.setattr(primitives, "CAST_WEIGHTS_DEVICES", ("cuda",))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(torch.equal(a, b) for a, b in zip(ref, model(*_inputs("pairformer"), *_masks("pairformer"))))


def test_replaced_linear_is_used(monkeypatch):
    """A layer swapped in after a forward (the collected weights are per module) is the one that runs."""
    model = randomize_(_pairformer()).train()
    _step(model, "pairformer", True, monkeypatch)
    new = primitives.Linear(32, 32, bias=False)
    torch.nn.init.normal_(new.weight)
    model.attention_pair_bias.mha.linear_o = new
    on = _step(model, "pairformer", True, monkeypatch)
    off = _step(model, "pairformer", False, monkeypatch)
    _assert_same(off, on)
    assert on[2]["attention_pair_bias.mha.linear_o.weight"] is not None


def test_cast_param_outside_and_in_other_dtype(monkeypatch):
    monkeypatch.setattr(primitives, "CAST_WEIGHTS_DEVICES", ("cuda", "cpu"))
    lin = primitives.Linear(4, 6)
    assert primitives.cast_param(lin.weight) is lin.weight  # no enclosing cast_weights
    with torch.autocast("cpu", dtype=torch.bfloat16), primitives.cast_weights(lin):
        w = primitives.cast_param(lin.weight)
        assert w.dtype == torch.bfloat16 and torch.equal(w, lin.weight.to(torch.bfloat16))
        with torch.autocast("cpu", enabled=False):
            assert primitives.cast_param(lin.weight) is lin.weight
        with torch.autocast("cpu", dtype=torch.float16):
            assert primitives.cast_param(lin.weight) is lin.weight
    assert primitives.cast_param(lin.weight) is lin.weight


def test_unused_weight_gets_no_gradient(monkeypatch):
    """A linear inside the block that the forward does not use keeps ``grad`` None, as without the cast."""
    monkeypatch.setattr(primitives, "CAST_WEIGHTS_DEVICES", ("cuda", "cpu"))
    model = randomize_(_pairformer()).train()
    model.unused = primitives.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s, z = model(*[x.requires_grad_() for x in _inputs("pairformer")], *_masks("pairformer"))
    (s.float().sum() + z.float().sum()).backward()
    assert model.unused.weight.grad is None and model.unused.bias.grad is None
    assert model.tri_mul_out.linear_z.weight.grad is not None
