"""Triton device helpers shared by the forward and backward kernels.

Logits are kept in natural units, ``s = q k^T * scale + bias``, and every exponential is one fused multiply-add
into ``exp2``: ``exp(s - m) = exp2(s * log2(e) - m2)`` with the row statistic ``m2`` (running max, lse) in the
log2 domain. The bias tile then needs only its conversion to fp32 (no scaling: one instruction per score fewer
than scaling it into the log2 domain, in every pass). lse is stored in the natural log (``m + ln(l)``).
Every index tensor is a 1-D ``tl.arange`` block; bias and mask are read through strides (a broadcast dim
has stride 0).
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Kernel args that vary with the sequence length (lengths, row counts, strides of the bias, mask, dbias and its
# partials, the dbias split count): not specialised on divisibility by 16, so a new length reuses the compiled
# kernels. Strides that are multiples of the head width (q, k, v, out, dout) stay specialised: they set the alignment
# of the row loads.
LENGTH_ARGS = ("R", "BR", "Lq", "Lk", "lr_n", "total", "numel", "steps_per_split", "splits",
               "s_bb", "s_br", "s_bh", "s_bm", "s_mb", "s_mr", "s_mh", "s_mm",
               "s_gb", "s_gr", "s_gh", "s_gm", "s_ps", "s_pb", "s_pr", "s_ph", "s_pm")
# The mask's and bias's key strides: 1 in a contiguous layout (specialised: the loads vectorise) but a length where
# they are transposed (the ending-node triangle attention's mask), so not specialised on divisibility by 16: a length
# that is a multiple of 16 would compile its own variant.
KEY_STRIDE_ARGS = ("s_mn", "s_bn")


@triton.jit
def mm(a, b):
    """a @ b with fp32 accumulation; fp32 inputs use full-precision products ("ieee"), not TF32."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def batch_offset(b, r, h, s_b, s_r, s_h):
    """Element offset of batch (b, r, h) in a tensor with batch strides (s_b, s_r, s_h), in int64."""
    return b.to(tl.int64) * s_b + r.to(tl.int64) * s_r + h.to(tl.int64) * s_h


