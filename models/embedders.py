"""Input embedders: MSA and pair representations from tokens, with relative positions (AF2 Alg. 3-4).

``MSAEmbedder(msa [B, S, N], residue_index [B, N]) -> (m [B, S, N, c_m], z [B, N, N, c_z])``. The
query is row 0 of the (possibly masked) MSA. Plain nn.Modules: no Lightning, no Hydra.
"""
from __future__ import annotations

import torch
from torch import nn


class RelativePosition(nn.Module):
    """AF2 Alg. 4: ``z_ij += Linear(one_hot(clip(r_j - r_i, -k, k)))`` (an embedding of 2k+1 offsets).

    residue_index ``[B, N]`` long -> ``[B, N, N, c_z]``.
    """

    def __init__(self, c_z: int, max_relative: int = 32):
        super().__init__()
        self.max_relative = max_relative
        self.embedding = nn.Embedding(2 * max_relative + 1, c_z)

    def forward(self, residue_index: torch.Tensor) -> torch.Tensor:
        d = residue_index[:, None, :] - residue_index[:, :, None]  # [B, N, N]: r_j - r_i
        return self.embedding(d.clamp(-self.max_relative, self.max_relative) + self.max_relative)


class MSAEmbedder(nn.Module):
    """AF2 Alg. 3 with tokens in place of the one-hot features.

    m_si = E_msa[msa_si] + E_q[query_i]; z_ij = A[query_i] + B[query_j] + relpos(i, j).
    """

    def __init__(self, c_m: int, c_z: int, vocab_size: int = 24, max_relative: int = 32):
        super().__init__()
        self.msa = nn.Embedding(vocab_size, c_m)
        self.query_m = nn.Embedding(vocab_size, c_m)
        self.query_left = nn.Embedding(vocab_size, c_z)
        self.query_right = nn.Embedding(vocab_size, c_z)
        self.relpos = RelativePosition(c_z, max_relative)

    def forward(self, msa: torch.Tensor, residue_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if msa.dim() != 3 or residue_index.shape != (msa.shape[0], msa.shape[2]):
            raise ValueError(
                f"MSAEmbedder: msa must be [B, S, N] and residue_index [B, N]; got msa {tuple(msa.shape)}, "
                f"residue_index {tuple(residue_index.shape)}"
            )
        query = msa[:, 0]  # [B, N]
        m = self.msa(msa) + self.query_m(query)[:, None]  # [B, S, N, c_m]
        z = self.query_left(query)[:, :, None] + self.query_right(query)[:, None, :]  # [B, N, N, c_z]
        return m, z + self.relpos(residue_index)
