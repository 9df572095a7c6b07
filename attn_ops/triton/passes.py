"""What each kernel is given: the bias layout (TMA descriptors, padded rows), the tuner keys, and the launch
records of the forward, the backward (the delta preprocess, the dK/dV and dQ kernels, split or fused, and the
dBias reduction of a broadcast bias) and the segment tables, recorded as launch plans on ``launch.py``'s
``Recorder``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..settings import get as _settings, interpreting
from . import tuning
from .backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_preprocess_kernel
from .common import LOG2E
from .dbias import attn_bwd_dbias_kernel, sum_splits_kernel
from .forward import attn_fwd_kernel
from .launch import (STATE, Recorder, TensorDescriptor, _align, _bstrides, _cdiv, _current_device, _empty, _even,
                     _geo, _order, _pow2, run_plan, _rows, _tma_capable, launch_kernel, sm_count)
from .segtable import segment_table_kernel
from .tuning import bucket

Tensor = torch.Tensor
_SEG_BLOCK = 1024  # positions per step of the segment-table kernel's scans


def _width(q, D, Dv) -> int:
    """Head width in 16-bit units, for pruning tile candidates (fp32 tiles take twice the shared memory)."""
    return max(D, Dv) * q.element_size() // 2


def _tile_args(c, Lq: int, Lk: int, D: int, Dv: int, align: int, bias=None, **middle) -> dict:
    """The constexpr tail of a launch with ``c``'s tiles, in the kernels' parameter order: EVEN_M, EVEN_N,
    ``middle``, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, D, Dv, ALIGN and, given ``bias`` (tensor, HAS_BIAS), BIAS_ALIGN."""
    even_m, even_n = _even(Lq, c.block_m), _even(Lk, c.block_n)
    tail = dict(EVEN_M=even_m, EVEN_N=even_n, **middle, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_D=_pow2(D),
                BLOCK_DV=_pow2(Dv), D=D, Dv=Dv, ALIGN=align)
    if bias is not None:
        tail["BIAS_ALIGN"] = _bias_align(*bias, even_m and even_n)
    return tail


def _bias_align(bias: Optional[Tensor], has_bias: int, in_range: bool) -> int:
    """The kernels' BIAS_ALIGN: 16 bytes in elements where bias tiles are read by pointer loads that carry no column
    masks (HAS_BIAS 1 with ``in_range``: EVEN_M and EVEN_N, every tile inside [Lq, Lk]; HAS_BIAS 3, rows read in
    whole tiles, at any length) and the bias's base, batch strides and row stride are that aligned; else 1. Its row
    stride is not specialised (a length), so without it each tile loads element by element. A contiguous bias of
    such lengths, and every padded copy, is aligned: no compile variant is added."""
    if not (has_bias == 3 or (has_bias == 1 and in_range)):
        return 1
    vec = 16 // bias.element_size()
    return 1 if bias.data_ptr() % 16 or any(s % vec for s in _bstrides(bias)[:4]) else vec


def _mask_kind(mask: Optional[Tensor]) -> int:
    """HAS_MASK for the kernels: 0 none, 1 a key mask (size 1 along Lq), 2 a mask varying along Lq."""
    return 0 if mask is None else 1 if mask.shape[3] == 1 else 2


def _key(q: Tensor, v: Tensor, bias, mask, causal: bool, *extra) -> Tuple:
    """The tuner's key: length buckets (not lengths, :func:`tuning.bucket`), the batch count's power of two, the
    head widths, dtypes, bias/mask kind and broadcast pattern, and the TMA switch (it changes the kernels)."""
    B, R, H, Lq, D = q.shape
    pattern, bias_dtype = (None, None) if bias is None else (tuple(n == 1 for n in bias.shape), str(bias.dtype))
    return (str(q.dtype), D, v.shape[-1], bucket(Lq), bucket(v.shape[3]), (B * R * H).bit_length(), pattern,
            bias_dtype, _mask_kind(mask), causal, _settings().tma) + extra


def _seg_strides(q_seg: Optional[Tensor], k_seg: Optional[Tensor]) -> Tuple[int, int, int, int]:
    """The (b, r) strides of the query and key segment tables (0 on broadcast dims; all 0 without ids)."""
    if q_seg is None:
        return 0, 0, 0, 0
    return tuple(0 if n == 1 else s for t in (q_seg, k_seg) for n, s in zip(t.shape[:2], t.stride()[:2]))


_TMA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    strides counted in slices). This takes the per-element address arithmetic of each bias tile off the inner
    loops (docs/bench/history.md, "Design measurements").
    """
    if not _tma_tiles(bias, Lq, Lk) or bias.stride(4) != 1:
        return None
    esize, s_m = bias.element_size(), bias.stride(3)
    if s_m < Lk or (s_m * esize) % 16 or bias.data_ptr() % 16:  # rows repeated by a 0 stride: pointer loads
        return None
    batch = _bstrides(bias)[:3]
    steps = [s for s in batch if s]
    slice_stride = min(steps) if steps else Lq * s_m
    if (slice_stride * esize) % 16 or any(s % slice_stride for s in steps):
        return None
    last = sum((n - 1) * s for n, s in zip(bias.shape[:3], batch))
    return slice_stride, last // slice_stride + 1, tuple(s // slice_stride for s in batch)


