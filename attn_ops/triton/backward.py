"""Backward kernels: delta preprocess, dK/dV over key tiles (optionally fused dQ by atomics), dQ over query tiles.

With P = exp(S - lse) recomputed from q, k, bias, mask and the saved lse:
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   delta = rowsum(dO * O) - dlse,
    dQ = scale * dS K,   dK = scale * dS^T Q,   dBias = dS (summed over the bias's broadcast dims).
The ``- dlse`` term carries a loss on lse into every gradient (d lse / dS = P).
"""
import triton
import triton.language as tl

from .common import (
    KEY_STRIDE_ARGS, LENGTH_ARGS,
    aligned, batch_offset, bias_f32, key_rows, key_terms_t, kv_scores, load_lse2, load_masked, load_rows, mm, logits_t,
    seg_ids, seg_span, split_batch,
)


@triton.jit(do_not_specialize=LENGTH_ARGS, do_not_specialize_on_alignment=KEY_STRIDE_ARGS)
def bwd_preprocess_kernel(
    Out, dOut, dLse, Delta,
    s_ob, s_or, s_oh, s_om,
    s_db, s_dr, s_dh, s_dm,
    R, H, Lq,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, Dv: tl.constexpr, ALIGN: tl.constexpr,
):
    """delta [B, R, H, Lq] fp32 = rowsum(dO * O) - dlse."""
    s_ob, s_or, s_oh, s_om = aligned(s_ob, s_or, s_oh, s_om, ALIGN)
    s_db, s_dr, s_dh, s_dm = aligned(s_db, s_dr, s_dh, s_dm, ALIGN)
    pid_m = tl.program_id(0)
    b, r, h = split_batch(tl.program_id(1), R, H)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    ok = offs_m < Lq
    o = load_rows(Out + batch_offset(b, r, h, s_ob, s_or, s_oh), offs_m, s_om, offs_dv, Dv, ok)
    do = load_rows(dOut + batch_offset(b, r, h, s_db, s_dr, s_dh), offs_m, s_dm, offs_dv, Dv, ok)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = ((b * R + r) * H + h).to(tl.int64) * Lq
    if HAS_DLSE:
        delta -= tl.load(dLse + row + offs_m, mask=ok, other=0.0)
    tl.store(Delta + row + offs_m, delta, mask=ok)


