"""Hugging Face transformers: ``attn_ops.attention`` as a named implementation of transformers' attention registry.

``register()`` adds ``"attn_zoo"`` to ``AttentionInterface`` (the attention function) and to
``AttentionMaskInterface`` (the boolean ``[B, 1, Lq, Lk]`` masks transformers' SDPA path builds, True = attend);
``EsmForMaskedLM.from_pretrained(path, attn_implementation="attn_zoo")`` and ``model.set_attn_implementation`` then
run this op in every layer of any model written against the registry. ``patch(model)`` does the same for a model
already built and ``unpatch`` sets back the implementation it had: the config's implementation name changes, in
ESM-2 models (``EsmIntermediate``) the feed-forward's GELU, written there as ``x * 0.5 * (1 + erf(x / sqrt(2)))``
(four kernels and four saved tensors on the widest activation), runs as ``F.gelu``, the same erf function in one,
and ESM-2's and ESM C's self-attention (``EsmSelfAttention``, ``EsmcAttention``) compute q, k, v in one matmul and
rotate q and k (ESM C: after their layer norms) in one pass of ``models.kernels.rotary_qk``: the host issues a
third of the layer's attention launches, which is what a host-bound training step waits on.

The function serves: a padding mask (boolean, or an additive float mask, taken as a bias), causal attention
without a mask, grouped key/value heads, and packed rows: ``cu_seq_lens_q``/``cu_seq_lens_k`` keyword arguments
(what ``DataCollatorWithFlattening`` gives a model) become ``segment_ids``. It falls back, with a warning naming the
reason, to the model's own eager attention for what it does not serve: ``output_attentions=True`` (the maps are
returned), attention dropout while training, ``softcap``, ``sliding_window``, attention sinks (``s_aux``).
"""
from __future__ import annotations

import inspect
import sys
import warnings
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

import attn_ops

from ..primitives import rotary_qkv
from .common import Options, original_forward

NAME = "attn_zoo"
LOOKS_FOR = ("transformers.PreTrainedModel whose layers call the attention registry (AttentionInterface)",)
_UNSERVED_KWARGS = ("softcap", "sliding_window", "s_aux")


def name_for(options: Options) -> str:
    """The registry name of these options: ``attn_zoo`` for the defaults, e.g. ``attn_zoo_triton_nondeterministic``."""
    parts = [NAME] + ([options.backend] if options.backend != "auto" else [])
    return "_".join(parts + ([] if options.deterministic else ["nondeterministic"]))


