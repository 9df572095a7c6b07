"""Evoformer (AlphaFold2 supplement Alg. 6-19) on ``attn_ops``.

Representations: MSA ``m [B, S, N, c_m]`` with ``msa_mask [B, S, N]`` and pair ``z [B, N, N, c_z]`` with
``pair_mask [B, N, N]`` (bool, True = real). Padded residues and padded MSA rows never change the result
at real positions. Every attention module takes ``attention=`` (see ``attn_zoo.models.primitives.AttentionConfig``).

Read top to bottom in the order a block runs: MSA row attention with pair bias, MSA column attention
(or global column attention in the extra-MSA stack), MSA transition, outer product mean, triangle
multiplications, triangle attentions, pair transition.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

import attn_ops

from . import inference
from .primitives import (
    Attention,
    AttentionConfig,
    LayerNorm,
    Linear,
    SharedDropout,
    Transition,
    chunk_rows,
    run_blocks,
)
from .triangle import (
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)

Tensor = torch.Tensor


def _default_masks(m: Tensor, z: Tensor, msa_mask: Optional[Tensor], pair_mask: Optional[Tensor]):
    """All-True masks where none are given; check shapes and dtype."""
    if msa_mask is None:
        msa_mask = torch.ones(m.shape[:-1], dtype=torch.bool, device=m.device)
    if pair_mask is None:
        pair_mask = torch.ones(z.shape[:-1], dtype=torch.bool, device=z.device)
    for name, t, want in (("msa_mask", msa_mask, m.shape[:-1]), ("pair_mask", pair_mask, z.shape[:-1])):
        if t.dtype != torch.bool:
            raise TypeError(f"{name} must be bool (True = real position), got {t.dtype}")
        if t.shape != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(want)}")
    if m.shape[-2] != z.shape[-2] or z.shape[-2] != z.shape[-3] or m.shape[:-3] != z.shape[:-3]:
        raise ValueError(f"m {tuple(m.shape)} must be [B, S, N, c_m] and z {tuple(z.shape)} [B, N, N, c_z]")
    return msa_mask, pair_mask


# --------------------------------------------------------------------------------------------------
# MSA stack
# --------------------------------------------------------------------------------------------------
class MSARowAttentionWithPairBias(nn.Module):
    """AF2 Alg. 7: each MSA row attends along residues, biased by ``Linear(LN(z))``.

    The pair bias ``[B, 1, H, N, N]`` is shared by all S rows (the op sums its gradient over S);
    the key mask is ``msa_mask`` as ``[B, S, 1, 1, N]``.
    """

    def __init__(self, c_m: int, c_z: int, c_hidden: int = 32, num_heads: int = 8, attention: Any = None):
        super().__init__()
        self.layer_norm_m = LayerNorm(c_m)
        self.layer_norm_z = LayerNorm(c_z)
        self.linear_z = Linear(c_z, num_heads, bias=False, init="normal")
        self.mha = Attention(c_m, c_m, c_hidden, num_heads, gating=True, attention=attention)

    def forward(self, m: Tensor, z: Tensor, msa_mask: Tensor, chunk_size: Optional[int] = None) -> Tensor:
        """m ``[B, S, N, c_m]``, z ``[B, N, N, c_z]``, msa_mask ``[B, S, N]`` -> update ``[B, S, N, c_m]``."""
        mn = self.layer_norm_m(m)
        bias = self.linear_z(self.layer_norm_z(z)).movedim(-1, -3).contiguous()  # [B, H, N, N]
        bias = bias.unsqueeze(-4)  # [B, 1, H, N, N]: shared by all S rows
        mask = msa_mask[..., :, None, None, :]  # [B, S, 1, 1, N]
        return chunk_rows(
            lambda x, k: self.mha(x, x, bias=bias, mask=k), [mn, mask], [-3, -4], chunk_size, out_dim=-3
        )


class MSAColumnAttention(nn.Module):
    """AF2 Alg. 8: each residue column of the MSA attends along the sequences (key mask over S)."""

    def __init__(self, c_m: int, c_hidden: int = 32, num_heads: int = 8, attention: Any = None):
        super().__init__()
        self.layer_norm = LayerNorm(c_m)
        self.mha = Attention(c_m, c_m, c_hidden, num_heads, gating=True, attention=attention)

    def forward(self, m: Tensor, msa_mask: Tensor, chunk_size: Optional[int] = None) -> Tensor:
        """m ``[B, S, N, c_m]``, msa_mask ``[B, S, N]`` -> update ``[B, S, N, c_m]``."""
        mt = self.layer_norm(m.transpose(-2, -3))  # [B, N, S, c_m]
        mask = msa_mask.transpose(-1, -2)[..., :, None, None, :]  # [B, N, 1, 1, S]
        out = chunk_rows(lambda x, k: self.mha(x, x, mask=k), [mt, mask], [-3, -4], chunk_size, out_dim=-3)
        return out.transpose(-2, -3)  # [B, S, N, c_m]


class MSAColumnGlobalAttention(nn.Module):
    """AF2 Alg. 19 (extra-MSA stack): per residue column, one query per head (the masked mean over
    sequences) attends to all sequences; keys and values have a single head shared by all heads.

    It runs on ``attn_ops.attention`` with q ``[B, N, H, 1, C]`` and k, v ``[B, N, H, S, C]`` (a
    stride-0 view over heads, never copied).
    """

    def __init__(self, c_m: int, c_hidden: int = 8, num_heads: int = 8, attention: Any = None, eps: float = 1e-10):
        super().__init__()
        self.c_hidden = c_hidden
        self.num_heads = num_heads
        self.eps = eps
        self.attention = AttentionConfig.coerce(attention)
        self.layer_norm = LayerNorm(c_m)
        self.linear_q = Linear(c_m, num_heads * c_hidden, bias=False, init="glorot")
        self.linear_k = Linear(c_m, c_hidden, bias=False, init="glorot")
        self.linear_v = Linear(c_m, c_hidden, bias=False, init="glorot")
        self.linear_g = Linear(c_m, num_heads * c_hidden, init="gating")
        self.linear_o = Linear(num_heads * c_hidden, c_m, init="final")

    def forward(self, m: Tensor, msa_mask: Tensor, chunk_size: Optional[int] = None) -> Tensor:
        """m ``[B, S, N, c_m]``, msa_mask ``[B, S, N]`` -> update ``[B, S, N, c_m]``."""
        mt = self.layer_norm(m.transpose(-2, -3))  # [B, N, S, c_m]
        mask_t = msa_mask.transpose(-1, -2)  # [B, N, S]
        w = mask_t.unsqueeze(-1).to(mt.dtype)  # [B, N, S, 1]
        q_avg = (mt * w).sum(-2) / (w.sum(-2) + self.eps)  # [B, N, c_m]
        q = self.linear_q(q_avg).unflatten(-1, (self.num_heads, 1, self.c_hidden))  # [B, N, H, 1, C]
        k = self.linear_k(mt).unsqueeze(-3)  # [B, N, 1, S, C]
        v = self.linear_v(mt).unsqueeze(-3)  # [B, N, 1, S, C]
        k = k.expand(*k.shape[:-3], self.num_heads, *k.shape[-2:])  # [B, N, H, S, C], view
        v = v.expand(*v.shape[:-3], self.num_heads, *v.shape[-2:])  # [B, N, H, S, C], view
        mask = mask_t[..., None, None, :]  # [B, N, 1, 1, S]
        o = attn_ops.attention(
            q, k, v, None, mask, backend=self.attention.backend, **self.attention.options
        )  # [B, N, H, 1, C]
        o = o.flatten(-3).unsqueeze(-2)  # [B, N, 1, H*C]: the same for every sequence
        g = torch.sigmoid(self.linear_g(mt))  # [B, N, S, H*C]
        out = self.linear_o(g * o)  # [B, N, S, c_m]
        return out.transpose(-2, -3)  # [B, S, N, c_m]


class MSATransition(Transition):
    """AF2 Alg. 9: the MSA transition, ``m -> Linear(relu(Linear(LN(m))))`` with hidden width ``n * c_m``
    (AF2 uses n = 4). Input/output ``[B, S, N, c_m]``; ``chunk_size`` chunks the S rows."""

    def __init__(self, c_m: int, n: int = 4):
        super().__init__(c_m, n)


class OuterProductMean(nn.Module):
    """AF2 Alg. 10: ``z_ij += Linear(mean_s a_si (x) b_sj)``, the mean over real sequences only.

    ``bias_in_mean``: divide the output bias by the count too, ``(W sum + b) / (count + eps)``, as AlphaFold 2's
    and OpenFold's code do (the supplement adds it after the mean)."""

    def __init__(self, c_m: int, c_z: int, c_hidden: int = 32, eps: float = 1e-3, bias_in_mean: bool = False):
        super().__init__()
        self.c_hidden = c_hidden
        self.eps = eps
        self.bias_in_mean = bool(bias_in_mean)
        self.layer_norm = LayerNorm(c_m)
        self.linear_a = Linear(c_m, c_hidden)
        self.linear_b = Linear(c_m, c_hidden)
        self.linear_out = Linear(c_hidden * c_hidden, c_z, init="final")

    def forward(self, m: Tensor, msa_mask: Tensor, chunk_size: Optional[int] = None) -> Tensor:
        """m ``[B, S, N, c_m]``, msa_mask ``[B, S, N]`` -> update ``[B, N, N, c_z]``.

        ``chunk_size`` chunks the rows i of the output (inference memory).
        """
        mn = self.layer_norm(m)
        w = msa_mask.unsqueeze(-1).to(mn.dtype)  # [B, S, N, 1]
        a = self.linear_a(mn) * w  # [B, S, N, C]
        b = self.linear_b(mn) * w  # [B, S, N, C]
        count = torch.einsum("...si,...sj->...ij", w.squeeze(-1), w.squeeze(-1))  # [B, N, N]
        b_flat = b.flatten(-2)  # [B, S, N*C]

        def rows(a_rows: Tensor, count_rows: Tensor) -> Tensor:
            ni = a_rows.shape[-2]
            a_t = a_rows.flatten(-2).transpose(-1, -2)  # [B, Ni*C, S]
            outer = torch.matmul(a_t, b_flat)  # [B, Ni*C, N*C]
            outer = outer.unflatten(-1, (-1, self.c_hidden)).unflatten(-3, (ni, self.c_hidden))
            # [B, Ni, C, N, D] -> [B, Ni, N, C, D] -> [B, Ni, N, C*D]
            outer = outer.transpose(-2, -3).flatten(-2)
            # Linear(sum / count) = (W sum) / count + bias: divide the c_z-wide result, not the C*D-wide sum
            out = nn.functional.linear(outer, self.linear_out.weight)  # [B, Ni, N, c_z]
            bias = self.linear_out.bias.to(out.dtype)
            if self.bias_in_mean:
                return (out + bias) / (count_rows.unsqueeze(-1) + self.eps).to(out.dtype)
            return out / (count_rows.unsqueeze(-1) + self.eps).to(out.dtype) + bias

        return chunk_rows(rows, [a, count], [-2, -2], chunk_size, out_dim=-3)


