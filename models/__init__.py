"""attn-zoo model blocks: Evoformer, Pairformer and long-context transformers built on ``attn_ops``.

Import the blocks from their modules, e.g. ``from models.evoformer import EvoformerBlock``.
"""
