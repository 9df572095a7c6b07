"""AlphaFold 2 parameters (``params_model_{1..5}[_ptm|_multimer_v3].npz``, as AlphaFold 2.3, ColabFold and
OpenFold read them) from and to this project's Evoformer and extra-MSA stacks.

    trunk = from_alphafold("params_model_1_ptm.npz", attention="triton")    # -> AlphaFold2Trunk
    m, z = trunk(msa, pair, extra_msa, msa_mask, pair_mask, extra_msa_mask)
    np.savez("back.npz", **to_alphafold(trunk))                             # the same arrays, same names

What is converted: the 48 Evoformer iterations (``alphafold/alphafold_iteration/evoformer/evoformer_iteration``) and
the 4 extra-MSA iterations (``.../evoformer/extra_msa_stack``), each array stacked over iterations along its leading
axis. Left out (their arrays are ignored): the input, recycling and template embedders, the extra-MSA and
single-representation projections, the structure module and the heads.

Monomer and multimer differ in the Evoformer in one place: AlphaFold-Multimer runs the outer product mean first
(``variant="alphafold2_multimer"`` of the stacks); multimer v3 parameters store the triangle multiplications'
left/right projections and gates fused (``projection``, ``gate``, ``left_norm_input``, ``center_norm``), the
others separately (``left_projection``, ``right_projection``, ``left_gate``, ``right_gate``,
``layer_norm_input``, ``center_layer_norm``). Both layouts load; :func:`to_alphafold` writes the one loaded.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
from torch import nn

from .evoformer import EvoformerStack, ExtraMSAStack
from .zoo_files import ZooCheckpointError, _summarise

Tensor = torch.Tensor
PREFIX = "alphafold/alphafold_iteration/evoformer/"
STACKS = {"evoformer": "evoformer_iteration", "extra_msa_stack": "extra_msa_stack"}
_MULTIMER_MARK = PREFIX + "~_relative_encoding/"


class AlphaFold2Trunk(nn.Module):
    """AlphaFold 2's extra-MSA stack followed by its Evoformer stack (AF2 Alg. 2 lines 16-18).

    ``forward(msa [B, S, N, c_m], pair [B, N, N, c_z], extra_msa [B, S_e, N, c_e], msa_mask, pair_mask,
    extra_msa_mask)`` -> ``(msa, pair)``: the extra-MSA stack updates the pair, which the Evoformer then takes.
    ``multimer``: AlphaFold-Multimer's block order; ``fused_triangle_weights``: the parameter layout
    :func:`to_alphafold` writes.
    """

    def __init__(self, evoformer: Mapping[str, Any], extra_msa_stack: Mapping[str, Any], attention: Any = None,
                 multimer: bool = False, fused_triangle_weights: bool = False, checkpoint_every: int = 0,
                 chunk_size: Optional[int] = None):
        super().__init__()
        variant = "alphafold2_multimer" if multimer else "alphafold2"
        common = dict(attention=attention, variant=variant, checkpoint_every=checkpoint_every, chunk_size=chunk_size,
                      msa_dropout=0.15, pair_dropout=0.25)
        self.multimer, self.fused_triangle_weights = bool(multimer), bool(fused_triangle_weights)
        self.sizes = {"evoformer": dict(evoformer), "extra_msa_stack": dict(extra_msa_stack)}
        self.extra_msa_stack = ExtraMSAStack(**extra_msa_stack, **common)
        self.evoformer = EvoformerStack(**evoformer, **common)

    def forward(self, msa: Tensor, pair: Tensor, extra_msa: Tensor, msa_mask: Optional[Tensor] = None,
                pair_mask: Optional[Tensor] = None, extra_msa_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        _, pair = self.extra_msa_stack(extra_msa, pair, extra_msa_mask, pair_mask)
        return self.evoformer(msa, pair, msa_mask, pair_mask)


# --------------------------------------------------------------------------------------------------
# One table: our parameter (per block) <-> the Haiku parameter(s) (per iteration) and how the arrays relate
# --------------------------------------------------------------------------------------------------
# kinds: "vec" same array; "lin" ours = theirs.T; "head_in" theirs [in, H, C] -> ours [H*C, in];
# "head_out" theirs [H, C, out] -> ours [out, H*C]; "head_vec" theirs [H, C] -> ours [H*C];
# "opm_out" theirs [C, C, c_z] -> ours [c_z, C*C]; "cat_lin" / "cat_vec": two Haiku arrays concatenated (dim 0 ours)
def _ln(ours: str, theirs: str):
    return [(f"{ours}.weight", f"{theirs}//scale", "vec"), (f"{ours}.bias", f"{theirs}//offset", "vec")]


def _linear(ours: str, theirs: str):
    return [(f"{ours}.weight", f"{theirs}//weights", "lin"), (f"{ours}.bias", f"{theirs}//bias", "vec")]


def _mha(ours: str, theirs: str, global_kv: bool = False):
    kv = "lin" if global_kv else "head_in"
    return [(f"{ours}.linear_q.weight", f"{theirs}//query_w", "head_in"),
            (f"{ours}.linear_k.weight", f"{theirs}//key_w", kv),
            (f"{ours}.linear_v.weight", f"{theirs}//value_w", kv),
            (f"{ours}.linear_g.weight", f"{theirs}//gating_w", "head_in"),
            (f"{ours}.linear_g.bias", f"{theirs}//gating_b", "head_vec"),
            (f"{ours}.linear_o.weight", f"{theirs}//output_w", "head_out"),
            (f"{ours}.linear_o.bias", f"{theirs}//output_b", "vec")]


def _tri_mul(ours: str, theirs: str, fused: bool, incoming: bool):
    # AF2's incoming update is x_ij = sum_k left_kj right_ki, ours sum_k a_ki b_kj: a is its right, b its left
    first, second = ("right", "left") if incoming else ("left", "right")
    if fused:  # [left | right] in one array: incoming swaps the halves
        lin, vec = ("swap_lin", "swap_vec") if incoming else ("lin", "vec")
        rows = _ln(f"{ours}.layer_norm_in", f"{theirs}/left_norm_input") + [
            (f"{ours}.linear_ab_p.weight", f"{theirs}/projection//weights", lin),
            (f"{ours}.linear_ab_p.bias", f"{theirs}/projection//bias", vec),
            (f"{ours}.linear_ab_g.weight", f"{theirs}/gate//weights", lin),
            (f"{ours}.linear_ab_g.bias", f"{theirs}/gate//bias", vec),
        ] + _ln(f"{ours}.layer_norm_out", f"{theirs}/center_norm")
    else:
        rows = _ln(f"{ours}.layer_norm_in", f"{theirs}/layer_norm_input") + [
            (f"{ours}.linear_ab_{w}.{p}", (f"{theirs}/{first}_{t}//{q}", f"{theirs}/{second}_{t}//{q}"), f"cat_{k}")
            for w, t in (("p", "projection"), ("g", "gate")) for p, q, k in (("weight", "weights", "lin"),
                                                                          ("bias", "bias", "vec"))
        ] + _ln(f"{ours}.layer_norm_out", f"{theirs}/center_layer_norm")
    return rows + _linear(f"{ours}.linear_z", f"{theirs}/output_projection") + _linear(
        f"{ours}.linear_g", f"{theirs}/gating_linear")


def _layer_table(extra: bool, fused: bool) -> List[Tuple[str, Any, str]]:
    row = "msa_row_attention_with_pair_bias"
    col = "msa_column_global_attention" if extra else "msa_column_attention"
    table = _ln("msa_row_attention.layer_norm_m", f"{row}/query_norm") + _ln(
        "msa_row_attention.layer_norm_z", f"{row}/feat_2d_norm") + [
        ("msa_row_attention.linear_z.weight", f"{row}//feat_2d_weights", "lin")] + _mha(
        "msa_row_attention.mha", f"{row}/attention")
    if extra:
        table += _ln("msa_column_attention.layer_norm", f"{col}/query_norm") + _mha(
            "msa_column_attention", f"{col}/attention", global_kv=True)
    else:
        table += _ln("msa_column_attention.layer_norm", f"{col}/query_norm") + _mha(
            "msa_column_attention.mha", f"{col}/attention")
    for ours, theirs in (("msa_transition", "msa_transition"), ("pair_transition", "pair_transition")):
        table += _ln(f"{ours}.layer_norm", f"{theirs}/input_layer_norm") + _linear(
            f"{ours}.linear_1", f"{theirs}/transition1") + _linear(f"{ours}.linear_2", f"{theirs}/transition2")
    table += _ln("outer_product_mean.layer_norm", "outer_product_mean/layer_norm_input") + _linear(
        "outer_product_mean.linear_a", "outer_product_mean/left_projection") + _linear(
        "outer_product_mean.linear_b", "outer_product_mean/right_projection") + [
        ("outer_product_mean.linear_out.weight", "outer_product_mean//output_w", "opm_out"),
        ("outer_product_mean.linear_out.bias", "outer_product_mean//output_b", "vec")]
    table += _tri_mul("tri_mul_out", "triangle_multiplication_outgoing", fused, incoming=False)
    table += _tri_mul("tri_mul_in", "triangle_multiplication_incoming", fused, incoming=True)
    for ours, theirs in (("tri_att_start", "triangle_attention_starting_node"),
                         ("tri_att_end", "triangle_attention_ending_node")):
        table += _ln(f"{ours}.layer_norm", f"{theirs}/query_norm") + [
            (f"{ours}.linear_bias.weight", f"{theirs}//feat_2d_weights", "lin")] + _mha(f"{ours}.mha",
                                                                                        f"{theirs}/attention")
    return table


def _to_theirs(kind: str, t: Tensor, heads: Optional[int]) -> Tuple[Tensor, ...]:
    """Our per-block tensor -> the Haiku array(s) of one iteration (views where possible)."""
    if kind == "vec":
        return (t,)
    if kind == "lin":
        return (t.t(),)
    if kind == "head_in":  # [H*C, in] -> [in, H, C]
        return (t.t().unflatten(1, (heads, -1)),)
    if kind == "head_out":  # [out, H*C] -> [H, C, out]
        return (t.t().unflatten(0, (heads, -1)),)
    if kind == "head_vec":
        return (t.unflatten(0, (heads, -1)),)
    if kind == "opm_out":  # [c_z, C*C] -> [C, C, c_z]
        c = int(round(t.shape[1] ** 0.5))
        return (t.t().unflatten(0, (c, c)),)
    if kind == "swap_lin":  # [2C, in] -> [in, 2C] with the halves swapped
        return (torch.cat(t.chunk(2, dim=0)[::-1]).t(),)
    if kind == "swap_vec":
        return (torch.cat(t.chunk(2, dim=0)[::-1]),)
    if kind == "cat_lin":
        return tuple(p.t() for p in t.chunk(2, dim=0))
    if kind == "cat_vec":
        return t.chunk(2, dim=0)
    raise AssertionError(kind)


def _to_ours(kind: str, arrs: List[Tensor]) -> Tensor:
    """The inverse of ``_to_theirs`` on stacked arrays ``[blocks, ...]`` -> ``[blocks, ...ours]``."""
    a = arrs[0]
    if kind in ("vec",):
        return a
    if kind == "lin":
        return a.transpose(-1, -2)
    if kind == "head_in":  # [L, in, H, C] -> [L, H*C, in]
        return a.flatten(-2).transpose(-1, -2)
    if kind == "head_out":  # [L, H, C, out] -> [L, out, H*C]
        return a.flatten(1, 2).transpose(-1, -2)
    if kind == "head_vec":
        return a.flatten(1)
    if kind == "opm_out":  # [L, C, C, c_z] -> [L, c_z, C*C]
        return a.flatten(1, 2).transpose(-1, -2)
    if kind == "swap_lin":  # [L, in, 2C] -> [L, 2C, in] with the halves swapped
        return torch.cat(a.transpose(-1, -2).chunk(2, dim=1)[::-1], dim=1)
    if kind == "swap_vec":
        return torch.cat(a.chunk(2, dim=1)[::-1], dim=1)
    if kind == "cat_lin":
        return torch.cat([x.transpose(-1, -2) for x in arrs], dim=1)
    if kind == "cat_vec":
        return torch.cat(arrs, dim=1)
    raise AssertionError(kind)


def _heads_of(ours_key: str, stack: nn.Module) -> Optional[int]:
    mod = stack.blocks[0].get_submodule(ours_key.rsplit(".", 2)[0]) if ours_key.count(".") >= 2 else None
    return getattr(mod, "num_heads", None)


# --------------------------------------------------------------------------------------------------
# Reading the file and the sizes
# --------------------------------------------------------------------------------------------------
def _flat(obj: Any, source: str) -> Dict[str, np.ndarray]:
    """``{"module//param": array}`` from an npz path, a flat dict, or Haiku's nested ``{module: {param: array}}``."""
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        if not os.path.isfile(path):
            raise ZooCheckpointError(f"AlphaFold parameters {path!r} do not exist or are not a file")
        try:
            with np.load(path, allow_pickle=False) as f:  # arrays only: the file never runs code
                return {k: f[k] for k in f.files}
        except Exception as e:
            raise ZooCheckpointError(f"cannot read AlphaFold parameters {path!r} (truncated or not an npz): "
                                     f"{type(e).__name__}: {e}") from e
    if not isinstance(obj, Mapping):
        raise ZooCheckpointError(f"{source} is a {type(obj).__name__}, not an npz path or a parameter dict")
    out: Dict[str, np.ndarray] = {}
    for k, v in obj.items():
        if isinstance(v, Mapping):  # Haiku's nested form
            for p, a in v.items():
                out[f"{k}//{p}"] = a
        else:
            out[str(k)] = v
    return out