class PairTransition(Transition):
    """AF2 Alg. 15: the pair transition, ``z -> Linear(relu(Linear(LN(z))))`` with hidden width ``n * c_z``
    (AF2 uses n = 4). Input/output ``[B, N, N, c_z]``; ``chunk_size`` chunks the rows i."""

    def __init__(self, c_z: int, n: int = 4):
        super().__init__(c_z, n)


# --------------------------------------------------------------------------------------------------
# Blocks and stacks
# --------------------------------------------------------------------------------------------------
VARIANTS = ("default", "alphafold2", "alphafold2_multimer")


class _MSAPairBlock(nn.Module):
    """Shared body of EvoformerBlock (Alg. 6) and ExtraMSABlock (Alg. 18); ``column`` picks the column
    attention: ``MSAColumnAttention`` or ``MSAColumnGlobalAttention``.

    ``variant``: ``"default"`` (the supplement), ``"alphafold2"`` (AlphaFold 2's code: the outer product mean's
    bias inside the mean) or ``"alphafold2_multimer"`` (also the outer product mean first, before the MSA
    attention, as AlphaFold-Multimer's Evoformer)."""

    def __init__(
        self, c_m, c_z, num_heads_msa, c_hidden_msa, num_heads_pair, c_hidden_pair, c_hidden_opm,
        c_hidden_mul, transition_n, msa_dropout, pair_dropout, attention, column: nn.Module,
        variant: str = "default",
    ):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.opm_first = variant == "alphafold2_multimer"
        attention = AttentionConfig.coerce(attention)
        self.msa_row_attention = MSARowAttentionWithPairBias(c_m, c_z, c_hidden_msa, num_heads_msa, attention)
        self.msa_column_attention = column
        self.msa_transition = MSATransition(c_m, transition_n)
        self.outer_product_mean = OuterProductMean(c_m, c_z, c_hidden_opm, bias_in_mean=variant != "default")
        self.tri_mul_out = TriangleMultiplicationOutgoing(c_z, c_hidden_mul)
        self.tri_mul_in = TriangleMultiplicationIncoming(c_z, c_hidden_mul)
        self.tri_att_start = TriangleAttentionStartingNode(c_z, c_hidden_pair, num_heads_pair, attention)
        self.tri_att_end = TriangleAttentionEndingNode(c_z, c_hidden_pair, num_heads_pair, attention)
        self.pair_transition = PairTransition(c_z, transition_n)
        self.msa_dropout_row = SharedDropout(msa_dropout, shared_dim=-3)
        self.pair_dropout_row = SharedDropout(pair_dropout, shared_dim=-3)
        self.pair_dropout_col = SharedDropout(pair_dropout, shared_dim=-2)

    def forward(
        self,
        m: Tensor,
        z: Tensor,
        msa_mask: Optional[Tensor] = None,
        pair_mask: Optional[Tensor] = None,
        chunk_size: Optional[int] = None,
    ) -> Tuple[Tensor, Tensor]:
        """m ``[B, S, N, c_m]``, z ``[B, N, N, c_z]``, msa_mask ``[B, S, N]``, pair_mask ``[B, N, N]`` -> (m, z)."""
        msa_mask, pair_mask = _default_masks(m, z, msa_mask, pair_mask)
        c = chunk_size
        if self.opm_first:
            z = z + self.outer_product_mean(m, msa_mask, c)
        m = m + self.msa_dropout_row(self.msa_row_attention(m, z, msa_mask, c))
        m = m + self.msa_column_attention(m, msa_mask, c)
        m = m + self.msa_transition(m, c)
        if not self.opm_first:
            z = z + self.outer_product_mean(m, msa_mask, c)
        z = z + self.pair_dropout_row(self.tri_mul_out(z, pair_mask, c))
        z = z + self.pair_dropout_row(self.tri_mul_in(z, pair_mask, c))
        z = z + self.pair_dropout_row(self.tri_att_start(z, pair_mask, c))
        z = z + self.pair_dropout_col(self.tri_att_end(z, pair_mask, c))
        z = z + self.pair_transition(z, c)
        return m, z

    def forward_inference(
        self, m: Tensor, z: Tensor, msa_mask: Optional[Tensor] = None, pair_mask: Optional[Tensor] = None,
        *, chunk_size: Optional[int] = None, memory_budget: Optional[int] = None, inplace: bool = False,
        mode: str = "auto",
    ) -> Tuple[Tensor, Tensor]:
        """The block without autograd (``attn_zoo.models.inference``), equal to ``forward`` in eval mode. ``mode``
        ``auto``: ``forward`` itself when its estimated memory fits ``memory_budget`` (bytes beyond the inputs;
        None: the free device memory), else the memory-bounded path, by chunks updating m and z in place;
        ``plain`` / ``bounded`` force one (the choice: ``self.last_inference``). ``chunk_size``: rows per chunk
        (bounded: None = planned from the budget). ``inplace``: m and z are overwritten with the result."""
        msa_mask, pair_mask = _default_masks(m, z, msa_mask, pair_mask)
        return inference.run_block(self, inference.msa_pair_block_, m, z, (msa_mask, pair_mask), chunk_size,
                                   memory_budget, n_seq=m.shape[-3], inplace=inplace, mode=mode)


