"""Masked-MSA + distogram training (AlphaFold2 supplement 1.9.8-1.9.9) on an Evoformer or Pairformer trunk."""
from __future__ import annotations

import torch

from .base import Task
from .metrics import long_range_contact_precision, masked_accuracy, masked_cross_entropy
from .parallel import loss_group


class MSADistogramTask(Task):
    """loss = masked_msa_weight * CE(masked MSA tokens) + distogram_weight * CE(distance bins).

    ``net(batch)`` returns msa_logits ``[B, S', N, C]`` and distogram_logits ``[B, N, N, 64]``; the
    masked-MSA loss scores the S' rows the trunk returns (all rows for the Evoformer, the query for
    the Pairformer). Examples without a structure contribute no distogram loss. Logged:
    loss, msa_loss, msa_accuracy, msa_perplexity, distogram_loss, and (val/test) contact_precision:
    top-L long-range (|i-j| >= 24) contact precision where structures exist.
    """

    def __init__(self, net=None, optimizer=None, scheduler=None, scheduler_interval="step", attention=None,
                 compile=False, masked_msa_weight: float = 1.0, distogram_weight: float = 1.0, net_config=None,
                 pretrained=None, allow_globals=()):
        super().__init__(net, optimizer, scheduler, scheduler_interval, attention, compile, net_config, pretrained,
                         allow_globals)

    def step(self, batch):
        out = self.net(batch)
        rows = out["msa_logits"].shape[1]
        target = batch["msa_target"][:, :rows]  # [B, S', N]
        loss_mask = batch["msa_loss_mask"][:, :rows] & batch["msa_mask"][:, :rows]
        group = loss_group(self)  # several processes: means over the whole global batch
        msa_loss, _ = masked_cross_entropy(out["msa_logits"], target, loss_mask, group)
        dist_loss, n_pairs = masked_cross_entropy(out["distogram_logits"], batch["distogram"], batch["distogram_mask"],
                                                  group)
        h = self.hparams
        loss = h.masked_msa_weight * msa_loss + h.distogram_weight * dist_loss
        logs = {
            "msa_loss": msa_loss.detach(),
            "msa_accuracy": masked_accuracy(out["msa_logits"].detach(), target, loss_mask),
            "msa_perplexity": msa_loss.detach().exp(),
        }
        if n_pairs > 0:
            logs["distogram_loss"] = dist_loss.detach()
        if not self.training and n_pairs > 0:
            precision, n = long_range_contact_precision(
                out["distogram_logits"].detach(), batch["distogram"], batch["distogram_mask"],
                residue_index=batch["residue_index"],
            )
            if n > 0:
                logs["contact_precision"] = precision
        return loss, logs, batch["msa"].shape[0]