@triton.jit
def _dkdv_step(
    dk, dv, k, v, Q, dOut, Lse, Delta, Mask, dQacc, zq, baddT, m0, offs_m, offs_n, Lq, Lk, D, Dv,
    s_qm, s_dm, s_mm, s_mn, scale,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, APPLY_CAUSAL: tl.constexpr, CHECK: tl.constexpr,
    FUSED_DQ: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    QSeg, kid, HAS_SEG: tl.constexpr,
):
    """Fold one query tile into dk [BN, BD], dv [BN, BDV] of one key tile of one row; returns dS^T [BN, BM] too.

    CHECK False: the tile is inside [Lq, Lk]; with EVEN_D too, its loads carry no masks. FUSED_DQ 1: dQacc is this
    row's fp32 accumulator (q's strides), added to by per-element atomics; 2: a tensor descriptor over a dense
    [slices, Lq, BD] fp32 accumulator, ``zq`` this row's slice, added to by one bulk TMA reduction per tile."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Lq
    qT = load_masked(Q + offs_m[None, :] * s_qm + offs_d[:, None], m_ok[None, :], offs_d[:, None] < D,
                     CHECK, not EVEN_D)  # [BD, BM]
    do = load_rows(dOut, offs_m, s_dm, offs_dv, Dv, m_ok, CHECK, not EVEN_D)  # [BM, BDV]
    lse2 = load_lse2(Lse, offs_m, Lq, CHECK)
    delta = load_masked(Delta + offs_m, m_ok, m_ok, CHECK, False)
    qid = 0
    if HAS_SEG:
        qid = seg_ids(QSeg, offs_m, Lq, -1)
    sT = logits_t(k, qT, baddT, Mask, offs_m, offs_n, Lq, Lk, s_mm, s_mn, scale,
                  HAS_BIAS, HAS_MASK, APPLY_CAUSAL, CHECK, qid, kid, HAS_SEG)  # [BN, BM]
    pT = tl.exp2(sT * 1.4426950408889634 - lse2[None, :])  # exp(s - lse): one FMA per score
    dv += mm(pT.to(do.dtype), do)
    dpT = mm(v, tl.trans(do))  # [BN, BM]
    dsT = pT * (dpT - delta[None, :])
    dsT_lp = dsT.to(qT.dtype)
    dk += mm(dsT_lp, tl.trans(qT))
    if FUSED_DQ:
        dq = mm(tl.trans(dsT_lp), k) * scale  # [BM, BD]
        if FUSED_DQ == 2:
            dQacc.atomic_add([zq, m0, 0], dq.reshape(1, dq.shape[0], dq.shape[1]))
        else:
            tl.atomic_add(dQacc + offs_m[:, None] * s_qm + offs_d[None, :], dq,
                          mask=m_ok[:, None] & (offs_d[None, :] < D), sem="relaxed")
    return dk, dv, dsT


@triton.jit
def _store_dbias_t(dBias, gz, dsT, m0, n0, offs_m, offs_n, Lq, Lk, s_gm, s_gn, ATOMIC: tl.constexpr):
    """dS^T [BN, BM] into dBias (plain store where the program owns the tile, else fp32 atomics: ATOMIC 1 per
    element, 2 one bulk TMA reduction into slice ``gz`` of a tensor descriptor over the [slices, Lq, Lk]
    accumulator; out-of-range parts of the tile are dropped by the copy engine)."""
    if ATOMIC == 2:
        ds = tl.trans(dsT)
        dBias.atomic_add([gz, m0, n0], ds.reshape(1, ds.shape[0], ds.shape[1]))
    else:
        ptrs = dBias + offs_n[:, None].to(tl.int64) * s_gn + offs_m[None, :].to(tl.int64) * s_gm
        ok = (offs_n[:, None] < Lk) & (offs_m[None, :] < Lq)
        if ATOMIC:
            tl.atomic_add(ptrs, dsT, mask=ok, sem="relaxed")
        else:
            tl.store(ptrs, dsT.to(dBias.dtype.element_ty), mask=ok)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, Q, dOut, Lse, Delta, Bias, bg, n0, Mask, keep, dQacc, zq, dBias, gz, offs_n, lo, hi, Lq, Lk, D, Dv,
    s_qm, s_dm, s_bm, s_bn, s_mm, s_mn, s_gm, s_gn, scale,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, APPLY_CAUSAL: tl.constexpr, CHECK: tl.constexpr,
    FUSED_DQ: tl.constexpr, DIRECT_DBIAS: tl.constexpr, ATOMIC_DBIAS: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, QSeg, kid, HAS_SEG: tl.constexpr,
):
    """Fold query tiles [lo, hi) into dk [BN, BD], dv [BN, BDV] of one key tile (transposed tiles [BN, BM]);
    ``keep`` [BN]: the key mask's attended keys (HAS_MASK 1); ``kid`` [BN] the key tile's segment ids."""
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        biasT = 0.0
        if HAS_BIAS:
            biasT = tl.trans(bias_f32(Bias, bg, m0, n0, offs_m, offs_n, s_bm, s_bn, Lq, Lk, CHECK, HAS_BIAS))
        baddT = key_terms_t(biasT, keep, HAS_BIAS, HAS_MASK)
        dk, dv, dsT = _dkdv_step(dk, dv, k, v, Q, dOut, Lse, Delta, Mask, dQacc, zq, baddT, m0, offs_m, offs_n,
                                 Lq, Lk, D, Dv, s_qm, s_dm, s_mm, s_mn, scale, HAS_BIAS, HAS_MASK, APPLY_CAUSAL,
                                 CHECK, FUSED_DQ, EVEN_D, BLOCK_D, BLOCK_DV, QSeg, kid, HAS_SEG)
        if DIRECT_DBIAS or ATOMIC_DBIAS:
            _store_dbias_t(dBias, gz, dsT, m0, n0, offs_m, offs_n, Lq, Lk, s_gm, s_gn, ATOMIC_DBIAS)
    return dk, dv


@triton.jit
def _store_dkdv(dK, dV, dk, dv, offs_n, s_kn, s_vn, Lk, D, Dv, scale, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < Lk
    tl.store(dK + offs_n[:, None] * s_kn + offs_d[None, :], (dk * scale).to(dK.dtype.element_ty),
             mask=n_ok[:, None] & (offs_d[None, :] < D))
    tl.store(dV + offs_n[:, None] * s_vn + offs_dv[None, :], dv.to(dV.dtype.element_ty),
             mask=n_ok[:, None] & (offs_dv[None, :] < Dv))


@triton.jit(do_not_specialize=LENGTH_ARGS, do_not_specialize_on_alignment=KEY_STRIDE_ARGS)
def attn_bwd_dkdv_kernel(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, dQacc, dK, dV, dBias, QSeg, KSeg,
    s_qb, s_qr, s_qh, s_qm,
    s_kb, s_kr, s_kh, s_kn,
    s_vb, s_vr, s_vh, s_vn,
    s_bb, s_br, s_bh, s_bm, s_bn,
    s_mb, s_mr, s_mh, s_mm, s_mn,
    s_db, s_dr, s_dh, s_dm,
    s_gb, s_gr, s_gh, s_gm, s_gn,
    s_sqb, s_sqr, s_skb, s_skr,
    R, H, Lq, Lk, scale,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
    FUSED_DQ: tl.constexpr, DIRECT_DBIAS: tl.constexpr, ATOMIC_DBIAS: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    D: tl.constexpr, Dv: tl.constexpr, ALIGN: tl.constexpr, BIAS_ALIGN: tl.constexpr,
):
    """One program per (key tile, b * (R / ROWS) * h): loops over query tiles, writes dK, dV (k's and v's strides).

    FUSED_DQ: also adds scale * dS K into the fp32 dQacc (q's strides) with atomics (not deterministic).
    DIRECT_DBIAS (fused variant only): the bias has every dim full, so this program owns
    dBias[b, r, h, :, key tile] and stores dS there. ATOMIC_DBIAS: the bias is broadcast over batch dims (full
    over Lq and Lk); dBias is an fp32 accumulator (bias's strides, 0 on broadcast dims) that every program
    adds its dS tiles into with atomics (not deterministic). ROWS = 2 (a bias shared over R, not causal, not
    FUSED_DQ): rows r and r + 1 share each bias tile load (and one atomic add of their summed dS). Lse/Delta are
    contiguous [B, R, H, Lq]. HAS_SEG (not with ROWS = 2): only the query tiles whose segment ids can meet this
    key tile's are visited (tables as in the forward kernel).
    """
    EVEN_D: tl.constexpr = D == BLOCK_D and Dv == BLOCK_DV  # D and Dv fill their blocks: no column masks
    s_qb, s_qr, s_qh, s_qm = aligned(s_qb, s_qr, s_qh, s_qm, ALIGN)
    s_kb, s_kr, s_kh, s_kn = aligned(s_kb, s_kr, s_kh, s_kn, ALIGN)
    s_vb, s_vr, s_vh, s_vn = aligned(s_vb, s_vr, s_vh, s_vn, ALIGN)
    s_db, s_dr, s_dh, s_dm = aligned(s_db, s_dr, s_dh, s_dm, ALIGN)
    s_bb, s_br, s_bh, s_bm = aligned(s_bb, s_br, s_bh, s_bm, BIAS_ALIGN)
    pid_n = tl.program_id(0)
    b, rp, h = split_batch(tl.program_id(1), (R + ROWS - 1) // ROWS, H)
    r = rp * ROWS
    bg = 0
    if HAS_BIAS == 2:  # a tensor descriptor: the batch strides count bias slices
        bg = batch_offset(b, r, h, s_bb, s_br, s_bh).to(tl.int32)
    elif HAS_BIAS:
        Bias += batch_offset(b, r, h, s_bb, s_br, s_bh)
    gz = 0
    if ATOMIC_DBIAS == 2:  # a tensor descriptor: the batch strides count accumulator slices
        gz = batch_offset(b, r, h, s_gb, s_gr, s_gh).to(tl.int32)
    elif DIRECT_DBIAS or ATOMIC_DBIAS:
        dBias += batch_offset(b, r, h, s_gb, s_gr, s_gh)

    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < Lk
    CHECK: tl.constexpr = not (EVEN_M and EVEN_N)
    # this row's pointers
    q_off = batch_offset(b, r, h, s_qb, s_qr, s_qh)
    k_off = batch_offset(b, r, h, s_kb, s_kr, s_kh)
    v_off = batch_offset(b, r, h, s_vb, s_vr, s_vh)
    Q_r = Q + q_off
    dO_r = dOut + batch_offset(b, r, h, s_db, s_dr, s_dh)
    zq = (b * R + r) * H + h  # this row's index over B*R*H: its slice of a dense dQ accumulator (FUSED_DQ 2)
    row = zq.to(tl.int64) * Lq
    Mask_r = Mask + batch_offset(b, r, h, s_mb, s_mr, s_mh)
    if FUSED_DQ == 2:
        dQ_r = dQacc
    else:
        dQ_r = dQacc + q_off
    keep = key_rows(Mask_r, offs_n, s_mn, Lk, HAS_MASK)
    # A key mask fixes this program's masked keys, and the query loop never mixes key rows: where no dS leaves the
    # program (no fused dQ, no dBias written here; two rows per program come only with the atomic dBias), their dK
    # and dV rows are zeroed once at the end instead of a select on every score (garbage in a masked key's v or bias
    # stays in its own rows); else they get -inf logits.
    MASK_AFTER: tl.constexpr = HAS_MASK == 1 and not FUSED_DQ and not DIRECT_DBIAS and not ATOMIC_DBIAS and ROWS == 1
    LOOP_MASK: tl.constexpr = HAS_MASK - MASK_AFTER  # the key mask as the query loop applies it
    k = load_rows(K + k_off, offs_n, s_kn, offs_d, D, keep)  # [BN, BD]
    v = load_rows(V + v_off, offs_n, s_vn, offs_dv, Dv, n_ok)  # [BN, BDV]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    lo_m = 0
    end_m = Lq
    kid = 0
    QSeg_r = QSeg
    if HAS_SEG:  # only the query tiles whose segment ids can meet this key tile's
        QSeg_r = QSeg + b.to(tl.int64) * s_sqb + r.to(tl.int64) * s_sqr
        KSeg_r = KSeg + b.to(tl.int64) * s_skb + r.to(tl.int64) * s_skr
        kid = seg_ids(KSeg_r, offs_n, Lk, -2)
        lo_m, end_m = seg_span(KSeg_r, offs_n, Lk, Lq, BLOCK_M)

    if ROWS == 2:
        tl.static_assert(not FUSED_DQ, "two rows per program only with the split dQ kernel")
        tl.static_assert(not HAS_SEG, "two rows per program only without segment ids")
        r2 = tl.minimum(r + 1, R - 1)
        q_off2 = batch_offset(b, r2, h, s_qb, s_qr, s_qh)
        k_off2 = batch_offset(b, r2, h, s_kb, s_kr, s_kh)
        v_off2 = batch_offset(b, r2, h, s_vb, s_vr, s_vh)
        row2 = ((b * R + r2) * H + h).to(tl.int64) * Lq
        Mask2 = Mask + batch_offset(b, r2, h, s_mb, s_mr, s_mh)
        dO2 = dOut + batch_offset(b, r2, h, s_db, s_dr, s_dh)
        keep2 = key_rows(Mask2, offs_n, s_mn, Lk, HAS_MASK)
        k2 = load_rows(K + k_off2, offs_n, s_kn, offs_d, D, keep2)
        v2 = load_rows(V + v_off2, offs_n, s_vn, offs_dv, Dv, n_ok)
        dk2 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv2 = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        # the repeated row of an odd R must not add its dS to the shared dBias twice
        w2 = (r + 1 < R).to(tl.float32)
        for m0 in range(0, Lq, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            biasT = 0.0
            if HAS_BIAS:
                # once for both rows
                biasT = tl.trans(bias_f32(Bias, bg, m0, n0, offs_m, offs_n, s_bm, s_bn, Lq, Lk, CHECK, HAS_BIAS))
            baddT = key_terms_t(biasT, keep, HAS_BIAS, HAS_MASK)
            dk, dv, dsT = _dkdv_step(dk, dv, k, v, Q_r, dO_r, Lse + row, Delta + row, Mask_r, dQ_r, zq, baddT,
                                     m0, offs_m, offs_n, Lq, Lk, D, Dv, s_qm, s_dm, s_mm, s_mn, scale,
                                     HAS_BIAS, HAS_MASK, False, CHECK, FUSED_DQ, EVEN_D, BLOCK_D, BLOCK_DV,
                                     QSeg_r, kid, False)
            baddT2 = key_terms_t(biasT, keep2, HAS_BIAS, HAS_MASK)  # the second row's own key mask
            dk2, dv2, dsT2 = _dkdv_step(dk2, dv2, k2, v2, Q + q_off2, dO2, Lse + row2, Delta + row2, Mask2,
                                        dQ_r, zq, baddT2, m0, offs_m, offs_n, Lq, Lk, D, Dv, s_qm, s_dm, s_mm,
                                        s_mn, scale, HAS_BIAS, HAS_MASK, False, CHECK,
                                        FUSED_DQ, EVEN_D, BLOCK_D, BLOCK_DV, QSeg_r, kid, False)
            if ATOMIC_DBIAS:
                _store_dbias_t(dBias, gz, dsT + dsT2 * w2, m0, n0, offs_m, offs_n, Lq, Lk, s_gm, s_gn, ATOMIC_DBIAS)
        if r + 1 < R:
            _store_dkdv(dK + k_off2, dV + v_off2, dk2, dv2, offs_n, s_kn, s_vn, Lk, D, Dv, scale, BLOCK_D, BLOCK_DV)
    elif CAUSAL:
        # query m sees key n iff m >= n - (Lk - Lq): tiles from lo hold the diagonal up to m_full; after, no test
        lo = (tl.maximum(n0 - (Lk - Lq), 0) // BLOCK_M) * BLOCK_M
        m_full = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - (Lk - Lq), 0), BLOCK_M) * BLOCK_M
        m_full = tl.minimum(tl.maximum(m_full, lo), Lq)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q_r, dO_r, Lse + row, Delta + row, Bias, bg, n0, Mask_r, keep, dQ_r,
                             zq, dBias, gz, offs_n, tl.maximum(lo, lo_m), tl.minimum(m_full, end_m), Lq, Lk, D, Dv,
                             s_qm, s_dm, s_bm, s_bn, s_mm, s_mn,
                             s_gm, s_gn, scale, HAS_BIAS, LOOP_MASK, True, CHECK, FUSED_DQ, DIRECT_DBIAS, ATOMIC_DBIAS,
                             EVEN_D, BLOCK_M, BLOCK_D, BLOCK_DV, QSeg_r, kid, HAS_SEG)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q_r, dO_r, Lse + row, Delta + row, Bias, bg, n0, Mask_r, keep, dQ_r,
                             zq, dBias, gz, offs_n, tl.maximum(m_full, lo_m), end_m, Lq, Lk, D, Dv, s_qm, s_dm,
                             s_bm, s_bn, s_mm, s_mn,
                             s_gm, s_gn, scale, HAS_BIAS, LOOP_MASK, False, CHECK, FUSED_DQ, DIRECT_DBIAS, ATOMIC_DBIAS,
                             EVEN_D, BLOCK_M, BLOCK_D, BLOCK_DV, QSeg_r, kid, HAS_SEG)
    else:
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q_r, dO_r, Lse + row, Delta + row, Bias, bg, n0, Mask_r, keep, dQ_r,
                             zq, dBias, gz, offs_n, lo_m, end_m, Lq, Lk, D, Dv, s_qm, s_dm, s_bm, s_bn, s_mm, s_mn,
                             s_gm, s_gn, scale, HAS_BIAS, LOOP_MASK, False, CHECK, FUSED_DQ, DIRECT_DBIAS, ATOMIC_DBIAS,
                             EVEN_D, BLOCK_M, BLOCK_D, BLOCK_DV, QSeg_r, kid, HAS_SEG)
    if MASK_AFTER:
        dk = tl.where(keep[:, None], dk, 0.0)
        dv = tl.where(keep[:, None], dv, 0.0)
    _store_dkdv(dK + k_off, dV + v_off, dk, dv, offs_n, s_kn, s_vn, Lk, D, Dv, scale, BLOCK_D, BLOCK_DV)


@triton.jit
def _dq_step(
    dq, q, do, lse2, delta, K, V, Bias, bg, m0, n0, Mask, offs_m, offs_n, Lq, Lk, D, Dv, s_kn, s_vn, s_bm, s_bn,
    s_mm, s_mn, scale, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, APPLY_CAUSAL: tl.constexpr, CHECK: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, qid, KSeg, HAS_SEG: tl.constexpr,
):
    """Fold one key tile into dq [BM, BD] of one query tile of one row; returns dS [BM, BN] too."""
    k, v, s = kv_scores(q, K, V, Bias, bg, m0, n0, Mask, offs_m, offs_n, Lq, Lk, D, Dv, s_kn, s_vn, s_bm, s_bn,
                        s_mm, s_mn, scale, HAS_BIAS, HAS_MASK, APPLY_CAUSAL, CHECK, CHECK, not CHECK, EVEN_D, BLOCK_D,
                        BLOCK_DV, qid, KSeg, HAS_SEG)  # s: [BM, BN]
    p = tl.exp2(s * 1.4426950408889634 - lse2[:, None])  # exp(s - lse): one FMA per score
    dp = mm(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    dq += mm(ds.to(k.dtype), k)
    return dq, ds


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, K, V, Bias, bg, m0, Mask, dBias, offs_m, lo, hi, Lq, Lk, D, Dv,
    s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, s_gm, s_gn, scale,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, APPLY_CAUSAL: tl.constexpr, CHECK: tl.constexpr,
    DIRECT_DBIAS: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, qid, KSeg, HAS_SEG: tl.constexpr,
):
    """Fold key tiles [lo, hi) into dq [BM, BD] of one query tile; store dS into dBias when it owns the rows
    (DIRECT_DBIAS 1), add it into the fp32 accumulator of a broadcast bias by atomics (2)."""
    m_ok = offs_m < Lq
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        dq, ds = _dq_step(dq, q, do, lse2, delta, K, V, Bias, bg, m0, n0, Mask, offs_m, offs_n, Lq, Lk, D, Dv,
                          s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, scale, HAS_BIAS, HAS_MASK, APPLY_CAUSAL, CHECK, EVEN_D,
                          BLOCK_D, BLOCK_DV, qid, KSeg, HAS_SEG)
        if DIRECT_DBIAS:
            ptrs = dBias + offs_m[:, None].to(tl.int64) * s_gm + offs_n[None, :].to(tl.int64) * s_gn
            if DIRECT_DBIAS == 2:  # a broadcast bias: fp32 atomics, along the tile's rows (contiguous keys)
                # up to the padded pitch (a multiple of 4: the mask is constant over 4 keys, so the adds go out
                # as 16-byte vector atomics); dS is 0 at keys past Lk
                tl.atomic_add(ptrs, ds, mask=m_ok[:, None] & (offs_n[None, :] < s_gm), sem="relaxed")
            else:
                tl.store(ptrs, ds.to(dBias.dtype.element_ty), mask=m_ok[:, None] & (offs_n[None, :] < Lk))
    return dq


@triton.jit(do_not_specialize=LENGTH_ARGS, do_not_specialize_on_alignment=KEY_STRIDE_ARGS)
def attn_bwd_dq_kernel(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, dQ, dBias, QSeg, KSeg,
    s_qb, s_qr, s_qh, s_qm,
    s_kb, s_kr, s_kh, s_kn,
    s_vb, s_vr, s_vh, s_vn,
    s_bb, s_br, s_bh, s_bm, s_bn,
    s_mb, s_mr, s_mh, s_mm, s_mn,
    s_db, s_dr, s_dh, s_dm,
    s_gb, s_gr, s_gh, s_gm, s_gn,
    s_sqb, s_sqr, s_skb, s_skr,
    R, H, Lq, Lk, scale,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
    DIRECT_DBIAS: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    D: tl.constexpr, Dv: tl.constexpr, ALIGN: tl.constexpr, BIAS_ALIGN: tl.constexpr,
):
    """One program per (query tile, b*r*h): loops over key tiles, writes dQ (q's strides).

    DIRECT_DBIAS 1: the bias has every dim full, so this program owns dBias[b, r, h, query tile, :] (plain stores);
    2: the bias is broadcast over batch dims (full over Lq and Lk) and dBias is an fp32 accumulator (0 strides on
    the broadcast dims, rows padded to a multiple of 4 floats) that every program adds its dS tiles into with
    atomics (not deterministic): dS [BM, BN] runs along the accumulator's rows here, so the adds go out as 16-byte
    vector atomics, where the dK/dV kernel's transposed tiles would add one float at a time
    (docs/bench/history.md). (Two rows per program sharing the bias tile, as in the dK/dV kernel,
    measured slower here: docs/bench/history.md.)
    """
    EVEN_D: tl.constexpr = D == BLOCK_D and Dv == BLOCK_DV  # D and Dv fill their blocks: no column masks
    s_qb, s_qr, s_qh, s_qm = aligned(s_qb, s_qr, s_qh, s_qm, ALIGN)
    s_kb, s_kr, s_kh, s_kn = aligned(s_kb, s_kr, s_kh, s_kn, ALIGN)
    s_vb, s_vr, s_vh, s_vn = aligned(s_vb, s_vr, s_vh, s_vn, ALIGN)
    s_db, s_dr, s_dh, s_dm = aligned(s_db, s_dr, s_dh, s_dm, ALIGN)
    s_bb, s_br, s_bh, s_bm = aligned(s_bb, s_br, s_bh, s_bm, BIAS_ALIGN)
    pid_m = tl.program_id(0)
    b, r, h = split_batch(tl.program_id(1), R, H)
    bg = 0
    if HAS_BIAS == 2:  # a tensor descriptor: the batch strides count bias slices
        bg = batch_offset(b, r, h, s_bb, s_br, s_bh).to(tl.int32)
    elif HAS_BIAS:
        Bias += batch_offset(b, r, h, s_bb, s_br, s_bh)
    if DIRECT_DBIAS == 2:  # the accumulator's rows start 16-byte aligned (a padded pitch): vector atomics
        s_gb, s_gr, s_gh, s_gm = aligned(s_gb, s_gr, s_gh, s_gm, 4)
    if DIRECT_DBIAS:
        dBias += batch_offset(b, r, h, s_gb, s_gr, s_gh)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Lq
    CHECK: tl.constexpr = not (EVEN_M and EVEN_N)
    q_off = batch_offset(b, r, h, s_qb, s_qr, s_qh)
    row = ((b * R + r) * H + h).to(tl.int64) * Lq
    K_r = K + batch_offset(b, r, h, s_kb, s_kr, s_kh)
    V_r = V + batch_offset(b, r, h, s_vb, s_vr, s_vh)
    Mask_r = Mask + batch_offset(b, r, h, s_mb, s_mr, s_mh)
    q = load_rows(Q + q_off, offs_m, s_qm, offs_d, D, m_ok)  # [BM, BD]
    do = load_rows(dOut + batch_offset(b, r, h, s_db, s_dr, s_dh), offs_m, s_dm, offs_dv, Dv, m_ok)
    lse2 = load_lse2(Lse + row, offs_m, Lq)
    delta = tl.load(Delta + row + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo = 0
    end = Lk
    qid = 0
    KSeg_r = KSeg
    if HAS_SEG:  # only the key tiles whose segment ids can meet this query tile's
        QSeg_r = QSeg + b.to(tl.int64) * s_sqb + r.to(tl.int64) * s_sqr
        KSeg_r = KSeg + b.to(tl.int64) * s_skb + r.to(tl.int64) * s_skr
        qid = seg_ids(QSeg_r, offs_m, Lq, -1)
        lo, end = seg_span(QSeg_r, offs_m, Lq, Lk, BLOCK_N)
    if CAUSAL:
        hi = tl.minimum(end, m0 + BLOCK_M + (Lk - Lq))
        full_hi = (tl.maximum(m0 + 1 + (Lk - Lq), 0) // BLOCK_N) * BLOCK_N
        full_hi = tl.minimum(full_hi, tl.maximum(hi, 0))
        dq = _dq_tiles(dq, q, do, lse2, delta, K_r, V_r, Bias, bg, m0, Mask_r, dBias, offs_m, lo, full_hi, Lq, Lk, D,
                       Dv, s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, s_gm, s_gn, scale,
                       HAS_BIAS, HAS_MASK, False, CHECK, DIRECT_DBIAS, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
                       qid, KSeg_r, HAS_SEG)
        dq = _dq_tiles(dq, q, do, lse2, delta, K_r, V_r, Bias, bg, m0, Mask_r, dBias, offs_m, tl.maximum(full_hi, lo),
                       hi, Lq, Lk, D, Dv, s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, s_gm, s_gn, scale,
                       HAS_BIAS, HAS_MASK, True, CHECK, DIRECT_DBIAS, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
                       qid, KSeg_r, HAS_SEG)
    else:
        dq = _dq_tiles(dq, q, do, lse2, delta, K_r, V_r, Bias, bg, m0, Mask_r, dBias, offs_m, lo, end, Lq, Lk, D, Dv,
                       s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, s_gm, s_gn, scale,
                       HAS_BIAS, HAS_MASK, False, CHECK, DIRECT_DBIAS, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
                       qid, KSeg_r, HAS_SEG)
    tl.store(dQ + q_off + offs_m[:, None] * s_qm + offs_d[None, :], (dq * scale).to(dQ.dtype.element_ty),
             mask=m_ok[:, None] & (offs_d[None, :] < D))
