"""The model zoo: the one place that knows other projects' weight layouts.

Each source has its own section: converters from its checkpoints into this project's modules (and back where
a round trip is promised), each checking keys, shapes and dtypes before anything is built, so a bad file
raises :class:`ZooCheckpointError` naming what is wrong and nothing half-loaded is returned.

    ESM-2 (fair-esm)       from_fair_esm, to_fair_esm
    ESM-2 (Hugging Face)   from_hf_esm, to_hf_esm
    Boltz-2 Pairformer     from_boltz, to_boltz
    ESM C (HF / esm)       from_esmc, to_esmc                      (models/zoo_esmc.py)
    AlphaFold 2 (npz)      from_alphafold, to_alphafold            (models/zoo_alphafold.py)
    OpenFold3 Pairformer   from_openfold3, to_openfold3            (models/zoo_openfold3.py)
    Protenix Pairformer    from_protenix, to_protenix              (models/zoo_protenix.py)
    trained here           load_checkpoint, build_network
    fine-tuning            load_pretrained (any of the above, into an existing network)

    stack = from_boltz("boltz2_conf.ckpt")              # Boltz-2 trunk Pairformer -> PairformerStack
    task = load_checkpoint("last.ckpt")                 # a checkpoint trained here, rebuilt in one call
    load_pretrained(path, into=net)                     # fine-tuning: any of the above, loaded into `net`

Files are data: every loader reads with ``torch.load(weights_only=True)`` (:func:`read_checkpoint`, allowing
only :data:`SAFE_GLOBALS` and the ``allow_globals`` your code passes), and a checkpoint's config may build only the
classes in :data:`NETWORKS` and :data:`TASKS` (``register_network`` / ``register_task`` add yours, from code).
Nothing read from a file chooses which function runs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .esm2 import ALPHABET, ESM2, ESM2_CONFIGS, RobertaLMHead
from .zoo_files import (SAFE_GLOBALS, UnsafeCheckpointError, ZooCheckpointError, _check_state,  # noqa: F401
                        _first_keys, _flat_tensors, _hf_read_folder, _hf_state, _mismatch_report, _shape, _summarise,
                        read_checkpoint)
from .zoo_tables import convert, export, transition_rows, tri_att_rows

Tensor = torch.Tensor
PathLike = Union[str, "os.PathLike[str]"]



# --------------------------------------------------------------------------------------------------
# ESM-2: shared by the fair-esm and Hugging Face converters
# --------------------------------------------------------------------------------------------------
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")
_CONTACT_KEYS = ("contact_head.regression.weight", "contact_head.regression.bias")


def _esm2_size(sd: Mapping[str, Any], source: str, num_heads: Optional[int], layer_re=_LAYER_KEY,
               embed_key: str = "embed_tokens.weight", contact_key: str = _CONTACT_KEYS[0]) -> Tuple[int, int, int]:
    """(num_layers, embed_dim, heads) of an ESM-2 state_dict: layers and width from the weights, heads from
    ``num_heads``, else the contact regression's width (layers * heads), else the published size."""
    emb = sd.get(embed_key)
    if not isinstance(emb, Tensor) or emb.ndim != 2:
        raise ZooCheckpointError(f"{source}: not an ESM-2 checkpoint: no token embedding {embed_key!r} "
                                 f"(got {_shape(emb) if emb is not None else 'nothing'}); keys seen: {_first_keys(sd)}")
    if emb.shape[0] != len(ALPHABET):
        raise ZooCheckpointError(f"{source}: {embed_key} has shape {tuple(emb.shape)}: {emb.shape[0]} tokens, "
                                 f"ESM-2's alphabet has {len(ALPHABET)}")
    idx = sorted({int(m.group(1)) for k in sd for m in [layer_re.match(k)] if m})
    if not idx:
        raise ZooCheckpointError(f"{source}: not an ESM-2 checkpoint: no transformer layer keys; keys seen: "
                                 f"{_first_keys(sd)}")
    if idx != list(range(len(idx))):
        raise ZooCheckpointError(f"{source}: layer indices are not 0..{len(idx) - 1}: missing "
                                 f"{sorted(set(range(idx[-1] + 1)) - set(idx))}")
    layers, width = len(idx), emb.shape[1]
    published = [c for c in ESM2_CONFIGS.values() if (c.num_layers, c.embed_dim) == (layers, width)]
    reg = sd.get(contact_key)
    from_contacts = reg.shape[1] // layers if isinstance(reg, Tensor) and reg.ndim == 2 else None
    heads = num_heads or from_contacts or (published[0].attention_heads if published else None)
    if heads is None:
        raise ZooCheckpointError(f"{source}: cannot tell the number of attention heads of a {layers}-layer, "
                                 f"width-{width} model (no contact regression, not a published size); pass num_heads")
    if width % heads:
        raise ZooCheckpointError(f"{source}: width {width} is not divisible by {heads} attention heads")
    return layers, width, heads


def _build_esm2(layers: int, width: int, heads: int, sd: Mapping[str, Tensor], source: str, attention: Any,
                token_dropout: bool = True, layer_norm_eps: float = 1e-5) -> ESM2:
    """Check ``sd`` (this project's key names) against an ESM2 of that size built on the meta device, then
    build the real one in the checkpoint's dtype and load it. A missing contact regression is allowed (fair-esm
    ships it in a separate file): the model then refuses ``return_contacts``."""
    kwargs = dict(token_dropout=token_dropout, attention=attention, layer_norm_eps=layer_norm_eps)
    with torch.device("meta"):
        ref = ESM2(layers, width, heads, **kwargs)
    expected = ref.state_dict()
    has_contacts = any(k in sd for k in _CONTACT_KEYS)
    if not has_contacts:
        for k in _CONTACT_KEYS:
            expected.pop(k)
    _check_state(expected, sd, source)
    emb, head = sd["embed_tokens.weight"], sd["lm_head.weight"]
    if emb is not head and not torch.equal(emb, head):
        raise ZooCheckpointError(f"{source}: the LM head's weight differs from the token embedding; ESM-2 ties "
                                 f"them (embed_tokens.weight / lm_head.weight)")
    model = ESM2(layers, width, heads, **kwargs).to(emb.dtype)
    model.load_state_dict(sd, strict=has_contacts)
    model.contact_head.loaded = has_contacts
    return model.eval()


# --------------------------------------------------------------------------------------------------
# ESM-2 from and to fair-esm
# --------------------------------------------------------------------------------------------------
_FAIR_PREFIX = re.compile(r"^(encoder\.sentence_encoder\.|encoder\.)")  # fair-esm's upgrade_state_dict


def _fair_cfg_heads(ckpt: Mapping[str, Any]) -> Tuple[Optional[int], Optional[bool]]:
    """(attention heads, token_dropout) from a fair-esm checkpoint's ``cfg['model']`` or ``args``, if any."""
    cfg = ckpt.get("cfg")
    cfg = cfg.get("model") if isinstance(cfg, Mapping) else None
    cfg = cfg if cfg is not None else ckpt.get("args")
    get = (lambda k: cfg.get(k)) if isinstance(cfg, Mapping) else (lambda k: getattr(cfg, k, None))
    return (get("encoder_attention_heads"), get("token_dropout")) if cfg is not None else (None, None)


