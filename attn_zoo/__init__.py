"""attn-zoo: the installed import root of the blocks, the zoo and the training entry point.

    from attn_zoo.models.pairformer import PairformerBlock    # blocks (the repository's models/ folder)
    from attn_ops import attention                            # the op stays a top-level package of its own

The wheel installs the repository's ``models/`` and ``configs/`` folders as ``attn_zoo.models`` and
``attn_zoo.configs``, so a user's own ``models`` package is never shadowed and never shadows ours.
"""
from pathlib import Path

__version__ = "0.1.0"

_here = Path(__file__).resolve().parent
if not (_here / "models").is_dir() and (_here.parent / "models" / "__init__.py").is_file():
    # A checkout (or an editable install) keeps models/ and configs/ at the repository's top level:
    # subpackages are looked up there too, so attn_zoo.models names the same files as in the wheel.
    __path__.append(str(_here.parent))  # noqa: F821  (a package's own __path__)


def patch(model, *, backend: str = "auto", deterministic: bool = True):
    """Run ``model``'s attention (transformers, fair-esm, Boltz) on ``attn_ops.attention`` in place; see
    ``attn_zoo.models.integrations.patch``."""
    from attn_zoo.models.integrations import patch as _patch

    return _patch(model, backend=backend, deterministic=deterministic)


def unpatch(model):
    """Undo :func:`patch`; see ``attn_zoo.models.integrations.unpatch``."""
    from attn_zoo.models.integrations import unpatch as _unpatch

    return _unpatch(model)


def register_hf(backend: str = "auto", deterministic: bool = True) -> str:
    """Register ``"attn_zoo"`` in transformers' attention registry (needed before
    ``from_pretrained(..., attn_implementation="attn_zoo")``); returns the name registered."""
    from attn_zoo.models.integrations.hf import register

    return register(backend=backend, deterministic=deterministic)
