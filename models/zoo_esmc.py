"""ESM C weights from and to the Hugging Face port (``EsmcForMaskedLM`` / ``EsmcModel``) and the ``esm``
package's layout (``esm.models.esmc.ESMC``).

    model = from_esmc("esmc_300m_hf/")              # a save_pretrained folder, or a state_dict of either layout
    sd, config = to_esmc(model)                      # EsmcForMaskedLM(EsmcConfig(**config)).load_state_dict(sd)
    sd = to_esmc(model, layout="esm")                # esm.models.esmc.ESMC(...).load_state_dict(sd)

Sizes come from the weights; the number of heads from the config, else the published size of that width
(the weights do not hold it: q/k LayerNorms span the whole width), else ``num_heads``. Every problem raises one
``ZooCheckpointError`` naming the keys, before anything is built.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from .esmc import ALPHABET, ESMC, ESMC_CONFIGS, VOCAB_ROWS
from .zoo_files import ZooCheckpointError, _check_state, _first_keys, _hf_state, _shape

Tensor = torch.Tensor

_HF_LAYER = re.compile(r"^layers\.(\d+)\.")
_ESM_LAYER = re.compile(r"^transformer\.blocks\.(\d+)\.")
# ours (per layer) -> esm package (per block); q/k/v and gate/up are slices of one esm weight (dim 0)
_ESM_LAYER_MAP: Tuple[Tuple[str, str], ...] = (
    ("input_layernorm.weight", "attn.layernorm_qkv.0.weight"),
    ("input_layernorm.bias", "attn.layernorm_qkv.0.bias"),
    ("self_attn.o_proj.weight", "attn.out_proj.weight"),
    ("self_attn.q_norm.weight", "attn.q_ln.weight"),
    ("self_attn.k_norm.weight", "attn.k_ln.weight"),
    ("post_attention_layernorm.weight", "ffn.0.weight"),
    ("post_attention_layernorm.bias", "ffn.0.bias"),
    ("mlp.down_proj.weight", "ffn.3.weight"),
)
_ESM_FUSED = (("attn.layernorm_qkv.1.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight")),
              ("ffn.1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")))
_ESM_TOP = (("embed_tokens.weight", "embed.weight"), ("norm.weight", "transformer.norm.weight"),
            ("lm_head.dense.weight", "sequence_head.0.weight"), ("lm_head.dense.bias", "sequence_head.0.bias"),
            ("lm_head.layer_norm.weight", "sequence_head.2.weight"), ("lm_head.layer_norm.bias", "sequence_head.2.bias"),
            ("lm_head.decoder.weight", "sequence_head.3.weight"), ("lm_head.decoder.bias", "sequence_head.3.bias"))


def _config_dict(config: Any) -> Dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):  # transformers.EsmcConfig
        return config.to_dict()
    raise TypeError(f"config must be None, a dict or an EsmcConfig, got {type(config).__name__}")


def _from_esm_layout(sd: Mapping[str, Tensor], source: str) -> Dict[str, Tensor]:
    """The ``esm`` package's ESMC keys -> ours; every missing, unexpected or misshapen key reported at once."""
    layers = sorted({int(m.group(1)) for k in sd for m in [_ESM_LAYER.match(k)] if m})
    out: Dict[str, Tensor] = {}
    used, missing, bad = set(), [], []
    for ours, theirs in _ESM_TOP:
        used.add(theirs)
        if theirs in sd:
            out[ours] = sd[theirs]
        else:
            missing.append(theirs)
    for i in layers:
        p, q = f"transformer.blocks.{i}.", f"layers.{i}."
        for ours, theirs in _ESM_LAYER_MAP:
            used.add(p + theirs)
            if p + theirs in sd:
                out[q + ours] = sd[p + theirs]
            else:
                missing.append(p + theirs)
        for theirs, parts in _ESM_FUSED:
            used.add(p + theirs)
            w = sd.get(p + theirs)
            if w is None:
                missing.append(p + theirs)
            elif not isinstance(w, Tensor) or w.ndim != 2 or w.shape[0] % len(parts):
                bad.append(f"{p + theirs} {_shape(w)} (rows not divisible by {len(parts)})")
            else:
                for ours, piece in zip(parts, w.chunk(len(parts), dim=0)):
                    out[q + ours] = piece
    unexpected = sorted(set(sd) - used)
    problems = ([f"missing keys {sorted(missing)}"] if missing else []) + (
        [f"unexpected keys {unexpected}"] if unexpected else []) + bad
    if problems:
        raise ZooCheckpointError(f"{source} does not match the esm package's ESMC layout: " + "; ".join(problems))
    return out


