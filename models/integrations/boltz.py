"""Boltz-1 and Boltz-2 attention on ``attn_ops.attention`` (layouts of boltz 2.2.1).

Patched in place, wherever they sit (Pairformer, MSA module's pair stack, template module, diffusion transformer):
- ``TriangleAttention`` (starting and ending node, ``boltz.model.layers.triangular_attention.attention``): the
  triangle bias ``[*, 1, H, I, J]`` is broadcast over the rows by the op, never expanded. With Boltz's own
  ``chunk_size`` argument (its inference setting) the rows are computed by chunks of ``chunk_size`` rows after the
  bias: the transient memory is one chunk's projections instead of Boltz's ``[chunk, H, J, J]`` logits.
  ``use_kernels`` is served by the op too (it selects cuequivariance in Boltz's own forward).
- ``AttentionPairBias`` of ``boltz.model.layers.attention`` (Boltz-1) and ``.attentionv2`` (Boltz-2): float32
  attention as Boltz computes it; a ``multiplicity > 1`` pair bias is broadcast over the diffusion samples instead
  of repeated.
- ``PairformerLayer`` and ``PairformerNoSeqLayer`` of ``boltz.model.layers.pairformer`` (Boltz-2's trunk, template
  and MSA modules' pair stacks): without autograd in eval mode (Boltz's inference) the layer runs the memory-bounded
  path of ``attn_zoo.models.inference`` on Boltz's own modules: z is copied once (Boltz returns a new, float32 z)
  and each pair update is added into that copy in place, by chunks of ``chunk_size_tri_attn`` rows (None: whole),
  triangle multiplication holding one stored projection, the transition one chunk's hidden width, the single
  attention's pair bias built by row chunks. Boltz's own forward materialises the full-size update, its residual
  sum and the transition's four-times-wider hidden layer (about 14 z-sizes at once, against 2 here). With autograd
  or in train mode (dropout) the layer runs Boltz's own forward, its attention modules patched as above.
Not patched: ``PairWeightedAveraging`` (the MSA module's pair-weighted averaging): its weights are a softmax of the
pair bias alone, shared by every MSA row, which Boltz already computes once; a fused op would recompute it per row.

Masks: Boltz adds ``-inf * (1 - mask)``; the op takes ``mask.bool()`` (Boltz's own kernel path does the same). A
query row with no key to attend (a padded row) gives 0 here, where Boltz gives an average over the masked keys;
real positions never read those rows (every later attention masks them as keys and the masked products zero them).
"""
from __future__ import annotations

import sys
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

import attn_ops
from attn_ops import registry as attn_registry

from .. import inference
from ..primitives import chunk_rows, fused_linear
from ..triangle import TriangleMultiplication
from .common import Options, fusable, layer_norm, modules_of, original_forward, plain_layer_norm, plain_linear
from .openfold import RowAttention, check_chunk_size, triangle_core

LOOKS_FOR = (
    "boltz.model.layers.triangular_attention.attention.TriangleAttention (Boltz-1/2)",
    "boltz.model.layers.attention.AttentionPairBias (Boltz-1)",
    "boltz.model.layers.attentionv2.AttentionPairBias (Boltz-2)",
    "boltz.model.layers.pairformer.PairformerLayer and PairformerNoSeqLayer (Boltz-2: no-grad inference in place)",
    "boltz.model.layers.triangular_mult.TriangleMultiplicationOutgoing and Incoming (Boltz-1/2)",
    "boltz.model.layers.transition.Transition (Boltz-1/2)",
)


def _classes() -> Tuple[tuple, tuple]:
    """(triangle attention classes, attention-with-pair-bias classes) of the installed boltz, or empty."""
    # a module of a class can exist only once its module is imported: nothing is imported here
    tri = sys.modules.get("boltz.model.layers.triangular_attention.attention")
    apb = [sys.modules.get(f"boltz.model.layers.{name}") for name in ("attention", "attentionv2")]
    return ((tri.TriangleAttention,) if tri else ()), tuple(m.AttentionPairBias for m in apb if m is not None)


def _layer_classes() -> tuple:
    """Boltz-2's ``PairformerLayer`` and ``PairformerNoSeqLayer``, or empty."""
    pf = sys.modules.get("boltz.model.layers.pairformer")
    return (pf.PairformerLayer, pf.PairformerNoSeqLayer) if pf else ()