class EvoformerBlock(_MSAPairBlock):
    """AF2 Alg. 6: one Evoformer block (gated MSA row/column attention, transitions, outer product
    mean, triangle updates). Dropout: row-wise on MSA row attention, triangle multiplications and
    starting-node attention; column-wise on ending-node attention."""

    def __init__(
        self, c_m: int = 256, c_z: int = 128, num_heads_msa: int = 8, c_hidden_msa: int = 32,
        num_heads_pair: int = 4, c_hidden_pair: int = 32, c_hidden_opm: int = 32, c_hidden_mul: int = 128,
        transition_n: int = 4, msa_dropout: float = 0.15, pair_dropout: float = 0.25, attention: Any = None,
        variant: str = "default",
    ):
        attention = AttentionConfig.coerce(attention)
        super().__init__(
            c_m, c_z, num_heads_msa, c_hidden_msa, num_heads_pair, c_hidden_pair, c_hidden_opm, c_hidden_mul,
            transition_n, msa_dropout, pair_dropout, attention,
            column=MSAColumnAttention(c_m, c_hidden_msa, num_heads_msa, attention), variant=variant,
        )


class ExtraMSABlock(_MSAPairBlock):
    """AF2 Alg. 18: the extra-MSA block; like EvoformerBlock with global column attention."""

    def __init__(
        self, c_m: int = 64, c_z: int = 128, num_heads_msa: int = 8, c_hidden_msa: int = 8,
        num_heads_pair: int = 4, c_hidden_pair: int = 32, c_hidden_opm: int = 32, c_hidden_mul: int = 128,
        transition_n: int = 4, msa_dropout: float = 0.15, pair_dropout: float = 0.25, attention: Any = None,
        variant: str = "default",
    ):
        attention = AttentionConfig.coerce(attention)
        super().__init__(
            c_m, c_z, num_heads_msa, c_hidden_msa, num_heads_pair, c_hidden_pair, c_hidden_opm, c_hidden_mul,
            transition_n, msa_dropout, pair_dropout, attention,
            column=MSAColumnGlobalAttention(c_m, c_hidden_msa, num_heads_msa, attention), variant=variant,
        )


