"""Block-size choice for the kernels: a small pruned candidate list, benchmarked once per shape key and cached.

Under ``TRITON_INTERPRET=1`` (CPU tests) there is no timing: one small config is used.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, NamedTuple, Tuple


class Cfg(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    rows: int = 1  # batch rows per program sharing each bias tile (2: a bias broadcast over R)
    splits: int = 0  # dbias: programs sharing one tile's batch loop (0: the launcher's default)


_CACHE: Dict[Tuple, Cfg] = {}

# Candidates per kernel (BLOCK_M = query tile, BLOCK_N = key tile), for H100-class GPUs with triton 3.x.
_CANDIDATES = {
    "fwd": [Cfg(128, 64, 4, 3), Cfg(128, 128, 8, 3), Cfg(64, 64, 4, 3), Cfg(128, 32, 4, 3), Cfg(64, 128, 4, 3)],
    "dkdv": [Cfg(64, 128, 8, 3), Cfg(32, 128, 4, 3), Cfg(64, 64, 4, 3), Cfg(32, 64, 4, 3), Cfg(128, 128, 8, 2)],
    "dq": [Cfg(128, 64, 8, 3), Cfg(64, 64, 4, 3), Cfg(128, 32, 4, 3), Cfg(64, 128, 8, 3)],
    # dbias: 4 warps and 64x64 tiles win since its steps lost their load masks (H100, triangle 768: 1.25 ms vs
    # 1.9-2.1 for 128x64 / 64x128 with 8 warps); each tile shape is also timed with several split counts.
    "dbias": [Cfg(64, 64, 4, 3), Cfg(64, 64, 4, 4), Cfg(64, 32, 4, 3), Cfg(32, 64, 4, 3), Cfg(128, 64, 8, 3),
              Cfg(64, 128, 8, 3), Cfg(32, 32, 4, 3)],
}
# 2 first: ATTN_ZOO_NO_TUNE (first candidate) then runs the fp32-partials path. 0 is the launcher's occupancy
# default (a few programs per SM, up to 64 splits) for shapes with few output tiles; the timed launch includes
# the sum over the splits (an earlier tuner timed the kernel alone and picked 9 splits for the H100 triangle
# [1,256,4,256,32]: 2.31 ms vs 1.41).
_DBIAS_SPLITS = (2, 1, 4, 0)
_INTERPRETER = Cfg(32, 16, 4, 1)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def candidates(kernel: str, head_dim: int, lq: int, lk: int, pair: bool = False) -> List[Cfg]:
    """Pruned candidates: big head dims need small tiles (registers, shared memory); tiny L, small tiles.

    ``head_dim`` is the padded width in 16-bit units (the caller doubles it for fp32 inputs). ``pair``: the
    kernel can run two batch rows per program on one bias tile; each tile shape is tried both ways.
    """
    out = []
    for c in _CANDIDATES[kernel]:
        if head_dim > 128 and (c.block_m * c.block_n > 64 * 64 or c.num_stages > 2):
            continue
        if head_dim > 64 and kernel == "dkdv" and c.block_m * c.block_n > 64 * 128:
            continue
        if c.block_m > max(16, 1 << (lq - 1).bit_length()) or c.block_n > max(16, 1 << (lk - 1).bit_length()):
            continue
        out.append(c)
    if head_dim > 128:
        out.append(Cfg(32, 32, 4, 2))
        out.append(Cfg(64, 32, 4, 2))
    out = out or [Cfg(16, 16, 4, 1)]
    if pair and head_dim <= 64:  # two rows' accumulators: only for small heads (the pair-bias layouts)
        out += [c._replace(rows=2) for c in out]
    if kernel == "dbias":  # the split count is a launch argument, not a compile-time one: cheap to time
        out = [c._replace(splits=n) for c in out for n in _DBIAS_SPLITS]
    return out


def pick(kernel: str, key: Tuple, head_dim: int, lq: int, lk: int, launch: Callable[[Cfg], None],
         pair: bool = False) -> Cfg:
    """The cached best config for ``key``; on a miss, time each candidate with ``launch(cfg)`` and keep the best.

    ``launch`` must be repeatable (it re-zeroes any buffer it accumulates into). ``pair``: see :func:`candidates`
    (the CPU interpreter then always runs the two-row path, so the tests cover it).
    """
    if interpreting():
        return _INTERPRETER._replace(rows=2 if pair else 1)
    full_key = (kernel, pair) + key
    cfg = _CACHE.get(full_key)
    if cfg is not None:
        return cfg
    cands = candidates(kernel, head_dim, lq, lk, pair)
    if len(cands) == 1 or os.environ.get("ATTN_ZOO_NO_TUNE") == "1":
        cfg = _first_that_launches(cands, launch)
    else:
        from triton.testing import do_bench

        best = None
        for c in cands:
            try:
                ms = do_bench(lambda: launch(c), warmup=5, rep=25)
            except Exception:  # out of resources for this shape: skip the candidate
                continue
            if os.environ.get("ATTN_ZOO_TUNE_LOG") == "1":
                print(f"tune {kernel} {key}: {c} {ms:.3f} ms", flush=True)
            if best is None or ms < best[0]:
                best = (ms, c)
        cfg = best[1] if best is not None else cands[-1]
    _CACHE[full_key] = cfg
    return cfg


def _first_that_launches(cands: List[Cfg], launch: Callable[[Cfg], None]) -> Cfg:
    """The first candidate whose kernel compiles and launches (shared memory and registers permitting)."""
    from triton.runtime.errors import OutOfResources

    for c in cands[:-1]:
        try:
            launch(c)
            return c
        except OutOfResources:
            continue
    return cands[-1]


def chosen() -> Dict[Tuple, Cfg]:
    """Configs picked so far (for benchmark reports)."""
    return dict(_CACHE)
