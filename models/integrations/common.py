"""The one mechanism every integration uses: an instance-level ``forward`` that leaves the module's class,
parameters, buffers and ``state_dict`` keys as they were, and that ``unpatch`` removes again."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from attn_ops import registry


@dataclass(frozen=True)
class Options:
    """What a patched module passes to ``attn_ops.attention``: the backend name and the ``deterministic`` choice."""

    backend: str = "auto"
    deterministic: bool = True

    def __post_init__(self):
        registry.validate_backend_name(self.backend)
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {type(self.deterministic).__name__}: {self.deterministic!r}")

    def kwargs(self) -> dict:
        return {"backend": self.backend, "deterministic": self.deterministic}


class PatchedForward:
    """``module.forward`` after patching: ``fn(module, options, *args, **kwargs)``.

    A plain object (not a bound method or closure) so that a patched model still deep-copies and pickles; it
    keeps the instance-level ``forward`` the module had before (usually none) for ``unpatch``."""

    def __init__(self, fn: Callable, module: nn.Module, options: Options, previous: Optional[Callable]):
        self.fn, self.module, self.options, self.previous = fn, module, options, previous

    def __call__(self, *args: Any, **kwargs: Any):
        return self.fn(self.module, self.options, *args, **kwargs)

    def original(self, *args: Any, **kwargs: Any):
        """The module's own forward (the exact path for what the patch does not serve)."""
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __repr__(self) -> str:
        return f"attn_zoo.PatchedForward({getattr(self.fn, '__qualname__', self.fn)}, {self.options})"


def modules_of(model: nn.Module, classes: tuple) -> list:
    """Every submodule of ``model`` (itself included) that is an instance of one of ``classes`` ([] for none)."""
    return [m for m in model.modules() if isinstance(m, classes)] if classes else []


def patched(module: nn.Module) -> Optional[PatchedForward]:
    """The module's patch, or None."""
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, PatchedForward) else None


def swap_forward(module: nn.Module, fn: Callable, options: Options) -> None:
    """Patch ``module`` (again, with new options, when it already is: patching is idempotent)."""
    current = patched(module)
    previous = current.previous if current is not None else module.__dict__.get("forward")
    object.__setattr__(module, "forward", PatchedForward(fn, module, options, previous))


def restore_forward(module: nn.Module) -> bool:
    """Undo :func:`swap_forward`; False when the module was not patched."""
    current = patched(module)
    if current is None:
        return False
    if current.previous is None:
        del module.__dict__["forward"]
    else:
        object.__setattr__(module, "forward", current.previous)
    return True


def original_forward(module: nn.Module) -> Callable:
    """The forward the module runs unpatched (for exact-path fallbacks)."""
    current = patched(module)
    return current.original if current is not None else module.forward
