"""In-place patching of other projects' models onto ``attn_ops.attention``: the only code that knows their
module layouts (one module per project: ``hf``, ``fair_esm``, ``boltz``, ``openfold``, ``openfold3``).

    import attn_zoo
    attn_zoo.patch(model)      # the model's attention modules now run attn_ops.attention
    attn_zoo.unpatch(model)    # back to the model's own forward

Patching replaces the ``forward`` of each recognised attention module on that instance only (a Hugging Face model
gets its ``attn_implementation`` set instead), of the ESM-2 layers whose GELU it fuses, and of Boltz-2's Pairformer
layers (their no-grad inference in place): classes, parameters, buffers and ``state_dict`` keys stay as they were, and
nothing is copied. Patching twice is patching once (the latest options hold); a model in which no known
module is found is refused with the list of what was looked for.
"""
from __future__ import annotations

from typing import List

from torch import nn

from . import boltz, fair_esm, hf, openfold, openfold3
from .common import Options, patched, restore_forward, swap_forward

_MODULE_PATCHERS = (fair_esm, boltz, openfold, openfold3)


def looked_for() -> List[str]:
    """Every module layout :func:`patch` recognises."""
    return [name for integ in (hf,) + _MODULE_PATCHERS for name in integ.LOOKS_FOR]


def patch(model: nn.Module, *, backend: str = "auto", deterministic: bool = True) -> nn.Module:
    """Run ``model``'s attention on ``attn_ops.attention(..., backend=backend, deterministic=deterministic)``.

    Recognises transformers models written against the attention registry, fair-esm's ``MultiheadAttention``,
    Boltz-1/2 triangle attention and attention with pair bias (and Boltz-2's Pairformer layers, whose inference
    without autograd then runs memory-bounded, in place), OpenFold's triangle and MSA attention, OpenFold3's
    triangle attention, trunk attention with pair bias and MSA attention (see :func:`looked_for`), in ``model`` itself or
    anywhere inside it (a wrapper of yours). Returns ``model``, patched in place. Raises ``TypeError`` for a model
    with none of them.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    options = Options(backend, deterministic)
    hf_models = hf.find(model)
    targets = hf.patch_targets(hf_models)
    targets += [t for integ in _MODULE_PATCHERS for t in integ.patch_targets(integ.find(model))]
    if not hf_models and not targets:
        raise TypeError(f"attn_zoo.patch: no attention module of a known layout in {type(model).__name__}. "
                        f"Looked for: {'; '.join(looked_for())}.")
    for m in hf_models:
        hf.patch_model(m, options)
    for module, fn in targets:
        swap_forward(module, fn, options)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: every patched module runs its own forward again (a no-op on an unpatched model)."""
    for m in hf.find(model):
        hf.unpatch_model(m)
    for m in model.modules():
        restore_forward(m)
    return model


def is_patched(model: nn.Module) -> bool:
    """True when some module of ``model`` runs attn_zoo's attention."""
    if any(hf.is_patched(m) for m in hf.find(model)):
        return True
    return any(patched(m) is not None for m in model.modules())


__all__ = ["patch", "unpatch", "is_patched", "looked_for", "Options"]
