"""Protenix's trunk Pairformer (``protenix.model.modules.pairformer.PairformerStack``) from and to this project's
``PairformerStack(variant="protenix")``.

    stack = from_protenix("protenix_base.pt", attention="triton")    # or Protenix's model / stack / state dict
    s, z = stack(s, z, single_mask, pair_mask)
    their_stack.load_state_dict(to_protenix(stack))                   # the same tensors, Protenix's names

Protenix's block is AF3's without biases in the triangle updates, the triangle attentions' gates and outputs or the
single attention's gate (the query projection keeps one). Protenix runs its trunk unpadded (``pair_mask=None``) and
its single attention takes no mask: on a padded input this stack masks the padded keys, which gives Protenix's
result on the unpadded input. Its single transition is 4 wide; the pair transition's factor must match it here.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from .zoo_files import ZooCheckpointError
from .zoo_tables import convert, export, find_prefix, num_blocks, read_source, sub_dict

Tensor = torch.Tensor
WHAT = "a Protenix PairformerStack"
_MARKER = "blocks.0.attention_pair_bias.layernorm_a.weight"  # only stacks with a single track (c_s > 0)

# Our PairformerBlock(variant="protenix") parameter -> Protenix's PairformerBlock parameter(s)
TABLE = tuple(
    [
        (f"{tri}.{ours}.weight", tuple(f"{tri}.{t}.weight" for t in theirs))
        for tri in ("tri_mul_out", "tri_mul_in")
        for ours, theirs in (("linear_ab_p", ("linear_a_p", "linear_b_p")),
                             ("linear_ab_g", ("linear_a_g", "linear_b_g")),
                             ("linear_z", ("linear_z",)), ("linear_g", ("linear_g",)))
    ]
    + [(f"{tri}.{ln}.{p}", (f"{tri}.{ln}.{p}",)) for tri in ("tri_mul_out", "tri_mul_in")
       for ln in ("layer_norm_in", "layer_norm_out") for p in ("weight", "bias")]
    + [(f"{tri}.layer_norm.{p}", (f"{tri}.layer_norm.{p}",)) for tri in ("tri_att_start", "tri_att_end")
       for p in ("weight", "bias")]
    + [(f"{tri}.linear_bias.weight", (f"{tri}.linear.weight",)) for tri in ("tri_att_start", "tri_att_end")]
    + [(f"{tri}.mha.linear_{x}.weight", (f"{tri}.mha.linear_{x}.weight",))
       for tri in ("tri_att_start", "tri_att_end") for x in "qkvgo"]
    + [
        item
        for t in ("pair_transition", "single_transition")
        for item in (
            (f"{t}.layer_norm.weight", (f"{t}.layernorm1.weight",)),
            (f"{t}.layer_norm.bias", (f"{t}.layernorm1.bias",)),
            (f"{t}.linear_ab.weight", (f"{t}.linear_no_bias_a.weight", f"{t}.linear_no_bias_b.weight")),
            (f"{t}.linear_out.weight", (f"{t}.linear_no_bias.weight",)),
        )
    ]
    + [
        ("attention_pair_bias.layer_norm_s.weight", ("attention_pair_bias.layernorm_a.weight",)),
        ("attention_pair_bias.layer_norm_s.bias", ("attention_pair_bias.layernorm_a.bias",)),
        ("attention_pair_bias.layer_norm_z.weight", ("attention_pair_bias.layernorm_z.weight",)),
        ("attention_pair_bias.layer_norm_z.bias", ("attention_pair_bias.layernorm_z.bias",)),
        ("attention_pair_bias.linear_z.weight", ("attention_pair_bias.linear_nobias_z.weight",)),
        ("attention_pair_bias.mha.linear_q.bias", ("attention_pair_bias.attention.linear_q.bias",)),
    ]
    + [(f"attention_pair_bias.mha.linear_{x}.weight", (f"attention_pair_bias.attention.linear_{x}.weight",))
       for x in "qkvgo"]
)


def protenix_sizes(sd: Dict[str, Any], source: str) -> Dict[str, int]:
    """``PairformerStack`` sizes read off a Protenix PairformerStack state dict (keys ``blocks.i...``)."""
    def shape(key: str):
        v = sd.get(key)
        if not isinstance(v, Tensor):
            raise ZooCheckpointError(f"{source}: missing {key!r} (needed to read the Pairformer's sizes)")
        return tuple(v.shape)

    b = "blocks.0."
    c_z = shape(b + "tri_mul_out.layer_norm_in.weight")[0]
    c_s = shape(b + "attention_pair_bias.layernorm_a.weight")[0]
    heads_single = shape(b + "attention_pair_bias.linear_nobias_z.weight")[0]
    heads_pair = shape(b + "tri_att_start.linear.weight")[0]
    hidden_pair, rem = divmod(shape(b + "tri_att_start.mha.linear_q.weight")[0], heads_pair)
    n, rem_t = divmod(shape(b + "pair_transition.linear_no_bias_a.weight")[0], c_z)
    n_single = shape(b + "single_transition.linear_no_bias_a.weight")[0] / c_s
    if rem or rem_t or c_s % heads_single or n_single != n:
        raise ZooCheckpointError(
            f"{source}: sizes this stack cannot take: tri_att_start q width {heads_pair * hidden_pair + rem} over "
            f"{heads_pair} heads, transitions {n * c_z + rem_t} wide for c_z={c_z} and {n_single:g} x c_s={c_s} "
            f"(one integer factor for both), {heads_single} single-attention heads for c_s={c_s}")
    return dict(c_s=c_s, c_z=c_z, num_blocks=num_blocks(sd), num_heads_single=heads_single,
                num_heads_pair=heads_pair, c_hidden_pair=hidden_pair,
                c_hidden_mul=shape(b + "tri_mul_out.linear_a_p.weight")[0], transition_n=n)


def from_protenix(state_dict_or_module: Any, attention: Any = None, *, prefix: Optional[str] = None,
                  pair_dropout: float = 0.25, checkpoint_every: int = 0, chunk_size: Optional[int] = None,
                  map_location: Any = "cpu", trust_file: bool = False) -> nn.Module:
    """Protenix's trunk Pairformer -> ``PairformerStack(variant="protenix")`` with the same outputs (eval mode).

    Args:
        state_dict_or_module: Protenix's ``PairformerStack`` or whole model (a module), its state dict, or a
            checkpoint (a path, read with ``weights_only=True``, or the loaded dict; a ``model`` or ``state_dict``
            entry is unwrapped, a ``module.`` prefix found with the rest). The trunk's stack is found by its keys
            (``...pairformer_stack.blocks.N...``); with several (the trunk's and the confidence head's) the shortest
            ``pairformer_stack.`` prefix is taken.
        attention: the attention backend / options of the stack (see ``AttentionConfig.coerce``).
        prefix: the key prefix of the stack to load, when the file holds others.
        pair_dropout: Protenix's dropout (0.25 in its config; active in training only).
        checkpoint_every, chunk_size: passed to ``PairformerStack``.
        map_location, trust_file: as ``zoo.read_checkpoint`` (without ``trust_file`` the file is read as data).

    Sizes are read off the weights. Raises ``ZooCheckpointError`` naming every missing, unexpected, misshapen or
    non-float key and another model's file; nothing half-loaded is returned.
    """
    from .pairformer import PairformerStack

    sd, source = read_source(state_dict_or_module, WHAT, map_location, trust_file)
    keys = [k for k in sd if isinstance(k, str)]
    pre = find_prefix(keys, _MARKER, "pairformer_stack.", WHAT, source, prefix)
    sd, source = sub_dict(sd, pre), f"{source} (prefix {pre!r})" if pre else source
    sizes = protenix_sizes(sd, source)
    kwargs = dict(**sizes, pair_dropout=pair_dropout, checkpoint_every=checkpoint_every, chunk_size=chunk_size,
                  variant="protenix")
    with torch.device("meta"):  # the expected shapes, before anything is allocated
        target = PairformerStack(**kwargs).state_dict()
    converted = convert(sd, target, TABLE, sizes["num_blocks"], source, WHAT)
    stack = PairformerStack(**kwargs, attention=attention)
    stack.load_state_dict(converted, strict=True)
    return stack.eval()


def to_protenix(stack: nn.Module) -> Dict[str, Tensor]:
    """The inverse of :func:`from_protenix`: a ``PairformerStack(variant="protenix")`` -> the state dict of
    Protenix's ``PairformerStack`` (``blocks.N...``; prefix it with ``pairformer_stack.`` for a whole model)."""
    from .pairformer import PairformerStack

    if not isinstance(stack, PairformerStack) or any(b.variant != "protenix" for b in stack.blocks):
        raise TypeError(f"to_protenix needs a PairformerStack built with variant='protenix', got "
                        f"{type(stack).__name__}")
    return export(stack, TABLE)
