"""The ``triton`` backend: fused attention kernels with a broadcastable trainable bias and differentiable lse.

    from attn_ops.triton import triton_attention
    out, lse = triton_attention(q, k, v, bias, mask, scale, causal, deterministic=True, bwd="auto")

Layers (each one screen): ``common.py``/``forward.py``/``backward.py``/``dbias.py``/``segtable.py``/``norms.py``
(``@triton.jit`` kernels) -> ``launch.py`` (direct calls of Triton's compiled kernels; each geometry's launch plan,
replayed per call; stride and device helpers) with ``tuning.py`` (cached block-size choice, compile threads) ->
``passes.py`` (what each kernel is given: bias layout, tuner keys, the forward, backward and segment-table
records) -> ``op.py`` (``torch.library`` custom ops ``attn_zoo::triton_attn_fwd``/``_bwd`` with fake impls and
autograd for ``torch.compile``; a plain ``autograd.Function`` over the same bodies for eager calls; the segment-table
cache; the leading-dim canonicalisation in front of them).
"""
import torch

from .op import BWD_VARIANTS, clear_segment_tables, triton_attention, triton_lse_backward

SUPPORTED_HEAD_DIMS = (8, 256)  # (min, max) for D and Dv; any value in between (blocks padded to >= 16, a power of 2)
SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
BIAS_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
DETERMINISTIC_BWD = ("split",)  # with deterministic=True only: "fused" uses atomics for dq, and
# deterministic=False also sums a broadcast bias's gradient with atomics

__all__ = ["triton_attention", "triton_lse_backward", "clear_segment_tables", "SUPPORTED_HEAD_DIMS",
           "SUPPORTED_DTYPES", "BIAS_DTYPES", "BWD_VARIANTS", "DETERMINISTIC_BWD"]
