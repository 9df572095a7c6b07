"""ESM C (EvolutionaryScale, 2024) as the Hugging Face port (``transformers.EsmcForMaskedLM``) defines it, with
attention on ``attn_ops``.

A pre-LayerNorm encoder: token embedding (64 rows, 33 used), blocks of ``x + Attn(LN(x)) / s`` and
``x + SwiGLU(LN(x)) / s`` with ``s = sqrt(layers / 36)``, no biases in the attention and feed-forward
projections, a bias-free LayerNorm over the whole width on q and k (before rotary), rotary embeddings
(``rotate_half``, base 10000, absolute positions), a bias-free final LayerNorm and a
``dense -> gelu -> LayerNorm -> decoder`` LM head. Parameter names are the Hugging Face port's without its
``esmc.`` prefix; ``models/zoo_esmc.py`` converts that layout and the ``esm`` package's.

Shapes: B batch, L tokens (with ``<cls>`` and ``<eos>``), C width, H heads, D = C / H, F feed-forward width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

import attn_ops
from .esm2 import Alphabet
from .graphs import Logits
from .primitives import AttentionConfig, LayerNorm, fused_linear, host_reads_allowed, rotary_qkv

Tensor = torch.Tensor
VOCAB_ROWS = 64  # the embedding and decoder have 64 rows; tokens 33..63 are never produced by the tokenizer


class EsmcAlphabet(Alphabet):
    """ESM C's 33 tokens: ESM-2's order with the chain break ``|`` at 31 (ESM-2 has ``<null_1>`` there):
    ``<cls> <pad> <eos> <unk>``, 27 residue letters, ``|``, ``<mask>``."""

    def __init__(self):
        super().__init__()
        self.all_toks[31] = "|"
        self.tok_to_idx = {t: i for i, t in enumerate(self.all_toks)}


ALPHABET = EsmcAlphabet()


@dataclass(frozen=True)
class EsmcConfig:
    num_layers: int
    width: int
    heads: int
    ffn_width: int


def swiglu_width(width: int, expansion: float = 8 / 3) -> int:
    """ESM C's feed-forward width: ``8/3 * width`` rounded up to a multiple of 256."""
    return int((expansion * width + 255) // 256 * 256)


ESMC_CONFIGS: Dict[str, EsmcConfig] = {
    "300M": EsmcConfig(30, 960, 15, swiglu_width(960)),
    "600M": EsmcConfig(36, 1152, 18, swiglu_width(1152)),
    "6B": EsmcConfig(80, 2560, 40, swiglu_width(2560)),
}


def esmc(size: str = "300M", attention: Any = None, **kwargs) -> "ESMC":
    """A randomly initialised ESM C of a published size (``300M``, ``600M``, ``6B``); ``kwargs`` go to ESMC."""
    if size not in ESMC_CONFIGS:
        raise ValueError(f"unknown ESM C size {size!r}; known: {sorted(ESMC_CONFIGS)}")
    c = ESMC_CONFIGS[size]
    return ESMC(c.num_layers, c.width, c.heads, c.ffn_width, attention=attention, **kwargs)


def _rotary_tables(n: int, head_dim: int, theta: float, device: torch.device) -> Tuple[Tensor, Tensor]:
    """float32 ``cos, sin`` ``[n, D]`` for positions 0..n-1 (channel i and i + D/2 share a frequency)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inv_freq)  # [n, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class EsmcAttention(nn.Module):
    """q, k, v projections (no bias), LayerNorm(C, no bias) on q and k, rotary, attention, out projection."""

    def __init__(self, width: int, heads: int, attention: Any = None, eps: float = 1e-5):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads, self.head_dim = heads, width // heads
        self.attention = AttentionConfig.coerce(attention)
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)
        self.q_norm = nn.LayerNorm(width, eps=eps, bias=False)
        self.k_norm = nn.LayerNorm(width, eps=eps, bias=False)

    def forward(self, x: Tensor, rotary: Tuple[Tensor, Tensor], mask: Optional[Tensor],
                segment_ids: Optional[Tensor]) -> Tensor:
        """x ``[B, L, C]``; rotary float32 ``(cos, sin)`` ``[L, D]``; mask ``[B, 1, 1, L]`` True = real key."""
        cos, sin = rotary
        # q and k normed over the width (float32 statistics) and rotated in one pass (one launch on CUDA)
        q, k, v = rotary_qkv(x, [self.q_proj, self.k_proj, self.v_proj], cos, sin, self.heads,
                             [self.q_norm, self.k_norm])
        seg = {} if segment_ids is None else {"segment_ids": segment_ids}
        o = attn_ops.attention(q, k, v, mask=mask, backend=self.attention.backend, **self.attention.options,
                               **seg)  # [B, H, L, D]
        return self.o_proj(o.transpose(1, 2).flatten(2))  # [B, L, C]


class EsmcMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, width: int, ffn_width: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, ffn_width, bias=False)
        self.up_proj = nn.Linear(width, ffn_width, bias=False)
        self.down_proj = nn.Linear(ffn_width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        g, u = fused_linear(x, [self.gate_proj, self.up_proj])  # [B, L, F] each
        return self.down_proj(nn.functional.silu(g) * u)


class EsmcLayer(nn.Module):
    """``x + Attn(LN(x)) / s``, then ``x + MLP(LN(x)) / s``; ``s = sqrt(num_layers / 36)`` (ESM3's residual scaling)."""

    def __init__(self, width: int, heads: int, ffn_width: int, num_layers: int, attention: Any = None,
                 eps: float = 1e-5):
        super().__init__()
        self.input_layernorm = LayerNorm(width, eps=eps)
        self.self_attn = EsmcAttention(width, heads, attention, eps)
        self.post_attention_layernorm = LayerNorm(width, eps=eps)
        self.mlp = EsmcMLP(width, ffn_width)
        self.scaling_factor = math.sqrt(num_layers / 36)

    def forward(self, x: Tensor, rotary: Tuple[Tensor, Tensor], mask: Optional[Tensor],
                segment_ids: Optional[Tensor]) -> Tensor:
        s = self.scaling_factor  # 1 at 36 layers (600M): no division then, the same bits, two ops fewer a layer
        h = self.self_attn(self.input_layernorm(x), rotary, mask, segment_ids)
        x = x + (h if s == 1.0 else h / s)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h if s == 1.0 else h / s)


class EsmcLMHead(nn.Module):
    """``decoder(LayerNorm(gelu(dense(x))))``: logits over the 64 vocabulary rows."""

    def __init__(self, width: int, vocab_rows: int = VOCAB_ROWS, eps: float = 1e-5):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.layer_norm = LayerNorm(width, eps=eps)
        self.decoder = nn.Linear(width, vocab_rows)

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.layer_norm(nn.functional.gelu(self.dense(x))))


