"""Rotary embedding kernels of the language-model blocks (``attn_zoo.models.kernels.rotary_qk`` holds their launch,
autograd and PyTorch fallback): q and k of one fused projection rotated in one launch, optionally after a layer
norm over the whole width (ESM C's q/k norms), in float32, written once in the attention's dtype."""
import triton
import triton.language as tl

# Row counts and strides change with every batch shape: not specialised (no compile per length).
_ROWS = ["M", "L", "sb", "sl", "scb"]


@triton.jit
def _rotary_tile(pid, M, L, sb, sl, scb, C: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """Rows ``offs_m`` (m = b * L + l) of a program, channels ``offs_c``, each channel's rotary partner
    (``c + D/2`` in the first half of a head, ``c - D/2`` in the second) and sign, the input row offsets and the
    cos/sin row offsets (tables ``[*, L, D]``, batch stride ``scb``: 0 for shared tables)."""
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_C)
    row_ok = offs_m < M
    ok = row_ok[:, None] & (offs_c < C)[None, :]
    b = offs_m // L
    l = offs_m - b * L
    d = offs_c % D
    first = d < D // 2
    partner = tl.where(first, offs_c + D // 2, offs_c - D // 2)
    sign = tl.where(first, -1.0, 1.0)
    rows = b.to(tl.int64) * sb + l.to(tl.int64) * sl
    tables = (b.to(tl.int64) * scb + l * D)[:, None] + d[None, :]
    return offs_m, offs_c, row_ok, ok, partner, sign, rows, tables


@triton.jit(do_not_specialize=_ROWS)
def _rotary_kernel(X, W, Cos, Sin, Y, Stats, M, L, sb, sl, sg, scb, eps, scale0, scale1, C: tl.constexpr,
                   D: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """``Y[g, m] = scale_g * rope(norm_g(X[m, g]))``: X ``[B, L, G, C]`` (strides ``sb, sl, sg, 1``), Y ``[G, M, C]``
    contiguous; ``NORM``: a layer norm over C with weight ``W[g]`` (no bias) first, each row's mean and 1/std into
    ``Stats [G, 2, M]``. Grid (cdiv(M, BLOCK_M), G)."""
    g = tl.program_id(1)
    offs_m, offs_c, row_ok, ok, partner, sign, rows, tables = _rotary_tile(
        tl.program_id(0), M, L, sb, sl, scb, C, D, BLOCK_M, BLOCK_C)
    base = X + g * sg + rows[:, None]
    x = tl.load(base + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM:
        mean = tl.sum(x, axis=1) / C
        dx = tl.where(ok, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(dx * dx, axis=1) / C + eps)
        col_ok = offs_c < C
        w = tl.load(W + g * C + offs_c, mask=col_ok, other=0.0).to(tl.float32)
        wp = tl.load(W + g * C + partner, mask=col_ok, other=0.0).to(tl.float32)
        x = dx * rstd[:, None] * w[None, :]
        xp = (xp - mean[:, None]) * rstd[:, None] * wp[None, :]
        tl.store(Stats + (g * 2) * M + offs_m, mean, mask=row_ok)
        tl.store(Stats + (g * 2 + 1) * M + offs_m, rstd, mask=row_ok)
    cos = tl.load(Cos + tables, mask=ok, other=0.0)
    sin = tl.load(Sin + tables, mask=ok, other=0.0)
    y = (x * cos + sign[None, :] * xp * sin) * tl.where(g == 0, scale0, scale1)
    tl.store(Y + (g * M + offs_m.to(tl.int64))[:, None] * C + offs_c[None, :], y.to(Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=_ROWS + ["ROWS"])
def _rotary_bwd_kernel(X, W, Cos, Sin, DY, DX, Stats, DW, M, L, sb, sl, sg, scb, ROWS, scale0, scale1,
                       C: tl.constexpr, D: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    """The gradient of :func:`_rotary_kernel` for ``ROWS`` rows per program: ``DX [M, G, C]`` contiguous from
    ``DY [G, M, C]``; with ``NORM`` the program's partial sum of the weight's gradient into ``DW [G, programs, C]``
    (summed in a fixed order afterwards: deterministic). The partner of a channel shares its frequency (the tables
    are ``cat(freqs, freqs)``), so ``dz_c = dy_c cos_c - sign_c dy_partner sin_c``."""
    g = tl.program_id(1)
    pid = tl.program_id(0)
    scale = tl.where(g == 0, scale0, scale1)
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    col_ok = tl.arange(0, BLOCK_C) < C
    for start in range(0, ROWS, BLOCK_M):
        offs_m, offs_c, row_ok, ok, partner, sign, rows, tables = _rotary_tile(
            (pid * ROWS + start) // BLOCK_M, M, L, sb, sl, scb, C, D, BLOCK_M, BLOCK_C)
        grow = DY + (g * M + offs_m.to(tl.int64))[:, None] * C
        dy = tl.load(grow + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
        dyp = tl.load(grow + partner[None, :], mask=ok, other=0.0).to(tl.float32)
        cos = tl.load(Cos + tables, mask=ok, other=0.0)
        sin = tl.load(Sin + tables, mask=ok, other=0.0)
        dz = (dy * cos - sign[None, :] * dyp * sin) * scale
        if NORM:
            x = tl.load(X + g * sg + rows[:, None] + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
            mean = tl.load(Stats + (g * 2) * M + offs_m, mask=row_ok, other=0.0)
            rstd = tl.load(Stats + (g * 2 + 1) * M + offs_m, mask=row_ok, other=0.0)
            w = tl.load(W + g * C + offs_c, mask=col_ok, other=0.0).to(tl.float32)
            xhat = tl.where(ok, (x - mean[:, None]) * rstd[:, None], 0.0)
            wdz = dz * w[None, :]
            c1 = tl.sum(xhat * wdz, axis=1) / C
            c2 = tl.sum(wdz, axis=1) / C
            dw += tl.sum(dz * xhat, axis=0)
            dz = (wdz - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + (offs_m.to(tl.int64) * G + g)[:, None] * C + offs_c[None, :], dz.to(DX.dtype.element_ty),
                 mask=ok)
    if NORM:
        tl.store(DW + (g * tl.num_programs(0) + pid) * C + tl.arange(0, BLOCK_C), dw, mask=col_ok)
