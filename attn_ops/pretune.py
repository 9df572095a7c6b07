"""``pretune``: time the triton kernels' tile configs for a list of shapes ahead of a run (filling the in-memory and
on-disk tuning caches), so that the run itself never stops to tune."""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Iterator, Optional, Sequence, Tuple

import torch

from . import settings

BIAS_KINDS = ("pair", "full", None)
MASK_KINDS = ("key", None)


def _inputs(shape: Sequence[int], dtype, device, bias: Optional[str], mask: Optional[str], grad: bool):
    """q, k, v ``shape`` (``[*batch, H, L, D]``), a bias (``"pair"``: shared over dim 1 of 5-D inputs, i.e. ``[B, 1,
    H, L, L]``; ``"full"``: ``[*batch, H, L, L]``) and a key mask ``[*batch, 1, 1, L]`` with one padded key."""
    *batch, H, L, D = shape
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype).requires_grad_(grad)

    q, k, v = rnd(*shape), rnd(*shape), rnd(*shape)
    b = m = None
    if bias == "pair":
        bb = list(batch)
        if len(bb) >= 2:
            bb[1] = 1
        b = rnd(*bb, H, L, L)
    elif bias == "full":
        b = rnd(*batch, H, L, L)
    if mask == "key":
        m = torch.ones(*batch, 1, 1, L, dtype=torch.bool, device=device)
        if L > 1:
            m[..., -1] = False
    return q, k, v, b, m


def pretune(shapes: Iterable[Sequence[int]], *, dtype: torch.dtype = torch.bfloat16, bias: Optional[str] = "pair",
            mask: Optional[str] = "key", causal: bool = False, backward: bool = True, deterministic: bool = True,
            device: Optional[str] = None) -> Dict[Tuple, object]:
    """Run the triton backend once on each q shape ``[*batch, H, L, D]`` (k and v the same, forward and, with
    ``backward``, backward) with tuning on: every kernel's length bucket is timed once and saved to the on-disk
    cache (``settings.cache_dir``). Shapes in one length bucket (:func:`attn_ops.triton.tuning.bucket`) share
    their configs, so one shape per bucket is enough. Returns the configs picked so far (kernel key -> config).
    """
    if bias not in BIAS_KINDS:
        raise ValueError(f"bias must be one of {BIAS_KINDS}, got {bias!r}")
    if mask not in MASK_KINDS:
        raise ValueError(f"mask must be one of {MASK_KINDS}, got {mask!r}")
    from .api import attention
    from .triton import tuning

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with settings.kernel_settings(tune=True):
        for shape in shapes:
            shape = tuple(int(n) for n in shape)
            if len(shape) < 3:
                raise ValueError(f"pretune: a shape is [*batch, H, L, D], got {shape}")
            q, k, v, b, m = _inputs(shape, dtype, device, bias, mask, backward)
            out, lse = attention(q, k, v, b, m, causal=causal, return_lse=True, backend="triton",
                                 deterministic=deterministic)
            if backward:
                (out.float().square().sum() + lse.sum()).backward()
    return tuning.chosen()


@contextlib.contextmanager
def compile_ahead(threads: Optional[int] = None) -> Iterator[None]:
    """Compile the triton backend's kernels for throwaway calls, all at once, instead of one after another as a run
    meets them::

        with attn_ops.compile_ahead():
            for n in lengths_the_run_will_meet:   # e.g. every multiple of 32 of a length range
                step(make_batch(n))               # outputs are garbage here: nothing is launched

    Inside the block (process-wide, so a backward on autograd's threads counts too) a launch whose kernel is not
    compiled submits its compile to ``threads`` threads (default ``settings.compile_threads``) and runs nothing.
    The block ends when every compile has. No launch plan is kept and no tuning is timed
    (a tuning miss compiles its candidates; the first real call times them). Everything else in the step runs
    (cuBLAS meets its GEMM shapes), on garbage values. On the CPU interpreter, without Triton or with
    ``settings.fast_launch`` off it does nothing. Not during a CUDA graph capture (RuntimeError): run the plain
    module, then capture.
    """
    try:
        from .triton.tuning import compile_ahead as _ahead
    except ImportError:  # no Triton: nothing to compile
        yield
        return
    with _ahead(threads):
        yield


def compiling_ahead() -> bool:
    """Whether :func:`compile_ahead` is active (calls then launch nothing; e.g. a CUDA-graph wrapper must not
    capture them)."""
    try:
        from .triton.tuning import compiling_ahead as _active
    except ImportError:
        return False
    return _active()


def wait_compiles(timeout: Optional[float] = None) -> float:
    """Wait for the triton backend's background compiles (a tile-multiple length's specialised variants, which
    its calls run the general variant while they compile) to end, at most ``timeout`` s; returns the seconds
    waited. Before timing a steady state."""
    try:
        from .triton.tuning import wait_background
    except ImportError:
        return 0.0
    return wait_background(timeout)
