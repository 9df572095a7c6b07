"""Deterministic dBias for a bias broadcast over some dims: each program owns one tile of the bias's own shape.

The bias has own shape ``[BB, BR, BH, BLq, BLk]`` with every dim 1 or full. A program owns one output tile
(bias batch index; a query tile, or all rows when BLq = 1 < Lq; a key tile, or all columns when BLk = 1 < Lk)
and loops, in a fixed order, over everything that tile sums: the broadcast batch indices (and, for a bias
broadcast over Lq or Lk, all query or key tiles). It recomputes dS = P * (dO V^T - delta) per step and
accumulates it in fp32 registers, so no ``[R, H, Lq, Lk]`` buffer exists and the result has the same bits
every run. Several programs may share one tile's batch loop (contiguous chunks, grid axis 2); their fp32 partial
sums go to ``dBiasPart[split]`` and the host adds them in a fixed order (one split: written in the bias's dtype).
"""
import triton
import triton.language as tl

from .common import batch_offset, load_lse2, load_rows, load_tile, mm


@triton.jit
def _ds_tile(
    Q, K, V, dOut, Lse, Delta, Mask, bias2, offs_m, offs_n, Lq, Lk, D, Dv, s_qm, s_kn, s_vn, s_dm, s_mm, s_mn,
    qk_scale, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, CHECK: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dS [BM, BN] (fp32) of one tile of one (b, r, h); ``bias2`` is the bias tile already times log2(e)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Lq
    n_ok = offs_n < Lk
    q = load_rows(Q, offs_m, s_qm, offs_d, D, m_ok)  # [BM, BD]
    do = load_rows(dOut, offs_m, s_dm, offs_dv, Dv, m_ok)  # [BM, BDV]
    k = load_rows(K, offs_n, s_kn, offs_d, D, n_ok)  # [BN, BD]
    v = load_rows(V, offs_n, s_vn, offs_dv, Dv, n_ok)  # [BN, BDV]
    lse2 = load_lse2(Lse, offs_m, Lq)
    delta = tl.load(Delta + offs_m, mask=m_ok, other=0.0)
    s = mm(q, tl.trans(k)) * qk_scale + bias2
    if HAS_MASK == 1:  # key mask: a select here (the bias tile is loop-invariant, so no add to fold it into)
        keep = tl.load(Mask + offs_n.to(tl.int64) * s_mn, mask=n_ok, other=0) != 0
        s = tl.where(keep[None, :], s, float("-inf"))
    if HAS_MASK == 2:
        keep = load_tile(Mask, offs_m, offs_n, s_mm, s_mn, Lq, Lk) != 0
        s = tl.where(keep, s, float("-inf"))
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= offs_m[:, None] + (Lk - Lq), s, float("-inf"))
    if CHECK:
        s = tl.where(m_ok[:, None] & n_ok[None, :], s, float("-inf"))
    p = tl.exp2(s - lse2[:, None])
    dp = mm(do, tl.trans(v))
    return p * (dp - delta[:, None])


@triton.jit
def attn_bwd_dbias_kernel(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, dBiasPart,
    s_qb, s_qr, s_qh, s_qm,
    s_kb, s_kr, s_kh, s_kn,
    s_vb, s_vr, s_vh, s_vn,
    s_bb, s_br, s_bh, s_bm, s_bn,
    s_mb, s_mr, s_mh, s_mm, s_mn,
    s_db, s_dr, s_dh, s_dm,
    s_ps, s_pb, s_pr, s_ph, s_pm, s_pn,
    B, R, H, BB, BR, BH, Lq, Lk, D, Dv, qk_scale, steps_per_split,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, LOOP_M: tl.constexpr, LOOP_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
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
    # the batch loop runs over the broadcast batch dims: (lb, lr, lh), each of extent 1 where not broadcast
    lr_n = R // BR
    lh_n = H // BH
    total = (B // BB) * lr_n * lh_n
    t_lo = pid_s * steps_per_split
    t_hi = tl.minimum(total, t_lo + steps_per_split)
    CHECK: tl.constexpr = not (EVEN_M and EVEN_N)
    Bias += batch_offset(gb, gr, gh, s_bb, s_br, s_bh)  # broadcast dims have stride 0
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
            b = gb + t // (lr_n * lh_n)
            r = gr + (t // lh_n) % lr_n
            h = gh + t % lh_n
            row = ((b * R + r) * H + h).to(tl.int64) * Lq
            for mt in range(m_lo, m_hi):
                for nt in range(n_lo, n_hi):
                    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
                    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
                    bias2 = load_tile(Bias, offs_m, offs_n, s_bm, s_bn, Lq, Lk)
                    acc += _ds_tile(Q + batch_offset(b, r, h, s_qb, s_qr, s_qh),
                                    K + batch_offset(b, r, h, s_kb, s_kr, s_kh),
                                    V + batch_offset(b, r, h, s_vb, s_vr, s_vh),
                                    dOut + batch_offset(b, r, h, s_db, s_dr, s_dh), Lse + row, Delta + row,
                                    Mask + batch_offset(b, r, h, s_mb, s_mr, s_mh),
                                    bias2.to(tl.float32) * 1.4426950408889634, offs_m, offs_n, Lq, Lk, D, Dv,
                                    s_qm, s_kn, s_vn, s_dm, s_mm, s_mn, qk_scale, HAS_MASK, CAUSAL, True,
                                    BLOCK_D, BLOCK_DV)
    else:  # the common case (pair bias shared over rows/batch): one fixed tile, flat pipelined loop
        offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        if CAUSAL:  # a tile entirely above the diagonal gets zero: skip its loop
            if pn * BLOCK_N > pm * BLOCK_M + BLOCK_M - 1 + (Lk - Lq):
                t_hi = t_lo
        bias2 = load_tile(Bias, offs_m, offs_n, s_bm, s_bn, Lq, Lk)
        bias2 = bias2.to(tl.float32) * 1.4426950408889634  # loaded once for the whole loop
        for t in range(t_lo, t_hi):
            b = gb + t // (lr_n * lh_n)
            r = gr + (t // lh_n) % lr_n
            h = gh + t % lh_n
            row = ((b * R + r) * H + h).to(tl.int64) * Lq
            acc += _ds_tile(Q + batch_offset(b, r, h, s_qb, s_qr, s_qh),
                            K + batch_offset(b, r, h, s_kb, s_kr, s_kh),
                            V + batch_offset(b, r, h, s_vb, s_vr, s_vh),
                            dOut + batch_offset(b, r, h, s_db, s_dr, s_dh), Lse + row, Delta + row,
                            Mask + batch_offset(b, r, h, s_mb, s_mr, s_mh),
                            bias2, offs_m, offs_n, Lq, Lk, D, Dv, s_qm, s_kn, s_vn, s_dm, s_mm, s_mn, qk_scale,
                            HAS_MASK, CAUSAL, CHECK, BLOCK_D, BLOCK_DV)

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