class ESMC(nn.Module):
    """ESM C: ``m(tokens, repr_layers=[...], sequence_id=None)`` returns ``logits [B, L, 64]``,
    ``embeddings [B, L, C]`` (after the final LayerNorm) and ``representations {layer: [B, L, C]}`` (layer 0 =
    token embeddings, layer i = block i's output, the last one after the final LayerNorm, as for ESM-2).

    ``tokens`` are ``<cls>`` residues ``<eos>``, right-padded with ``<pad>`` (id 1): padding keys are masked.
    ``sequence_id`` (int ``[B, L]``, -1 on padding) makes multi-chain rows: a token attends only tokens of its own
    chain (the ids must not decrease along a row: chains are contiguous); rotary positions stay absolute over
    the row, as in ESM C. Padding positions' outputs are not meaningful.

    Args:
        num_layers, width, heads, ffn_width: sizes (``ffn_width`` default: :func:`swiglu_width`).
        attention: what ``AttentionConfig.coerce`` takes (``"triton"``, ``{"backend": "chunked", ...}``).
        size: a published size (``"300M"``, ``"600M"``, ``"6B"``) instead of the four sizes above (giving both is
            an error); with neither, 300M.
        rope_theta, layer_norm_eps: ESM C uses 10000 and 1e-5.
        activation_checkpointing: in training, recompute each block in the backward.
    """

    def __init__(self, num_layers: Optional[int] = None, width: Optional[int] = None, heads: Optional[int] = None,
                 ffn_width: Optional[int] = None, attention: Any = None, rope_theta: float = 10000.0,
                 layer_norm_eps: float = 1e-5, activation_checkpointing: bool = False, size: Optional[str] = None):
        super().__init__()
        given = {k: v for k, v in (("num_layers", num_layers), ("width", width), ("heads", heads),
                                   ("ffn_width", ffn_width)) if v is not None}
        if size is not None and given:
            raise ValueError(f"ESMC takes a published size or num_layers/width/heads/ffn_width, not both: got "
                             f"size={size!r} and {given} (set size to null for a size of your own)")
        if size is not None and str(size) not in ESMC_CONFIGS:
            raise ValueError(f"unknown ESM C size {size!r}; known: {sorted(ESMC_CONFIGS)}")
        c = ESMC_CONFIGS["300M" if size is None else str(size)]  # 300M fills what is not given
        num_layers = c.num_layers if num_layers is None else num_layers
        width = c.width if width is None else width
        heads = c.heads if heads is None else heads
        ffn_width = c.ffn_width if size is not None else ffn_width
        if num_layers < 1 or width < 2 or heads < 1 or width % heads or (width // heads) % 2:
            raise ValueError(f"need num_layers >= 1 and width divisible by heads into an even head dim; got "
                             f"num_layers={num_layers}, width={width}, heads={heads}")
        self.num_layers, self.width, self.heads = num_layers, width, heads
        self.ffn_width = swiglu_width(width) if ffn_width is None else int(ffn_width)
        self.rope_theta, self.activation_checkpointing = float(rope_theta), bool(activation_checkpointing)
        self.alphabet = ALPHABET
        self.padding_idx = ALPHABET.padding_idx
        self.attention = AttentionConfig.coerce(attention)
        self.embed_tokens = nn.Embedding(VOCAB_ROWS, width)
        self.layers = nn.ModuleList([
            EsmcLayer(width, heads, self.ffn_width, num_layers, self.attention, layer_norm_eps)
            for _ in range(num_layers)
        ])
        self.norm = nn.LayerNorm(width, eps=layer_norm_eps, bias=False)
        self.lm_head = EsmcLMHead(width, VOCAB_ROWS, layer_norm_eps)

    @property
    def config(self) -> EsmcConfig:
        return EsmcConfig(self.num_layers, self.width, self.heads, self.ffn_width)

    @property
    def embed_dim(self) -> int:  # ESM-2's names, read by attn-zoo-embed
        return self.width

    @property
    def attention_heads(self) -> int:
        return self.heads

    def _check(self, tokens: Tensor, repr_layers: Sequence[int], sequence_id: Optional[Tensor]) -> set:
        if not isinstance(tokens, Tensor) or tokens.ndim != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an int64/int32 tensor [B, L], got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}")
        if tokens.numel() and host_reads_allowed(tokens):  # (compiled and captured graphs skip the host read)
            lo, hi = torch.stack(torch.aminmax(tokens)).tolist()  # one host read, not one per bound
            if lo < 0 or hi >= VOCAB_ROWS:
                raise ValueError(f"tokens must lie in [0, {VOCAB_ROWS}), got [{lo}, {hi}]")
        if sequence_id is not None and (sequence_id.shape != tokens.shape or sequence_id.dtype.is_floating_point
                                        or sequence_id.dtype == torch.bool):
            raise ValueError(f"sequence_id must be an integer tensor {tuple(tokens.shape)} like tokens, got "
                             f"{sequence_id.dtype} {tuple(sequence_id.shape)}")
        layers = set(repr_layers)
        bad = sorted(i for i in layers if not (isinstance(i, int) and 0 <= i <= self.num_layers))
        if bad:
            raise ValueError(f"repr_layers must be ints in [0, {self.num_layers}], got {bad}")
        return layers

    def forward(self, tokens: Tensor, repr_layers: Sequence[int] = (), sequence_id: Optional[Tensor] = None,
                return_contacts: bool = False) -> Dict[str, Any]:
        if return_contacts:
            raise ValueError("return_contacts: ESM C has no contact head (ESM-2's regression over attention maps)")
        repr_layers = self._check(tokens, repr_layers, sequence_id)
        x = self.embed_tokens(tokens)  # [B, L, C]
        mask = None
        pad = tokens.eq(self.padding_idx)
        if sequence_id is not None:
            sequence_id = torch.where(pad, torch.full_like(sequence_id, -1), sequence_id)
        elif not host_reads_allowed(tokens) or pad.any():  # compiled / captured: no data-dependent branch (see ESM2)
            mask = (~pad)[:, None, None, :]  # [B, 1, 1, L]
        rotary = _rotary_tables(tokens.shape[1], self.width // self.heads, self.rope_theta, x.device)
        reps: Dict[int, Tensor] = {0: x} if 0 in repr_layers else {}
        checkpoint = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if checkpoint:
                # ESM C draws no random numbers: no RNG state to save (which a CUDA graph capture could not read)
                x = torch.utils.checkpoint.checkpoint(layer, x, rotary, mask, sequence_id, use_reentrant=False,
                                                      preserve_rng_state=False)
            else:
                x = layer(x, rotary, mask, sequence_id)
            if i + 1 in repr_layers:
                reps[i + 1] = x
        x = self.norm(x)
        if self.num_layers in repr_layers:
            reps[self.num_layers] = x
        return {"logits": self.lm_head(x), "embeddings": x, "representations": reps}


class EsmcLogits(Logits):
    """``model(tokens, sequence_id=...)["logits"]`` with tensors as positional arguments only, for
    :class:`~attn_zoo.models.graphs.CUDAGraphs`: ``CUDAGraphs(EsmcLogits(model))(tokens, sequence_id)``
    (``sequence_id`` optional)."""

    def __init__(self, model: ESMC):
        super().__init__(model, "sequence_id")
