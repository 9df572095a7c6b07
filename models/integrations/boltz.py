"""Boltz-1 and Boltz-2 attention on ``attn_ops.attention`` (layouts of boltz 2.2.1).

Patched in place, wherever they sit (Pairformer, MSA module's pair stack, template module, diffusion transformer):
- ``TriangleAttention`` (starting and ending node, ``boltz.model.layers.triangular_attention.attention``): the
  triangle bias ``[*, 1, H, I, J]`` is broadcast over the rows by the op, never expanded. With Boltz's own
  ``chunk_size`` argument (its inference setting) the rows are computed by chunks of ``chunk_size`` rows after the
  bias: the transient memory is one chunk's projections instead of Boltz's ``[chunk, H, J, J]`` logits.
  ``use_kernels`` is served by the op too (it selects cuequivariance in Boltz's own forward).
- ``AttentionPairBias`` of ``boltz.model.layers.attention`` (Boltz-1) and ``.attentionv2`` (Boltz-2): float32
  attention as Boltz computes it; a ``multiplicity > 1`` pair bias is broadcast over the diffusion samples instead
  of repeated.
Not patched: ``PairWeightedAveraging`` (the MSA module's pair-weighted averaging): its weights are a softmax of the
pair bias alone, shared by every MSA row, which Boltz already computes once; a fused op would recompute it per row.

Masks: Boltz adds ``-inf * (1 - mask)``; the op takes ``mask.bool()`` (Boltz's own kernel path does the same). A
query row with no key to attend (a padded row) gives 0 here, where Boltz gives an average over the masked keys;
real positions never read those rows (every later attention masks them as keys and the masked products zero them).
"""
from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

import attn_ops

from .common import Options, modules_of
from .openfold import triangle_core

LOOKS_FOR = (
    "boltz.model.layers.triangular_attention.attention.TriangleAttention (Boltz-1/2)",
    "boltz.model.layers.attention.AttentionPairBias (Boltz-1)",
    "boltz.model.layers.attentionv2.AttentionPairBias (Boltz-2)",
)


def _classes() -> Tuple[tuple, tuple]:
    """(triangle attention classes, attention-with-pair-bias classes) of the installed boltz, or empty."""
    # a module of a class can exist only once its module is imported: nothing is imported here
    tri = sys.modules.get("boltz.model.layers.triangular_attention.attention")
    apb = [sys.modules.get(f"boltz.model.layers.{name}") for name in ("attention", "attentionv2")]
    return ((tri.TriangleAttention,) if tri else ()), tuple(m.AttentionPairBias for m in apb if m is not None)


def find(model: nn.Module) -> List[nn.Module]:
    tri, apb = _classes()
    return modules_of(model, tri + apb)


def patch_targets(modules: List[nn.Module]) -> List[Tuple[nn.Module, object]]:
    tri, _ = _classes()
    v2 = sys.modules.get("boltz.model.layers.attentionv2")
    out = []
    for m in modules:
        if isinstance(m, tri):
            out.append((m, triangle_attention))
        elif v2 is not None and isinstance(m, v2.AttentionPairBias):
            out.append((m, attention_pair_bias_v2))
        else:
            out.append((m, attention_pair_bias_v1))
    return out


# --------------------------------------------------------------------------------------------------
# Triangle attention (AF2 Alg. 13/14 as Boltz writes it)
# --------------------------------------------------------------------------------------------------
def triangle_attention(mod: nn.Module, options: Options, x: Tensor, mask: Optional[Tensor] = None,
                       chunk_size: Optional[int] = None, use_kernels: bool = False) -> Tensor:
    """Boltz's ``TriangleAttention.forward``: ``x [*, I, J, C_in]``, ``mask [*, I, J]`` (OpenFold's module)."""
    return triangle_core(mod, options, x, mask, chunk_size)


# --------------------------------------------------------------------------------------------------
# Single attention with pair bias (AF3 Alg. 24 as Boltz writes it)
# --------------------------------------------------------------------------------------------------
def _pair_bias_attention(mod: nn.Module, options: Options, s: Tensor, k_in: Tensor, bias: Tensor, mask: Tensor,
                         multiplicity: int) -> Tensor:
    """Boltz's attention core: float32 q/k/v (autocast off, as Boltz computes it), gate, output projection.
    ``s [B, Lq, c_s]``, ``k_in [B, Lk, c_s]``, ``bias [B/m, H, Lq, Lk]``, ``mask [B, Lk]``."""
    B, H, D = s.shape[0], mod.num_heads, mod.head_dim
    if not isinstance(multiplicity, int) or multiplicity < 1 or B % multiplicity:
        raise ValueError(f"multiplicity must be a positive int dividing the batch {B}, got {multiplicity!r}")
    if mask.shape[0] != B or mask.shape[-1] != k_in.shape[1]:
        raise ValueError(f"mask: expected shape {(B, k_in.shape[1])}, got {tuple(mask.shape)}")
    q = mod.proj_q(s).view(B, -1, H, D)
    k = mod.proj_k(k_in).view(B, -1, H, D)
    v = mod.proj_v(k_in).view(B, -1, H, D)
    g = mod.proj_g(s).sigmoid()
    m = multiplicity
    with torch.autocast("cuda", enabled=False):
        # [B/m, m, H, L, D]: the pair bias [B/m, 1, H, Lq, Lk] is shared by the m samples without a copy
        qf, kf, vf = (t.float().transpose(1, 2).unflatten(0, (B // m, m)) for t in (q, k, v))
        keys = mask.bool().view(B // m, m, 1, 1, -1)
        o = attn_ops.attention(qf, kf, vf, bias=bias.float().unsqueeze(1), mask=keys, scale=D ** -0.5,
                               **options.kwargs())  # [B/m, m, H, Lq, D]
        o = o.flatten(0, 1).transpose(1, 2).to(v.dtype)  # [B, Lq, H, D]
    return mod.proj_o(g * o.reshape(B, -1, mod.c_s))


def attention_pair_bias_v2(mod: nn.Module, options: Options, s: Tensor, z: Tensor, mask: Tensor, k_in: Tensor,
                           multiplicity: int = 1) -> Tensor:
    """Boltz-2's ``AttentionPairBias.forward`` (``boltz.model.layers.attentionv2``: Pairformer, diffusion
    transformer): keys given, ``proj_z`` a projection or (``compute_pair_bias=False``) the bias itself."""
    return _pair_bias_attention(mod, options, s, k_in, mod.proj_z(z), mask, multiplicity)


def attention_pair_bias_v1(mod: nn.Module, options: Options, s: Tensor, z: Tensor, mask: Tensor,
                           multiplicity: int = 1, to_keys=None, model_cache=None) -> Tensor:
    """Boltz-1's ``AttentionPairBias.forward`` (``boltz.model.layers.attention``: trunk Pairformer, diffusion
    transformer): an initial norm, keys through ``to_keys`` (windowed atom attention), a cached pair bias."""
    if mod.initial_norm:
        s = mod.norm_s(s)
    if to_keys is not None:
        k_in = to_keys(s)
        mask = to_keys(mask.unsqueeze(-1)).squeeze(-1)
    else:
        k_in = s
    if model_cache is None or "z" not in model_cache:
        z = mod.proj_z(z)
        if model_cache is not None:
            model_cache["z"] = z
    else:
        z = model_cache["z"]
    return _pair_bias_attention(mod, options, s, k_in, z, mask, multiplicity)