def _update_classes() -> Tuple[tuple, tuple]:
    """(Boltz's two triangle multiplications, its ``Transition``), or empty."""
    tm = sys.modules.get("boltz.model.layers.triangular_mult")
    tr = sys.modules.get("boltz.model.layers.transition")
    mul = (tm.TriangleMultiplicationOutgoing, tm.TriangleMultiplicationIncoming) if tm else ()
    return mul, ((tr.Transition,) if tr else ())


def find(model: nn.Module) -> List[nn.Module]:
    tri, apb = _classes()
    layers = _layer_classes()
    mul, trans = _update_classes()
    exact = layers + mul + trans
    # a layer, triangle multiplication or transition is patched only where it runs the forward reproduced here (not
    # a subclass's own)
    return [m for m in modules_of(model, tri + apb + exact)
            if not isinstance(m, exact) or any(type(m).forward is cls.forward for cls in exact)]


def patch_targets(modules: List[nn.Module]) -> List[Tuple[nn.Module, object]]:
    tri, _ = _classes()
    layers = _layer_classes()
    mul, trans = _update_classes()
    v2 = sys.modules.get("boltz.model.layers.attentionv2")
    out = []
    for m in modules:
        if isinstance(m, tri):
            out.append((m, triangle_attention))
        elif mul and isinstance(m, mul):
            out.append((m, triangle_multiplication))
        elif trans and isinstance(m, trans):
            out.append((m, transition))
        elif layers and isinstance(m, layers[0]):
            out.append((m, pairformer_layer))
        elif layers and isinstance(m, layers[1]):
            out.append((m, pairformer_noseq_layer))
        elif v2 is not None and isinstance(m, v2.AttentionPairBias):
            out.append((m, attention_pair_bias_v2))
        else:
            out.append((m, attention_pair_bias_v1))
    return out


# --------------------------------------------------------------------------------------------------
# Triangle attention (AF2 Alg. 13/14 as Boltz writes it)
# --------------------------------------------------------------------------------------------------
def triangle_attention(mod: nn.Module, options: Options, x: Tensor, mask: Optional[Tensor] = None,
                       chunk_size: Optional[int] = None, use_kernels: bool = False) -> Tensor:
    """Boltz's ``TriangleAttention.forward``: ``x [*, I, J, C_in]``, ``mask [*, I, J]`` (OpenFold's module)."""
    return triangle_core(mod, options, x, mask, chunk_size)


# --------------------------------------------------------------------------------------------------
# Triangle multiplication (AF3 Alg. 12 as Boltz writes it) and the SwiGLU transition, on our blocks' code
# --------------------------------------------------------------------------------------------------
class _OurTriangleMultiplication:
    """A Boltz ``TriangleMultiplicationOutgoing`` / ``Incoming`` under our ``TriangleMultiplication``'s names, run by
    that class's forward: one matmul for Boltz's ``p_in`` and ``g_in`` (our ``[a | b]`` projection and its gate),
    the gating, mask and channels-first layout in one Triton pass on eager CUDA, the product's rows padded for
    cuBLAS, the layer norms on our kernels. Boltz's math: ``x_ij = sum_k a_ik b_jk`` (outgoing) or
    ``sum_k a_ki b_kj`` (incoming) of the gated, masked projections, then ``p_out(norm_out(x)) * sigmoid(g_out(zn))``."""

    forward = TriangleMultiplication.forward
    _gated_channels_first = TriangleMultiplication._gated_channels_first

    def __init__(self, mod: nn.Module, outgoing: bool):
        self.outgoing, self.c_hidden = outgoing, mod.p_in.out_features // 2
        self.linear_ab_p, self.linear_ab_g, self.linear_z, self.linear_g = mod.p_in, mod.g_in, mod.p_out, mod.g_out
        self.layer_norm_in = lambda x: layer_norm(mod.norm_in, x)
        self.layer_norm_out = lambda x: layer_norm(mod.norm_out, x)


def _ours_serves_triangle_multiplication(mod: nn.Module, x: Tensor) -> bool:
    return all(plain_layer_norm(n) for n in (mod.norm_in, mod.norm_out)) and \
        fusable(x, [mod.p_in, mod.g_in]) and plain_linear(mod.p_out) and plain_linear(mod.g_out)


