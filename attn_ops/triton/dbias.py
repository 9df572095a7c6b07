"""Deterministic dBias for a bias broadcast over some dims: each program owns one tile of the bias's own shape.

The bias has own shape ``[BB, BR, BH, BLq, BLk]`` with every dim 1 or full. A program owns one output tile
(bias batch index, query tile or all rows when BLq = 1 < Lq, key tile or all columns when BLk = 1 < Lk) and
loops, in a fixed order, over everything that tile sums: the broadcast batch indices and, for a bias
broadcast over Lq or Lk, all query or key tiles. It recomputes dS = P * (dO V^T - delta) per step and
accumulates it in fp32 registers, so no ``[R, H, Lq, Lk]`` buffer exists and the result has the same bits
every run. ``SPLIT`` programs may share one tile's loop (contiguous chunks); their fp32 partial sums go to
``dBiasPart[split]`` and the host adds them in a fixed order.
"""
import triton
import triton.language as tl

from .common import batch_offset, load_lse2, load_rows, scores_log2


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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_t = tl.program_id(0)  # output tile within one bias [BLq, BLk] slice
    pid_g = tl.program_id(1)  # bias batch index over BB*BR*BH
    pid_s = tl.program_id(2)  # split of the reduction loop
    n_mt = tl.cdiv(Lq, BLOCK_M)
    n_nt = tl.cdiv(Lk, BLOCK_N)
    prog_nt = 1 if LOOP_N else n_nt
    pm = pid_t // prog_nt
    pn = pid_t % prog_nt
    gh = pid_g % BH
    gr = (pid_g // BH) % BR
    gb = pid_g // (BH * BR)
    # extents of the loop: broadcast batch dims and broadcast tile axes
    lb_n = B // BB
    lr_n = R // BR
    lh_n = H // BH
    lm_n = n_mt if LOOP_M else 1
    ln_n = n_nt if LOOP_N else 1
    total = lb_n * lr_n * lh_n * lm_n * ln_n
    t_lo = pid_s * steps_per_split
    t_hi = tl.minimum(total, t_lo + steps_per_split)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    Bias += batch_offset(gb, gr, gh, s_bb, s_br, s_bh)  # broadcast dims have stride 0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        ln = t % ln_n
        u = t // ln_n
        lm = u % lm_n
        u = u // lm_n
        lh = u % lh_n
        u = u // lh_n
        lr = u % lr_n
        lb = u // lr_n
        b = gb + lb  # exactly one of (gb, lb) is nonzero-ranged per dim
        r = gr + lr
        h = gh + lh
        m0 = (lm if LOOP_M else pm) * BLOCK_M
        n0 = (ln if LOOP_N else pn) * BLOCK_N
        if CAUSAL:  # skip tiles fully above the diagonal
            active = n0 <= m0 + BLOCK_M - 1 + (Lk - Lq)
        else:
            active = n0 >= 0
        if active:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            m_ok = offs_m < Lq
            n_ok = offs_n < Lk
            row = ((b * R + r) * H + h).to(tl.int64) * Lq
            q = load_rows(Q + batch_offset(b, r, h, s_qb, s_qr, s_qh), offs_m, s_qm, offs_d, D, m_ok)
            do = load_rows(dOut + batch_offset(b, r, h, s_db, s_dr, s_dh), offs_m, s_dm, offs_dv, Dv, m_ok)
            k = load_rows(K + batch_offset(b, r, h, s_kb, s_kr, s_kh), offs_n, s_kn, offs_d, D, n_ok)
            v = load_rows(V + batch_offset(b, r, h, s_vb, s_vr, s_vh), offs_n, s_vn, offs_dv, Dv, n_ok)
            lse2 = load_lse2(Lse + row, offs_m, Lq)
            delta = tl.load(Delta + row + offs_m, mask=m_ok, other=0.0)
            mask_b = Mask
            if HAS_MASK:
                mask_b = Mask + batch_offset(b, r, h, s_mb, s_mr, s_mh)
            s = scores_log2(q, k, Bias, mask_b, offs_m, offs_n, Lq, Lk, s_bm, s_bn, s_mm, s_mn, qk_scale,
                            True, HAS_MASK, CAUSAL, True, True)  # [BM, BN]
            p = tl.exp2(s - lse2[:, None])
            dp = tl.dot(do, tl.trans(v))
            acc += p * (dp - delta[:, None])

    Out = dBiasPart + pid_s.to(tl.int64) * s_ps + batch_offset(gb, gr, gh, s_pb, s_pr, s_ph)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    if LOOP_M and LOOP_N:
        tl.store(Out, tl.sum(tl.sum(acc, 1), 0))
    elif LOOP_M:
        tl.store(Out + offs_n * s_pn, tl.sum(acc, 0), mask=offs_n < Lk)
    elif LOOP_N:
        tl.store(Out + offs_m * s_pm, tl.sum(acc, 1), mask=offs_m < Lq)
    else:
        tl.store(Out + offs_m[:, None] * s_pm + offs_n[None, :] * s_pn, acc,
                 mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))