def _host_bound(q: Tensor, Lq: int, Lk: int) -> bool:
    """Whether a step is small enough that the host's descriptor work outweighs TMA's gain (the CPU interpreter
    always takes TMA, so the CPU tests cover that path at their small shapes)."""
    return q.shape[:3].numel() * Lq * Lk < STATE.tma_min_scores and not interpreting()


# Pointer-loaded bias tiles read whole rows of this many columns from a padded copy (HAS_BIAS 3): the widest key
# tile, so that every tile's columns lie inside the copy's rows.
PAD_COLS = 128


def bias_for_tiles(bias: Tensor, q: Tensor, Lq: int, Lk: int):
    """(the bias the kernels read, :func:`bias_tma` of it, whether its rows can be read in whole tiles: HAS_BIAS 3).

    A bias that several programs re-read (it is broadcast over a batch dim of q: a pair bias shared over R) is
    copied once per pass where its layout would make every tile's loads slow, one copy against one read per row:
    - for TMA, where the descriptor cannot take it as it is (a heads-last pair bias, the blocks' projection layout,
      has a non-contiguous Lk; rows of an odd length are not 16-byte multiples): into 16-byte aligned rows;
    - for pointer loads (steps under ``STATE.tma_min_scores``, GPUs without TMA), where Lk is not a multiple of
      ``PAD_COLS`` or the columns are not contiguous: into contiguous rows padded to a multiple of ``PAD_COLS``
      (HAS_BIAS 3), so that no tile needs a column mask and every row starts 16-byte aligned (BIAS_ALIGN); one
      whose rows already fill whole tiles is read as it is, with HAS_BIAS 3 too.
    Its gradient keeps the bias's shape and dtype either way.
    """
    reused = tuple(bias.shape[:3]) != tuple(q.shape[:3]) and tuple(bias.shape[3:]) == (Lq, Lk) and min(Lq, Lk) >= 2
    if not _host_bound(q, Lq, Lk):
        tma = bias_tma(bias, Lq, Lk)
        if tma is not None:
            return bias, tma, False
        if reused and _tma_tiles(bias, Lq, Lk):
            rows = _rows_copy(bias, tuple(bias.shape), _cdiv(Lk * bias.element_size(), 16) * 16 // bias.element_size())
            return rows, bias_tma(rows, Lq, Lk), False
    if not reused:
        return bias, None, False
    if Lk % PAD_COLS == 0 and bias.stride(4) == 1:  # its rows fill whole tiles already: read as it is, the same
        return bias, None, True  # kernel variant as every other length's copy (no compile per length)
    return _rows_copy(bias, tuple(bias.shape), _cdiv(Lk, PAD_COLS) * PAD_COLS), None, True


def _bias_slot(rec: Recorder, b: int, q: Tensor, Lq: int, Lk: int):
    """(env slot of the bias the kernels read, that tensor, :func:`bias_tma` of it, whether its rows can be read in
    whole tiles): :func:`bias_for_tiles` as a step; (None, None, None, False) without a bias."""
    bias = rec.env[b]
    if bias is None:
        return None, None, None, False
    read, tma, whole_rows = bias_for_tiles(bias, q, Lq, Lk)
    if read is bias:
        return b, bias, tma, whole_rows
    shape, pitch = tuple(read.shape), read.stride(3)
    first = [read]  # this call's copy, made above; replays make their own

    def copy(env):
        return first.pop() if first else _rows_copy(env[b], shape, pitch)

    return rec.new(copy), read, tma, whole_rows


def _rows_copy(bias: Tensor, shape, pitch: int) -> Tensor:
    """``bias`` in rows of ``pitch`` elements (the columns past ``shape[4]`` left unwritten)."""
    rows = torch.empty(shape[:4] + (pitch,), dtype=bias.dtype, device=bias.device)[..., :shape[4]]
    return rows.copy_(bias)


def _bias_operand_slot(read: Tuple, c, dummy: int):
    """(leading argument: the env slot of the bias read (:func:`_bias_slot`), a per-call descriptor maker, or the
    ``dummy`` slot; its five strides; HAS_BIAS) of a kernel reading ``c``'s [block_m, block_n] bias tiles: a tensor
    descriptor (HAS_BIAS 2, batch strides in slices) where :func:`bias_tma` allowed it, else the tensor (1; 3 where
    its rows are readable in whole tiles, :func:`bias_for_tiles`) or nothing (0)."""
    b, bias, tma, whole_rows = read
    if b is None:
        return dummy, (0, 0, 0, 0, 0), 0
    if tma is None:  # (a tile wider than the padding reads the copy with column masks, as HAS_BIAS 1)
        return b, _bstrides(bias), 3 if whole_rows and c.block_n <= PAD_COLS else 1
    slice_stride, n_slices, batch = tma
    dims, strides = [n_slices, bias.shape[3], bias.shape[4]], [slice_stride, bias.stride(3), 1]
    block = [1, c.block_m, c.block_n]
    return (lambda env: TensorDescriptor(env[b], dims, strides, block)), (*batch, bias.stride(3), 1), 2


def attn_forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], scale: float,
                 causal: bool, q_seg: Optional[Tensor] = None, k_seg: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """out ``[B, R, H, Lq, Dv]`` (q.dtype, dense in q's dim order) and lse ``[B, R, H, Lq]`` (fp32, natural log).

    ``q_seg``/``k_seg``: None or the ``op.segment_tables`` of the query / key ids (both or neither)."""
    m8 = None if mask is None else mask.view(torch.uint8)
    env = [q, k, v, bias, m8, q_seg, k_seg]
    key = ("fwd", _geo(q), _geo(k), _geo(v), _geo(bias), _geo(m8), _geo(q_seg), _geo(k_seg), scale, causal,
           _current_device() if q.is_cuda else -1, interpreting(), _settings())
    o, lse = run_plan(key, env, _record_forward, scale, causal)
    return env[o], env[lse]


