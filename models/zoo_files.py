"""Reading other projects' weight files safely and checking them: the errors, the one ``torch.load`` of the
project (:func:`read_checkpoint`) and key/shape checks shared by every converter of the zoo."""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

Tensor = torch.Tensor
PathLike = Union[str, "os.PathLike[str]"]


class ZooCheckpointError(ValueError):
    """A checkpoint that cannot be converted: unreadable or truncated file, another model's weights, missing
    or unexpected keys, wrong shapes. The message names the file (if any), the keys and the shapes seen."""


class UnsafeCheckpointError(ZooCheckpointError):
    """A checkpoint refused because reading it would unpickle Python objects (run code): not a damaged file, so a
    caller that falls back to another checkpoint over damage stops here and shows the whole message. ``globals``:
    the dotted names of what the file would have unpickled."""

    def __init__(self, message: str, globals: Sequence[str] = ()):
        super().__init__(message)
        self.globals = list(globals)


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------
# Globals a checkpoint may name beyond torch's own weights-only set (tensors, storages, OrderedDict, dtypes):
# fair-esm pickles its config as an argparse.Namespace. Checkpoints trained here hold plain values only.
SAFE_GLOBALS: Tuple[type, ...] = (argparse.Namespace,)

# Modules whose functions run code rather than hold data: a file naming one is never a checkpoint to allow.
_CODE_MODULES = ("builtins", "os", "posix", "nt", "subprocess", "io", "_io", "sys", "shutil", "importlib", "runpy",
                 "pickle", "_pickle", "marshal", "types", "codecs", "ctypes", "socket", "webbrowser", "pty",
                 "functools", "operator", "code", "pdb")


def _allowed(allow_globals: Any) -> List[Any]:
    """``allow_globals`` as a list of classes / functions, or a TypeError naming the bad entry: a name (a string)
    is no object of your code, and a file must never get to choose by name what is allowed."""
    if isinstance(allow_globals, (str, bytes)) or not isinstance(allow_globals, Iterable):
        raise TypeError(f"allow_globals must be a list of classes or functions (the objects, imported by your code), "
                        f"got {type(allow_globals).__name__} {allow_globals!r}")
    out = list(allow_globals)
    for g in out:
        if not (callable(g) and isinstance(getattr(g, "__module__", None), str)
                and isinstance(getattr(g, "__qualname__", None), str)):
            raise TypeError(f"allow_globals entries must be classes or functions (the objects, imported by your "
                            f"code), got {type(g).__name__} {g!r}")
    return out


def data_only(allow_globals: Sequence[Any]):
    """The context every load of a user's file runs in: :data:`SAFE_GLOBALS` and the caller's ``allow_globals``
    (checked by :func:`_allowed`) are all a ``weights_only=True`` unpickler may build."""
    return torch.serialization.safe_globals([*SAFE_GLOBALS, *_allowed(allow_globals)])


def _global_name(g: Any) -> str:
    return f"{g.__module__}.{g.__qualname__}"


def read_checkpoint(path: PathLike, map_location: Any = "cpu", *, allow_globals: Sequence[Any] = (),
                    mmap: bool = False) -> Any:
    """The project's one ``torch.load``: ``weights_only=True`` with :data:`SAFE_GLOBALS` allowed, so a file is
    read as data and never runs code. Failures become ``ZooCheckpointError`` naming the file.

    allow_globals: classes your file pickles, named by your code (``[mymodule.MyConfig]``, the objects, not
        strings); the file still cannot name anything else. They are allowed for this call only
        (``torch.serialization.safe_globals``) and the file is still read with ``weights_only=True``.

    A file that names any other class or function raises :class:`UnsafeCheckpointError` listing them.
    """
    extra = _allowed(allow_globals)
    path = Path(path).expanduser()
    if not path.is_file():
        raise ZooCheckpointError(f"checkpoint {str(path)!r} does not exist or is not a file")
    try:
        with data_only(extra):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, garbage bytes, pickled code refused by weights_only
        text = str(e)
        msg = text.splitlines()[0] if text else type(e).__name__
        if not _looks_like_torch_save(path):  # a text file, an image: its bytes read as pickle opcodes
            raise ZooCheckpointError(
                f"cannot read checkpoint {str(path)!r} ({path.stat().st_size} bytes): truncated, corrupt or not a "
                f"torch checkpoint: neither a torch.save zip archive nor a pickle, it starts {_head(path)!r}") from None
        if isinstance(e, pickle.UnpicklingError) and "weights_only" in text.lower():
            names = _unsafe_names(path, text, extra)
            raise UnsafeCheckpointError(_refusal(path, names), names) from None
        raise ZooCheckpointError(
            f"cannot read checkpoint {str(path)!r} ({path.stat().st_size} bytes): truncated, corrupt or not a "
            f"torch checkpoint: {type(e).__name__}: {msg}"
        ) from e


