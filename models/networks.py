"""Networks the tasks train: an embedder, a trunk and heads composed into one nn.Module.

``MSADistogramNet`` runs any trunk with the Evoformer interface
``trunk(m [B,S,N,c_m], z [B,N,N,c_z], msa_mask [B,S,N], pair_mask [B,N,N]) -> (m, z)``;
``PairformerTrunk`` gives a ``PairformerStack`` that interface (single representation = query row
plus the MSA mean, returned as a one-row MSA).
"""
from __future__ import annotations

import torch
from torch import nn


class PairformerTrunk(nn.Module):
    """Adapter: (m, z, msa_mask, pair_mask) -> (s[:, None] ``[B, 1, N, c_s]``, z) through a Pairformer.

    s_i = Linear(m_0i + mean over real rows of m_si): the query with an MSA profile summary.
    """

    def __init__(self, stack: nn.Module, c_m: int, c_s: int):
        super().__init__()
        self.stack = stack
        self.to_single = nn.Linear(c_m, c_s)

    def forward(self, m, z, msa_mask, pair_mask):
        w = msa_mask[..., None].to(m.dtype)  # [B, S, N, 1]
        profile = (m * w).sum(1) / w.sum(1).clamp(min=1.0)  # [B, N, c_m]
        s = self.to_single(m[:, 0] + profile)  # [B, N, c_s]
        s, z = self.stack(s, z, msa_mask[:, 0], pair_mask)
        return s[:, None], z  # [B, 1, N, c_s]


class MSADistogramNet(nn.Module):
    """embedder -> trunk -> (masked-MSA head on m, distogram head on z).

    forward(batch) with batch keys msa ``[B,S,N]``, residue_index ``[B,N]``, msa_mask ``[B,S,N]``,
    pair_mask ``[B,N,N]`` -> {"msa_logits": ``[B,S',N,C]`` (S' = rows the trunk returns),
    "distogram_logits": ``[B,N,N,bins]``}.
    """

    def __init__(self, embedder: nn.Module, trunk: nn.Module, masked_msa_head: nn.Module, distogram_head: nn.Module):
        super().__init__()
        self.embedder, self.trunk = embedder, trunk
        self.masked_msa_head, self.distogram_head = masked_msa_head, distogram_head

    def forward(self, batch: dict) -> dict:
        m, z = self.embedder(batch["msa"], batch["residue_index"])
        m, z = self.trunk(m, z, batch["msa_mask"], batch["pair_mask"])
        return {"msa_logits": self.masked_msa_head(m), "distogram_logits": self.distogram_head(z)}