def _sizes(params: Mapping[str, Any], prefix: str, source: str, extra: bool) -> Tuple[Dict[str, int], bool]:
    """The stack's constructor sizes, and whether its triangle multiplications are stored fused."""
    def shape(name: str) -> Tuple[int, ...]:
        a = params.get(prefix + name)
        if a is None:
            raise ZooCheckpointError(f"{source}: missing {prefix + name!r} (needed to read the sizes); AlphaFold keys "
                                     f"seen under {prefix!r}: {_summarise(sorted(k for k in params if k.startswith(prefix)), 5)}")
        return tuple(np.shape(a))

    L, c_m = shape("msa_row_attention_with_pair_bias/attention//query_w")[:2]
    heads_msa, c_hidden_msa = shape("msa_row_attention_with_pair_bias/attention//query_w")[2:]
    c_z = shape("msa_row_attention_with_pair_bias/feat_2d_norm//scale")[1]
    heads_pair, c_hidden_pair = shape("triangle_attention_starting_node/attention//query_w")[2:]
    c_opm = shape("outer_product_mean/left_projection//weights")[2]
    fused = prefix + "triangle_multiplication_outgoing/projection//weights" in params
    c_mul = (shape("triangle_multiplication_outgoing/projection//weights")[2] // 2 if fused
             else shape("triangle_multiplication_outgoing/left_projection//weights")[2])
    n_msa = shape("msa_transition/transition1//weights")[2] / c_m
    n_pair = shape("pair_transition/transition1//weights")[2] / c_z
    if n_msa != n_pair or n_msa != int(n_msa):
        raise ZooCheckpointError(f"{source}: transition widths {n_msa} x c_m and {n_pair} x c_z under {prefix!r}: "
                                 f"the stacks take one integer factor for both")
    return dict(c_m=c_m, c_z=c_z, num_blocks=L, num_heads_msa=heads_msa, c_hidden_msa=c_hidden_msa,
                num_heads_pair=heads_pair, c_hidden_pair=c_hidden_pair, c_hidden_opm=c_opm, c_hidden_mul=c_mul,
                transition_n=int(n_msa)), fused


