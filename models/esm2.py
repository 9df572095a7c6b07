"""ESM-2 (Lin et al. 2023) as fair-esm defines it (``esm.model.esm2.ESM2``), with attention on ``attn_ops``.

Same alphabet (33 tokens, ``<cls> ... <eos>``, ``<pad>``, ``<mask>``), tokenisation, rotary embeddings,
pre-LayerNorm blocks with a GELU feed-forward, final LayerNorm, tied LM head with its own bias, token-dropout
rescaling and padding handling; parameter names match fair-esm's, so a state_dict of :class:`ESM2` has
fair-esm's keys (``models/zoo.py`` converts and checks checkpoints). Differences: the attention backend is one
``attention`` config away (``AttentionConfig``), rotary tables are computed in float32 whatever the model
dtype (fair-esm's buffer follows ``.half()``), and there is no length limit.

Shapes: B batch, L tokens (with ``<cls>`` and ``<eos>``), C embed dim, H heads, D = C / H.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

import attn_ops
from .kernels import _rotate_half
from .primitives import (AttentionConfig, LayerNorm, check_token_segments, host_reads_allowed, rotary_qkv,
                         segment_positions)

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------------
# Alphabet and tokenisation (fair-esm's "ESM-1b" alphabet, which ESM-2 uses)
# --------------------------------------------------------------------------------------------------
_PREPEND = ("<cls>", "<pad>", "<eos>", "<unk>")
_STANDARD = tuple("LAGVSERTIDPKQNFYMHWCXBUZO.-")
_APPEND = ("<mask>",)


class Alphabet:
    """ESM-2's 33 tokens in fair-esm's order: ``<cls> <pad> <eos> <unk>``, 27 residue letters, ``<null_1>``,
    ``<mask>``. ``encode`` reads one letter per residue and ``<...>`` special tokens; whitespace is skipped."""

    def __init__(self):
        toks = list(_PREPEND) + list(_STANDARD)
        toks += [f"<null_{i + 1}>" for i in range(-len(toks) % 8)]  # padded to a multiple of 8, as fair-esm
        toks += list(_APPEND)
        self.all_toks: List[str] = toks
        self.tok_to_idx: Dict[str, int] = {t: i for i, t in enumerate(toks)}
        self.cls_idx, self.padding_idx = self.tok_to_idx["<cls>"], self.tok_to_idx["<pad>"]
        self.eos_idx, self.unk_idx = self.tok_to_idx["<eos>"], self.tok_to_idx["<unk>"]
        self.mask_idx = self.tok_to_idx["<mask>"]
        self.prepend_bos, self.append_eos = True, True

    def __len__(self) -> int:
        return len(self.all_toks)

    def get_idx(self, tok: str) -> int:
        return self.tok_to_idx.get(tok, self.unk_idx)

    def get_tok(self, idx: int) -> str:
        return self.all_toks[idx]

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (no ``<cls>``/``<eos>``); an unknown character raises ValueError."""
        ids = []
        for m in re.finditer(r"<[^<>\s]*>|\S", text):
            tok = m.group(0)
            if tok not in self.tok_to_idx:
                raise ValueError(f"sequence has {tok!r} at position {m.start()}, not an ESM-2 token "
                                 f"(residues {''.join(_STANDARD)} or one of {[t for t in self.all_toks if t[0] == '<']})")
            ids.append(self.tok_to_idx[tok])
        return ids

    def get_batch_converter(self, truncation_seq_length: Optional[int] = None) -> "BatchConverter":
        return BatchConverter(self, truncation_seq_length)