def _record_forward(rec: Recorder, scale: float, causal: bool) -> Tuple[int, int]:
    q, k, v, bias, m8, q_seg, k_seg = rec.env
    B, R, H, Lq, D, Lk, Dv = *q.shape, k.shape[3], v.shape[4]
    o = rec.new(_empty((B, R, H, Lq, Dv), q.dtype, q.device, order=_order(q)))
    lse = rec.new(_empty((B, R, H, Lq), torch.float32, q.device))
    out = rec.env[o]
    read = _bias_slot(rec, 3, q, Lq, Lk)
    bias_t, tma = read[1:3]
    sm = (0,) * 5 if m8 is None else _bstrides(m8)
    seg, ss = q_seg is not None, _seg_strides(q_seg, k_seg)
    rows = (*_rows(q), *_rows(k), *_rows(v))  # the same for every config
    flags = dict(HAS_MASK=_mask_kind(m8), CAUSAL=causal, HAS_SEG=seg)
    align = _align(q, k, v, out)

    def run(c):
        arg, sb, has_bias = _bias_operand_slot(read, c, dummy=0)
        rec.launch(attn_fwd_kernel, (_cdiv(Lq, c.block_m), B * R * H),
                   (0, 1, 2, arg, 4 if m8 is not None else 0, o, lse, 5 if seg else lse, 6 if seg else lse),
                   (*rows, *sb, *sm, *_rows(out), *ss, R, H, Lq, Lk, scale),
                   c.num_warps, c.num_stages, HAS_BIAS=has_bias, **flags,
                   **_tile_args(c, Lq, Lk, D, Dv, align, (bias_t, has_bias)))

    rec.tuned("fwd", _key(q, v, bias_t, m8, causal, seg, tma is None), _width(q, D, Dv), Lq, Lk, run,
              device=q.device.index)
    return o, lse


