"""Output heads: distogram (AF2 1.9.8), masked MSA (AF2 1.9.9) and language-model logits.

Heads are plain linear maps with PyTorch's default init (not zero), so the first loss already
depends on the trunk.
"""
from __future__ import annotations

import torch
from torch import nn


class DistogramHead(nn.Module):
    """z ``[B, N, N, c_z]`` -> symmetric logits ``[B, N, N, num_bins]`` (logits_ij = logits_ji)."""

    def __init__(self, c_z: int, num_bins: int = 64):
        super().__init__()
        self.linear = nn.Linear(c_z, num_bins)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        logits = self.linear(z)  # [B, N, N, bins]
        return logits + logits.transpose(-2, -3)


class MaskedMSAHead(nn.Module):
    """m ``[B, S, N, c_m]`` -> logits ``[B, S, N, num_classes]`` over the token alphabet."""

    def __init__(self, c_m: int, num_classes: int = 24):
        super().__init__()
        self.linear = nn.Linear(c_m, num_classes)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        return self.linear(m)


class LMHead(nn.Module):
    """x ``[B, L, d]`` -> logits ``[B, L, vocab_size]`` (LayerNorm then Linear), for trunks without
    their own output layer."""

    def __init__(self, d_model: int, vocab_size: int = 24):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.linear = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))
