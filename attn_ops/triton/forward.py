"""Forward kernel: one program per (q-tile, b*r*h); online softmax over key tiles (exp2 of one FMA per score).

Tensors are canonical ``[B, R, H, L, D]`` (last dim contiguous); bias ``[*, *, *, Lq|1, Lk|1]`` and mask are
read through strides, 0 on broadcast dims. Writes O ``[B, R, H, Lq, Dv]`` and lse ``[B, R, H, Lq]`` (fp32,
natural log, -inf for a row with no key).
"""
import triton
import triton.language as tl

from .common import (
    KEY_STRIDE_ARGS, LENGTH_ARGS, aligned, batch_offset, kv_scores, load_rows, mm, seg_ids, seg_span, split_batch,
)


@triton.jit
def _fwd_step(
    acc, l_i, m_i, q, K, V, Bias, bg, m0, n0, Mask, offs_m, offs_n, Lq, Lk, D, Dv, s_kn, s_vn, s_bm, s_bn, s_mm,
    s_mn, logit_scale, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, APPLY_CAUSAL: tl.constexpr,
    CHECK_M: tl.constexpr, CHECK_N: tl.constexpr, IN_RANGE: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, qid, KSeg, HAS_SEG: tl.constexpr,
):
    """Fold one key tile into the running (acc [BM, Dv], l_i, m_i) of one query tile of one row."""
    k, v, s = kv_scores(q, K, V, Bias, bg, m0, n0, Mask, offs_m, offs_n, Lq, Lk, D, Dv, s_kn, s_vn, s_bm, s_bn,
                        s_mm, s_mn, logit_scale, HAS_BIAS, HAS_MASK, APPLY_CAUSAL, CHECK_M, CHECK_N, IN_RANGE,
                        EVEN_D, BLOCK_D, BLOCK_DV, qid, KSeg, HAS_SEG, False)  # s: [BM, BN]
    m_new = tl.maximum(m_i, tl.max(s, 1))  # natural units, as s
    m2 = m_new * 1.4426950408889634  # log2(e) * m, per row
    # No key so far, or a max so negative (< -2.4e38, e.g. a float32-min additive mask) that it overflows in the
    # log2 domain: the row has nothing yet (its scores give exp2(-inf) = 0 below), as in the log2-domain kernels.
    dead = m2 == float("-inf")
    m2 = tl.where(dead, 0.0, m2)
    # the difference first, then the scale: exactly 1 while the max holds (an FMA of m_i against the rounded m2
    # would be off by m2's rounding error, compounding over the tiles for large |m|)
    alpha = tl.where(dead, 0.0, tl.exp2((m_i - m_new) * 1.4426950408889634))
    p = tl.exp2(s * 1.4426950408889634 - m2[:, None])  # exp(s - m): one FMA per score
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mm(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, K, V, Bias, bg, m0, Mask, offs_m, lo, hi, Lq, Lk, D, Dv,
    s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, logit_scale,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, APPLY_CAUSAL: tl.constexpr,
    CHECK_M: tl.constexpr, CHECK_N: tl.constexpr, IN_RANGE: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, qid, KSeg, HAS_SEG: tl.constexpr,
):
    """Fold key tiles [lo, hi) into the running (acc [BM, Dv], l_i, m_i) of one query tile."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K, V, Bias, bg, m0, start_n, Mask, offs_m, offs_n, Lq, Lk, D, Dv,
                                  s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, logit_scale, HAS_BIAS, HAS_MASK, APPLY_CAUSAL,
                                  CHECK_M, CHECK_N, IN_RANGE, EVEN_D, BLOCK_D, BLOCK_DV, qid, KSeg, HAS_SEG)
    return acc, l_i, m_i


@triton.jit
def _fwd_store(acc, l_i, m_i, Out, Lse, offs_m, s_om, Lq, Dv, BLOCK_DV: tl.constexpr):
    """out = acc / l and lse (natural log) of one query tile; a row with no key gets out 0, lse -inf."""
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Lq
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)) * 0.6931471805599453)
    tl.store(Out + offs_m[:, None] * s_om + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & (offs_dv[None, :] < Dv))
    tl.store(Lse + offs_m, lse, mask=m_ok)


@triton.jit(do_not_specialize=LENGTH_ARGS, do_not_specialize_on_alignment=KEY_STRIDE_ARGS)
def attn_fwd_kernel(
    Q, K, V, Bias, Mask, Out, Lse, QSeg, KSeg,
    s_qb, s_qr, s_qh, s_qm,
    s_kb, s_kr, s_kh, s_kn,
    s_vb, s_vr, s_vh, s_vn,
    s_bb, s_br, s_bh, s_bm, s_bn,
    s_mb, s_mr, s_mh, s_mm, s_mn,
    s_ob, s_or, s_oh, s_om,
    s_sqb, s_sqr, s_skb, s_skr,
    R, H, Lq, Lk, logit_scale,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    D: tl.constexpr, Dv: tl.constexpr, ALIGN: tl.constexpr, BIAS_ALIGN: tl.constexpr,
):
    """One program per (query tile, b*r*h). EVEN_M / EVEN_N: Lq / Lk are multiples of the tiles; BLOCK_D /
    BLOCK_DV: D and Dv rounded up to powers of two (>= 16). HAS_SEG: QSeg / KSeg are the segment id tables
    ``[B|1, R|1, 3, L]`` int32 (ids, running max, suffix min; strides s_s*), and only the key tiles whose ids can meet
    the query tile's are visited (:func:`seg_span`). ALIGN: every batch and row stride of q, k, v and out is a
    multiple of it; BIAS_ALIGN: of the bias's (:func:`aligned`; ``launch._bias_align``)."""
    EVEN_D: tl.constexpr = D == BLOCK_D and Dv == BLOCK_DV  # D and Dv fill their blocks: no column masks
    s_qb, s_qr, s_qh, s_qm = aligned(s_qb, s_qr, s_qh, s_qm, ALIGN)
    s_kb, s_kr, s_kh, s_kn = aligned(s_kb, s_kr, s_kh, s_kn, ALIGN)
    s_vb, s_vr, s_vh, s_vn = aligned(s_vb, s_vr, s_vh, s_vn, ALIGN)
    s_ob, s_or, s_oh, s_om = aligned(s_ob, s_or, s_oh, s_om, ALIGN)
    s_bb, s_br, s_bh, s_bm = aligned(s_bb, s_br, s_bh, s_bm, BIAS_ALIGN)
    pid_m = tl.program_id(0)
    b, r, h = split_batch(tl.program_id(1), R, H)
    Lse_r = Lse + ((b * R + r) * H + h).to(tl.int64) * Lq
    bg = 0
    if HAS_BIAS == 2:  # a tensor descriptor: the batch strides count bias slices
        bg = batch_offset(b, r, h, s_bb, s_br, s_bh).to(tl.int32)
    elif HAS_BIAS:
        Bias += batch_offset(b, r, h, s_bb, s_br, s_bh)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    q = load_rows(Q + batch_offset(b, r, h, s_qb, s_qr, s_qh), offs_m, s_qm, offs_d, D, m_ok)  # [BM, BD]
    K_r = K + batch_offset(b, r, h, s_kb, s_kr, s_kh)
    V_r = V + batch_offset(b, r, h, s_vb, s_vr, s_vh)
    Mask_r = Mask + batch_offset(b, r, h, s_mb, s_mr, s_mh)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    CHECK_N: tl.constexpr = not EVEN_N
    IN_RANGE: tl.constexpr = EVEN_M and EVEN_N
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
        # Key tiles fully below the diagonal need no causal test; the rest (up to hi) do.
        hi = tl.minimum(end, m0 + BLOCK_M + (Lk - Lq))
        full_hi = (tl.maximum(m0 + 1 + (Lk - Lq), 0) // BLOCK_N) * BLOCK_N
        full_hi = tl.minimum(full_hi, tl.maximum(hi, 0))
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_r, V_r, Bias, bg, m0, Mask_r, offs_m, lo, full_hi,
                                   Lq, Lk, D, Dv, s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, logit_scale, HAS_BIAS,
                                   HAS_MASK, False, False, CHECK_N, IN_RANGE, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
                                   qid, KSeg_r, HAS_SEG)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_r, V_r, Bias, bg, m0, Mask_r, offs_m,
                                   tl.maximum(full_hi, lo), hi,
                                   Lq, Lk, D, Dv, s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, logit_scale, HAS_BIAS,
                                   HAS_MASK, True, False, CHECK_N, IN_RANGE, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
                                   qid, KSeg_r, HAS_SEG)
    else:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_r, V_r, Bias, bg, m0, Mask_r, offs_m, lo, end,
                                   Lq, Lk, D, Dv, s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, logit_scale, HAS_BIAS,
                                   HAS_MASK, False, False, CHECK_N, IN_RANGE, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
                                   qid, KSeg_r, HAS_SEG)
    _fwd_store(acc, l_i, m_i, Out + batch_offset(b, r, h, s_ob, s_or, s_oh), Lse_r, offs_m, s_om, Lq, Dv, BLOCK_DV)