def from_fair_esm(state_dict_or_path: Any, attention: Any = None, *, num_heads: Optional[int] = None,
                  allow_globals: Sequence[Any] = ()) -> ESM2:
    """A fair-esm ESM-2 -> :class:`~attn_zoo.models.esm2.ESM2` (eval mode, the checkpoint's dtype).

    Args:
        state_dict_or_path: a fair-esm checkpoint (a path, or its loaded dict with ``model`` and ``cfg``/``args``;
            keys under ``encoder.sentence_encoder.`` / ``encoder.``) or an ``esm.model.esm2.ESM2`` state_dict.
        attention: the attention config of the new model (``"triton"``, ``{"backend": "chunked"}``, ...).
        num_heads: needed only when neither the checkpoint's config nor its contact regression tells the
            number of heads and the size is not a published one.
        allow_globals: classes your file pickles, named by your code; the file still cannot name anything
            else (see :func:`read_checkpoint`). The file is read as data; fair-esm's ``argparse.Namespace``
            config is allowed.

    The size comes from the weights. A fair-esm checkpoint without its contact regression loads (as in fair-esm);
    such a model raises on ``return_contacts``. Raises ZooCheckpointError for anything that is not a complete
    ESM-2 of one size.
    """
    source = "fair-esm checkpoint"
    obj = state_dict_or_path
    if isinstance(obj, (str, os.PathLike)):
        source = f"fair-esm checkpoint {os.fspath(obj)!r}"
        obj = read_checkpoint(os.fspath(obj), allow_globals=allow_globals)
    return _fair_esm(obj, source, attention, num_heads)


def _fair_esm(obj: Any, source: str, attention: Any = None, num_heads: Optional[int] = None) -> ESM2:
    """:func:`from_fair_esm` of an already read file (``source`` names it in errors)."""
    if not isinstance(obj, Mapping):
        raise ZooCheckpointError(f"{source}: expected a dict (a checkpoint or a state_dict), got {type(obj).__name__}")
    cfg_heads, token_dropout = None, None
    if isinstance(obj.get("model"), Mapping):  # a checkpoint: weights under "model", config beside them
        cfg_heads, token_dropout = _fair_cfg_heads(obj)
        obj = {_FAIR_PREFIX.sub("", k): v for k, v in obj["model"].items()}
    sd = dict(obj)
    if any(k.startswith("esm.") or k.startswith("embeddings.word_embeddings") for k in sd):
        raise ZooCheckpointError(f"{source}: this is a Hugging Face ESM state_dict; use from_hf_esm")
    layers, width, heads = _esm2_size(sd, source, num_heads or cfg_heads)
    if cfg_heads is not None and heads != cfg_heads:
        raise ZooCheckpointError(f"{source}: its config says {cfg_heads} heads, the weights/arguments say {heads}")
    return _build_esm2(layers, width, heads, sd, source, attention,
                       token_dropout=True if token_dropout is None else bool(token_dropout))


def to_fair_esm(module: ESM2, layout: str = "state_dict") -> Dict[str, Any]:
    """The inverse of :func:`from_fair_esm`: this project's ESM-2 -> fair-esm weights (same tensors, no copy).

    ``layout="state_dict"``: what ``esm.model.esm2.ESM2.load_state_dict`` takes (``embed_tokens.weight`` and the
    tied ``lm_head.weight`` are the same tensor, as in fair-esm). ``layout="checkpoint"``: a fair-esm checkpoint
    dict, ``{"model": {"encoder.sentence_encoder.*", "encoder.lm_head.*"}, "cfg": {"model": Namespace(...)}}``,
    which ``esm.pretrained.load_model_and_alphabet_core("esm2_...", ckpt)`` loads. A contact regression that was
    not loaded is left out.
    """
    if not isinstance(module, ESM2):
        raise TypeError(f"to_fair_esm takes an attn_zoo ESM2 module, got {type(module).__name__}")
    if layout not in ("state_dict", "checkpoint"):
        raise ValueError(f"layout must be 'state_dict' or 'checkpoint', got {layout!r}")
    sd = {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}
    if not getattr(module.contact_head, "loaded", True):
        for k in _CONTACT_KEYS:
            sd.pop(k)
    if layout == "state_dict":
        return sd
    model = {("encoder." if k.startswith("lm_head.") else "encoder.sentence_encoder.") + k: v for k, v in sd.items()}
    cfg = argparse.Namespace(encoder_layers=module.num_layers, encoder_embed_dim=module.embed_dim,
                             encoder_ffn_embed_dim=4 * module.embed_dim,
                             encoder_attention_heads=module.attention_heads, token_dropout=module.token_dropout)
    return {"model": model, "cfg": {"model": cfg}}


# --------------------------------------------------------------------------------------------------
# ESM-2 from Hugging Face (EsmForMaskedLM / EsmModel)
# --------------------------------------------------------------------------------------------------
_HF_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.")
_HF_LAYER_MAP = {  # Hugging Face EsmLayer names -> fair-esm TransformerLayer names
    "attention.self.query.": "self_attn.q_proj.",
    "attention.self.key.": "self_attn.k_proj.",
    "attention.self.value.": "self_attn.v_proj.",
    "attention.output.dense.": "self_attn.out_proj.",
    "attention.LayerNorm.": "self_attn_layer_norm.",
    "intermediate.dense.": "fc1.",
    "output.dense.": "fc2.",
    "LayerNorm.": "final_layer_norm.",
    "attention.self.rotary_embeddings.inv_freq": "self_attn.rot_emb.inv_freq",  # older HF checkpoints
}
_HF_TOP_MAP = {
    "embeddings.word_embeddings.weight": "embed_tokens.weight",
    "encoder.emb_layer_norm_after.": "emb_layer_norm_after.",
    "contact_head.regression.": "contact_head.regression.",
    "lm_head.dense.": "lm_head.dense.",
    "lm_head.layer_norm.": "lm_head.layer_norm.",
    "lm_head.bias": "lm_head.bias",
}


def _hf_config(config: Any) -> Optional[Dict[str, Any]]:
    if config is None or isinstance(config, Mapping):
        return None if config is None else dict(config)
    if hasattr(config, "to_dict"):  # transformers.EsmConfig
        return config.to_dict()
    raise TypeError(f"config must be None, a dict or an EsmConfig, got {type(config).__name__}")




def _hf_check_config(cfg: Mapping[str, Any], source: str) -> None:
    want = {"vocab_size": len(ALPHABET), "mask_token_id": ALPHABET.mask_idx, "pad_token_id": ALPHABET.padding_idx,
            "position_embedding_type": "rotary", "is_decoder": False}
    bad = [f"{k}={cfg[k]!r} (ESM-2: {v!r})" for k, v in want.items() if k in cfg and cfg[k] != v]
    if cfg.get("emb_layer_norm_before"):
        bad.append("emb_layer_norm_before=True (ESM-2 has none)")
    if cfg.get("hidden_act", "gelu") != "gelu":
        bad.append(f"hidden_act={cfg['hidden_act']!r} (ESM-2: 'gelu')")
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    if float(theta) != 10000.0:
        bad.append(f"rope_theta={theta} (ESM-2: 10000)")
    if "hidden_size" in cfg and "intermediate_size" in cfg and cfg["intermediate_size"] != 4 * cfg["hidden_size"]:
        bad.append(f"intermediate_size={cfg['intermediate_size']} (ESM-2: 4 * hidden_size = {4 * cfg['hidden_size']})")
    if bad:
        raise ZooCheckpointError(f"{source}: not an ESM-2 config: " + ", ".join(bad))


