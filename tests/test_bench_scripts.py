"""The GPU benchmark scripts' backend tables, checked on CPU: a typo there only shows up on the GPU machine,
after device time is spent."""
import os
import sys

import pytest

from attn_ops import registry

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_blocks  # noqa: E402


@pytest.mark.parametrize("name", [b for b in bench_blocks.BACKENDS if not b.startswith("boltz")])
def test_every_block_bench_backend_maps_to_a_registered_backend(name):
    config = bench_blocks.attention_config(name)
    assert config["backend"] in registry.valid_names(), (name, config)
    assert set(config) <= {"backend", "deterministic"}, config


def test_block_bench_backend_options():
    """``-atomic`` and flex (whose bias gradient uses atomics) opt out of determinism; ``+compile`` changes nothing
    in the attention config."""
    assert bench_blocks.attention_config("triton") == {"backend": "triton"}
    assert bench_blocks.attention_config("triton-atomic+compile") == {"backend": "triton", "deterministic": False}
    assert bench_blocks.attention_config("flex+compile") == {"backend": "flex", "deterministic": False}
    assert bench_blocks.attention_config("torch+compile") == {"backend": "torch"}


def test_attention_bench_heads_last_inputs():
    """``--layout heads-last``: q, k, v are [B, R, H, L, D] views of [B, R, L, H, D] leaves (the blocks' layout); the
    step's gradients land on those leaves, and peers that cannot take the views are skipped, not failed."""
    import bench_attention

    B, R, H, L, D = 1, 3, 4, 5, 8
    q, k, v, bias, mask, leaves = bench_attention.bias_inputs(B, R, H, L, D, 2, heads_last=True, device="cpu")
    assert q.shape == (B, R, H, L, D) and q.stride()[2:] == (D, H * D, 1)
    assert all(t.is_leaf and t.requires_grad for t in leaves) and leaves[3] is bias
    assert leaves[0].shape == (B, R, L, H, D) and q._base is leaves[0]
    assert mask[..., -2:].any().item() is False and mask[..., :-2].all().item()
    q2, _, _, _, _, leaves2 = bench_attention.bias_inputs(B, R, H, L, D, 0, device="cpu")
    assert leaves2[0] is q2 and q2.is_contiguous()
    cases = {(be, skip is not None) for _, _, be, _, _, skip in bench_attention.bias_cases(
        ["MSA rows 1,512,8,384,32"], ["triton", "triton-atomic", "flex"], heads_last=True)}
    assert cases == {("triton", False), ("triton-atomic", False), ("flex", True)}


def test_attention_bench_heads_last_step_fills_leaf_grads(monkeypatch):
    """The bench's ``make`` for an attn_ops backend, run on a tiny shape on the CPU: the step's gradients reach the
    heads-last leaves (what ``do_bench(grad_to_none=...)`` resets)."""
    import functools

    import bench_attention

    monkeypatch.setitem(bench_attention.BIAS_SHAPES, "tiny", (1, 2, 2, 8, 16, 1))
    monkeypatch.setattr(bench_attention, "bias_inputs", functools.partial(bench_attention.bias_inputs, device="cpu"))
    for _, _, be, make, _, skip in bench_attention.bias_cases(["tiny"], ["torch", "chunked"], heads_last=True):
        assert skip is None
        run, leaves = make()
        out = run()
        out.float().sum().backward()
        assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves), be


def test_packed_bench_draws_rows_within_the_budget():
    """scripts/bench_packed.py: first-fit rows of log-normal lengths stay within the token budget, ids in order."""
    import bench_packed

    rows = bench_packed.draw_rows(2, 4096)
    assert all(sum(r) <= 4096 and all(16 <= n <= 1024 for n in r) for r in rows) and sum(map(len, rows)) >= 8
    ids = bench_packed.ids_of(rows[0], 4096, "cpu")
    assert ids[0] == 0 and ids[-1] == -1 and int(ids.max()) == len(rows[0]) - 1
