"""Deterministic dBias for a bias broadcast over some dims: each program owns one tile of the bias's own shape.

The bias has own shape ``[BB, BR, BH, BLq, BLk]`` with every dim 1 or full. A program owns one output tile
(bias batch index; a query tile, or all rows when BLq = 1 < Lq; a key tile, or all columns when BLk = 1 < Lk)
and loops, in a fixed order, over everything that tile sums: the broadcast batch indices (and, for a bias
broadcast over Lq or Lk, all query or key tiles). It recomputes dS = P * (dO V^T - delta) per step and
accumulates it in fp32 registers, so no ``[R, H, Lq, Lk]`` buffer exists and the result has the same bits
on every call with the same tile config (the tuner picks one per length bucket; ``settings.tune`` False fixes
it across processes). Several programs may share one tile's batch loop (contiguous chunks, grid axis 2); their
fp32 partial sums go to ``dBiasPart[split]`` and are added in a fixed order (one split: written in the bias's
dtype).

The loop is bound by its per-step instruction count, not by memory (docs/bench/history.md, "Design
measurements"), so the common case keeps each step lean: operand offsets are computed
once, tiles that are fully in range load without masks, and the batch index needs no division where a
broadcast extent is 1.
"""
import triton
import triton.language as tl

from .common import (
    KEY_STRIDE_ARGS, LENGTH_ARGS, aligned, batch_offset, ids_meet, key_rows, load_lse2, load_masked, load_tile, mm,
    seg_ids,
)


@triton.jit
def _ds_step(
    Q, K, V, dOut, Lse, Delta, Mask, bias2, q_off, k_off, v_off, do_off, offs_m, offs_n, offs_d, offs_dv,
    Lq, Lk, D, Dv, s_mm, s_mn, qk_scale,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, EVEN: tl.constexpr, QSeg, KSeg, HAS_SEG: tl.constexpr,
):
    """dS [BM, BN] (fp32) of one tile of one (b, r, h) whose operand rows sit at the given element offsets.

    ``bias2`` is the bias tile already times log2(e). EVEN: the tile is inside [Lq, Lk] and D, Dv fill their
    blocks, so nothing is masked on load. HAS_SEG: QSeg / KSeg point at this row's segment ids.
    """
    CHECK: tl.constexpr = not EVEN
    m_ok = offs_m < Lq
    n_ok = offs_n < Lk
    q = load_masked(Q + q_off, m_ok[:, None], offs_d[None, :] < D, CHECK, CHECK)  # [BM, BD]
    do = load_masked(dOut + do_off, m_ok[:, None], offs_dv[None, :] < Dv, CHECK, CHECK)  # [BM, BDV]
    k = load_masked(K + k_off, n_ok[:, None], offs_d[None, :] < D, CHECK, CHECK)  # [BN, BD]
    v = load_masked(V + v_off, n_ok[:, None], offs_dv[None, :] < Dv, CHECK, CHECK)  # [BN, BDV]
    lse2 = load_lse2(Lse, offs_m, Lq, CHECK)
    delta = load_masked(Delta + offs_m, m_ok, m_ok, CHECK, False)
    s = mm(q, tl.trans(k)) * qk_scale + bias2
    if HAS_MASK == 1:  # key mask: a select here (the bias tile is loop-invariant, so no add to fold it into)
        s = tl.where(key_rows(Mask, offs_n, s_mn, Lk, HAS_MASK)[None, :], s, float("-inf"))
    if HAS_MASK == 2:
        keep = load_tile(Mask, offs_m, offs_n, s_mm, s_mn, Lq, Lk) != 0
        s = tl.where(keep, s, float("-inf"))
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= offs_m[:, None] + (Lk - Lq), s, float("-inf"))
    if HAS_SEG:
        s = tl.where(seg_ids(QSeg, offs_m, Lq, -1)[:, None] == seg_ids(KSeg, offs_n, Lk, -2)[None, :], s,
                     float("-inf"))
    if CHECK:
        s = tl.where(m_ok[:, None] & n_ok[None, :], s, float("-inf"))
    p = tl.exp2(s - lse2[:, None])
    dp = mm(do, tl.trans(v))
    return p * (dp - delta[:, None])