class BatchConverter:
    """``[(label, sequence), ...] -> (labels, sequences, tokens [B, L])``: ``<cls>`` + residues + ``<eos>``,
    right-padded with ``<pad>`` to the longest (fair-esm's ``BatchConverter``)."""

    def __init__(self, alphabet: Alphabet, truncation_seq_length: Optional[int] = None):
        self.alphabet = alphabet
        self.truncation_seq_length = truncation_seq_length

    def __call__(self, raw_batch: Sequence[Tuple[str, str]]):
        if len(raw_batch) == 0:
            raise ValueError("batch converter got an empty batch")
        for i, item in enumerate(raw_batch):
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], str)):
                raise TypeError(f"batch item {i} must be a (label, sequence str) pair, got {item!r}")
        labels = [label for label, _ in raw_batch]
        strs = [seq for _, seq in raw_batch]
        encoded = [self.alphabet.encode(s) for s in strs]
        if self.truncation_seq_length:
            encoded = [e[: self.truncation_seq_length] for e in encoded]
        a = self.alphabet
        tokens = torch.full((len(encoded), max(map(len, encoded)) + 2), a.padding_idx, dtype=torch.int64)
        for i, e in enumerate(encoded):
            tokens[i, 0] = a.cls_idx
            tokens[i, 1 : len(e) + 1] = torch.tensor(e, dtype=torch.int64)
            tokens[i, len(e) + 1] = a.eos_idx
        return labels, strs, tokens


ALPHABET = Alphabet()


# --------------------------------------------------------------------------------------------------
# Published sizes
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ESM2Config:
    num_layers: int
    embed_dim: int
    attention_heads: int
    token_dropout: bool = True


ESM2_CONFIGS: Dict[str, ESM2Config] = {
    "esm2_t6_8M_UR50D": ESM2Config(6, 320, 20),
    "esm2_t12_35M_UR50D": ESM2Config(12, 480, 20),
    "esm2_t30_150M_UR50D": ESM2Config(30, 640, 20),
    "esm2_t33_650M_UR50D": ESM2Config(33, 1280, 20),
    "esm2_t36_3B_UR50D": ESM2Config(36, 2560, 40),
    "esm2_t48_15B_UR50D": ESM2Config(48, 5120, 40),
}
_SHORT = {name.split("_")[2]: name for name in ESM2_CONFIGS}  # "650M" -> "esm2_t33_650M_UR50D"


def esm2_config(size: str) -> ESM2Config:
    """The published config by full name (``esm2_t33_650M_UR50D``) or size (``650M``)."""
    name = _SHORT.get(size, size)
    if name not in ESM2_CONFIGS:
        raise ValueError(f"unknown ESM-2 size {size!r}; known: {sorted(_SHORT)} or {sorted(ESM2_CONFIGS)}")
    return ESM2_CONFIGS[name]


def esm2(size: str = "650M", attention: Any = None, **kwargs) -> "ESM2":
    """A randomly initialised ESM-2 of a published size; ``kwargs`` go to :class:`ESM2`."""
    cfg = esm2_config(size)
    return ESM2(cfg.num_layers, cfg.embed_dim, cfg.attention_heads, token_dropout=cfg.token_dropout,
                attention=attention, **kwargs)


# --------------------------------------------------------------------------------------------------
# Rotary embedding, attention, layer
# --------------------------------------------------------------------------------------------------
def gelu(x: Tensor) -> Tensor:
    """Exact (erf) GELU, fair-esm's ``x * 0.5 * (1 + erf(x / sqrt(2)))`` as one fused op (one saved tensor)."""
    return nn.functional.gelu(x)


class RotaryEmbedding(nn.Module):
    """fair-esm's rotary embedding: channel ``i`` and ``i + D/2`` rotated by ``pos / 10000^(2i/D)``, pos = 0..L-1.

    ``inv_freq`` is a state_dict buffer (fair-esm keeps one per layer). It keeps its own dtype when the module
    is cast (``.half()``), and a loaded one keeps the checkpoint's dtype; the tables are float32.
    """

    def __init__(self, dim: int):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary embedding needs an even head dim, got {dim}")
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self._cache: Optional[Tuple[int, torch.device, Tensor, Tensor]] = None

    def _apply(self, fn, recurse=True):
        keep = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = keep.to(device=self.inv_freq.device)  # a dtype cast must not round the frequencies
        self._cache = None
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        loaded = state_dict.get(prefix + "inv_freq")
        if isinstance(loaded, Tensor) and loaded.shape == self.inv_freq.shape:
            self.inv_freq = loaded.detach().clone().to(self.inv_freq.device)  # the checkpoint's dtype
            self._cache = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def tables(self, n: int, device: torch.device) -> Tuple[Tensor, Tensor]:
        """float32 ``cos, sin`` ``[n, D]`` for positions 0..n-1."""
        c = self._cache
        if c is None or c[0] != n or c[1] != device or torch.compiler.is_compiling():
            t = torch.arange(n, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(device=device, dtype=torch.float32))  # [n, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
            c = (n, device, emb.cos(), emb.sin())
            if not torch.compiler.is_compiling():  # a compiled graph computes them inside (a cached tensor would
                self._cache = c                    # be a CUDA graph's output, overwritten by its next replay)
        return c[2], c[3]

    def forward(self, q: Tensor, k: Tensor, positions: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """q, k ``[..., L, D]`` -> rotated q, k (same dtype). ``positions`` ``[B, L]`` (packed rows, restarting at
        each sequence) for q, k ``[B, H, L, D]``; default 0..L-1."""
        cos, sin = self.tables(k.shape[-2], k.device)
        if positions is not None:
            cos, sin = cos[positions][:, None], sin[positions][:, None]  # [B, 1, L, D]

        def rot(x):
            xf = x.float()
            return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)

        return rot(q), rot(k)


