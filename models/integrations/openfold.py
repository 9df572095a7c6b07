"""OpenFold (aqlaboratory/openfold) attention on ``attn_ops.attention``; also the core of Boltz's triangle attention,
which is OpenFold's module (same attributes: ``layer_norm``, ``linear``, ``mha`` with ``_prep_qkv``/``_wrap_up``).

Patched in place:
- ``openfold.model.triangular_attention.TriangleAttention`` (starting and ending node, AF2 Alg. 13/14);
- ``openfold.model.msa.MSAAttention``: MSA row attention with pair bias (``MSARowAttentionWithPairBias``, Alg. 7)
  and the attention inside ``MSAColumnAttention`` (Alg. 8).
The pair / triangle bias ``[*, 1, H, N, N]`` is broadcast over rows by the op, never expanded; the MSA mask is
taken as ``mask.bool()``. ``chunk_size`` (OpenFold's inference chunking) bounds memory by computing rows in chunks
after the bias; OpenFold's kernel switches (``use_memory_efficient_kernel``, ``use_deepspeed_evo_attention``,
``use_lma``, ``use_flash``, ``_chunk_logits``) are all served by the op. A query row with no key gives 0 (OpenFold
averages over its masked keys); no real position reads such rows. Not patched: ``GlobalAttention`` (extra-MSA
column global attention: one mean query per column, nothing to fuse).

OpenFold is not on PyPI and imports a compiled extension (``attn_core_inplace_cuda``) at import time, so its tests
here run only where OpenFold is installed.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

import attn_ops

from .common import Options, fusable, layer_norm, modules_of
from ..primitives import fused_linear

LOOKS_FOR = (
    "openfold.model.triangular_attention.TriangleAttention (OpenFold)",
    "openfold.model.msa.MSAAttention (OpenFold: MSA row attention with pair bias, MSA column attention)",
)


def _classes() -> Tuple[tuple, tuple]:
    tri, msa = (sys.modules.get(f"openfold.model.{n}") for n in ("triangular_attention", "msa"))
    return ((tri.TriangleAttention,) if tri else ()), ((msa.MSAAttention,) if msa else ())


def find(model: nn.Module) -> List[nn.Module]:
    tri, msa = _classes()
    return modules_of(model, tri + msa)


def patch_targets(modules: List[nn.Module]) -> List[Tuple[nn.Module, object]]:
    tri, _ = _classes()
    return [(m, triangle_attention if tri and isinstance(m, tri) else msa_attention) for m in modules]


# --------------------------------------------------------------------------------------------------
# Shared: rows attending along themselves with one broadcast bias, optionally by chunks of rows
# --------------------------------------------------------------------------------------------------
def check_chunk_size(chunk_size) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _spans(n: int, chunk: int):
    return [slice(i, min(i + chunk, n)) for i in range(0, n, chunk)]


class RowAttention:
    """OpenFold's gated ``Attention`` (``mha``: ``_prep_qkv`` / ``_wrap_up``) on ``attn_ops.attention``, split as
    our ``Attention`` is (``project``, then ``attend``), so that the memory-bounded inference path of
    ``attn_zoo.models.inference`` (``triangle_attention_``) can run it by chunks of rows."""

    def __init__(self, mha: nn.Module, options: Options):
        self.mha, self.options = mha, options

    def project(self, q_x: Tensor, kv_x: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(q, k, v, q_x)``: q, k, v ``[*, H, L, C]``; the gate is OpenFold's, computed from ``q_x`` at the end."""
        q, k, v = self.mha._prep_qkv(q_x, kv_x, apply_scale=False)
        return q, k, v, q_x

    def attend(self, q: Tensor, k: Tensor, v: Tensor, q_x: Tensor, bias: Optional[Tensor], mask: Tensor) -> Tensor:
        """Bias broadcastable to ``[*, H, Lq, Lk]`` or None, ``mask`` (True or 1 = attend) likewise; returns
        ``[*, Lq, C_in]``."""
        o = attn_ops.attention(q, k, v, bias=bias, mask=mask.bool(), scale=self.mha.c_hidden ** -0.5,
                               **self.options.kwargs())  # [*, H, Lq, C]
        return self.mha._wrap_up(o.transpose(-2, -3), q_x)  # [*, Lq, H, C] -> [*, Lq, C_in]