class _Stack(inference.StackInference, nn.Module):
    """Blocks run in order, with activation checkpointing every ``checkpoint_every`` blocks (training
    only) and inference chunking over rows (``chunk_size``; None = off).

    Without autograd in eval mode the stack runs ``forward_inference``: the plain path when its estimated memory
    fits the budget, else the memory-bounded one (``attn_zoo.models.inference``): see ``configure_inference``,
    ``inference_choice``, ``plan_inference`` and ``last_inference``."""

    def __init__(self, blocks, checkpoint_every: int, chunk_size: Optional[int]):
        super().__init__()
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")
        self.blocks = nn.ModuleList(blocks)
        self.checkpoint_every = checkpoint_every
        self.chunk_size = chunk_size

    def forward(
        self, m: Tensor, z: Tensor, msa_mask: Optional[Tensor] = None, pair_mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        """m ``[B, S, N, c_m]``, z ``[B, N, N, c_z]``, msa_mask ``[B, S, N]``, pair_mask ``[B, N, N]`` -> (m, z)."""
        msa_mask, pair_mask = _default_masks(m, z, msa_mask, pair_mask)
        if inference.use_inference_path(self, self.inference_settings):
            return self.forward_inference(m, z, msa_mask, pair_mask)
        return run_blocks(
            self.blocks, m, z, (msa_mask, pair_mask), self.checkpoint_every, self.chunk_size, self.training
        )


    def forward_inference(
        self, m: Tensor, z: Tensor, msa_mask: Optional[Tensor] = None, pair_mask: Optional[Tensor] = None,
        *, inplace: bool = False, mode: Optional[str] = None,
    ) -> Tuple[Tensor, Tensor]:
        """The stack without autograd on the path ``mode`` (None: ``inference_settings.mode``) picks: plain (the
        blocks' forward) or memory-bounded (block by block in place on one copy of m and z, chunk sizes from
        ``inference_settings`` / ``chunk_size`` or planned; with ``offload`` z waits on the host). ``inplace``: the
        result is written into m and z. The choice: ``self.last_inference``."""
        msa_mask, pair_mask = _default_masks(m, z, msa_mask, pair_mask)
        settings = self.inference_settings if mode is None else inference.configure(self.inference_settings,
                                                                                      mode=mode)
        return inference.run_stack(self, inference.msa_pair_block_, m, z, (msa_mask, pair_mask),
                                   settings, n_seq=m.shape[-3], inplace=inplace, default_chunk=self.chunk_size)


class EvoformerStack(_Stack):
    """AF2 Alg. 6 repeated ``num_blocks`` times. Returns the updated (m, z)."""

    def __init__(
        self, c_m: int = 256, c_z: int = 128, num_blocks: int = 48, num_heads_msa: int = 8,
        c_hidden_msa: int = 32, num_heads_pair: int = 4, c_hidden_pair: int = 32, c_hidden_opm: int = 32,
        c_hidden_mul: int = 128, transition_n: int = 4, msa_dropout: float = 0.15, pair_dropout: float = 0.25,
        attention: Any = None, checkpoint_every: int = 0, chunk_size: Optional[int] = None,
        variant: str = "default",
    ):
        attention = AttentionConfig.coerce(attention)
        blocks = [
            EvoformerBlock(
                c_m, c_z, num_heads_msa, c_hidden_msa, num_heads_pair, c_hidden_pair, c_hidden_opm,
                c_hidden_mul, transition_n, msa_dropout, pair_dropout, attention, variant,
            )
            for _ in range(num_blocks)
        ]
        super().__init__(blocks, checkpoint_every, chunk_size)


class ExtraMSAStack(_Stack):
    """AF2 Alg. 18 repeated ``num_blocks`` times over the extra MSA ``[B, S_extra, N, c_m]``.
    Returns (m, z); AlphaFold2 keeps only z."""

    def __init__(
        self, c_m: int = 64, c_z: int = 128, num_blocks: int = 4, num_heads_msa: int = 8, c_hidden_msa: int = 8,
        num_heads_pair: int = 4, c_hidden_pair: int = 32, c_hidden_opm: int = 32, c_hidden_mul: int = 128,
        transition_n: int = 4, msa_dropout: float = 0.15, pair_dropout: float = 0.25, attention: Any = None,
        checkpoint_every: int = 0, chunk_size: Optional[int] = None, variant: str = "default",
    ):
        attention = AttentionConfig.coerce(attention)
        blocks = [
            ExtraMSABlock(
                c_m, c_z, num_heads_msa, c_hidden_msa, num_heads_pair, c_hidden_pair, c_hidden_opm,
                c_hidden_mul, transition_n, msa_dropout, pair_dropout, attention, variant,
            )
            for _ in range(num_blocks)
        ]
        super().__init__(blocks, checkpoint_every, chunk_size)
