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
