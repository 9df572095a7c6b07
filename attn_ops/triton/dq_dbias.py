"""dQ and the deterministic dBias of a bias shared over batch dims, in one pass (the pair-bias case).

A bias ``[BB, BR, BH, Lq, Lk]`` broadcast over some of (B, R, H) (triangle attention's ``[1, 1, H, L, L]`` shared
by all R rows) gets the gradient ``dBias = sum over the broadcast members of dS``. Instead of a separate kernel
that recomputes P a third time, the dQ pass owns it: one program per (query tile, bias batch index, split) walks
the members it sums in groups of GROUP (1, 2 or 4; one dQ accumulator each, unrolled: Triton's 3-D dots
measured 2-5x slower on an H100). Per key tile it forms each member's dS ``[BM, BN]`` (the shared bias tile is
loaded once for the group), adds dS K into that member's dQ, and adds the group's summed dS into its own fp32
partial dBias rows (a read-modify-write per GROUP members). The program owns those rows (no
other program writes them) and visits members in a fixed order, so the result has the same bits every run;
splits of the member loop write separate partials that the host sums in a fixed order.
"""
import triton
import triton.language as tl

from .common import batch_offset, mm
from .dbias import _ds_tile


@triton.jit
def _member(t, gb, gr, gh, lr_n, lh_n):
    """(b, r, h) of member ``t`` of bias index (gb, gr, gh)'s broadcast set (extent 1 where not broadcast)."""
    return gb + t // (lr_n * lh_n), gr + (t // lh_n) % lr_n, gh + t % lh_n


