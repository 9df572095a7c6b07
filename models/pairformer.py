"""Pairformer (AlphaFold3 supplement Alg. 17) on ``attn_ops``.

Representations: single ``s [B, N, c_s]`` with ``single_mask [B, N]`` and pair ``z [B, N, N, c_z]`` with
``pair_mask [B, N, N]`` (bool, True = real). Padded residues never change the result at real positions.
Every attention module takes ``attention=`` (see ``attn_zoo.models.primitives.AttentionConfig``).

A block runs: triangle multiplication outgoing, incoming, triangle attention starting node, ending
node, pair transition, then single attention with pair bias and single transition.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import contextlib

import torch
from torch import nn

from . import inference
from .primitives import (
    at_least_fp32,
    Attention,
    AttentionConfig,
    LayerNorm,
    LineDropout,
    Linear,
    SharedDropout,
    SwiGLUTransition,
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

VARIANTS = ("default", "boltz2", "openfold3", "protenix")


def _default_masks(s: Tensor, z: Tensor, single_mask: Optional[Tensor], pair_mask: Optional[Tensor]):
    """All-True masks where none are given; check shapes and dtype."""
    if s.ndim != 3 or z.ndim != 4 or s.shape[:2] != z.shape[:2] or z.shape[1] != z.shape[2]:
        raise ValueError(f"s {tuple(s.shape)} must be [B, N, c_s] and z {tuple(z.shape)} [B, N, N, c_z]")
    if single_mask is None:
        single_mask = torch.ones(s.shape[:-1], dtype=torch.bool, device=s.device)
    if pair_mask is None:
        pair_mask = single_mask[:, :, None] & single_mask[:, None, :]
    for name, t, want in (("single_mask", single_mask, s.shape[:-1]), ("pair_mask", pair_mask, z.shape[:-1])):
        if t.dtype != torch.bool:
            raise TypeError(f"{name} must be bool (True = real position), got {t.dtype}")
        if t.shape != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(want)}")
    return single_mask, pair_mask


def _masked(update: Tensor, mask: Tensor, on: bool) -> Tensor:
    """``update`` zeroed where ``mask`` (``update.shape[:-1]``) is False when ``on``, else ``update`` itself."""
    return update * mask.unsqueeze(-1).to(update.dtype) if on else update


class AttentionPairBias(nn.Module):
    """AF3 Alg. 24 (Pairformer form, no conditioning): residues of ``s`` attend to each other, biased by
    ``Linear(LN(z))`` ``[B, H, N, N]`` and with the key mask ``single_mask`` as ``[B, 1, 1, N]``.
    Head width ``c_s // num_heads``; gated; query projection with bias, output without. ``gate_bias=False``:
    the gate has no bias (Boltz-2)."""

    def __init__(self, c_s: int, c_z: int, num_heads: int = 16, attention: Any = None, gate_bias: bool = True):
        super().__init__()
        if c_s % num_heads:
            raise ValueError(f"c_s={c_s} must be divisible by num_heads={num_heads}")
        self.layer_norm_s = LayerNorm(c_s)
        self.layer_norm_z = LayerNorm(c_z)
        self.linear_z = Linear(c_z, num_heads, bias=False, init="normal")
        self.mha = Attention(
            c_s, c_s, c_s // num_heads, num_heads, gating=True, attention=attention, q_bias=True, out_bias=False,
            gate_bias=gate_bias,
        )

    def forward(self, s: Tensor, z: Tensor, single_mask: Tensor, chunk_size: Optional[int] = None) -> Tensor:
        """s ``[B, N, c_s]``, z ``[B, N, N, c_z]``, single_mask ``[B, N]`` -> update ``[B, N, c_s]``.

        ``chunk_size`` chunks the queries (inference memory).
        """
        sn = self.layer_norm_s(s)
        bias = self.linear_z(self.layer_norm_z(z)).movedim(-1, -3).contiguous()  # [B, H, N, N]
        mask = single_mask[:, None, None, :]  # [B, 1, 1, N]
        return chunk_rows(
            lambda q, b: self.mha(q, sn, bias=b, mask=mask), [sn, bias], [-2, -2], chunk_size, out_dim=-2
        )


class PairformerBlock(nn.Module):
    """AF3 Alg. 17: one Pairformer block. Dropout row-wise on the triangle multiplications and the
    starting-node attention, column-wise on the ending-node attention.

    ``variant`` picks the parameterisation (the computation order is the same):
    - ``"default"``: the triangle multiplications' four linears, the triangle attentions' gate and output
      projection and the single attention's gate have biases (gates start at ``sigmoid(1)``); dropout masks
      are shared over rows (row-wise) or columns (column-wise) and drawn per channel (AF2's DropoutRowwise).
    - ``"boltz2"``: Boltz-2's trunk layer (``PairformerLayer(v2=True)``): none of those biases (gates start
      at 0.5), and dropout drops whole rows i (row-wise) or whole columns j (column-wise) of the pair update,
      one draw per row / column shared by every channel; the single track (attention, transition, post-norm)
      runs in float32 with autocast off, as Boltz-2 runs it. ``attn_zoo.models.zoo.from_boltz`` builds it.
    - ``"openfold3"``: OpenFold3's ``PairFormerBlock``: the biases of ``"boltz2"``, the dropout of ``"default"``;
      the ending-node attention reads its bias off the untransposed pair (``b_ik`` for ``z_ij``, see
      ``TriangleAttention``), and the transitions' updates are zeroed at masked positions (pair and single).
      ``attn_zoo.models.zoo.from_openfold3`` builds it.
    - ``"protenix"``: Protenix's ``PairformerBlock``: the biases of ``"boltz2"``, the dropout of ``"default"``.
      Protenix runs its trunk unpadded and its single attention takes no mask; here padded keys are masked, so
      a padded input gives Protenix's result on the unpadded one. ``attn_zoo.models.zoo.from_protenix`` builds it.
    ``post_norm_s``: a LayerNorm on s at the end of the block (Boltz's ``post_layer_norm``; off in Boltz-2).
    Fully masked attention rows (padded residues) give 0 here and a mean of the masked values in Boltz;
    neither reaches a real position.
    """

    def __init__(
        self, c_s: int = 384, c_z: int = 128, num_heads_single: int = 16, num_heads_pair: int = 4,
        c_hidden_pair: int = 32, c_hidden_mul: int = 128, transition_n: int = 4, pair_dropout: float = 0.25,
        attention: Any = None, variant: str = "default", post_norm_s: bool = False,
    ):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        attention = AttentionConfig.coerce(attention)
        bias = variant == "default"
        self.variant = variant
        self.tri_mul_out = TriangleMultiplicationOutgoing(c_z, c_hidden_mul, bias=bias)
        self.tri_mul_in = TriangleMultiplicationIncoming(c_z, c_hidden_mul, bias=bias)
        self.tri_att_start = TriangleAttentionStartingNode(c_z, c_hidden_pair, num_heads_pair, attention, bias=bias)
        self.tri_att_end = TriangleAttentionEndingNode(c_z, c_hidden_pair, num_heads_pair, attention, bias=bias,
                                                       transpose_bias=variant == "openfold3")
        self.pair_transition = SwiGLUTransition(c_z, transition_n)
        self.attention_pair_bias = AttentionPairBias(c_s, c_z, num_heads_single, attention, gate_bias=bias)
        self.single_transition = SwiGLUTransition(c_s, transition_n)
        if variant == "boltz2":
            self.pair_dropout_row = LineDropout(pair_dropout, dim=-3)
            self.pair_dropout_col = LineDropout(pair_dropout, dim=-2)
        else:
            self.pair_dropout_row = SharedDropout(pair_dropout, shared_dim=-3)
            self.pair_dropout_col = SharedDropout(pair_dropout, shared_dim=-2)
        self.post_norm_s = LayerNorm(c_s) if post_norm_s else None
        self.single_fp32 = variant == "boltz2"
        self.mask_transitions = variant == "openfold3"  # transition updates zeroed where the mask is False

    def forward(
        self,
        s: Tensor,
        z: Tensor,
        single_mask: Optional[Tensor] = None,
        pair_mask: Optional[Tensor] = None,
        chunk_size: Optional[int] = None,
    ) -> Tuple[Tensor, Tensor]:
        """s ``[B, N, c_s]``, z ``[B, N, N, c_z]``, single_mask ``[B, N]``, pair_mask ``[B, N, N]`` -> (s, z)."""
        single_mask, pair_mask = _default_masks(s, z, single_mask, pair_mask)
        c = chunk_size
        z = z + self.pair_dropout_row(self.tri_mul_out(z, pair_mask, c))
        z = z + self.pair_dropout_row(self.tri_mul_in(z, pair_mask, c))
        z = z + self.pair_dropout_row(self.tri_att_start(z, pair_mask, c))
        z = z + self.pair_dropout_col(self.tri_att_end(z, pair_mask, c))
        z = z + _masked(self.pair_transition(z, c), pair_mask, self.mask_transitions)
        with torch.autocast(s.device.type, enabled=False) if self.single_fp32 else contextlib.nullcontext():
            if self.single_fp32:  # Boltz-2: the whole single track in float32, autocast off
                s, z = at_least_fp32(s), at_least_fp32(z)
            s = s + self.attention_pair_bias(s, z, single_mask, c)
            s = s + _masked(self.single_transition(s, c), single_mask, self.mask_transitions)
            if self.post_norm_s is not None:
                s = self.post_norm_s(s)
        return s, z

    def forward_inference(
        self, s: Tensor, z: Tensor, single_mask: Optional[Tensor] = None, pair_mask: Optional[Tensor] = None,
        *, chunk_size: Optional[int] = None, memory_budget: Optional[int] = None, inplace: bool = False,
        mode: str = "auto",
    ) -> Tuple[Tensor, Tensor]:
        """The block without autograd (``attn_zoo.models.inference``), equal to ``forward`` in eval mode. ``mode``
        ``auto``: ``forward`` itself when its estimated memory fits ``memory_budget`` (bytes beyond the inputs;
        None: the free device memory), else the memory-bounded path, by chunks updating z in place; ``plain`` /
        ``bounded`` force one (the choice: ``self.last_inference``). ``chunk_size``: rows per chunk (bounded:
        None = planned from the budget). ``inplace``: z is overwritten with the result."""
        single_mask, pair_mask = _default_masks(s, z, single_mask, pair_mask)
        return inference.run_block(self, inference.pairformer_block_, s, z, (single_mask, pair_mask), chunk_size,
                                   memory_budget, inplace=inplace, mode=mode)


class PairformerStack(inference.StackInference, nn.Module):
    """AF3 Pairformer: ``num_blocks`` PairformerBlocks with activation checkpointing every
    ``checkpoint_every`` blocks (training only) and inference chunking over rows (``chunk_size``).
    ``variant`` and ``post_norm_s``: see ``PairformerBlock``.

    Without autograd in eval mode the stack runs ``forward_inference``: the plain path when its estimated memory
    fits the budget, else the memory-bounded one (``attn_zoo.models.inference``): see ``configure_inference``,
    ``inference_choice``, ``plan_inference`` and ``last_inference``."""

    def __init__(
        self, c_s: int = 384, c_z: int = 128, num_blocks: int = 48, num_heads_single: int = 16,
        num_heads_pair: int = 4, c_hidden_pair: int = 32, c_hidden_mul: int = 128, transition_n: int = 4,
        pair_dropout: float = 0.25, attention: Any = None, checkpoint_every: int = 0,
        chunk_size: Optional[int] = None, variant: str = "default", post_norm_s: bool = False,
    ):
        super().__init__()
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")
        attention = AttentionConfig.coerce(attention)
        self.blocks = nn.ModuleList(
            PairformerBlock(
                c_s, c_z, num_heads_single, num_heads_pair, c_hidden_pair, c_hidden_mul, transition_n,
                pair_dropout, attention, variant, post_norm_s,
            )
            for _ in range(num_blocks)
        )
        self.checkpoint_every = checkpoint_every
        self.chunk_size = chunk_size

    def forward(
        self, s: Tensor, z: Tensor, single_mask: Optional[Tensor] = None, pair_mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        """s ``[B, N, c_s]``, z ``[B, N, N, c_z]``, single_mask ``[B, N]``, pair_mask ``[B, N, N]`` -> (s, z)."""
        single_mask, pair_mask = _default_masks(s, z, single_mask, pair_mask)
        if inference.use_inference_path(self, self.inference_settings):
            return self.forward_inference(s, z, single_mask, pair_mask)
        return run_blocks(
            self.blocks, s, z, (single_mask, pair_mask), self.checkpoint_every, self.chunk_size, self.training
        )

    def forward_inference(
        self, s: Tensor, z: Tensor, single_mask: Optional[Tensor] = None, pair_mask: Optional[Tensor] = None,
        *, inplace: bool = False, mode: Optional[str] = None,
    ) -> Tuple[Tensor, Tensor]:
        """The stack without autograd on the path ``mode`` (None: ``inference_settings.mode``) picks: plain (the
        blocks' forward) or memory-bounded (block by block in place on one copy of z, chunk sizes from
        ``inference_settings`` / ``chunk_size`` or planned; with ``offload`` z waits on the host). ``inplace``: the
        result is written into z. The choice: ``self.last_inference``."""
        single_mask, pair_mask = _default_masks(s, z, single_mask, pair_mask)
        settings = self.inference_settings if mode is None else inference.configure(self.inference_settings,
                                                                                      mode=mode)
        return inference.run_stack(self, inference.pairformer_block_, s, z, (single_mask, pair_mask),
                                   settings, inplace=inplace, default_chunk=self.chunk_size)
