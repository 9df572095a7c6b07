"""fair-esm (``esm.multihead_attention.MultiheadAttention``, the attention of ESM-2 and ESM-1b layers) on
``attn_ops.attention``.

The patched forward computes what fair-esm's own does (projections, query scaling, rotary embedding, key padding
mask, an additive ``attn_mask``) with the fused op, and returns no attention weights. Served by fair-esm's own
forward (the exact path), unchanged: ``need_head_weights`` (the per-head maps behind ``return_contacts``),
incremental decoding state, ``static_kv``, ``before_softmax``, ``bias_k``/``bias_v``, ``add_zero_attn``, attention
dropout while training, and a non-float ``attn_mask``. The head-averaged weights that ``need_weights=True`` alone
asks for (ESM layers ask for them and discard them) are not computed: the patched forward returns None for them.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

import attn_ops

from .common import Options, original_forward

LOOKS_FOR = ("esm.multihead_attention.MultiheadAttention (fair-esm)",)


def _classes() -> tuple:
    mod = sys.modules.get("esm.multihead_attention")  # no such module object can exist before it is imported
    return (mod.MultiheadAttention,) if mod is not None else ()


def find(model: nn.Module) -> List[nn.Module]:
    classes = _classes()
    return [m for m in model.modules() if classes and isinstance(m, classes)]


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
    q = mod.q_proj(query) * mod.scaling  # fair-esm scales q before the rotary embedding
    k = mod.k_proj(query if mod.self_attention else key)
    v = mod.v_proj(query if mod.self_attention else value)
    q = q.view(tgt_len, bsz * H, D).transpose(0, 1)  # [B*H, T, D], fair-esm's layout for its rotary embedding
    k = k.view(-1, bsz * H, D).transpose(0, 1)
    v = v.view(-1, bsz * H, D).transpose(0, 1)
    if mod.rot_emb is not None:
        q, k = mod.rot_emb(q, k)
        q, k = q.to(v.dtype), k.to(v.dtype)  # the fp32 rotary tables promote q, k under autocast; bmm would cast back
    src_len = k.shape[1]
    q, k, v = (t.view(bsz, H, -1, D) for t in (q, k, v))  # [B, H, L, D]
    mask = None
    if key_padding_mask is not None and key_padding_mask.dim() > 0:
        if tuple(key_padding_mask.shape) != (bsz, src_len):
            raise ValueError(f"key_padding_mask: expected shape {(bsz, src_len)} (True = padding), "
                             f"got {tuple(key_padding_mask.shape)}")
        mask = ~key_padding_mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, S], True = attend
    o = attn_ops.attention(q, k, v, bias=attn_mask, mask=mask, scale=1.0, **options.kwargs())  # [B, H, T, D]
    o = o.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)
    return mod.out_proj(o), None


def patch_targets(modules: List[nn.Module]) -> List[Tuple[nn.Module, object]]:
    return [(m, forward) for m in modules]
