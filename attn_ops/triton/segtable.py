"""The kernel that builds the segment tables in one launch (its launcher: ``passes.segment_tables_flat``).

For query ids ``[B|1, R|1, Lq]`` and key ids ``[B|1, R|1, Lk]`` (contiguous segments, negative = padding), each
side's table is int32 ``[B', R', 3, L]`` (B', R' the broadcast batch dims): row 0 the ids (negatives as -1), rows 1
and 2 per position the span [lo, hi) of the other side's positions whose ids can equal its id (padding: lo = the
other length, hi = 0, an empty span). A kernel's tile then finds the other side's tiles it must visit from the min
of its lo and the max of its hi (:func:`common.seg_span`), two vector loads.

The spans come from the other side's running maximum of ids (padding as -1) and its suffix minimum (padding as
2**31 - 1), both non-decreasing for contiguous segments: lo is the first position whose running maximum reaches the
id, hi the first whose suffix minimum exceeds it, found by a vectorised binary search. One program per batch row
does the scans and the searches; built with PyTorch ops (scans, searchsorted, flips, stacks) the tables took a
dozen launches and more GPU time than the packed attention's own kernels (docs/bench/packed_h100.md).
"""
from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


@triton.jit
def _ids_and_bounds(Ids, T, RunMax, SufMin, L, BLOCK: tl.constexpr):
    """Row 0 of the table (canonical ids), the running maximum and the suffix minimum of one side's row."""
    carry = tl.full([], -1, tl.int32)
    start = 0
    while start < L:
        offs = start + tl.arange(0, BLOCK)
        ok = offs < L
        x = tl.load(Ids + offs, mask=ok, other=-1)
        x = tl.where(x >= 0, x, -1).to(tl.int32)
        tl.store(T + offs, x, mask=ok)
        m = tl.maximum(tl.associative_scan(x, 0, _max2), carry)
        tl.store(RunMax + offs, m, mask=ok)
        carry = tl.max(m, 0)
        start += BLOCK
    carry = tl.full([], 2147483647, tl.int32)
    start = ((L - 1) // BLOCK) * BLOCK
    while start >= 0:  # the chunks from the last one back
        offs = start + tl.arange(0, BLOCK)
        ok = offs < L
        x = tl.load(Ids + offs, mask=ok, other=-1)
        x = tl.where(x >= 0, x, 2147483647).to(tl.int32)
        m = tl.minimum(tl.associative_scan(x, 0, _min2, reverse=True), carry)
        tl.store(SufMin + offs, m, mask=ok)
        carry = tl.min(m, 0)
        start -= BLOCK


@triton.jit
def _search_step(Sorted, lo, hi, target):
    active = lo < hi
    mid = (lo + hi) // 2
    right = active & (tl.load(Sorted + mid, mask=active, other=0) < target)
    return tl.where(right, mid + 1, lo), tl.where(right, hi, tl.where(active, mid, hi))


@triton.jit
def _spans(T, L_own, RunMax, SufMin, L_other, STEPS, BLOCK: tl.constexpr):
    """Rows 1 and 2 of one side's table from its ids (row 0) and the other side's bounds: per position the first
    running maximum >= its id and the first suffix minimum > it, two binary searches on every lane at once
    (STEPS >= the bit length of L_other), interleaved so their loads overlap."""
    start = 0
    while start < L_own:
        offs = start + tl.arange(0, BLOCK)
        ok = offs < L_own
        x = tl.load(T + offs, mask=ok, other=-1)
        lo_a = tl.zeros([BLOCK], tl.int32)
        hi_a = lo_a + L_other
        lo_b = lo_a
        hi_b = hi_a
        step = 0
        while step < STEPS:
            lo_a, hi_a = _search_step(RunMax, lo_a, hi_a, x)
            lo_b, hi_b = _search_step(SufMin, lo_b, hi_b, x + 1)
            step += 1
        valid = x >= 0
        tl.store(T + L_own + offs, tl.where(valid, lo_a, L_other), mask=ok)
        tl.store(T + 2 * L_own + offs, tl.where(valid, lo_b, 0), mask=ok)
        start += BLOCK


@triton.jit
def segment_table_kernel(
    QIds, KIds, Out, Scratch, s_qb, s_qr, s_kb, s_kr, R, Lq, Lk, Q_STEPS, K_STEPS,
    SHARED: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per batch row: both sides' ids, bounds and spans. ``Out`` is ``[rows, 3 * (Lq + Lk)]`` (the
    query table then the key table; ``[rows, 3 * Lq]`` when SHARED), ``Scratch`` ``[rows, 2 * (Lq + Lk)]``."""
    pid = tl.program_id(0)
    b = pid // R
    r = pid % R
    QI = QIds + b.to(tl.int64) * s_qb + r.to(tl.int64) * s_qr
    if SHARED:
        QT = Out + pid.to(tl.int64) * (3 * Lq)
        S = Scratch + pid.to(tl.int64) * (2 * Lq)
        _ids_and_bounds(QI, QT, S, S + Lq, Lq, BLOCK)
        tl.debug_barrier()  # the bounds are read back by other lanes
        _spans(QT, Lq, S, S + Lq, Lq, Q_STEPS, BLOCK)
    else:
        KI = KIds + b.to(tl.int64) * s_kb + r.to(tl.int64) * s_kr
        QT = Out + pid.to(tl.int64) * (3 * (Lq + Lk))
        KT = QT + 3 * Lq
        S = Scratch + pid.to(tl.int64) * (2 * (Lq + Lk))
        _ids_and_bounds(QI, QT, S, S + Lq, Lq, BLOCK)
        _ids_and_bounds(KI, KT, S + 2 * Lq, S + 2 * Lq + Lk, Lk, BLOCK)
        tl.debug_barrier()
        _spans(QT, Lq, S + 2 * Lq, S + 2 * Lq + Lk, Lk, K_STEPS, BLOCK)
        _spans(KT, Lk, S, S + Lq, Lq, Q_STEPS, BLOCK)
