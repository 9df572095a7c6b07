"""The model zoo: the one place that knows other projects' weight layouts.

Every loader returns a fully loaded module or raises ``ZooCheckpointError`` (a ``ValueError``) that names
what is wrong: missing keys, unexpected keys, keys whose shapes disagree, another model's file, a truncated
file. Nothing half-loaded is ever returned.

    stack = from_boltz("boltz2_conf.ckpt")              # Boltz-2 trunk Pairformer -> PairformerStack
    task = load_checkpoint("last.ckpt")                 # a checkpoint trained here, rebuilt in one call
    load_pretrained(path, into=net)                     # fine-tuning: any of the above, loaded into `net`
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

Tensor = torch.Tensor
PathLike = Union[str, "os.PathLike[str]"]


class ZooCheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and the offending keys / shapes."""


# --------------------------------------------------------------------------------------------------
# Shared helpers: reading a file, reporting key / shape mismatches
# --------------------------------------------------------------------------------------------------
def _torch_load(path: PathLike, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """``torch.load`` with the failure modes turned into ``ZooCheckpointError`` naming the file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ZooCheckpointError(f"checkpoint {str(path)!r} does not exist or is not a file")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as e:  # truncated zip, garbage bytes, pickled classes refused by weights_only
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = ""
        if weights_only and ("weights_only" in str(e) or "Unsupported global" in str(e)):
            hint = " (it pickles Python objects: pass weights_only=False if you trust the file)"
        raise ZooCheckpointError(
            f"cannot read checkpoint {str(path)!r} ({path.stat().st_size} bytes): truncated, corrupt or not a "
            f"torch checkpoint{hint}: {type(e).__name__}: {msg}"
        ) from e


def _summarise(items: Sequence[str], limit: int = 8) -> str:
    items = list(items)
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _mismatch_report(
    missing: Sequence[str], unexpected: Sequence[str], shapes: Sequence[str], what: str
) -> Optional[str]:
    """One message listing every problem, or None when there is none."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {_summarise(sorted(missing))}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {_summarise(sorted(unexpected))}")
    if shapes:
        parts.append(f"{len(shapes)} key(s) with the wrong shape: {_summarise(shapes)}")
    return f"{what}: " + "; ".join(parts) if parts else None


def _flat_tensors(obj: Any, source: str) -> Dict[str, Tensor]:
    """A ``{name: tensor}`` state dict, or a ZooCheckpointError saying what the object is instead."""
    if not isinstance(obj, Mapping):
        raise ZooCheckpointError(f"{source} holds a {type(obj).__name__}, not a state dict")
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
    if bad:
        raise ZooCheckpointError(f"{source} is not a flat state dict: non-tensor entries {_summarise(bad)}")
    return dict(obj)


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
    + [(f"{tri}.layer_norm.{p}", (f"{tri}.layer_norm.{p}",)) for tri in ("tri_att_start", "tri_att_end")
       for p in ("weight", "bias")]
    + [(f"{tri}.linear_bias.weight", (f"{tri}.linear.weight",)) for tri in ("tri_att_start", "tri_att_end")]
    + [(f"{tri}.mha.linear_{x}.weight", (f"{tri}.mha.linear_{x}.weight",))
       for tri in ("tri_att_start", "tri_att_end") for x in "qkvgo"]
    + [
        item
        for ours, theirs in (("pair_transition", "transition_z"), ("single_transition", "transition_s"))
        for item in (
            (f"{ours}.layer_norm.weight", (f"{theirs}.norm.weight",)),
            (f"{ours}.layer_norm.bias", (f"{theirs}.norm.bias",)),
            (f"{ours}.linear_ab.weight", (f"{theirs}.fc1.weight", f"{theirs}.fc2.weight")),
            (f"{ours}.linear_out.weight", (f"{theirs}.fc3.weight",)),
        )
    ]
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


