"""attn_ops: fused attention with a trainable broadcastable bias and a differentiable log-sum-exp.

Public API:
    attention(q, k, v, bias=None, mask=None, *, scale=None, causal=False, return_lse=False,
              backend="auto", deterministic=True, **options)
    merge_partials(outs, lses), blockwise_attention(...), ring_attention(...)
    backends(): the backends usable here.
"""
from . import registry
from .api import attention
from .merge import blockwise_attention, merge_partials
from .reference import attention_reference
from .ring import ring_attention, ring_positions, shard_sequence, unshard_sequence, zigzag_merge, zigzag_split


registry.warm_up()


def backends():
    """Names of the backends usable in this process (``auto`` picks among them)."""
    return registry.available()


__all__ = [
    "attention", "attention_reference", "backends", "blockwise_attention", "merge_partials", "registry",
    "ring_attention", "ring_positions", "shard_sequence", "unshard_sequence", "zigzag_merge", "zigzag_split",
]
