"""Host launchers: grids, strides, block sizes and buffers for the kernels, on canonical 5-D tensors.

Canonical layout (see ``op.py``): q ``[B, R, H, Lq, D]``, k ``[B, R, H, Lk, D]``, v ``[B, R, H, Lk, Dv]`` with a
contiguous last dim; bias ``[B|1, R|1, H|1, Lq|1, Lk|1]`` (any float dtype) and mask (bool, same rule) in
their own shapes: a size-1 dim is passed with stride 0, so nothing is expanded.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import settings as _settings

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

from .backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_preprocess_kernel
from .common import LOG2E
from .dbias import attn_bwd_dbias_kernel, sum_splits_kernel
from .fastlaunch import launch as _launch
from .forward import attn_fwd_kernel
from .tuning import bucket, interpreting, pick

Tensor = torch.Tensor


def _width(q, D, Dv) -> int:
    """Head width in 16-bit units, for pruning tile candidates (fp32 tiles take twice the shared memory)."""
    return max(D, Dv) * q.element_size() // 2


def _bstrides(t: Tensor) -> Tuple[int, ...]:
    """Strides of a 5-D tensor, 0 on size-1 dims (broadcast)."""
    (n0, n1, n2, n3, n4), (s0, s1, s2, s3, s4) = t.shape, t.stride()  # unrolled: called ~20 times per fwd + bwd
    return (0 if n0 == 1 else s0, 0 if n1 == 1 else s1, 0 if n2 == 1 else s2, 0 if n3 == 1 else s3,
            0 if n4 == 1 else s4)


def _rows(t: Tensor) -> Tuple[int, int, int, int]:
    """(b, r, h, row) strides of a canonical [B, R, H, L, D] tensor."""
    s = _bstrides(t)
    return s[0], s[1], s[2], t.stride(3)  # the row stride as is, also for a single row


def empty_in_order(like: Tensor, shape, dtype: torch.dtype) -> Tensor:
    """A dense ``shape`` tensor whose dims are laid out in ``like``'s stride order (largest stride outermost).

    The op's output takes q's dim order, so that a caller who split heads out of ``[*, L, H*C]`` gets ``out``
    back as a view of ``[*, L, H*C]`` memory (no copy to merge the heads). Also used by the fake impl.
    """
    order = sorted(range(like.ndim), key=lambda d: (-like.stride(d), d))  # outermost first; ties keep dim order
    return torch.empty_permuted(shape, order, dtype=dtype, device=like.device)


def _cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a constexpr function: ~1.5 us per call from Python, and
    the launchers make a few dozen such calls per forward + backward)."""
    return -(-a // b)


def _pow2(n: int) -> int:
    """The head-dim block: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (n - 1).bit_length())


def _even_d(D: int, Dv: int) -> bool:
    """D and Dv fill their (power-of-two, >= 16) blocks: the kernels then load rows without a column mask."""
    return D == _pow2(D) and Dv == _pow2(Dv)


def _mask_u8(mask: Optional[Tensor]) -> Optional[Tensor]:
    return None if mask is None else mask.view(torch.uint8)


def _mask_kind(mask: Optional[Tensor]) -> int:
    """HAS_MASK for the kernels: 0 none, 1 a key mask (size 1 along Lq), 2 a mask varying along Lq."""
    if mask is None:
        return 0
    return 1 if mask.shape[3] == 1 else 2


def _key(q: Tensor, v: Tensor, bias, mask, causal: bool, *extra) -> Tuple:
    """The tuner's key: length buckets (not lengths, :func:`tuning.bucket`), the batch count's power of two, the
    head widths, dtypes, bias/mask kind and broadcast pattern, and the TMA switch (it changes the kernels)."""
    B, R, H, Lq, D = q.shape
    nbatch = (B * R * H).bit_length()
    pattern = None if bias is None else tuple(n == 1 for n in bias.shape)
    return (str(q.dtype), D, v.shape[-1], bucket(Lq), bucket(v.shape[3]), nbatch, pattern,
            None if bias is None else str(bias.dtype), _mask_kind(mask), causal, _settings.get().tma) + extra


def _pairs_rows(bias: Optional[Tensor], R: int, causal: bool, atomic_dbias: bool) -> bool:
    """Whether a dK/dV program may take two rows r, r + 1 that share one bias slice (a bias broadcast over R,
    summed by atomics with the split dQ kernel).

    Measured on an H100 (triangle 768): it pays with ``atomic_dbias`` (one atomic add of both rows' dS: backward
    5.52 -> 4.74 ms); the deterministic dK/dV kernel and the forward and dQ kernels were as fast or faster with one
    row per program (forward 1.63 vs 1.48 ms, dQ 1.59 vs 1.44 ms), so only the atomic variant tries it.
    """
    return atomic_dbias and bias is not None and bias.shape[1] == 1 and R > 1 and not causal


def _seg_args(q_seg: Optional[Tensor], k_seg: Optional[Tensor], dummy: Tensor):
    """(q table, k table, their (b, r) strides: 0 on broadcast dims) for the kernels; dummies without ids."""
    if q_seg is None:
        return dummy, dummy, (0, 0, 0, 0)
    st = lambda t: (0 if t.shape[0] == 1 else t.stride(0), 0 if t.shape[1] == 1 else t.stride(1))  # noqa: E731
    return q_seg, k_seg, st(q_seg) + st(k_seg)


def _bias_args(bias: Optional[Tensor], dummy: Tensor):
    return (dummy, (0, 0, 0, 0, 0)) if bias is None else (bias, _bstrides(bias))


_TMA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CAPABILITY = {}  # CUDA device index -> compute capability major


def _tma_capable(device: torch.device) -> bool:
    """Tensor-memory-accelerator copies: Hopper or newer GPUs with a Triton that has host tensor descriptors, and
    the CPU interpreter (so the CPU tests run this path too); ``settings.tma`` False (``ATTN_ZOO_NO_TMA=1``) turns
    it off."""
    if TensorDescriptor is None or not _settings.get().tma:
        return False
    if interpreting():
        return True
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    major = _CAPABILITY.get(index)
    if major is None:  # asked on every launch: the host's share of a small step counts
        major = _CAPABILITY[index] = torch.cuda.get_device_capability(index)[0]
    return major >= 9


def _tma_reduce(device: torch.device) -> bool:
    """Bulk TMA reductions (``cp.reduce.async.bulk.tensor``) into the fp32 accumulators of the atomic variants: as
    :func:`_tma_capable`, but not under the CPU interpreter, which has no descriptor reductions (the CPU tests
    take the per-element atomics there; the GPU tests check both)."""
    return not interpreting() and _tma_capable(device)


def _reduce_desc(acc: Tensor, rows: int, cols: int, block_rows: int, block_cols: int):
    """A tensor descriptor over a dense fp32 accumulator seen as ``[slices, rows, cols]``, ``[1, block_rows,
    block_cols]`` tiles (the kernels add whole tiles into it with one bulk reduction each)."""
    return TensorDescriptor(acc, [acc.numel() // (rows * cols), rows, cols], [rows * cols, cols, 1],
                            [1, block_rows, block_cols])


def _tma_tiles(bias: Optional[Tensor], Lq: int, Lk: int) -> bool:
    """Whether a bias could have its tiles read by TMA in some layout: a TMA dtype, full over Lq and Lk (a tile dim
    broadcast with stride 0 cannot be described), on a capable device."""
    return (bias is not None and bias.dtype in _TMA_DTYPES and tuple(bias.shape[3:]) == (Lq, Lk)
            and min(Lq, Lk) >= 2 and _tma_capable(bias.device))


def bias_tma(bias: Optional[Tensor], Lq: int, Lk: int) -> Optional[Tuple[int, int, Tuple[int, int, int]]]:
    """How the forward, dK/dV and dQ kernels may read bias tiles through a tensor descriptor, or None.

    A descriptor sees the bias as ``[slices, Lq, Lk]``: the batch dims (B, R, H; 0 stride where broadcast) must
    step in whole multiples of one slice stride, and TMA needs a 16-byte aligned base, row and slice strides and a
    contiguous last dim (:func:`_tma_tiles` for the rest). Returns (slice stride, number of slices, the batch
    strides counted in slices). On an H100 this takes the per-element address arithmetic of each bias tile off the
    inner loops (a forward probe on the triangle [1,768,4,768,32]: 1.43-1.45 -> 1.30 ms).
    """
    if not _tma_tiles(bias, Lq, Lk) or bias.stride(4) != 1:
        return None
    esize = bias.element_size()
    s_m = bias.stride(3)
    if s_m < Lk or (s_m * esize) % 16 or bias.data_ptr() % 16:  # rows repeated by a 0 stride: pointer loads
        return None
    batch = _bstrides(bias)[:3]
    steps = [s for s in batch if s]
    slice_stride = min(steps) if steps else Lq * s_m
    if (slice_stride * esize) % 16 or any(s % slice_stride for s in steps):
        return None
    last = sum((n - 1) * s for n, s in zip(bias.shape[:3], batch))
    return slice_stride, last // slice_stride + 1, tuple(s // slice_stride for s in batch)


# Below this many attention scores per launch (B*R*H*Lq*Lk; 2**29 is the triangle [1,512,4,512,*]) the bias is read
# by pointer loads, not TMA: Triton encodes a descriptor on the host at every launch (~0.5 ms per fwd + bwd of the
# triangle [1,256,4,256,32] on an H100 host), more than the kernels of such a step save (docs/bench/crop_h100.md).
TMA_MIN_SCORES = 2 ** 29


def _host_bound(q: Tensor, Lq: int, Lk: int) -> bool:
    """Whether a step is small enough that the host's descriptor work outweighs TMA's gain (the CPU interpreter
    always takes TMA, so the CPU tests cover that path at their small shapes)."""
    B, R, H = q.shape[:3]
    return B * R * H * Lq * Lk < TMA_MIN_SCORES and not interpreting()


def bias_for_tiles(bias: Optional[Tensor], q: Tensor, Lq: int, Lk: int):
    """(the bias the kernels read, :func:`bias_tma` of it).

    A bias that the TMA path cannot take as it is (a heads-last pair bias, the blocks' projection layout, has a
    non-contiguous Lk; rows of an odd length are not 16-byte multiples) is copied into 16-byte aligned rows when
    several programs re-read it, i.e. it is broadcast over a batch dim of q (a pair bias shared over R): one copy
    of the bias per pass against one read per row. Its gradient keeps the bias's shape and dtype either way.
    """
    if bias is None or _host_bound(q, Lq, Lk):
        return bias, None
    tma = bias_tma(bias, Lq, Lk)
    if tma is not None or not _tma_tiles(bias, Lq, Lk) or tuple(bias.shape[:3]) == tuple(q.shape[:3]):
        return bias, tma
    pitch = _cdiv(Lk * bias.element_size(), 16) * 16 // bias.element_size()
    rows = torch.empty(tuple(bias.shape[:4]) + (pitch,), dtype=bias.dtype, device=bias.device)[..., :Lk]
    rows.copy_(bias)
    return rows, bias_tma(rows, Lq, Lk)


def _bias_operand(bias: Optional[Tensor], dummy: Tensor, tma, block_m: int, block_n: int):
    """(bias argument, its five strides, HAS_BIAS) for a kernel reading [block_m, block_n] bias tiles: a tensor
    descriptor (HAS_BIAS 2, batch strides in slices) where :func:`bias_tma` allowed it, else the tensor (1) or the
    dummy (0) as :func:`_bias_args` gives them."""
    if tma is None:
        bias_t, strides = _bias_args(bias, dummy)
        return bias_t, strides, int(bias is not None)
    slice_stride, n_slices, batch = tma
    Lq, Lk = bias.shape[3], bias.shape[4]
    desc = TensorDescriptor(bias, [n_slices, Lq, Lk], [slice_stride, bias.stride(3), 1], [1, block_m, block_n])
    return desc, (*batch, bias.stride(3), 1), 2


def attn_forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                 scale: float, causal: bool, q_seg: Optional[Tensor] = None, k_seg: Optional[Tensor] = None
                 ) -> Tuple[Tensor, Tensor]:
    """out ``[B, R, H, Lq, Dv]`` (q.dtype, dense in q's dim order) and lse ``[B, R, H, Lq]`` (fp32, natural log).

    ``q_seg``/``k_seg``: None or the ``op.segment_tables`` of the query / key ids (both or neither)."""
    B, R, H, Lq, D = q.shape
    Lk, Dv = k.shape[3], v.shape[4]
    out = empty_in_order(q, (B, R, H, Lq, Dv), q.dtype)
    lse = torch.empty((B, R, H, Lq), dtype=torch.float32, device=q.device)
    m8 = _mask_u8(mask)
    bias, tma = bias_for_tiles(bias, q, Lq, Lk)
    mask_t, sm = _bias_args(m8, q)
    qs_t, ks_t, ss = _seg_args(q_seg, k_seg, lse)
    qkv_rows, out_rows = (*_rows(q), *_rows(k), *_rows(v)), _rows(out)  # the same for every config

    def launch(c):
        grid = (_cdiv(Lq, c.block_m), B * R * H)
        bias_t, sb, has_bias = _bias_operand(bias, q, tma, c.block_m, c.block_n)
        _launch(
            attn_fwd_kernel, grid,
            (q, k, v, bias_t, mask_t, out, lse, qs_t, ks_t, *qkv_rows, *sb, *sm, *out_rows, *ss,
             R, H, Lq, Lk, D, Dv, scale),
            c.num_warps, c.num_stages,
            HAS_BIAS=has_bias, HAS_MASK=_mask_kind(mask), CAUSAL=causal, HAS_SEG=q_seg is not None,
            EVEN_M=Lq % c.block_m == 0, EVEN_N=Lk % c.block_n == 0, EVEN_D=_even_d(D, Dv),
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv),
        )

    cfg = pick("fwd", _key(q, v, bias, mask, causal, q_seg is not None, tma is None), _width(q, D, Dv), Lq, Lk, launch,
               device=q.device.index)
    launch(cfg)
    return out, lse


def _dbias_splits(n_programs: int, total_steps: int, device: torch.device) -> int:
    """How many programs share one dbias tile's reduction loop when the config does not say (``Cfg.splits`` 0):
    a few programs per SM, so that the grid is not one wave and a small remainder."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 8  # the CPU interpreter: small, but exercises the split path in tests
    return max(1, min(total_steps, 64, _cdiv(target, n_programs)))


def _even_splits(n_steps: int, splits: int) -> Tuple[int, int]:
    """(steps per split, number of splits) with no empty split."""
    per = _cdiv(n_steps, splits)
    return per, _cdiv(n_steps, per)


def attn_backward(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  bias: Optional[Tensor], mask: Optional[Tensor], scale: float, causal: bool, fused: bool,
                  need_dbias: bool, atomic_dbias: bool = False, q_seg: Optional[Tensor] = None,
                  k_seg: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """dq, dk, dv (same shapes/strides as q, k, v) and dbias (bias's own shape and dtype, or None).

    ``fused``: one pass over key tiles with dQ by fp32 atomics (not bitwise deterministic). Otherwise a dK/dV
    kernel over key tiles and a dQ kernel over query tiles, no atomics. dBias is written by the dQ kernel
    (dK/dV kernel when fused) when the bias has every dim full. A bias broadcast over batch dims gets its
    gradient from the deterministic reduction kernel in ``dbias.py`` or, with ``atomic_dbias`` (and the bias
    full over Lq and Lk), from fp32 atomics in the dK/dV kernel (not bitwise deterministic). ``q_seg``/``k_seg``:
    segment id tables as in :func:`attn_forward`.
    """
    B, R, H, Lq, D = q.shape
    Lk, Dv = k.shape[3], v.shape[4]
    dev = q.device
    BD, BDV = _pow2(D), _pow2(Dv)
    m8 = _mask_u8(mask)
    bias, tma = bias_for_tiles(bias, q, Lq, Lk)  # any copy has the bias's shape and dtype (so has dbias)
    mask_t, sm = _bias_args(m8, q)
    seg = q_seg is not None
    qs_t, ks_t, ss = _seg_args(q_seg, k_seg, lse)
    dims = (B, R, H, Lq, Lk)
    direct_dbias = need_dbias and tuple(bias.shape) == dims
    atomic = need_dbias and not direct_dbias and atomic_dbias and tuple(bias.shape[3:]) == (Lq, Lk)
    want_dbias = need_dbias and not direct_dbias and not atomic

    # 1. delta = rowsum(dO * O) - dlse: [B, R, H, Lq] fp32
    delta = torch.empty((B, R, H, Lq), dtype=torch.float32, device=dev)
    bm_pre = 16 if interpreting() else 64
    _launch(bwd_preprocess_kernel, (_cdiv(Lq, bm_pre), B * R * H),
            (out, do, q if dlse is None else dlse, delta, *_rows(out), *_rows(do), R, H, Lq, Dv), 4, 3,
            HAS_DLSE=dlse is not None, BLOCK_M=bm_pre, BLOCK_DV=BDV)

    dq = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=dev)
    dk = torch.empty_strided(k.shape, k.stride(), dtype=k.dtype, device=dev)
    dv = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=dev)
    dbias = None
    if direct_dbias:  # causal / segments: tiles that are never visited must start at zero
        dbias = (torch.zeros if causal or seg else torch.empty)(bias.shape, dtype=bias.dtype, device=dev)
    elif atomic:  # fp32 accumulator, zeroed per launch; in dq's memory (written only after it) when it fits
        dbias = _f32_buffer(bias.numel(), dev, None if fused else dq).view(bias.shape)
    gs = (0,) * 5 if dbias is None else _bstrides(dbias)
    # The atomic accumulators take bulk TMA reductions (one per tile, H100: see attention_h100.md) where the
    # copy engine can address them: dense, 16-byte rows. The dense dbias accumulator's batch strides then count
    # [Lq, Lk] slices; the fused dQ accumulator is allocated dense ([B*R*H] slices of [Lq, D]).
    reduce = _tma_reduce(dev) and not _host_bound(q, Lq, Lk)
    tma_dbias = atomic and reduce and Lk % 4 == 0
    tma_dq = fused and reduce and D % 4 == 0
    if tma_dbias:
        gs = tuple(s // (Lq * Lk) for s in gs[:3]) + gs[3:]
    dq_acc = None
    if fused:
        dq_acc = (torch.empty(q.shape, dtype=torch.float32, device=dev) if tma_dq
                  else torch.empty_strided(q.shape, q.stride(), dtype=torch.float32, device=dev))
    flags = dict(HAS_MASK=_mask_kind(mask), CAUSAL=causal, HAS_SEG=seg)
    qkv_rows, do_rows = (*_rows(q), *_rows(k), *_rows(v)), _rows(do)  # the same for every config

    def operands(c):
        """The bias argument, the stride tuple and the constexpr flags (HAS_BIAS first, the kernels' parameter
        order) of a launch with c's tiles (only a bias descriptor's block shape depends on them)."""
        bias_t, sb, has_bias = _bias_operand(bias, q, tma, c.block_m, c.block_n)
        return bias_t, (*qkv_rows, *sb, *sm, *do_rows), dict(HAS_BIAS=has_bias, **flags)
    key = _key(q, v, bias, mask, causal, fused, direct_dbias, atomic, seg, tma is None)

    # 2. dK, dV (+ dQ by atomics when fused, + dBias when it is unbroadcast or accumulated by atomics)
    def launch_dkdv(c):
        if fused:
            dq_acc.zero_()
        if atomic:
            dbias.zero_()
        bias_t, strides, kflags = operands(c)
        dq_arg = _reduce_desc(dq_acc, Lq, D, c.block_m, BD) if tma_dq else (q if dq_acc is None else dq_acc)
        dbias_arg = _reduce_desc(dbias, Lq, Lk, c.block_m, c.block_n) if tma_dbias else (
            q if dbias is None else dbias)
        _launch(
            attn_bwd_dkdv_kernel, (_cdiv(Lk, c.block_n), B * _cdiv(R, c.rows) * H),
            (q, k, v, bias_t, mask_t, do, lse, delta, dq_arg, dk, dv, dbias_arg, qs_t, ks_t, *strides, *gs, *ss,
             R, H, Lq, Lk, D, Dv, scale),
            c.num_warps, c.num_stages, **kflags,
            FUSED_DQ=(2 if tma_dq else 1) if fused else 0, DIRECT_DBIAS=direct_dbias and fused,
            ATOMIC_DBIAS=(2 if tma_dbias else 1) if atomic else 0,
            EVEN_M=Lq % c.block_m == 0, EVEN_N=Lk % c.block_n == 0, EVEN_D=_even_d(D, Dv), ROWS=c.rows,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_D=BD, BLOCK_DV=BDV,
        )

    launch_dkdv(pick("dkdv", key, _width(q, D, Dv), Lq, Lk, launch_dkdv,
                     pair=_pairs_rows(bias, R, causal, atomic and not fused) and not seg, device=dev.index))
    if atomic:
        dbias = dbias.to(bias.dtype, copy=True)  # a copy: the accumulator may live in dq's memory

    # 3. dBias of a broadcast bias: deterministic tile-owner reduction. It runs before dq is written, so its
    #    fp32 split partials can live in dq's memory (no extra peak memory).
    if want_dbias:
        dbias = _dbias_reduce(q, k, v, bias, mask_t, sm, do, lse, delta, scale, causal, _mask_kind(mask), key,
                              scratch=dq, seg=(qs_t, ks_t, ss) if seg else None)

    # 4. dQ over query tiles (split variant)
    if fused:
        dq.copy_(dq_acc)
    else:
        def launch_dq(c):
            bias_t, strides, kflags = operands(c)
            _launch(
                attn_bwd_dq_kernel, (_cdiv(Lq, c.block_m), B * R * H),
                (q, k, v, bias_t, mask_t, do, lse, delta, dq, q if dbias is None else dbias, qs_t, ks_t, *strides,
                 *gs, *ss, R, H, Lq, Lk, D, Dv, scale),
                c.num_warps, c.num_stages, **kflags, DIRECT_DBIAS=direct_dbias,
                EVEN_M=Lq % c.block_m == 0, EVEN_N=Lk % c.block_n == 0, EVEN_D=_even_d(D, Dv),
                BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_D=BD, BLOCK_DV=BDV,
            )

        launch_dq(pick("dq", key, _width(q, D, Dv), Lq, Lk, launch_dq, device=dev.index))
    return dq, dk, dv, dbias


def _f32_buffer(n: int, device: torch.device, scratch: Optional[Tensor] = None) -> Tensor:
    """n fp32 elements over ``scratch``'s memory (a buffer not yet written) when given and big enough, else new."""
    if scratch is not None and scratch.untyped_storage().nbytes() >= 4 * n:
        return torch.empty(0, dtype=torch.float32, device=device).set_(scratch.untyped_storage(), 0, (n,), (1,))
    return torch.empty(n, dtype=torch.float32, device=device)


def _dbias_reduce(q, k, v, bias, mask_t, sm, do, lse, delta, scale, causal, mask_kind, key, scratch,
                  seg=None) -> Tensor:
    B, R, H, Lq, D = q.shape
    Lk, Dv = k.shape[3], v.shape[4]
    BB, BR, BH, BLq, BLk = bias.shape
    loop_m, loop_n = BLq == 1 and Lq > 1, BLk == 1 and Lk > 1
    n_groups = BB * BR * BH
    qs_t, ks_t, ss = seg if seg is not None else (lse, lse, (0, 0, 0, 0))
    state = {}

    def launch(c):
        n_mt, n_nt = _cdiv(Lq, c.block_m), _cdiv(Lk, c.block_n)
        tiles = (1 if loop_m else n_mt) * (1 if loop_n else n_nt)
        lr_n, lh_n = R // BR, H // BH
        total = (B // BB) * lr_n * lh_n  # batch steps summed into each tile
        want = c.splits or _dbias_splits(tiles * n_groups, total, q.device)
        per, splits = _even_splits(total, min(want, total))
        numel = bias.numel()
        dbias = torch.empty(bias.shape, dtype=bias.dtype, device=q.device)  # dense, in the bias's dtype
        # splits > 1: fp32 partials, in the scratch memory (dq's, not yet written) when it is big enough; one
        # split writes dbias directly
        part = dbias if splits == 1 else _f32_buffer(splits * numel, q.device, scratch)
        _launch(
            attn_bwd_dbias_kernel, (tiles, n_groups, splits),
            (q, k, v, bias, mask_t, do, lse, delta, part, qs_t, ks_t,
             *_rows(q), *_rows(k), *_rows(v), *_bstrides(bias), *sm, *_rows(do), numel, *_bstrides(dbias), *ss,
             R, H, BR, BH, lr_n, lh_n, total, Lq, Lk, D, Dv, scale * LOG2E, per),
            c.num_warps, c.num_stages,
            HAS_MASK=mask_kind, CAUSAL=causal, HAS_SEG=seg is not None, LOOP_M=loop_m, LOOP_N=loop_n, LOOP_B=B // BB > 1,
            EVEN_M=Lq % c.block_m == 0, EVEN_N=Lk % c.block_n == 0, EVEN_D=_even_d(D, Dv),
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv),
        )
        # The sum over the splits is part of the launch, so the tuner times a split count with its cost: one
        # small kernel adds each element's partials in split order (no atomics: the bits repeat) and writes the
        # result in the bias's dtype.
        if splits > 1:
            block = 1024
            _launch(sum_splits_kernel, (_cdiv(numel, block),), (part, dbias, numel, splits), 4, 1, BLOCK=block)
        state["dbias"] = dbias

    # the bias's broadcast pattern is in the key; R's power of two sets how many batch steps each tile sums
    cfg = pick("dbias", key + ((B // BB * R // BR * H // BH).bit_length(),), _width(q, D, Dv), Lq, Lk, launch,
               device=q.device.index)
    launch(cfg)
    return state["dbias"]