def _rows(mha: nn.Module, options: Options, xn: Tensor, bias: Optional[Tensor], keys: Tensor) -> Tensor:
    """OpenFold's gated ``Attention`` over rows ``xn [*, R, J, C_in]`` (already layer-normed) along J; bias
    ``[*, 1, H, J, J]`` or None, keys ``[*, R, 1, 1, J]`` bool. Returns ``[*, R, J, C_in]``."""
    att = RowAttention(mha, options)
    return att.attend(*att.project(xn, xn), bias, keys)


def row_attention(mha: nn.Module, layer_norm: nn.Module, options: Options, x: Tensor, bias: Optional[Tensor],
                  mask: Tensor, chunk_size: Optional[int]) -> Tensor:
    """``mha(layer_norm(x))`` along the last-but-one dim of ``x [*, R, J, C]``, rows by chunks of ``chunk_size``
    (layer norm and projections per chunk: the transient memory is one chunk's)."""
    keys = mask.bool()[..., :, None, None, :]  # [*, R, 1, 1, J], True = attend
    n = x.shape[-3]
    if chunk_size is None or chunk_size >= n:
        return _rows(mha, options, layer_norm(x), bias, keys)
    parts, out = [], None
    for r in _spans(n, chunk_size):
        o = _rows(mha, options, layer_norm(x[..., r, :, :]), bias, keys[..., r, :, :, :])
        if torch.is_grad_enabled():
            parts.append(o)
            continue
        if out is None:
            out = o.new_empty(*x.shape[:-1], o.shape[-1])
        out[..., r, :, :] = o
    return torch.cat(parts, dim=-3) if parts else out


def pair_bias(z: Tensor, layer_norm: nn.Module, linear: nn.Module, chunk_size: Optional[int]) -> Tensor:
    """``linear(layer_norm(z))`` as ``[*, 1, H, I, J]``, by chunks of rows of z when ``chunk_size`` is given."""
    if chunk_size is None or chunk_size >= z.shape[-3]:
        b = linear(layer_norm(z))
    else:
        b = torch.cat([linear(layer_norm(z[..., r, :, :])) for r in _spans(z.shape[-3], chunk_size)], dim=-3)
    return b.movedim(-1, -3).unsqueeze(-4)


def triangle_core(mod: nn.Module, options: Options, x: Tensor, mask: Optional[Tensor],
                  chunk_size: Optional[int], linear: Optional[nn.Module] = None,
                  transpose_bias: bool = False) -> Tensor:
    """OpenFold's (and Boltz's, and OpenFold3's) ``TriangleAttention``: ``x [*, I, J, C_in]``, ``mask [*, I, J]``;
    ``linear``: the bias projection (None: ``mod.linear``); ``transpose_bias``: ``b[h, i, j]`` read at ``(j, i)``."""
    check_chunk_size(chunk_size)
    if mask is None:
        mask = x.new_ones(x.shape[:-1])
    if tuple(mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"mask: expected shape {tuple(x.shape[:-1])} (x without channels), got {tuple(mask.shape)}")
    if not mod.starting:
        x, mask = x.transpose(-2, -3), mask.transpose(-1, -2)
    linear = mod.linear if linear is None else linear
    mha = mod.mha
    gate = [] if mha.linear_g is None else [mha.linear_g]
    projections = [mha.linear_q, mha.linear_k, mha.linear_v] + gate + [linear]
    if (chunk_size is None or chunk_size >= x.shape[-3]) and fusable(x, projections):
        out = _fused_rows(mha, options, layer_norm(mod.layer_norm, x), mask, projections, transpose_bias)
        return out.transpose(-2, -3) if not mod.starting else out
    bias = pair_bias(x, mod.layer_norm, linear, chunk_size)  # [*, 1, H, I, J]
    if transpose_bias:
        bias = bias.transpose(-1, -2)
    out = row_attention(mod.mha, mod.layer_norm, options, x, bias, mask, chunk_size)
    return out.transpose(-2, -3) if not mod.starting else out


