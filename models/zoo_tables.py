"""Per-block weight tables shared by the zoo's Pairformer loaders (OpenFold3, Protenix).

A table lists, for one block, our parameter and the foreign parameter(s) it is made of: one source is the same
tensor; several are concatenated along dim 0 (our ``[a | b]`` projections are one linear where others keep two).
:func:`convert` reads a foreign stack's state dict through a table and reports every missing, unexpected,
misshapen or non-float entry at once; :func:`export` writes ours back under the foreign names.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .zoo_files import ZooCheckpointError, _mismatch_report, _summarise, read_checkpoint

Tensor = torch.Tensor
Row = Tuple[str, Tuple[str, ...]]
Table = Sequence[Row]
_TRI_MUL = ("tri_mul_out", "tri_mul_in")
_TRI_ATT = ("tri_att_start", "tri_att_end")


def tri_att_rows(pre: str, bias: str) -> List[Row]:
    """The triangle attentions' rows: theirs under ``pre`` (``""`` or ``"pair_stack."``), the pair-bias projection
    named ``bias``."""
    return ([(f"{tri}.layer_norm.{p}", (f"{pre}{tri}.layer_norm.{p}",)) for tri in _TRI_ATT for p in ("weight", "bias")]
            + [(f"{tri}.linear_bias.weight", (f"{pre}{tri}.{bias}.weight",)) for tri in _TRI_ATT]
            + [(f"{tri}.mha.linear_{x}.weight", (f"{pre}{tri}.mha.linear_{x}.weight",))
               for tri in _TRI_ATT for x in "qkvgo"])


def transition_rows(pairs: Sequence[Tuple[str, str]], norm: str, a: str, b: str, out: str) -> List[Row]:
    """SwiGLU transitions' rows, for each (ours, theirs) module: their layer norm ``norm``, the ``a`` and ``b``
    projections (our ``linear_ab``) and the output projection ``out``."""
    return [item for ours, theirs in pairs for item in (
        (f"{ours}.layer_norm.weight", (f"{theirs}.{norm}.weight",)),
        (f"{ours}.layer_norm.bias", (f"{theirs}.{norm}.bias",)),
        (f"{ours}.linear_ab.weight", (f"{theirs}.{a}.weight", f"{theirs}.{b}.weight")),
        (f"{ours}.linear_out.weight", (f"{theirs}.{out}.weight",)),
    )]


def pairformer_table(pre: str, tri_att_bias: str, transitions: Sequence[Tuple[str, str]],
                     transition_parts: Tuple[str, str, str, str], pair_bias: str, pair_bias_parts: Tuple[str, ...]
                     ) -> Tuple[Row, ...]:
    """The table of a block laid out as AF3's with split triangle projections (OpenFold3's, Protenix's): the pair
    track under ``pre``; the single attention under ``pair_bias`` with its (layer norm s, layer norm z, pair-bias
    projection, attention) named ``pair_bias_parts``."""
    ln_s, ln_z, lin_z, mha = (f"{pair_bias}.{n}" for n in pair_bias_parts)
    return tuple(
        [
            (f"{tri}.{ours}.weight", tuple(f"{pre}{tri}.{t}.weight" for t in theirs))
            for tri in _TRI_MUL
            for ours, theirs in (("linear_ab_p", ("linear_a_p", "linear_b_p")),
                                 ("linear_ab_g", ("linear_a_g", "linear_b_g")),
                                 ("linear_z", ("linear_z",)), ("linear_g", ("linear_g",)))
        ]
        + [(f"{tri}.{ln}.{p}", (f"{pre}{tri}.{ln}.{p}",)) for tri in _TRI_MUL
           for ln in ("layer_norm_in", "layer_norm_out") for p in ("weight", "bias")]
        + tri_att_rows(pre, tri_att_bias)
        + transition_rows(transitions, *transition_parts)
        + [
            ("attention_pair_bias.layer_norm_s.weight", (f"{ln_s}.weight",)),
            ("attention_pair_bias.layer_norm_s.bias", (f"{ln_s}.bias",)),
            ("attention_pair_bias.layer_norm_z.weight", (f"{ln_z}.weight",)),
            ("attention_pair_bias.layer_norm_z.bias", (f"{ln_z}.bias",)),
            ("attention_pair_bias.linear_z.weight", (f"{lin_z}.weight",)),
            ("attention_pair_bias.mha.linear_q.bias", (f"{mha}.linear_q.bias",)),
        ]
        + [(f"attention_pair_bias.mha.linear_{x}.weight", (f"{mha}.linear_{x}.weight",)) for x in "qkvgo"]
    )


def read_source(obj: Any, what: str, map_location: Any,
                allow_globals: Sequence[Any] = ()) -> Tuple[Mapping[str, Any], str]:
    """A state dict and a name for messages, from a path (read as data), a module or a mapping; a checkpoint's
    ``state_dict`` / ``model`` / ``module`` entry (Lightning, Protenix and DeepSpeed-style files) is unwrapped."""
    if isinstance(obj, (str, os.PathLike)):
        source = repr(os.fspath(obj))
        obj = read_checkpoint(obj, map_location=map_location, allow_globals=allow_globals)
    elif isinstance(obj, nn.Module):
        return obj.state_dict(), f"the {type(obj).__name__} module"
    else:
        source = "the state dict"
    if not isinstance(obj, Mapping):
        raise ZooCheckpointError(f"{source} holds a {type(obj).__name__}, not {what} state dict or checkpoint")
    for key in ("state_dict", "model", "module"):
        if isinstance(obj.get(key), Mapping):
            return obj[key], f"{source}[{key!r}]"
    return obj, source


def find_prefix(keys: Sequence[str], marker: str, trunk: str, what: str, source: str,
                prefix: Optional[str] = None) -> str:
    """The prefix under which ``marker`` (a key of block 0) sits. Several stacks in one file (a trunk and a head's):
    the shortest prefix ending in ``trunk`` (``pairformer_stack.``, optionally ``_orig_mod.`` after it), unless
    ``prefix`` names one."""
    found = sorted({k[: -len(marker)] for k in keys if k.endswith(marker)}, key=len)
    if prefix is not None:
        if prefix not in found:
            raise ZooCheckpointError(f"{source}: nothing under prefix {prefix!r} (no {prefix + marker!r}); "
                                     f"{what} found under: {found or 'none'}")
        return prefix
    if not found:
        raise ZooCheckpointError(f"{source} is not {what}: no key ending in {marker!r}; its first keys: "
                                 f"{_summarise(sorted(keys), 5)}")
    if len(found) == 1:
        return found[0]
    trunks = [p for p in found if re.search(rf"(^|\.){re.escape(trunk)}(_orig_mod\.)?$", p)]
    if not trunks:
        raise ZooCheckpointError(f"{source} holds several {what} stacks ({found}): pass prefix= to pick one")
    return trunks[0]


def sub_dict(sd: Mapping[str, Any], prefix: str) -> Dict[str, Any]:
    """The entries under ``prefix`` (stripped) whose rest starts with ``blocks.``: one stack's state dict."""
    return {k[len(prefix):]: v for k, v in sd.items() if isinstance(k, str) and k.startswith(prefix + "blocks.")}


def num_blocks(sd: Mapping[str, Any]) -> int:
    return max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))) + 1


