"""attn-zoo model blocks: Evoformer, Pairformer and long-context transformers built on ``attn_ops``.

Installed as ``attn_zoo.models``; import the blocks from their modules, e.g.
``from attn_zoo.models.evoformer import EvoformerBlock``.
"""
