"""The one mechanism every integration uses: an instance-level ``forward`` that leaves the module's class,
parameters, buffers and ``state_dict`` keys as they were, and that ``unpatch`` removes again."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from attn_ops import registry

from .. import primitives

# Modules of other projects whose Linear and LayerNorm compute what PyTorch's do under its autocast rules (a Linear
# whose ``precision`` is None; a LayerNorm over the last dim, float32 statistics): the fused paths may stand in for
# them. Any other subclass (its own forward: LoRA, quantised layers) keeps being called as it is.
_TORCH_SEMANTICS = frozenset({
    "boltz.model.layers.triangular_attention.primitives",  # OpenFold's Linear / LayerNorm as Boltz vendors them
    "openfold3.core.model.primitives.linear",
    "openfold3.core.model.primitives.normalization",
})


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


def plain_linear(m: nn.Module) -> bool:
    """Whether ``m(x)`` is ``nn.functional.linear(x, m.weight, m.bias)`` under autocast's rules."""
    return isinstance(m, nn.Linear) and (type(m).forward is nn.Linear.forward or (
        type(m).__module__ in _TORCH_SEMANTICS and getattr(m, "precision", 0) is None))


def plain_layer_norm(m: nn.Module) -> bool:
    """Whether ``m`` is an affine layer norm over the last dim that ``primitives.layer_norm`` may compute."""
    if isinstance(m, nn.LayerNorm):
        return type(m).forward is nn.LayerNorm.forward and len(m.normalized_shape) == 1
    return type(m).__module__ in _TORCH_SEMANTICS and type(m).__name__ == "LayerNorm" and \
        getattr(m, "weight", None) is not None and getattr(m, "bias", None) is not None


def fusable(x: Tensor, linears) -> bool:
    """Whether one matmul on the concatenated weights (``primitives.fused_linear``) computes ``[l(x) for l in
    linears]``: plain linears of one dtype, and autocast on or ``x`` in their dtype (OpenFold's Linear would cast its
    weight to a bf16 input's dtype itself)."""
    dtype = linears[0].weight.dtype
    return all(plain_linear(m) and m.weight.dtype == dtype for m in linears) and (
        x.dtype == dtype or torch.is_autocast_enabled(x.device.type))


def layer_norm(m: nn.Module, x: Tensor) -> Tensor:
    """``m(x)``: by ``primitives.layer_norm`` (under autocast the autocast dtype, Triton kernels on eager CUDA) where
    ``m`` is a plain layer norm and autocast is on or ``x`` has its dtype, else the module itself."""
    if plain_layer_norm(m) and (x.dtype == m.weight.dtype or torch.is_autocast_enabled(x.device.type)):
        return primitives.layer_norm(m, x)
    return m(x)