def _attention_with_probs(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Plain attention that also returns the probabilities ``[B, H, L, L]`` (float32): the fused backends never
    form them. q is pre-scaled. mask ``[B, 1, 1, L]`` True = attend."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2))  # [B, H, L, L]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype), p


class MultiheadAttention(nn.Module):
    """fair-esm's self-attention: q, k, v, out projections with biases; q scaled by ``D^-0.5`` before rotary."""

    def __init__(self, embed_dim: int, num_heads: int, attention: Any = None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by attention_heads {num_heads}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.attention = AttentionConfig.coerce(attention)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.rot_emb = RotaryEmbedding(self.head_dim)

    def forward(self, x: Tensor, mask: Optional[Tensor], need_weights: bool, segment_ids: Optional[Tensor] = None,
                positions: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """x ``[B, L, C]``, mask ``[B, 1, 1, L]`` (True = real key) -> ``[B, L, C]`` and, with ``need_weights``,
        the probabilities ``[B, H, L, L]``. Packed rows: ``segment_ids`` / ``positions`` ``[B, L]``."""
        if need_weights and segment_ids is not None:
            raise ValueError("attention probabilities (need_head_weights / return_contacts) are not available for "
                             "packed rows (segment_ids): run those proteins padded")
        cos, sin = self.rot_emb.tables(x.shape[1], x.device)
        if positions is not None:
            cos, sin = cos[positions], sin[positions]  # [B, L, D]
        # q scaled by D^-0.5 (after the rotation: the same map) and q, k rotated in one pass (one launch on CUDA)
        q, k, v = rotary_qkv(x, [self.q_proj, self.k_proj, self.v_proj], cos, sin, self.num_heads,
                             q_scale=self.scaling)
        probs = None
        if need_weights:
            o, probs = _attention_with_probs(q, k, v, mask)
        else:
            seg = {} if segment_ids is None else {"segment_ids": segment_ids}  # [B, L]: ids have no head dim
            o = attn_ops.attention(q, k, v, mask=mask, scale=1.0, backend=self.attention.backend,
                                   **self.attention.options, **seg)  # [B, H, L, D]
        o = o.transpose(1, 2).flatten(2)  # [B, L, C]
        return self.out_proj(o), probs


class TransformerLayer(nn.Module):
    """Pre-LayerNorm block: ``x + Attn(LN(x))``, then ``x + fc2(gelu(fc1(LN(x))))`` (FFN width 4C)."""

    def __init__(self, embed_dim: int, ffn_embed_dim: int, attention_heads: int, attention: Any = None,
                 layer_norm_eps: float = 1e-5):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, attention_heads, attention)
        self.self_attn_layer_norm = LayerNorm(embed_dim, eps=layer_norm_eps)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim, eps=layer_norm_eps)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None, need_weights: bool = False,
                segment_ids: Optional[Tensor] = None, positions: Optional[Tensor] = None):
        h, probs = self.self_attn(self.self_attn_layer_norm(x), mask, need_weights, segment_ids, positions)
        x = x + h
        x = x + self.fc2(gelu(self.fc1(self.final_layer_norm(x))))
        return x, probs