def _stack_arrays(stack: nn.Module, extra: bool, fused: bool, prefix: str) -> Dict[str, Tensor]:
    """Our stack's weights as the Haiku arrays (``prefix + module//param`` -> ``[blocks, ...]``)."""
    out: Dict[str, Tensor] = {}
    sds = [b.state_dict() for b in stack.blocks]
    for ours, theirs, kind in _layer_table(extra, fused):
        names = (theirs,) if isinstance(theirs, str) else theirs
        heads = _heads_of(ours, stack)
        per_block = [_to_theirs(kind, sd[ours].detach(), heads) for sd in sds]
        for j, name in enumerate(names):
            out[prefix + name] = torch.stack([p[j] for p in per_block])
    return out


def from_alphafold(npz_or_dict: Any, attention: Any = None, *, multimer: Optional[bool] = None,
                   checkpoint_every: int = 0, chunk_size: Optional[int] = None) -> AlphaFold2Trunk:
    """AlphaFold 2 parameters -> :class:`AlphaFold2Trunk` (the extra-MSA and Evoformer stacks; eval mode).

    Args:
        npz_or_dict: a ``params_model_*.npz`` path (read with ``allow_pickle=False``), its dict
            (``"alphafold/alphafold_iteration/evoformer/evoformer_iteration/...//query_w"`` -> array, stacked over
            iterations) or Haiku's nested ``{module: {param: array}}`` form of it.
        attention: the attention config of the stacks.
        multimer: AlphaFold-Multimer's block order; default: True when the file has the multimer relative
            encoding (``.../evoformer/~_relative_encoding/...``).
        checkpoint_every, chunk_size: passed to the stacks.

    Sizes are read off the arrays. Arrays of other modules (embedders, structure module, heads) are ignored; a
    missing, unexpected or misshapen array of the two stacks raises one ZooCheckpointError naming all of them,
    before anything is built.
    """
    source = repr(os.fspath(npz_or_dict)) if isinstance(npz_or_dict, (str, os.PathLike)) else "the parameter dict"
    params = _flat(npz_or_dict, source)
    if multimer is None:
        multimer = any(k.startswith(_MULTIMER_MARK) for k in params)
    sizes, fused = {}, {}
    for ours, name in STACKS.items():
        sizes[ours], fused[ours] = _sizes(params, f"{PREFIX}{name}/", source, ours == "extra_msa_stack")
    if fused["evoformer"] != fused["extra_msa_stack"]:
        raise ZooCheckpointError(f"{source}: the Evoformer and extra-MSA triangle multiplications use different "
                                 f"layouts (fused projection in one only)")
    kwargs = dict(multimer=multimer, fused_triangle_weights=fused["evoformer"], checkpoint_every=checkpoint_every,
                  chunk_size=chunk_size)
    with torch.device("meta"):
        ref = AlphaFold2Trunk(sizes["evoformer"], sizes["extra_msa_stack"], **kwargs)
    expected = to_alphafold(ref, as_numpy=False)
    got = {k: v for k, v in params.items() if any(k.startswith(f"{PREFIX}{n}/") for n in STACKS.values())}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    shapes = [f"{k} {tuple(np.shape(got[k]))} (expected {tuple(expected[k].shape)})" for k in sorted(expected)
              if k in got and tuple(np.shape(got[k])) != tuple(expected[k].shape)]
    dtypes = [f"{k} {np.asarray(got[k]).dtype}" for k in sorted(expected) if k in got
              and not np.issubdtype(np.asarray(got[k]).dtype, np.floating)]
    parts = ([f"{len(missing)} missing: {_summarise(missing)}"] if missing else []) + (
        [f"{len(unexpected)} unexpected: {_summarise(unexpected)}"] if unexpected else []) + (
        [f"{len(shapes)} with the wrong shape: {_summarise(shapes)}"] if shapes else []) + (
        [f"not float arrays: {_summarise(dtypes)}"] if dtypes else [])
    if parts:
        raise ZooCheckpointError(f"{source} does not match AlphaFold 2's Evoformer and extra-MSA stacks: "
                                 + "; ".join(parts))
    tensors = {k: torch.from_numpy(np.array(got[k])) for k in expected}  # own copies
    dtype = tensors[next(iter(tensors))].dtype
    trunk = AlphaFold2Trunk(sizes["evoformer"], sizes["extra_msa_stack"], attention=attention, **kwargs).to(dtype)
    for ours, name in STACKS.items():
        stack, extra = getattr(trunk, ours), ours == "extra_msa_stack"
        prefix = f"{PREFIX}{name}/"
        sd = {}
        for key, theirs, kind in _layer_table(extra, fused[ours]):
            names = (theirs,) if isinstance(theirs, str) else theirs
            full = _to_ours(kind, [tensors[prefix + n] for n in names])  # [blocks, ...]
            for i in range(len(stack.blocks)):
                sd[f"blocks.{i}.{key}"] = full[i]
        stack.load_state_dict(sd, strict=True)
    return trunk.eval()


def to_alphafold(trunk: AlphaFold2Trunk, *, as_numpy: bool = True) -> Dict[str, Any]:
    """The inverse of :func:`from_alphafold`: the two stacks' arrays under AlphaFold's names, stacked over
    iterations (``np.savez(path, **to_alphafold(trunk))`` writes them as an npz; float32 numpy arrays of the
    trunk's dtype, or tensors with ``as_numpy=False``). Only these arrays: the rest of a ``params_model_*.npz``
    (embedders, structure module, heads) is not modelled here."""
    if not isinstance(trunk, AlphaFold2Trunk):
        raise TypeError(f"to_alphafold takes an AlphaFold2Trunk (from from_alphafold), got {type(trunk).__name__}")
    out: Dict[str, Any] = {}
    for ours, name in STACKS.items():
        out.update(_stack_arrays(getattr(trunk, ours), ours == "extra_msa_stack", trunk.fused_triangle_weights,
                                 f"{PREFIX}{name}/"))
    if as_numpy:
        out = {k: v.contiguous().numpy() for k, v in out.items()}
    return out
