"""fair-esm (``esm.multihead_attention.MultiheadAttention``, the attention of ESM-2 and ESM-1b layers) on
``attn_ops.attention``.

The patched forward computes what fair-esm's own does (projections, query scaling, rotary embedding, key padding
mask, an additive ``attn_mask``) with the fused op, and returns no attention weights. Served by fair-esm's own
forward (the exact path), unchanged: ``need_head_weights`` (the per-head maps behind ``return_contacts``),
incremental decoding state, ``static_kv``, ``before_softmax``, ``bias_k``/``bias_v``, ``add_zero_attn``, attention
dropout while training, and a non-float ``attn_mask``. The head-averaged weights that ``need_weights=True`` alone
asks for (ESM layers ask for them and discard them) are not computed: the patched forward returns None for them.
Self-attention's q, k and v projections run as one matmul (``fused_linear``: the same weights, one read of x), and
the rotation of q and k as one pass of ``models.kernels.rotary_qk`` (``models.primitives.rotary_qkv``) on fair-esm's own cached tables (one Triton
launch each way on CUDA, where fair-esm's rotary embedding issues a dozen ops per tensor).

Each ``esm.modules.TransformerLayer`` is patched too: its feed-forward's GELU, written in fair-esm as
``x * 0.5 * (1 + erf(x / sqrt(2)))`` (four kernels and four saved tensors on the widest activation), runs as
``F.gelu``, the same erf function in one kernel. A layer whose forward does not have the signature patched here (a
fair-esm version that changed it) keeps its own.
"""
from __future__ import annotations

import inspect
import sys
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

import attn_ops

from ..primitives import fused_linear, rotary_qkv
from .common import Options, original_forward

LOOKS_FOR = ("esm.multihead_attention.MultiheadAttention (fair-esm)",)
# the forward of fair-esm's TransformerLayer that layer_forward reproduces
_LAYER_PARAMS = ("self", "x", "self_attn_mask", "self_attn_padding_mask", "need_head_weights")


def _classes() -> tuple:
    mod = sys.modules.get("esm.multihead_attention")  # no such module object can exist before it is imported
    return (mod.MultiheadAttention,) if mod is not None else ()


def _layer_class() -> Optional[type]:
    mod = sys.modules.get("esm.modules")
    cls = getattr(mod, "TransformerLayer", None)
    if cls is None or tuple(inspect.signature(cls.forward).parameters) != _LAYER_PARAMS:
        return None
    return cls


def find(model: nn.Module) -> List[nn.Module]:
    """The attention modules, then the layers whose GELU is fused (patched only where attention is)."""
    classes = _classes()
    attn = [m for m in model.modules() if classes and isinstance(m, classes)]
    layer = _layer_class()
    layers = [m for m in model.modules() if layer is not None and isinstance(m, layer)  # (not a subclass's forward)
              and type(m).forward is layer.forward] if attn else []
    return attn + layers


def _exact_path_reason(mod: nn.Module, key, value, incremental_state, static_kv, attn_mask, before_softmax,
                       need_head_weights) -> Optional[str]:
    if need_head_weights:
        return "need_head_weights asks for the attention maps"
    if incremental_state is not None or static_kv:
        return "incremental decoding state"
    if before_softmax:
        return "before_softmax asks for the logits"
    if mod.bias_k is not None or mod.add_zero_attn:
        return "bias_k/bias_v or add_zero_attn"
    if mod.training and mod.dropout > 0:
        return "attention dropout while training"
    if attn_mask is not None and not attn_mask.is_floating_point():
        return "a non-float attn_mask"
    if key is None or value is None:
        return "no key/value given"
    return None


