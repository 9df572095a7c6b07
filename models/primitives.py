"""Building blocks shared by the Evoformer and Pairformer: AlphaFold-initialised Linear, LayerNorm,
the attention config, gated multi-head attention on ``attn_ops.attention``, shared-mask dropout and
row chunking.

Shapes use ``*`` for any leading batch dims. Masks are bool with True = real position / attend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

import attn_ops
from attn_ops import registry as _registry

from . import kernels as _kernels
from .shapes import check_multiple, round_up, segment_positions  # noqa: F401 - part of this module's API

Tensor = torch.Tensor

# std of a standard normal truncated to [-2, 2]; dividing by it makes the truncated draw have the
# intended std (AlphaFold2 supplement 1.11.4, "LeCun/He init with a truncated normal").
_TRUNC_STD = 0.87962566103423978


# --------------------------------------------------------------------------------------------------
# Attention configuration: one backend string plus backend options, never boolean flags.
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionConfig:
    """Which ``attn_ops`` backend an attention module uses and the options passed to it.

    ``backend`` is validated against ``attn_ops.registry`` at construction, so a typo fails when the
    model is built (with the list of valid names), not at the first forward. ``options`` are backend
    options forwarded verbatim, e.g. ``{"chunk_size": 256}`` for ``chunked`` or ``{"bwd": "split"}``
    for ``triton``.
    """

    backend: str = "auto"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.backend, str):
            raise TypeError(f"attention backend must be a str, got {type(self.backend).__name__}: {self.backend!r}")
        _registry.validate_backend_name(self.backend)
        if not isinstance(self.options, Mapping):
            raise TypeError(f"attention options must be a mapping, got {type(self.options).__name__}")
        bad = [k for k in self.options if not isinstance(k, str)]
        if bad:
            raise TypeError(f"attention option names must be str, got {bad}")
        if "backend" in self.options:
            raise ValueError("attention options must not contain 'backend'; set AttentionConfig.backend")
        object.__setattr__(self, "options", dict(self.options))

    def __hash__(self):
        return hash((self.backend, tuple(sorted((k, repr(v)) for k, v in self.options.items()))))

    @classmethod
    def coerce(cls, x: Any = None) -> "AttentionConfig":
        """Build a config from None (``auto``), a backend name, a mapping or an AttentionConfig.

        A mapping (dict, omegaconf DictConfig) holds ``backend`` and any backend options, either flat
        (``{"backend": "chunked", "chunk_size": 256}``) or under ``options``. Keys starting with ``_``
        (Hydra's ``_target_``, ``_partial_``) are ignored.
        """
        if x is None:
            return cls()
        if isinstance(x, cls):
            return x
        if isinstance(x, str):
            return cls(backend=x)
        if isinstance(x, Mapping):
            # a null option is unset (the Hydra attention configs list every option, null by default)
            items = {str(k): _plain(v) for k, v in x.items() if not str(k).startswith("_") and v is not None}
            backend = items.pop("backend", "auto")
            options = dict(items.pop("options", None) or {})
            overlap = sorted(set(options) & set(items))
            if overlap:
                raise ValueError(f"attention option(s) {overlap} given both flat and under 'options': {dict(x)}")
            options.update(items)
            return cls(backend=backend, options=options)
        raise TypeError(
            "attention must be None, a backend name, a mapping such as {'backend': 'chunked', "
            f"'chunk_size': 256}} or an AttentionConfig; got {type(x).__name__}: {x!r}"
        )


def at_least_fp32(x: Tensor) -> Tensor:
    """``x`` in float32 if it is a 16-bit float, else unchanged (float64 stays float64)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _plain(v: Any) -> Any:
    """Turn omegaconf containers into plain dicts/lists without importing omegaconf."""
    if isinstance(v, Mapping):
        return {str(k): _plain(u) for k, u in v.items()}
    if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig":
        return [_plain(u) for u in v]
    return v


# --------------------------------------------------------------------------------------------------
# Linear and LayerNorm
# --------------------------------------------------------------------------------------------------
_INITS = ("default", "relu", "glorot", "gating", "final", "normal")


class Linear(nn.Linear):
    """``nn.Linear`` with the AlphaFold2 initialisations (supplement 1.11.4).

    init:
        ``default``: LeCun (truncated normal, std 1/sqrt(fan_in)), bias 0.
        ``relu``: He (truncated normal, std sqrt(2/fan_in)), bias 0; for layers followed by ReLU/SwiGLU.
        ``glorot``: Xavier uniform, bias 0; attention q/k/v projections.
        ``gating``: weights 0, bias 1, so sigmoid gates start mostly open.
        ``final``: weights 0, bias 0; the last layer of every residual update, so blocks start as identity.
        ``normal``: plain normal, std 1/sqrt(fan_in) (pair-bias projections).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, init: str = "default"):
        if init not in _INITS:
            raise ValueError(f"init must be one of {_INITS}, got {init!r}")
        if init == "gating" and not bias:
            raise ValueError("init='gating' needs bias=True (the gate bias starts at 1)")
        self.init = init
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        init = getattr(self, "init", "default")
        w = self.weight
        fan_in = w.shape[1]
        with torch.no_grad():
            if init in ("default", "relu"):
                std = math.sqrt((2.0 if init == "relu" else 1.0) / max(1, fan_in)) / _TRUNC_STD
                nn.init.trunc_normal_(w, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)
            elif init == "glorot":
                nn.init.xavier_uniform_(w, gain=1.0)
            elif init == "normal":
                nn.init.normal_(w, std=1.0 / math.sqrt(max(1, fan_in)))
            else:  # gating, final
                w.zero_()
            if self.bias is not None:
                self.bias.fill_(1.0 if init == "gating" else 0.0)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


# Rows from which an eager CUDA linear with a bias takes ``_LinearBiasByMatmul`` (pair tensors of N >= 512, where the
# step is bound by GPU time; below it the Function's Python host time would cost more than it saves).
BIAS_GRAD_MATMUL_MIN_ROWS = 1 << 18


class _LinearBiasByMatmul(torch.autograd.Function):
    """``F.linear(x, w, b)`` (autocast's dtype rule) whose bias gradient is one matmul, ``1^T @ dy``, instead of
    PyTorch's column sum of ``dy [rows, out]``: that reduction runs at a fraction of the memory bandwidth on the
    hundreds of thousands of rows of a pair tensor. The input and weight gradients are the same two matmuls, and the
    bias gradient takes their precision (a TF32 or reduced-precision matmul setting applies to all three).

    First-order only: a double backward raises (``once_differentiable``) instead of dropping terms; ``linear``
    routes forward-mode AD elsewhere."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        x_c, w_c = x.to(dt), weight.to(dt)
        # keep only what a gradient needs: x for the weight's, the weight for x's (a frozen weight keeps no x)
        ctx.save_for_backward(x_c if weight.requires_grad else None, w_c if x.requires_grad else None)
        ctx.x_shape, ctx.dtype = x.shape, dt
        with torch.autocast(dev, enabled=False):
            return nn.functional.linear(x_c, w_c, bias.to(dt))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(ctx.dtype)  # [rows, out]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ weight).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = dy2.t() @ x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[2]:
            db = (dy2.new_ones(1, dy2.shape[0]) @ dy2).view(-1)
        return dx, dw, db  # autograd casts each to its input's dtype


def _autocast_or_one_dtype(x: Tensor, weight: Tensor, bias: Tensor) -> bool:
    """Whether ``_LinearBiasByMatmul`` casts as ``F.linear`` would: under autocast every operand a 16/32-bit float
    (autocast casts those), else one dtype for all three (no cast at all)."""
    if torch.is_autocast_enabled(x.device.type):
        return all(t.dtype in _kernels.FLOATS for t in (x, weight, bias))
    return x.dtype == weight.dtype == bias.dtype


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``nn.functional.linear``; on eager CUDA with a trainable bias, gradients on, no forward-mode AD and at least
    ``BIAS_GRAD_MATMUL_MIN_ROWS`` rows (fewer inside ``kernels.device_bound``), :class:`_LinearBiasByMatmul` (the
    same output; the bias's gradient by a matmul; first-order). The traced and cheap tests come first: under
    ``torch.compile`` nothing here may become a guard on the input's size."""
    if bias is not None and _kernels.eager_first_order() and x.is_cuda and torch.is_grad_enabled() and \
            bias.requires_grad and type(x) is torch.Tensor and \
            x.numel() >= _kernels.min_rows(BIAS_GRAD_MATMUL_MIN_ROWS) * x.shape[-1] and \
            _autocast_or_one_dtype(x, weight, bias):
        return _LinearBiasByMatmul.apply(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def fused_linear(x: Tensor, layers: Sequence[nn.Linear], split: bool = True):
    """``tuple(layer(x) for layer in layers)`` computed by one matmul on the concatenated weights.

    One read of ``x`` (and one autocast cast of it) instead of one per layer; the outputs are views of
    one ``[*, sum(out_features) + pad]`` tensor (pad below), which ``split=False`` returns whole. Parameters and
    their initialisations stay per layer.

    The concatenated width is padded with zero rows to a multiple of 8 (16 bytes in bf16): a triangle
    attention's q, k, v, gate and 4 bias heads make 516 outputs, and for such a width ``torch.compile`` pads the
    ``[*, 516]`` gradient of the matmul into a new ``[*, 520]`` tensor, a full copy (docs/bench/history.md,
    "Design measurements"). The padded outputs are computed and dropped.
    """
    if len(layers) == 1 and split:
        return (layers[0](x),)
    sizes = [lin.out_features for lin in layers]
    pad = -sum(sizes) % 8
    w0 = layers[0].weight
    zero_rows = [_zeros(w0, pad, layers[0].in_features)] if pad else []
    w = torch.cat([lin.weight for lin in layers] + zero_rows)  # [sum(out) + pad, in]
    b = None
    if any(lin.bias is not None for lin in layers):
        b = torch.cat([
            lin.bias if lin.bias is not None else _zeros(w0, lin.out_features) for lin in layers
        ] + ([_zeros(w0, pad)] if pad else []))
    y = linear(x, w, b)  # [*, sum(out) + pad]
    if not split:
        return y
    return y.split(sizes + ([pad] if pad else []), dim=-1)[: len(layers)]


def rotary_qkv(x: Tensor, projections: Sequence[nn.Linear], cos: Tensor, sin: Tensor, heads: int,
               norms: Optional[Sequence[nn.LayerNorm]] = None, q_scale: float = 1.0, time_first: bool = False):
    """q, k, v ``[B, H, L, D]`` of a rotary self-attention: the three projections of ``x`` ``[B, L, E]`` (``[L, B, E]``
    with ``time_first``) in one matmul, then q and k (layer-normed over the width first with ``norms``) rotated by
    ``cos, sin`` and q scaled by ``q_scale`` in one pass of ``kernels.rotary_qkv`` (one launch each way on CUDA, v
    and the fused gradient included); v in the dtype of the matmul."""
    C = projections[0].out_features
    y = fused_linear(x, projections, split=False)  # [*, 3C + pad]
    if time_first:
        y = y.transpose(0, 1)
    weight = torch.stack([n.weight for n in norms]) if norms else None  # [2, C]
    q, k, v = _kernels.rotary_qkv(y, C, cos, sin, heads, weight, norms[0].eps if norms else 1e-5,
                                  scales=(q_scale, 1.0))  # [B, L, C] each
    return tuple(t.unflatten(-1, (heads, C // heads)).transpose(1, 2) for t in (q, k, v))


_ZEROS: dict = {}  # (device, dtype) -> a zero buffer that _zeros hands out views of
_ZEROS_OUTGROWN: list = []  # buffers replaced by larger ones, kept alive


def _zeros(like: Tensor, *shape: int) -> Tensor:
    """Zeros of ``shape`` in ``like``'s dtype and device, read-only: in eager mode a view of one cached buffer (no
    allocation and no fill kernel per call: ``fused_linear`` pads every call with them); traced, plain zeros."""
    if torch.compiler.is_compiling() or type(like) not in (torch.Tensor, nn.Parameter) or like.is_meta or (
            like.is_cuda and torch.cuda.is_current_stream_capturing()):
        # traced, a fake / meta / subclass tensor, or inside CUDA graph capture (a buffer made there is only filled
        # at replay): plain zeros
        return like.new_zeros(shape)
    n = math.prod(shape)
    key = (like.device, like.dtype)
    buf = _ZEROS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:  # a captured CUDA graph may still read the smaller one: never hand its memory back
            _ZEROS_OUTGROWN.append(buf)
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whatever mode the caller runs in
            buf = _ZEROS[key] = torch.zeros(max(n, 1024), dtype=like.dtype, device=like.device)
    return buf[:n].view(shape)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dim (elementwise affine, eps 1e-5).

    Under autocast, plain ``nn.LayerNorm`` returns float32 (even for a bf16 input), which every following
    linear casts back to bf16/fp16: on pair tensors ``[B, N, N, c]`` that is the largest memory traffic of
    a block. Here the output comes back in the autocast dtype, the one the next matmul wants: a float32
    input is normalised in float32 first (a large mean would swamp a bf16 cast), a low-precision input is
    normalised in its own dtype (the kernel accumulates in float32). Without autocast: plain LayerNorm.

    On CUDA in eager mode, for at least ``kernels.LAYER_NORM_MIN_ROWS`` rows (fewer inside ``kernels.device_bound``,
    as in a CUDA graph capture) or a non-contiguous view (the ending
    node's transposed pair, the triangle product's channels-last view: PyTorch would copy it first), the Triton
    kernels of ``kernels.layer_norm`` do it (float32 statistics, the same output dtypes), reading such views in place
    and handing their gradient back in the view's layout; under ``torch.compile``, for fewer rows of a contiguous
    input and elsewhere, the PyTorch path above.
    """

    def __init__(self, c: int, eps: float = 1e-5):
        super().__init__(c, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(self, x)


class _NormView(NamedTuple):
    """Another project's last-dim layer norm under ``nn.LayerNorm``'s attribute names (``kernels.layer_norm``)."""

    normalized_shape: Tuple[int, ...]
    weight: Tensor
    bias: Tensor
    eps: float


def layer_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """``norm(x)`` as :class:`LayerNorm` computes it, for that class and for another project's affine layer norm over
    the last dim (``nn.LayerNorm``, OpenFold's, Boltz's and OpenFold3's ``LayerNorm``: ``weight``, ``bias``, ``eps``
    and ``normalized_shape`` or ``c_in``), which the in-place integrations run on their own parameters."""
    weight, bias, eps = norm.weight, norm.bias, norm.eps
    if isinstance(norm, nn.LayerNorm):
        shape = norm.normalized_shape
    else:
        shape = tuple(norm.c_in)
        norm = _NormView(shape, weight, bias, eps)
    dev = x.device.type
    auto = torch.is_autocast_enabled(dev)
    autocast_input = auto and x.dtype in (torch.float32, torch.get_autocast_dtype(dev))
    if dev == "cuda" and _kernels.eager_first_order() and (autocast_input or not auto) and (
            x.numel() >= _kernels.min_rows(_kernels.LAYER_NORM_MIN_ROWS) * x.shape[-1] or
            (_kernels.LAYER_NORM_STRIDED and not x.is_contiguous())):
        # eager CUDA: the Triton kernels (float32 statistics, any row layout, several rows per program; the
        # module's kernel runs one block per row: slow on the 128 channels of large pair tensors, and a
        # transposed or channels-last view costs it a transposing copy first)
        y = None if weight is None or bias is None else _kernels.layer_norm(
            x, norm, torch.get_autocast_dtype(dev) if auto else x.dtype)
        if y is not None:
            return y
    if autocast_input:
        dt = torch.get_autocast_dtype(dev)
        with torch.autocast(dev, enabled=False):
            if x.dtype == dt:
                # already low precision: one pass that also makes a transposed view (ending node,
                # MSA columns) contiguous, instead of layer_norm's own copy
                x = x.contiguous()
                return nn.functional.layer_norm(x, shape, None if weight is None else weight.to(dt),
                                                None if bias is None else bias.to(dt), eps)
            # float32 residual stream: normalise in float32 (a large mean would swamp a bf16 input),
            # then hand the next matmul the autocast dtype
            return nn.functional.layer_norm(x, shape, weight, bias, eps).to(dt)
    return nn.functional.layer_norm(x, shape, weight, bias, eps)


# --------------------------------------------------------------------------------------------------
# Dropout with a mask shared along one dim (AF2 "DropoutRowwise"/"DropoutColumnwise")
# --------------------------------------------------------------------------------------------------
class SharedDropout(nn.Module):
    """Dropout whose mask is shared along ``shared_dim``.

    For a pair tensor ``[*, N_i, N_j, C]`` (or MSA ``[*, S, N, C]``), AF2's row-wise dropout uses one
    mask for all rows: ``shared_dim=-3``; column-wise uses one mask for all columns: ``shared_dim=-2``.
    """

    def __init__(self, p: float, shared_dim: int):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout p must be in [0, 1), got {p}")
        self.p = p
        self.shared_dim = shared_dim

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = list(x.shape)
        shape[self.shared_dim] = 1
        keep = torch.empty(shape, device=x.device, dtype=x.dtype).bernoulli_(1.0 - self.p)
        return x * keep.div_(1.0 - self.p)  # scale the small shared mask, not x: one pass over x

    def extra_repr(self) -> str:
        return f"p={self.p}, shared_dim={self.shared_dim}"


class LineDropout(nn.Module):
    """Dropout of whole rows (``dim=-3``) or whole columns (``dim=-2``) of a pair tensor ``[B, N_i, N_j, C]``.

    One keep/drop draw per batch element and row i (or column j), shared by the other index and every
    channel: Boltz's ``get_dropout_mask``. ``SharedDropout`` instead shares one mask over all rows and
    draws per column and channel (AF2).
    """

    def __init__(self, p: float, dim: int):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout p must be in [0, 1), got {p}")
        if dim not in (-3, -2):
            raise ValueError(f"LineDropout dim must be -3 (rows) or -2 (columns), got {dim}")
        self.p = p
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.ndim < 4:
            raise ValueError(f"LineDropout expects [B, N_i, N_j, C], got {tuple(x.shape)}")
        shape = [x.shape[0]] + [1] * (x.ndim - 1)
        shape[self.dim] = x.shape[self.dim]  # [B, N, 1, 1] rows or [B, 1, N, 1] columns
        keep = torch.empty(shape, device=x.device, dtype=x.dtype).bernoulli_(1.0 - self.p)
        return x * keep.div_(1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, dim={self.dim}"


# --------------------------------------------------------------------------------------------------
# Row chunking for inference
# --------------------------------------------------------------------------------------------------
def chunk_rows(
    fn: Callable[..., Tensor],
    args: Sequence[Optional[Tensor]],
    dims: Sequence[Optional[int]],
    chunk_size: Optional[int],
    out_dim: int,
) -> Tensor:
    """Run ``fn(*args)`` over chunks of a row dim and concatenate the results along ``out_dim``.

    ``dims[i]`` is the row dim of ``args[i]`` (negative, counted from the end), or None for an argument
    passed whole (e.g. a pair bias shared by all rows). An argument whose row dim has size 1 is
    broadcast over rows and also passed whole. With ``chunk_size`` None (or >= rows) ``fn`` runs once.
    """
    n = None
    for a, d in zip(args, dims):
        if a is not None and d is not None and a.shape[d] != 1:
            if n is not None and a.shape[d] != n:
                raise ValueError(f"chunk_rows: row dims disagree ({n} vs {a.shape[d]} in {tuple(a.shape)})")
            n = a.shape[d]
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")
    if chunk_size is None or n is None or n <= chunk_size:
        return fn(*args)
    outs = []
    for start in range(0, n, chunk_size):
        part = []
        for a, d in zip(args, dims):
            if a is None or d is None or a.shape[d] == 1:
                part.append(a)
            else:
                part.append(a.narrow(d, start, min(chunk_size, n - start)))
        outs.append(fn(*part))
    return torch.cat(outs, dim=out_dim)


# --------------------------------------------------------------------------------------------------
# Gated multi-head attention
# --------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Gated multi-head attention with an optional additive bias and key mask (AF2 Alg. 7-8, AF3 Alg. 24).

    Projections q, k, v: ``c_q/c_kv -> num_heads * c_hidden`` (Glorot, no bias unless ``q_bias``);
    gate ``sigmoid(Linear(q_x))`` (weights 0, bias 1); output ``Linear(num_heads * c_hidden -> c_q)``
    (zero init). The attention itself is ``attn_ops.attention`` with the configured backend, scale
    ``c_hidden ** -0.5``.

    Args:
        attention: anything ``AttentionConfig.coerce`` accepts (None, "triton", {"backend": ..., ...}).
        q_bias: a bias on the query projection (AF3's AttentionPairBias has one).
        out_bias: a bias on the output projection (AF2 has one; AF3's single attention does not).
        gate_bias: a bias on the gate projection (default, started at 1); Boltz-2's gates have none, so
            they start at ``sigmoid(0) = 0.5``.
    """

    def __init__(
        self,
        c_q: int,
        c_kv: int,
        c_hidden: int,
        num_heads: int,
        gating: bool = True,
        attention: Any = None,
        q_bias: bool = False,
        out_bias: bool = True,
        gate_bias: bool = True,
    ):
        super().__init__()
        self.c_hidden = c_hidden
        self.num_heads = num_heads
        self.attention = AttentionConfig.coerce(attention)
        hc = num_heads * c_hidden
        self.linear_q = Linear(c_q, hc, bias=q_bias, init="glorot")
        self.linear_k = Linear(c_kv, hc, bias=False, init="glorot")
        self.linear_v = Linear(c_kv, hc, bias=False, init="glorot")
        self.linear_g = None
        if gating:  # weights 0: the gate starts at sigmoid(bias) = sigmoid(1), or 0.5 without a bias
            self.linear_g = Linear(c_q, hc, bias=gate_bias, init="gating" if gate_bias else "final")
        self.linear_o = Linear(hc, c_q, bias=out_bias, init="final")

    def _heads(self, x: Tensor) -> Tensor:
        # [*, L, H*C] -> [*, L, H, C] -> [*, H, L, C]
        return x.unflatten(-1, (self.num_heads, self.c_hidden)).transpose(-2, -3)

    def project(self, q_x: Tensor, kv_x: Tensor, extra: Sequence[nn.Linear] = ()) -> Tuple[Tensor, ...]:
        """Projections ``(q, k, v, g, *extra)``, each ``[*, L, out]`` (``g`` None without gating).

        Self-attention (``kv_x is q_x``) computes all of them, plus the ``extra`` linears of ``q_x`` (e.g.
        a pair-bias projection of the same normalised input), with one matmul.
        """
        if q_x.shape[:-2] != kv_x.shape[:-2]:
            raise ValueError(
                f"q_x {tuple(q_x.shape)} and kv_x {tuple(kv_x.shape)} must share the leading batch dims"
            )
        gate = [] if self.linear_g is None else [self.linear_g]
        if kv_x is q_x:
            outs = fused_linear(q_x, [self.linear_q, self.linear_k, self.linear_v] + gate + list(extra))
            q, k, v, rest = outs[0], outs[1], outs[2], outs[3:]
        else:
            outs = fused_linear(q_x, [self.linear_q] + gate + list(extra))
            q, rest = outs[0], outs[1:]
            k, v = fused_linear(kv_x, [self.linear_k, self.linear_v])
        g = rest[0] if gate else None
        return (q, k, v, g) + tuple(rest[len(gate):])

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], bias: Optional[Tensor], mask: Optional[Tensor]
    ) -> Tensor:
        """Attention on projected ``q [*, Lq, H*C]``, ``k, v [*, Lk, H*C]``, gate ``g [*, Lq, H*C]`` -> ``[*, Lq, c_q]``."""
        q, k, v = self._heads(q), self._heads(k), self._heads(v)  # [*, H, L, C]
        o = attn_ops.attention(
            q, k, v, bias, mask, backend=self.attention.backend, **self.attention.options
        )  # [*, H, Lq, C]
        o = o.transpose(-2, -3).flatten(-2)  # [*, Lq, H*C]
        if g is not None:
            o = o * torch.sigmoid(g)
        return self.linear_o(o)

    def forward(
        self,
        q_x: Tensor,
        kv_x: Tensor,
        bias: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
    ) -> Tensor:
        """Attend from ``q_x`` to ``kv_x``.

        Args:
            q_x: ``[*, Lq, c_q]``; kv_x: ``[*, Lk, c_kv]``.
            bias: float, broadcastable to ``[*, H, Lq, Lk]`` (e.g. a pair bias ``[B, 1, H, L, L]`` shared
                by all rows); it is passed to the op as is, never expanded.
            mask: bool, broadcastable to ``[*, H, Lq, Lk]``, True = attend (e.g. a key mask ``[B, R, 1, 1, Lk]``).

        Returns:
            ``[*, Lq, c_q]``. A query with no key to attend gets the output projection's bias only.
        """
        q, k, v, g = self.project(q_x, kv_x)
        return self.attend(q, k, v, g, bias, mask)


# --------------------------------------------------------------------------------------------------
# Transitions
# --------------------------------------------------------------------------------------------------
def _row_dim(x: Tensor) -> int:
    """Row dim to chunk over: -3 for pair/MSA tensors ``[B, R, L, C]``, -2 for ``[B, L, C]``."""
    return -3 if x.ndim >= 4 else -2


class Transition(nn.Module):
    """AF2 transition (Alg. 9 / 15): ``x -> Linear(relu(Linear(LN(x))))``, hidden width ``n * c``.

    Input/output ``[*, c]``; ``chunk_size`` runs it over chunks of rows (see ``_row_dim``), for inference.
    """

    def __init__(self, c: int, n: int = 4):
        super().__init__()
        self.layer_norm = LayerNorm(c)
        self.linear_1 = Linear(c, n * c, init="relu")
        self.linear_2 = Linear(n * c, c, init="final")

    def _run(self, x: Tensor) -> Tensor:
        return self.linear_2(torch.relu(self.linear_1(self.layer_norm(x))))

    def forward(self, x: Tensor, chunk_size: Optional[int] = None) -> Tensor:
        dim = _row_dim(x)
        return chunk_rows(self._run, [x], [dim], chunk_size, out_dim=dim)


class SwiGLUTransition(nn.Module):
    """AF3 transition (AF3 supplement Alg. 11): ``Linear(silu(a) * b)`` with ``a, b = Linear(LN(x))``.

    No biases; hidden width ``n * c``. Input/output ``[*, c]``; ``chunk_size`` chunks rows (``_row_dim``).
    """

    def __init__(self, c: int, n: int = 4):
        super().__init__()
        self.layer_norm = LayerNorm(c)
        self.linear_ab = Linear(c, 2 * n * c, bias=False, init="relu")
        self.linear_out = Linear(n * c, c, bias=False, init="final")

    def _run(self, x: Tensor) -> Tensor:
        a, b = self.linear_ab(self.layer_norm(x)).chunk(2, dim=-1)  # 2 x [*, n*c]
        return self.linear_out(nn.functional.silu(a) * b)

    def forward(self, x: Tensor, chunk_size: Optional[int] = None) -> Tensor:
        dim = _row_dim(x)
        return chunk_rows(self._run, [x], [dim], chunk_size, out_dim=dim)


# --------------------------------------------------------------------------------------------------
# Running a stack of blocks with activation checkpointing
# --------------------------------------------------------------------------------------------------
def run_blocks(
    blocks: Sequence[nn.Module],
    x: Tensor,
    y: Tensor,
    masks: Sequence[Optional[Tensor]],
    checkpoint_every: int,
    chunk_size: Optional[int],
    training: bool,
):
    """Run ``(x, y) = block(x, y, *masks, chunk_size=chunk_size)`` for every block.

    With ``checkpoint_every = k > 0`` in training (and with autograd on), every segment of ``k`` blocks
    runs under ``torch.utils.checkpoint`` (``use_reentrant=False``; the RNG state is restored on the
    recompute, so dropout masks match): only the segment inputs are kept, activations are recomputed
    in the backward.
    """
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")

    def segment(start: int, stop: int):
        def run(x: Tensor, y: Tensor, *ms: Optional[Tensor]):
            for blk in blocks[start:stop]:
                x, y = blk(x, y, *ms, chunk_size=chunk_size)
            return x, y

        return run

    n = len(blocks)
    if checkpoint_every == 0 or not training or not torch.is_grad_enabled():
        return segment(0, n)(x, y, *masks)
    for start in range(0, n, checkpoint_every):
        stop = min(n, start + checkpoint_every)
        x, y = torch.utils.checkpoint.checkpoint(segment(start, stop), x, y, *masks, use_reentrant=False)
    return x, y


def host_reads_allowed(t: Tensor) -> bool:
    """False while ``torch.compile`` traces or a CUDA graph capture records on ``t``'s device: a check or a branch
    that reads ``t``'s values on the host (a device sync) cannot run there (compiled graphs would break; a capture
    fails). Callers skip such checks there and take the branch that is right for every input."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_token_segments(segment_ids: torch.Tensor, tokens: torch.Tensor) -> None:
    """A model's ``segment_ids`` argument: an integer tensor shaped like ``tokens`` (else ValueError naming it)."""
    if segment_ids.shape != tokens.shape or segment_ids.dtype.is_floating_point or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids must be an integer tensor {tuple(tokens.shape)} like tokens, got "
                         f"{segment_ids.dtype} {tuple(segment_ids.shape)}")