@triton.jit
def aligned(s_b, s_r, s_h, s_m, ALIGN: tl.constexpr):
    """A tensor's (b, r, h, row) strides, each known to the compiler as a multiple of ALIGN (the launcher's
    guarantee: ``launch._align``). Triton specialises a stride only when 16 divides it, so a head width such as 24
    would otherwise leave every row start of unknown alignment and the rows' loads without 16-byte vectors or
    asynchronous copies. ``(s // ALIGN) * ALIGN`` is ``s`` itself, in a form the compiler's alignment analysis
    reads (a ``tl.multiple_of`` hint would not survive this function's inlining)."""
    if ALIGN > 1:
        s_b = (s_b // ALIGN) * ALIGN
        s_r = (s_r // ALIGN) * ALIGN
        s_h = (s_h // ALIGN) * ALIGN
        s_m = (s_m // ALIGN) * ALIGN
    return s_b, s_r, s_h, s_m


@triton.jit
def split_batch(pid_z, R, H):
    """Program id over B*R*H -> (b, r, h), h fastest."""
    h = pid_z % H
    r = (pid_z // H) % R
    b = pid_z // (H * R)
    return b, r, h


@triton.jit
def load_masked(ptrs, row_ok, col_ok, MASK_ROWS: tl.constexpr = True, MASK_COLS: tl.constexpr = True):
    """``tl.load(ptrs)`` with 0 where ``row_ok`` / ``col_ok`` (broadcastable to ``ptrs``) are False, each applied
    only where its flag says: a caller that knows every row / column is in range loads without that mask (fewer
    instructions in the inner loops)."""
    if MASK_ROWS and MASK_COLS:
        return tl.load(ptrs, mask=row_ok & col_ok, other=0.0)
    elif MASK_ROWS:
        return tl.load(ptrs, mask=row_ok, other=0.0)
    elif MASK_COLS:
        return tl.load(ptrs, mask=col_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def load_rows(base, offs, stride, offs_d, D, ok, MASK_ROWS: tl.constexpr = True, MASK_D: tl.constexpr = True):
    """Rows ``offs`` of a [L, D] matrix with row stride ``stride`` (last dim contiguous): [len(offs), BLOCK_D].

    Rows where ``ok`` is False and columns >= D read as 0 (:func:`load_masked`; MASK_ROWS / MASK_D False: every
    row is to be read / D fills the block).
    """
    return load_masked(base + offs[:, None] * stride + offs_d[None, :], ok[:, None], offs_d[None, :] < D,
                       MASK_ROWS, MASK_D)


@triton.jit
def load_tile(Base, offs_m, offs_n, s_m, s_n, Lm, Ln, CHECK: tl.constexpr = True):
    """Tile ``[len(offs_m), len(offs_n)]`` of a 2-D slice with strides (s_m, s_n) (0 on a broadcast dim); 0 out of
    range.

    Offsets in int64: a bias slice may span more than 2^31 elements. CHECK False: the tile is known to be in range.
    """
    ptrs = Base + offs_m[:, None].to(tl.int64) * s_m + offs_n[None, :].to(tl.int64) * s_n
    if CHECK:
        return tl.load(ptrs, mask=(offs_m[:, None] < Lm) & (offs_n[None, :] < Ln), other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def key_rows(Mask, offs_n, s_mn, Lk, HAS_MASK: tl.constexpr):
    """``[BN]``: the attended keys under a key mask (HAS_MASK 1), else the keys < Lk: the K rows a caller that
    zeroes masked keys' rows reads (garbage there, NaN / inf padding, then never meets q), or the logits' columns
    a select keeps (:func:`kv_scores`)."""
    if HAS_MASK == 1:
        return tl.load(Mask + offs_n.to(tl.int64) * s_mn, mask=offs_n < Lk, other=0) != 0
    else:
        return offs_n < Lk


@triton.jit
def bias_f32(Bias, bg, m0, n0, offs_m, offs_n, s_bm, s_bn, Lq, Lk, CHECK: tl.constexpr = True,
             HAS_BIAS: tl.constexpr = 1):
    """The bias tile ``[BM, BN]`` at rows ``offs_m = m0 + arange``, columns ``offs_n = n0 + arange`` as fp32,
    natural units (0 out of range; CHECK False: known in range).

    HAS_BIAS 1: ``Bias`` points at this program's bias slice (strides s_bm, s_bn). HAS_BIAS 2: ``Bias`` is a
    ``[slices, Lq, Lk]`` tensor descriptor (Hopper TMA: the copy engine computes the addresses and fills what is out
    of range with 0) and ``bg`` the slice; the launcher picks it where the layout allows (:func:`launch.bias_tma`).
    HAS_BIAS 3: as 1, but the launcher's copy of the bias whose rows run on to a whole number of the widest key
    tile (``launch.bias_for_tiles``): columns >= Lk are read, not masked (their values are never used: every
    caller sets the logits of keys >= Lk to -inf by a select), so the tile's loads carry at most a row mask,
    uniform along each row, and vectorise.
    """
    if HAS_BIAS == 2:
        BM: tl.constexpr = offs_m.shape[0]
        BN: tl.constexpr = offs_n.shape[0]
        return Bias.load([bg, m0, n0]).reshape(BM, BN).to(tl.float32)
    elif HAS_BIAS == 3:
        ptrs = Bias + offs_m[:, None].to(tl.int64) * s_bm + offs_n[None, :].to(tl.int64) * s_bn
        if CHECK:
            return tl.load(ptrs, mask=offs_m[:, None] < Lq, other=0).to(tl.float32)
        else:
            return tl.load(ptrs).to(tl.float32)
    else:
        return load_tile(Bias, offs_m, offs_n, s_bm, s_bn, Lq, Lk, CHECK).to(tl.float32)


@triton.jit
def key_terms(
    Bias, bg, m0, n0, Mask, offs_m, offs_n, s_bm, s_bn, s_mn, Lq, Lk, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, CHECK: tl.constexpr = True,
):
    """What a query tile adds to its logits for one key tile, and which key rows to load.

    Returns ``(badd, k_ok)``: ``badd`` the fp32 bias tile ``[BM, BN]`` with a key mask (HAS_MASK 1) folded
    in as -inf (a ``[1, BN]`` 0/-inf row without a bias; 0.0 with neither), ``k_ok`` ``[BN]`` the key rows to
    load from K (attended keys only under a key mask, else those < Lk). The masked keys' bias is replaced, not
    added to, and the caller reads their K rows as zeros, so a NaN or inf there (padding garbage) cannot reach the
    row, as with the reference's masked_fill; a select costs what the add it replaces did.
    """
    k_ok = key_rows(Mask, offs_n, s_mn, Lk, HAS_MASK)
    badd = 0.0
    if HAS_MASK == 1:
        if HAS_BIAS:
            badd = tl.where(k_ok[None, :], bias_f32(Bias, bg, m0, n0, offs_m, offs_n, s_bm, s_bn, Lq, Lk, CHECK,
                                                    HAS_BIAS), float("-inf"))
        else:
            badd = tl.where(k_ok, 0.0, float("-inf"))[None, :]
    elif HAS_BIAS:
        badd = bias_f32(Bias, bg, m0, n0, offs_m, offs_n, s_bm, s_bn, Lq, Lk, CHECK, HAS_BIAS)
    return badd, k_ok


@triton.jit
def seg_ids(Seg, offs, L, FILL: tl.constexpr):
    """Segment ids [len(offs)] of one row (``Seg`` points at the row's ids), FILL where out of range or negative
    (padding): the query side fills -1 and the key side -2, so an equality test never pairs two paddings."""
    ids = tl.load(Seg + offs, mask=offs < L, other=FILL)
    return tl.where(ids < 0, FILL, ids)


@triton.jit
def seg_span(Own, offs, L_own, L_other, BLOCK: tl.constexpr):
    """For a tile of positions ``offs`` of one row (``Own`` points at the row's table,
    ``op.segment_tables``), the positions [lo, hi) of the other side's row whose ids can equal one of the
    tile's non-negative ids, ``lo`` rounded down to a multiple of BLOCK (the other side's tile): the smallest of
    the tile's per-position lower bounds and the largest of their ends. A tile of padding only gives an empty
    span."""
    in_row = offs < L_own
    lo = tl.min(tl.load(Own + L_own + offs, mask=in_row, other=L_other), 0)
    hi = tl.max(tl.load(Own + 2 * L_own + offs, mask=in_row, other=0), 0)
    lo_tile = (lo // BLOCK) * BLOCK
    return lo_tile, tl.where(hi > lo, hi, lo_tile)


@triton.jit
def ids_meet(Qs, offs_m, Lq, Ks, offs_n, Lk):
    """Whether a query tile and a key tile of one row share a non-negative segment id (their id ranges meet)."""
    qi = tl.load(Qs + offs_m, mask=offs_m < Lq, other=-1)
    ki = tl.load(Ks + offs_n, mask=offs_n < Lk, other=-1)
    q_lo = tl.min(tl.where(qi >= 0, qi, 2147483647), 0)
    q_hi = tl.max(qi, 0)
    k_lo = tl.min(tl.where(ki >= 0, ki, 2147483647), 0)
    k_hi = tl.max(ki, 0)
    return (q_lo <= k_hi) & (k_lo <= q_hi)


@triton.jit
def logits(
    q, k, badd, Mask, offs_m, offs_n, Lq, Lk, s_mm, s_mn, logit_scale,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, APPLY_CAUSAL: tl.constexpr,
    CHECK_M: tl.constexpr, CHECK_N: tl.constexpr, qid=0, kid=0, HAS_SEG: tl.constexpr = False,
):
    """Logits of one tile (natural units): q [BM, D] x k [BN, D] -> [BM, BN] fp32, -inf where not attended.

    ``badd``: the tile's bias and key mask from :func:`key_terms` (loaded by the caller, which also needs the
    key mask to load K). ``Mask`` points at this program's (b, r, h) slice; ``logit_scale``: the op's scale.
    HAS_MASK: 0 none, 1 a key mask (broadcast over Lq, in ``badd``), 2 a mask that varies over Lq (a select
    here). Rows >= Lq (when CHECK_M) and columns >= Lk (when CHECK_N) are -inf too. HAS_SEG: ``qid`` [BM] and
    ``kid`` [BN] (:func:`seg_ids`) must be equal.
    """
    if HAS_BIAS or HAS_MASK == 1:
        s = mm(q, tl.trans(k)) * logit_scale + badd
    else:
        s = mm(q, tl.trans(k)) * logit_scale
    if HAS_MASK == 2:
        keep = load_tile(Mask, offs_m, offs_n, s_mm, s_mn, Lq, Lk) != 0
        s = tl.where(keep, s, float("-inf"))
    if HAS_SEG:
        s = tl.where(qid[:, None] == kid[None, :], s, float("-inf"))
    if APPLY_CAUSAL:
        s = tl.where(offs_n[None, :] <= offs_m[:, None] + (Lk - Lq), s, float("-inf"))
    if CHECK_M or CHECK_N:
        s = tl.where((offs_m[:, None] < Lq) & (offs_n[None, :] < Lk), s, float("-inf"))
    return s


@triton.jit
def load_lse2(Lse, offs_m, Lq, CHECK: tl.constexpr = True):
    """lse of rows ``offs_m`` in the log2 domain, with -inf (fully masked rows) and out-of-range rows as 0.

    A fully masked row has every score -inf, so ``exp2(s * log2(e) - 0)`` gives exactly 0 there: no NaN. CHECK False:
    every row is < Lq.
    """
    lse = load_masked(Lse + offs_m, offs_m < Lq, offs_m < Lq, CHECK, False) * 1.4426950408889634
    return tl.where(lse == float("-inf"), 0.0, lse)


@triton.jit
def logits_t(
    k, qT, baddT, Mask, offs_m, offs_n, Lq, Lk, s_mm, s_mn, logit_scale,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, APPLY_CAUSAL: tl.constexpr, CHECK: tl.constexpr,
    qid=0, kid=0, HAS_SEG: tl.constexpr = False,
):
    """Transposed tile of :func:`logits`: k [BN, D] x qT [D, BM] -> sT [BN, BM] (-inf masked).

    ``baddT``: the transposed bias tile with the key mask folded in (``[BN, 1]`` without a bias), see
    :func:`key_terms_t`. The dK/dV kernel works on transposed tiles so that no [BM, BN] matrix needs a
    transpose before its dots.
    """
    if HAS_BIAS or HAS_MASK == 1:
        s = mm(k, qT) * logit_scale + baddT
    else:
        s = mm(k, qT) * logit_scale
    if HAS_MASK == 2:
        keep = tl.trans(load_tile(Mask, offs_m, offs_n, s_mm, s_mn, Lq, Lk)) != 0
        s = tl.where(keep, s, float("-inf"))
    if HAS_SEG:
        s = tl.where(kid[:, None] == qid[None, :], s, float("-inf"))
    if APPLY_CAUSAL:
        s = tl.where(offs_n[:, None] <= offs_m[None, :] + (Lk - Lq), s, float("-inf"))
    if CHECK:
        s = tl.where((offs_n[:, None] < Lk) & (offs_m[None, :] < Lq), s, float("-inf"))
    return s


@triton.jit
def key_terms_t(biasT, keep, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr):
    """:func:`key_terms` for a transposed tile whose key rows are fixed: ``biasT`` [BN, BM] (fp32, loaded
    in the bias's own row-major order and transposed, or 0.0) and ``keep`` [BN] (HAS_MASK 1) -> ``baddT``."""
    if HAS_MASK == 1:
        if HAS_BIAS:
            return tl.where(keep[:, None], biasT, float("-inf"))
        else:
            return tl.where(keep, 0.0, float("-inf"))[:, None]
    else:
        return biasT


@triton.jit
def kv_scores(
    q, K, V, Bias, bg, m0, n0, Mask, offs_m, offs_n, Lq, Lk, D, Dv, s_kn, s_vn, s_bm, s_bn, s_mm, s_mn, logit_scale,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, APPLY_CAUSAL: tl.constexpr,
    CHECK_M: tl.constexpr, CHECK_N: tl.constexpr, IN_RANGE: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, qid=0, KSeg=None, HAS_SEG: tl.constexpr = False,
    ZERO_K: tl.constexpr = True,
):
    """One key tile of a query tile's loop: k [BN, BD], v [BN, BDV] and the logits s [BM, BN] (:func:`logits`).
    The tile starts at query row m0 and key n0 (offs_m, offs_n); (Bias, bg): see :func:`bias_f32`.

    Under a key mask (HAS_MASK 1) a masked key's garbage (NaN / inf in k or the bias) never reaches the logits:
    ZERO_K True reads K rows of masked keys as zeros (:func:`key_terms`), for a caller that multiplies k by the
    scores (dQ's ``dS @ k``); ZERO_K False (the forward), on a tile with range checks (not IN_RANGE), reads K by
    its range alone and selects -inf over the masked keys' logits, so the K load does not wait on the mask's. V
    rows are read as they are (a NaN in v at a masked key reaches the output through 0 * NaN, as in the
    reference). IN_RANGE: every query row and key of the tile is < Lq, Lk; EVEN_D: D and Dv fill
    their blocks (the loads then need no mask beyond the key mask's rows). HAS_SEG: ``qid`` [BM] the query tile's
    segment ids, ``KSeg`` this row's key ids.
    """
    # (a tile in range has no other select to merge the key mask's with: there the select after the dot cost the
    # forward more than the wait on the mask: docs/bench/history.md)
    SELECT_KEYS: tl.constexpr = HAS_MASK == 1 and not ZERO_K and not IN_RANGE
    if SELECT_KEYS:
        k_ok = key_rows(Mask, offs_n, s_mn, Lk, HAS_MASK)
        badd = 0.0
        if HAS_BIAS:  # (the tile has range checks here: not IN_RANGE)
            badd = bias_f32(Bias, bg, m0, n0, offs_m, offs_n, s_bm, s_bn, Lq, Lk, True, HAS_BIAS)
        k = load_rows(K, offs_n, s_kn, tl.arange(0, BLOCK_D), D, offs_n < Lk, True, not EVEN_D)
    else:
        badd, k_ok = key_terms(Bias, bg, m0, n0, Mask, offs_m, offs_n, s_bm, s_bn, s_mn, Lq, Lk, HAS_BIAS,
                               HAS_MASK, not IN_RANGE)
        K_ROWS: tl.constexpr = HAS_MASK == 1 or not IN_RANGE
        k = load_rows(K, offs_n, s_kn, tl.arange(0, BLOCK_D), D, k_ok, K_ROWS, not EVEN_D)
    v = load_rows(V, offs_n, s_vn, tl.arange(0, BLOCK_DV), Dv, offs_n < Lk, not IN_RANGE, not EVEN_D)
    kid = 0
    if HAS_SEG:
        kid = seg_ids(KSeg, offs_n, Lk, -2)
    if SELECT_KEYS:
        s = logits(q, k, badd, Mask, offs_m, offs_n, Lq, Lk, s_mm, s_mn, logit_scale,
                   HAS_BIAS, 0, APPLY_CAUSAL, CHECK_M, CHECK_N, qid, kid, HAS_SEG)
        s = tl.where(k_ok[None, :], s, float("-inf"))
    else:
        s = logits(q, k, badd, Mask, offs_m, offs_n, Lq, Lk, s_mm, s_mn, logit_scale,
                   HAS_BIAS, HAS_MASK, APPLY_CAUSAL, CHECK_M, CHECK_N, qid, kid, HAS_SEG)
    return k, v, s