# deterministic=False below STATE.tma_min_scores: a broadcast bias's gradient by vector atomics in the dQ kernel
# (False: by per-element atomics in the dK/dV kernel, the older path, kept for comparisons; clear_plans() after a
# change)
DBIAS_ATOMICS_IN_DQ = True


def _tma_reduce(device: torch.device) -> bool:
    """Bulk TMA reductions (``cp.reduce.async.bulk.tensor``) into the fp32 accumulators of the atomic variants: as
    :func:`_tma_capable`, but not under the CPU interpreter, which has no descriptor reductions (the CPU tests
    take the other atomics there: the split dQ kernel's, the fused dK/dV kernel's; the GPU tests check all)."""
    return not interpreting() and _tma_capable(device)


def _reduce_desc(acc: Tensor, rows: int, cols: int, block_rows: int, block_cols: int):
    """A tensor descriptor over a dense fp32 accumulator seen as ``[slices, rows, cols]``, ``[1, block_rows,
    block_cols]`` tiles (the kernels add whole tiles into it with one bulk reduction each)."""
    return TensorDescriptor(acc, [acc.numel() // (rows * cols), rows, cols], [rows * cols, cols, 1],
                            [1, block_rows, block_cols])


def _dbias_splits(splits: int, n_programs: int, total_steps: int, device: torch.device) -> int:
    """How many programs share one dbias tile's batch loop for the config value ``splits`` (``Cfg.splits``): 1, one
    program per tile; n > 1, enough splits for about n programs per SM; 0, ``tuning.DBIAS_PER_SM`` per SM. A count
    per SM, not a fixed count, so that a config tuned at one length of a bucket fills the GPU alike at the others (a
    fixed 2 tuned at N=300 made N=384's grid one wave and a sliver: docs/bench)."""
    if splits == 1:
        return 1
    sms = sm_count(device) if device.type == "cuda" else 2  # the CPU interpreter: small, but splits in tests
    return max(1, min(total_steps, 64, _cdiv((splits or tuning.DBIAS_PER_SM) * sms, n_programs)))


def _even_splits(n_steps: int, splits: int) -> Tuple[int, int]:
    """(steps per split, number of splits) with no empty split."""
    per = _cdiv(n_steps, splits)
    return per, _cdiv(n_steps, per)


_DO, _DLSE, _Q, _K, _V, _OUT, _LSE, _BIAS, _MASK, _QS, _KS = range(11)  # the backward's input slots in env


def attn_backward(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  bias: Optional[Tensor], mask: Optional[Tensor], scale: float, causal: bool, fused: bool,
                  need_dbias: bool, atomic_dbias: bool = False, q_seg: Optional[Tensor] = None,
                  k_seg: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """dq, dk, dv (same shapes/strides as q, k, v) and dbias (bias's own shape and dtype, or None).

    ``fused``: one pass over key tiles with dQ by fp32 atomics (not bitwise deterministic). Otherwise a dK/dV
    kernel over key tiles and a dQ kernel over query tiles, no atomics. dBias is written by the dQ kernel
    (dK/dV kernel when fused) when the bias has every dim full. A bias broadcast over batch dims gets its
    gradient from the deterministic reduction kernel in ``dbias.py`` or, with ``atomic_dbias`` (and the bias
    full over Lq and Lk), from fp32 atomics (not bitwise deterministic): in the split dQ kernel, or in the dK/dV
    kernel when fused or when TMA bulk reductions take them (large steps on Hopper). ``q_seg``/``k_seg``:
    segment id tables as in :func:`attn_forward`.
    """
    m8 = None if mask is None else mask.view(torch.uint8)
    env = [do, dlse, q, k, v, out, lse, bias, m8, q_seg, k_seg]
    key = ("bwd", _geo(do), _geo(dlse), _geo(q), _geo(k), _geo(v), _geo(out), _geo(lse), _geo(bias), _geo(m8),
           _geo(q_seg), _geo(k_seg), scale, causal, fused, need_dbias, atomic_dbias,
           _current_device() if q.is_cuda else -1, interpreting(), _settings())
    dq, dk, dv, db = run_plan(key, env, _record_backward, scale, causal, fused, need_dbias, atomic_dbias)
    return env[dq], env[dk], env[dv], (None if db is None else env[db])


def _record_backward(rec: Recorder, scale: float, causal: bool, fused: bool, need_dbias: bool, atomic_dbias: bool):
    do, dlse, q, k, v, out, lse, bias, m8, q_seg, k_seg = rec.env
    B, R, H, Lq, D, Lk, Dv = *q.shape, k.shape[3], v.shape[4]
    dev, BD = q.device, _pow2(D)
    # any copy of the bias has its shape and dtype (so has dbias)
    read = _bias_slot(rec, _BIAS, q, Lq, Lk)
    b, bias_t, tma, _ = read
    mask_slot, sm = (_Q, (0,) * 5) if m8 is None else (_MASK, _bstrides(m8))
    seg = q_seg is not None
    seg_slots, ss = ((_QS, _KS) if seg else (_LSE, _LSE)), _seg_strides(q_seg, k_seg)
    direct_dbias = need_dbias and tuple(bias.shape) == (B, R, H, Lq, Lk)
    atomic = need_dbias and not direct_dbias and atomic_dbias and tuple(bias.shape[3:]) == (Lq, Lk)
    # The atomic accumulators take bulk TMA reductions (one per tile; faster: docs/bench/attention_h100.md) where the
    # copy engine can address them: dense, 16-byte rows. The dense dbias accumulator's batch strides then count
    # [Lq, Lk] slices; the fused dQ accumulator is allocated dense ([B*R*H] slices of [Lq, D]).
    reduce = _tma_reduce(dev) and not _host_bound(q, Lq, Lk)
    tma_dbias = atomic and reduce and Lk % 4 == 0
    tma_dq = fused and reduce and D % 4 == 0
    # without TMA, the split backward's atomics go into the dQ kernel, whose dS tiles run along the accumulator's
    # rows: 16-byte vector atomics, where the dK/dV kernel's transposed tiles add one float at a time
    dq_atomic = atomic and not fused and not tma_dbias and DBIAS_ATOMICS_IN_DQ

    align = _align(q, k, v, out, do)  # (dq, dk, dv and a fused dQ accumulator take q's, k's and v's strides)
    # 1. delta = rowsum(dO * O) - dlse: [B, R, H, Lq] fp32
    delta = rec.new(_empty((B, R, H, Lq), torch.float32, dev))
    bm_pre = 16 if interpreting() else 64
    rec.launch(bwd_preprocess_kernel, (_cdiv(Lq, bm_pre), B * R * H), (_OUT, _DO, _Q if dlse is None else _DLSE, delta),
               (*_rows(out), *_rows(do), R, H, Lq), 4, 3, HAS_DLSE=dlse is not None, BLOCK_M=bm_pre,
               BLOCK_DV=_pow2(Dv), Dv=Dv, ALIGN=align)

    dq, dk, dv = (rec.new(_empty(t.shape, t.dtype, dev, stride=t.stride())) for t in (q, k, v))
    dbias = None
    if direct_dbias:  # causal / segments: tiles that are never visited must start at zero
        make, shape, dtype = torch.zeros if causal or seg else torch.empty, tuple(bias.shape), bias.dtype
        dbias = rec.new(lambda env: make(shape, dtype=dtype, device=dev))
    elif dq_atomic:  # fp32 accumulator, zeroed per launch, rows padded to 16 bytes (the dQ kernel's vector atomics;
        # the padding adds zeros and is never read); not in dq's memory, which that kernel writes meanwhile
        shape, pitch, dtype = tuple(bias.shape), _cdiv(Lk, 4) * 4, bias.dtype
        dbias = rec.new(lambda env: torch.empty(shape[:4] + (pitch,), dtype=torch.float32, device=dev)[..., :Lk])
    elif atomic:  # fp32 accumulator, zeroed per launch; in dq's memory (written only after it) when it fits
        n, shape, dtype, scratch = bias.numel(), tuple(bias.shape), bias.dtype, None if fused else dq
        dbias = rec.new(lambda env: _f32_buffer(n, dev, None if scratch is None else env[scratch]).view(shape))
    acc = dbias  # (steps below that name a slot take it from a variable that is never reassigned)
    gs = (0,) * 5 if dbias is None else _bstrides(rec.env[dbias])
    if dq_atomic:  # the padded pitch as the row stride also for a single query row: the dQ kernel's atomics run to it
        gs = gs[:3] + (rec.env[dbias].stride(3),) + gs[4:]
    if tma_dbias:
        gs = tuple(s // (Lq * Lk) for s in gs[:3]) + gs[3:]
    dq_acc = rec.new(_empty(q.shape, torch.float32, dev, stride=None if tma_dq else q.stride())) if fused else None
    flags = dict(HAS_MASK=_mask_kind(m8), CAUSAL=causal, HAS_SEG=seg)
    rows = (*_rows(q), *_rows(k), *_rows(v))  # the same for every config
    tail = (*ss, R, H, Lq, Lk, scale)
    key = _key(q, v, bias_t, m8, causal, fused, direct_dbias, atomic, seg, tma is None)

    def operands(c):
        """The bias argument, the stride tuple and the constexpr flags (HAS_BIAS first, the kernels' parameter
        order) of a launch with c's tiles (only a bias descriptor's block shape depends on them)."""
        arg, sb, has_bias = _bias_operand_slot(read, c, dummy=_Q)
        return arg, (*rows, *sb, *sm, *_rows(do)), dict(HAS_BIAS=has_bias, **flags), (bias_t, has_bias)

    # 2. dK, dV (+ dQ by atomics when fused, + dBias when it is unbroadcast or accumulated by atomics)
    def run_dkdv(c):
        if fused:
            rec.do(lambda env: env[dq_acc].zero_())
        if atomic and not dq_atomic:
            rec.do(lambda env: env[acc].zero_())
        arg, strides, kflags, bias_arg = operands(c)
        bm, bn = c.block_m, c.block_n
        dq_arg = (lambda env: _reduce_desc(env[dq_acc], Lq, D, bm, BD)) if tma_dq else (
            _Q if dq_acc is None else dq_acc)
        dbias_arg = (lambda env: _reduce_desc(env[acc], Lq, Lk, bm, bn)) if tma_dbias else (
            _Q if dbias is None or dq_atomic else dbias)
        rec.launch(attn_bwd_dkdv_kernel, (_cdiv(Lk, bn), B * _cdiv(R, c.rows) * H),
                   (_Q, _K, _V, arg, mask_slot, _DO, _LSE, delta, dq_arg, dk, dv, dbias_arg, *seg_slots),
                   (*strides, *gs, *tail), c.num_warps, c.num_stages, **kflags,
                   FUSED_DQ=(2 if tma_dq else 1) if fused else 0, DIRECT_DBIAS=direct_dbias and fused,
                   ATOMIC_DBIAS=(2 if tma_dbias else 1) if atomic and not dq_atomic else 0,
                   **_tile_args(c, Lq, Lk, D, Dv, align, bias_arg, ROWS=c.rows))

    # Two rows r, r + 1 per dK/dV program sharing one bias slice (a bias broadcast over R, summed by the dK/dV
    # kernel's atomics): one atomic add covers both rows' dS; the other variants measured as fast or faster with one
    # row per program (docs/bench/history.md, "Design measurements").
    pair = atomic and not fused and not dq_atomic and bias.shape[1] == 1 and R > 1 and not causal and not seg
    rec.tuned("dkdv", key, _width(q, D, Dv), Lq, Lk, run_dkdv, pair=pair, device=dev.index)
    if atomic and not dq_atomic:
        dbias = rec.new(lambda env: env[acc].to(dtype, copy=True))  # a copy: the accumulator may be in dq's memory

    # 3. dBias of a broadcast bias: deterministic tile-owner reduction. It runs before dq is written, so its
    #    fp32 split partials can live in dq's memory (no extra peak memory).
    if need_dbias and not direct_dbias and not atomic:
        dbias = _record_dbias_reduce(rec, b, mask_slot, sm, seg_slots, ss, delta, scale, causal, key, scratch=dq)

    # 4. dQ over query tiles (split variant)
    if fused:
        rec.do(lambda env: env[dq].copy_(env[dq_acc]))
    else:
        def run_dq(c):
            if dq_atomic:
                rec.do(lambda env: env[acc].zero_())
            arg, strides, kflags, bias_arg = operands(c)
            rec.launch(attn_bwd_dq_kernel, (_cdiv(Lq, c.block_m), B * R * H),
                       (_Q, _K, _V, arg, mask_slot, _DO, _LSE, delta, dq, _Q if dbias is None else dbias, *seg_slots),
                       (*strides, *gs, *tail), c.num_warps, c.num_stages, **kflags,
                       DIRECT_DBIAS=2 if dq_atomic else direct_dbias, **_tile_args(c, Lq, Lk, D, Dv, align, bias_arg))

        rec.tuned("dq", key, _width(q, D, Dv), Lq, Lk, run_dq, device=dev.index)
        if dq_atomic:  # (a copy: a dense tensor, not the padded rows)
            dbias = rec.new(lambda env: env[acc].to(dtype, copy=True))
    return dq, dk, dv, dbias


def _f32_buffer(n: int, device: torch.device, scratch: Optional[Tensor] = None) -> Tensor:
    """n fp32 elements over ``scratch``'s memory (a buffer not yet written) when given and big enough, else new."""
    if scratch is not None and scratch.untyped_storage().nbytes() >= 4 * n:
        return torch.empty(0, dtype=torch.float32, device=device).set_(scratch.untyped_storage(), 0, (n,), (1,))
    return torch.empty(n, dtype=torch.float32, device=device)


def _record_dbias_reduce(rec: Recorder, b: int, mask_slot: int, sm, seg_slots, ss, delta: int, scale: float,
                         causal: bool, key: Tuple, scratch: int) -> int:
    """The gradient of a bias broadcast over batch dims (env slot ``b``) by the deterministic reduction kernel;
    returns its env slot. ``scratch``: the slot of a buffer not yet written (dq) that fp32 split partials may use."""
    q, k, v, bias, do = rec.env[_Q], rec.env[_K], rec.env[_V], rec.env[b], rec.env[_DO]
    B, R, H, Lq, D, Lk, Dv = *q.shape, k.shape[3], v.shape[4]
    BB, BR, BH, BLq, BLk = bias.shape
    loop_m, loop_n = BLq == 1 and Lq > 1, BLk == 1 and Lk > 1
    n_groups = BB * BR * BH
    numel, shape, dtype, dev = bias.numel(), tuple(bias.shape), bias.dtype, q.device
    lr_n, lh_n = R // BR, H // BH
    total = (B // BB) * lr_n * lh_n  # batch steps summed into each tile
    dense = _bstrides(torch.empty(shape, device="meta"))  # dbias is allocated dense: its strides, 0 on broadcast dims
    strides = (*_rows(q), *_rows(k), *_rows(v), *_bstrides(bias), *sm, *_rows(do), numel, *dense)

    def run(c):
        tiles = (1 if loop_m else _cdiv(Lq, c.block_m)) * (1 if loop_n else _cdiv(Lk, c.block_n))
        per, splits = _even_splits(total, _dbias_splits(c.splits, tiles * n_groups, total, dev))
        dbias = rec.new(_empty(shape, dtype, dev))  # dense, in the bias's dtype
        # splits > 1: fp32 partials, in the scratch memory (dq's, not yet written) when it is big enough; one
        # split writes dbias directly
        part = dbias if splits == 1 else rec.new(lambda env: _f32_buffer(splits * numel, dev, env[scratch]))
        rec.launch(attn_bwd_dbias_kernel, (tiles, n_groups, splits),
                   (_Q, _K, _V, b, mask_slot, _DO, _LSE, delta, part, *seg_slots),
                   (*strides, *ss, R, H, BR, BH, lr_n, lh_n, total, Lq, Lk, scale * LOG2E, per),
                   c.num_warps, c.num_stages,
                   HAS_MASK=_mask_kind(rec.env[_MASK]), CAUSAL=causal, HAS_SEG=seg_slots[0] == _QS, LOOP_M=loop_m,
                   LOOP_N=loop_n, LOOP_B=B // BB > 1, **_tile_args(c, Lq, Lk, D, Dv, _align(q, k, v, do)))
        # The sum over the splits is part of the launch, so the tuner times a split count with its cost: one
        # small kernel adds each element's partials in split order (no atomics: the bits repeat) and writes the
        # result in the bias's dtype.
        if splits > 1:
            block = 1024
            rec.launch(sum_splits_kernel, (_cdiv(numel, block),), (part, dbias), (numel, splits), 4, 1, BLOCK=block)
        return dbias

    # the bias's broadcast pattern is in the key; R's power of two sets how many batch steps each tile sums
    return rec.tuned("dbias", key + (total.bit_length(),), _width(q, D, Dv), Lq, Lk, run, device=dev.index)


def segment_tables_flat(q_ids: Tensor, k_ids: Tensor, shared: bool) -> Tensor:
    """int32 ``[B', R', 3 * (Lq + Lk)]`` (``[B', R', 3 * Lq]`` when ``shared``: ``k_ids`` is ``q_ids``) holding the
    query table then the key table of ``op.segment_tables``."""
    batch = torch.broadcast_shapes(q_ids.shape[:-1], k_ids.shape[:-1])
    Lq, Lk = q_ids.shape[-1], k_ids.shape[-1]

    # each side's ids contiguous along L, broadcast over the batch
    qi, ki = ((t if t.stride(-1) == 1 else t.contiguous()).expand(batch + t.shape[-1:]) for t in (q_ids, k_ids))
    B, R = batch
    n = Lq if shared else Lq + Lk  # positions in the tables
    out = torch.empty((B, R, 3 * n), dtype=torch.int32, device=q_ids.device)
    scratch = torch.empty((B * R, 2 * n), dtype=torch.int32, device=q_ids.device)
    launch_kernel(segment_table_kernel, (B * R,), (qi, ki, out, scratch, *qi.stride()[:2], *ki.stride()[:2], R, Lq, Lk,
                  int(Lq).bit_length(), int(Lk).bit_length()), 4, 1, SHARED=shared, BLOCK=_SEG_BLOCK)
    return out


def split_tables(flat: Tensor, Lq: int, Lk: int, shared: bool) -> Tuple[Tensor, Tensor]:
    """The (query, key) table views ``[B', R', 3, L]`` of :func:`segment_tables_flat`'s result."""
    qt = flat[..., :3 * Lq].unflatten(-1, (3, Lq))
    return qt, (qt if shared else flat[..., 3 * Lq:].unflatten(-1, (3, Lk)))