def triangle_multiplication(mod: nn.Module, options: Options, x: Tensor, mask: Tensor,
                            use_kernels: bool = False) -> Tensor:
    """Boltz's ``TriangleMultiplicationOutgoing/Incoming.forward``: ``x [B, N, N, D]``, ``mask [B, N, N]``. With
    ``use_kernels`` (cuEquivariance's fused kernel, asked for by name) Boltz's own forward runs, as it does for a
    layout this code does not know."""
    if use_kernels or not _ours_serves_triangle_multiplication(mod, x):
        return original_forward(mod)(x, mask, use_kernels=use_kernels)
    if mask.shape != x.shape[:-1]:
        raise ValueError(f"mask: expected shape {tuple(x.shape[:-1])} (x without channels), got {tuple(mask.shape)}")
    outgoing = isinstance(mod, _update_classes()[0][0])
    return _OurTriangleMultiplication(mod, outgoing).forward(x, mask)


def transition(mod: nn.Module, options: Options, x: Tensor, chunk_size: Optional[int] = None) -> Tensor:
    """Boltz's ``Transition.forward``: ``fc3(silu(fc1(xn)) * fc2(xn))`` of ``xn = norm(x)``, ``fc1`` and ``fc2`` as
    one matmul and the norm on our kernels. Boltz's inference form (``chunk_size`` in eval mode: the hidden width by
    chunks, for memory) runs Boltz's own forward."""
    if (chunk_size is not None and not mod.training) or not plain_layer_norm(mod.norm) or \
            not fusable(x, [mod.fc1, mod.fc2]) or not plain_linear(mod.fc3):
        return original_forward(mod)(x, chunk_size)
    a, b = fused_linear(layer_norm(mod.norm, x), [mod.fc1, mod.fc2])
    return mod.fc3(nn.functional.silu(a) * b)