def from_hf_esm(state_dict_or_folder: Any, config: Any = None, attention: Any = None, *,
                allow_globals: Sequence[Any] = ()) -> ESM2:
    """Hugging Face ``EsmForMaskedLM`` / ``EsmModel`` weights of an ESM-2 -> :class:`~attn_zoo.models.esm2.ESM2`.

    Args:
        state_dict_or_folder: a ``save_pretrained`` folder (``config.json`` plus safetensors or
            ``pytorch_model.bin``) or a state_dict (``esm.*`` and ``lm_head.*`` keys for EsmForMaskedLM, bare
            ``embeddings.*``/``encoder.*`` for EsmModel).
        config: an ``EsmConfig`` or its dict; overrides the folder's ``config.json``. Without one, the size comes
            from the weights and ESM-2's defaults apply (token dropout on, LayerNorm eps 1e-5).
        attention: the attention config of the new model.
        allow_globals: for a ``pytorch_model.bin`` / ``.bin`` file: classes your file pickles, named by your
            code; the file still cannot name anything else (see :func:`read_checkpoint`). Safetensors and
            ``config.json`` are data either way.

    ``EsmModel`` has no LM head: the returned model's LM head is randomly initialised (``lm_head.loaded`` is
    False), its ``representations`` are the checkpoint's. The pooler of ``EsmModel`` (unused by HF's ESM
    forward) is dropped. Raises ZooCheckpointError for anything that is not a complete ESM-2 of one size.
    """
    obj, file_cfg, source = _hf_state(state_dict_or_folder, "Hugging Face ESM", allow_globals)
    cfg = _hf_config(config) or file_cfg or {}
    _hf_check_config(cfg, source)

    hf = dict(obj)
    if any(k.startswith("esm.") for k in hf):  # EsmForMaskedLM: the encoder under esm., the head beside it
        hf = {k[len("esm."):] if k.startswith("esm.") else k: v for k, v in hf.items()}
    if any(_FAIR_PREFIX.match(k) and not k.startswith("encoder.layer.") and not k.startswith("encoder.emb_layer")
           for k in hf) or "embed_tokens.weight" in hf:
        raise ZooCheckpointError(f"{source}: this is a fair-esm checkpoint; use from_fair_esm")
    # transformers' legacy LayerNorm names, which its save_pretrained writes and its loader reads
    hf = {re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", k)): v for k, v in hf.items()}
    for k in ("pooler.dense.weight", "pooler.dense.bias"):
        hf.pop(k, None)
    decoder = hf.pop("lm_head.decoder.weight", None)  # tied to the word embeddings

    if "embeddings.word_embeddings.weight" not in hf:
        raise ZooCheckpointError(f"{source}: not an ESM-2 checkpoint: no embeddings.word_embeddings.weight; keys "
                                 f"seen: {_first_keys(hf)}")
    sd: Dict[str, Any] = {}
    unknown = []
    # one shared rotary buffer: rotary_embeddings.inv_freq (transformers >= 5 in memory), or its saved form
    # encoder.layer.*.attention.self.rotary_embeddings.inv_freq (save_pretrained of transformers >= 5)
    shared_inv_freq = hf.pop("rotary_embeddings.inv_freq", None)
    starred = hf.pop("encoder.layer.*.attention.self.rotary_embeddings.inv_freq", None)
    shared_inv_freq = starred if shared_inv_freq is None else shared_inv_freq
    for k, v in hf.items():
        m = _HF_LAYER.match(k)
        if m:
            rest = k[m.end():]
            new = next((n + rest[len(o):] for o, n in _HF_LAYER_MAP.items() if rest.startswith(o)), None)
            new = None if new is None else f"layers.{m.group(1)}.{new}"
        else:
            new = next((n + k[len(o):] for o, n in _HF_TOP_MAP.items() if k.startswith(o)), None)
        if new is None:
            unknown.append(k)
        else:
            sd[new] = v
    if unknown:
        raise ZooCheckpointError(f"{source}: unexpected keys {sorted(unknown)}")
    n_cfg = cfg.get("num_hidden_layers")
    layers, width, heads = _esm2_size(sd, source, cfg.get("num_attention_heads"))
    if n_cfg is not None and n_cfg != layers or cfg.get("hidden_size", width) != width:
        raise ZooCheckpointError(f"{source}: config says {n_cfg} layers of width {cfg.get('hidden_size')}, the "
                                 f"weights have {layers} of width {width}")
    for i in range(layers):  # fair-esm keeps the (shared) rotary frequencies once per layer
        key = f"layers.{i}.self_attn.rot_emb.inv_freq"
        if key not in sd:
            sd[key] = shared_inv_freq if shared_inv_freq is not None else _default_inv_freq(width // heads)
    emb = sd.get("embed_tokens.weight")
    if decoder is not None and isinstance(emb, Tensor) and (decoder.shape != emb.shape or not torch.equal(decoder, emb)):
        raise ZooCheckpointError(f"{source}: lm_head.decoder.weight {_shape(decoder)} differs from the word "
                                 f"embeddings {_shape(emb)}; ESM-2 ties them")
    has_head = any(k.startswith("lm_head.") for k in sd)
    if not has_head:  # EsmModel: take the freshly initialised head of the model being built
        fresh = RobertaLMHead(width, len(ALPHABET), torch.nn.Parameter(emb)).state_dict()
        sd.update({f"lm_head.{k}": v.to(emb.dtype) for k, v in fresh.items() if k != "weight"})
    sd["lm_head.weight"] = emb
    model = _build_esm2(layers, width, heads, sd, source, attention,
                        token_dropout=bool(cfg.get("token_dropout", True)),
                        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)))
    model.lm_head.loaded = has_head
    return model


def _default_inv_freq(head_dim: int) -> Tensor:
    return 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))


