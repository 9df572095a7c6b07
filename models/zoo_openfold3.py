"""OpenFold3's trunk Pairformer (``openfold3.core.model.latent.pairformer.PairFormerStack``) from and to this
project's ``PairformerStack(variant="openfold3")``.

    stack = from_openfold3("of3.pt", attention="triton")       # or OpenFold3's model / stack / state dict
    s, z = stack(s, z, single_mask, pair_mask)                   # OpenFold3's (s, z, single_mask, pair_mask)
    their_stack.load_state_dict(to_openfold3(stack))             # the same tensors, OpenFold3's names

What differs from AF3 in OpenFold3's block, and so in the variant: no biases in the triangle updates, the triangle
attentions' gates and outputs or the single attention's gate (the query projection keeps one); the ending-node
attention's bias is read off the untransposed pair; the transitions' updates are zeroed at masked positions.
Only the published layout is read: separate ``linear_a_*`` / ``linear_b_*`` triangle projections
(``fuse_projection_weights=False``) and SwiGLU transitions (``transition_type="swiglu"``).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from .zoo_files import ZooCheckpointError
from .zoo_tables import export_stack, load_stack, num_blocks, pairformer_table, shape_reader

Tensor = torch.Tensor
WHAT = "an OpenFold3 PairFormerStack"
_MARKER = "blocks.0.pair_stack.tri_mul_out.layer_norm_in.weight"

# Our PairformerBlock(variant="openfold3") parameter -> OpenFold3's PairFormerBlock parameter(s)
TABLE = pairformer_table(
    "pair_stack.", "linear_z",
    (("pair_transition", "pair_stack.pair_transition"), ("single_transition", "single_transition")),
    ("layer_norm", "swiglu.linear_a", "swiglu.linear_b", "linear_out"),
    "attn_pair_bias", ("layer_norm_a", "layer_norm_z", "linear_z", "mha"))


def openfold3_sizes(sd: Dict[str, Any], source: str) -> Dict[str, int]:
    """``PairformerStack`` sizes read off an OpenFold3 PairFormerStack state dict (keys ``blocks.i...``)."""
    shape = shape_reader(sd, source)
    b = "blocks.0."
    if b + "pair_stack.tri_mul_out.linear_ab_p.weight" in sd:
        raise ZooCheckpointError(f"{source}: fused triangle projections (fuse_projection_weights=True, "
                                 f"'{b}pair_stack.tri_mul_out.linear_ab_p.weight'): only OpenFold3's published "
                                 "layout (separate linear_a_p / linear_b_p) is read")
    if b + "pair_stack.pair_transition.layers.0.0.weight" in sd:
        raise ZooCheckpointError(f"{source}: a ReLU pair transition (transition_type='relu', "
                                 f"'{b}pair_stack.pair_transition.layers.0.0.weight'): the Pairformer's is SwiGLU")
    c_z = shape(b + "pair_stack.tri_mul_out.layer_norm_in.weight")[0]
    c_s = shape(b + "attn_pair_bias.layer_norm_a.weight")[0]
    heads_single = shape(b + "attn_pair_bias.linear_z.weight")[0]
    heads_pair = shape(b + "pair_stack.tri_att_start.linear_z.weight")[0]
    hidden_pair, rem = divmod(shape(b + "pair_stack.tri_att_start.mha.linear_q.weight")[0], heads_pair)
    width_single = shape(b + "attn_pair_bias.mha.linear_q.weight")[0]
    n, rem_t = divmod(shape(b + "pair_stack.pair_transition.swiglu.linear_a.weight")[0], c_z)
    if rem or rem_t or c_s % heads_single or width_single != c_s:
        raise ZooCheckpointError(
            f"{source}: sizes this stack cannot take: tri_att_start q width {heads_pair * hidden_pair + rem} over "
            f"{heads_pair} heads, pair transition hidden {n * c_z + rem_t} for c_z={c_z}, single attention width "
            f"{width_single} over {heads_single} heads for c_s={c_s} (head width must be c_s / heads)")
    return dict(c_s=c_s, c_z=c_z, num_blocks=num_blocks(sd), num_heads_single=heads_single,
                num_heads_pair=heads_pair, c_hidden_pair=hidden_pair,
                c_hidden_mul=shape(b + "pair_stack.tri_mul_out.linear_a_p.weight")[0], transition_n=n)


def from_openfold3(state_dict_or_module: Any, attention: Any = None, *, prefix: Optional[str] = None,
                   pair_dropout: float = 0.25, checkpoint_every: int = 0, chunk_size: Optional[int] = None,
                   map_location: Any = "cpu", allow_globals: Sequence[Any] = ()) -> nn.Module:
    """OpenFold3's trunk Pairformer -> ``PairformerStack(variant="openfold3")`` with the same outputs (eval mode).

    Args:
        state_dict_or_module: OpenFold3's ``PairFormerStack`` or whole model (a module), its state dict, or a
            checkpoint (a path, read with ``weights_only=True``, or the loaded dict; a ``state_dict`` entry is
            unwrapped). The trunk's stack is found by its keys (``...pairformer_stack.blocks.N...``); with several
            stacks in the file (the trunk's and a head's) the shortest ``pairformer_stack.`` prefix is taken.
        attention: the attention backend / options of the stack (see ``AttentionConfig.coerce``).
        prefix: the key prefix of the stack to load (``"pairformer_stack."``), when the file holds others.
        pair_dropout: OpenFold3's pair dropout (0.25 in its config; active in training only).
        checkpoint_every, chunk_size: passed to ``PairformerStack``.
        map_location: passed to ``torch.load`` when a path is given (the file is read as data).
        allow_globals: classes your file pickles, named by your code; the file still cannot name anything
            else (see ``zoo.read_checkpoint``).

    Sizes are read off the weights. The stack's forward ``(s, z, single_mask, pair_mask)`` takes OpenFold3's
    inputs with bool masks. Raises ``ZooCheckpointError`` naming every missing, unexpected, misshapen or non-float
    key, another model's file, a layout other than the published one; nothing half-loaded is returned.
    """
    return load_stack(state_dict_or_module, what=WHAT, marker=_MARKER, table=TABLE, sizes=openfold3_sizes,
                      variant="openfold3", attention=attention, prefix=prefix, pair_dropout=pair_dropout,
                      checkpoint_every=checkpoint_every, chunk_size=chunk_size, map_location=map_location,
                      allow_globals=allow_globals)


def to_openfold3(stack: nn.Module) -> Dict[str, Tensor]:
    """The inverse of :func:`from_openfold3`: a ``PairformerStack(variant="openfold3")`` -> the state dict of
    OpenFold3's ``PairFormerStack`` (``blocks.N...``; prefix it with ``pairformer_stack.`` for a whole model)."""
    return export_stack(stack, TABLE, "openfold3", "to_openfold3")
