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
def _rotary_kernel(X, W, Cos, Sin, Y, Y1, YV, Stats, M, L, sb, sl, sg, scb, eps, scale0, scale1, C: tl.constexpr,
                   D: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """``Y_g[m] = scale_g * rope(norm_g(X[m, g]))`` for the G rotated groups of X ``[B, L, *, C]`` (strides ``sb, sl,
    sg, 1``): group 0 into ``Y``, group 1 into ``Y1``, each ``[M, C]`` contiguous; ``NORM``: a layer norm over C with
    weight ``W[g]`` (no bias) first, each row's mean and 1/std into ``Stats [G, 2, M]``. Grid (cdiv(M, BLOCK_M), G),
    or G + 1 to copy group G (v of a fused q/k/v projection) as it is into ``YV [M, C]``."""
    g = tl.program_id(1)
    offs_m, offs_c, row_ok, ok, partner, sign, rows, tables = _rotary_tile(
        tl.program_id(0), M, L, sb, sl, scb, C, D, BLOCK_M, BLOCK_C)
    base = X + g * sg + rows[:, None]
    out = offs_m.to(tl.int64)[:, None] * C + offs_c[None, :]
    if g >= G:
        tl.store(YV + out, tl.load(base + offs_c[None, :], mask=ok).to(YV.dtype.element_ty), mask=ok)
    else:
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
        if g == 0:
            tl.store(Y + out, y.to(Y.dtype.element_ty), mask=ok)
        else:
            tl.store(Y1 + out, y.to(Y1.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=_ROWS + ["sdb", "sdl", "ROWS"])
def _rotary_bwd_kernel(X, W, Cos, Sin, DY, DY1, DYV, DX, Stats, DW, M, L, sb, sl, sg, scb, sdb, sdl, ROWS, scale0,
                       scale1, C: tl.constexpr, D: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr,
                       PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """The gradient of :func:`_rotary_kernel` for ``ROWS`` rows per program: group g's input gradient into columns
    ``[g C, (g + 1) C)`` of ``DX`` (row strides ``sdb, sdl``: the fused projection's gradient) from ``DY`` (g = 0)
    or ``DY1`` (g = 1), each ``[M, C]`` contiguous; with ``NORM`` the program's partial sum of the weight's gradient
    into ``DW [G, programs, C]`` (summed in a fixed order afterwards: deterministic). The partner of a channel shares
    its frequency (the tables are ``cat(freqs, freqs)``), so ``dz_c = dy_c cos_c - sign_c dy_partner sin_c``. Grid
    (programs, G), or G + 1 to copy ``DYV [M, C]`` (v's gradient) into columns ``[G C, (G + 1) C)`` and zeros into
    the ``PAD`` columns after them."""
    g = tl.program_id(1)
    pid = tl.program_id(0)
    if g >= G:
        offs_p = tl.arange(0, 8)  # (PAD < 8: the fused width's padding to a multiple of 8)
        for start in range(0, ROWS, BLOCK_M):
            offs_m, offs_c, row_ok, ok, partner, sign, rows, tables = _rotary_tile(
                (pid * ROWS + start) // BLOCK_M, M, L, sb, sl, scb, C, D, BLOCK_M, BLOCK_C)
            b = offs_m // L
            drow = DX + (b.to(tl.int64) * sdb + (offs_m - b * L).to(tl.int64) * sdl)[:, None] + G * C
            dv = tl.load(DYV + offs_m.to(tl.int64)[:, None] * C + offs_c[None, :], mask=ok)
            tl.store(drow + offs_c[None, :], dv.to(DX.dtype.element_ty), mask=ok)
            if PAD > 0:
                zeros = tl.zeros([BLOCK_M, 8], dtype=DX.dtype.element_ty)
                tl.store(drow + C + offs_p[None, :], zeros, mask=row_ok[:, None] & (offs_p < PAD)[None, :])
    else:
        scale = tl.where(g == 0, scale0, scale1)
        dw = tl.zeros([BLOCK_C], dtype=tl.float32)
        col_ok = tl.arange(0, BLOCK_C) < C
        for start in range(0, ROWS, BLOCK_M):
            offs_m, offs_c, row_ok, ok, partner, sign, rows, tables = _rotary_tile(
                (pid * ROWS + start) // BLOCK_M, M, L, sb, sl, scb, C, D, BLOCK_M, BLOCK_C)
            grow = offs_m.to(tl.int64)[:, None] * C
            if g == 0:
                dy = tl.load(DY + grow + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
                dyp = tl.load(DY + grow + partner[None, :], mask=ok, other=0.0).to(tl.float32)
            else:
                dy = tl.load(DY1 + grow + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
                dyp = tl.load(DY1 + grow + partner[None, :], mask=ok, other=0.0).to(tl.float32)
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
            b = offs_m // L
            drow = (b.to(tl.int64) * sdb + (offs_m - b * L).to(tl.int64) * sdl)[:, None] + g * C
            tl.store(DX + drow + offs_c[None, :], dz.to(DX.dtype.element_ty), mask=ok)
        if NORM:
            tl.store(DW + (g * tl.num_programs(0) + pid) * C + tl.arange(0, BLOCK_C), dw, mask=col_ok)