def convert(sd: Mapping[str, Any], target: Mapping[str, Tensor], table: Table, blocks: int, source: str,
            what: str, *, layers: str = "blocks", floats_only: bool = True) -> Dict[str, Tensor]:
    """Foreign ``<layers>.i.<theirs>`` -> our ``blocks.i.<ours>`` (``target``: our state dict, for the shapes); every
    missing, unexpected, misshapen or (with ``floats_only``) non-float entry is reported at once in a
    ZooCheckpointError."""
    out: Dict[str, Tensor] = {}
    used, missing, shapes, dtypes = set(), [], [], []
    for i in range(blocks):
        for ours, theirs in table:
            want = tuple(target[f"blocks.{i}.{ours}"].shape)
            parts = []
            for t in theirs:
                key = f"{layers}.{i}.{t}"
                used.add(key)
                w = (want[0] // len(theirs),) + want[1:]  # each source holds its share of dim 0
                v = sd.get(key)
                if key not in sd:
                    missing.append(key)
                elif floats_only and (not isinstance(v, Tensor) or not v.is_floating_point()):
                    dtypes.append(f"{key} ({v.dtype if isinstance(v, Tensor) else type(v).__name__})")
                elif tuple(v.shape) != w:
                    shapes.append(f"{key} {tuple(v.shape)} (expected {w})")
                else:
                    parts.append(v)
            if len(parts) == len(theirs):
                out[f"blocks.{i}.{ours}"] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    unexpected = sorted(set(sd) - used)
    report = _mismatch_report(missing, unexpected, shapes, f"{source} does not match {what}")
    if dtypes:
        report = (report + "; " if report else f"{source} does not match {what}: ") + \
            f"{len(dtypes)} non-float entr(ies): {_summarise(dtypes)}"
    if report:
        raise ZooCheckpointError(report)
    return out


def export(stack: nn.Module, table: Table, layers: str = "blocks") -> Dict[str, Tensor]:
    """Our stack's weights under the foreign names (``<layers>.i.<theirs>``), each its own copy."""
    sd = stack.state_dict()
    out: Dict[str, Tensor] = {}
    for i in range(len(stack.blocks)):
        for ours, theirs in table:
            for t, p in zip(theirs, sd[f"blocks.{i}.{ours}"].chunk(len(theirs), dim=0)):
                out[f"{layers}.{i}.{t}"] = p.clone()
    return out


def shape_reader(sd: Mapping[str, Any], source: str) -> Callable[[str], Tuple[int, ...]]:
    """``shape(key)``: the shape of the tensor ``sd[key]``, or a ZooCheckpointError naming the key."""
    def shape(key: str) -> Tuple[int, ...]:
        v = sd.get(key)
        if not isinstance(v, Tensor):
            raise ZooCheckpointError(f"{source}: missing {key!r} (needed to read the Pairformer's sizes)")
        return tuple(v.shape)

    return shape


def load_stack(obj: Any, *, what: str, marker: str, table: Table,
               sizes: Callable[[Dict[str, Any], str], Dict[str, int]], variant: str, attention: Any,
               prefix: Optional[str], pair_dropout: float, checkpoint_every: int, chunk_size: Optional[int],
               map_location: Any, allow_globals: Sequence[Any] = ()) -> nn.Module:
    """A foreign trunk stack (path, module or state dict) -> ``PairformerStack(variant=variant)`` in eval mode: the
    stack found by ``marker`` (see :func:`find_prefix`), sized by ``sizes``, read through ``table``."""
    from .pairformer import PairformerStack

    sd, source = read_source(obj, what, map_location, allow_globals)
    keys = [k for k in sd if isinstance(k, str)]
    pre = find_prefix(keys, marker, "pairformer_stack.", what, source, prefix)
    sd, source = sub_dict(sd, pre), f"{source} (prefix {pre!r})" if pre else source
    found = sizes(sd, source)
    kwargs = dict(**found, pair_dropout=pair_dropout, checkpoint_every=checkpoint_every, chunk_size=chunk_size,
                  variant=variant)
    with torch.device("meta"):  # the expected shapes, before anything is allocated
        target = PairformerStack(**kwargs).state_dict()
    converted = convert(sd, target, table, found["num_blocks"], source, what)
    stack = PairformerStack(**kwargs, attention=attention)
    stack.load_state_dict(converted, strict=True)
    return stack.eval()


def export_stack(stack: nn.Module, table: Table, variant: str, caller: str) -> Dict[str, Tensor]:
    """:func:`export` of a ``PairformerStack(variant=variant)``; any other module is a TypeError naming ``caller``."""
    from .pairformer import PairformerStack

    if not isinstance(stack, PairformerStack) or any(b.variant != variant for b in stack.blocks):
        raise TypeError(f"{caller} needs a PairformerStack built with variant={variant!r}, got "
                        f"{type(stack).__name__}")
    return export(stack, table)
