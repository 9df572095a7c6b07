"""OpenFold3 (``openfold3`` on PyPI) attention on ``attn_ops.attention``.

Patched in place:
- ``openfold3.core.model.layers.triangular_attention.TriangleAttention`` (starting and ending node, AF3 Alg. 14/15),
  ``transpose_bias`` included (OpenFold3's ending node reads its bias off the untransposed pair);
- ``openfold3.core.model.layers.attention_pair_bias.AttentionPairBias`` (the trunk's single attention with pair
  bias, AF3 Alg. 24), ``use_high_precision_attention`` as float32 attention with autocast off;
- ``openfold3.core.model.layers.msa.MSAAttention`` (MSA row attention with pair bias, and the attention inside
  ``MSAColumnAttention``).
OpenFold3's attention modules are OpenFold's (``layer_norm``, ``mha`` with ``_prep_qkv``/``_wrap_up``), so the row
attention of ``openfold.py`` serves them; its kernel switches (``use_deepspeed_evo_attention``,
``use_cueq_triangle_kernels``, ``use_triton_triangle_kernels``, ``use_lma``) are all served by the op, and
``chunk_size`` bounds memory by computing rows in chunks. A query row with no key gives 0 where OpenFold3 averages
over its masked keys; no real position reads such rows. Not patched: the diffusion transformer's and the atom
encoder's attention (conditioned, windowed), ``GlobalAttention`` and ``MSAPairWeightedAveraging`` (no q.k scores).
"""
from __future__ import annotations

import contextlib
import sys
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

import attn_ops

from .common import Options, modules_of
from .openfold import msa_core, triangle_core

LOOKS_FOR = (
    "openfold3.core.model.layers.triangular_attention.TriangleAttention (OpenFold3)",
    "openfold3.core.model.layers.attention_pair_bias.AttentionPairBias (OpenFold3: trunk attention with pair bias)",
    "openfold3.core.model.layers.msa.MSAAttention (OpenFold3: MSA row attention with pair bias, MSA column attention)",
)
_PREFIX = "openfold3.core.model.layers."


def _classes() -> Tuple[tuple, tuple, tuple]:
    """(triangle, pair-bias, MSA) classes of the openfold3 modules already imported (none imported: nothing to find)."""
    tri, apb, msa = (sys.modules.get(_PREFIX + n) for n in ("triangular_attention", "attention_pair_bias", "msa"))
    return (((tri.TriangleAttention,) if tri else ()), ((apb.AttentionPairBias,) if apb else ()),
            ((msa.MSAAttention,) if msa else ()))


def find(model: nn.Module) -> List[nn.Module]:
    tri, apb, msa = _classes()
    return modules_of(model, tri + apb + msa)


def patch_targets(modules: List[nn.Module]) -> List[Tuple[nn.Module, object]]:
    tri, apb, _ = _classes()
    out = []
    for m in modules:
        if tri and isinstance(m, tri):
            out.append((m, triangle_attention))
        elif apb and isinstance(m, apb):
            out.append((m, attention_pair_bias))
        else:
            out.append((m, msa_attention))
    return out


def triangle_attention(mod: nn.Module, options: Options, x: Tensor, mask: Optional[Tensor] = None,
                       transpose_bias: bool = False, chunk_size: Optional[int] = None,
                       use_deepspeed_evo_attention: bool = False, use_cueq_triangle_kernels: bool = False,
                       use_triton_triangle_kernels: bool = False, use_lma: bool = False,
                       inplace_safe: bool = False) -> Tensor:
    """OpenFold3's ``TriangleAttention.forward`` (its bias projection is ``linear_z``)."""
    return triangle_core(mod, options, x, mask, chunk_size, linear=mod.linear_z, transpose_bias=transpose_bias)


def attention_pair_bias(mod: nn.Module, options: Options, a: Tensor, z: Tensor, mask: Optional[Tensor] = None,
                        use_deepspeed_evo_attention: bool = False, use_cueq_triangle_kernels: bool = False,
                        use_triton_triangle_kernels: bool = False, use_lma: bool = False,
                        use_high_precision_attention: bool = False) -> Tensor:
    """OpenFold3's ``AttentionPairBias.forward``: ``a [*, N, C_q]``, ``z [*, N, N, C_z]``, ``mask [*, N]``."""
    a = mod.layer_norm_a(a)
    if mask is None:
        mask = a.new_ones(a.shape[:-1])
    try:
        mask = mask.expand(*a.shape[:-1])
    except RuntimeError:
        raise ValueError(f"mask: expected shape {tuple(a.shape[:-1])} (a without channels), got "
                         f"{tuple(mask.shape)}") from None
    bias = mod.linear_z(mod.layer_norm_z(z)).movedim(-1, -3)  # [*, H, N, N]
    q, k, v = mod.mha._prep_qkv(a, a, apply_scale=False)  # [*, H, N, C]
    keys = mask.bool()[..., None, None, :]  # [*, 1, 1, N], True = attend
    high = use_high_precision_attention
    with torch.autocast(a.device.type, enabled=False) if high else contextlib.nullcontext():
        args = (q.float(), k.float(), v.float(), bias.float()) if high else (q, k, v, bias)
        o = attn_ops.attention(*args[:3], bias=args[3], mask=keys, scale=mod.mha.c_hidden ** -0.5,
                               **options.kwargs())
    return mod.mha._wrap_up(o.to(q.dtype).transpose(-2, -3), a)  # [*, N, H, C] -> [*, N, C_q]


def msa_attention(mod: nn.Module, options: Options, m: Tensor, z: Optional[Tensor] = None,
                  mask: Optional[Tensor] = None, chunk_size: Optional[int] = None,
                  use_deepspeed_evo_attention: bool = False, use_cueq_triangle_kernels: bool = False,
                  use_triton_triangle_kernels: bool = False, use_lma: bool = False, inplace_safe: bool = False,
                  _chunk_logits: Optional[int] = None, _checkpoint_chunks: Optional[bool] = None) -> Tensor:
    """OpenFold3's ``MSAAttention.forward`` (its ``_chunk_logits`` softmax chunking is served whole by the op)."""
    return msa_core(mod, options, m, z, mask, chunk_size)
