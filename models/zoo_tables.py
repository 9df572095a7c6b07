"""Per-block weight tables shared by the zoo's Pairformer loaders (OpenFold3, Protenix).

A table lists, for one block, our parameter and the foreign parameter(s) it is made of: one source is the same
tensor; several are concatenated along dim 0 (our ``[a | b]`` projections are one linear where others keep two).
:func:`convert` reads a foreign stack's state dict through a table and reports every missing, unexpected,
misshapen or non-float entry at once; :func:`export` writes ours back under the foreign names.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .zoo_files import ZooCheckpointError, _mismatch_report, _summarise, read_checkpoint

Tensor = torch.Tensor
Table = Sequence[Tuple[str, Tuple[str, ...]]]


def read_source(obj: Any, what: str, map_location: Any, trust_file: bool) -> Tuple[Mapping[str, Any], str]:
    """A state dict and a name for messages, from a path (read as data), a module or a mapping; a checkpoint's
    ``state_dict`` / ``model`` / ``ema`` entry (Lightning, Protenix and DeepSpeed-style files) is unwrapped."""
    if isinstance(obj, (str, os.PathLike)):
        source = repr(os.fspath(obj))
        obj = read_checkpoint(obj, map_location=map_location, trust_file=trust_file)
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
            what: str) -> Dict[str, Tensor]:
    """Foreign ``blocks.i.<theirs>`` -> our ``blocks.i.<ours>`` (``target``: our state dict, for the shapes); every
    missing, unexpected, misshapen or non-float entry is reported at once in a ZooCheckpointError."""
    out: Dict[str, Tensor] = {}
    used, missing, shapes, dtypes = set(), [], [], []
    for i in range(blocks):
        for ours, theirs in table:
            want = tuple(target[f"blocks.{i}.{ours}"].shape)
            parts = []
            for t in theirs:
                key = f"blocks.{i}.{t}"
                used.add(key)
                w = (want[0] // len(theirs),) + want[1:]  # each source holds its share of dim 0
                v = sd.get(key)
                if key not in sd:
                    missing.append(key)
                elif not isinstance(v, Tensor) or not v.is_floating_point():
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


def export(stack: nn.Module, table: Table) -> Dict[str, Tensor]:
    """Our stack's weights under the foreign names (``blocks.i.<theirs>``), each its own copy."""
    sd = stack.state_dict()
    out: Dict[str, Tensor] = {}
    for i in range(len(stack.blocks)):
        for ours, theirs in table:
            for t, p in zip(theirs, sd[f"blocks.{i}.{ours}"].chunk(len(theirs), dim=0)):
                out[f"blocks.{i}.{t}"] = p.clone()
    return out