# --------------------------------------------------------------------------------------------------
# Single attention with pair bias (AF3 Alg. 24 as Boltz writes it)
# --------------------------------------------------------------------------------------------------
def _pair_bias_attention(mod: nn.Module, options: Options, s: Tensor, k_in: Tensor, bias: Tensor, mask: Tensor,
                         multiplicity: int) -> Tensor:
    """Boltz's attention core: float32 q/k/v (autocast off, as Boltz computes it), gate, output projection.
    ``s [B, Lq, c_s]``, ``k_in [B, Lk, c_s]``, ``bias [B/m, H, Lq, Lk]``, ``mask [B, Lk]``."""
    B, H, D = s.shape[0], mod.num_heads, mod.head_dim
    if not isinstance(multiplicity, int) or multiplicity < 1 or B % multiplicity:
        raise ValueError(f"multiplicity must be a positive int dividing the batch {B}, got {multiplicity!r}")
    if mask.shape[0] != B or mask.shape[-1] != k_in.shape[1]:
        raise ValueError(f"mask: expected shape {(B, k_in.shape[1])}, got {tuple(mask.shape)}")
    q = mod.proj_q(s).view(B, -1, H, D)
    k = mod.proj_k(k_in).view(B, -1, H, D)
    v = mod.proj_v(k_in).view(B, -1, H, D)
    g = mod.proj_g(s).sigmoid()
    m = multiplicity
    with torch.autocast("cuda", enabled=False):
        # [B/m, m, H, L, D]: the pair bias [B/m, 1, H, Lq, Lk] is shared by the m samples without a copy
        qf, kf, vf = (t.float().transpose(1, 2).unflatten(0, (B // m, m)) for t in (q, k, v))
        keys = mask.bool().view(B // m, m, 1, 1, -1)
        o = attn_ops.attention(qf, kf, vf, bias=bias.float().unsqueeze(1), mask=keys, scale=D ** -0.5,
                               **options.kwargs())  # [B/m, m, H, Lq, D]
        o = o.flatten(0, 1).transpose(1, 2).to(v.dtype)  # [B, Lq, H, D]
    return mod.proj_o(g * o.reshape(B, -1, mod.c_s))


def attention_pair_bias_v2(mod: nn.Module, options: Options, s: Tensor, z: Tensor, mask: Tensor, k_in: Tensor,
                           multiplicity: int = 1) -> Tensor:
    """Boltz-2's ``AttentionPairBias.forward`` (``boltz.model.layers.attentionv2``: Pairformer, diffusion
    transformer): keys given, ``proj_z`` a projection or (``compute_pair_bias=False``) the bias itself."""
    return _pair_bias_attention(mod, options, s, k_in, mod.proj_z(z), mask, multiplicity)


def attention_pair_bias_v1(mod: nn.Module, options: Options, s: Tensor, z: Tensor, mask: Tensor,
                           multiplicity: int = 1, to_keys=None, model_cache=None) -> Tensor:
    """Boltz-1's ``AttentionPairBias.forward`` (``boltz.model.layers.attention``: trunk Pairformer, diffusion
    transformer): an initial norm, keys through ``to_keys`` (windowed atom attention), a cached pair bias."""
    if mod.initial_norm:
        s = mod.norm_s(s)
    if to_keys is not None:
        k_in = to_keys(s)
        mask = to_keys(mask.unsqueeze(-1)).squeeze(-1)
    else:
        k_in = s
    if model_cache is None or "z" not in model_cache:
        z = mod.proj_z(z)
        if model_cache is not None:
            model_cache["z"] = z
    else:
        z = model_cache["z"]
    return _pair_bias_attention(mod, options, s, k_in, z, mask, multiplicity)


# --------------------------------------------------------------------------------------------------
# Pairformer layers without autograd: the memory-bounded path of attn_zoo.models.inference on Boltz's modules
# --------------------------------------------------------------------------------------------------
class _TriangleMultiplication:
    """Boltz's ``TriangleMultiplicationOutgoing`` / ``Incoming`` under the names ``inference.triangle_multiplication_``
    reads (those of our ``TriangleMultiplication*``: Boltz's ``p_in`` / ``g_in`` are our ``[a | b]`` projection and
    its gate, ``p_out`` / ``g_out`` the output projection and gate). ``fused``: Boltz's cuEquivariance kernel
    (``use_kernels``), run whole."""

    def __init__(self, mod: nn.Module, outgoing: bool, fused: bool):
        self.mod, self.outgoing, self.fused = mod, outgoing, fused
        self.c_hidden = mod.p_in.out_features // 2
        self.layer_norm_in, self.linear_ab_p, self.linear_ab_g = mod.norm_in, mod.p_in, mod.g_in
        self.layer_norm_out, self.linear_z, self.linear_g = mod.norm_out, mod.p_out, mod.g_out

    def __call__(self, z: Tensor, pair_mask: Tensor) -> Tensor:  # the whole-tensor form: Boltz's own forward
        return self.mod(z, mask=pair_mask, use_kernels=self.fused)


class _TriangleAttention:
    """Boltz's (OpenFold's) ``TriangleAttention`` under the names ``inference.triangle_attention_`` reads, its
    attention on ``attn_ops.attention`` (``RowAttention``)."""

    def __init__(self, mod: nn.Module, options: Options):
        self.mod, self.options, self.starting = mod, options, mod.starting
        self.layer_norm, self.linear_bias, self.mha = mod.layer_norm, mod.linear, RowAttention(mod.mha, options)

    def __call__(self, z: Tensor, pair_mask: Tensor) -> Tensor:  # the whole-tensor form
        return triangle_core(self.mod, self.options, z, pair_mask, None)


class _Transition:
    """Boltz's ``Transition`` as ``inference.rows_update_`` runs a transition (``_run``: rows in, update out)."""

    def __init__(self, mod: nn.Module):
        self._run = mod


class _PairStack:
    """The pair half of a Boltz layer under a ``PairformerBlock``'s names, for ``inference.pair_stack_``."""

    mask_transitions = False

    def __init__(self, layer: nn.Module, options: Options, fused_mul: bool):
        self.tri_mul_out = _TriangleMultiplication(layer.tri_mul_out, True, fused_mul)
        self.tri_mul_in = _TriangleMultiplication(layer.tri_mul_in, False, fused_mul)
        self.tri_att_start = _TriangleAttention(layer.tri_att_start, options)
        self.tri_att_end = _TriangleAttention(layer.tri_att_end, options)
        self.pair_transition = _Transition(layer.transition_z)


def _bounded(layer: nn.Module, z: Tensor, chunk_size) -> bool:
    """Whether a layer call runs the memory-bounded path: without autograd, in eval mode (no dropout)."""
    check_chunk_size(chunk_size)
    return not torch.is_grad_enabled() and not layer.training and z.ndim == 4


def _row_chunk(layer: nn.Module, options: Options, z: Tensor, chunk_size: Optional[int]) -> int:
    """Rows per chunk: Boltz's ``chunk_size_tri_attn`` (None: every row), or fewer where the bounded path's plan
    (``inference.plan_inference``: the same estimate, the attention backend's score tiles included, against the
    free memory of a CUDA device, elsewhere the chunk-size rule alone) asks for fewer."""
    n = z.shape[-2]
    want = n if chunk_size is None else min(chunk_size, n)
    ta, cz = layer.tri_att_start, layer.tri_mul_out.norm_in.normalized_shape[0]
    single = {} if getattr(layer, "attention", None) is None else dict(c_s=layer.attention.c_s,
                                                                        num_heads_single=layer.attention.num_heads)
    dims = inference.Dims(c_z=cz, c_hidden_mul=layer.tri_mul_out.p_in.out_features // 2,
                          num_heads_pair=ta.mha.no_heads, c_hidden_pair=ta.mha.c_hidden,
                          transition_n=max(1, layer.transition_z.hidden // cz), **single)
    dev = z.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else z.dtype  # the attention's inputs

    def scores(problems: int, lq: int, lk: int) -> int:
        return attn_registry.forward_scratch_bytes(options.backend, device=dev, dtype=dtype,
                                                   head_dim=ta.mha.c_hidden, batch=problems, lq=lq, lk=lk)

    try:
        plan = inference.plan_inference(dims, n, inference.free_device_memory(z.device), batch=z.shape[0],
                                        dtype=z.dtype, inplace=True, scores=scores)
    except ValueError:  # not even chunks of one row fit the free memory: Boltz's chunk, as it would run
        return want
    return min(want, plan.chunk_size)


def _pair_stack(layer: nn.Module, options: Options, z: Tensor, pair_mask: Tensor, chunk_size: Optional[int],
                fused_mul: bool) -> Tuple[Tensor, int]:
    """Boltz's pair stack (``z = z + dropout * update`` five times, dropout 1 in eval mode) on a copy of z updated in
    place, by chunks of rows; returns the copy and the rows per chunk. The copy has Boltz's result dtype: its float32
    dropout mask promotes the sums to at least float32."""
    work = z.to(dtype=torch.promote_types(z.dtype, torch.float32), memory_format=torch.contiguous_format, copy=True)
    chunk = _row_chunk(layer, options, work, chunk_size)
    inference.pair_stack_(_PairStack(layer, options, fused_mul), work, pair_mask, chunk)
    return work, chunk


def _dropout_residual(z: Tensor, update: Callable[[], Tensor], p: float, columnwise: bool = False) -> Tensor:
    """Boltz's ``z + get_dropout_mask(p, z, training, columnwise) * update()`` with the same random draw (drawn before
    the update, as Boltz does) in three small launches instead of five, and the scaled add in one pass over z
    (``addcmul``) instead of a multiply and an add."""
    shape = (z.shape[0], 1, z.shape[2], 1) if columnwise else (z.shape[0], z.shape[1], 1, 1)
    keep = torch.rand(shape, dtype=torch.float32, device=z.device).ge_(p).div_(1.0 - p)  # Boltz's mask, as float
    return torch.addcmul(z, keep, update())


def _layer_forward(mod: nn.Module, s: Tensor, z: Tensor, mask: Tensor, pair_mask: Tensor,
                   chunk_size_tri_attn: Optional[int], use_kernels: bool, use_cuequiv_mul: bool,
                   use_cuequiv_attn: bool) -> Tuple[Tensor, Tensor]:
    """Boltz-2's ``PairformerLayer.forward`` (2.2.1) as written there, its (patched) sub-modules called as Boltz calls
    them, with the dropout-and-residual steps of :func:`_dropout_residual`."""
    p = mod.dropout * mod.training
    mul, attn = use_cuequiv_mul or use_kernels, use_cuequiv_attn or use_kernels
    z = _dropout_residual(z, lambda: mod.tri_mul_out(z, mask=pair_mask, use_kernels=mul), p)
    z = _dropout_residual(z, lambda: mod.tri_mul_in(z, mask=pair_mask, use_kernels=mul), p)
    z = _dropout_residual(z, lambda: mod.tri_att_start(z, mask=pair_mask, chunk_size=chunk_size_tri_attn,
                                                       use_kernels=attn), p)
    z = _dropout_residual(z, lambda: mod.tri_att_end(z, mask=pair_mask, chunk_size=chunk_size_tri_attn,
                                                     use_kernels=attn), p, columnwise=True)
    z = z + mod.transition_z(z)
    with torch.autocast("cuda", enabled=False):
        s_normed = mod.pre_norm_s(s.float())
        s = s.float() + mod.attention(s=s_normed, z=z.float(), mask=mask.float(), k_in=s_normed)
        s = s + mod.transition_s(s)
        s = mod.s_post_norm(s)
    return s, z


def pairformer_layer(mod: nn.Module, options: Options, s: Tensor, z: Tensor, mask: Tensor, pair_mask: Tensor,
                     chunk_size_tri_attn: Optional[int] = None, use_kernels: bool = False,
                     use_cuequiv_mul: bool = False, use_cuequiv_attn: bool = False) -> Tuple[Tensor, Tensor]:
    """Boltz-2's ``PairformerLayer.forward``: without autograd in eval mode the memory-bounded path (rows by
    chunks of ``chunk_size_tri_attn``), else Boltz's forward with fewer launches (:func:`_layer_forward`)."""
    v2 = sys.modules.get("boltz.model.layers.attentionv2")
    att = mod.attention
    if not _bounded(mod, z, chunk_size_tri_attn):
        return _layer_forward(mod, s, z, mask, pair_mask, chunk_size_tri_attn, use_kernels, use_cuequiv_mul,
                              use_cuequiv_attn)
    if v2 is None or not isinstance(att, v2.AttentionPairBias) or not isinstance(att.proj_z, nn.Sequential):
        return original_forward(mod)(s, z, mask, pair_mask, chunk_size_tri_attn=chunk_size_tri_attn,
                                     use_kernels=use_kernels, use_cuequiv_mul=use_cuequiv_mul,
                                     use_cuequiv_attn=use_cuequiv_attn)
    z, chunk = _pair_stack(mod, options, z, pair_mask, chunk_size_tri_attn, use_cuequiv_mul or use_kernels)
    with torch.autocast("cuda", enabled=False):  # Boltz's single track: float32, autocast off
        s_normed = mod.pre_norm_s(s.float())
        # Boltz's proj_z(z.float()) [B, H, N, N], by chunks of z's rows, each read as float32
        bias = inference.pair_bias(z, att.proj_z[0], att.proj_z[1], chunk, fp32=True)
        keys = mask.float()
        update = chunk_rows(lambda q, b: _pair_bias_attention(att, options, q, s_normed, b, keys, 1),
                            [s_normed, bias], [-2, -2], chunk, out_dim=-2)
        del bias
        s = s.float() + update
        s = s + mod.transition_s(s)
        s = mod.s_post_norm(s)
    return s, z


def pairformer_noseq_layer(mod: nn.Module, options: Options, z: Tensor, pair_mask: Tensor,
                           chunk_size_tri_attn: Optional[int] = None, use_kernels: bool = False,
                           use_cuequiv_mul: bool = False, use_cuequiv_attn: bool = False) -> Tensor:
    """Boltz-2's ``PairformerNoSeqLayer.forward`` (template and MSA modules' pair stacks): as
    :func:`pairformer_layer` without the single track."""
    if not _bounded(mod, z, chunk_size_tri_attn):
        return original_forward(mod)(z, pair_mask, chunk_size_tri_attn=chunk_size_tri_attn, use_kernels=use_kernels,
                                     use_cuequiv_mul=use_cuequiv_mul, use_cuequiv_attn=use_cuequiv_attn)
    return _pair_stack(mod, options, z, pair_mask, chunk_size_tri_attn, use_cuequiv_mul or use_kernels)[0]
