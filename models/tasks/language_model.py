"""Language-model training: protein masked LM (ESM-2 style) and causal long-context LM.

One task serves both; the data decides which: masked-LM batches score the BERT-masked positions,
causal-LM batches score every next token (the network is built with ``causal=True``).

Context-parallel training of the long-context LM (ring attention over all ranks): ``trainer=context_parallel``
(``parallel.ContextParallelStrategy``: every rank draws the same batches and keeps its shard of the sequence).
"""
from __future__ import annotations

from .base import Task
from .metrics import masked_accuracy, masked_cross_entropy
from .parallel import loss_group


class LanguageModelTask(Task):
    """``net(tokens [B, L], pad_mask [B, L]) -> logits [B, L, V]``; loss = mean CE over
    ``loss_mask & pad_mask``. Logged: loss, perplexity, accuracy, tokens (scored per batch)."""

    def step(self, batch):
        # context parallel (net given a process group): every rank holds the same batch and keeps its sequence
        # shard; the global-mean loss and DDP's gradient average then give the full-sequence step
        if hasattr(self.net, "shard_batch"):
            batch = self.net.shard_batch(batch)
        packed = {k: batch[k] for k in ("segment_ids", "positions") if batch.get(k) is not None}
        logits = self.net(batch["tokens"], batch["pad_mask"], **packed)  # packed rows: see data/packing.py
        mask = batch["loss_mask"] & batch["pad_mask"]
        loss, n = masked_cross_entropy(logits, batch["target"], mask, loss_group(self))  # global mean over ranks
        logs = {"perplexity": loss.detach().exp(), "accuracy": masked_accuracy(logits.detach(), batch["target"], mask)}
        return loss, logs, batch["tokens"].shape[0]