class HFAttention:
    """The registered attention function: ``(module, query, key, value, attention_mask, ...) -> (out, weights)``,
    q ``[B, H, Lq, D]``, k/v ``[B, Hkv, Lk, D]``, out ``[B, Lq, H, D]``; weights only on the eager fallback."""

    def __init__(self, options: Options):
        self.options = options
        self._warned = set()

    def _fallback(self, reason: str, module: nn.Module, query, key, value, attention_mask, dropout, scaling, kwargs):
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"attn_zoo attention: {reason}; served by the model's eager attention", stacklevel=3)
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None) or _eager
        if attention_mask is not None and attention_mask.dtype == torch.bool:  # eager paths add the mask
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    def __call__(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                 is_causal: Optional[bool] = None, **kwargs) -> Tuple[Tensor, Optional[Tensor]]:
        config = getattr(module, "config", None)
        reason = None
        if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
            reason = "output_attentions=True needs the attention maps"
        elif dropout and module.training:
            reason = f"attention dropout {dropout} while training"
        else:
            unserved = [k for k in _UNSERVED_KWARGS if kwargs.get(k) is not None]
            if unserved:
                reason = f"{', '.join(unserved)} is not served"
        if reason:
            return self._fallback(reason, module, query, key, value, attention_mask, dropout, scaling, kwargs)

        B, H, Lq, D = query.shape
        if key.shape[1] != H:  # grouped key/value heads
            if H % key.shape[1]:
                raise ValueError(f"query has {H} heads, key {key.shape[1]}: not a multiple")
            key = key.repeat_interleave(H // key.shape[1], dim=1)
            value = value.repeat_interleave(H // value.shape[1], dim=1)
        Lk = key.shape[2]
        bias = mask = None
        if attention_mask is not None:
            am = attention_mask[..., :Lk]
            if am.dtype == torch.bool:
                mask = am
            else:  # an additive mask (0 / large negative), as transformers' eager path adds it
                bias = am
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
        causal = causal and attention_mask is None and Lq > 1
        if causal and Lk > Lq:  # transformers' causal without a mask is aligned top-left (SDPA's is_causal)
            key, value = key[:, :, :Lq], value[:, :, :Lq]
        segment_ids = _segment_ids(kwargs, B, Lq, key.shape[2], query.device)
        if query.dtype != value.dtype or key.dtype != value.dtype:  # ESM C's float32 q/k norms beside autocast's v
            query, key = query.to(value.dtype), key.to(value.dtype)
        out = attn_ops.attention(query, key, value, bias=bias, mask=mask, scale=scaling, causal=causal,
                                 segment_ids=segment_ids, **self.options.kwargs())  # [B, H, Lq, Dv]
        return out.transpose(1, 2).contiguous(), None


def _segment_ids(kwargs: dict, B: int, Lq: int, Lk: int, device) -> Optional[object]:
    """Packed rows from ``cu_seq_lens_q``/``cu_seq_lens_k`` (cumulative lengths starting at 0, batch 1): ids
    ``[1, L]``, one per sequence, -1 after the last one."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    if B != 1:
        raise ValueError(f"cu_seq_lens_q/cu_seq_lens_k describe packed rows of batch 1; the query has batch {B}")

    def ids(cu: Tensor, L: int, name: str) -> Tensor:
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name}: expected cumulative lengths [n + 1] starting at 0, got shape {tuple(cu.shape)}")
        pos = torch.arange(L, device=device)
        seg = torch.searchsorted(cu[1:].to(device), pos, right=True)  # sequence index of each position
        return torch.where(pos < cu[-1].to(device), seg, torch.full_like(seg, -1))[None]  # [1, L]

    q_ids, k_ids = ids(cu_q, Lq, "cu_seq_lens_q"), ids(cu_k, Lk, "cu_seq_lens_k")
    return q_ids if cu_q is cu_k and Lq == Lk else (q_ids, k_ids)


def _eager(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
           dropout: float = 0.0, scaling: Optional[float] = None, **kwargs) -> Tuple[Tensor, Tensor]:
    """Plain attention returning the maps, for models whose module defines no ``eager_attention_forward``."""
    H = query.shape[1]
    key = key.repeat_interleave(H // key.shape[1], dim=1)
    value = value.repeat_interleave(H // value.shape[1], dim=1)
    w = torch.matmul(query, key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        w = w + attention_mask[..., : key.shape[2]]
    w = nn.functional.dropout(w.softmax(-1, dtype=torch.float32).to(query.dtype), p=dropout, training=module.training)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


def _key_mask_builder(sdpa_mask):
    """transformers' boolean mask builder, returning ``[B, 1, 1, Lk]`` where its ``[B, 1, Lq, Lk]`` mask is one
    row repeated (key padding in a bidirectional model, e.g. ESM): the kernels then read one row per batch instead
    of Lq x Lk bytes and skip padded key tiles. The comparison costs one host sync per forward (the builder runs
    once per forward, not per layer); under torch.compile or CUDA graph capture the full mask is kept."""

    def build(*args, **kwargs):
        mask = sdpa_mask(*args, **kwargs)
        if (isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[2] > 1
                and not torch.compiler.is_compiling()
                and not (mask.is_cuda and torch.cuda.is_current_stream_capturing())):  # no sync inside a capture
            row = mask[:, :, :1]
            if torch.equal(mask, row.expand_as(mask)):
                return row
        return mask

    return build


def register(backend: str = "auto", deterministic: bool = True) -> str:
    """Register the attention function (and the boolean mask builder) under :func:`name_for` these options;
    returns the name to pass as ``attn_implementation``. transformers' registry is the only state: a name already
    holding these options is left as it is."""
    from transformers import AttentionInterface, masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    options = Options(backend, deterministic)
    name = name_for(options)
    current = ALL_ATTENTION_FUNCTIONS.get(name)
    if not (isinstance(current, HFAttention) and current.options == options):
        AttentionInterface.register(name, HFAttention(options))
        if hasattr(masking_utils, "AttentionMaskInterface"):  # older versions build additive masks (served as bias)
            masking_utils.AttentionMaskInterface.register(name, _key_mask_builder(masking_utils.sdpa_mask))
    return name


def _pretrained_class():
    mod = sys.modules.get("transformers")
    if mod is None:  # a transformers model cannot exist before transformers is imported
        return None
    from transformers import PreTrainedModel

    return PreTrainedModel


def find(model: nn.Module) -> List[nn.Module]:
    """The outermost transformers models in ``model`` (itself, or submodules of a wrapper of the user's)."""
    cls = _pretrained_class()
    if cls is None:
        return []
    found, inner = [], set()
    for m in model.modules():  # pre-order: an outer model comes before the models inside it
        if isinstance(m, cls) and id(m) not in inner:
            found.append(m)
            inner.update(id(sub) for sub in m.modules())
    return found


def intermediate_forward(mod: nn.Module, options: Options, hidden_states: Tensor) -> Tensor:
    return nn.functional.gelu(mod.dense(hidden_states))


# The rotary self-attention modules whose projections and rotation patching fuses: (module, class, parameters of
# the forward it was written against). Another signature means another forward: left to the registry alone.
_ROTARY_ATTENTION = (
    ("transformers.models.esm.modeling_esm", "EsmSelfAttention",
     ("self", "hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask",
      "position_embeddings", "kwargs")),
    ("transformers.models.esmc.modeling_esmc", "EsmcAttention",
     ("self", "hidden_states", "attention_mask", "position_embeddings", "kwargs")),
)


def _known_class(module: str, name: str, params: Tuple[str, ...]) -> Optional[type]:
    cls = getattr(sys.modules.get(module), name, None)
    if cls is None or tuple(inspect.signature(cls.forward).parameters) != params:
        return None
    return cls


def _intermediate_class() -> Optional[type]:
    """transformers' ESM ``EsmIntermediate`` (dense then the erf GELU), if imported and of the known signature."""
    return _known_class("transformers.models.esm.modeling_esm", "EsmIntermediate", ("self", "hidden_states"))


def _rotary_attention(mod: nn.Module, x: Tensor, projections, norms, q_scale: float, position_embeddings,
                      attention_mask: Optional[Tensor], dropout: float, scaling: float, kwargs: dict):
    """q, k, v of ``x`` in one matmul, then q and k (layer-normed first where ``norms`` are given) rotated and q
    scaled in one pass (``models.primitives.rotary_qkv``), then the model's configured
    attention function: the module's own computation in a third of its launches."""
    heads = getattr(mod, "num_attention_heads", None) or mod.config.num_attention_heads
    cos, sin = (t.float().contiguous() for t in position_embeddings)  # [B or 1, L, D]: the model's own tables
    if cos.dim() == 3 and cos.shape[0] == 1:
        cos, sin = cos[0], sin[0]
    q, k, v = rotary_qkv(x, projections, cos, sin, heads, norms, q_scale)  # [B, H, L, D] each

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(mod.config._attn_implementation, _eager)
    out, weights = attention(mod, q, k, v, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return out.reshape(*x.shape[:-1], -1).contiguous(), weights


def esm_self_attention_forward(mod: nn.Module, options: Options, hidden_states: Tensor,
                               attention_mask: Optional[Tensor] = None, encoder_hidden_states=None,
                               encoder_attention_mask=None, position_embeddings=None, **kwargs):
    """``EsmSelfAttention.forward``: q scaled by ``D^-0.5`` and rotated (ESM's order; the same map scaled after),
    attention at scale 1. Cross-attention and absolute positions run the module's own forward."""
    if encoder_hidden_states is not None or mod.position_embedding_type != "rotary" or position_embeddings is None:
        return original_forward(mod)(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                     position_embeddings, **kwargs)
    dropout = mod.dropout if mod.training else 0.0
    return _rotary_attention(mod, hidden_states, [mod.query, mod.key, mod.value], None,
                             mod.attention_head_size ** -0.5, position_embeddings, attention_mask, dropout,
                             mod.scaling, kwargs)


def esmc_attention_forward(mod: nn.Module, options: Options, hidden_states: Tensor,
                           attention_mask: Optional[Tensor] = None, position_embeddings=None, **kwargs):
    """``EsmcAttention.forward``: q and k layer-normed over the width (float32 statistics, no rounding between the
    norm and the rotation), rotated, then the output projection."""
    out, weights = _rotary_attention(mod, hidden_states, [mod.q_proj, mod.k_proj, mod.v_proj],
                                     [mod.q_norm, mod.k_norm], 1.0, position_embeddings, attention_mask,
                                     mod.attention_dropout if mod.training else 0.0, mod.scaling, kwargs)
    return mod.o_proj(out), weights


def _fusable(m: nn.Module, name: str) -> bool:
    """Whether this rotary attention module has the layout the fused forward computes: q, k, v of one width (no
    grouped key/value heads), ESM C's norms affine without bias and of one eps."""
    if name == "EsmSelfAttention":
        return m.query.out_features == m.key.out_features == m.value.out_features
    projs = (m.q_proj, m.k_proj, m.v_proj)
    norms = (m.q_norm, m.k_norm)
    return (len({p.out_features for p in projs}) == 1 and m.q_proj.out_features == m.config.hidden_size
            and m.head_dim * m.config.num_attention_heads == m.q_proj.out_features
            and all(n.weight is not None and n.bias is None for n in norms) and norms[0].eps == norms[1].eps)


def patch_targets(models: List[nn.Module]) -> List[Tuple[nn.Module, object]]:
    """The modules of ``models`` (found by :func:`find`) whose forward is replaced beside the attention function:
    ESM-2's GELU, and ESM-2's / ESM C's self-attention (fused projections and rotation)."""
    known = [(_intermediate_class(), "EsmIntermediate", intermediate_forward)]
    known += [(_known_class(mod, name, params), name, fn) for (mod, name, params), fn in
              zip(_ROTARY_ATTENTION, (esm_self_attention_forward, esmc_attention_forward))]
    return [(m, fn) for model in models for m in model.modules() for cls, name, fn in known
            if cls is not None and isinstance(m, cls) and type(m).forward is cls.forward
            and (fn is intermediate_forward or _fusable(m, name))]


_PREVIOUS = "_attn_zoo_previous_attn_implementation"


def patch_model(model: nn.Module, options: Options) -> None:
    if not model._can_set_attn_implementation():
        raise TypeError(f"{type(model).__name__} does not select its attention through transformers' "
                        "AttentionInterface, so attn_implementation cannot route it to attn_zoo")
    name = register(options.backend, options.deterministic)
    if _PREVIOUS not in model.__dict__:
        model.__dict__[_PREVIOUS] = model.config._attn_implementation
    model.set_attn_implementation(name)


def is_patched(model: nn.Module) -> bool:
    return _PREVIOUS in model.__dict__ or str(model.config._attn_implementation).startswith(NAME)


def unpatch_model(model: nn.Module) -> bool:
    """Set back the implementation the model had before :func:`patch_model` (``sdpa`` for a model loaded with
    ``attn_implementation="attn_zoo"``, where no earlier one is known)."""
    if _PREVIOUS in model.__dict__:
        model.set_attn_implementation(model.__dict__.pop(_PREVIOUS))
        return True
    if str(model.config._attn_implementation).startswith(NAME):
        model.set_attn_implementation("sdpa")
        return True
    return False