# --------------------------------------------------------------------------------------------------
# Heads
# --------------------------------------------------------------------------------------------------
class RobertaLMHead(nn.Module):
    """``dense -> gelu -> LayerNorm -> x @ embed_tokens.weight^T + bias`` (weight tied to the embedding)."""

    def __init__(self, embed_dim: int, output_dim: int, weight: nn.Parameter, layer_norm_eps: float = 1e-5):
        super().__init__()
        self.dense = nn.Linear(embed_dim, embed_dim)
        self.layer_norm = LayerNorm(embed_dim, eps=layer_norm_eps)
        self.weight = weight  # the embedding's Parameter: state_dict lists it under both names, as fair-esm
        self.bias = nn.Parameter(torch.zeros(output_dim))
        self.loaded = True  # False for a Hugging Face EsmModel checkpoint, which has no LM head (models/zoo.py)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer_norm(gelu(self.dense(x)))
        return nn.functional.linear(x, self.weight) + self.bias


def _symmetrize(x: Tensor) -> Tensor:
    return x + x.transpose(-1, -2)


def _apc(x: Tensor) -> Tensor:
    """Average product correction."""
    a1 = x.sum(-1, keepdim=True)
    a2 = x.sum(-2, keepdim=True)
    a12 = x.sum((-1, -2), keepdim=True)
    return x - a1 * a2 / a12


