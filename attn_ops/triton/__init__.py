"""The ``triton`` backend: fused attention kernels with a broadcastable trainable bias and differentiable lse.

    from attn_ops.triton import triton_attention
    out, lse = triton_attention(q, k, v, bias, mask, scale, causal, deterministic=True, bwd="auto")

Layers (each one screen): ``common.py``/``forward.py``/``backward.py``/``dbias.py`` (``@triton.jit`` kernels) ->
``launch.py`` (direct calls of Triton's compiled kernels; grids, strides, buffers; each geometry's launch plan,
replayed per call; the forward) and ``launch_backward.py`` (the backward's launches, on ``launch.py``'s plans) with
``tuning.py`` (cached block-size choice, compile threads) -> ``op.py`` (``torch.library``
custom ops ``attn_zoo::triton_attn_fwd``/``_bwd`` with fake impls and autograd for ``torch.compile``; a plain
``autograd.Function`` over the same bodies for eager calls) -> ``attention.py`` (leading-dim canonicalisation).
``segtable.py``: the segment-id tables of packed rows (one launch; cached per ids tensor by ``op.py``).
"""
import torch

from .attention import BWD_VARIANTS, triton_attention, triton_lse_backward
from .op import clear_segment_tables

SUPPORTED_HEAD_DIMS = (8, 256)  # (min, max) for D and Dv; any value in between (blocks padded to >= 16, a power of 2)
SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
BIAS_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
DETERMINISTIC_BWD = ("split",)  # with deterministic=True only: "fused" uses atomics for dq, and
# deterministic=False also sums a broadcast bias's gradient with atomics

__all__ = ["triton_attention", "triton_lse_backward", "clear_segment_tables", "SUPPORTED_HEAD_DIMS",
           "SUPPORTED_DTYPES", "BIAS_DTYPES", "BWD_VARIANTS", "DETERMINISTIC_BWD"]