def to_hf_esm(module: ESM2) -> Tuple[Dict[str, Tensor], Dict[str, Any]]:
    """This project's ESM-2 -> ``(state_dict, config dict)`` of a Hugging Face ``EsmForMaskedLM``:
    ``EsmForMaskedLM(EsmConfig(**config)).load_state_dict(state_dict)`` (same tensors, no copy)."""
    if not isinstance(module, ESM2):
        raise TypeError(f"to_hf_esm takes an attn_zoo ESM2 module, got {type(module).__name__}")
    inv = {n: o for o, n in _HF_LAYER_MAP.items() if "rotary" not in o}
    top = {n: o for o, n in _HF_TOP_MAP.items()}
    freqs = [layer.self_attn.rot_emb.inv_freq for layer in module.layers]
    if any(not torch.equal(f, freqs[0]) for f in freqs):
        raise ValueError("the layers' rotary frequencies differ; Hugging Face ESM keeps one shared buffer")
    sd: Dict[str, Tensor] = {"esm.rotary_embeddings.inv_freq": freqs[0].detach()}
    for k, v in module.state_dict(keep_vars=True).items():
        m = _LAYER_KEY.match(k)
        if k == "lm_head.weight" or k.endswith("rot_emb.inv_freq"):
            continue
        if m:
            rest = k[m.end():]
            old = next(o + rest[len(n):] for n, o in inv.items() if rest.startswith(n))
            sd[f"esm.encoder.layer.{m.group(1)}.{old}"] = v.detach()
        else:
            old = next(o + k[len(n):] for n, o in top.items() if k.startswith(n))
            sd[old if old.startswith("lm_head.") else "esm." + old] = v.detach()
    sd["lm_head.decoder.weight"] = module.embed_tokens.weight.detach()
    eps = module.emb_layer_norm_after.eps
    config = dict(vocab_size=len(ALPHABET), hidden_size=module.embed_dim, num_hidden_layers=module.num_layers,
                  num_attention_heads=module.attention_heads, intermediate_size=4 * module.embed_dim,
                  position_embedding_type="rotary", token_dropout=module.token_dropout,
                  mask_token_id=ALPHABET.mask_idx, pad_token_id=ALPHABET.padding_idx, emb_layer_norm_before=False,
                  layer_norm_eps=eps, max_position_embeddings=1026, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    return sd, config


# --------------------------------------------------------------------------------------------------
# Boltz-2: the trunk Pairformer (boltz.model.layers.pairformer.PairformerModule, v2=True)
# --------------------------------------------------------------------------------------------------
_BOLTZ_PREFIXES = ("pairformer_module._orig_mod.", "pairformer_module.")  # a Boltz-2 (compiled) model
_BOLTZ_MARKER = "layers.0.tri_mul_out.norm_in.weight"  # present in every Boltz Pairformer

# Our PairformerBlock(variant="boltz2") parameter -> the Boltz PairformerLayer parameter(s) it is built
# from; two sources are concatenated along dim 0 (SwiGLU's [a | b] projection is one linear here).
_BOLTZ_LAYER_MAP: Tuple[Tuple[str, Tuple[str, ...]], ...] = tuple(
    [
        (f"{ours}.{p}", (f"{theirs}.{p}",))
        for tri in ("tri_mul_out", "tri_mul_in")
        for ours, theirs in ((f"{tri}.layer_norm_in", f"{tri}.norm_in"), (f"{tri}.layer_norm_out", f"{tri}.norm_out"))
        for p in ("weight", "bias")
    ]
    + [
        (f"{tri}.{ours}.weight", (f"{tri}.{theirs}.weight",))
        for tri in ("tri_mul_out", "tri_mul_in")
        for ours, theirs in (("linear_ab_p", "p_in"), ("linear_ab_g", "g_in"), ("linear_z", "p_out"),
                             ("linear_g", "g_out"))
    ]
    + tri_att_rows("", "linear")
    + transition_rows((("pair_transition", "transition_z"), ("single_transition", "transition_s")),
                      "norm", "fc1", "fc2", "fc3")
    + [
        ("attention_pair_bias.layer_norm_s.weight", ("pre_norm_s.weight",)),
        ("attention_pair_bias.layer_norm_s.bias", ("pre_norm_s.bias",)),
        ("attention_pair_bias.layer_norm_z.weight", ("attention.proj_z.0.weight",)),
        ("attention_pair_bias.layer_norm_z.bias", ("attention.proj_z.0.bias",)),
        ("attention_pair_bias.linear_z.weight", ("attention.proj_z.1.weight",)),
        ("attention_pair_bias.mha.linear_q.weight", ("attention.proj_q.weight",)),
        ("attention_pair_bias.mha.linear_q.bias", ("attention.proj_q.bias",)),
        ("attention_pair_bias.mha.linear_k.weight", ("attention.proj_k.weight",)),
        ("attention_pair_bias.mha.linear_v.weight", ("attention.proj_v.weight",)),
        ("attention_pair_bias.mha.linear_g.weight", ("attention.proj_g.weight",)),
        ("attention_pair_bias.mha.linear_o.weight", ("attention.proj_o.weight",)),
    ]
)
_BOLTZ_POST_NORM = (("post_norm_s.weight", ("s_post_norm.weight",)), ("post_norm_s.bias", ("s_post_norm.bias",)))


def _boltz_layer_map(post_norm_s: bool):
    return _BOLTZ_LAYER_MAP + (_BOLTZ_POST_NORM if post_norm_s else ())


def _boltz_pairformer_dict(obj: Any, source: str) -> Tuple[Dict[str, Tensor], Dict[str, Any]]:
    """The PairformerModule's own state dict (keys ``layers.N...``) and Boltz's ``pairformer_args`` if the
    checkpoint records them, from a Boltz-2 checkpoint, a Boltz-2 model state_dict or a bare module's."""
    args: Dict[str, Any] = {}
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):  # a Lightning checkpoint
        hp = obj.get("hyper_parameters")
        if isinstance(hp, Mapping) and isinstance(hp.get("pairformer_args"), Mapping):
            args = dict(hp["pairformer_args"])
        obj, source = obj["state_dict"], f"{source}['state_dict']"
    if not isinstance(obj, Mapping):
        raise ZooCheckpointError(f"{source} holds a {type(obj).__name__}, not a Boltz-2 checkpoint or state dict")
    keys = [k for k in obj if isinstance(k, str)]
    prefix = next((p for p in _BOLTZ_PREFIXES if any(k.startswith(p + "layers.") for k in keys)), None)
    if prefix is None:
        prefix = ""  # a bare PairformerModule state_dict
    sd = {k[len(prefix):]: obj[k] for k in keys if k.startswith(prefix)}
    if _BOLTZ_MARKER not in sd:
        raise ZooCheckpointError(
            f"{source} is not a Boltz-2 Pairformer: no '{prefix or ''}{_BOLTZ_MARKER}' "
            f"(expected 'pairformer_module.layers.N...' in a Boltz-2 checkpoint or 'layers.N...' in a "
            f"PairformerModule state_dict); its first keys: {_summarise(keys, 5)}"
        )
    if any(k.startswith("layers.0.attention.norm_s.") for k in sd):
        raise ZooCheckpointError(
            f"{source} holds a Boltz-1 Pairformer (PairformerLayer(v2=False): 'layers.0.attention.norm_s.*'); "
            "from_boltz loads Boltz-2's (v2=True)"
        )
    return _flat_tensors(sd, source), args


def _boltz_hyperparameters(sd: Mapping[str, Tensor], source: str) -> Dict[str, Any]:
    """PairformerStack constructor arguments read off the weights' shapes."""

    def shape(key: str) -> Tuple[int, ...]:
        if key not in sd:
            raise ZooCheckpointError(f"{source}: missing key {key!r} (needed to infer the Pairformer's sizes)")
        return tuple(sd[key].shape)

    layers = {int(m.group(1)) for k in sd if (m := re.match(r"layers\.(\d+)\.", k))}
    num_blocks = max(layers) + 1
    c_z = shape("layers.0.tri_mul_out.norm_in.weight")[0]
    c_s = shape("layers.0.pre_norm_s.weight")[0]
    heads_pair = shape("layers.0.tri_att_start.linear.weight")[0]
    hidden_pair, rem = divmod(shape("layers.0.tri_att_start.mha.linear_q.weight")[0], heads_pair)
    hidden_mul = shape("layers.0.tri_mul_out.p_in.weight")[0] // 2
    transition_n, rem_t = divmod(shape("layers.0.transition_z.fc1.weight")[0], c_z)
    if rem or rem_t:
        raise ZooCheckpointError(
            f"{source}: inconsistent sizes: tri_att_start q width {heads_pair * hidden_pair + rem} over "
            f"{heads_pair} heads, transition_z hidden {transition_n * c_z + rem_t} for c_z={c_z}"
        )
    return dict(
        c_s=c_s, c_z=c_z, num_blocks=num_blocks, num_heads_single=shape("layers.0.attention.proj_z.1.weight")[0],
        num_heads_pair=heads_pair, c_hidden_pair=hidden_pair, c_hidden_mul=hidden_mul, transition_n=transition_n,
        post_norm_s="layers.0.s_post_norm.weight" in sd,
    )


