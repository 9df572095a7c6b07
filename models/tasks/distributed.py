"""Helpers for Lightning's distributed strategies, usable from configs."""
from __future__ import annotations

import importlib


def module_classes(paths: list[str]) -> set[type]:
    """Import 'pkg.module.Class' paths -> a set of classes, the form FSDPStrategy takes for
    ``auto_wrap_policy`` and ``activation_checkpointing_policy`` (one FSDP unit per block)."""
    out = set()
    for path in paths:
        module, _, name = str(path).rpartition(".")
        if not module:
            raise ValueError(f"module_classes: {path!r} is not a 'package.module.Class' path")
        try:
            out.add(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError) as err:
            raise ValueError(f"module_classes: cannot import {path!r}: {err}") from err
    return out