def _convert(
    sd: Mapping[str, Tensor],
    target: Mapping[str, Tensor],
    layer_map: Sequence[Tuple[str, Tuple[str, ...]]],
    num_blocks: int,
    source: str,
) -> Dict[str, Tensor]:
    """Boltz ``layers.i.<theirs>`` -> our ``blocks.i.<ours>``; every missing, unexpected or wrongly shaped
    key is reported at once (``target``: our state dict, for the shapes)."""
    out: Dict[str, Tensor] = {}
    used, missing, shapes = set(), [], []
    for i in range(num_blocks):
        for ours, theirs in layer_map:
            want = tuple(target[f"blocks.{i}.{ours}"].shape)
            parts = []
            for t in theirs:
                key = f"layers.{i}.{t}"
                used.add(key)
                w = (want[0] // len(theirs),) + want[1:]  # each source holds its share of dim 0
                if key not in sd:
                    missing.append(key)
                elif tuple(sd[key].shape) != w:
                    shapes.append(f"{key} {tuple(sd[key].shape)} (expected {w})")
                else:
                    parts.append(sd[key])
            if len(parts) == len(theirs):
                out[f"blocks.{i}.{ours}"] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    unexpected = sorted(set(sd) - used)
    report = _mismatch_report(missing, unexpected, shapes, f"{source} does not match a Boltz-2 Pairformer")
    if report:
        raise ZooCheckpointError(report)
    return out


def from_boltz(
    state_dict_or_path: Union[PathLike, Mapping[str, Any]],
    attention: Any = None,
    *,
    pair_dropout: Optional[float] = None,
    checkpoint_every: int = 0,
    chunk_size: Optional[int] = None,
    map_location: Any = "cpu",
    weights_only: bool = True,
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
        map_location, weights_only: passed to ``torch.load`` when a path is given.

    Sizes (blocks, c_s, c_z, heads, head widths, transition factor, post-LayerNorm) are read off the weights.
    The stack's forward ``(s, z, single_mask, pair_mask)`` is Boltz's ``(s, z, mask, pair_mask)`` with bool
    masks. Raises ``ZooCheckpointError`` for missing / unexpected / wrongly shaped keys, a Boltz-1 or another
    model's file, and an unreadable file.
    """
    from .pairformer import PairformerStack

    if isinstance(state_dict_or_path, (str, os.PathLike)):
        source = repr(str(state_dict_or_path))
        obj = _torch_load(state_dict_or_path, map_location=map_location, weights_only=weights_only)
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
    converted = _convert(sd, stack.state_dict(), _boltz_layer_map(hp["post_norm_s"]), hp["num_blocks"], source)
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
    sd, blocks = stack.state_dict(), stack.blocks
    post = blocks[0].post_norm_s is not None
    out: Dict[str, Tensor] = {}
    for i in range(len(blocks)):
        for ours, theirs in _boltz_layer_map(post):
            parts = sd[f"blocks.{i}.{ours}"].chunk(len(theirs), dim=0)
            for t, p in zip(theirs, parts):
                out[f"layers.{i}.{t}"] = p.clone()
    return out


# --------------------------------------------------------------------------------------------------
# Checkpoints trained here: rebuild the network from the config its task recorded
# --------------------------------------------------------------------------------------------------
# _target_ prefixes a checkpoint may name without trusted=True (a _target_ is code the loader calls)
_TRUSTED_TARGETS = ("attn_zoo.", "attn_ops.", "torch.nn.")


def _import_target(path: str, trusted: bool) -> Callable:
    import importlib

    if not trusted and not path.startswith(_TRUSTED_TARGETS):
        raise ZooCheckpointError(
            f"_target_ {path!r} is outside {_TRUSTED_TARGETS}: pass trusted=True to build it (it runs that code)"
        )
    module, _, name = path.rpartition(".")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ZooCheckpointError(f"_target_ {path!r} cannot be imported: {e}") from e
    return obj


def build_network(config: Mapping[str, Any], *, trusted: bool = False) -> nn.Module:
    """Build a module from a Hydra-style config (``{"_target_": "attn_zoo.models....", **kwargs}``, nested
    ``_target_`` dicts built first) without Hydra: what a task records as ``net_config``. Other ``_``-keys
    (``_partial_``, ``_recursive_``) are refused; targets outside ``attn_zoo.``/``attn_ops.``/``torch.nn.``
    need ``trusted=True``."""

    def build(node: Any, where: str) -> Any:
        if isinstance(node, Mapping):
            if "_target_" not in node:
                return {k: build(v, f"{where}.{k}") for k, v in node.items()}
            extra = sorted(k for k in node if str(k).startswith("_") and k != "_target_")
            if extra:
                raise ZooCheckpointError(f"net config {where} uses {extra}: only plain _target_ calls are rebuilt")
            fn = _import_target(str(node["_target_"]), trusted)
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


def load_checkpoint(
    path: PathLike, map_location: Any = "cpu", *, attention: Any = None, task: bool = False, trusted: bool = False,
) -> nn.Module:
    """Rebuild a network (or with ``task=True`` its LightningModule) from a checkpoint trained here.

        net = load_checkpoint("logs/train/runs/X/checkpoints/last.ckpt", attention="torch").eval()
        out = net(batch)

    The task saved the net's config (``hyper_parameters["net_config"]``); the net is built from it with
    ``build_network`` and its weights loaded strictly. ``attention`` replaces the recorded attention
    config (a run trained with triton on a GPU, reloaded on a CPU). ``task=True`` returns the task class
    the checkpoint names, without an optimizer (inference, evaluation; ``train.py ckpt_path=`` resumes
    training). ``trusted``: see ``build_network``.
    """
    source = repr(str(path))
    obj = _torch_load(path, map_location=map_location)
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
    net = build_network(net_config, trusted=trusted)
    _check_and_load(net, _net_state(obj["state_dict"], source), f"{source} does not match the net it records")
    if not task:
        return net
    cls_path = obj.get("attn_zoo_task")
    if not cls_path:
        raise ZooCheckpointError(f"{source} does not name its task class ('attn_zoo_task'): load the net instead")
    cls = _import_target(str(cls_path), trusted)
    kwargs = {k: v for k, v in hparams.items() if k != "net_config"}
    module = cls(net=net, **kwargs)
    module.record_net_config(net_config)
    return module


# --------------------------------------------------------------------------------------------------
# Fine-tuning: load whatever the zoo knows into an existing network
# --------------------------------------------------------------------------------------------------
def _zoo_function(name: str) -> Callable:
    """A converter of another section of this module (the ESM-2 converters), looked up when used."""
    fn = globals().get(name)
    if fn is None:
        raise ZooCheckpointError(f"attn_zoo.models.zoo.{name} is not available in this build")
    return fn


def _only_module_of(net: nn.Module, cls: type, what: str) -> nn.Module:
    found = [m for m in net.modules() if isinstance(m, cls)]
    if len(found) != 1:
        raise ZooCheckpointError(f"{what} needs exactly one {cls.__name__} inside {type(net).__name__}, found {len(found)}")
    return found[0]


def _load_hf_folder(path: Path, map_location: Any) -> Tuple[Dict[str, Tensor], Dict[str, Any]]:
    import json

    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ZooCheckpointError(f"{str(path)!r}: not a Hugging Face model folder ({config_file.name}: {e})") from e
    weights = path / "model.safetensors"
    if weights.is_file():
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ZooCheckpointError(f"{str(weights)!r} needs the safetensors package") from e
        try:
            return load_file(str(weights), device=str(map_location)), config
        except Exception as e:  # truncated or corrupt
            raise ZooCheckpointError(f"cannot read {str(weights)!r}: truncated or corrupt: {e}") from e
    bin_file = path / "pytorch_model.bin"
    if bin_file.is_file():
        return _flat_tensors(_torch_load(bin_file, map_location=map_location), repr(str(bin_file))), config
    raise ZooCheckpointError(f"{str(path)!r} has config.json but neither model.safetensors nor pytorch_model.bin")


def load_pretrained(
    path: PathLike, into: nn.Module, *, map_location: Any = "cpu", weights_only: bool = True
) -> nn.Module:
    """Load pretrained weights into an existing network ``into`` (fine-tuning), dispatching on what ``path`` is:

    - a checkpoint trained here (``.ckpt`` with the task's ``net.*`` weights): loaded into ``into``;
    - a Boltz-2 checkpoint or PairformerModule state_dict: ``from_boltz``, loaded into the one
      ``PairformerStack`` inside ``into`` (which must be ``variant="boltz2"`` of the same sizes);
    - a fair-esm ``.pt`` (a dict with ``model``): ``from_fair_esm``; a Hugging Face folder (``config.json``):
      ``from_hf_esm``; the converted module's weights are loaded into ``into``;
    - a bare state_dict of ``into`` itself (``torch.save(net.state_dict())``).

    Every key and shape is checked before anything is copied: on a ZooCheckpointError ``into`` is unchanged.
    Returns ``into``.
    """
    p = Path(path).expanduser()
    source = repr(str(p))
    if p.is_dir():
        sd, config = _load_hf_folder(p, map_location)
        converted = _zoo_function("from_hf_esm")(sd, config)
        _check_and_load(into, converted.state_dict(), f"{source} (Hugging Face ESM) does not fit {type(into).__name__}")
        return into
    obj = _torch_load(p, map_location=map_location, weights_only=weights_only)
    if _is_ours(obj):
        _check_and_load(into, _net_state(obj["state_dict"], source), f"{source} does not fit {type(into).__name__}")
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
        converted = _zoo_function("from_fair_esm")(obj["model"])
        _check_and_load(into, converted.state_dict(), f"{source} (fair-esm) does not fit {type(into).__name__}")
        return into
    if isinstance(obj, Mapping) and obj and all(isinstance(v, Tensor) for v in obj.values()):
        _check_and_load(into, obj, f"{source} (a state_dict) does not fit {type(into).__name__}")
        return into
    keys = _summarise([str(k) for k in obj], 5) if isinstance(obj, Mapping) else type(obj).__name__
    raise ZooCheckpointError(
        f"{source} is none of what the zoo loads (a checkpoint trained here, Boltz-2, fair-esm .pt, Hugging Face "
        f"folder, a state_dict of the network): {keys}"
    )