@triton.jit(do_not_specialize=LENGTH_ARGS, do_not_specialize_on_alignment=KEY_STRIDE_ARGS)
def attn_bwd_dbias_kernel(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, dBiasPart, QSeg, KSeg,
    s_qb, s_qr, s_qh, s_qm,
    s_kb, s_kr, s_kh, s_kn,
    s_vb, s_vr, s_vh, s_vn,
    s_bb, s_br, s_bh, s_bm, s_bn,
    s_mb, s_mr, s_mh, s_mm, s_mn,
    s_db, s_dr, s_dh, s_dm,
    s_ps, s_pb, s_pr, s_ph, s_pm, s_pn,
    s_sqb, s_sqr, s_skb, s_skr,
    R, H, BR, BH, lr_n, lh_n, total, Lq, Lk, qk_scale, steps_per_split,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, LOOP_M: tl.constexpr, LOOP_N: tl.constexpr,
    LOOP_B: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    D: tl.constexpr, Dv: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid (output tiles, BB*BR*BH bias batch indices, splits). The batch loop of a tile runs t over the
    broadcast batch dims (lb, lr, lh), h fastest: ``lr_n = R // BR``, ``lh_n = H // BH`` (an extent of 1 is
    specialised, so its division folds away), ``total = (B // BB) * lr_n * lh_n``; LOOP_B: B // BB > 1.
    HAS_SEG: segment id tables as in the forward kernel; a step whose query and key tiles share no segment id
    adds nothing and is skipped."""
    EVEN_D: tl.constexpr = D == BLOCK_D and Dv == BLOCK_DV  # D and Dv fill their blocks: no column masks
    s_qb, s_qr, s_qh, s_qm = aligned(s_qb, s_qr, s_qh, s_qm, ALIGN)
    s_kb, s_kr, s_kh, s_kn = aligned(s_kb, s_kr, s_kh, s_kn, ALIGN)
    s_vb, s_vr, s_vh, s_vn = aligned(s_vb, s_vr, s_vh, s_vn, ALIGN)
    s_db, s_dr, s_dh, s_dm = aligned(s_db, s_dr, s_dh, s_dm, ALIGN)
    pid_t = tl.program_id(0)  # output tile within one bias [BLq, BLk] slice
    pid_g = tl.program_id(1)  # bias batch index over BB*BR*BH
    pid_s = tl.program_id(2)  # split of the batch loop
    n_mt = tl.cdiv(Lq, BLOCK_M)
    n_nt = tl.cdiv(Lk, BLOCK_N)
    prog_nt = 1 if LOOP_N else n_nt
    pm = pid_t // prog_nt
    pn = pid_t % prog_nt
    gh = pid_g % BH
    gr = (pid_g // BH) % BR
    gb = pid_g // (BH * BR)
    t_lo = pid_s * steps_per_split
    t_hi = tl.minimum(total, t_lo + steps_per_split)
    Bias += batch_offset(gb, gr, gh, s_bb, s_br, s_bh)  # broadcast dims have stride 0
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    if LOOP_M or LOOP_N:  # bias broadcast over Lq and/or Lk: rare layouts, plain nested loops
        m_lo = pm
        m_hi = pm + 1
        n_lo = pn
        n_hi = pn + 1
        if LOOP_M:
            m_lo = 0
            m_hi = n_mt
        if LOOP_N:
            n_lo = 0
            n_hi = n_nt
        for t in range(t_lo, t_hi):
            h = gh + t % lh_n
            r = gr + (t // lh_n) % lr_n
            b = gb + t // (lh_n * lr_n)
            row = ((b * R + r) * H + h).to(tl.int64) * Lq
            for mt in range(m_lo, m_hi):
                for nt in range(n_lo, n_hi):
                    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
                    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
                    bias2 = load_tile(Bias, offs_m, offs_n, s_bm, s_bn, Lq, Lk).to(tl.float32) * 1.4426950408889634
                    acc += _ds_step(Q + batch_offset(b, r, h, s_qb, s_qr, s_qh),
                                    K + batch_offset(b, r, h, s_kb, s_kr, s_kh),
                                    V + batch_offset(b, r, h, s_vb, s_vr, s_vh),
                                    dOut + batch_offset(b, r, h, s_db, s_dr, s_dh), Lse + row, Delta + row,
                                    Mask + batch_offset(b, r, h, s_mb, s_mr, s_mh), bias2,
                                    offs_m[:, None] * s_qm + offs_d[None, :], offs_n[:, None] * s_kn + offs_d[None, :],
                                    offs_n[:, None] * s_vn + offs_dv[None, :],
                                    offs_m[:, None] * s_dm + offs_dv[None, :], offs_m, offs_n, offs_d, offs_dv,
                                    Lq, Lk, D, Dv, s_mm, s_mn, qk_scale, HAS_MASK, CAUSAL, False,
                                    QSeg + b.to(tl.int64) * s_sqb + r.to(tl.int64) * s_sqr,
                                    KSeg + b.to(tl.int64) * s_skb + r.to(tl.int64) * s_skr, HAS_SEG)
    else:  # the common case (pair bias shared over rows/batch): one fixed tile, flat pipelined loop
        offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        if CAUSAL:  # a tile entirely above the diagonal gets zero: skip its loop
            if pn * BLOCK_N > pm * BLOCK_M + BLOCK_M - 1 + (Lk - Lq):
                t_hi = t_lo
        bias2 = load_tile(Bias, offs_m, offs_n, s_bm, s_bn, Lq, Lk)
        bias2 = bias2.to(tl.float32) * 1.4426950408889634  # loaded once for the whole loop
        q_off = offs_m[:, None] * s_qm + offs_d[None, :]  # operand offsets within one (b, r, h): loop-invariant
        do_off = offs_m[:, None] * s_dm + offs_dv[None, :]
        k_off = offs_n[:, None] * s_kn + offs_d[None, :]
        v_off = offs_n[:, None] * s_vn + offs_dv[None, :]
        for t in range(t_lo, t_hi):
            h = gh + t % lh_n
            if LOOP_B:
                r = gr + (t // lh_n) % lr_n
                b = gb + t // (lh_n * lr_n)
            else:  # t // lh_n < lr_n: no division by R
                r = gr + t // lh_n
                b = gb
            row = ((b * R + r) * H + h).to(tl.int64) * Lq
            if HAS_SEG:
                QSeg_r = QSeg + b.to(tl.int64) * s_sqb + r.to(tl.int64) * s_sqr
                KSeg_r = KSeg + b.to(tl.int64) * s_skb + r.to(tl.int64) * s_skr
                if ids_meet(QSeg_r, offs_m, Lq, KSeg_r, offs_n, Lk):
                    acc += _ds_step(Q + batch_offset(b, r, h, s_qb, s_qr, s_qh),
                                    K + batch_offset(b, r, h, s_kb, s_kr, s_kh),
                                    V + batch_offset(b, r, h, s_vb, s_vr, s_vh),
                                    dOut + batch_offset(b, r, h, s_db, s_dr, s_dh), Lse + row, Delta + row,
                                    Mask + batch_offset(b, r, h, s_mb, s_mr, s_mh), bias2, q_off, k_off, v_off,
                                    do_off, offs_m, offs_n, offs_d, offs_dv, Lq, Lk, D, Dv, s_mm, s_mn, qk_scale,
                                    HAS_MASK, CAUSAL, EVEN_M and EVEN_N and EVEN_D, QSeg_r, KSeg_r, True)
            else:
                acc += _ds_step(Q + batch_offset(b, r, h, s_qb, s_qr, s_qh),
                                K + batch_offset(b, r, h, s_kb, s_kr, s_kh),
                                V + batch_offset(b, r, h, s_vb, s_vr, s_vh),
                                dOut + batch_offset(b, r, h, s_db, s_dr, s_dh), Lse + row, Delta + row,
                                Mask + batch_offset(b, r, h, s_mb, s_mr, s_mh), bias2, q_off, k_off, v_off, do_off,
                                offs_m, offs_n, offs_d, offs_dv, Lq, Lk, D, Dv, s_mm, s_mn, qk_scale, HAS_MASK, CAUSAL,
                                EVEN_M and EVEN_N and EVEN_D, QSeg, KSeg, False)

    Out = dBiasPart + pid_s.to(tl.int64) * s_ps + batch_offset(gb, gr, gh, s_pb, s_pr, s_ph)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    ty = dBiasPart.dtype.element_ty  # the bias's dtype with one split, else fp32 partials
    if LOOP_M and LOOP_N:
        tl.store(Out, tl.sum(tl.sum(acc, 1), 0).to(ty))
    elif LOOP_M:
        tl.store(Out + offs_n.to(tl.int64) * s_pn, tl.sum(acc, 0).to(ty), mask=offs_n < Lk)
    elif LOOP_N:
        tl.store(Out + offs_m.to(tl.int64) * s_pm, tl.sum(acc, 1).to(ty), mask=offs_m < Lq)
    else:
        tl.store(Out + offs_m[:, None].to(tl.int64) * s_pm + offs_n[None, :].to(tl.int64) * s_pn, acc.to(ty),
                 mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))


@triton.jit(do_not_specialize=LENGTH_ARGS, do_not_specialize_on_alignment=KEY_STRIDE_ARGS)
def sum_splits_kernel(Part, Out, numel, splits, BLOCK: tl.constexpr):
    """Out[i] = sum over s of Part[s * numel + i], added in split order in fp32, stored in Out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    ptrs = Part + offs
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(splits):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += numel
    tl.store(Out + offs, acc.to(Out.dtype.element_ty), mask=ok)
