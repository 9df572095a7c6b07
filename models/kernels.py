"""Triton kernels of the memory-bounded inference path (forward only), each with a PyTorch fallback.

``layer_norm_rows`` normalises the rows of a pair chunk in one pass whatever its layout: a row chunk (contiguous),
a column chunk ``z[:, J]`` (strided rows) or a channels-first matmul output ``[C, M]`` (the channel stride is the
large one), writing a contiguous channels-last result. PyTorch's layer norm needs a contiguous input (a transposing
copy first) and runs one thread block per row, which is slow for the 64-384 channels of pair tensors.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

Tensor = torch.Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency; the fallback keeps CPU-only installs working
    triton = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _layer_norm_kernel(X, W, Bias, Y, M, B, C, sa, sb, sc, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
        """Rows ``m`` of a 3-d view ``[A, B, C]`` (strides ``sa, sb, sc``; ``m = a * B + b``) normalised over C
        into ``Y [M, C]`` contiguous, in float32."""
        pid = tl.program_id(0)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_c = tl.arange(0, BLOCK_C)
        row_ok = offs_m < M
        col_ok = offs_c < C
        ok = row_ok[:, None] & col_ok[None, :]
        a = offs_m // B
        b = offs_m - a * B
        # 64-bit offsets: a column chunk of a large pair tensor spans more than 2**31 elements
        row = a.to(tl.int64) * sa + b.to(tl.int64) * sb
        x = tl.load(X + row[:, None] + offs_c[None, :].to(tl.int64) * sc, mask=ok, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / C
        d = tl.where(ok, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / C + eps)
        y = d * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + offs_c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(Bias + offs_c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m.to(tl.int64)[:, None] * C + offs_c[None, :], y.to(Y.dtype.element_ty), mask=ok)


def _as_3d(x: Tensor, channels_first: bool):
    """(A, B, C, sa, sb, sc) of ``x`` read as rows ``[A, B]`` of C channels, or None if no such view exists."""
    if channels_first:  # [C, *rows]: the rows must flatten to one stride-1 dimension
        if x.dim() < 2:
            return None
        rows = x[0]
        if not rows.is_contiguous():
            return None
        return 1, rows.numel(), x.shape[0], 0, 1, x.stride(0)
    if x.dim() == 1:
        return 1, 1, x.shape[0], 0, 0, x.stride(0)
    lead = x.shape[:-1]
    # merge the leading dims into at most two strided ones (a column chunk [N, R, C] keeps two)
    dims = [(s, st) for s, st in zip(lead, x.stride()[:-1]) if s != 1]
    merged: list = []
    for s, st in reversed(dims):
        if merged and merged[0][1] * merged[0][0] == st:
            merged[0] = (merged[0][0] * s, merged[0][1])
        else:
            merged.insert(0, (s, st))
    if len(merged) > 2:
        return None
    while len(merged) < 2:
        merged.insert(0, (1, 0))
    (a, sa), (b, sb) = merged
    return a, b, x.shape[-1], sa, sb, x.stride(-1)


def layer_norm_rows(x: Tensor, norm: nn.LayerNorm, channels_first: bool = False,
                    out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``norm(x)`` (a last-dim LayerNorm), or with ``channels_first`` of ``x [C, *rows]`` moved to channels-last:
    a contiguous ``[*rows, C]``. ``out_dtype`` defaults to the autocast dtype under autocast, else x's.

    Triton on CUDA (any row strides, one pass, float32 statistics); elsewhere the module itself."""
    dev = x.device.type
    if out_dtype is None:
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    rows_shape = x.shape[1:] if channels_first else x.shape[:-1]
    view = _as_3d(x, channels_first) if triton is not None and dev == "cuda" and not _interpreting() else None
    if view is None or not isinstance(norm, nn.LayerNorm) or tuple(norm.normalized_shape) != (view[2],):
        y = norm(x.movedim(0, -1) if channels_first else x)
        return y.to(out_dtype).contiguous()
    return _launch(x, norm, view, rows_shape, out_dtype)


def _launch(x: Tensor, norm: nn.LayerNorm, view, rows_shape, out_dtype: torch.dtype) -> Tensor:
    a, b, c, sa, sb, sc = view
    m = a * b
    y = torch.empty(*rows_shape, c, dtype=out_dtype, device=x.device)
    if m == 0:
        return y
    block_c = triton.next_power_of_2(c)
    block_m = max(1, min(64, 4096 // block_c))
    w, bias = norm.weight, norm.bias
    _layer_norm_kernel[(triton.cdiv(m, block_m),)](
        x, w if w is not None else x, bias if bias is not None else x, y, m, b, c, sa, sb, sc, norm.eps,
        HAS_W=w is not None, HAS_B=bias is not None, BLOCK_M=block_m, BLOCK_C=block_c)
    return y
