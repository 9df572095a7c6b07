"""Kernel settings: the switches of the ``triton`` backend (and the ``cudnn`` backend's workspace bound) in one
object, read from the environment once.

    import attn_ops
    attn_ops.settings.get().tune                  # the current values (a frozen KernelSettings)
    attn_ops.settings.update(tune=False)          # for the rest of the process
    with attn_ops.kernel_settings(tma=False):     # for a block of code; the previous values come back after it
        ...

Four of them also have an environment variable, read when attn_ops is imported (later changes to ``os.environ``
are not seen; call :func:`reload_from_env` to read it again): the ones a run started from a command line (train.py,
torchrun, a benchmark) needs before any code of its own runs:

- ``ATTN_ZOO_CACHE_DIR=DIR`` -> ``cache_dir``: the on-disk tuning cache (default ``~/.cache/attn_zoo``; empty: none)
- ``ATTN_ZOO_NO_TUNE=1`` -> ``tune=False``: no timing, the first candidate config (the same in every process)
- ``ATTN_ZOO_COMPILE_THREADS=N`` -> ``compile_threads``: threads compiling a tuning key's candidates at once
  (default 8; 1: one after another)
- ``ATTN_ZOO_NO_TMA=1`` -> ``tma=False``: pointer loads and per-element atomics, no TMA descriptors (the way around
  a GPU, driver or Triton release whose TMA path fails, for a run that cannot change code)

The other fields are set in code only: ``shipped_configs`` (False: time every new key, ignoring the configs shipped
for this GPU model in ``triton/tuned/``), ``tune_log`` (print each timed candidate), ``fast_launch`` (False:
Triton's own launch path on every call), ``tile_variants`` (False: no kernel variants for lengths that are a
multiple of a tile, fewer compiles where many such lengths come), ``cudnn_workspace_gib`` (the largest workspace
of the ``cudnn`` backend's deterministic backward, default 2). Their former variables (``REMOVED_ENV``)
are not read; one that is set gets a warning naming the setting to use instead. ``compile_processes`` is gone
(compiles run on ``compile_threads`` threads): passing it raises a TypeError that says so.

Every field that changes which kernel or tile config runs is part of the cache keys it affects: ``tune`` of the
tuner's (untuned picks are cached apart), ``tma`` of the launchers' tuning key and, through the kernels' arguments
(a descriptor vs a tensor, HAS_BIAS), of the direct-launch cache's; ``tile_variants`` of the launch plans' and,
through the EVEN_M / EVEN_N constexprs, of the direct-launch cache's (not of the tuner's: a tile config suits
either variant).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Iterator, Mapping, Optional

__all__ = ["KernelSettings", "get", "update", "kernel_settings", "from_env", "reload_from_env", "ENV", "REMOVED_ENV"]


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """Behaviour switches of the triton kernels (see the module docstring for the four environment variables).

    tune: time the candidate tile configs of a length bucket not yet in the cache (False: the heuristic choice).
    shipped_configs: before timing, take the config shipped for this GPU model and Triton release if there is one.
    tune_log: print each timed candidate. fast_launch: call Triton's compiled kernels directly once a launch
    signature was seen. tma: TMA tensor descriptors on Hopper GPUs. cache_dir: the on-disk tuning cache's folder
    (None: no disk cache). compile_threads: on a tuning miss, the candidates compile on this many threads at once
    before they are timed (Triton's asynchronous compile mode; 1: one by one as they are timed).
    tile_variants: a length that is a multiple of a kernel's tile runs a variant compiled for it (EVEN_M / EVEN_N:
    no load masks); False: every length runs the general variant, so fewer kernels compile.
    cudnn_workspace_gib: the largest workspace the ``cudnn`` backend's deterministic backward may take (cuDNN 9 on
    Hopper keeps the scores' gradient, at most 2 bytes per query-key pair and head); the registry refuses the backend
    for inputs that would need more, named or picked by ``auto`` (which then takes triton, whose backward holds no
    score-sized buffer).
    """

    tune: bool = True
    shipped_configs: bool = True
    tune_log: bool = False
    fast_launch: bool = True
    tma: bool = True
    cache_dir: Optional[str] = None
    compile_threads: int = 8
    tile_variants: bool = True
    cudnn_workspace_gib: float = 2.0

    def __post_init__(self):
        for f in ("tune", "shipped_configs", "tune_log", "fast_launch", "tma", "tile_variants"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"KernelSettings.{f} must be a bool, got {getattr(self, f)!r}")
        if isinstance(self.compile_threads, bool) or not isinstance(self.compile_threads, int) or \
                self.compile_threads < 1:
            raise TypeError(f"KernelSettings.compile_threads must be an int >= 1, got {self.compile_threads!r}")
        if isinstance(self.cudnn_workspace_gib, bool) or not isinstance(self.cudnn_workspace_gib, (int, float)) or \
                not self.cudnn_workspace_gib >= 0:
            raise TypeError(f"KernelSettings.cudnn_workspace_gib must be a number >= 0, got {self.cudnn_workspace_gib!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"KernelSettings.cache_dir must be a path or None, got {self.cache_dir!r}")


_ENV_DATA = getattr(os.environ, "_data", None)  # POSIX: the bytes dict behind os.environ (kept in sync by it)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), read on every call (tests flip
    it); asked a dozen times per forward + backward, so a plain dict lookup where the platform allows."""
    if type(_ENV_DATA) is dict:
        return _ENV_DATA.get(b"TRITON_INTERPRET") == b"1"
    return os.environ.get("TRITON_INTERPRET") == "1"


