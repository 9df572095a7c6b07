"""Plans, launchers and autograd of the blocks' layer-norm and gating kernels (the kernels themselves:
``attn_ops/triton/norms.py``), each with a PyTorch fallback.

``layer_norm_rows`` normalises the rows of a pair chunk in one pass whatever its layout: a row chunk (contiguous),
a column chunk ``z[:, J]`` (strided rows) or a channels-first matmul output ``[C, M]`` (the channel stride is the
large one), writing a contiguous channels-last result. PyTorch's layer norm needs a contiguous input (a transposing
copy first) and runs one thread block per row, which is slow for the 64-384 channels of pair tensors.

``layer_norm`` is the same forward with a backward (training): the blocks' ``LayerNorm`` takes it on CUDA in eager
mode. Its input gradient is written in the input's own layout, so a transposed or channels-last view (the ending
node's pair, the triangle multiplication's product) hands its producer a gradient of the producer's layout.
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import nn

from attn_ops.settings import interpreting as _interpreting

Tensor = torch.Tensor

try:
    import triton

    from attn_ops.triton.launch import launch_kernel as _fast_launch  # direct launches of compiled kernels
    from attn_ops.triton.launch import sm_count as _cuda_sm_count
    from attn_ops.triton.norms import (_gate_cf_bwd_kernel, _gate_cf_kernel, _layer_norm_bwd_kernel,
                                       _layer_norm_kernel)
    from attn_ops.triton.rotary import _rotary_bwd_kernel, _rotary_kernel
except ImportError:  # pragma: no cover - triton is a dependency; the fallback keeps CPU-only installs working
    triton = None


def _as_3d(x: Tensor, channels_first: bool):
    """(A, B, C, sa, sb, sc) of ``x`` read as rows ``[A, B]`` of C channels, or None if no such view exists."""
    if channels_first:  # [C, *rows]: the rows must flatten to one stride-1 dimension
        if x.dim() < 2:
            return None
        rows = x[0]
        if not rows.is_contiguous():
            return None
        return 1, rows.numel(), x.shape[0], 0, 1, x.stride(0)
    if x.dim() == 1:
        return 1, 1, x.shape[0], 0, 0, x.stride(0)
    lead = x.shape[:-1]
    # merge the leading dims into at most two strided ones (a column chunk [N, R, C] keeps two)
    dims = [(s, st) for s, st in zip(lead, x.stride()[:-1]) if s != 1]
    merged: list = []
    for s, st in reversed(dims):
        if merged and merged[0][1] * merged[0][0] == st:
            merged[0] = (merged[0][0] * s, merged[0][1])
        else:
            merged.insert(0, (s, st))
    if len(merged) > 2:
        return None
    while len(merged) < 2:
        merged.insert(0, (1, 0))
    (a, sa), (b, sb) = merged
    return a, b, x.shape[-1], sa, sb, x.stride(-1)


def layer_norm_rows(x: Tensor, norm: nn.LayerNorm, channels_first: bool = False,
                    out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``norm(x)`` (a last-dim LayerNorm), or with ``channels_first`` of ``x [C, *rows]`` moved to channels-last:
    a contiguous ``[*rows, C]``. ``out_dtype`` defaults to the autocast dtype under autocast, else x's.

    Triton on CUDA (any row strides, one pass, float32 statistics); elsewhere the module itself."""
    dev = x.device.type
    if out_dtype is None:
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    rows_shape = x.shape[1:] if channels_first else x.shape[:-1]
    view = _as_3d(x, channels_first) if triton is not None and dev == "cuda" and not _interpreting() else None
    if view is None or not isinstance(norm, nn.LayerNorm) or tuple(norm.normalized_shape) != (view[2],):
        y = norm(x.movedim(0, -1) if channels_first else x)
        return y.to(out_dtype).contiguous()
    return _launch(x, norm, view, rows_shape, out_dtype)


def _launch(x: Tensor, norm: nn.LayerNorm, view, rows_shape, out_dtype: torch.dtype) -> Tensor:
    y = torch.empty(*rows_shape, view[2], dtype=out_dtype, device=x.device)
    if view[0] * view[1] == 0:
        return y
    _forward(x, norm.weight, norm.bias, norm.eps, _make_plan(view, x.device), y)
    return y


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # (triton.cdiv is a jit-wrapped function: microseconds per call on the host path)