def _unsafe_names(path: Path, text: str, extra: Sequence[Any]) -> List[str]:
    """The globals the file names beyond those allowed: every one of a zip checkpoint (listed without running
    anything), else the one torch's refusal names."""
    allowed = {_global_name(g) for g in (*SAFE_GLOBALS, *extra)}
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # a legacy (non-zip) pickle: torch's message names the first
        names = re.findall(r"GLOBAL ([\w.]+)", text)[:1]
    return sorted(n for n in set(names) if n not in allowed)


def _refusal(path: Path, names: Sequence[str]) -> str:
    """What the file names, and the two ways on: allow your own classes from code, or re-save plain tensors."""
    code = [n for n in names if n.split(".")[0] in _CODE_MODULES]
    data = [n for n in names if n not in code] or ([] if code else ["yourmodule.YourClass"])
    what = f" ({_summarise(names, 4)})" if names else ""
    never = (f" {_summarise(code, 4)} {'run' if len(code) > 1 else 'runs'} code, not data: never allow "
             f"{'them' if len(code) > 1 else 'it'};" if code else "")
    allow = (f" if the file pickles classes of your own code, allow them from your code: "
             f"allow_globals=[{', '.join(data[:4])}] (every loader takes it; the file still cannot name anything "
             f"else); or" if data else "")
    return (f"refused to unpickle Python objects{what} in {str(path)!r}: a checkpoint should hold tensors and plain "
            f"values, and unpickling objects can run code;{never}{allow} re-save the checkpoint as plain tensors "
            f"and values (torch.save(model.state_dict(), path))")


def _head(path: Path, n: int = 16) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _looks_like_torch_save(path: Path) -> bool:
    """A torch.save zip archive (maybe truncated), or a legacy / plain pickle (protocol 2+ starts with 0x80)."""
    head = _head(path, 4)
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


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


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__


def _first_keys(keys: Iterable[str], n: int = 6) -> str:
    keys = sorted(keys)
    return str(keys[:n])[:-1] + (f", ... ({len(keys)} keys)]" if len(keys) > n else "]")


def _check_state(expected: Mapping[str, Tensor], got: Mapping[str, Any], source: str) -> None:
    """Raise ZooCheckpointError listing every missing key, unexpected key, non-tensor value and shape
    mismatch of ``got`` against ``expected`` (both in this project's key names)."""
    problems = []
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for k in sorted(set(expected) & set(got)):
        v = got[k]
        if not isinstance(v, Tensor):
            problems.append(f"{k} is a {type(v).__name__}, not a tensor")
        elif v.shape != expected[k].shape:
            problems.append(f"{k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}")
        elif not v.is_floating_point():
            problems.append(f"{k} has dtype {v.dtype}, expected a float tensor")
    if problems:
        raise ZooCheckpointError(f"{source}: " + "; ".join(problems))


def _hf_state(obj: Any, what: str,
              allow_globals: Sequence[Any] = ()) -> Tuple[Mapping[str, Any], Optional[Dict[str, Any]], str]:
    """(state_dict, the folder's config.json or None, a name for messages) of a Hugging Face folder, a file or a
    state_dict given as it is."""
    source, file_cfg = f"{what} state_dict", None
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        source = f"{what} checkpoint {path!r}"
        if os.path.isdir(path):
            obj, file_cfg = _hf_read_folder(path, allow_globals)
        else:
            obj = read_checkpoint(path, allow_globals=allow_globals)
    if not isinstance(obj, Mapping):
        raise ZooCheckpointError(f"{source}: expected a state_dict, got {type(obj).__name__}")
    return obj, file_cfg, source


def _hf_read_folder(folder: str,
                    allow_globals: Sequence[Any] = ()) -> Tuple[Dict[str, Tensor], Optional[Dict[str, Any]]]:
    """Weights (``model.safetensors``, sharded safetensors or ``pytorch_model.bin``) and ``config.json``."""
    config = None
    cfg_path = os.path.join(folder, "config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path) as f:
                config = json.load(f)
        except ValueError as e:
            raise ZooCheckpointError(f"cannot parse {cfg_path!r}: {e}") from e
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index) or os.path.isfile(single):
        from safetensors.torch import load_file  # a dependency of transformers, only needed here

        try:
            if os.path.isfile(index):
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            else:
                shards = ["model.safetensors"]
            sd: Dict[str, Tensor] = {}
            for s in shards:
                sd.update(load_file(os.path.join(folder, s), device="cpu"))
        except Exception as e:
            raise ZooCheckpointError(f"cannot read the safetensors weights in {folder!r} (truncated?): "
                                     f"{type(e).__name__}: {e}") from e
        return sd, config
    bin_path = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        return read_checkpoint(bin_path, allow_globals=allow_globals), config
    raise ZooCheckpointError(f"{folder!r} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")
