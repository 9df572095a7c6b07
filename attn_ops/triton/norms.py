"""Layer-norm and gating kernels of the blocks (``attn_zoo.models.kernels`` holds their plans, launchers, autograd
and PyTorch fallbacks): rows of any 2-strided layout normalised into a contiguous result, and triangle
multiplication's gate / projection / mask written channels-first with its padding."""
import triton
import triton.language as tl

# Lengths and row strides change with every protein length: not specialised (no compile per length); ALIGN
# (a power of two dividing sa and sb, see _align) gives back what their divisibility told the compiler.
_ROWS = ["M", "B", "sa", "sb"]


@triton.jit(do_not_specialize=_ROWS, do_not_specialize_on_alignment=["sc"])
def _layer_norm_kernel(X, W, Bias, Y, Mean, Rstd, M, B, C, sa, sb, sc, eps, HAS_W: tl.constexpr,
                       HAS_B: tl.constexpr, STATS: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    """Rows ``m`` of a 3-d view ``[A, B, C]`` (strides ``sa, sb, sc``; ``m = a * B + b``) normalised over C
    into ``Y [M, C]`` contiguous, in float32; ``STATS``: each row's mean and 1/std into ``Mean``, ``Rstd``."""
    sa = (sa // ALIGN) * ALIGN
    sb = (sb // ALIGN) * ALIGN
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_C)
    row_ok = offs_m < M
    col_ok = offs_c < C
    ok = row_ok[:, None] & col_ok[None, :]
    a = offs_m // B
    b = offs_m - a * B
    # 64-bit offsets: a column chunk of a large pair tensor spans more than 2**31 elements
    row = a.to(tl.int64) * sa + b.to(tl.int64) * sb
    x = tl.load(X + row[:, None] + offs_c[None, :].to(tl.int64) * sc, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / C
    d = tl.where(ok, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / C + eps)
    y = d * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + offs_c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(Bias + offs_c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * C + offs_c[None, :], y.to(Y.dtype.element_ty), mask=ok)
    if STATS:
        tl.store(Mean + offs_m, mean, mask=row_ok)
        tl.store(Rstd + offs_m, rstd, mask=row_ok)


@triton.jit(do_not_specialize=_ROWS + ["da", "db", "ROWS"], do_not_specialize_on_alignment=["sc", "dc"])
def _layer_norm_bwd_kernel(X, W, DY, DX, Mean, Rstd, DW, DB, M, B, C, sa, sb, sc, da, db, dc, ROWS,
                           HAS_W: tl.constexpr, ALIGN: tl.constexpr, ALIGN_DX: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """The input gradient of ``ROWS`` rows per program (``DX`` in the 3-d view of strides ``da, db, dc``, ``DY``
    contiguous ``[M, C]``), and the program's partial sums of the weight's and bias's gradients (``DW``, ``DB``
    ``[programs, C]`` float32: summed in a fixed order afterwards, so the gradients are deterministic). ROWS, a
    multiple of BLOCK_M, follows the row count: a runtime value (as a constexpr it compiled once per length)."""
    sa = (sa // ALIGN) * ALIGN
    sb = (sb // ALIGN) * ALIGN
    da = (da // ALIGN_DX) * ALIGN_DX
    db = (db // ALIGN_DX) * ALIGN_DX
    pid = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    col_ok = offs_c < C
    w = tl.load(W + offs_c, mask=col_ok, other=0.0).to(tl.float32) if HAS_W else tl.where(col_ok, 1.0, 0.0)
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    dbias = tl.zeros([BLOCK_C], dtype=tl.float32)
    for start in range(0, ROWS, BLOCK_M):
        offs_m = pid * ROWS + start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < M
        ok = row_ok[:, None] & col_ok[None, :]
        a = offs_m // B
        b = offs_m - a * B
        x = tl.load(X + (a.to(tl.int64) * sa + b.to(tl.int64) * sb)[:, None] + offs_c[None, :].to(tl.int64) * sc,
                    mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs_m.to(tl.int64)[:, None] * C + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(Mean + offs_m, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + offs_m, mask=row_ok, other=0.0)
        xhat = tl.where(ok, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :]
        c1 = tl.sum(xhat * wdy, axis=1) / C
        c2 = tl.sum(wdy, axis=1) / C
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + (a.to(tl.int64) * da + b.to(tl.int64) * db)[:, None] + offs_c[None, :].to(tl.int64) * dc,
                 dx.to(DX.dtype.element_ty), mask=ok)
        dw += tl.sum(dy * xhat, axis=0)
        dbias += tl.sum(dy, axis=0)
    tl.store(DW + pid * C + offs_c, dw, mask=col_ok)
    tl.store(DB + pid * C + offs_c, dbias, mask=col_ok)


@triton.jit
def _gate_tile(C2, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr):
    """A gating program's row ``i``, columns ``offs_j``, batch ``b`` and channels ``offs_c`` (with ``c_ok``) of
    the grid (rows, column blocks, batch * channel blocks)."""
    n_cb = tl.cdiv(C2, BLOCK_C)
    offs_c = (tl.program_id(2) % n_cb) * BLOCK_C + tl.arange(0, BLOCK_C)
    return (tl.program_id(0), tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J), tl.program_id(2) // n_cb,
            offs_c, offs_c < C2)


@triton.jit(do_not_specialize=["N", "M"])
def _gate_cf_kernel(Y, Mask, Out, N, M, C2: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_J: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """``Out[b, c, i, j] = sigmoid(Y[b, p, c]) * Y[b, p, C2 + c] * Mask[b, p]`` with ``p = i * N + j`` for i, j < N,
    0 for i or j in [N, M): ``Y [B, N*N, 2*C2]`` channels-last, ``Out [B, C2, M, M]`` channels-first (the
    compiler stages the tile through shared memory, so loads run along c and stores along j). Grid (M,
    cdiv(M, BLOCK_J), B * cdiv(C2, BLOCK_C))."""
    i, offs_j, b, offs_c, c_ok = _gate_tile(C2, BLOCK_J, BLOCK_C)
    in_ok = offs_j < tl.where(i < N, N, 0)  # rows i >= N: padding
    p = (b.to(tl.int64) * N + i) * N + offs_j
    ok = in_ok[:, None] & c_ok[None, :]
    rows = Y + p[:, None] * (2 * C2) + offs_c[None, :]
    v = tl.sigmoid(tl.load(rows, mask=ok, other=0.0).to(tl.float32)) * \
        tl.load(rows + C2, mask=ok, other=0.0).to(tl.float32)  # 0 outside [N, N]
    if HAS_MASK:
        v = v * tl.load(Mask + p, mask=in_ok, other=0.0).to(tl.float32)[:, None]
    out = Out + ((b * C2 + offs_c[None, :]).to(tl.int64) * M + i) * M + offs_j[:, None]
    tl.store(out, v.to(Out.dtype.element_ty), mask=(offs_j[:, None] < M) & c_ok[None, :])


@triton.jit(do_not_specialize=["N", "M"])
def _gate_cf_bwd_kernel(Y, Mask, GOut, DY, N, M, C2: tl.constexpr, HAS_MASK: tl.constexpr,
                        BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr):
    """The gradient of :func:`_gate_cf_kernel`: ``DY [B, N*N, 2*C2]`` channels-last (gate's, then proj's) from
    ``GOut [B, C2, M, M]`` contiguous. Grid (N, cdiv(N, BLOCK_J), B * cdiv(C2, BLOCK_C))."""
    i, offs_j, b, offs_c, c_ok = _gate_tile(C2, BLOCK_J, BLOCK_C)
    j_ok = offs_j < N
    p = (b.to(tl.int64) * N + i) * N + offs_j
    ok = j_ok[:, None] & c_ok[None, :]
    go = tl.load(GOut + ((b * C2 + offs_c[None, :]).to(tl.int64) * M + i) * M + offs_j[:, None], mask=ok,
                 other=0.0).to(tl.float32)
    if HAS_MASK:
        go = go * tl.load(Mask + p, mask=j_ok, other=0.0).to(tl.float32)[:, None]
    rows = p[:, None] * (2 * C2) + offs_c[None, :]
    s = tl.sigmoid(tl.load(Y + rows, mask=ok, other=0.0).to(tl.float32))
    proj = tl.load(Y + rows + C2, mask=ok, other=0.0).to(tl.float32)
    tl.store(DY + rows, (go * proj * s * (1.0 - s)).to(DY.dtype.element_ty), mask=ok)
    tl.store(DY + rows + C2, (go * s).to(DY.dtype.element_ty), mask=ok)