def _default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "attn_zoo")


# The environment variables read, and the setting each one gives.
ENV = {
    "ATTN_ZOO_CACHE_DIR": "cache_dir",
    "ATTN_ZOO_NO_TUNE": "tune=False",
    "ATTN_ZOO_COMPILE_THREADS": "compile_threads",
    "ATTN_ZOO_NO_TMA": "tma=False",
}
# Variables no longer read, and the setting that replaces each one (or, without "=", what happens instead).
REMOVED_ENV = {
    "ATTN_ZOO_NO_SHIPPED": "shipped_configs=False",
    "ATTN_ZOO_TUNE_LOG": "tune_log=True",
    "ATTN_ZOO_PLAIN_LAUNCH": "fast_launch=False",
    "ATTN_ZOO_NO_TILE_VARIANTS": "tile_variants=False",
    "ATTN_ZOO_COMPILE_PROCESSES": "worker-process compiles were removed: compiles run on compile_threads threads",
}
_warned = set()  # removed variables already warned about in this process
# Fields no longer there, and why: update() and kernel_settings() refuse them with this text.
REMOVED_FIELDS = {
    "compile_processes": "worker-process compiles were removed; compiles run on threads (compile_threads)",
}


def from_env(environ: Optional[Mapping[str, str]] = None) -> KernelSettings:
    """Settings from environment variables (``os.environ`` by default); unset variables give the defaults. A set
    variable of ``REMOVED_ENV`` changes nothing and is warned about once per process."""
    env = os.environ if environ is None else environ
    for name, setting in REMOVED_ENV.items():
        if name in env and name not in _warned:
            _warned.add(name)
            instead = f"set it in code instead: attn_ops.settings.update({setting}) or " \
                f"`with attn_ops.kernel_settings({setting}):`" if "=" in setting else setting
            warnings.warn(f"{name}={env[name]!r} is set but no longer read (environment variables: "
                          f"{', '.join(ENV)}); {instead}", UserWarning, stacklevel=2)
    cache_dir = env.get("ATTN_ZOO_CACHE_DIR")
    if cache_dir is None:
        cache_dir = _default_cache_dir()
    return KernelSettings(
        tune=env.get("ATTN_ZOO_NO_TUNE") != "1",
        tma=env.get("ATTN_ZOO_NO_TMA") != "1",
        cache_dir=cache_dir or None,
        compile_threads=_env_int(env, "ATTN_ZOO_COMPILE_THREADS", 8),
    )


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


_current = from_env()


def get() -> KernelSettings:
    """The settings in force now."""
    return _current


def update(**changes) -> KernelSettings:
    """Replace some fields for the rest of the process; returns the new settings. Unknown names: TypeError."""
    global _current
    fields = {f.name for f in dataclasses.fields(KernelSettings)}
    gone = [f"{name}: {why}" for name, why in REMOVED_FIELDS.items() if name in changes]
    if gone:
        raise TypeError(f"removed kernel setting(s): {'; '.join(gone)}")
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(f"unknown kernel setting(s) {unknown}; known: {sorted(fields)}")
    _current = dataclasses.replace(_current, **changes)
    return _current


def reload_from_env() -> KernelSettings:
    """Read the environment variables again (e.g. after a test changed them)."""
    global _current
    _current = from_env()
    return _current


@contextlib.contextmanager
def kernel_settings(**changes) -> Iterator[KernelSettings]:
    """``with kernel_settings(tune=False): ...``: the changed settings inside the block, the previous ones after it
    (also when the block raises)."""
    global _current
    previous = _current
    try:
        yield update(**changes)
    finally:
        _current = previous
