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
