"""dQ and the deterministic dBias of a bias shared over batch dims, in one pass (the pair-bias case).

A bias ``[BB, BR, BH, Lq, Lk]`` broadcast over some of (B, R, H) (triangle attention's ``[1, 1, H, L, L]`` shared
by all R rows) gets the gradient ``dBias = sum over the broadcast members of dS``. Instead of a separate kernel
that recomputes P a third time, the dQ pass owns it: one program per (query tile, bias batch index, split) walks
the members it sums in groups of GROUP, holding the group as the leading dim of 3-D tiles ``[G, BM, *]``.
Per key tile it forms dS ``[G, BM, BN]`` (the shared bias tile is loaded once for the group), adds dS K into
each member's dQ, and adds ``sum_g dS`` into its own fp32 partial dBias rows. The program owns those rows (no
other program writes them) and visits members in a fixed order, so the result has the same bits every run;
splits of the member loop write separate partials that the host sums in a fixed order.
"""
import triton
import triton.language as tl

from .common import batch_offset, mm


@triton.jit
def _rows3(base, offs, stride, offs_d, D, ok):
    """[G, len(offs), BLOCK_D] tile: rows ``offs`` of G matrices at element offsets ``base`` [G]."""
    ptrs = base[:, None, None] + offs[None, :, None].to(tl.int64) * stride + offs_d[None, None, :]
    return tl.load(ptrs, mask=ok[None, :, None] & (offs_d[None, None, :] < D), other=0.0)


@triton.jit
def attn_bwd_dq_dbias_kernel(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, dQ, dBiasPart,
    s_qb, s_qr, s_qh, s_qm,
    s_kb, s_kr, s_kh, s_kn,
    s_vb, s_vr, s_vh, s_vn,
    s_bb, s_br, s_bh, s_bm, s_bn,
    s_mb, s_mr, s_mh, s_mm, s_mn,
    s_db, s_dr, s_dh, s_dm,
    s_ps, s_pb, s_pr, s_ph, s_pm, s_pn,
    B, R, H, BB, BR, BH, Lq, Lk, D, Dv, qk_scale, scale, units_per_split,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)  # query tile
    pid_g = tl.program_id(1)  # bias batch index over BB*BR*BH
    pid_s = tl.program_id(2)  # split of the member loop
    gh = pid_g % BH
    gr = (pid_g // BH) % BR
    gb = pid_g // (BH * BR)
    lr_n = R // BR  # members per bias index along R (1 where the bias is not broadcast), likewise H and B
    lh_n = H // BH
    n_units = (B // BB) * lr_n * lh_n // GROUP
    u_lo = pid_s * units_per_split
    u_hi = tl.minimum(n_units, u_lo + units_per_split)
    CHECK: tl.constexpr = not (EVEN_M and EVEN_N)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_g = tl.arange(0, GROUP)
    m_ok = offs_m < Lq
    Bias += batch_offset(gb, gr, gh, s_bb, s_br, s_bh)  # broadcast dims have stride 0
    Part = dBiasPart + pid_s.to(tl.int64) * s_ps + batch_offset(gb, gr, gh, s_pb, s_pr, s_ph)
    hi = Lk
    if CAUSAL:  # key tiles past the last diagonal of this query tile get P = 0: never visited
        hi = tl.minimum(Lk, tl.maximum(m0 + BLOCK_M + (Lk - Lq), 0))

    for u in range(u_lo, u_hi):
        t = u * GROUP + offs_g  # [G] member index within this bias index's broadcast set
        b = gb + t // (lr_n * lh_n)
        r = gr + (t // lh_n) % lr_n
        h = gh + t % lh_n
        q_off = batch_offset(b, r, h, s_qb, s_qr, s_qh)  # [G]
        k_off = batch_offset(b, r, h, s_kb, s_kr, s_kh)
        v_off = batch_offset(b, r, h, s_vb, s_vr, s_vh)
        m_off = batch_offset(b, r, h, s_mb, s_mr, s_mh)
        row = ((b * R + r) * H + h).to(tl.int64) * Lq
        q = _rows3(Q + q_off, offs_m, s_qm, offs_d, D, m_ok)  # [G, BM, BD]
        do = _rows3(dOut + batch_offset(b, r, h, s_db, s_dr, s_dh), offs_m, s_dm, offs_dv, Dv, m_ok)
        lse2 = tl.load(Lse + row[:, None] + offs_m[None, :], mask=m_ok[None, :], other=0.0) * 1.4426950408889634
        lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # empty rows: every score is -inf, so P = 0
        delta = tl.load(Delta + row[:, None] + offs_m[None, :], mask=m_ok[None, :], other=0.0)  # [G, BM]
        dq = tl.zeros([GROUP, BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(0, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < Lk
            in_bounds = m_ok[:, None] & n_ok[None, :]
            k = _rows3(K + k_off, offs_n, s_kn, offs_d, D, n_ok)  # [G, BN, BD]
            v = _rows3(V + v_off, offs_n, s_vn, offs_dv, Dv, n_ok)  # [G, BN, BDV]
            bias2 = tl.load(Bias + offs_m[:, None].to(tl.int64) * s_bm + offs_n[None, :].to(tl.int64) * s_bn,
                            mask=in_bounds, other=0.0).to(tl.float32) * 1.4426950408889634  # shared: [BM, BN]
            s = mm(q, tl.trans(k, (0, 2, 1))) * qk_scale + bias2[None, :, :]  # [G, BM, BN]
            if HAS_MASK == 1:  # key mask: [G, BN]
                keep = tl.load(Mask + m_off[:, None] + offs_n[None, :].to(tl.int64) * s_mn,
                               mask=n_ok[None, :], other=0) != 0
                s = tl.where(keep[:, None, :], s, float("-inf"))
            if HAS_MASK == 2:
                keep = tl.load(Mask + m_off[:, None, None] + offs_m[None, :, None].to(tl.int64) * s_mm
                               + offs_n[None, None, :].to(tl.int64) * s_mn, mask=in_bounds[None, :, :], other=0) != 0
                s = tl.where(keep, s, float("-inf"))
            if CAUSAL:
                s = tl.where((offs_n[None, :] <= offs_m[:, None] + (Lk - Lq))[None, :, :], s, float("-inf"))
            if CHECK:
                s = tl.where(in_bounds[None, :, :], s, float("-inf"))
            p = tl.exp2(s - lse2[:, :, None])
            dp = mm(do, tl.trans(v, (0, 2, 1)))
            ds = p * (dp - delta[:, :, None])  # [G, BM, BN] fp32
            dq += mm(ds.to(k.dtype), k)
            part = Part + offs_m[:, None].to(tl.int64) * s_pm + offs_n[None, :].to(tl.int64) * s_pn
            acc = tl.sum(ds, 0)
            if u > u_lo:  # this program's own rows: plain read-modify-write, fixed order
                acc += tl.load(part, mask=in_bounds, other=0.0)
            tl.store(part, acc, mask=in_bounds)
        dq_ptrs = dQ + q_off[:, None, None] + offs_m[None, :, None].to(tl.int64) * s_qm + offs_d[None, None, :]
        tl.store(dq_ptrs, (dq * scale).to(dQ.dtype.element_ty), mask=m_ok[None, :, None] & (offs_d[None, None, :] < D))
