"""Memory-bounded inference through the Evoformer and Pairformer blocks and stacks.

Under ``torch.no_grad`` a block's update of the pair tensor ``z [*, N, N, c_z]`` is computed by chunks of rows
(or columns) and added into ``z`` in place, so the transient memory of a block is about one ``z`` (the one
projection triangle multiplication must hold) plus one chunk's temporaries, instead of several ``z``-sized
intermediates. The MSA ``m [*, S, N, c_m]`` is updated likewise by chunks of sequences or columns.

Why the in-place updates are exact (each chunk reads only what no earlier chunk wrote):
- triangle multiplication, outgoing ``x_ij = sum_k a_ik b_jk``: ``b`` is stored whole (channels-first, from the
  input ``z``); output rows ``I`` need ``a`` of rows ``I`` only, computed from ``z[I]`` just before ``z[I]`` is
  written. Incoming ``x_ij = sum_k a_ki b_kj``: ``a`` is stored whole; output columns ``J`` need ``b`` of
  columns ``J`` only, computed from ``z[:, J]`` just before it is written.
- triangle attention: the pair bias ``[*, H, N, N]`` is computed whole first (small: H channels); then each
  row (starting node) or column (ending node) attends within itself.
- transitions, MSA row / column attention: each row / column depends on itself (the pair bias first).
- outer product mean: reads ``m`` only, adds into ``z`` rows.

Chunk sizes come from an estimate of the transient bytes (``estimate_inference_memory``) against a budget:
given by the user or, on CUDA, the free device memory. ``plan_inference`` picks the largest chunk that fits.
With ``offload`` the stack keeps one host copy of z (the result; none when the caller's z on the host is updated
in place) and one device copy per block; the estimate counts its host bytes (``MemoryEstimate.host``: a pinned
copy is page-locked by torch's caching host allocator in a power-of-two block) and the plan checks them against
the available host memory (``available_host_memory``: MemAvailable), falling back to a pageable copy (slower,
synchronous transfers) when the pinned block does not fit.
Dropout is not applied (inference); the stacks' training path is untouched.

Which path runs (``InferenceSettings.mode``): ``auto`` (the default) runs the plain path (the blocks' own
``forward`` without autograd, rows chunked only by the stack's ``chunk_size``), which is the faster one, whenever
its estimated extra memory (``estimate_plain_memory``) fits the budget, and the memory-bounded path only when it
does not, or when ``offload`` asks for it; ``plain`` / ``bounded`` force one. The budget is ``memory_budget``
when given, else 95% of the free memory of a CUDA device, else on the CPU half of the available host memory
(``available_host_memory``; the host's other users and the allocator's caching get the other half). Both
estimates count the attention backend's score tiles (``attn_ops.registry.forward_scratch_bytes``: none for the
fused kernels). The choice is kept in the module's ``last_inference`` (an ``InferenceChoice``) and logged at
DEBUG level by the ``attn_zoo.models.inference`` logger.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from attn_ops import registry as _attn_registry

from .kernels import layer_norm_rows
from .primitives import at_least_fp32, chunk_rows

Tensor = torch.Tensor
GIB = 2.0 ** 30

_MODES = ("auto", "bounded", "plain")
# bytes kept free of the planned peak for cuBLAS workspaces and allocator rounding
_RESERVE_BYTES = 256 * 2 ** 20
# chunks whose temporaries stay under this fraction of z (or _MIN_CHUNK_BYTES) are large enough to run at
# full matmul efficiency; larger ones only cost memory
_CHUNK_FRACTION_OF_Z = 0.5
_MIN_CHUNK_BYTES = 256 * 2 ** 20
# ... unless the budget leaves room: then chunk temporaries may take this fraction of what the budget leaves beyond
# chunks of one row (fewer, larger chunks: fewer launches and host round trips per block)
_SPARE_FRACTION = 0.5
# the CPU has no free-memory query of its own: the auto choice's default budget is this fraction of MemAvailable
_CPU_BUDGET_FRACTION = 0.5
_LOG = logging.getLogger(__name__)
# bytes an attention backend holds beyond its inputs and outputs: (problems = batch dims * heads, Lq, Lk) -> bytes
ScoreBytes = Callable[[int, int, int], int]


def _no_scores(problems: int, lq: int, lk: int) -> int:
    return 0


# --------------------------------------------------------------------------------------------------
# Settings and plans
# --------------------------------------------------------------------------------------------------
def _check_chunk(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int or None, got {type(value).__name__}: {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {value}")
    return value


def _check_budget(value: Any, name: str = "memory_budget") -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of bytes or None, got {type(value).__name__}: {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {value}")
    return int(value)


@dataclass(frozen=True)
class InferenceSettings:
    """How a stack runs when it runs without autograd.

    mode: ``auto`` (default): without grad in eval mode, the plain path (the blocks' ``forward``) when its
        estimated memory fits the budget, else the memory-bounded path (always with ``offload``); with grad or in
        train mode the plain path. ``bounded``: always the memory-bounded path (no gradients; eval mode only);
        ``plain``: always the plain path.
    chunk_size / msa_chunk_size: pair rows (columns) and MSA rows (columns) per chunk; None = planned from
        ``memory_budget``. A stack's own ``chunk_size`` is used for the pair chunk when this one is None.
    memory_budget: bytes the block may allocate beyond the parameters and the inputs (None: on CUDA the free
        device memory; on the CPU half the available host memory for the auto choice, and for the bounded
        path's chunks a size whose temporaries are a fraction of z).
    offload: keep the pair tensor in host memory between blocks (each block copies it in and out; pinned when
        the power-of-two pinned block fits the available host memory, else pageable). Saves device memory when
        ``z`` is passed on the host; the result then stays on the host. The host holds the caller's z and one
        copy (the result), or only the caller's z with ``inplace``.
    """

    mode: str = "auto"
    chunk_size: Optional[int] = None
    msa_chunk_size: Optional[int] = None
    memory_budget: Optional[int] = None
    offload: bool = False

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"inference mode must be one of {_MODES}, got {self.mode!r}")
        _check_chunk("chunk_size", self.chunk_size)
        _check_chunk("msa_chunk_size", self.msa_chunk_size)
        object.__setattr__(self, "memory_budget", _check_budget(self.memory_budget))
        if not isinstance(self.offload, bool):
            raise TypeError(f"offload must be a bool, got {type(self.offload).__name__}: {self.offload!r}")


@dataclass(frozen=True)
class Dims:
    """Widths of a Pairformer / Evoformer block that the memory estimate needs (``Dims.of(block)`` reads them)."""

    c_z: int = 128
    c_hidden_mul: int = 128
    num_heads_pair: int = 4
    c_hidden_pair: int = 32
    transition_n: int = 4
    # Pairformer single track (c_s = 0: none)
    c_s: int = 0
    num_heads_single: int = 16
    # Evoformer MSA track (c_m = 0: none)
    c_m: int = 0
    num_heads_msa: int = 8
    c_hidden_msa: int = 32
    c_hidden_opm: int = 32

    @classmethod
    def of(cls, block: nn.Module) -> "Dims":
        tm, ta = block.tri_mul_out, block.tri_att_start
        d = dict(
            c_z=tm.linear_ab_p.in_features, c_hidden_mul=tm.c_hidden, num_heads_pair=ta.mha.num_heads,
            c_hidden_pair=ta.mha.c_hidden,
            transition_n=max(1, _transition_width(block.pair_transition) // tm.linear_ab_p.in_features),
        )
        if hasattr(block, "attention_pair_bias"):
            apb = block.attention_pair_bias
            d.update(c_s=apb.layer_norm_s.normalized_shape[0], num_heads_single=apb.mha.num_heads)
        if hasattr(block, "msa_row_attention"):
            ra = block.msa_row_attention
            d.update(c_m=ra.layer_norm_m.normalized_shape[0], num_heads_msa=ra.mha.num_heads,
                     c_hidden_msa=ra.mha.c_hidden, c_hidden_opm=block.outer_product_mean.c_hidden)
        return cls(**d)


def _transition_width(mod: nn.Module) -> int:
    """Hidden width of a (SwiGLU) transition."""
    for name in ("linear_out", "linear_2"):
        lin = getattr(mod, name, None)
        if lin is not None:
            return lin.in_features
    raise TypeError(f"unknown transition {type(mod).__name__}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one block (or a stack, block by block) needs on the device in the memory-bounded path.

    ``inputs``: the inputs that live on the device (z unless offloaded, s or m, masks); ``working``: the
    copies the path makes of z and m (none with ``inplace``); ``transient``: the largest module's temporaries
    (stored projection, pair bias, one chunk); ``extra = working + transient`` is what the budget bounds;
    ``peak = inputs + extra``. ``modules`` lists each module's transient. ``host``: host bytes the path
    allocates (offload: its host copy of z, as page-locked when pinned; 0 without offload).
    """

    n: int
    chunk_size: int
    msa_chunk_size: Optional[int]
    z_bytes: int
    inputs: int
    working: int
    transient: int
    modules: Tuple[Tuple[str, int], ...] = field(default=())
    host: int = 0

    @property
    def extra(self) -> int:
        return self.working + self.transient

    @property
    def peak(self) -> int:
        return self.inputs + self.extra

    def __str__(self) -> str:
        mods = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.modules)
        return (f"N={self.n} chunk={self.chunk_size} msa_chunk={self.msa_chunk_size}: z {self.z_bytes / GIB:.2f} GiB, "
                f"extra {self.extra / GIB:.2f} GiB (working {self.working / GIB:.2f}, transient "
                f"{self.transient / GIB:.2f}: {mods}), peak {self.peak / GIB:.2f} GiB"
                + (f", host {self.host / GIB:.2f} GiB" if self.host else ""))


@dataclass(frozen=True)
class InferencePlan:
    """Chunk sizes for one run of the memory-bounded path, with the estimate they were chosen by; with offload
    whether the host copy of z is pinned (``pinned``) and the host budget it was checked against."""

    chunk_size: int
    msa_chunk_size: Optional[int]
    offload: bool
    estimate: MemoryEstimate
    budget: Optional[int] = None
    pinned: bool = False
    host_budget: Optional[int] = None

    @property
    def fits(self) -> bool:
        return ((self.budget is None or self.estimate.extra <= self.budget)
                and (self.host_budget is None or self.estimate.host <= self.host_budget))


def pinned_host_bytes(nbytes: int) -> int:
    """Host bytes torch's caching host allocator page-locks for a pinned tensor of ``nbytes``: the request rounded
    up to a power of two (its default; ``pinned_max_round_threshold`` unset), e.g. 64 GiB for a 36 GiB z."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes


def available_host_memory() -> Optional[int]:
    """Bytes of host memory new allocations can get: Linux's MemAvailable (``/proc/meminfo``), capped by a cgroup
    v2 memory limit where one is set; else the free physical pages (``os.sysconf``); None when unknown."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        avail = None
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            avail = None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                left = max(0, int(limit) - int(f.read().strip()))
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


def estimate_inference_memory(
    dims: Dims, n: int, chunk_size: int, *, n_seq: int = 0, msa_chunk_size: Optional[int] = None,
    batch: int = 1, dtype: torch.dtype = torch.bfloat16, inplace: bool = False, offload: bool = False,
    z_on_host: bool = True, pin: bool = True, scores: Optional[ScoreBytes] = None,
) -> MemoryEstimate:
    """Upper estimate of the device bytes of one block of the memory-bounded path, and of the host bytes of the
    stack's offload (``host``).

    ``dims``: the block's widths (``Dims.of(block)``); ``n``: residues; ``chunk_size``: pair rows per chunk;
    ``n_seq`` / ``msa_chunk_size``: MSA sequences and MSA rows (columns) per chunk (Evoformer only);
    ``dtype``: the activations' dtype; ``inplace``: the block writes into the caller's z (and m), no working
    copy; ``offload``: z (and the result) live on the host between blocks: one device copy per block, and one
    host copy of z (none when ``inplace`` and the caller's z is on the host, ``z_on_host``), page-locked in a
    power-of-two block when ``pin`` (``pinned_host_bytes``). ``scores``: the attention backend's score bytes
    (``score_bytes_of``); None: a fused backend (triton, flex, cuequivariance) that holds no ``[..., L, L]`` scores.
    """
    n = _check_chunk("n", n)
    chunk = _check_chunk("chunk_size", chunk_size)
    if n is None or chunk is None:
        raise ValueError(f"n and chunk_size must be positive ints, got n={n}, chunk_size={chunk_size}")
    msa = dims.c_m > 0
    if msa and (isinstance(n_seq, bool) or not isinstance(n_seq, int) or n_seq <= 0):
        raise ValueError(f"an Evoformer estimate needs n_seq (MSA sequences) > 0, got {n_seq!r}")
    msa_chunk = _check_chunk("msa_chunk_size", msa_chunk_size) if msa else None
    if msa and msa_chunk is None:
        msa_chunk = chunk
    r = min(chunk, n)
    e = torch.empty((), dtype=dtype).element_size()
    sc = scores or _no_scores
    B = batch
    cz, C, H, hc = dims.c_z, dims.c_hidden_mul, dims.num_heads_pair, dims.num_heads_pair * dims.c_hidden_pair
    tn = dims.transition_n
    nn2 = B * n * n
    z_bytes = nn2 * cz * e
    rows = B * r * n  # pair entries in one chunk
    mods = [
        # stored projection + (LN(z), [g|p], a / b and its channels-first copy, x, x channels-last, LN(x),
        # gate, output) of one chunk
        ("triangle_multiplication", nn2 * C * e + rows * e * (3 * cz + 6 * C)),
        # pair bias + (LN(z), fused q|k|v|g|pad, contiguous q, k, v for the op, o, o flat, gated o, output)
        # of one chunk, and its fp32 lse
        ("triangle_attention", nn2 * H * e + rows * e * (2 * cz + 4 * hc + H + 8 + 3 * hc + 3 * hc) + rows * H * 4
         + sc(B * r * H, n, n)),
        # LN, [a|b], silu(a), silu(a)*b, output
        ("pair_transition", rows * e * cz * (2 + 4 * tn)),
    ]
    m_bytes = s_bytes = 0
    if dims.c_s:
        cs, hs = dims.c_s, dims.num_heads_single
        s_bytes = B * n * cs * e
        # pair bias + its build chunk (LN(z) rows, H) + the single attention's projections, o, lse
        mods.append(("attention_pair_bias", nn2 * hs * e + rows * e * (cz + hs) + B * n * e * 10 * cs + B * hs * n * 4
                     + sc(B * hs, r, n)))
        mods.append(("single_transition", B * n * e * cs * (2 + 4 * tn)))
    if msa:
        cm, hm, hcm, co = dims.c_m, dims.num_heads_msa, dims.num_heads_msa * dims.c_hidden_msa, dims.c_hidden_opm
        m_bytes = B * n_seq * n * cm * e
        rs = min(msa_chunk, n_seq)
        rc = min(msa_chunk, n)
        att = e * (2 * cm + 4 * hcm + 6 * hcm)  # per MSA entry of a chunk: LN, q|k|v|g, op copies, o, output
        mods.append(("msa_row_attention", nn2 * hm * e + rows * e * (cz + hm) + B * rs * n * (att + hm * 4)
                     + sc(B * rs * hm, n, n)))
        mods.append(("msa_column_attention", B * rc * n_seq * (att + 4 * hm) + B * rc * n_seq * cm * e
                     + sc(B * rc * hm, n_seq, n_seq)))
        mods.append(("msa_transition", B * rs * n * e * cm * (2 + 4 * tn)))
        # a, b (fp32-safe: activations' dtype) + the build chunk of LN(m) + one row chunk's outer products
        # (outer, its transposed copy), outputs and counts
        opm = (2 * B * n_seq * n * co * e + B * n_seq * rc * cm * e * 2
               + rows * e * (2 * co * co + 2 * cz) + rows * 8)
        mods.append(("outer_product_mean", opm))
    mask_bytes = nn2 + (B * n_seq * n if msa else 0) + B * n
    inputs = (0 if offload else z_bytes) + s_bytes + m_bytes + mask_bytes
    working = (0 if inplace and not offload else z_bytes) + (0 if inplace or not msa else m_bytes)
    transient = max(v for _, v in mods) + _RESERVE_BYTES
    host = 0
    if offload and not (inplace and z_on_host):
        host = pinned_host_bytes(z_bytes) if pin else z_bytes
    return MemoryEstimate(n, chunk, msa_chunk, z_bytes, inputs, working, transient, tuple(mods), host)


def estimate_plain_memory(
    dims: Dims, n: int, chunk_size: Optional[int] = None, *, n_seq: int = 0, batch: int = 1,
    dtype: torch.dtype = torch.bfloat16, scores: Optional[ScoreBytes] = None, single_fp32: bool = False,
) -> MemoryEstimate:
    """Upper estimate of the device bytes of one block of the plain path: the block's ``forward`` without autograd,
    rows chunked by ``chunk_size`` (None: whole), as a stack runs it block after block.

    Each module holds its full-size intermediates (normalised input, projections, the triangle product, the pair
    bias) plus one chunk's; the update is concatenated from its chunks and added to a new z (or m), so a block
    holds the current z, the update and the new z at once (``working``: the current z and m, which from the second
    block on are not the caller's). ``scores``: the attention backend's score bytes (``score_bytes_of``; None: a
    fused backend). ``single_fp32``: Boltz-2's single track, which reads a float32 copy of z. Same fields as
    :func:`estimate_inference_memory` (``chunk_size`` reports the row chunk, N when whole).
    """
    n = _check_chunk("n", n)
    chunk = _check_chunk("chunk_size", chunk_size)
    if n is None:
        raise ValueError("n must be a positive int")
    msa = dims.c_m > 0
    if msa and (isinstance(n_seq, bool) or not isinstance(n_seq, int) or n_seq <= 0):
        raise ValueError(f"an Evoformer estimate needs n_seq (MSA sequences) > 0, got {n_seq!r}")
    r = n if chunk is None else min(chunk, n)
    e = torch.empty((), dtype=dtype).element_size()
    sc = scores or _no_scores
    B = batch
    cz, C, H, hc = dims.c_z, dims.c_hidden_mul, dims.num_heads_pair, dims.num_heads_pair * dims.c_hidden_pair
    tn = dims.transition_n
    nn2 = B * n * n
    z_bytes = nn2 * cz * e
    rows = B * r * n  # pair entries of one chunk
    cat = 2 * z_bytes if r < n else 0  # chunk_rows keeps every chunk's output, then concatenates them
    small = nn2 * 64  # per-pair float masks, norm statistics, bias channels
    mods = [
        # LN(z), the [g|p] GEMM output, sigmoid, gated and masked products; then LN(z), [a|b], x, the gate and
        # one chunk's LN(x), output, sigmoid and product
        ("triangle_multiplication", small + max(nn2 * e * (cz + 8 * C),
                                                nn2 * e * (2 * cz + 3 * C) + rows * e * (C + 3 * cz) + cat)),
        # LN(z), fused q|k|v|g|bias, the contiguous bias; one chunk's op copies of q, k, v, o, o flat, sigmoid,
        # gated o, output, lse and the backend's scores
        ("triangle_attention", small + nn2 * e * (cz + 4 * hc + 2 * H) + rows * e * (7 * hc + cz) + rows * H * 4
         + sc(B * r * H, n, n) + cat),
        # one chunk's LN, [a|b], silu(a), product, output
        ("pair_transition", small + rows * e * cz * (2 + 4 * tn) + cat),
        # the update and the new z while the current one lives
        ("residual", 2 * z_bytes),
    ]
    m_bytes = s_bytes = 0
    if dims.c_s:
        cs, hs = dims.c_s, dims.num_heads_single
        es = 4 if single_fp32 else e
        s_bytes = B * n * cs * e
        z32 = nn2 * cz * 4 if single_fp32 and e < 4 else 0  # Boltz-2: the single track reads z as float32
        # LN(z) and the bias (then its contiguous copy), the single attention's projections, o, and its scores
        mods.append(("attention_pair_bias", small + z32 + nn2 * es * (cz + hs) + B * n * es * 10 * cs
                     + B * hs * n * 4 + sc(B * hs, r, n)))
        mods.append(("single_transition", z32 + B * n * es * cs * (2 + 4 * tn)))
    if msa:
        cm, hm, hcm, co = dims.c_m, dims.num_heads_msa, dims.num_heads_msa * dims.c_hidden_msa, dims.c_hidden_opm
        ms = B * n_seq * n  # MSA entries
        m_bytes = ms * cm * e
        rs, rc = min(r, n_seq), r
        mcat = 2 * m_bytes if r < max(n, n_seq) else 0
        att = e * (4 * hcm + 7 * hcm + cm)  # per MSA entry of a chunk: q|k|v|g, op copies, o, gate, output
        mods.append(("msa_row_attention", nn2 * e * (cz + 2 * hm) + m_bytes + B * rs * n * (att + hm * 4)
                     + sc(B * rs * hm, n, n) + mcat))
        mods.append(("msa_column_attention", m_bytes + B * rc * n_seq * (att + 4 * hm) + sc(B * rc * hm, n_seq, n_seq)
                     + mcat))
        mods.append(("msa_transition", B * rs * n * e * cm * (2 + 2 * tn) + mcat))
        # LN(m), a, b, counts; one row chunk's outer products (and their transposed copy), output
        mods.append(("outer_product_mean", m_bytes + 2 * ms * co * e + nn2 * 4 + rows * e * (2 * co * co + 2 * cz)
                     + cat))
        mods.append(("msa_residual", 2 * m_bytes))
    mask_bytes = nn2 + (B * n_seq * n if msa else 0) + B * n
    inputs = z_bytes + s_bytes + m_bytes + mask_bytes
    working = z_bytes + m_bytes
    transient = max(v for _, v in mods) + _RESERVE_BYTES
    return MemoryEstimate(n, r, r if msa else None, z_bytes, inputs, working, transient, tuple(mods))


def score_bytes_of(blk: nn.Module, device: torch.device, dtype: torch.dtype) -> ScoreBytes:
    """The score bytes of the attention backend a block's modules call (they share one attention config), as
    ``attn_ops.registry.forward_scratch_bytes`` resolves it for ``device`` and ``dtype``."""
    mha = blk.tri_att_start.mha
    cfg = mha.attention
    dev = torch.device(device).type

    def scores(problems: int, lq: int, lk: int) -> int:
        return _attn_registry.forward_scratch_bytes(cfg.backend, device=dev, dtype=dtype, head_dim=mha.c_hidden,
                                                    batch=problems, lq=lq, lk=lk, options=cfg.options)

    return scores


def _candidates(n: int) -> list:
    """Chunk sizes tried, largest first: n, then powers of two below it."""
    out, c = [n], 1 << max(0, (n - 1).bit_length() - 1)
    while c >= 1:
        if c < n:
            out.append(c)
        c //= 2
    return out


def plan_inference(
    dims: Dims, n: int, budget: Optional[int] = None, *, n_seq: int = 0, batch: int = 1,
    dtype: torch.dtype = torch.bfloat16, inplace: bool = False, offload: bool = False,
    chunk_size: Optional[int] = None, msa_chunk_size: Optional[int] = None,
    host_budget: Optional[int] = None, z_on_host: bool = True, pin: bool = True,
    scores: Optional[ScoreBytes] = None,
) -> InferencePlan:
    """Chunk sizes for ``n`` residues within ``budget`` bytes beyond the parameters and inputs.

    The pair chunk is the largest candidate (``n``, then powers of two) whose estimate fits the budget and whose
    chunk temporaries stay under the larger of half of z, 256 MiB and half of what the budget leaves beyond
    chunks of one row (a large budget buys fewer chunks: fewer launches per block); then likewise the MSA
    chunk. ``scores``: the attention backend's score bytes (``score_bytes_of``; None: a fused backend). A
    ``chunk_size`` / ``msa_chunk_size`` given is kept as is. ``budget`` None: only the size rule.
    With ``offload`` the host copy of z (``MemoryEstimate.host``) must fit ``host_budget`` (None: the available
    host memory, ``available_host_memory``): pinned (``pin``) when its power-of-two block fits, else pageable.
    Raises ``ValueError`` when even chunks of 1 do not fit the device budget, or the host copy the host budget,
    naming N, the budget and the bytes needed.
    """
    budget = _check_budget(budget)
    host_budget = _check_budget(host_budget, "host_budget")
    chunk_size = _check_chunk("chunk_size", chunk_size)
    msa_chunk_size = _check_chunk("msa_chunk_size", msa_chunk_size)
    n = _check_chunk("n", n)
    if n is None:
        raise ValueError("n must be a positive int")
    msa = dims.c_m > 0
    kw = dict(n_seq=n_seq, batch=batch, dtype=dtype, inplace=inplace, offload=offload, z_on_host=z_on_host,
              scores=scores)
    z_bytes = batch * n * n * dims.c_z * torch.empty((), dtype=dtype).element_size()
    size_cap = max(_CHUNK_FRACTION_OF_Z * z_bytes, _MIN_CHUNK_BYTES)

    # host: the offload's copy of z, pinned if its (power-of-two) block fits, else pageable, else refused
    pinned = False
    if offload:
        host_src = ""
        if host_budget is None:
            host_budget, host_src = available_host_memory(), " (the available host memory)"
        pinned_est, plain_est = (estimate_inference_memory(dims, n, 1, msa_chunk_size=1 if msa else None, **kw,
                                                           pin=p) for p in (True, False))
        if pin and (host_budget is None or pinned_est.host <= host_budget):
            pinned = pinned_est.host > 0
        elif host_budget is not None and plain_est.host > host_budget:
            pin_note = (f" (pinned: {pinned_est.host / GIB:.2f} GiB, torch's pinned blocks are powers of two)"
                        if pin else "")
            raise ValueError(
                f"N={n} does not fit in host memory: offload keeps one copy of z on the host, "
                f"{plain_est.host / GIB:.2f} GiB{pin_note}, but host_budget={host_budget / GIB:.2f} GiB"
                f"{host_src}; pass z on the host with inplace=True (no copy), keep z on the device "
                f"(offload=False), or a smaller N"
            )
    kw["pin"] = pinned

    def est(c, mc):
        return estimate_inference_memory(dims, n, c, msa_chunk_size=mc, **kw)

    def ok(e0: MemoryEstimate, e: MemoryEstimate, check_size: bool) -> bool:
        if budget is not None and e.extra > budget:
            return False
        # chunk temporaries: what the estimate adds over chunks of one row
        return not check_size or e.transient - e0.transient <= size_cap

    base = est(1, 1 if msa else None)
    if budget is not None and base.extra > budget:
        raise ValueError(
            f"N={n} does not fit in memory_budget={budget / GIB:.2f} GiB: even chunks of 1 need "
            f"{base.extra / GIB:.2f} GiB beyond the inputs ({base}); "
            + ("use inplace=True, " if not inplace and not offload else "")
            + ("offload z to the host, " if not offload else "") + "or a smaller N"
        )
    if budget is not None:
        size_cap = max(size_cap, _SPARE_FRACTION * (budget - base.extra))
    pair_choices = [chunk_size] if chunk_size is not None else _candidates(n)
    chosen = None
    for c in pair_choices:
        e = est(c, 1 if msa else None)
        if ok(base, e, chunk_size is None):
            chosen = c
            break
    if chosen is None:
        if chunk_size is not None:
            e = est(chunk_size, 1 if msa else None)
            raise ValueError(f"chunk_size={chunk_size} does not fit in memory_budget={budget / GIB:.2f} GiB: {e}")
        chosen = 1
    msa_chosen = None
    if msa:
        msa_choices = [msa_chunk_size] if msa_chunk_size is not None else _candidates(max(n, n_seq))
        for mc in msa_choices:
            e = est(chosen, mc)
            if ok(base, e, msa_chunk_size is None):
                msa_chosen = mc
                break
        if msa_chosen is None:
            if msa_chunk_size is not None:
                raise ValueError(f"msa_chunk_size={msa_chunk_size} does not fit in memory_budget="
                                 f"{budget / GIB:.2f} GiB: {est(chosen, msa_chunk_size)}")
            msa_chosen = 1
    return InferencePlan(chosen, msa_chosen, offload, est(chosen, msa_chosen), budget, pinned,
                         host_budget if offload else None)


def free_device_memory(device: torch.device) -> Optional[int]:
    """Bytes a new allocation can get on a CUDA ``device``: the driver's free memory plus what the caching
    allocator holds unused. None on other devices."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


# --------------------------------------------------------------------------------------------------
# In-place chunked modules (all run without autograd)
# --------------------------------------------------------------------------------------------------
def _spans(n: int, chunk: int) -> Iterator[slice]:
    for start in range(0, n, chunk):
        yield slice(start, min(n, start + chunk))


def _rows(x: Tensor, dim: int, idx: slice) -> Tensor:
    """``x`` narrowed to ``idx`` along ``dim`` (a view)."""
    return x.narrow(dim, idx.start, idx.stop - idx.start)


def rows_update_(x: Tensor, dim: int, chunk: int, fn: Callable[[Tensor], Tensor],
                 mask: Optional[Tensor] = None) -> Tensor:
    """``x += fn(x)`` by chunks along ``dim``, where each row of ``fn(x)`` depends only on that row of ``x``;
    with ``mask`` (bool, ``x.shape[:-1]``) the update is zeroed where it is False (OpenFold3's transitions)."""
    mask_dim = dim + 1 if dim < 0 else dim  # the mask lacks x's channel dim
    for idx in _spans(x.shape[dim], chunk):
        part = _rows(x, dim, idx)
        update = fn(part)
        if mask is not None:
            update = update * _rows(mask, mask_dim, idx).unsqueeze(-1).to(update.dtype)
        part += update
    return x


def _gated_projection(mod: nn.Module, which: int) -> Tuple[Tensor, Optional[Tensor]]:
    """Weight ``[2C, c_z]`` and bias of triangle multiplication's ``[gate | projection]`` for a (0) or b (1)."""
    sl = slice(which * mod.c_hidden, (which + 1) * mod.c_hidden)
    w = torch.cat([mod.linear_ab_g.weight[sl], mod.linear_ab_p.weight[sl]])  # [2C, c_z]
    if mod.linear_ab_g.bias is None:  # Boltz-2's variant has no biases here
        return w, None
    b = torch.cat([mod.linear_ab_g.bias[sl], mod.linear_ab_p.bias[sl]])  # [2C]
    return w, b


def _gated_channels_first(zn: Tensor, wb: Tuple[Tensor, Optional[Tensor]], mask: Tensor, c: int,
                          out: Optional[Tensor] = None) -> Tensor:
    """``sigmoid(Linear_g(zn)) * Linear_p(zn)`` zeroed where ``mask`` is False, channels-first ``[C, M]`` for the
    ``M`` rows of ``zn [..., c_z]`` (``out``: written there, any view of that shape).

    The GEMM ``W @ zn^T`` writes channels-first directly, so the gate, the product and the mask are contiguous
    elementwise passes (a channels-last GEMM would need strided halves and a transposing copy)."""
    w, b = wb
    znt = zn.reshape(-1, zn.shape[-1]).t()
    y = torch.mm(w, znt) if b is None else torch.addmm(b[:, None], w, znt)  # [2C, M]: bias in the GEMM's rounding
    gate = y[:c].sigmoid_()
    out = torch.mul(gate, y[c:], out=gate if out is None else out)
    del y, gate
    return out.mul_(mask.reshape(1, -1).to(out.dtype))


def triangle_multiplication_(mod: nn.Module, z: Tensor, pair_mask: Tensor, chunk: int) -> Tensor:
    """``z += mod(z, pair_mask)`` in place (AF2 Alg. 11/12), holding one projection ``[C, N, N]`` per batch entry."""
    lead, n = z.shape[:-3], z.shape[-2]
    pair_mask = pair_mask.expand(*lead, n, n)
    for index in itertools.product(*(range(s) for s in lead)):
        _triangle_multiplication_one_(mod, z[index], pair_mask[index], chunk)
    return z


def _triangle_multiplication_one_(mod: nn.Module, z: Tensor, pair_mask: Tensor, chunk: int) -> None:
    """:func:`triangle_multiplication_` of one pair tensor ``z [N, N, c_z]`` (a view), ``pair_mask [N, N]``."""
    c = mod.c_hidden
    n = z.shape[-2]
    w_a, w_b = _gated_projection(mod, 0), _gated_projection(mod, 1)
    # outgoing: store b[c, j, k] from rows j; output rows i from a of rows i.
    # incoming: store a[c, k, i] from rows k; output columns j from b of columns j.
    stored_wb, chunk_wb = (w_b, w_a) if mod.outgoing else (w_a, w_b)
    dev = z.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else z.dtype  # the GEMMs' output
    stored = z.new_empty(c, n, n, dtype=dtype)  # [C, N, N]
    for idx in _spans(n, chunk):
        rows = z[idx]  # [R, N, c_z]
        _gated_channels_first(layer_norm_rows(rows, mod.layer_norm_in), stored_wb, pair_mask[idx], c,
                              out=stored[:, idx].view(c, -1))
    dim = 0 if mod.outgoing else 1  # output rows i (outgoing) or columns j (incoming)
    for idx in _spans(n, chunk):
        zc = _rows(z, dim, idx)  # [R, N, c_z] or [N, R, c_z]
        zn = layer_norm_rows(zc, mod.layer_norm_in)
        g = mod.linear_g(zn).sigmoid_()  # [R, N, c_z] / [N, R, c_z]
        p = _gated_channels_first(zn, chunk_wb, _rows(pair_mask, dim, idx), c).view(c, *zc.shape[:2])
        del zn
        if mod.outgoing:
            x = torch.matmul(p, stored.transpose(-1, -2))  # [C, R(i), N(j)]: sum_k a[i, k] b[j, k]
        else:
            x = torch.matmul(stored.transpose(-1, -2), p)  # [C, N(i), R(j)]: sum_k a[k, i] b[k, j]
        del p
        upd = mod.linear_z(layer_norm_rows(x, mod.layer_norm_out, channels_first=True))  # [R, N, c_z] / [N, R, c_z]
        del x
        zc.addcmul_(upd, g)
        del upd, g


def pair_bias(z: Tensor, layer_norm: nn.Module, linear: nn.Module, chunk: int, fp32: bool = False) -> Tensor:
    """``linear(layer_norm(z))`` channels-first ``[*, H, N_i, N_j]``, computed by chunks of rows i (``fp32``: each
    chunk of z read as float32)."""
    out = None
    for idx in _spans(z.shape[-3], chunk):
        zc = z[..., idx, :, :]
        b = linear(layer_norm_rows(zc, layer_norm, out_dtype=torch.promote_types(zc.dtype, torch.float32) if fp32 else None))  # [*, R, N, H]
        if out is None:
            out = torch.empty(*z.shape[:-3], b.shape[-1], z.shape[-3], z.shape[-2], dtype=b.dtype, device=z.device)
        out[..., :, idx, :] = b.movedim(-1, -3)
    return out


def triangle_attention_(mod: nn.Module, z: Tensor, pair_mask: Tensor, chunk: int) -> Tensor:
    """``z += mod(z, pair_mask)`` in place (AF2 Alg. 13/14): the bias once, then rows (columns) by chunks."""
    zt = z if mod.starting else z.transpose(-2, -3)  # [*, I, J, c_z] view: rows attend along themselves
    mt = pair_mask if mod.starting else pair_mask.transpose(-1, -2)
    # [*, 1, H, J, K]; OpenFold3's ending node reads it off z itself (TriangleAttention's transpose_bias)
    bias = pair_bias(z if getattr(mod, "transpose_bias", False) else zt, mod.layer_norm, mod.linear_bias,
                     chunk).unsqueeze(-4)
    for idx in _spans(zt.shape[-3], chunk):
        zr = zt[..., idx, :, :]  # [*, R, J, c_z] view into z
        zn = layer_norm_rows(zr, mod.layer_norm)
        q, k, v, g = mod.mha.project(zn, zn)  # [*, R, J, H*C]
        del zn
        mask = mt[..., idx, None, None, :]  # [*, R, 1, 1, K]
        zr += mod.mha.attend(q, k, v, g, bias, mask)
    return z


def attention_pair_bias(mod: nn.Module, s: Tensor, z: Tensor, single_mask: Tensor, chunk: int,
                        fp32: bool = False) -> Tensor:
    """``mod(s, z, single_mask)`` with the pair bias computed by chunks of z's rows (AF3 Alg. 24); ``fp32``: z read
    as float32 chunk by chunk (s must be float32 then, under autocast off)."""
    bias = pair_bias(z, mod.layer_norm_z, mod.linear_z, chunk, fp32)  # [B, H, N, N]
    sn = mod.layer_norm_s(s)
    mask = single_mask[:, None, None, :]  # [B, 1, 1, N]
    return chunk_rows(lambda q, b: mod.mha(q, sn, bias=b, mask=mask), [sn, bias], [-2, -2], chunk, out_dim=-2)


def msa_row_attention_(mod: nn.Module, m: Tensor, z: Tensor, msa_mask: Tensor, z_chunk: int, chunk: int) -> Tensor:
    """``m += mod(m, z, msa_mask)`` in place (AF2 Alg. 7): the pair bias once, then MSA rows by chunks."""
    bias = pair_bias(z, mod.layer_norm_z, mod.linear_z, z_chunk).unsqueeze(-4)  # [B, 1, H, N, N]

    def rows(x: Tensor, idx: slice) -> Tensor:
        xn = mod.layer_norm_m(x)
        return mod.mha(xn, xn, bias=bias, mask=msa_mask[..., idx, None, None, :])

    for idx in _spans(m.shape[-3], chunk):
        part = m[..., idx, :, :]  # [B, R, N, c_m]
        part += rows(part, idx)
    return m


def msa_column_attention_(mod: nn.Module, m: Tensor, msa_mask: Tensor, chunk: int) -> Tensor:
    """``m += mod(m, msa_mask)`` in place by chunks of residue columns (AF2 Alg. 8 and 19: columns are independent)."""
    for idx in _spans(m.shape[-2], chunk):
        part = m[..., idx, :]  # [B, S, R, c_m] view
        part += mod(part, msa_mask[..., idx])
    return m


def outer_product_mean_(mod: nn.Module, m: Tensor, msa_mask: Tensor, z: Tensor, chunk: int, msa_chunk: int) -> Tensor:
    """``z += mod(m, msa_mask)`` in place (AF2 Alg. 10) by chunks of rows i of z."""
    w = msa_mask.unsqueeze(-1)  # [B, S, N, 1] bool
    a = b = None
    for idx in _spans(m.shape[-2], msa_chunk):  # a, b by residue columns: one LN(m) chunk at a time
        mn = mod.layer_norm(m[..., idx, :])
        wi = w[..., idx, :].to(mn.dtype)
        ai, bi = mod.linear_a(mn) * wi, mod.linear_b(mn) * wi  # [B, S, R, C]
        if a is None:
            a = ai.new_empty(*m.shape[:-1], ai.shape[-1])
            b = bi.new_empty(*m.shape[:-1], bi.shape[-1])
        a[..., idx, :], b[..., idx, :] = ai, bi
        del mn, ai, bi
    wf = msa_mask.to(a.dtype)  # [B, S, N]
    b_flat = b.flatten(-2)  # [B, S, N*C]
    cc = mod.c_hidden
    for idx in _spans(z.shape[-3], chunk):
        a_rows = a[..., idx, :]  # [B, S, R, C]
        ni = a_rows.shape[-2]
        count = torch.einsum("...si,...sj->...ij", wf[..., idx], wf)  # [B, R, N]
        outer = torch.matmul(a_rows.flatten(-2).transpose(-1, -2), b_flat)  # [B, R*C, N*C]
        # [B, R, C, N, D] -> [B, R, N, C, D] -> [B, R, N, C*D]
        outer = outer.unflatten(-1, (-1, cc)).unflatten(-3, (ni, cc)).transpose(-2, -3).flatten(-2)
        out = nn.functional.linear(outer, mod.linear_out.weight)  # [B, R, N, c_z]
        del outer
        in_mean = getattr(mod, "bias_in_mean", False)
        if mod.linear_out.bias is not None and in_mean:
            out = out + mod.linear_out.bias.to(out.dtype)
        out = out / (count.unsqueeze(-1) + mod.eps).to(out.dtype)
        if mod.linear_out.bias is not None and not in_mean:
            out = out + mod.linear_out.bias.to(out.dtype)
        z[..., idx, :, :] += out
    return z


def _transition_fn(mod: nn.Module) -> Callable[[Tensor], Tensor]:
    return mod._run  # the transition without its row chunking


def pair_stack_(blk: nn.Module, z: Tensor, pair_mask: Tensor, chunk: int) -> Tensor:
    """The pair half shared by both blocks: triangle multiplications, triangle attentions, pair transition.

    A chunk that covers every row runs each triangle module's own whole-tensor form (its fused kernels, one
    projection for attention's bias and q/k/v) and adds the update in place: the chunked forms' peak is then no
    lower than it, and their extra launches and passes only cost time (docs/inference.md). A triangle
    multiplication marked ``fused`` (a kernel that holds no full-size intermediates: cuEquivariance's, for a patched
    Boltz layer) always runs whole. ``blk`` may be any object with these modules' names (``attn_zoo.patch`` runs
    Boltz's pair stack through this function)."""
    whole = chunk >= z.shape[-2]
    for mod in (blk.tri_mul_out, blk.tri_mul_in):
        if whole or getattr(mod, "fused", False):
            z += mod(z, pair_mask)
        else:
            triangle_multiplication_(mod, z, pair_mask, chunk)
    for mod in (blk.tri_att_start, blk.tri_att_end):
        if whole:
            z += mod(z, pair_mask)
        else:
            triangle_attention_(mod, z, pair_mask, chunk)
    mask = pair_mask if getattr(blk, "mask_transitions", False) else None  # OpenFold3: zeroed at masked pairs
    return rows_update_(z, -3, chunk, _transition_fn(blk.pair_transition), mask=mask)


def pairformer_block_(blk: nn.Module, s: Tensor, z: Tensor, single_mask: Tensor, pair_mask: Tensor,
                      plan: InferencePlan) -> Tuple[Tensor, Tensor]:
    """One Pairformer block (AF3 Alg. 17) updating ``z`` in place; returns ``(s, z)``."""
    c = plan.chunk_size
    pair_stack_(blk, z, pair_mask, c)
    fp32 = blk.single_fp32  # as PairformerBlock.forward: Boltz-2's single track in float32, autocast off
    with torch.autocast(s.device.type, enabled=False) if fp32 else contextlib.nullcontext():
        s = at_least_fp32(s) if fp32 else s
        s = s + attention_pair_bias(blk.attention_pair_bias, s, z, single_mask, c, fp32=fp32)
        update = blk.single_transition(s, c)
        if getattr(blk, "mask_transitions", False):  # OpenFold3: zeroed at padded residues
            update = update * single_mask.unsqueeze(-1).to(update.dtype)
        s = s + update
        if blk.post_norm_s is not None:
            s = blk.post_norm_s(s)
    return s, z


def msa_pair_block_(blk: nn.Module, m: Tensor, z: Tensor, msa_mask: Tensor, pair_mask: Tensor,
                    plan: InferencePlan) -> Tuple[Tensor, Tensor]:
    """One Evoformer / extra-MSA block (AF2 Alg. 6 / 18) updating ``m`` and ``z`` in place; returns ``(m, z)``."""
    c, mc = plan.chunk_size, plan.msa_chunk_size or plan.chunk_size
    opm_first = getattr(blk, "opm_first", False)  # AlphaFold-Multimer's order
    if opm_first:
        outer_product_mean_(blk.outer_product_mean, m, msa_mask, z, c, mc)
    msa_row_attention_(blk.msa_row_attention, m, z, msa_mask, c, mc)
    msa_column_attention_(blk.msa_column_attention, m, msa_mask, mc)
    rows_update_(m, -3, mc, _transition_fn(blk.msa_transition))
    if not opm_first:
        outer_product_mean_(blk.outer_product_mean, m, msa_mask, z, c, mc)
    pair_stack_(blk, z, pair_mask, c)
    return m, z


# --------------------------------------------------------------------------------------------------
# Running blocks and stacks
# --------------------------------------------------------------------------------------------------
def use_inference_path(module: nn.Module, settings: InferenceSettings) -> bool:
    """Whether a stack's forward goes through ``forward_inference`` (which then picks the plain or the bounded
    path): with ``mode="bounded"``, or ``auto`` without grad in eval mode."""
    if settings.mode == "plain":
        return False
    if settings.mode == "bounded":
        return True
    return not torch.is_grad_enabled() and not module.training


@dataclass(frozen=True)
class InferenceChoice:
    """The path an inference call took: ``path`` ``"plain"`` or ``"bounded"``, and ``reason``. ``plain``: the plain
    path's estimate and ``budget`` the bytes it was held against (None where the choice needed neither);
    ``plan``: the bounded path's plan when that path ran."""

    path: str
    reason: str
    plain: Optional[MemoryEstimate] = None
    budget: Optional[int] = None
    plan: Optional[InferencePlan] = None


def inference_budget(device: torch.device, memory_budget: Optional[int] = None) -> Optional[int]:
    """The auto choice's budget: ``memory_budget`` when given; else 95% of a CUDA device's free memory; else on the
    CPU half of the available host memory; None when unknown."""
    if memory_budget is not None:
        return memory_budget
    device = torch.device(device)
    free = free_device_memory(device)
    if free is not None:
        return int(0.95 * free)
    if device.type == "cpu":
        avail = available_host_memory()
        return None if avail is None else int(_CPU_BUDGET_FRACTION * avail)
    return None


def choose_path(blk: nn.Module, settings: InferenceSettings, n: int, device: torch.device, dtype: torch.dtype,
                *, n_seq: int = 0, batch: int = 1, plain_chunk: Optional[int] = None) -> InferenceChoice:
    """Plain or bounded for a run of ``blk`` (a stack's first block) at ``n`` residues: as ``settings.mode`` says;
    ``auto``: bounded with offload, else plain when the plain path's estimate (rows chunked by ``plain_chunk``)
    fits :func:`inference_budget`, else bounded."""
    if settings.mode != "auto":
        return InferenceChoice(settings.mode, f"mode={settings.mode!r}")
    if settings.offload:
        return InferenceChoice("bounded", "offload runs on the memory-bounded path")
    budget = inference_budget(device, settings.memory_budget)
    fp32 = bool(getattr(blk, "single_fp32", False))
    # Boltz-2's plain block returns z as float32: from the second block on the pair track runs in float32
    est_dtype = torch.promote_types(dtype, torch.float32) if fp32 else dtype
    plain = estimate_plain_memory(Dims.of(blk), n, plain_chunk, n_seq=n_seq, batch=batch, dtype=est_dtype,
                                  scores=score_bytes_of(blk, device, dtype), single_fp32=fp32)
    if budget is None:
        return InferenceChoice("plain", "no memory budget known", plain, None)
    verdict = "fits" if plain.extra <= budget else "does not fit"
    reason = (f"the plain path's estimated extra {plain.extra / GIB:.2f} GiB {verdict} the budget "
              f"{budget / GIB:.2f} GiB")
    return InferenceChoice("plain" if plain.extra <= budget else "bounded", reason, plain, budget)


def _record(module: nn.Module, choice: InferenceChoice, n: int) -> None:
    module.last_inference = choice  # a debug hook: benchmarks and tests read which path ran
    _LOG.debug("%s N=%d: %s path (%s)", type(module).__name__, n, choice.path, choice.reason)


def make_plan(blk: nn.Module, settings: InferenceSettings, n: int, device: torch.device, dtype: torch.dtype,
              *, n_seq: int = 0, batch: int = 1, inplace: bool = False, offload: bool = False,
              default_chunk: Optional[int] = None, z_on_host: bool = True) -> InferencePlan:
    """The plan for a run: the user's chunk sizes where given, the rest planned against the settings' budget or
    the free device memory; with ``offload`` the host copy of z against the available host memory."""
    budget = settings.memory_budget
    if budget is None and settings.chunk_size is None:
        free = free_device_memory(device)
        budget = None if free is None else int(0.95 * free)
    host_budget = None
    if offload:
        avail = available_host_memory()
        host_budget = None if avail is None else max(1, int(0.95 * avail))
    chunk = settings.chunk_size if settings.chunk_size is not None else default_chunk
    return plan_inference(Dims.of(blk), n, budget, n_seq=n_seq, batch=batch, dtype=dtype, inplace=inplace,
                          offload=offload, chunk_size=chunk, msa_chunk_size=settings.msa_chunk_size,
                          host_budget=host_budget, z_on_host=z_on_host, pin=device.type == "cuda",
                          scores=score_bytes_of(blk, device, dtype))


def _check_inference(module: nn.Module) -> None:
    if module.training:
        raise ValueError(f"the inference path of {type(module).__name__} applies no dropout: call .eval() first "
                         "(or configure_inference(mode='plain') and call the module, to run the training path)")


def run_stack(
    stack: nn.Module, block_fn: Callable, x: Tensor, z: Tensor, masks: Sequence[Tensor],
    settings: InferenceSettings, *, n_seq: int = 0, inplace: bool = False, default_chunk: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Run every block of ``stack`` without autograd: the plain path (the blocks' forward, rows chunked by
    ``default_chunk``) or the memory-bounded one (``block_fn(blk, x, z, *masks, plan)``), as :func:`choose_path`
    picks (recorded in ``stack.last_inference``). ``n_seq`` > 0: an MSA stack (m is updated in place too).

    ``x`` (s or m) lives on the parameters' device. Without offload z is copied once (not with ``inplace``)
    and updated in place block after block. With ``settings.offload`` z lives in host memory between blocks: one
    host copy (the result; pinned when the plan says it fits, else pageable), or the caller's z itself when it is
    on the host and ``inplace``; the first block reads the caller's z directly, and the device holds one copy of
    z per block. The result is returned where the input z was.
    """
    _check_inference(stack)
    if len(stack.blocks) == 0:
        return x, z
    dev = x.device
    masks = [t.to(dev, non_blocking=True) for t in masks]
    offload = settings.offload
    n = z.shape[-2]
    choice = choose_path(stack.blocks[0], settings, n, dev, z.dtype, n_seq=n_seq, batch=z.shape[0],
                         plain_chunk=default_chunk)
    if choice.path == "plain":
        _record(stack, choice, n)
        with torch.no_grad():
            out = x, z.to(dev, non_blocking=True)
            for blk in stack.blocks:
                out = blk(*out, *masks, chunk_size=default_chunk)
        return _write_back(x, z, out, inplace, n_seq > 0)
    with torch.no_grad():
        plan = make_plan(stack.blocks[0], settings, n, dev, z.dtype, n_seq=n_seq, batch=z.shape[0],
                         inplace=inplace, offload=offload, default_chunk=default_chunk,
                         z_on_host=z.device.type == "cpu")
        _record(stack, replace(choice, plan=plan), n)
        x = x if inplace else x.clone()  # the MSA blocks update m in place
        if not offload:
            work = z if inplace else z.clone()
            work = work.to(dev)
            for blk in stack.blocks:
                x, work = block_fn(blk, x, work, *masks, plan)
            return x, work
        if inplace and z.device.type == "cpu":
            host = z  # the caller's z is the host copy: no other one
        else:  # the one host copy, written by every block: the result
            host = torch.empty(z.shape, dtype=z.dtype, device="cpu", pin_memory=plan.pinned)
        if dev.type == "cpu":  # nothing to move: the blocks run on the host copy
            if host is not z:
                host.copy_(z)
            for blk in stack.blocks:
                x, host = block_fn(blk, x, host, *masks, plan)
        else:
            for i, blk in enumerate(stack.blocks):
                src = z if i == 0 else host
                if src.device == dev:  # the caller's z on the device, first block
                    zd = src if inplace else src.clone()
                else:
                    zd = src.to(dev, non_blocking=True)
                x, zd = block_fn(blk, x, zd, *masks, plan)
                host.copy_(zd, non_blocking=True)
                del zd
            if dev.type == "cuda":  # the last copy into the host
                torch.cuda.current_stream(dev).synchronize()
        if z.device.type == "cpu":
            return x, host
        return x, (z.copy_(host) if inplace else host.to(z.device))


def _write_back(x: Tensor, z: Tensor, out: Tuple[Tensor, Tensor], inplace: bool, x_inplace: bool
                ) -> Tuple[Tensor, Tensor]:
    """The plain path's result where the caller wants it: z's device; with ``inplace`` in the caller's z (and, for
    the MSA blocks, ``x_inplace``, in m)."""
    x_new, z_new = out
    if not inplace:
        return x_new, z_new.to(z.device)
    z.copy_(z_new)
    if x_inplace:
        x.copy_(x_new)
        x_new = x
    return x_new, z


def run_block(blk: nn.Module, block_fn: Callable, x: Tensor, z: Tensor, masks: Sequence[Tensor],
              chunk_size: Optional[int], memory_budget: Optional[int], *, n_seq: int = 0,
              inplace: bool = False, mode: str = "auto") -> Tuple[Tensor, Tensor]:
    """One block's forward without autograd, on the path :func:`choose_path` picks (``mode``; recorded in
    ``blk.last_inference``); ``inplace``: z, and m for the MSA blocks, are updated in place."""
    _check_inference(blk)
    settings = InferenceSettings(mode=mode, chunk_size=chunk_size, memory_budget=memory_budget)
    n = z.shape[-2]
    choice = choose_path(blk, settings, n, z.device, z.dtype, n_seq=n_seq, batch=z.shape[0], plain_chunk=chunk_size)
    if choice.path == "plain":
        _record(blk, choice, n)
        with torch.no_grad():
            out = blk(x, z, *masks, chunk_size=chunk_size)
        return _write_back(x, z, out, inplace, n_seq > 0)
    with torch.no_grad():
        plan = make_plan(blk, settings, n, z.device, z.dtype, n_seq=n_seq, batch=z.shape[0], inplace=inplace)
        _record(blk, replace(choice, plan=plan), n)
        if not inplace:
            x, z = x.clone(), z.clone()
        return block_fn(blk, x, z, *masks, plan)


def configure(settings: InferenceSettings, **changes: Any) -> InferenceSettings:
    """``settings`` with ``changes`` (validated)."""
    unknown = sorted(set(changes) - set(InferenceSettings.__dataclass_fields__))
    if unknown:
        known = sorted(InferenceSettings.__dataclass_fields__)
        raise TypeError(f"unknown inference setting(s) {unknown}; known: {known}")
    return replace(settings, **changes)


class StackInference:
    """Mixin for the stacks: settings, planning and estimates of the memory-bounded inference path.

    A stack defines ``_inference_block_fn`` (the in-place block function) and ``forward_inference``.
    """

    inference_settings: InferenceSettings = InferenceSettings()
    last_inference: Optional[InferenceChoice] = None  # the path the last inference call took (a debug hook)

    def configure_inference(self, **changes: Any):
        """Set ``InferenceSettings`` fields (mode, chunk_size, msa_chunk_size, memory_budget, offload); returns self."""
        self.inference_settings = configure(self.inference_settings, **changes)
        return self

    def inference_dims(self) -> Dims:
        if len(self.blocks) == 0:
            raise ValueError(f"{type(self).__name__} has no blocks")
        return Dims.of(self.blocks[0])

    def estimate_inference_memory(self, n: int, chunk_size: int, **kwargs: Any) -> MemoryEstimate:
        """``estimate_inference_memory(self.inference_dims(), n, chunk_size, **kwargs)``: bytes of one block."""
        return estimate_inference_memory(self.inference_dims(), n, chunk_size, **kwargs)

    def plan_inference(self, n: int, budget: Optional[int] = None, **kwargs: Any) -> InferencePlan:
        """Chunk sizes for ``n`` residues within ``budget`` bytes beyond parameters and inputs (None: the free
        memory of the parameters' CUDA device, or only the chunk-size rule elsewhere); raises ``ValueError``
        when ``n`` does not fit (with offload also the host copy of z against ``host_budget``, None: the
        available host memory). ``kwargs`` as ``plan_inference`` (n_seq, batch, dtype, inplace, offload,
        host_budget, z_on_host, pin, ...); ``pin`` defaults to whether the parameters are on a CUDA device."""
        if budget is None:
            p = next(self.parameters(), None)
            budget = None if p is None else free_device_memory(p.device)
        kwargs.setdefault("offload", self.inference_settings.offload)
        p = next(self.parameters(), None)
        if "pin" not in kwargs:
            kwargs["pin"] = p is not None and p.device.type == "cuda"
        if "scores" not in kwargs and p is not None:
            kwargs["scores"] = score_bytes_of(self.blocks[0], p.device, kwargs.get("dtype", torch.bfloat16))
        return plan_inference(self.inference_dims(), n, budget, **kwargs)

    def inference_choice(self, n: int, *, batch: int = 1, dtype: torch.dtype = torch.bfloat16, n_seq: int = 0,
                         device: Optional[torch.device] = None, **changes: Any) -> InferenceChoice:
        """The path an inference call at ``n`` residues would take with ``inference_settings`` (and ``changes``
        to them), without running it; ``device``: the parameters' by default."""
        settings = configure(self.inference_settings, **changes)
        if device is None:
            p = next(self.parameters(), None)
            device = torch.device("cpu") if p is None else p.device
        return choose_path(self.blocks[0], settings, n, torch.device(device), dtype, n_seq=n_seq, batch=batch,
                           plain_chunk=self.chunk_size)
