"""attn_ops: fused attention with a trainable broadcastable bias and a differentiable log-sum-exp.

Public API:
    attention(q, k, v, bias=None, mask=None, *, scale=None, causal=False, return_lse=False,
              backend="auto", deterministic=True, **options)
    merge_partials(outs, lses), blockwise_attention(...), ring_attention(...)
    backends(): the backends usable here.
    settings, kernel_settings(...): the triton kernels' switches (tuning, TMA, direct launch, cache folder).
    pretune(shapes, ...): time the triton kernels' tile configs for some shapes ahead of a run.
    compile_ahead(): a context in which throwaway calls compile the triton kernels of a run's shapes, all at once.
    wait_compiles(): wait for the triton kernels' background compiles (before timing a steady state).
"""
from . import registry, settings
from .api import attention
from .merge import blockwise_attention, merge_partials
from .pretune import compile_ahead, compiling_ahead, pretune, wait_compiles
from .reference import attention_reference
from .ring import ring_attention, ring_positions, shard_sequence, unshard_sequence, zigzag_merge, zigzag_split
from .settings import kernel_settings


registry.warm_up()


def backends():
    """Names of the backends usable in this process (``auto`` picks among them)."""
    return registry.available()


__all__ = [
    "attention", "attention_reference", "backends", "blockwise_attention", "compile_ahead", "compiling_ahead",
    "kernel_settings", "merge_partials", "pretune", "registry", "ring_attention", "ring_positions", "settings",
    "shard_sequence", "unshard_sequence", "wait_compiles",
    "zigzag_merge", "zigzag_split",
]