def _fused_rows(mha: nn.Module, options: Options, xn: Tensor, mask: Tensor, projections, transpose_bias: bool) -> Tensor:
    """The whole triangle attention of layer-normed rows ``xn [*, I, J, C_in]`` with one matmul for q, k, v, the gate
    and the triangle bias (``projections``, the last one the bias's), as our ``TriangleAttention`` computes it: the
    layer norm once, not once for the bias and once for the rows. Returns ``[*, I, J, C_in]``."""
    H, C = mha.no_heads, mha.c_hidden
    outs = fused_linear(xn, projections)
    q, k, v = (t.unflatten(-1, (H, C)).transpose(-2, -3) for t in outs[:3])  # [*, I, H, J, C]
    bias = outs[-1].movedim(-1, -3)  # [*, H, I, J]
    if transpose_bias:
        bias = bias.transpose(-1, -2)
    bias = bias.contiguous().unsqueeze(-4)  # [*, 1, H, J, K]: shared by all rows i
    keys = mask.bool()[..., :, None, None, :]  # [*, I, 1, 1, K], True = attend
    o = attn_ops.attention(q, k, v, bias=bias, mask=keys, scale=C ** -0.5, **options.kwargs())  # [*, I, H, J, C]
    o = o.transpose(-2, -3)  # [*, I, J, H, C]
    if mha.linear_g is not None:  # OpenFold's _wrap_up: sigmoid(linear_g(q_x)) per head, then the output projection
        o = o * torch.sigmoid(outs[3]).unflatten(-1, (H, C))
    return mha.linear_o(o.flatten(-2))


# --------------------------------------------------------------------------------------------------
# OpenFold's forwards
# --------------------------------------------------------------------------------------------------
def triangle_attention(mod: nn.Module, options: Options, x: Tensor, mask: Optional[Tensor] = None,
                       chunk_size: Optional[int] = None, use_memory_efficient_kernel: bool = False,
                       use_deepspeed_evo_attention: bool = False, use_lma: bool = False,
                       inplace_safe: bool = False) -> Tensor:
    """OpenFold's ``TriangleAttention.forward``."""
    return triangle_core(mod, options, x, mask, chunk_size)


def msa_attention(mod: nn.Module, options: Options, m: Tensor, z: Optional[Tensor] = None,
                  mask: Optional[Tensor] = None, chunk_size: Optional[int] = None,
                  use_memory_efficient_kernel: bool = False, use_deepspeed_evo_attention: bool = False,
                  use_lma: bool = False, use_flash: bool = False, inplace_safe: bool = False,
                  _chunk_logits: Optional[int] = None, _checkpoint_chunks: Optional[bool] = None) -> Tensor:
    """OpenFold's ``MSAAttention.forward``."""
    return msa_core(mod, options, m, z, mask, chunk_size)


def msa_core(mod: nn.Module, options: Options, m: Tensor, z: Optional[Tensor], mask: Optional[Tensor],
             chunk_size: Optional[int]) -> Tensor:
    """OpenFold's (and OpenFold3's) ``MSAAttention``: ``m [*, S, N, C_m]``, ``z [*, N, N, C_z]``, ``mask [*, S, N]``."""
    check_chunk_size(chunk_size)
    if mask is None:
        mask = m.new_ones(m.shape[:-1])
    if tuple(mask.shape) != tuple(m.shape[:-1]):
        raise ValueError(f"mask: expected shape {tuple(m.shape[:-1])} (m without channels), got {tuple(mask.shape)}")
    bias = None
    if mod.pair_bias and z is not None:
        bias = pair_bias(z, mod.layer_norm_z, mod.linear_z, 256)  # [*, 1, H, N, N]; OpenFold's own 256-row chunks
    return row_attention(mod.mha, mod.layer_norm_m, options, m, bias, mask, chunk_size)
