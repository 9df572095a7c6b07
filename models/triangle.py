"""Triangle updates of the pair representation, shared by the Evoformer and the Pairformer.

AlphaFold2 supplement Alg. 11-14 (AF3 Alg. 12-15 are the same up to biases):
``TriangleMultiplicationOutgoing/Incoming`` and ``TriangleAttentionStartingNode/EndingNode``.
Pair tensors are ``z [*, N_i, N_j, c_z]`` with ``pair_mask [*, N_i, N_j]`` bool, True = real pair.
Each module returns the residual update (the caller adds it, with dropout).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .kernels import gate_channels_first, use_gate_kernel
from .primitives import Attention, LayerNorm, Linear, chunk_rows

Tensor = torch.Tensor


class _ChannelsLast(torch.autograd.Function):
    """``x [*, C, I, J] -> [*, I, J, C]`` view whose gradient comes back contiguous channels-first.

    The triangle matmul's backward multiplies the incoming gradient as ``[*, C, I, J]`` matrices; the plain
    ``movedim`` would hand it a channels-last tensor, which the batched matmul copies once per operand with a
    slow strided kernel (docs/bench/history.md, "Design measurements"). One explicit copy here,
    which ``torch.compile`` turns into a tiled transpose, serves both matmuls.
    """

    generate_vmap_rule = True  # works under torch.func.vmap / grad too (forward and setup_context split)

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x.movedim(-3, -1)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass  # the backward needs nothing saved

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        # (clone, not contiguous(): asking whether a padded product's gradient is contiguous would guard a compiled
        # graph on the padding)
        return grad.movedim(-1, -3).clone(memory_format=torch.contiguous_format)


def gemm_pad(n: int, device: torch.device, symbolic: bool = False) -> Optional[int]:
    """Zeros to append to a length-``n`` side of the triangle product's ``[N, N]`` matrices so that their rows
    start 16 bytes apart (a multiple of 8 elements): on CUDA from N=64 (below, the products are launch-bound);
    ``symbolic`` (torch.compile): ``-n % 8`` at every N, no comparison that would guard a graph on N. None on
    other devices: the plain product.

    Rows whose length is not a multiple of 8 send the batched products to cuBLAS's unaligned kernels (and, under
    torch.compile, to strided copies around them), which cost more than the padding (docs/bench/history.md). The
    padded product does ``(N'/N)^3`` the arithmetic: at most 1.07x from N=300.
    """
    if device.type != "cuda":
        return None
    if symbolic:
        # The round-up form, not ``-n % 8``: with that Mod (or with no pad) Inductor's tiling analysis asserts at
        # the second, symbolic length a compiled block meets (docs/compile.md has the repro).
        return (n + 7) // 8 * 8 - n
    return -n % 8 if n >= 64 else 0


class TriangleMultiplication(nn.Module):
    """Triangular multiplicative update (AF2 Alg. 11 outgoing, Alg. 12 incoming).

    outgoing: ``x_ij = sum_k a_ik * b_jk``; incoming: ``x_ij = sum_k a_ki * b_kj``, with
    ``a, b = sigmoid(Linear_g(LN(z))) * Linear_p(LN(z))``, zeroed at masked pairs, and the update
    ``sigmoid(Linear(LN(z))) * Linear(LN(x))``.

    ``bias=False`` drops the biases of all four linears (Boltz-2, AF3 Alg. 12's LinearNoBias): the gates
    then start at ``sigmoid(0) = 0.5`` instead of ``sigmoid(1)``.
    """

    def __init__(self, c_z: int, c_hidden: int, outgoing: bool, bias: bool = True):
        super().__init__()
        self.outgoing = outgoing
        self.c_hidden = c_hidden
        gating = "gating" if bias else "final"  # weights 0 either way; "gating" needs a bias (set to 1)
        self.layer_norm_in = LayerNorm(c_z)
        self.linear_ab_p = Linear(c_z, 2 * c_hidden, bias=bias)  # a and b projections, [a | b]
        self.linear_ab_g = Linear(c_z, 2 * c_hidden, bias=bias, init=gating)
        self.layer_norm_out = LayerNorm(c_hidden)
        self.linear_z = Linear(c_hidden, c_z, bias=bias, init="final")
        self.linear_g = Linear(c_z, c_z, bias=bias, init=gating)

    def _gated_channels_first(self, zn: Tensor, pair_mask: Optional[Tensor], m: int = 0) -> Tensor:
        """``[a | b] = sigmoid(Linear_g(zn)) * Linear_p(zn)``, zeroed at masked pairs: ``[*, 2C, N, N]`` contiguous,
        or with ``m`` (the fused kernel's form only) ``[*, 2C, M, M]`` with zeros past N.

        Three forms of the same function, each the faster one where it runs (docs/bench/history.md, "Design
        measurements" and its 2026-11-27 entries):
        - under ``torch.compile``: one channels-last GEMM with the bias in its epilogue, then gate, mask and
          the transpose to channels-first as one fused pass;
        - eager CUDA: the same GEMM, then one Triton pass for the rest (``kernels.gate_channels_first``), which also
          writes the padding of the triangle product's operands;
        - eager elsewhere: one channels-first GEMM ``W @ zn^T`` (``baddbmm``, bias fused) and elementwise gating in
          that layout; the channels-last form would cost eager PyTorch a strided transpose copy each way.
        """
        w = torch.cat([self.linear_ab_g.weight, self.linear_ab_p.weight], dim=0)  # [4C, c_z]
        bias = None
        if self.linear_ab_p.bias is not None:
            bias = torch.cat([self.linear_ab_g.bias, self.linear_ab_p.bias], dim=0)  # [4C]
        c2 = 2 * self.c_hidden
        if m:
            lead, n = zn.shape[:-3], zn.shape[-2]
            y = nn.functional.linear(zn, w, bias)  # [*, N, N, 4C]
            # a mask broadcast over z's leading dims is expanded: the kernel reads one row per batch element
            mask = None if pair_mask is None else \
                pair_mask.to(y.dtype).expand(*lead, n, n).reshape(-1, n * n).contiguous()
            return gate_channels_first(y.reshape(-1, n * n, 2 * c2), mask, n, m).reshape(*lead, c2, m, m)
        if torch.compiler.is_compiling():
            gate, proj = nn.functional.linear(zn, w, bias).split(c2, dim=-1)  # [*, N, N, 2C] each
            ab = torch.sigmoid(gate) * proj  # [*, N, N, 2C]
            if pair_mask is not None:
                ab = ab * pair_mask.unsqueeze(-1).to(ab.dtype)
            return ab.movedim(-1, -3).contiguous()
        lead, n = zn.shape[:-3], zn.shape[-2]
        zt = zn.reshape(-1, n * n, zn.shape[-1]).transpose(-1, -2)  # [B', c_z, N*N]
        wb = w.expand(zt.shape[0], -1, -1)  # [B', 4C, c_z]
        y = torch.bmm(wb, zt) if bias is None else torch.baddbmm(bias[None, :, None], wb, zt)  # [B', 4C, N*N]
        # split, not two slices: the backward is one concatenation, not a zero-filled buffer per slice and a sum
        gate, proj = y.reshape(*lead, 2 * c2, n, n).split(c2, dim=-3)  # [*, 2C, N, N] each
        ab = torch.sigmoid(gate) * proj  # [*, 2C, N, N]
        if pair_mask is not None:
            ab = ab * pair_mask.unsqueeze(-3).to(ab.dtype)
        return ab

    def forward(self, z: Tensor, pair_mask: Optional[Tensor] = None, chunk_size: Optional[int] = None) -> Tensor:
        """z ``[*, N, N, c_z]``, pair_mask ``[*, N, N]`` bool -> update ``[*, N, N, c_z]``.

        ``chunk_size`` chunks the output stage over rows (inference memory).
        """
        zn = self.layer_norm_in(z)  # [*, N, N, c_z]
        n = zn.shape[-2]
        compiling = torch.compiler.is_compiling()
        # (a mask with more leading dims than z broadcasts z up: PyTorch's ops below handle that)
        fused = not compiling and use_gate_kernel(zn) and (pair_mask is None or pair_mask.dim() < zn.dim())
        # Zero rows and columns past N (rows of 16 bytes for cuBLAS; gemm_pad): the sums over k gain zeros, and x's
        # extra rows and columns are dropped again. Inductor writes them in the pass that makes ab; compiled, the pad
        # is taken whatever its value (0 included: a copy Inductor fuses), so symbolic lengths keep one graph. Eager
        # CUDA writes them in its gating kernel, for one leading element only (with more, x's slice has three strided
        # row dims: layer_norm_out would copy it). PyTorch's own eager ops would copy ab and x's gradient each way,
        # which costs more than the aligned products gain (docs/bench/history.md).
        pad = None  # None: the plain product
        if compiling:
            pad = gemm_pad(n, zn.device, symbolic=True)
        elif fused and zn.shape[:-3].numel() == 1:
            pad = gemm_pad(n, zn.device)
        padded = pad is not None and (compiling or pad > 0)
        m = n + pad if padded else n
        ab = self._gated_channels_first(zn, pair_mask, m if fused else 0)  # [*, 2C, N', N'] (compiled: N, N)
        if padded and not fused:
            ab = nn.functional.pad(ab, (0, pad, 0, pad))
        a, b = ab.split(self.c_hidden, dim=-3)  # [*, C, N', N'] each, contiguous
        if self.outgoing:
            x = torch.matmul(a, b.transpose(-1, -2))  # [*, C, I, J]: sum_k a[i, k] b[j, k]
        else:
            x = torch.matmul(a.transpose(-1, -2), b)  # [*, C, I, J]: sum_k a[k, i] b[k, j]
        if padded:
            x = x.narrow(-2, 0, n).narrow(-1, 0, n)  # (a slice would guard on whether it drops anything)
        g = self.linear_g(zn)  # [*, I, J, c_z]
        x = _ChannelsLast.apply(x)  # [*, I, J, C] view; its gradient comes back channels-first

        def out(x_rows: Tensor, g_rows: Tensor) -> Tensor:
            return self.linear_z(self.layer_norm_out(x_rows)) * torch.sigmoid(g_rows)

        return chunk_rows(out, [x, g], [-3, -3], chunk_size, out_dim=-3)


class TriangleMultiplicationOutgoing(TriangleMultiplication):
    """AF2 Alg. 11: ``x_ij = sum_k a_ik b_jk`` (edges leaving i and j)."""

    def __init__(self, c_z: int, c_hidden: int = 128, bias: bool = True):
        super().__init__(c_z, c_hidden, outgoing=True, bias=bias)


class TriangleMultiplicationIncoming(TriangleMultiplication):
    """AF2 Alg. 12: ``x_ij = sum_k a_ki b_kj`` (edges arriving at i and j)."""

    def __init__(self, c_z: int, c_hidden: int = 128, bias: bool = True):
        super().__init__(c_z, c_hidden, outgoing=False, bias=bias)


class TriangleAttention(nn.Module):
    """Triangle self-attention around the starting node (AF2 Alg. 13) or the ending node (Alg. 14).

    Starting node: row i of the pair tensor attends along j, query ij to key ik, with the bias
    ``b_jk = Linear(LN(z_jk))`` shared by every row (passed as ``[*, 1, H, N, N]``, never expanded) and
    the key mask ``pair_mask[i, k]`` (``[*, N, 1, 1, N]``). The ending node is the same on the transposed
    pair tensor.

    ``bias=False`` drops the gate's and the output projection's biases (Boltz-2, OpenFold's layout as Boltz
    vendors it: the gate starts at ``sigmoid(0) = 0.5``). ``transpose_bias``: the ending node reads its bias off
    the untransposed pair, ``b_ik`` instead of AF2's ``b_ki`` for the update of ``z_ij`` (OpenFold3).
    """

    def __init__(
        self, c_z: int, c_hidden: int, num_heads: int, starting: bool, attention: Any = None, bias: bool = True,
        transpose_bias: bool = False,
    ):
        super().__init__()
        self.starting = starting
        self.transpose_bias = bool(transpose_bias)
        self.layer_norm = LayerNorm(c_z)
        self.linear_bias = Linear(c_z, num_heads, bias=False, init="normal")
        self.mha = Attention(
            c_z, c_z, c_hidden, num_heads, gating=True, attention=attention, out_bias=bias, gate_bias=bias
        )

    def forward(self, z: Tensor, pair_mask: Optional[Tensor] = None, chunk_size: Optional[int] = None) -> Tensor:
        """z ``[*, N, N, c_z]``, pair_mask ``[*, N, N]`` bool -> update ``[*, N, N, c_z]``.

        ``chunk_size`` runs the attention over chunks of rows i (inference memory).
        """
        if not self.starting:
            z = z.transpose(-2, -3)  # [*, J, I, c_z]
            pair_mask = None if pair_mask is None else pair_mask.transpose(-1, -2)
        zn = self.layer_norm(z)  # [*, I, J, c_z]
        # q, k, v, gate and the pair bias of the same normalised input: one matmul
        q, k, v, g, bias = self.mha.project(zn, zn, extra=[self.linear_bias])  # [*, I, J, H*C] / [*, J, K, H]
        bias = bias.movedim(-1, -3)  # [*, H, J, K]
        if self.transpose_bias:
            bias = bias.transpose(-1, -2)  # b_jk read at (k, j) here: (j, k) of the pair before the transpose
        bias = bias.contiguous().unsqueeze(-4)  # [*, 1, H, J, K]: shared by all rows i
        mask = None if pair_mask is None else pair_mask[..., :, None, None, :]  # [*, I, 1, 1, K]
        out = chunk_rows(
            lambda q, k, v, g, m: self.mha.attend(q, k, v, g, bias, m),
            [q, k, v, g, mask], [-3, -3, -3, -3, -4], chunk_size, out_dim=-3,
        )  # [*, I, J, c_z]
        if not self.starting:
            out = out.transpose(-2, -3)
        return out


class TriangleAttentionStartingNode(TriangleAttention):
    """AF2 Alg. 13: rows of the pair tensor attend along their own row, biased by the pair."""

    def __init__(
        self, c_z: int, c_hidden: int = 32, num_heads: int = 4, attention: Any = None, bias: bool = True
    ):
        super().__init__(c_z, c_hidden, num_heads, starting=True, attention=attention, bias=bias)


class TriangleAttentionEndingNode(TriangleAttention):
    """AF2 Alg. 14: columns of the pair tensor attend along their own column, biased by the pair."""

    def __init__(
        self, c_z: int, c_hidden: int = 32, num_heads: int = 4, attention: Any = None, bias: bool = True,
        transpose_bias: bool = False,
    ):
        super().__init__(c_z, c_hidden, num_heads, starting=False, attention=attention, bias=bias,
                         transpose_bias=transpose_bias)