def from_boltz(
    state_dict_or_path: Union[PathLike, Mapping[str, Any]],
    attention: Any = None,
    *,
    pair_dropout: Optional[float] = None,
    checkpoint_every: int = 0,
    chunk_size: Optional[int] = None,
    map_location: Any = "cpu",
    allow_globals: Sequence[Any] = (),
) -> nn.Module:
    """Boltz-2's trunk Pairformer -> ``PairformerStack(variant="boltz2")`` with the same outputs.

    Args:
        state_dict_or_path: a Boltz-2 checkpoint (a path or the loaded dict: ``state_dict`` holding
            ``pairformer_module.layers.N...`` among the other modules' keys), a Boltz-2 model's
            state_dict, or a bare ``PairformerModule`` state_dict (``layers.N...``).
        attention: the attention backend / options of the stack (see ``AttentionConfig.coerce``).
        pair_dropout: the pair dropout rate; default: the checkpoint's ``pairformer_args.dropout`` if it
            records one, else Boltz's default 0.25 (only active in training).
        checkpoint_every, chunk_size: passed to ``PairformerStack``.
        map_location: passed to ``torch.load`` when a path is given.
        allow_globals: classes your file pickles, named by your code; the file still cannot name anything
            else (see :func:`read_checkpoint`). Boltz's checkpoints load as data without it (their
            hyperparameters are plain values).

    Sizes (blocks, c_s, c_z, heads, head widths, transition factor, post-LayerNorm) are read off the weights.
    The stack's forward ``(s, z, single_mask, pair_mask)`` is Boltz's ``(s, z, mask, pair_mask)`` with bool
    masks. Raises ``ZooCheckpointError`` for missing / unexpected / wrongly shaped keys, a Boltz-1 or another
    model's file, and an unreadable file.
    """
    from .pairformer import PairformerStack

    if isinstance(state_dict_or_path, (str, os.PathLike)):
        source = repr(str(state_dict_or_path))
        obj = read_checkpoint(state_dict_or_path, map_location=map_location, allow_globals=allow_globals)
    else:
        source, obj = "the state dict", state_dict_or_path
    sd, args = _boltz_pairformer_dict(obj, source)
    hp = _boltz_hyperparameters(sd, source)
    if pair_dropout is None:
        pair_dropout = float(args.get("dropout", 0.25))
    stack = PairformerStack(
        c_s=hp["c_s"], c_z=hp["c_z"], num_blocks=hp["num_blocks"], num_heads_single=hp["num_heads_single"],
        num_heads_pair=hp["num_heads_pair"], c_hidden_pair=hp["c_hidden_pair"], c_hidden_mul=hp["c_hidden_mul"],
        transition_n=hp["transition_n"], pair_dropout=pair_dropout, attention=attention,
        checkpoint_every=checkpoint_every, chunk_size=chunk_size, variant="boltz2", post_norm_s=hp["post_norm_s"],
    )
    converted = convert(sd, stack.state_dict(), _boltz_layer_map(hp["post_norm_s"]), hp["num_blocks"], source,
                        "a Boltz-2 Pairformer", layers="layers", floats_only=False)
    stack.load_state_dict(converted, strict=True)
    return stack


def to_boltz(stack: nn.Module) -> Dict[str, Tensor]:
    """The inverse of ``from_boltz``: a ``PairformerStack(variant="boltz2")`` -> a Boltz ``PairformerModule``
    state_dict (``layers.N...``), so a stack fine-tuned here loads back into Boltz."""
    from .pairformer import PairformerStack
    from .primitives import LineDropout

    if not isinstance(stack, PairformerStack) or not all(isinstance(b.pair_dropout_row, LineDropout)
                                                         for b in stack.blocks):
        raise TypeError(f"to_boltz needs a PairformerStack built with variant='boltz2', got {type(stack).__name__}")
    return export(stack, _boltz_layer_map(stack.blocks[0].post_norm_s is not None), "layers")