def _from_hf_layout(sd: Mapping[str, Tensor], source: str) -> Tuple[Dict[str, Tensor], bool]:
    """Hugging Face keys (``esmc.*`` + ``lm_head.*`` of EsmcForMaskedLM, or EsmcModel's bare keys) -> ours,
    and whether an LM head was there."""
    hf = {k[len("esmc."):] if k.startswith("esmc.") else k: v for k, v in sd.items()}
    for k in [k for k in hf if k.endswith(("rotary_emb.inv_freq", "rotary_emb.original_inv_freq"))]:
        hf.pop(k)  # non-persistent in transformers; older saves may hold them
    return hf, any(k.startswith("lm_head.") for k in hf)


def _sizes(sd: Mapping[str, Tensor], source: str, cfg: Mapping[str, Any], num_heads: Optional[int]):
    emb = sd.get("embed_tokens.weight")
    if not isinstance(emb, Tensor) or emb.ndim != 2:
        raise ZooCheckpointError(f"{source}: not an ESM C checkpoint: no token embedding (embed_tokens.weight / "
                                 f"esmc.embed_tokens.weight / embed.weight, got {_shape(emb) if emb is not None else 'nothing'}); "
                                 f"keys seen: {_first_keys(sd)}")
    if emb.shape[0] != VOCAB_ROWS:
        raise ZooCheckpointError(f"{source}: the token embedding has shape {tuple(emb.shape)}: {emb.shape[0]} rows, "
                                 f"ESM C has {VOCAB_ROWS}")
    idx = sorted({int(m.group(1)) for k in sd for m in [_HF_LAYER.match(k)] if m})
    if not idx or idx != list(range(len(idx))):
        raise ZooCheckpointError(f"{source}: layer indices {idx[:8]}{'...' if len(idx) > 8 else ''} are not 0..n-1 "
                                 f"(or there are none)")
    width = emb.shape[1]
    gate = sd.get("layers.0.mlp.gate_proj.weight")
    if not isinstance(gate, Tensor) or gate.ndim != 2:
        raise ZooCheckpointError(f"{source}: missing layers.0.mlp.gate_proj.weight (needed for the feed-forward width)")
    published = [c.heads for c in ESMC_CONFIGS.values() if c.width == width]
    heads = num_heads or cfg.get("num_attention_heads") or (published[0] if published else None)
    if heads is None:
        raise ZooCheckpointError(f"{source}: cannot tell the number of attention heads of width {width} (no config, "
                                 f"not a published size); pass num_heads")
    if width % heads or (width // heads) % 2:
        raise ZooCheckpointError(f"{source}: width {width} does not split into {heads} heads of an even size")
    n_cfg = cfg.get("num_hidden_layers")
    if n_cfg is not None and n_cfg != len(idx) or cfg.get("hidden_size", width) != width:
        raise ZooCheckpointError(f"{source}: its config says {n_cfg} layers of width {cfg.get('hidden_size')}, the "
                                 f"weights have {len(idx)} of width {width}")
    return len(idx), width, int(heads), gate.shape[0]


def _check_config(cfg: Mapping[str, Any], source: str) -> None:
    want = {"vocab_size": VOCAB_ROWS, "pad_token_id": ALPHABET.padding_idx, "mask_token_id": ALPHABET.mask_idx,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    bad = [f"{k}={cfg[k]!r} (ESM C: {v!r})" for k, v in want.items() if k in cfg and cfg[k] != v]
    kv = cfg.get("num_key_value_heads")
    if kv is not None and kv != cfg.get("num_attention_heads", kv):
        bad.append(f"num_key_value_heads={kv} (ESM C has no grouped-query attention)")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        bad.append(f"rope_type={rope['rope_type']!r} (ESM C: 'default')")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and "hidden_size" in cfg and "num_attention_heads" in cfg and \
            head_dim * cfg["num_attention_heads"] != cfg["hidden_size"]:
        bad.append(f"head_dim={head_dim} (ESM C: hidden_size / num_attention_heads)")
    if bad:
        raise ZooCheckpointError(f"{source}: not an ESM C config: " + ", ".join(bad))


def from_esmc(state_dict_or_folder: Any, config: Any = None, attention: Any = None, *,
              num_heads: Optional[int] = None, allow_globals: Sequence[Any] = ()) -> ESMC:
    """ESM C weights -> :class:`~attn_zoo.models.esmc.ESMC` (eval mode, the checkpoint's dtype).

    Args:
        state_dict_or_folder: a Hugging Face ``save_pretrained`` folder (``config.json`` + safetensors), a state
            dict of ``EsmcForMaskedLM`` (``esmc.*``, ``lm_head.*``) or ``EsmcModel`` (no LM head: the new model's
            head is random and ``lm_head.loaded`` is False), or of the ``esm`` package's ``ESMC``
            (``embed.weight``, ``transformer.blocks.N.*``, ``sequence_head.*``), or a ``.pt``/``.pth`` file
            holding one.
        config: an ``EsmcConfig`` or its dict; overrides a folder's ``config.json``.
        attention: the attention config of the new model.
        num_heads: needed only when neither a config nor a published width tells it.
        allow_globals: for a ``.pt``/``.bin`` file: classes your file pickles, named by your code; the file
            still cannot name anything else (see ``zoo.read_checkpoint``). Safetensors are data either way.
    """
    obj, file_cfg, source = _hf_state(state_dict_or_folder, "ESM C", allow_globals)
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
    if bad:
        raise ZooCheckpointError(f"{source}: not a flat state dict: non-tensor entries {bad[:8]}")
    cfg = _config_dict(config) or file_cfg or {}
    _check_config(cfg, source)
    if "embed.weight" in obj or any(_ESM_LAYER.match(k) for k in obj):
        sd, has_head = _from_esm_layout(obj, source), True
    else:
        sd, has_head = _from_hf_layout(obj, source)
    layers, width, heads, ffn = _sizes(sd, source, cfg, num_heads)
    theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    kwargs = dict(attention=attention, rope_theta=theta)
    with torch.device("meta"):
        ref = ESMC(layers, width, heads, ffn, **kwargs)
    if not has_head:
        sd = dict(sd)
        fresh = ESMC(1, width, heads, ffn).lm_head.state_dict()  # EsmcModel: the head of a fresh model
        sd.update({f"lm_head.{k}": v.to(sd["embed_tokens.weight"].dtype) for k, v in fresh.items()})
    _check_state(ref.state_dict(), sd, f"{source} does not match an ESM C of {layers} layers, width {width}, "
                                        f"feed-forward {ffn}")
    model = ESMC(layers, width, heads, ffn, **kwargs).to(sd["embed_tokens.weight"].dtype)
    model.load_state_dict(sd, strict=True)
    model.lm_head.loaded = has_head
    return model.eval()


def to_esmc(module: ESMC, layout: str = "hf") -> Union[Tuple[Dict[str, Tensor], Dict[str, Any]], Dict[str, Tensor]]:
    """The inverse of :func:`from_esmc`. ``layout="hf"``: ``(state_dict, config dict)`` of an ``EsmcForMaskedLM``
    (``EsmcForMaskedLM(EsmcConfig(**config)).load_state_dict(state_dict)``; same tensors, no copy).
    ``layout="esm"``: the ``esm`` package's ``ESMC`` state_dict (q/k/v and gate/up concatenated)."""
    if not isinstance(module, ESMC):
        raise TypeError(f"to_esmc takes an attn_zoo ESMC module, got {type(module).__name__}")
    sd = {k: v.detach() for k, v in module.state_dict().items()}
    if layout == "hf":
        out = {(k if k.startswith("lm_head.") else "esmc." + k): v for k, v in sd.items()}
        config = dict(vocab_size=VOCAB_ROWS, hidden_size=module.width, intermediate_size=module.ffn_width,
                      num_hidden_layers=module.num_layers, num_attention_heads=module.heads,
                      num_key_value_heads=module.heads, hidden_act="silu", pad_token_id=ALPHABET.padding_idx,
                      mask_token_id=ALPHABET.mask_idx, attention_bias=False, mlp_bias=False,
                      rope_parameters={"rope_type": "default", "rope_theta": module.rope_theta})
        return out, config
    if layout != "esm":
        raise ValueError(f"layout must be 'hf' or 'esm', got {layout!r}")
    out = {theirs: sd[ours] for ours, theirs in _ESM_TOP}
    for i in range(module.num_layers):
        p, q = f"transformer.blocks.{i}.", f"layers.{i}."
        out.update({p + theirs: sd[q + ours] for ours, theirs in _ESM_LAYER_MAP})
        out.update({p + theirs: torch.cat([sd[q + o] for o in parts]) for theirs, parts in _ESM_FUSED})
    return out


def _looks_like_esmc(sd: Any) -> bool:
    if not isinstance(sd, Mapping):
        return False
    emb = sd.get("esmc.embed_tokens.weight", sd.get("embed.weight", sd.get("embed_tokens.weight")))
    return isinstance(emb, Tensor) and emb.ndim == 2 and emb.shape[0] == VOCAB_ROWS