@triton.jit
def _member_ds(
    t, gb, gr, gh, lr_n, lh_n, R, H, Q, K, V, dOut, Lse, Delta, Mask, bias2, offs_m, offs_n, Lq, Lk, D, Dv,
    s_qb, s_qr, s_qh, s_qm, s_kb, s_kr, s_kh, s_kn, s_vb, s_vr, s_vh, s_vn, s_mb, s_mr, s_mh, s_mm, s_mn,
    s_db, s_dr, s_dh, s_dm, qk_scale,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, CHECK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dS [BM, BN] and the k tile of member ``t`` (q, dO, lse, delta rows re-read: L1/L2 hits)."""
    b, r, h = _member(t, gb, gr, gh, lr_n, lh_n)
    row = ((b * R + r) * H + h).to(tl.int64) * Lq
    return _ds_tile(Q + batch_offset(b, r, h, s_qb, s_qr, s_qh), K + batch_offset(b, r, h, s_kb, s_kr, s_kh),
                    V + batch_offset(b, r, h, s_vb, s_vr, s_vh), dOut + batch_offset(b, r, h, s_db, s_dr, s_dh),
                    Lse + row, Delta + row, Mask + batch_offset(b, r, h, s_mb, s_mr, s_mh), bias2, offs_m, offs_n,
                    Lq, Lk, D, Dv, s_qm, s_kn, s_vn, s_dm, s_mm, s_mn, qk_scale, HAS_MASK, CAUSAL, CHECK,
                    BLOCK_D, BLOCK_DV)


@triton.jit
def _store_dq(dQ, dq, t, gb, gr, gh, lr_n, lh_n, offs_m, offs_d, Lq, D, s_qb, s_qr, s_qh, s_qm, scale):
    b, r, h = _member(t, gb, gr, gh, lr_n, lh_n)
    ptrs = dQ + batch_offset(b, r, h, s_qb, s_qr, s_qh) + offs_m[:, None].to(tl.int64) * s_qm + offs_d[None, :]
    tl.store(ptrs, (dq * scale).to(dQ.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))


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
    tl.static_assert(GROUP == 1 or GROUP == 2 or GROUP == 4)
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
    m_ok = offs_m < Lq
    Bias += batch_offset(gb, gr, gh, s_bb, s_br, s_bh)  # broadcast dims have stride 0
    Part = dBiasPart + pid_s.to(tl.int64) * s_ps + batch_offset(gb, gr, gh, s_pb, s_pr, s_ph)
    hi = Lk
    if CAUSAL:  # key tiles past the last diagonal of this query tile get P = 0: never visited
        hi = tl.minimum(Lk, tl.maximum(m0 + BLOCK_M + (Lk - Lq), 0))

    for u in range(u_lo, u_hi):
        t = u * GROUP
        dq0 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq1 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq2 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq3 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(0, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            in_bounds = m_ok[:, None] & (offs_n[None, :] < Lk)
            bias2 = tl.load(Bias + offs_m[:, None].to(tl.int64) * s_bm + offs_n[None, :].to(tl.int64) * s_bn,
                            mask=in_bounds, other=0.0).to(tl.float32) * 1.4426950408889634  # shared by the group
            ds, k = _member_ds(t, gb, gr, gh, lr_n, lh_n, R, H, Q, K, V, dOut, Lse, Delta, Mask, bias2, offs_m,
                               offs_n, Lq, Lk, D, Dv, s_qb, s_qr, s_qh, s_qm, s_kb, s_kr, s_kh, s_kn, s_vb, s_vr,
                               s_vh, s_vn, s_mb, s_mr, s_mh, s_mm, s_mn, s_db, s_dr, s_dh, s_dm, qk_scale,
                               HAS_MASK, CAUSAL, CHECK, BLOCK_D, BLOCK_DV)
            dq0 += mm(ds.to(k.dtype), k)
            acc = ds
            if GROUP > 1:
                ds, k = _member_ds(t + 1, gb, gr, gh, lr_n, lh_n, R, H, Q, K, V, dOut, Lse, Delta, Mask, bias2,
                                   offs_m, offs_n, Lq, Lk, D, Dv, s_qb, s_qr, s_qh, s_qm, s_kb, s_kr, s_kh, s_kn,
                                   s_vb, s_vr, s_vh, s_vn, s_mb, s_mr, s_mh, s_mm, s_mn, s_db, s_dr, s_dh, s_dm,
                                   qk_scale, HAS_MASK, CAUSAL, CHECK, BLOCK_D, BLOCK_DV)
                dq1 += mm(ds.to(k.dtype), k)
                acc += ds
            if GROUP > 2:
                ds, k = _member_ds(t + 2, gb, gr, gh, lr_n, lh_n, R, H, Q, K, V, dOut, Lse, Delta, Mask, bias2,
                                   offs_m, offs_n, Lq, Lk, D, Dv, s_qb, s_qr, s_qh, s_qm, s_kb, s_kr, s_kh, s_kn,
                                   s_vb, s_vr, s_vh, s_vn, s_mb, s_mr, s_mh, s_mm, s_mn, s_db, s_dr, s_dh, s_dm,
                                   qk_scale, HAS_MASK, CAUSAL, CHECK, BLOCK_D, BLOCK_DV)
                dq2 += mm(ds.to(k.dtype), k)
                acc += ds
                ds, k = _member_ds(t + 3, gb, gr, gh, lr_n, lh_n, R, H, Q, K, V, dOut, Lse, Delta, Mask, bias2,
                                   offs_m, offs_n, Lq, Lk, D, Dv, s_qb, s_qr, s_qh, s_qm, s_kb, s_kr, s_kh, s_kn,
                                   s_vb, s_vr, s_vh, s_vn, s_mb, s_mr, s_mh, s_mm, s_mn, s_db, s_dr, s_dh, s_dm,
                                   qk_scale, HAS_MASK, CAUSAL, CHECK, BLOCK_D, BLOCK_DV)
                dq3 += mm(ds.to(k.dtype), k)
                acc += ds
            part = Part + offs_m[:, None].to(tl.int64) * s_pm + offs_n[None, :].to(tl.int64) * s_pn
            if u > u_lo:  # this program's own rows: plain read-modify-write, fixed order
                acc += tl.load(part, mask=in_bounds, other=0.0)
            tl.store(part, acc, mask=in_bounds)
        _store_dq(dQ, dq0, t, gb, gr, gh, lr_n, lh_n, offs_m, offs_d, Lq, D, s_qb, s_qr, s_qh, s_qm, scale)
        if GROUP > 1:
            _store_dq(dQ, dq1, t + 1, gb, gr, gh, lr_n, lh_n, offs_m, offs_d, Lq, D, s_qb, s_qr, s_qh, s_qm, scale)
        if GROUP > 2:
            _store_dq(dQ, dq2, t + 2, gb, gr, gh, lr_n, lh_n, offs_m, offs_d, Lq, D, s_qb, s_qr, s_qh, s_qm, scale)
            _store_dq(dQ, dq3, t + 3, gb, gr, gh, lr_n, lh_n, offs_m, offs_d, Lq, D, s_qb, s_qr, s_qh, s_qm, scale)