# --------------------------------------------------------------------------------------------------
# Checkpoints trained here: rebuild the network from the config its task recorded
# --------------------------------------------------------------------------------------------------
class ClassRegistry:
    """The classes a checkpoint may name, by dotted name: a file's config picks one of these to build, never an
    arbitrary callable. Our own entries are imported lazily on first use (``name -> "module:attr"``); classes
    registered at run time (``register``) are held as objects. A checkout's ``models.`` names are read as
    ``attn_zoo.models.``."""

    def __init__(self, what: str, base: type, entries: Mapping[str, str], register_with: str):
        self.what, self.base, self.register_with = what, base, register_with
        self._entries: Dict[str, Any] = dict(entries)

    @staticmethod
    def canonical(name: str) -> str:
        return "attn_zoo." + name if name.startswith("models.") else name

    def register(self, cls: type, name: Optional[str] = None) -> type:
        """Allow ``cls`` (a subclass of the registry's base) to be rebuilt from a checkpoint under ``name``
        (default: its ``module.qualname``). Returns ``cls``, so it works as a class decorator."""
        if not isinstance(cls, type) or not issubclass(cls, self.base):
            raise TypeError(f"only {self.base.__name__} subclasses can be registered as {self.what}, got {cls!r}")
        self._entries[self.canonical(name or f"{cls.__module__}.{cls.__qualname__}")] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Undo ``register`` (our own entries stay)."""
        if not isinstance(self._entries.get(self.canonical(name)), type):
            raise KeyError(f"{name!r} was not registered at run time")
        del self._entries[self.canonical(name)]

    def names(self) -> Tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.canonical(name) in self._entries

    def resolve(self, name: str) -> type:
        entry = self._entries.get(self.canonical(str(name)))
        if entry is None:
            raise ZooCheckpointError(
                f"{self.what} {name!r} is not a registered class: a checkpoint may only name one of "
                f"{_summarise(self.names(), 12)}; a class of your own rebuilds once your code calls "
                f"zoo.{self.register_with}(YourClass) (a file never adds to the list)"
            )
        if isinstance(entry, str):
            import importlib

            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
        return entry


def _entries(prefix: str, modules: Mapping[str, Sequence[str]]) -> Dict[str, str]:
    return {f"{prefix}{m}.{c}": f"{prefix}{m}:{c}" for m, classes in modules.items() for c in classes}


# Every class a saved net config may build (the blocks, stacks, heads and networks configs compose) ...
NETWORKS = ClassRegistry("network", nn.Module, {
    **_entries("attn_zoo.models.", {
        "networks": ("MSADistogramNet", "PairformerTrunk"),
        "embedders": ("MSAEmbedder", "RelativePosition"),
        "evoformer": ("EvoformerStack", "EvoformerBlock", "ExtraMSAStack", "ExtraMSABlock",
                      "MSARowAttentionWithPairBias", "MSAColumnAttention", "MSAColumnGlobalAttention",
                      "OuterProductMean"),
        "pairformer": ("PairformerStack", "PairformerBlock", "AttentionPairBias"),
        "triangle": ("TriangleMultiplication", "TriangleAttention", "TriangleAttentionStartingNode",
                     "TriangleAttentionEndingNode"),
        "transformer": ("TransformerLM", "TransformerBlock", "RelativePositionBias", "SwiGLU", "RotaryEmbedding"),
        "esm2": ("ESM2", "TransformerLayer", "RobertaLMHead", "ContactPredictionHead"),
        "esmc": ("ESMC", "EsmcLayer", "EsmcLMHead"),
        "zoo_alphafold": ("AlphaFold2Trunk",),
        "heads": ("DistogramHead", "MaskedMSAHead", "LMHead"),
        "primitives": ("Attention", "Transition", "SwiGLUTransition", "SharedDropout", "LineDropout"),
    }),
    **{f"torch.nn.{c}": f"torch.nn:{c}" for c in ("Identity", "Linear", "LayerNorm", "Embedding", "Dropout",
                                                    "ModuleList", "ModuleDict", "ReLU", "GELU", "SiLU", "Sigmoid",
                                                    "Tanh")},
}, register_with="register_network")
# ... and every task class a checkpoint's "attn_zoo_task" may name (load_checkpoint(path, task=True))
TASKS = ClassRegistry("task", nn.Module, {
    **_entries("attn_zoo.models.tasks.", {"msa_distogram": ("MSADistogramTask",),
                                          "language_model": ("LanguageModelTask",),
                                          "lm_esm": ("ESMMaskedLMTask",)}),
    "attn_zoo.models.tasks.MSADistogramTask": "attn_zoo.models.tasks:MSADistogramTask",
    "attn_zoo.models.tasks.LanguageModelTask": "attn_zoo.models.tasks:LanguageModelTask",
    "attn_zoo.models.tasks.ESMMaskedLMTask": "attn_zoo.models.tasks:ESMMaskedLMTask",
}, register_with="register_task")


def register_network(cls: type, name: Optional[str] = None) -> type:
    """Let checkpoints whose net config names ``cls`` rebuild it (your own network classes): see
    :class:`ClassRegistry`. Usable as a class decorator."""
    return NETWORKS.register(cls, name)


def register_task(cls: type, name: Optional[str] = None) -> type:
    """Let ``load_checkpoint(path, task=True)`` rebuild your own task class ``cls``."""
    return TASKS.register(cls, name)


def build_network(config: Mapping[str, Any]) -> nn.Module:
    """Build a module from a Hydra-style config (``{"_target_": "attn_zoo.models....", **kwargs}``, nested
    ``_target_`` dicts built first) without Hydra: what a task records as ``net_config``. Other ``_``-keys
    (``_partial_``, ``_recursive_``) are refused. Every ``_target_`` must be a class in :data:`NETWORKS`
    (``register_network(YourClass)`` in your code adds yours); any other target raises ZooCheckpointError
    naming it, before anything is called."""

    def build(node: Any, where: str) -> Any:
        if isinstance(node, Mapping):
            if "_target_" not in node:
                return {k: build(v, f"{where}.{k}") for k, v in node.items()}
            extra = sorted(str(k) for k in node if str(k).startswith("_") and k != "_target_")
            if extra:
                raise ZooCheckpointError(f"net config {where} uses {extra}: only plain _target_ calls are rebuilt")
            target = str(node["_target_"])
            try:
                fn = NETWORKS.resolve(target)
            except ZooCheckpointError as e:
                raise ZooCheckpointError(f"net config {where}: {e}") from None
            kwargs = {k: build(v, f"{where}.{k}") for k, v in node.items() if k != "_target_"}
            return fn(**kwargs)
        if isinstance(node, (list, tuple)):
            return [build(v, f"{where}[{i}]") for i, v in enumerate(node)]
        return node

    if not isinstance(config, Mapping) or "_target_" not in config:
        raise ZooCheckpointError(f"a net config must be a mapping with a _target_, got {config!r}")
    net = build(config, "net")
    if not isinstance(net, nn.Module):
        raise ZooCheckpointError(f"net config {config['_target_']!r} built a {type(net).__name__}, not an nn.Module")
    return net


def _with_attention(config: Any, attention: Any) -> Any:
    """The config with every ``attention`` entry replaced (e.g. a GPU run's triton reloaded on a CPU)."""
    if isinstance(config, Mapping):
        return {k: (attention if k == "attention" else _with_attention(v, attention)) for k, v in config.items()}
    if isinstance(config, list):
        return [_with_attention(v, attention) for v in config]
    return config


def _check_and_load(module: nn.Module, sd: Mapping[str, Tensor], what: str) -> None:
    """``module.load_state_dict(sd, strict=True)`` after checking every key and shape first, so a mismatch
    raises one ZooCheckpointError naming all of them and leaves ``module`` untouched."""
    own = module.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = [f"{k} {tuple(sd[k].shape)} (expected {tuple(own[k].shape)})" for k in own
              if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    report = _mismatch_report(missing, unexpected, shapes, what)
    if report:
        raise ZooCheckpointError(report)
    module.load_state_dict(sd, strict=True)


def _net_state(state_dict: Mapping[str, Any], source: str) -> Dict[str, Tensor]:
    """The net's own keys of a task's state_dict (``net.x`` -> ``x``)."""
    sd = {k[len("net."):]: v for k, v in state_dict.items() if isinstance(k, str) and k.startswith("net.")}
    if not sd:
        raise ZooCheckpointError(f"{source}: its state_dict has no 'net.*' keys (first keys: {_summarise(list(state_dict), 5)})")
    return _flat_tensors(sd, source)


def _is_ours(obj: Any) -> bool:
    return (isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping)
            and (isinstance(obj.get("hyper_parameters"), Mapping) and "net_config" in obj["hyper_parameters"]
                 or "attn_zoo_task" in obj))


# hyperparameters never passed from a file to a task: which file to read and what it may unpickle are the caller's
# (trust_file and pretrained_weights_only: options of older versions, dropped if a file still holds them)
_NOT_FROM_FILE = ("net", "net_config", "optimizer", "scheduler", "pretrained", "allow_globals", "trust_file",
                  "pretrained_weights_only")


def load_checkpoint(
    path: PathLike, map_location: Any = "cpu", *, attention: Any = None, task: bool = False,
    allow_globals: Sequence[Any] = (),
) -> nn.Module:
    """Rebuild a network (or with ``task=True`` its LightningModule) from a checkpoint trained here.

        net = load_checkpoint("logs/train/runs/X/checkpoints/last.ckpt", attention="torch").eval()
        out = net(batch)

    The task saved the net's config (``hyper_parameters["net_config"]``); the net is built from it with
    ``build_network`` (registered classes only) and its weights loaded strictly. ``attention`` replaces the
    recorded attention config (a run trained with triton on a GPU, reloaded on a CPU). ``task=True`` returns the
    task class the checkpoint names (one of :data:`TASKS`), without an optimizer (inference, evaluation;
    ``train.py ckpt_path=`` resumes training).

    ``allow_globals``: classes your file pickles, named by your code; the file still cannot name anything else
    (see :func:`read_checkpoint`). The config's classes are still only those registered.
    """
    obj = read_checkpoint(path, map_location=map_location, allow_globals=allow_globals)
    return _from_checkpoint(obj, repr(str(path)), attention=attention, task=task)


def _from_checkpoint(obj: Any, source: str, *, attention: Any, task: bool) -> nn.Module:
    """``load_checkpoint`` of an already read file."""
    if not _is_ours(obj):
        hint = ""
        if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
            if any(str(k).startswith(_BOLTZ_PREFIXES) for k in obj["state_dict"]):
                hint = " (a Boltz-2 checkpoint: use from_boltz)"
            else:
                hint = (" (a Lightning checkpoint without the net config: trained before the config was recorded? "
                        "build the net and use load_pretrained(path, into=net))")
        elif isinstance(obj, Mapping) and "model" in obj:
            hint = " (a fair-esm checkpoint? use from_fair_esm)"
        raise ZooCheckpointError(f"{source} is not a checkpoint trained with attn-zoo{hint}")
    hparams = dict(obj["hyper_parameters"] or {})
    if "net_config" not in hparams:
        raise ZooCheckpointError(f"{source} records no net_config in its hyperparameters: cannot rebuild the net")
    net_config = hparams["net_config"]
    if attention is not None:
        from .primitives import AttentionConfig

        a = AttentionConfig.coerce(attention)
        net_config = _with_attention(net_config, {"backend": a.backend, **a.options})
    try:
        net = build_network(net_config)
    except ZooCheckpointError as e:
        raise ZooCheckpointError(f"{source}: {e}") from None
    _check_and_load(net, _net_state(obj["state_dict"], source), f"{source} does not match the net it records")
    _restore_contact_flags(net, obj)
    if not task:
        return net
    cls_path = obj.get("attn_zoo_task")
    if not cls_path:
        raise ZooCheckpointError(f"{source} does not name its task class ('attn_zoo_task'): load the net instead")
    try:
        cls = TASKS.resolve(str(cls_path))
    except ZooCheckpointError as e:
        raise ZooCheckpointError(f"{source}: {e}") from None
    kwargs = {k: v for k, v in hparams.items() if k not in _NOT_FROM_FILE}
    module = cls(net=net, **kwargs)
    module.record_net_config(net_config)
    return module


# --------------------------------------------------------------------------------------------------
# Fine-tuning: load whatever the zoo knows into an existing network
# --------------------------------------------------------------------------------------------------
def _only_module_of(net: nn.Module, cls: type, what: str) -> nn.Module:
    found = [m for m in net.modules() if isinstance(m, cls)]
    if len(found) != 1:
        raise ZooCheckpointError(f"{what} needs exactly one {cls.__name__} inside {type(net).__name__}, found {len(found)}")
    return found[0]


def _lm_sizes(m: nn.Module) -> Tuple[Tuple[str, int], ...]:
    """The constructor sizes of an ESM2 / ESMC, as (argument, value) pairs."""
    if isinstance(m, ESM2):
        return (("num_layers", m.num_layers), ("embed_dim", m.embed_dim), ("attention_heads", m.attention_heads))
    return (("num_layers", m.num_layers), ("width", m.width), ("heads", m.heads), ("ffn_width", m.ffn_width))


def _lm_published(m: nn.Module) -> Optional[str]:
    """The published size name ("650M", "300M") of an ESM2 / ESMC of ``m``'s shape, or None."""
    from .esmc import ESMC_CONFIGS

    if isinstance(m, ESM2):
        return next((n.split("_")[2] for n, c in ESM2_CONFIGS.items()
                     if (c.num_layers, c.embed_dim, c.attention_heads) == tuple(v for _, v in _lm_sizes(m))), None)
    return next((n for n, c in ESMC_CONFIGS.items()
                 if (c.num_layers, c.width, c.heads, c.ffn_width) == tuple(v for _, v in _lm_sizes(m))), None)


def _lm_size_name(m: nn.Module) -> str:
    name = _lm_published(m)
    return ", ".join(f"{k} {v}" for k, v in _lm_sizes(m)) + (f" ({name})" if name else "")


def _heads_of(into: nn.Module, cls_name: str, sd: Mapping[str, Any]) -> Optional[int]:
    """The head count of the one ESM2 / ESMC in ``into`` when its width is the state_dict's: what a state_dict
    without a config cannot tell (another width: the size check names both)."""
    emb = next((sd[k] for k in ("embed_tokens.weight", "esmc.embed_tokens.weight", "embed.weight") if k in sd), None)
    found = [m for m in into.modules() if type(m).__name__ == cls_name and hasattr(m, "attention_heads")]
    if len(found) != 1 or not isinstance(emb, Tensor) or emb.ndim != 2 or emb.shape[1] != found[0].embed_dim:
        return None
    return found[0].attention_heads


def _lm_into(into: nn.Module, converted: nn.Module, source: str, what: str) -> nn.Module:
    """Copy a converted ESM-2 / ESM C's weights into ``into`` (one of that class, or a network holding exactly
    one), after checking that the sizes agree; ``into`` is unchanged on any error."""
    cls = type(converted)
    name, experiment = ("ESM-2", "esm2_mlm") if cls is ESM2 else ("ESM C", "esmc_mlm")
    if isinstance(into, cls):
        target = into
    else:
        found = [m for m in into.modules() if isinstance(m, cls)]
        if len(found) != 1:
            raise ZooCheckpointError(
                f"{source} is a {what} {name}: it loads into an attn_zoo {cls.__name__} (train.py "
                f"experiment={experiment}), but {type(into).__name__} holds {len(found)} of them")
        target = found[0]
    if _lm_sizes(target) != _lm_sizes(converted):
        size = _lm_published(converted)
        fix = f"model.size={size}" if size else "model.size=null " + " ".join(
            f"model.net.{k}={v}" for k, v in _lm_sizes(converted))
        raise ZooCheckpointError(f"{source} holds a {what} {name} of {_lm_size_name(converted)}; the network's "
                                 f"{cls.__name__} has {_lm_size_name(target)}: build it at the file's size "
                                 f"(train.py: {fix})")
    _check_and_load(target, converted.state_dict(), f"{source} ({what}) does not fit {type(target).__name__}")
    if isinstance(target, ESM2):  # fair-esm ships the contact regression apart: a file without it leaves it random
        target.contact_head.loaded = converted.contact_head.loaded
    return into


def _restore_contact_flags(net: nn.Module, obj: Mapping[str, Any]) -> None:
    """A checkpoint trained here from weights without ESM-2's contact regression says so (``attn_zoo_contacts``,
    written by the LM task); its model keeps refusing contacts rather than returning a random regression's."""
    if obj.get("attn_zoo_contacts") is False:
        for m in net.modules():
            if isinstance(m, ESM2):
                m.contact_head.loaded = False


def load_pretrained(
    path: PathLike, into: nn.Module, *, map_location: Any = "cpu", allow_globals: Sequence[Any] = ()
) -> nn.Module:
    """Load pretrained weights into an existing network ``into`` (fine-tuning), dispatching on what ``path`` is:

    - a checkpoint trained here (``.ckpt`` with the task's ``net.*`` weights): loaded into ``into``;
    - a Boltz-2 checkpoint or PairformerModule state_dict: ``from_boltz``, loaded into the one
      ``PairformerStack`` inside ``into`` (which must be ``variant="boltz2"`` of the same sizes);
    - a fair-esm ``.pt`` (a dict with ``model`` and ``cfg``/``args``, keys under ``encoder.sentence_encoder.``),
      a Hugging Face ESM-2 or ESM C folder, a bare ESM-2 or ESM C state_dict: read by ``from_fair_esm`` /
      ``from_hf_esm`` / ``from_esmc`` (the same readers, the same checks), then copied into ``into`` if it is an
      ESM2 (ESMC), else into the one inside it (same size: an error names both sizes and the ``model.size`` to set);
    - a bare state_dict of ``into`` itself (``torch.save(net.state_dict())``).

    Every key and shape is checked before anything is copied: on a ZooCheckpointError ``into`` is unchanged.
    Returns ``into``. The file is read as data; ``allow_globals``: classes your file pickles, named by your
    code; the file still cannot name anything else (see :func:`read_checkpoint`).
    """
    p = Path(path).expanduser()
    source = repr(str(p))
    if p.is_dir():
        # ESM C when its config.json says so, else ESM-2
        converted = load_language_model(str(p), allow_globals=allow_globals)
        return _lm_into(into, converted, source, "Hugging Face")
    obj = read_checkpoint(p, map_location=map_location, allow_globals=allow_globals)
    if _is_ours(obj):
        _check_and_load(into, _net_state(obj["state_dict"], source), f"{source} does not fit {type(into).__name__}")
        _restore_contact_flags(into, obj)
        return into
    inner = obj.get("state_dict") if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping) else obj
    if isinstance(inner, Mapping) and any(
        isinstance(k, str) and k.endswith(_BOLTZ_MARKER) and k[: -len(_BOLTZ_MARKER)] in _BOLTZ_PREFIXES + ("",)
        for k in inner
    ):
        from .pairformer import PairformerStack

        target = _only_module_of(into, PairformerStack, f"the Boltz-2 Pairformer of {source}")
        stack = from_boltz(obj)
        _check_and_load(target, stack.state_dict(),
                        f"{source} (Boltz-2 Pairformer) does not fit the PairformerStack in {type(into).__name__} "
                        "(build it with variant='boltz2' and the checkpoint's sizes)")
        return into
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):  # fair-esm: {"model", "args"/"cfg"}
        return _lm_into(into, _fair_esm(obj, f"fair-esm checkpoint {source}"), source, "fair-esm")
    if _looks_like_esmc(obj):  # a state_dict of ESM C (the esm package's or Hugging Face's names)
        return _lm_into(into, from_esmc(obj, num_heads=_heads_of(into, "ESMC", obj)), source, "ESM C state_dict")
    if isinstance(obj, Mapping) and obj and all(isinstance(v, Tensor) for v in obj.values()):
        target = into if isinstance(into, ESM2) else None
        if target is None and "embed_tokens.weight" in obj and any(isinstance(m, ESM2) for m in into.modules()):
            target = _only_module_of(into, ESM2, f"the ESM-2 state_dict {source}")
        if target is not None:  # an ESM-2 state_dict (fair-esm's names are this project's)
            return _lm_into(into, _fair_esm(obj, f"ESM-2 state_dict {source}", num_heads=_heads_of(into, "ESM2", obj)),
                            source, "ESM-2 state_dict")
        _check_and_load(into, obj, f"{source} (a state_dict) does not fit {type(into).__name__}")
        return into
    keys = _summarise([str(k) for k in obj], 5) if isinstance(obj, Mapping) else type(obj).__name__
    raise ZooCheckpointError(
        f"{source} is none of what the zoo loads (a checkpoint trained here, Boltz-2, fair-esm .pt, Hugging Face "
        f"folder, a state_dict of the network): {keys}"
    )