def _forward(x: Tensor, weight, bias, eps: float, plan: "_Plan", y: Tensor, mean: Optional[Tensor] = None,
             rstd: Optional[Tensor] = None) -> None:
    """Launch the forward kernel over the rows of ``plan.view`` (``_as_3d(x)``) into ``y``; with ``mean`` and
    ``rstd``, each row's statistics too (what the backward reads)."""
    a, b, c, sa, sb, sc = plan.view
    stats = mean is not None
    _fast_launch(_layer_norm_kernel, (_cdiv(a * b, plan.block_m),),
                 (x, weight if weight is not None else x, bias if bias is not None else x, y,
                  mean if stats else y, rstd if stats else y, a * b, b, c, sa, sb, sc, eps), 4, 3,
                 HAS_W=weight is not None, HAS_B=bias is not None, STATS=stats, ALIGN=plan.align,
                 BLOCK_M=plan.block_m, BLOCK_C=plan.block_c)


def _align(*strides: int) -> int:
    """The largest power of two, at most 16, dividing every stride (0 and 1-sized dims' strides count as any)."""
    g = 0
    for s in strides:
        g = math.gcd(g, s)
    return 16 if g == 0 else min(16, g & -g)


def _tiles(c: int):
    """(BLOCK_C, BLOCK_M) of the layer norm kernels for ``c`` channels: about 4096 elements per tile."""
    block_c = 1 << max(0, c - 1).bit_length()  # next power of two
    return block_c, max(1, min(64, 4096 // block_c))


class _Plan(NamedTuple):
    """What a layer norm launch needs beyond the tensors, worked out once per input shape and strides: the row
    view (``_as_3d``), its alignment, the tiles, and the backward's programs and rows per program (a multiple of
    ``block_m``)."""

    view: tuple
    align: int
    block_c: int
    block_m: int
    programs: int
    rows: int


def _make_plan(view, device: torch.device) -> _Plan:
    a, b, c, sa, sb, _ = view
    m = a * b
    block_c, block_m = _tiles(c)
    programs = max(1, min(_cdiv(m, block_m), 8 * _sm_count(device)))
    rows = max(block_m, _cdiv(_cdiv(m, programs), block_m) * block_m)
    return _Plan(view, _align(sa, sb), block_c, block_m, max(1, _cdiv(m, rows)), rows)


# (shape, strides, device index) -> _Plan, or None where no row view exists; the training layer norm's host path
_PLANS: dict = {}
_PLANS_MAX = 4096


def _plan(x: Tensor) -> Optional[_Plan]:
    key = (x.shape, x.stride(), x.get_device())
    try:
        return _PLANS[key]
    except KeyError:
        pass
    view = _as_3d(x, False)
    plan = None if view is None else _make_plan(view, x.device)
    if len(_PLANS) >= _PLANS_MAX:  # many shapes seen: start over
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


class _LayerNorm(torch.autograd.Function):
    """``layer_norm`` with float32 statistics, the output in ``out_dtype`` (contiguous ``[*rows, C]``) and the input
    gradient in the input's layout (see the module docstring); ``plan`` is ``_plan(x)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, out_dtype: torch.dtype, plan: _Plan):
        view = plan.view
        m = view[0] * view[1]
        y = torch.empty(*x.shape[:-1], view[2], dtype=out_dtype, device=x.device)
        # each row's mean and 1/std; rows padded to 4 keep both 16-byte aligned (no second compiled variant)
        stats = torch.empty(2, _cdiv(m, 4) * 4, dtype=torch.float32, device=x.device)
        if m:
            _forward(x, weight, bias, eps, plan, y, stats[0], stats[1])
        ctx.save_for_backward(x, weight, stats)
        ctx.plan, ctx.bias_dtype = plan, None if bias is None else bias.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # a double backward raises instead of dropping terms
    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        plan = ctx.plan
        a, b, c, sa, sb, sc = plan.view
        m = a * b
        dy = dy.contiguous()
        dx = torch.empty_like(x)  # a dense view (transposed, channels-last) keeps its strides: so does its gradient
        if dx.stride() == x.stride():
            strides, align_dx = (sa, sb, sc), plan.align
        else:  # a view with gaps (a slice): a contiguous gradient, rows in the same order
            dx, strides = torch.empty(x.shape, dtype=x.dtype, device=x.device), (b * c, c, 1)
            align_dx = _align(b * c, c)
        partials = torch.empty(2, plan.programs, c, dtype=torch.float32, device=x.device)  # one row per program
        if m:
            _fast_launch(_layer_norm_bwd_kernel, (plan.programs,),
                         (x, weight if weight is not None else x, dy, dx, stats[0], stats[1], partials[0],
                          partials[1], m, b, c, sa, sb, sc, *strides, plan.rows), 4, 3, HAS_W=weight is not None,
                         ALIGN=plan.align, ALIGN_DX=align_dx, BLOCK_M=plan.block_m, BLOCK_C=plan.block_c)
        else:
            partials.zero_()
        sums = partials.sum(1)  # [2, C]: a fixed order, the same bits every run
        gw = None if weight is None else sums[0].to(weight.dtype)
        gb = None if ctx.bias_dtype is None else sums[1].to(ctx.bias_dtype)
        return dx, gw, gb, None, None, None


# The blocks' LayerNorm takes the kernels from this many rows (pair tensors of N >= 512): below it the eager step is
# host-bound and the module's cheaper launch did as well (docs/bench/history.md).
LAYER_NORM_MIN_ROWS = 1 << 18
# ... and at any size for a view that is not contiguous: they read it in place where PyTorch's layer norm copies it.
LAYER_NORM_STRIDED = True
# the 16- and 32-bit floats: the kernels' dtypes (float64 keeps the module's exact path), and the ones autocast casts
FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# Inside :func:`device_bound` (CUDA graph captures: a replay has no host time) the LayerNorm kernels and the linear-bias
# gradient by matmul serve from this many rows: they took 18% less device time off an N=384 Pairformer step there,
# 14.4 -> 11.9 ms (history.md 2026-11-27)
DEVICE_BOUND_MIN_ROWS = 1 << 16
# process-wide, not per thread: a capture's backward (and an activation checkpoint's recompute in it) runs on
# autograd's device threads, which must choose as the forward chose
_DEVICE_BOUND = [0]


@contextlib.contextmanager
def device_bound():
    """Inside the block the blocks pick their kernels for the least device time whatever their host time: what a
    CUDA graph capture (``models.graphs.CUDAGraphs``) wants, whose replays run no host code. Its warm-up calls and
    the capture both run inside, so they take the same kernels. Process-wide while it lasts (autograd's threads
    see it too): eager work in other threads meanwhile also takes those kernels (the same math)."""
    _DEVICE_BOUND[0] += 1
    try:
        yield
    finally:
        _DEVICE_BOUND[0] -= 1


def min_rows(eager_rows: int) -> int:
    """The row count from which a kernel chosen for its device time serves: ``eager_rows`` (a threshold set for
    host-bound eager steps), or :data:`DEVICE_BOUND_MIN_ROWS` where lower inside :func:`device_bound`."""
    return min(eager_rows, DEVICE_BOUND_MIN_ROWS) if _DEVICE_BOUND[0] else eager_rows


def _sm_count(device: torch.device) -> int:
    return _cuda_sm_count(device) if device.type == "cuda" else 4  # the CPU interpreter: a few programs


def eager_first_order() -> bool:
    """Whether a first-order custom autograd Function (these layer norm kernels, the blocks' bias-gradient linear)
    may stand in for PyTorch's ops: eager mode, no functorch transform, no forward-mode AD. Checked first by its
    callers: under ``torch.compile`` nothing after it may turn into a guard."""
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active() or
                _forward_ad._current_level >= 0)


def layer_norm(x: Tensor, norm: nn.LayerNorm, out_dtype: torch.dtype, force: bool = False) -> Optional[Tensor]:
    """``norm(x)`` in ``out_dtype`` with a backward, by the Triton kernels: on CUDA in eager mode (``force``: on any
    device, the CPU interpreter in tests); None where they do not apply (the caller runs the module): other
    devices, ``torch.compile`` (Inductor fuses its own), functorch transforms and forward-mode AD (the kernels are
    first-order: a double backward raises), a view of more than two strided row dims, a norm over more than the last
    dim."""
    if not eager_first_order() or triton is None or \
            not (force or (x.device.type == "cuda" and not _interpreting())) or \
            len(norm.normalized_shape) != 1 or x.dim() == 0 or x.shape[-1] != norm.normalized_shape[0] or \
            x.dtype not in FLOATS or out_dtype not in FLOATS:
        return None
    plan = _plan(x)
    if plan is None:
        return None
    return _LayerNorm.apply(x, norm.weight, norm.bias, norm.eps, out_dtype, plan)


_GATE_TILE = (64, 32)  # (BLOCK_J, BLOCK_C): 2048 elements a program


class _GateChannelsFirst(torch.autograd.Function):
    """:func:`gate_channels_first` on the Triton kernels (first order)."""

    @staticmethod
    def forward(ctx, y: Tensor, mask: Optional[Tensor], n: int, m: int) -> Tensor:
        bsz, c2 = y.shape[0], y.shape[-1] // 2
        out = torch.empty(bsz, c2, m, m, dtype=y.dtype, device=y.device)
        bj, bc = _GATE_TILE
        _fast_launch(_gate_cf_kernel, (m, _cdiv(m, bj), bsz * _cdiv(c2, bc)),
                     (y, y if mask is None else mask, out, n, m), 4, 1, C2=c2, HAS_MASK=mask is not None, BLOCK_J=bj,
                     BLOCK_C=bc)
        ctx.save_for_backward(y, mask)
        ctx.nm = n, m
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        y, mask = ctx.saved_tensors
        n, m = ctx.nm
        bsz, c2 = y.shape[0], y.shape[-1] // 2
        grad = grad.contiguous()
        dy = torch.empty_like(y)
        bj, bc = _GATE_TILE
        _fast_launch(_gate_cf_bwd_kernel, (n, _cdiv(n, bj), bsz * _cdiv(c2, bc)),
                     (y, y if mask is None else mask, grad, dy, n, m), 4, 1, C2=c2, HAS_MASK=mask is not None,
                     BLOCK_J=bj, BLOCK_C=bc)
        return dy, None, None, None


def use_gate_kernel(t: Tensor, force: bool = False) -> bool:
    """Whether :func:`gate_channels_first` runs for tensors like ``t``: CUDA in eager mode (``force``: any device,
    the CPU interpreter in tests), not under torch.compile (Inductor fuses its own), functorch transforms or
    forward-mode AD (the kernels are first order), a floating dtype."""
    return eager_first_order() and triton is not None and (force or (t.device.type == "cuda" and not _interpreting())) \
        and t.dtype in FLOATS


def gate_channels_first(y: Tensor, mask: Optional[Tensor], n: int, m: int) -> Tensor:
    """``sigmoid(gate) * proj * mask`` of ``y = [gate | proj] [B, N*N, 2*C2]`` (channels-last, contiguous; ``mask
    [B, N*N]`` contiguous, or None), transposed to channels-first ``[B, C2, M, M]`` with zeros past ``N`` (``M >= N``:
    the triangle product's operands, rows padded to a multiple of 8 elements), in one pass each way where PyTorch
    runs three elementwise passes, a transposing copy and a padding copy. Where :func:`use_gate_kernel` says so."""
    bsz, c4 = y.shape[0], y.shape[-1]
    if y.dim() != 3 or y.shape[1] != n * n or c4 % 2 or m < n or not y.is_contiguous():
        raise ValueError(f"gate_channels_first: y must be a contiguous [B, N*N, 2*C2] tensor with n={n} <= m={m}; got "
                         f"shape {tuple(y.shape)}, strides {y.stride()}")
    if mask is not None and (mask.shape != (bsz, n * n) or not mask.is_contiguous()):
        raise ValueError(f"gate_channels_first: mask must be a contiguous [B, N*N] = [{bsz}, {n * n}] tensor; got "
                         f"shape {tuple(mask.shape)}, strides {mask.stride()}")
    return _GateChannelsFirst.apply(y, mask, n, m)


# --------------------------------------------------------------------------------------------------
# Rotary embedding of q and k (with ESM C's layer norm over the width first), the kernels of
# attn_ops/triton/rotary.py: one launch for both, float32 inside, one write in the attention's dtype.
# --------------------------------------------------------------------------------------------------
def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_qk_reference(x: Tensor, cos: Tensor, sin: Tensor, heads: int, weight: Optional[Tensor] = None,
                        eps: float = 1e-5, scales: Tuple[float, ...] = (1.0, 1.0),
                        out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """:func:`rotary_qk` in PyTorch ops (CPU, ``torch.compile``, the kernels' reference)."""
    G, C = x.shape[-2:]
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if weight is not None:
        xf = nn.functional.layer_norm(xf, (C,), eps=eps) * weight.float()  # [B, L, G, C]
    xh = xf.unflatten(-1, (heads, C // heads))  # [B, L, G, H, D]
    c, s = cos[..., None, None, :], sin[..., None, None, :]  # [*, L, 1, 1, D]
    y = xh * c + _rotate_half(xh) * s
    if any(v != 1.0 for v in scales[:G]):
        y = y * torch.tensor(scales[:G], dtype=y.dtype, device=x.device)[:, None, None]
    return y.flatten(-2).movedim(-2, 0).to(out_dtype or x.dtype)  # [G, B, L, C]


def _launch_rotary(x: Tensor, cos: Tensor, sin: Tensor, weight: Optional[Tensor], eps: float, s0: float, s1: float,
                   heads: int, outs: Tuple[Tensor, Tensor, Tensor], stats: Tensor, groups: int) -> None:
    """The forward kernel on x ``[B, L, *, C]`` (last dim contiguous): ``groups`` programs per row block (G rotated
    groups, one more copies group G into ``outs[2]``), the rotated groups into ``outs[0]``/``outs[1]``."""
    B, L, _, C = x.shape
    M = B * L
    if not M:
        return
    block_c, block_m = _tiles(C)  # the layer norm kernels' tiles: about 4096 elements
    norm = weight is not None
    _fast_launch(_rotary_kernel, (_cdiv(M, block_m), groups),
                 (x, weight if norm else x, cos, sin, *outs, stats if norm else outs[0], M, L, x.stride(0),
                  x.stride(1), x.stride(2), cos.stride(0) if cos.dim() == 3 else 0, eps, s0, s1), 4, 1, C=C,
                 D=C // heads, G=min(groups, 2), NORM=norm, BLOCK_M=block_m, BLOCK_C=block_c)


def _launch_rotary_bwd(x: Tensor, weight: Optional[Tensor], cos: Tensor, sin: Tensor, stats: Tensor, s0: float,
                       s1: float, heads: int, grads: Tuple[Tensor, Tensor, Tensor], dx: Tensor, pad: int,
                       groups: int) -> Optional[Tensor]:
    """The backward kernel: group g's gradient into columns ``[g C, (g + 1) C)`` of ``dx`` ``[B, L, width]`` (one
    more group copies ``grads[2]``, then ``pad`` zero columns); returns the norm weight's gradient ``[G, C]``."""
    B, L, _, C = x.shape
    M = B * L
    G = min(groups, 2)
    norm = weight is not None
    plan = _make_plan((M, 1, C, C, C, 1), x.device)  # the layer norm backward's programs and rows each
    programs, rows = plan.programs, plan.rows
    dw = torch.empty(G, programs, C, dtype=torch.float32, device=x.device) if norm else dx
    block_c, block_m = _tiles(C)
    if M:
        sx = x.stride() if norm else (0, 0, 0, 1)
        _fast_launch(_rotary_bwd_kernel, (programs, groups),
                     (x if norm else dx, weight if norm else dx, cos, sin, *grads, dx, stats if norm else dx, dw, M,
                      L, sx[0], sx[1], sx[2], cos.stride(0) if cos.dim() == 3 else 0, dx.stride(0), dx.stride(1),
                      rows, s0, s1), 4, 1, C=C, D=C // heads, G=G, NORM=norm, PAD=pad, BLOCK_M=block_m,
                     BLOCK_C=block_c)
    elif norm:
        dw.zero_()
    return dw.sum(1).to(weight.dtype) if norm else None  # [G, C] summed in a fixed order: the same bits every run


def _rotary_fwd(x: Tensor, cos: Tensor, sin: Tensor, weight: Optional[Tensor], eps: float, s0: float, s1: float,
                heads: int, out_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """:func:`rotary_qk`'s launch: ``[G, B, L, C]`` in ``out_dtype`` and the layer norm's float32 statistics
    ``[G, 2, B*L]`` (empty without ``weight``)."""
    B, L, G, C = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()  # (the kernel reads the last dim as contiguous)
    y = torch.empty(G, B, L, C, dtype=out_dtype, device=x.device)
    stats = torch.empty(G, 2, B * L if weight is not None else 0, dtype=torch.float32, device=x.device)
    _launch_rotary(x, cos, sin, weight, eps, s0, s1, heads, (y[0], y[G - 1], y[0]), stats, G)
    return y, stats


def _rotary_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], cos: Tensor, sin: Tensor, stats: Tensor, s0: float,
                s1: float, heads: int) -> Tuple[Tensor, Tensor]:
    """:func:`rotary_qk`'s backward launch: dx ``[B, L, G, C]`` in x's dtype and the weight's gradient ``[G, C]``
    (empty without ``weight``). Only x's shape and dtype are read without ``weight``."""
    B, L, G, C = x.shape
    dy = dy.contiguous()
    if weight is not None and x.stride(-1) != 1:
        x = x.contiguous()
    dx = torch.empty(B, L, G, C, dtype=x.dtype, device=dy.device)
    gw = _launch_rotary_bwd(x, weight, cos, sin, stats, s0, s1, heads, (dy[0], dy[G - 1], dy[0]), dx.flatten(2), 0, G)
    return dx, (dy.new_empty((0,)) if gw is None else gw)


def _qkv_view(y: Tensor, C: int) -> Tensor:
    return y[..., : 3 * C].unflatten(-1, (3, C))  # [B, L, 3, C]: q, k, v of the fused projection


def _rotary_qkv_fwd(y: Tensor, cos: Tensor, sin: Tensor, s0: float, s1: float, heads: int,
                    C: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`rotary_qkv`'s launch: q, k (rotated) and v (copied), each ``[B, L, C]`` contiguous in y's dtype."""
    B, L = y.shape[:2]
    y = y if y.stride(-1) == 1 else y.contiguous()
    q, k, v = (torch.empty(B, L, C, dtype=y.dtype, device=y.device) for _ in range(3))
    _launch_rotary(_qkv_view(y, C), cos, sin, None, 0.0, s0, s1, heads, (q, k, v), q, 3)
    return q, k, v


def _fused_grad(B: int, L: int, width: int, l_major: bool, like: Tensor) -> Tensor:
    """The fused projection's gradient buffer ``[B, L, width]``, stored L-major (``[L, B, width]`` transposed:
    fair-esm's time-first layout) where the projection was."""
    if l_major:
        return torch.empty(L, B, width, dtype=like.dtype, device=like.device).transpose(0, 1)
    return torch.empty(B, L, width, dtype=like.dtype, device=like.device)


def _rotary_qkv_bwd(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor, s0: float, s1: float, heads: int,
                    width: int, l_major: bool) -> Tensor:
    """:func:`rotary_qkv`'s backward launch: the fused projection's gradient ``[B, L, width]`` in v's dtype (L-major
    with ``l_major``; zeros past 3C) in one pass."""
    B, L, C = dq.shape
    dy = _fused_grad(B, L, width, l_major, dv)
    _launch_rotary_bwd(dv.new_empty(()).expand(B, L, 3, C), None, cos, sin, dy, s0, s1, heads,
                       tuple(t.contiguous() for t in (dq, dk, dv)), dy, width - 3 * C, 3)
    return dy


# The launches as custom ops for torch.compile: Inductor's own fusion of the reference moves the rotated q/k through
# a transposing layout and ran about 3x the kernels' time on ESM-2 650M (docs/bench/esm2_h200.md).
rotary_qk_fwd = torch.library.custom_op("attn_zoo::rotary_qk_fwd", _rotary_fwd, mutates_args=())
rotary_qk_bwd = torch.library.custom_op("attn_zoo::rotary_qk_bwd", _rotary_bwd, mutates_args=())
rotary_qkv_fwd = torch.library.custom_op("attn_zoo::rotary_qkv_fwd", _rotary_qkv_fwd, mutates_args=())
rotary_qkv_bwd = torch.library.custom_op("attn_zoo::rotary_qkv_bwd", _rotary_qkv_bwd, mutates_args=())


def _stats_like(t: Tensor, G: int, M: int, norm: bool) -> Tensor:
    return t.new_empty((G, 2, M if norm else 0), dtype=torch.float32)


@rotary_qk_fwd.register_fake
def _(x, cos, sin, weight, eps, s0, s1, heads, out_dtype):
    B, L, G, C = x.shape
    return x.new_empty((G, B, L, C), dtype=out_dtype), _stats_like(x, G, B * L, weight is not None)


@rotary_qk_bwd.register_fake
def _(dy, x, weight, cos, sin, stats, s0, s1, heads):
    return torch.empty(x.shape, dtype=x.dtype, device=dy.device), (
        weight.new_empty(weight.shape) if weight is not None else dy.new_empty((0,)))


@rotary_qkv_fwd.register_fake
def _(y, cos, sin, s0, s1, heads, C):
    return tuple(y.new_empty((*y.shape[:2], C)) for _ in range(3))


@rotary_qkv_bwd.register_fake
def _(dq, dk, dv, cos, sin, s0, s1, heads, width, l_major):
    return _fused_grad(*dq.shape[:2], width, l_major, dv)


def _rotary_setup(ctx, inputs, output):
    x, cos, sin, weight, eps, s0, s1, heads, out_dtype = inputs
    # without a norm the backward reads only x's shape and dtype: an empty stand-in keeps x's memory free
    ctx.save_for_backward(x if weight is not None else x.new_empty(()).expand(x.shape), weight, cos, sin, output[1])
    ctx.consts = s0, s1, heads
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # (no zeros buffer for the statistics' gradient)


def _rotary_grads(ctx, dy, dstats, run):
    x, weight, cos, sin, stats = ctx.saved_tensors
    if dy is None:  # nothing used the rotated q/k
        return (None,) * 9
    dx, gw = run(dy, x, weight, cos, sin, stats, *ctx.consts)
    return dx, None, None, (gw if weight is not None else None), None, None, None, None, None


def _rotary_qkv_setup(ctx, inputs, output):
    y, cos, sin, s0, s1, heads, C = inputs
    ctx.save_for_backward(cos, sin)  # (not y: its gradient's layout is all the backward needs of it)
    ctx.consts = s0, s1, heads, y.shape[-1], y.shape[0] > 1 and y.stride(0) < y.stride(1)
    ctx.zeros = output[0].shape, output[0].dtype  # (for an output that gets no gradient)
    ctx.set_materialize_grads(False)


def _rotary_qkv_grads(ctx, dq, dk, dv, run):
    cos, sin = ctx.saved_tensors
    if dq is None and dk is None and dv is None:  # nothing used q, k or v
        return (None,) * 7
    shape, dtype = ctx.zeros
    dq, dk, dv = (torch.zeros(shape, dtype=dtype, device=cos.device) if t is None else t for t in (dq, dk, dv))
    return (run(dq, dk, dv, cos, sin, *ctx.consts),) + (None,) * 6


torch.library.register_autograd(
    "attn_zoo::rotary_qk_fwd", lambda ctx, dy, dstats: _rotary_grads(ctx, dy, dstats, torch.ops.attn_zoo.rotary_qk_bwd),
    setup_context=_rotary_setup)
torch.library.register_autograd(
    "attn_zoo::rotary_qkv_fwd",
    lambda ctx, dq, dk, dv: _rotary_qkv_grads(ctx, dq, dk, dv, torch.ops.attn_zoo.rotary_qkv_bwd),
    setup_context=_rotary_qkv_setup)


class _RotaryQK(torch.autograd.Function):
    """The eager path of :func:`rotary_qk`: the custom op's bodies without its dispatch (first order)."""

    forward = staticmethod(_rotary_fwd)
    setup_context = staticmethod(_rotary_setup)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dstats):
        return _rotary_grads(ctx, dy, dstats, _rotary_bwd)


class _RotaryQKV(torch.autograd.Function):
    """The eager path of :func:`rotary_qkv` (first order)."""

    forward = staticmethod(_rotary_qkv_fwd)
    setup_context = staticmethod(_rotary_qkv_setup)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk, dv):
        return _rotary_qkv_grads(ctx, dq, dk, dv, _rotary_qkv_bwd)


def _check_rotary(x: Tensor, cos: Tensor, sin: Tensor, heads: int, weight: Optional[Tensor], name: str) -> None:
    """ValueError naming the argument where x ``[B, L, G, C]``, the tables or the norm weight do not fit."""
    if x.dim() != 4 or x.shape[-1] % heads or (x.shape[-1] // heads) % 2:
        raise ValueError(f"{name}: x must be [B, L, G, C] with C divisible by heads={heads} into an even head "
                         f"dim, got {tuple(x.shape)}")
    B, L, G, C = x.shape
    if cos.shape != sin.shape or cos.shape[-2:] != (L, C // heads) or cos.dim() not in (2, 3) or \
            (cos.dim() == 3 and cos.shape[0] != B):
        raise ValueError(f"{name}: cos and sin must be [L, D] or [B, L, D] = [{L}, {C // heads}] or "
                         f"[{B}, {L}, {C // heads}] for x {tuple(x.shape)}, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if weight is not None and weight.shape != (G, C):
        raise ValueError(f"{name}: weight must be [G, C] = [{G}, {C}], got {tuple(weight.shape)}")


def _rotary_route(x: Tensor, cos: Tensor, sin: Tensor, force: bool) -> Optional[str]:
    """Where the rotary kernels serve ``x`` and its tables: "eager" (the autograd Function: eager mode, a contiguous
    last dim), "compiled" (the custom ops, under torch.compile) or None (the PyTorch reference: no Triton, another
    device unless ``force``, a dtype the kernels do not take, strided tables, functorch transforms, forward-mode
    AD)."""
    if triton is None or not (force or (x.device.type == "cuda" and not _interpreting())) or x.dtype not in FLOATS \
            or not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()):
        return None
    if eager_first_order():
        return "eager" if x.stride(-1) == 1 else None
    if torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active() and \
            _forward_ad._current_level < 0:
        return "compiled"  # (a view with a strided last dim is copied inside)
    return None


def _scales(scales: Tuple[float, ...]) -> Tuple[float, float]:
    return tuple(float(v) for v in (tuple(scales) + (1.0, 1.0))[:2])


def rotary_qk(x: Tensor, cos: Tensor, sin: Tensor, heads: int, weight: Optional[Tensor] = None, eps: float = 1e-5,
              scales: Tuple[float, ...] = (1.0, 1.0), out_dtype: Optional[torch.dtype] = None,
              force: bool = False) -> Tensor:
    """Rotary embedding (``rotate_half``: channel i and i + D/2 of each head) of the ``G`` groups of ``x``
    ``[B, L, G, C]`` (q and k of one fused projection: a view, last dim contiguous), each scaled by ``scales[g]``
    after the rotation; with ``weight`` ``[G, C]``, a layer norm over C (no bias, float32 statistics) first.
    ``cos, sin``: float32 ``[L, D]`` (or ``[B, L, D]``: per-row positions) built as ``cat(freqs, freqs)``.
    Returns ``[G, B, L, C]`` contiguous in ``out_dtype`` (default ``x.dtype``).

    On CUDA one Triton launch forward and one backward (float32 inside, one write), replacing a dozen PyTorch ops
    per tensor: in eager mode an autograd Function, under ``torch.compile`` the custom ops ``attn_zoo::rotary_qk_fwd``
    / ``_bwd`` around the same launches; ``force`` runs the kernels on any device (the CPU interpreter in tests).
    Elsewhere (functorch transforms, forward-mode AD, more than two groups, a layout or dtype they do not take):
    :func:`rotary_qk_reference`."""
    out_dtype = out_dtype or x.dtype
    _check_rotary(x, cos, sin, heads, weight, "rotary_qk")
    route = _rotary_route(x, cos, sin, force) if x.shape[2] <= 2 and out_dtype in FLOATS and (
        weight is None or weight.is_contiguous()) else None  # (the kernels write two groups)
    args = (x, cos, sin, weight, float(eps), *_scales(scales), int(heads), out_dtype)
    if route == "eager":
        return _RotaryQK.apply(*args)[0]
    if route == "compiled":
        return torch.ops.attn_zoo.rotary_qk_fwd(*args)[0]
    return rotary_qk_reference(x, cos, sin, heads, weight, eps, scales, out_dtype)


def rotary_qkv(y: Tensor, C: int, cos: Tensor, sin: Tensor, heads: int, weight: Optional[Tensor] = None,
               eps: float = 1e-5, scales: Tuple[float, ...] = (1.0, 1.0), force: bool = False
               ) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``[B, L, C]`` of a fused projection ``y`` ``[B, L, W]`` (q, k, v in its first ``3C`` columns, at
    most 7 padding columns after them): q and k as :func:`rotary_qk` gives them (in y's dtype), v as it is.

    Without a norm ``weight``, where :func:`rotary_qk`'s kernels run (CUDA; ``force``: any device), one launch each
    way for all three: v copied by the forward's launch (so that ``y`` itself is freed after the forward), and the
    backward writes y's whole gradient (q's, k's and v's parts and the padding's zeros) in one pass, where autograd
    would stack q's and k's gradients, zero-fill and copy v's and concatenate them. Otherwise :func:`rotary_qk` on
    the view and v a view of ``y`` (with a norm its backward keeps ``y``: a copy of v would only add memory)."""
    if y.dim() != 3 or not 0 <= y.shape[-1] - 3 * C < 8:
        raise ValueError(f"rotary_qkv: y must be [B, L, 3 * C + pad] with C={C} and pad < 8, got {tuple(y.shape)}")
    qkv = _qkv_view(y, C)  # [B, L, 3, C]
    _check_rotary(qkv, cos, sin, heads, None, "rotary_qkv")
    if weight is None:
        route = _rotary_route(y, cos, sin, force)
        args = (y, cos, sin, *_scales(scales), int(heads), int(C))
        if route == "eager":
            return _RotaryQKV.apply(*args)
        if route == "compiled":
            return torch.ops.attn_zoo.rotary_qkv_fwd(*args)
    q, k = rotary_qk(qkv[:, :, :2], cos, sin, heads, weight, eps, scales, out_dtype=y.dtype, force=force)
    return q, k, qkv[:, :, 2]