def forward(mod: nn.Module, options: Options, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
            key_padding_mask: Optional[Tensor] = None, incremental_state=None, need_weights: bool = True,
            static_kv: bool = False, attn_mask: Optional[Tensor] = None, before_softmax: bool = False,
            need_head_weights: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """fair-esm's ``MultiheadAttention.forward`` (time-first ``[T, B, E]``) on the fused op."""
    if _exact_path_reason(mod, key, value, incremental_state, static_kv, attn_mask, before_softmax, need_head_weights):
        return original_forward(mod)(query, key, value, key_padding_mask=key_padding_mask,
                                     incremental_state=incremental_state, need_weights=need_weights,
                                     static_kv=static_kv, attn_mask=attn_mask, before_softmax=before_softmax,
                                     need_head_weights=need_head_weights)
    tgt_len, bsz, embed_dim = query.shape
    if embed_dim != mod.embed_dim:
        raise ValueError(f"query: expected embed_dim {mod.embed_dim} as its last dim, got shape {tuple(query.shape)}")
    H, D = mod.num_heads, mod.head_dim
    tables = getattr(mod.rot_emb, "_update_cos_sin_tables", None)  # fair-esm's own cached [1, T, D] tables
    # (ESM-2's layers build their attention without self_attention=True and pass the same tensor three times)
    self_attention = mod.self_attention or (key is query and value is query)
    if self_attention and tables is not None and mod.kdim == mod.vdim == embed_dim:
        # q, k, v in one matmul; q and k rotated (q scaled after the rotation: the same map) in one pass
        cos, sin = (t[0].float().contiguous() for t in tables(query, seq_dimension=0))  # [T, D]
        q, k, v = rotary_qkv(query, [mod.q_proj, mod.k_proj, mod.v_proj], cos, sin, H, q_scale=mod.scaling,
                             time_first=True)  # [B, H, T, D] each
        return _attend(mod, options, q, k, v, key_padding_mask, attn_mask, tgt_len, bsz, embed_dim)
    if self_attention:
        q, k, v = fused_linear(query, [mod.q_proj, mod.k_proj, mod.v_proj])
    else:
        q, k, v = mod.q_proj(query), mod.k_proj(key), mod.v_proj(value)
    q = q * mod.scaling  # fair-esm scales q before the rotary embedding
    q = q.view(tgt_len, bsz * H, D).transpose(0, 1)  # [B*H, T, D], fair-esm's layout for its rotary embedding
    k = k.view(-1, bsz * H, D).transpose(0, 1)
    v = v.view(-1, bsz * H, D).transpose(0, 1)
    if mod.rot_emb is not None:
        q, k = mod.rot_emb(q, k)
        q, k = q.to(v.dtype), k.to(v.dtype)  # the fp32 rotary tables promote q, k under autocast; bmm would cast back
    q, k, v = (t.view(bsz, H, -1, D) for t in (q, k, v))  # [B, H, L, D]
    return _attend(mod, options, q, k, v, key_padding_mask, attn_mask, tgt_len, bsz, embed_dim)


def _attend(mod: nn.Module, options: Options, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
            attn_mask: Optional[Tensor], tgt_len: int, bsz: int, embed_dim: int) -> Tuple[Tensor, None]:
    """The op on q, k, v ``[B, H, L, D]`` (q scaled) with fair-esm's key padding mask; the output projection."""
    src_len = k.shape[2]
    mask = None
    if key_padding_mask is not None and key_padding_mask.dim() > 0:
        if tuple(key_padding_mask.shape) != (bsz, src_len):
            raise ValueError(f"key_padding_mask: expected shape {(bsz, src_len)} (True = padding), "
                             f"got {tuple(key_padding_mask.shape)}")
        mask = ~key_padding_mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, S], True = attend
    o = attn_ops.attention(q, k, v, bias=attn_mask, mask=mask, scale=1.0, **options.kwargs())  # [B, H, T, D]
    o = o.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)
    return mod.out_proj(o), None


def layer_forward(mod: nn.Module, options: Options, x: Tensor, self_attn_mask: Optional[Tensor] = None,
                  self_attn_padding_mask: Optional[Tensor] = None, need_head_weights: bool = False):
    """fair-esm's ``TransformerLayer.forward`` (pre-LayerNorm attention, then the feed-forward) with ``F.gelu``;
    its own forward where the maps are asked for, so that contacts come out of fair-esm's computation bit for bit."""
    if need_head_weights:
        return original_forward(mod)(x, self_attn_mask, self_attn_padding_mask, need_head_weights)
    y = mod.self_attn_layer_norm(x)
    h, attn = mod.self_attn(query=y, key=y, value=y, key_padding_mask=self_attn_padding_mask, need_weights=True,
                            need_head_weights=need_head_weights, attn_mask=self_attn_mask)
    x = x + h
    return x + mod.fc2(nn.functional.gelu(mod.fc1(mod.final_layer_norm(x)))), attn


def patch_targets(modules: List[nn.Module]) -> List[Tuple[nn.Module, object]]:
    classes = _classes()
    return [(m, forward if isinstance(m, classes) else layer_forward) for m in modules]
