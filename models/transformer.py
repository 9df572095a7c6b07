"""Long-context transformer blocks on ``attn_ops``: pre-norm, RoPE, SwiGLU, optional T5-style
relative-position bias (trainable through the op's bias gradient), causal or bidirectional, and a
context-parallel mode in which the sequence is sharded over a process group and attention runs as
``attn_ops.ring.ring_attention``.

Shapes: B batch, L full sequence length, n local length (L in single-process mode, L / W when the
sequence is sharded over W ranks), d model width, H heads, Dh = d / H.

Context parallel (``process_group`` given): every rank of the group holds the same batch but only its
shard of the sequence (``layout`` order, see :func:`shard_for_context_parallel`); token positions are the
global ones, so RoPE and the relative-position bias see the full sequence (packed rows: RoPE positions restart
at each sequence, computed from the whole row's ids, see :func:`context_parallel_segment_positions`).
Parameters are replicated; gradients w.r.t. other ranks' keys/values come back through the ring backward, so
summing (or, with equal token counts, averaging as DDP does) parameter gradients over the group gives the
single-process gradient.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

import attn_ops
from attn_ops.inputs import segment_order_violation
from attn_ops.ring import ring_attention, ring_positions, shard_sequence, unshard_sequence

from . import kernels as _kernels
from .primitives import AttentionConfig, LayerNorm, Linear, check_token_segments, segment_positions

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------------
# Positions
# --------------------------------------------------------------------------------------------------
class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer): rotates channel pairs (i, i + Dh/2) by ``pos * base^(-2i/Dh)``."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding needs an even head_dim, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [Dh/2]

    def tables(self, positions: Tensor) -> Tuple[Tensor, Tensor]:
        """float32 ``cos, sin`` ``[*positions.shape, Dh]`` (each angle twice: ``cat(freqs, freqs)``), the tables of
        ``models.kernels.rotary_qkv``."""
        ang = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., n, Dh/2]
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos(), ang.sin()

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x ``[..., n, Dh]``, positions Long ``[n]`` (global) or ``[B, n]`` per row (packed rows: positions restart
        at each sequence) for x ``[B, H, n, Dh]`` -> rotated x, same shape and dtype."""
        if positions.ndim == 2 and x.ndim == 4 and positions.shape == (x.shape[0], x.shape[2]):
            positions = positions[:, None]  # [B, 1, n]: the same for every head
        elif positions.shape != x.shape[-2:-1]:
            raise ValueError(f"positions {tuple(positions.shape)} must be [n] (or [B, n] for x [B, H, n, Dh]) for x "
                             f"{tuple(x.shape)}")
        ang = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., n, Dh/2]
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def relative_position_bucket(rel: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5 buckets of ``rel = key_pos - query_pos``: exact for small distances, log-spaced up to ``max_distance``."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets  # keys after the query use the upper half
        dist_ = rel.abs()
    else:
        dist_ = (-rel).clamp(min=0)  # only past keys are distinguished
    exact = num_buckets // 2
    far = exact + (torch.log(dist_.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return buckets + torch.where(dist_ < exact, dist_, far)


class RelativePositionBias(nn.Module):
    """Trainable T5-style relative-position bias: a ``[num_buckets, H]`` table read by bucketed distance.

    Called with query and key positions it returns the ``[H, Lq, Lk]`` bias tile, so ring attention can
    materialise only the tiles it needs (pass the module as the ``bias`` callable).
    """

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        if num_buckets < 4 or max_distance <= num_buckets // (4 if bidirectional else 2):
            raise ValueError(f"need num_buckets >= 4 and max_distance > the exact range, got num_buckets="
                             f"{num_buckets}, max_distance={max_distance}")
        self.num_heads, self.num_buckets = num_heads, num_buckets
        self.max_distance, self.bidirectional = max_distance, bidirectional
        self.table = nn.Embedding(num_buckets, num_heads)
        nn.init.normal_(self.table.weight, std=0.02)

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Long ``[Lq]``, ``[Lk]`` global positions -> float32 bias ``[H, Lq, Lk]``."""
        rel = k_pos[None, :] - q_pos[:, None]  # [Lq, Lk]
        b = relative_position_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)
        return self.table(b).permute(2, 0, 1)  # [Lq, Lk, H] -> [H, Lq, Lk]


# --------------------------------------------------------------------------------------------------
# Feed-forward
# --------------------------------------------------------------------------------------------------
def ffn_width(d_model: int, ffn_mult: float = 8 / 3, multiple_of: int = 8) -> int:
    return multiple_of * math.ceil(ffn_mult * d_model / multiple_of)


class SwiGLU(nn.Module):
    """``W2 (silu(W1 x) * W3 x)``; ``hidden`` defaults to 8/3 d rounded up to a multiple of 8."""

    def __init__(self, d_model: int, hidden: Optional[int] = None):
        super().__init__()
        hidden = hidden or ffn_width(d_model)
        self.w13 = Linear(d_model, 2 * hidden, bias=False, init="relu")
        self.w2 = Linear(hidden, d_model, bias=False, init="final")

    def forward(self, x: Tensor) -> Tensor:
        a, gate = self.w13(x).chunk(2, dim=-1)  # [..., hidden] each
        return self.w2(nn.functional.silu(a) * gate)


# --------------------------------------------------------------------------------------------------
# The block
# --------------------------------------------------------------------------------------------------
class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + Attn(LN(x))`` (RoPE, optional relative-position bias), then ``x + SwiGLU(LN(x))``.

    Args:
        ffn_mult: SwiGLU width as a multiple of d_model (float) or the hidden width itself (int > 16).
        attention: what ``AttentionConfig.coerce`` takes (backend name plus options).
        process_group: run context-parallel over this group (inputs are the local sequence shard).
        layout: sequence layout over the group, ``zigzag`` (balanced causal work) or ``contiguous``.
        ring_options: extra ``ring_attention`` arguments in context-parallel mode (``kv_parts``, ``q_chunk``,
            ``grad_dtype``, ``check``); ignored without a group.
    """

    def __init__(self, d_model: int, num_heads: int, ffn_mult=8 / 3, causal: bool = False,
                 rel_pos_bias: bool = False, dropout: float = 0.0, attention=None, process_group=None,
                 layout: str = "zigzag", rel_pos_buckets: int = 32, rel_pos_max_distance: int = 128,
                 ring_options: Optional[dict] = None):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model {d_model} is not divisible by num_heads {num_heads}")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.causal, self.layout, self.process_group = causal, layout, process_group
        self.ring_options = dict(ring_options or {})  # kv_parts, q_chunk, grad_dtype, check (ring mode only)
        self.attention = AttentionConfig.coerce(attention)
        self.norm_attn = LayerNorm(d_model)
        self.qkv = Linear(d_model, 3 * d_model, bias=False, init="glorot")
        self.out = Linear(d_model, d_model, bias=False, init="final")
        self.rope = RotaryEmbedding(self.head_dim)
        self.rel_bias = RelativePositionBias(num_heads, rel_pos_buckets, rel_pos_max_distance,
                                             bidirectional=not causal) if rel_pos_bias else None
        self.norm_ffn = LayerNorm(d_model)
        hidden = ffn_mult if isinstance(ffn_mult, int) and ffn_mult > 16 else ffn_width(d_model, float(ffn_mult))
        self.ffn = SwiGLU(d_model, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, pad_mask: Optional[Tensor] = None, positions: Optional[Tensor] = None,
                segment_ids: Optional[Tensor] = None) -> Tensor:
        """x ``[B, n, d]``; pad_mask bool ``[B, L]`` over the *full* sequence in natural order (True = real),
        or None; positions Long ``[n]`` global positions of x's rows (default: this rank's positions).

        Packed rows: ``segment_ids`` Long ``[B, n]`` (one id per sequence, -1 on padding; pad_mask is then not
        needed) and ``positions`` ``[B, n]`` restarting at each sequence (RoPE); the relative bias, a function of
        position differences, is the same within a sequence either way. Context parallel: both are this rank's
        shards (``layout`` order; :func:`context_parallel_segment_positions` gives the positions); default
        positions are the global ones, as without a group."""
        B, n, d = x.shape
        if positions is None:
            positions = local_positions(n, self.process_group, self.layout, x.device)
        if positions.shape not in ((n,), (B, n)):
            raise ValueError(f"positions {tuple(positions.shape)} must be [n] or [B, n] for x {tuple(x.shape)}")
        h = self.norm_attn(x)
        # q and k rotated and v split off in one pass each way (one launch on CUDA; models.kernels.rotary_qkv)
        cos, sin = self.rope.tables(positions)  # [n, Dh] or [B, n, Dh]
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # [B, H, n, Dh]
                   for t in _kernels.rotary_qkv(self.qkv(h), d, cos, sin, self.num_heads))
        mask = None if pad_mask is None or segment_ids is not None else pad_mask[:, None, None, :]  # [B, 1, 1, L]
        opts = dict(backend=self.attention.backend, **self.attention.options)
        group = resolve_group(self.process_group)
        if group is None:
            rel_pos = positions if positions.ndim == 1 else torch.arange(n, device=x.device)
            bias = None if self.rel_bias is None else self.rel_bias(rel_pos, rel_pos)  # [H, n, n]
            if segment_ids is not None:
                opts["segment_ids"] = segment_ids  # [B, n]: ids have no head dim
            o = attn_ops.attention(q, k, v, bias, mask, causal=self.causal, **opts)
        else:
            # packed rows: this rank's ids (sharded like x); the ring gathers and checks them and skips the calls
            # whose segments cannot meet. The relative bias sees global row positions: the same differences
            # within a sequence, and cross-sequence pairs are masked.
            o = ring_attention(q, k, v, self.rel_bias, mask, group=group, causal=self.causal,
                               layout=self.layout, segment_ids=segment_ids, **self.ring_options, **opts)
        o = o.transpose(1, 2).reshape(B, n, d)  # [B, H, n, Dh] -> [B, n, d]
        x = x + self.drop(self.out(o))
        return x + self.drop(self.ffn(self.norm_ffn(x)))


def resolve_group(group):
    """``process_group`` as given to the blocks: None, a ProcessGroup, or ``"world"`` (the default group once
    ``torch.distributed`` is initialised, e.g. by Lightning's DDP strategy; None while it is not or W = 1)."""
    if isinstance(group, str):
        if group != "world":
            raise ValueError(f"process_group must be None, a ProcessGroup or 'world', got {group!r}")
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return dist.group.WORLD
    return group


def context_parallel_segment_positions(segment_ids: Tensor, group, layout: str = "zigzag",
                                      tokens: Optional[Tensor] = None, positions: Optional[Tensor] = None) -> Tensor:
    """This rank's shard of ``segment_positions`` of the whole packed row: Long ``[B, n]`` positions restarting at
    each sequence, 0 on padding (ids < 0).

    ``segment_ids`` int ``[B, n]`` is this rank's shard (``layout`` order, like ``tokens``); a sequence may start on
    another rank, so the ids of all ranks are gathered (one all_gather of ``n`` ints per row and rank), put in
    natural order, and their positions sharded back. Every rank first checks its ids (integer, shaped like its
    ``tokens`` when given; ``positions``, when given, shaped like them too and returned as they are) and the
    ranks agree, so a bad shard on one rank raises the same ValueError on every rank instead of hanging; ids
    that return to a sequence after another one started (over the whole row) raise too. Without a group: the
    positions of ``segment_ids`` itself.
    """
    group = resolve_group(group)
    error = None
    try:
        if not isinstance(segment_ids, torch.Tensor):
            raise ValueError(f"segment_ids must be an integer tensor [B, n], got {type(segment_ids).__name__}")
        if tokens is not None:
            check_token_segments(segment_ids, tokens)
        elif segment_ids.ndim != 2 or segment_ids.dtype.is_floating_point or segment_ids.dtype == torch.bool:
            raise ValueError(f"segment_ids must be an integer tensor [B, n], got {segment_ids.dtype} "
                             f"{tuple(segment_ids.shape)}")
        if positions is not None and positions.shape != segment_ids.shape:
            raise ValueError(f"positions must be {tuple(segment_ids.shape)} like segment_ids, got "
                             f"{tuple(positions.shape)}")
    except ValueError as exc:
        if group is None:
            raise
        error = str(exc)
    if group is None:
        return segment_positions(segment_ids) if positions is None else positions
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if error is None and tokens is not None and segment_ids.device != tokens.device:
        error = f"segment_ids is on {segment_ids.device} but tokens are on {tokens.device}"
    # agree before gathering the ids: (failed, B, n, itemsize) of every rank
    device = tokens.device if tokens is not None else getattr(segment_ids, "device", torch.device("cpu"))
    head = (1, 0, 0, 0) if error else (0, segment_ids.shape[0], segment_ids.shape[1], segment_ids.element_size())
    heads = [torch.empty(4, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(heads, torch.tensor(head, dtype=torch.int64, device=device), group=group)
    heads = [tuple(h.tolist()) for h in heads]
    if any(h[0] for h in heads) or len(set(heads)) > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error, group=group)
        detail = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e) or "; ".join(
            f"rank {r}: segment_ids [B, n] = {list(h[1:3])}, {h[3]}-byte ints" for r, h in enumerate(heads))
        raise ValueError(f"context-parallel packed rows take this rank's shard of segment_ids (and of positions), "
                         f"sharded like tokens with layout={layout!r}: bad or disagreeing shards over the {world} "
                         f"ranks: {detail}")
    parts = [torch.empty_like(segment_ids) for _ in range(world)]
    dist.all_gather(parts, segment_ids.contiguous(), group=group)
    full = unshard_sequence(parts, 1, layout)  # [B, L] in natural order
    bad = segment_order_violation(full)
    if bool(bad.any()):  # the same on every rank: all hold the whole row
        row = int(bad.nonzero()[0, 0])
        shown = full[row].tolist()
        raise ValueError(f"context-parallel segment_ids must be contiguous within each row of the whole sequence "
                         f"(a sequence cannot return after another one started; check that ids and tokens are "
                         f"sharded with layout={layout!r}): row {row} of the gathered [B, L] = "
                         f"{list(full.shape)} is {shown[:64]}{' ...' if len(shown) > 64 else ''}")
    if positions is not None:
        return positions
    return shard_sequence(segment_positions(full), 1, world, rank, layout)


def local_positions(n: int, group, layout: str, device) -> Tensor:
    """Long ``[n]`` global positions of this rank's shard (``arange(n)`` without a group)."""
    group = resolve_group(group)
    if group is None:
        return torch.arange(n, device=device)
    return ring_positions(n, dist.get_world_size(group), dist.get_rank(group), layout, device=device)


# --------------------------------------------------------------------------------------------------
# Language model / protein encoder
# --------------------------------------------------------------------------------------------------
class TransformerLM(nn.Module):
    """Token embedding -> ``num_layers`` blocks -> LayerNorm -> vocabulary logits.

    ``causal=True``: a causal LM; ``causal=False``: a bidirectional (ESM-2-style, masked-LM) encoder.
    With ``process_group`` (a group, or ``"world"`` resolved at the first forward) the model runs
    context-parallel: ``tokens``/``pad_mask`` are this rank's shard (:meth:`shard_batch`) and the logits
    are the shard's logits. Train it with every rank of the group seeing the same batches (Lightning:
    ``Trainer(strategy="ddp", use_distributed_sampler=False)``); DDP's gradient average over the group then
    equals the single-device gradient of the mean loss when ranks score equal token counts.
    """

    def __init__(self, vocab_size: int, d_model: int, num_layers: int, num_heads: int, causal: bool = True,
                 rel_pos_bias: bool = False, max_len: Optional[int] = None, attention=None, process_group=None,
                 checkpoint: bool = False, ffn_mult=8 / 3, dropout: float = 0.0, layout: str = "zigzag",
                 padding_idx: Optional[int] = None, ring_options: Optional[dict] = None):
        super().__init__()
        self.vocab_size, self.max_len, self.checkpoint = vocab_size, max_len, checkpoint
        self.process_group, self.layout = process_group, layout
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, num_heads, ffn_mult, causal, rel_pos_bias, dropout, attention,
                             process_group, layout, ring_options=ring_options) for _ in range(num_layers))
        self.norm = LayerNorm(d_model)
        self.head = Linear(d_model, vocab_size, bias=False, init="default")

    def forward(self, tokens: Tensor, pad_mask: Optional[Tensor] = None, segment_ids: Optional[Tensor] = None,
                positions: Optional[Tensor] = None) -> Tensor:
        """tokens Long ``[B, n]``, pad_mask bool ``[B, n]`` (True = real) or None -> logits ``[B, n, vocab]``.

        Packed rows (several sequences per row): ``segment_ids`` int ``[B, n]``, contiguous ids per sequence, -1 on
        padding; ``positions`` ``[B, n]`` (default: restarting at each sequence). Each sequence then gets exactly
        what it gets alone in a row. Context parallel: ``segment_ids`` (and ``positions``) are this rank's shards,
        sharded like ``tokens`` (:meth:`shard_batch`); default positions restart at each sequence of the whole
        row (one all_gather of the ids per forward)."""
        if tokens.dtype != torch.long or tokens.ndim != 2:
            raise TypeError(f"tokens must be a Long tensor [B, L], got {tokens.dtype} {tuple(tokens.shape)}")
        if pad_mask is not None and (pad_mask.dtype != torch.bool or pad_mask.shape != tokens.shape):
            raise ValueError(f"pad_mask must be bool {tuple(tokens.shape)} like tokens, got "
                             f"{pad_mask.dtype} {tuple(pad_mask.shape)}")
        B, n = tokens.shape
        group = resolve_group(self.process_group)
        world = 1 if group is None else dist.get_world_size(group)
        if self.max_len is not None and n * world > self.max_len:
            raise ValueError(f"sequence length {n * world} (local {n} x {world} ranks) exceeds max_len {self.max_len}")
        if segment_ids is not None and group is not None:
            # context parallel: ids (and positions) are this rank's shards; RoPE positions restart at each sequence
            # over the whole row (a sequence may start on another rank). pad_mask is not needed (ids < 0 = padding).
            positions = context_parallel_segment_positions(segment_ids, group, self.layout, tokens, positions)
            pad_mask = None
        elif segment_ids is not None:
            check_token_segments(segment_ids, tokens)
            if positions is None:
                positions = segment_positions(segment_ids)
            elif positions.shape != tokens.shape:
                raise ValueError(f"positions must be {tuple(tokens.shape)} like tokens, got {tuple(positions.shape)}")
        elif positions is not None:
            raise ValueError("positions are taken with segment_ids (packed rows) only")
        else:
            positions = local_positions(n, group, self.layout, tokens.device)
        full_mask = None if pad_mask is None else gather_sequence(pad_mask, group, self.layout)
        x = self.embed(tokens)  # [B, n, d]
        for block in self.blocks:
            if self.checkpoint and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, full_mask, positions, segment_ids, use_reentrant=False)
            else:
                x = block(x, full_mask, positions, segment_ids)
        return self.head(self.norm(x))


    def shard_batch(self, batch: dict, keys: Sequence[str] = ("tokens", "pad_mask", "target", "loss_mask",
                                                             "segment_ids", "positions")) -> dict:
        """In context-parallel mode, this rank's sequence shard of every ``[B, L, ...]`` entry in ``keys``
        (others pass through); otherwise the batch unchanged. Every rank must hold the same batch."""
        group = resolve_group(self.process_group)
        if group is None:
            return batch
        out = dict(batch)
        for key in keys:
            if key in out and out[key] is not None:
                out[key], = shard_for_context_parallel([out[key]], group, self.layout)
        return out


