"""Hydra configs of attn-zoo (installed as ``attn_zoo.configs``; ``pkg://attn_zoo.configs`` finds them)."""