def load_esm2(path: PathLike, attention: Any = None, *, map_location: Any = "cpu",
              allow_globals: Sequence[Any] = ()) -> ESM2:
    """An ESM-2 from any file the zoo reads, for inference (``scripts/embed.py``): a fair-esm ``.pt``, a
    Hugging Face folder, a checkpoint trained here (its network must hold exactly one ESM-2) or a bare ESM-2
    state_dict (fair-esm's or this project's names). ``attention`` sets the model's attention config.
    ZooCheckpointError for anything else. The file is read as data (registered network classes only);
    ``allow_globals``: classes your file pickles, named by your code; the file still cannot name anything else
    (see :func:`read_checkpoint`)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return from_hf_esm(str(p), attention=attention, allow_globals=allow_globals)
    if not p.is_file():
        raise ZooCheckpointError(f"{str(p)!r}: no such file or folder")
    obj = read_checkpoint(p, map_location=map_location, allow_globals=allow_globals)
    if _is_ours(obj):
        net = _from_checkpoint(obj, repr(str(p)), attention=attention, task=False)
        from .esmc import ESMC

        found = [m for m in net.modules() if isinstance(m, (ESM2, ESMC))]  # embed reads either
        if len(found) != 1:
            raise ZooCheckpointError(f"{str(p)!r} was trained here for a {type(net).__name__}, which holds "
                                     f"{len(found)} ESM-2 / ESM C models: embedding needs exactly one")
        return found[0]
    if isinstance(obj, Mapping) and (isinstance(obj.get("model"), Mapping) or obj and all(
            isinstance(v, Tensor) for v in obj.values())):
        return from_fair_esm(obj, attention=attention)
    keys = _summarise([str(k) for k in obj], 5) if isinstance(obj, Mapping) else type(obj).__name__
    raise ZooCheckpointError(f"{str(p)!r} is not an ESM-2 the zoo reads (fair-esm .pt, Hugging Face folder, a "
                             f"checkpoint trained here, an ESM-2 state_dict): {keys}")


def load_language_model(path: Any, attention: Any = None, *, allow_globals: Sequence[Any] = ()) -> torch.nn.Module:
    """An ESM-2 or an ESM C from a file or folder, for inference (``attn-zoo-embed``): ESM C when the folder's
    ``config.json`` says ``model_type: esmc`` or the weights have ESM C's 64-row embedding (a Hugging Face or
    ``esm``-package state dict), else :func:`~attn_zoo.models.zoo.load_esm2`. The file is read as data;
    ``allow_globals``: classes your file pickles, named by your code; the file still cannot name anything else
    (see :func:`read_checkpoint`)."""
    p = os.path.expanduser(os.fspath(path))
    if os.path.isdir(p):
        cfg_path = os.path.join(p, "config.json")
        model_type = None
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path) as f:
                    model_type = json.load(f).get("model_type")
            except ValueError as e:
                raise ZooCheckpointError(f"cannot parse {cfg_path!r}: {e}") from e
        if model_type == "esmc":
            return from_esmc(p, attention=attention, allow_globals=allow_globals)
        return load_esm2(p, attention=attention, allow_globals=allow_globals)
    if os.path.isfile(p):
        try:  # memory-mapped: an ESM-2 file is read again, in full, by load_esm2
            obj = read_checkpoint(p, allow_globals=allow_globals, mmap=True)
        except ZooCheckpointError:
            obj = None  # a legacy (non-zip) file or an unreadable one: load_esm2 reads it or says why
        if _looks_like_esmc(obj):
            source = f"ESM C checkpoint {p!r}"
            try:
                return from_esmc(obj, attention=attention)
            except ZooCheckpointError as e:
                raise ZooCheckpointError(f"{source}: {e}") from None
    return load_esm2(p, attention=attention, allow_globals=allow_globals)


# ESM C (Hugging Face port and the esm package's layout): models/zoo_esmc.py
from .zoo_esmc import _looks_like_esmc, from_esmc, to_esmc  # noqa: E402,F401  (re-exported)

# AlphaFold 2 parameters (npz) into the Evoformer and extra-MSA stacks: models/zoo_alphafold.py
from .zoo_alphafold import AlphaFold2Trunk, from_alphafold, to_alphafold  # noqa: E402,F401  (re-exported)

# OpenFold3's and Protenix's trunk Pairformers: models/zoo_openfold3.py, models/zoo_protenix.py
from .zoo_openfold3 import from_openfold3, to_openfold3  # noqa: E402,F401  (re-exported)
from .zoo_protenix import from_protenix, to_protenix  # noqa: E402,F401  (re-exported)
