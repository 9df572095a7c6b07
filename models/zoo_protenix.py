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

from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from .zoo_files import ZooCheckpointError
from .zoo_tables import export_stack, load_stack, num_blocks, pairformer_table, shape_reader

Tensor = torch.Tensor
WHAT = "a Protenix PairformerStack"
_MARKER = "blocks.0.attention_pair_bias.layernorm_a.weight"  # only stacks with a single track (c_s > 0)

# Our PairformerBlock(variant="protenix") parameter -> Protenix's PairformerBlock parameter(s)
TABLE = pairformer_table(
    "", "linear", (("pair_transition", "pair_transition"), ("single_transition", "single_transition")),
    ("layernorm1", "linear_no_bias_a", "linear_no_bias_b", "linear_no_bias"),
    "attention_pair_bias", ("layernorm_a", "layernorm_z", "linear_nobias_z", "attention"))


def protenix_sizes(sd: Dict[str, Any], source: str) -> Dict[str, int]:
    """``PairformerStack`` sizes read off a Protenix PairformerStack state dict (keys ``blocks.i...``)."""
    shape = shape_reader(sd, source)
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
                  map_location: Any = "cpu", allow_globals: Sequence[Any] = ()) -> nn.Module:
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
        map_location: passed to ``torch.load`` when a path is given (the file is read as data).
        allow_globals: classes your file pickles, named by your code; the file still cannot name anything
            else (see ``zoo.read_checkpoint``).

    Sizes are read off the weights. Raises ``ZooCheckpointError`` naming every missing, unexpected, misshapen or
    non-float key and another model's file; nothing half-loaded is returned.
    """
    return load_stack(state_dict_or_module, what=WHAT, marker=_MARKER, table=TABLE, sizes=protenix_sizes,
                      variant="protenix", attention=attention, prefix=prefix, pair_dropout=pair_dropout,
                      checkpoint_every=checkpoint_every, chunk_size=chunk_size, map_location=map_location,
                      allow_globals=allow_globals)


def to_protenix(stack: nn.Module) -> Dict[str, Tensor]:
    """The inverse of :func:`from_protenix`: a ``PairformerStack(variant="protenix")`` -> the state dict of
    Protenix's ``PairformerStack`` (``blocks.N...``; prefix it with ``pairformer_stack.`` for a whole model)."""
    return export_stack(stack, TABLE, "protenix", "to_protenix")
