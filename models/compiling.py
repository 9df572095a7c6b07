"""``torch.compile`` for the blocks, with the Inductor setting they need to train through many protein lengths.

    from attn_zoo.models.compiling import compile_module
    block = compile_module(PairformerBlock(...))                      # torch.compile(block) plus the setting
    block = compile_module(block, dynamic=True)                       # any torch.compile keyword
    block = compile_module(block, mode="reduce-overhead")             # modes become their Inductor options

With PyTorch 2.11 on CUDA, Inductor's memory-coalescing analysis asserts (``get_pw_red_splits``) when it first
meets a Pairformer or Evoformer block at a symbolic length, the second length of a crop-based run; with the analysis
off, the same blocks compile once more and serve every later length (docs/compile.md has the measurements and a
minimal repro). The analysis only picks tilings, so turning it off changes speed, never results.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

#: Inductor options every compile of the blocks gets (``torch.compile(options=...)`` keys).
INDUCTOR_OPTIONS: Dict[str, Any] = {"triton.coalesce_tiling_analysis": False}


def compile_options(mode: str | None = None, options: Dict[str, Any] | None = None,
                    dynamic: bool | None = None) -> Dict[str, Any]:
    """The ``options`` dict for ``torch.compile``: ``mode``'s own options (``torch.compile`` takes a mode or
    options, not both), then ``INDUCTOR_OPTIONS``, then the caller's ``options`` (which win)."""
    from torch._inductor import list_mode_options

    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"mode must be a string such as 'reduce-overhead', got {type(mode).__name__}")
    try:
        from_mode = list_mode_options(mode or "default", dynamic)
    except RuntimeError as e:  # an unknown mode
        raise ValueError(f"mode {mode!r} is not a torch.compile mode: {e}") from e
    return {**from_mode, **INDUCTOR_OPTIONS, **(options or {})}


def compile_module(module: nn.Module, *, in_place: bool = False, mode: str | None = None,
                   options: Dict[str, Any] | None = None, **kwargs: Any):
    """``torch.compile(module, ...)`` with ``INDUCTOR_OPTIONS`` added (keywords as ``torch.compile``'s). ``in_place``:
    ``module.compile(...)`` instead, keeping the module object and its ``state_dict`` keys; returns ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if kwargs.get("backend", "inductor") == "inductor":
        kwargs["options"] = compile_options(mode, options, kwargs.get("dynamic"))
    else:  # other backends take torch.compile's own mode/options, no Inductor ones
        kwargs.update({k: v for k, v in (("mode", mode), ("options", options)) if v is not None})
    if in_place:
        module.compile(**kwargs)
        return module
    return torch.compile(module, **kwargs)
