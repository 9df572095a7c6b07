"""Kernel launches that skip Triton's per-call argument binding once a launch signature has been seen.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument on each call (Triton 3.6 on an H100
host: ~31-42 us for the ~45 arguments of these kernels, 41 native specialisation calls each), and a small shape's
step is bound by such host time (triangle ``[1,256,4,256,32]``: five launches per forward + backward).
:func:`launch` keeps the compiled kernel Triton returned for a launch signature and calls it directly the next
time (~11 us). The signature holds everything Triton specialises on: the constexprs, warps and stages, the value
of every scalar argument and each tensor argument's dtype and 16-byte alignment; and the current device, since a
compiled kernel's handle is loaded for the device it was launched on. A new value of any of them goes through
Triton's own path again (which finds its cached binary) and is remembered too.

The direct call passes the arguments in the kernel's parameter order, constexprs included, as Triton's own
``JITFunction.run`` does in 3.x; kernels whose constexprs are not the trailing parameters, the CPU interpreter
(``TRITON_INTERPRET=1``) and Triton versions whose launch does not return a compiled kernel take the plain path.
``ATTN_ZOO_PLAIN_LAUNCH=1`` forces the plain path (for comparison).
"""
from __future__ import annotations

import os
from typing import Dict, Sequence, Tuple

import torch

from .tuning import interpreting

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

_COMPILED: Dict[Tuple, object] = {}
_TRAILING: Dict[object, int] = {}  # kernel -> number of leading non-constexpr params (-1: not trailing)


def _leading_params(kernel) -> int:
    n = _TRAILING.get(kernel)
    if n is None:
        flags = [bool(getattr(p, "is_constexpr", False)) for p in getattr(kernel, "params", ())]
        n = flags.index(True) if True in flags else len(flags)
        if not flags or any(not f for f in flags[n:]):
            n = -1  # a constexpr between runtime params: the plain path
        _TRAILING[kernel] = n
    return n


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if TensorDescriptor is not None and isinstance(a, TensorDescriptor):
        # specialised on the base's dtype and the block shape; shape and strides are runtime values of the
        # descriptor that Triton's launcher encodes on every call
        return TensorDescriptor, a.base.dtype, tuple(a.block_shape), a.padding
    return type(a), a


def signature(args: Sequence) -> Tuple:
    """What Triton specialises a launch on, from the runtime arguments: each tensor's dtype and whether its data
    pointer is 16-byte aligned; a tensor descriptor's dtype and block shape; the scalars with their type (the value
    decides int32 vs int64, divisibility by 16 and the value-1 specialisation; the type keeps True, 1 and 1.0
    apart, which compare equal in Python)."""
    return tuple(_arg_key(a) for a in args)


def _device() -> int:
    """The device Triton launches on (its current CUDA device)."""
    return torch.cuda.current_device()


def launch(kernel, grid: Tuple[int, ...], args: Sequence, num_warps: int, num_stages: int, **constexprs) -> None:
    """``kernel[grid](*args, num_warps=.., num_stages=.., **constexprs)``, directly on a remembered compiled kernel
    when this launch signature was seen before. ``args`` are the runtime params in order; ``constexprs`` must be
    exactly the kernel's trailing constexpr params, in order."""
    if interpreting() or os.environ.get("ATTN_ZOO_PLAIN_LAUNCH") == "1":
        kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
        return
    key = (kernel, _device(), num_warps, num_stages, tuple(constexprs.values()), signature(args))
    compiled = _COMPILED.get(key)
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    if compiled is not None:
        compiled[grid3](*args, *constexprs.values())
        return
    result = kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
    if _leading_params(kernel) == len(args) and len(args) + len(constexprs) == len(kernel.params) and all(
            p.name == name for p, name in zip(kernel.params[len(args):], constexprs)) and hasattr(
            result, "__getitem__"):
        _COMPILED[key] = result
