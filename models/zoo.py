"""The model zoo: the one place that knows other projects' weight layouts.

Each source has its own section: converters from its checkpoints into this project's modules (and back where
a round trip is promised), each checking keys, shapes and dtypes before anything is built, so a bad file
raises :class:`ZooCheckpointError` naming what is wrong and nothing half-loaded is returned.

    ESM-2 (fair-esm)       from_fair_esm, to_fair_esm
    ESM-2 (Hugging Face)   from_hf_esm, to_hf_esm
"""
from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import torch

from .esm2 import ALPHABET, ESM2, ESM2_CONFIGS, RobertaLMHead

Tensor = torch.Tensor


class ZooCheckpointError(ValueError):
    """A checkpoint that cannot be converted: unreadable or truncated file, another model's weights, missing
    or unexpected keys, wrong shapes. The message names the file (if any), the keys and the shapes seen."""


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------
def _load_torch_file(path: str, weights_only: bool = True) -> Any:
    """``torch.load`` on the CPU; ``argparse.Namespace`` (fair-esm's ``args``/``cfg``) is allowed with
    ``weights_only``. An unreadable or truncated file raises ZooCheckpointError naming the path."""
    if not os.path.isfile(path):
        raise ZooCheckpointError(f"checkpoint file {path!r} does not exist")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for bad files
        raise ZooCheckpointError(f"cannot read checkpoint {path!r} ({os.path.getsize(path)} bytes; truncated or "
                                 f"not a torch file?): {type(e).__name__}: {e}") from e


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__


def _first_keys(keys: Iterable[str], n: int = 6) -> str:
    keys = sorted(keys)
    return str(keys[:n])[:-1] + (f", ... ({len(keys)} keys)]" if len(keys) > n else "]")


def _check_state(expected: Mapping[str, Tensor], got: Mapping[str, Any], source: str) -> None:
    """Raise ZooCheckpointError listing every missing key, unexpected key, non-tensor value and shape
    mismatch of ``got`` against ``expected`` (both in this project's key names)."""
    problems = []
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for k in sorted(set(expected) & set(got)):
        v = got[k]
        if not isinstance(v, Tensor):
            problems.append(f"{k} is a {type(v).__name__}, not a tensor")
        elif v.shape != expected[k].shape:
            problems.append(f"{k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}")
        elif not v.is_floating_point():
            problems.append(f"{k} has dtype {v.dtype}, expected a float tensor")
    if problems:
        raise ZooCheckpointError(f"{source}: " + "; ".join(problems))


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
                  weights_only: bool = True) -> ESM2:
    """A fair-esm ESM-2 -> :class:`~attn_zoo.models.esm2.ESM2` (eval mode, the checkpoint's dtype).

    Args:
        state_dict_or_path: a fair-esm checkpoint (a path, or its loaded dict with ``model`` and ``cfg``/``args``;
            keys under ``encoder.sentence_encoder.`` / ``encoder.``) or an ``esm.model.esm2.ESM2`` state_dict.
        attention: the attention config of the new model (``"triton"``, ``{"backend": "chunked"}``, ...).
        num_heads: needed only when neither the checkpoint's config nor its contact regression tells the
            number of heads and the size is not a published one.
        weights_only: ``torch.load``'s safe mode (fair-esm's ``argparse.Namespace`` config is allowed).

    The size comes from the weights. A fair-esm checkpoint without its contact regression loads (as in fair-esm);
    such a model raises on ``return_contacts``. Raises ZooCheckpointError for anything that is not a complete
    ESM-2 of one size.
    """
    source = "fair-esm checkpoint"
    obj = state_dict_or_path
    if isinstance(obj, (str, os.PathLike)):
        source = f"fair-esm checkpoint {os.fspath(obj)!r}"
        obj = _load_torch_file(os.fspath(obj), weights_only)
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


def _hf_read_folder(folder: str) -> Tuple[Dict[str, Tensor], Optional[Dict[str, Any]]]:
    """Weights (``model.safetensors``, sharded safetensors or ``pytorch_model.bin``) and ``config.json``."""
    config = None
    cfg_path = os.path.join(folder, "config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path) as f:
                config = json.load(f)
        except ValueError as e:
            raise ZooCheckpointError(f"cannot parse {cfg_path!r}: {e}") from e
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index) or os.path.isfile(single):
        from safetensors.torch import load_file  # a dependency of transformers, only needed here

        try:
            if os.path.isfile(index):
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            else:
                shards = ["model.safetensors"]
            sd: Dict[str, Tensor] = {}
            for s in shards:
                sd.update(load_file(os.path.join(folder, s), device="cpu"))
        except Exception as e:
            raise ZooCheckpointError(f"cannot read the safetensors weights in {folder!r} (truncated?): "
                                     f"{type(e).__name__}: {e}") from e
        return sd, config
    bin_path = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        return _load_torch_file(bin_path), config
    raise ZooCheckpointError(f"{folder!r} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


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


def from_hf_esm(state_dict_or_folder: Any, config: Any = None, attention: Any = None) -> ESM2:
    """Hugging Face ``EsmForMaskedLM`` / ``EsmModel`` weights of an ESM-2 -> :class:`~attn_zoo.models.esm2.ESM2`.

    Args:
        state_dict_or_folder: a ``save_pretrained`` folder (``config.json`` plus safetensors or
            ``pytorch_model.bin``) or a state_dict (``esm.*`` and ``lm_head.*`` keys for EsmForMaskedLM, bare
            ``embeddings.*``/``encoder.*`` for EsmModel).
        config: an ``EsmConfig`` or its dict; overrides the folder's ``config.json``. Without one, the size comes
            from the weights and ESM-2's defaults apply (token dropout on, LayerNorm eps 1e-5).
        attention: the attention config of the new model.

    ``EsmModel`` has no LM head: the returned model's LM head is randomly initialised (``lm_head.loaded`` is
    False), its ``representations`` are the checkpoint's. The pooler of ``EsmModel`` (unused by HF's ESM
    forward) is dropped. Raises ZooCheckpointError for anything that is not a complete ESM-2 of one size.
    """
    source = "Hugging Face ESM state_dict"
    obj, file_cfg = state_dict_or_folder, None
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        source = f"Hugging Face ESM checkpoint {path!r}"
        if os.path.isdir(path):
            obj, file_cfg = _hf_read_folder(path)
        else:
            obj = _load_torch_file(path)
    if not isinstance(obj, Mapping):
        raise ZooCheckpointError(f"{source}: expected a state_dict, got {type(obj).__name__}")
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