class ContactPredictionHead(nn.Module):
    """Attention maps ``[B, layers, H, L, L]`` -> contact probabilities ``[B, L-2, L-2]`` (``<cls>``/``<eos>``
    dropped): symmetrise, APC, logistic regression over the layers*heads maps."""

    def __init__(self, in_features: int, eos_idx: int):
        super().__init__()
        self.eos_idx = eos_idx
        self.regression = nn.Linear(in_features, 1)
        self.loaded = True  # False when a checkpoint came without its contact regression (models/zoo.py)

    def forward(self, tokens: Tensor, attentions: Tensor) -> Tensor:
        if not self.loaded:
            raise ValueError("this model's checkpoint had no contact regression (fair-esm ships it in a separate "
                             "contact-regression file): merge its 'model' dict into the checkpoint's before loading")
        eos = tokens.ne(self.eos_idx).to(attentions)  # [B, L]
        attentions = attentions * (eos[:, None, :] * eos[:, :, None])[:, None, None]
        attentions = attentions[..., 1:-1, 1:-1]  # drop <eos> (last) and <cls> (first)
        b, nl, nh, n, _ = attentions.shape
        feats = _apc(_symmetrize(attentions.reshape(b, nl * nh, n, n)))  # [B, layers*H, n, n]
        feats = feats.to(self.regression.weight).permute(0, 2, 3, 1)  # [B, n, n, layers*H]
        return torch.sigmoid(self.regression(feats).squeeze(3))


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------
def _init_bert(module: nn.Module) -> None:
    """fairseq's ``init_bert_params``, ESM-2's initialisation: weights N(0, 0.02), biases 0, the padding row 0
    (PyTorch's defaults give the tied LM head logits of size ~sqrt(C): a from-scratch loss far above log 33)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()


class ESM2(nn.Module):
    """ESM-2: ``m(tokens, repr_layers=[...], need_head_weights=False, return_contacts=False)`` returns fair-esm's
    dict: ``logits [B, L, 33]``, ``representations {layer: [B, L, C]}`` (layer 0 = embeddings, the last layer
    after the final LayerNorm), and with ``need_head_weights`` ``attentions [B, layers, H, L, L]``, with
    ``return_contacts`` also ``contacts [B, L-2, L-2]``.

    Attention runs on ``attn_ops.attention`` with the configured backend (key padding as a bool mask). When the
    attention probabilities are asked for (``need_head_weights`` or ``return_contacts``), every layer instead
    runs plain PyTorch math that materialises ``[B, H, L, L]`` in float32 (the fused backends never form the
    probabilities), so contacts cost O(L^2) memory per layer, as in fair-esm.

    Args:
        size: a published size (``"8M"``, ``"35M"``, ``"150M"``, ``"650M"``, ``"3B"``, ``"15B"`` or the full name
            ``esm2_t33_650M_UR50D``) instead of ``num_layers`` / ``embed_dim`` / ``attention_heads`` (giving both
            is an error); with neither, 650M.
        attention: what ``AttentionConfig.coerce`` takes (``"triton"``, ``{"backend": "chunked", ...}``).
        activation_checkpointing: in training, keep only each layer's input and recompute the layer in the
            backward (long sequences: memory per layer drops to one ``[B, L, C]`` tensor).
    """

    def __init__(self, num_layers: Optional[int] = None, embed_dim: Optional[int] = None,
                 attention_heads: Optional[int] = None, token_dropout: bool = True, attention: Any = None,
                 layer_norm_eps: float = 1e-5, activation_checkpointing: bool = False, size: Optional[str] = None):
        super().__init__()
        given = {k: v for k, v in (("num_layers", num_layers), ("embed_dim", embed_dim),
                                   ("attention_heads", attention_heads)) if v is not None}
        if size is not None and given:
            raise ValueError(f"ESM2 takes a published size or num_layers/embed_dim/attention_heads, not both: got "
                             f"size={size!r} and {given} (set size to null for a size of your own)")
        published = esm2_config("650M" if size is None else str(size))  # 650M fills what is not given
        num_layers = published.num_layers if num_layers is None else num_layers
        embed_dim = published.embed_dim if embed_dim is None else embed_dim
        attention_heads = published.attention_heads if attention_heads is None else attention_heads
        if num_layers < 1 or embed_dim < 2 or attention_heads < 1:
            raise ValueError(f"need num_layers >= 1, embed_dim >= 2, attention_heads >= 1; got "
                             f"{num_layers}, {embed_dim}, {attention_heads}")
        self.num_layers, self.embed_dim, self.attention_heads = num_layers, embed_dim, attention_heads
        self.token_dropout, self.activation_checkpointing = token_dropout, bool(activation_checkpointing)
        self.alphabet = ALPHABET
        a = self.alphabet
        self.alphabet_size = len(a)
        self.padding_idx, self.mask_idx, self.cls_idx, self.eos_idx = a.padding_idx, a.mask_idx, a.cls_idx, a.eos_idx
        self.attention = AttentionConfig.coerce(attention)

        self.embed_tokens = nn.Embedding(self.alphabet_size, embed_dim, padding_idx=self.padding_idx)
        self.layers = nn.ModuleList([
            TransformerLayer(embed_dim, 4 * embed_dim, attention_heads, self.attention, layer_norm_eps)
            for _ in range(num_layers)
        ])
        self.contact_head = ContactPredictionHead(num_layers * attention_heads, self.eos_idx)
        self.emb_layer_norm_after = LayerNorm(embed_dim, eps=layer_norm_eps)
        self.lm_head = RobertaLMHead(embed_dim, self.alphabet_size, self.embed_tokens.weight, layer_norm_eps)
        self.apply(_init_bert)


    @property
    def config(self) -> ESM2Config:
        return ESM2Config(self.num_layers, self.embed_dim, self.attention_heads, self.token_dropout)

    def _check(self, tokens: Tensor, repr_layers: Iterable[int]) -> set:
        if not isinstance(tokens, Tensor) or tokens.ndim != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an int64/int32 tensor [B, L], got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}")
        # the range check reads the tokens on the host (a device sync); compiled graphs and CUDA graph captures skip it
        if tokens.numel() and host_reads_allowed(tokens):
            lo, hi = torch.stack(torch.aminmax(tokens)).tolist()  # one host read, not one per bound
            if lo < 0 or hi >= self.alphabet_size:
                raise ValueError(f"tokens must lie in [0, {self.alphabet_size}), got [{lo}, {hi}]")
        layers = set(repr_layers)
        bad = sorted(i for i in layers if not (isinstance(i, int) and 0 <= i <= self.num_layers))
        if bad:
            raise ValueError(f"repr_layers must be ints in [0, {self.num_layers}], got {bad}")
        return layers

    def forward(self, tokens: Tensor, repr_layers: Sequence[int] = (), need_head_weights: bool = False,
                return_contacts: bool = False, segment_ids: Optional[Tensor] = None) -> Dict[str, Any]:
        """tokens ``[B, L]`` (``<cls>`` seq ``<eos>``, right-padded with ``<pad>``) -> fair-esm's output dict.

        Packed rows: ``segment_ids`` int ``[B, L]``, one contiguous id per sequence (each with its own ``<cls>`` ...
        ``<eos>``), -1 on padding. Rotary positions restart at each sequence and token dropout's rescaling is
        per sequence, so every sequence gets exactly what it gets alone (no probabilities / contacts)."""
        repr_layers = self._check(tokens, repr_layers)
        need_head_weights = need_head_weights or return_contacts
        padding_mask = tokens.eq(self.padding_idx)  # [B, L], True = padding
        positions = None
        if segment_ids is not None:
            check_token_segments(segment_ids, tokens)
            padding_mask = padding_mask | (segment_ids < 0)
            positions = segment_positions(segment_ids)

        x = self.embed_tokens(tokens)  # [B, L, C]
        if self.token_dropout:
            is_mask = tokens.eq(self.mask_idx)
            x = x.masked_fill(is_mask.unsqueeze(-1), 0.0)
            mask_ratio_train = 0.15 * 0.8  # the masking rate of every ESM-2 training run
            if segment_ids is None:
                src_lengths = (~padding_mask).sum(-1)
                mask_ratio_observed = (is_mask.sum(-1).to(x.dtype) / src_lengths)[:, None, None]
            else:  # per sequence of a packed row: counts per id, read back at each token
                ids = segment_ids.clamp(min=0).long()
                real = (~padding_mask).to(x.dtype)
                counts = torch.zeros(ids.shape[0], ids.shape[1] + 1, dtype=x.dtype, device=x.device)
                n_real = counts.scatter_add(1, ids, real).gather(1, ids)
                n_mask = counts.scatter_add(1, ids, (is_mask & ~padding_mask).to(x.dtype)).gather(1, ids)
                mask_ratio_observed = (n_mask / n_real.clamp(min=1))[..., None]
            x = x * (1 - mask_ratio_train) / (1 - mask_ratio_observed)
        x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))

        reps: Dict[int, Tensor] = {}
        if 0 in repr_layers:
            reps[0] = x
        key_mask = None
        # eager: no mask without padding (SDPA's flash kernel takes none); compiled or captured: always one, so that
        # no data-dependent branch breaks the graph
        if segment_ids is None and (not host_reads_allowed(tokens) or padding_mask.any()):
            key_mask = (~padding_mask)[:, None, None, :]  # [B, 1, 1, L]
        checkpoint = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        attn_weights = []
        for i, layer in enumerate(self.layers):
            if checkpoint and not need_head_weights:
                # ESM-2 draws no random numbers (its token dropout is a fixed rescaling): no RNG state to save,
                # which a CUDA graph capture could not read
                x, probs = torch.utils.checkpoint.checkpoint(layer, x, key_mask, False, segment_ids, positions,
                                                             use_reentrant=False, preserve_rng_state=False)
            else:
                x, probs = layer(x, key_mask, need_head_weights, segment_ids, positions)
            if i + 1 in repr_layers:
                reps[i + 1] = x
            if need_head_weights:
                attn_weights.append(probs)

        x = self.emb_layer_norm_after(x)
        if self.num_layers in repr_layers:
            reps[self.num_layers] = x  # the last representation has the final LayerNorm applied
        result: Dict[str, Any] = {"logits": self.lm_head(x), "representations": reps}
        if need_head_weights:
            attentions = torch.stack(attn_weights, 1)  # [B, layers, H, L, L]
            if key_mask is not None:
                keep = (~padding_mask).type_as(attentions)
                attentions = attentions * (keep[:, None, :] * keep[:, :, None])[:, None, None]
            result["attentions"] = attentions
            if return_contacts:
                result["contacts"] = self.contact_head(tokens, attentions)
        return result

    def predict_contacts(self, tokens: Tensor) -> Tensor:
        return self(tokens, return_contacts=True)["contacts"]