def esm2_like(vocab_size: int = 33, d_model: int = 320, num_layers: int = 6, num_heads: int = 20, **kwargs):
    """An ESM-2-style protein encoder (bidirectional, pre-norm, RoPE); defaults are ESM-2 8M's sizes.

    Pass ``padding_idx`` for your alphabet's pad token (``attn_zoo.models.data.alphabet.PAD`` for this project's).
    """
    return TransformerLM(vocab_size, d_model, num_layers, num_heads, causal=False, **kwargs)


# --------------------------------------------------------------------------------------------------
# Context-parallel data helpers
# --------------------------------------------------------------------------------------------------
def shard_for_context_parallel(tensors: Sequence[Optional[Tensor]], group=None, layout: str = "zigzag",
                               dim: int = 1) -> Tuple[Optional[Tensor], ...]:
    """This rank's sequence shard of each full-batch tensor (tokens, targets, masks: ``[B, L, ...]``).

    Every rank of ``group`` must hold the same batch; ``L`` must be divisible by W (2W for zigzag). Shift
    causal-LM targets on the full sequence *before* sharding.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return tuple(None if t is None else shard_sequence(t, dim, world, rank, layout) for t in tensors)


def gather_sequence(x: Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """All ranks' shards of ``x`` along ``dim`` joined in natural sequence order (no gradient)."""
    if group is None:
        return x
    world = dist.get_world_size(group)
    wire = x.to(torch.uint8) if x.dtype == torch.bool else x  # gloo has no bool collectives
    parts = [torch.empty_like(wire) for _ in range(world)]
    dist.all_gather(parts, wire.contiguous(), group=group)
    full = unshard_sequence(parts, dim, layout)
    return full.bool() if x.dtype == torch.bool else full
