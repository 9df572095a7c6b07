"""Masked-LM training of the real ESM-2 (``models/esm2.py``: fair-esm's 33-token alphabet and layout) and of
ESM C (``models/esmc.py``: the same token ids, ``|`` in place of ``<null_1>``).

The masked-LM data (``models/data/lm.py``) speak the project's 24-token alphabet; each batch is rewritten into
ESM-2's tokens here: every residue, gap, ``<mask>`` and ``<pad>`` maps to its ESM-2 token (X stays X: the data
alphabet already folded B, Z, U and O into it) and each crop is wrapped in ``<cls> ... <eos>``, as fair-esm's
``BatchConverter`` does. The loss scores the masked residues only, so a checkpoint trained here and a fair-esm
file are the same model to ``zoo.load_esm2`` and ``attn-zoo-embed`` (likewise an ESM C and ``from_esmc``).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..data.alphabet import MASK, PAD, TOKENS
from ..esm2 import ALPHABET, ESM2
from ..esmc import ESMC
from ..graphs import CUDAGraphs, Logits
from .base import Task
from .metrics import masked_accuracy, masked_cross_entropy
from .parallel import loss_group


def _data_to_esm2() -> torch.Tensor:
    """``[24]`` lookup table: data-alphabet token -> ESM-2 token."""
    lut = [ALPHABET.get_idx(t) for t in TOKENS]
    lut[MASK], lut[PAD] = ALPHABET.mask_idx, ALPHABET.padding_idx
    if ALPHABET.unk_idx in lut:
        raise RuntimeError(f"the data alphabet has a token ESM-2 lacks: {TOKENS[lut.index(ALPHABET.unk_idx)]!r}")
    return torch.tensor(lut, dtype=torch.long)


DATA_TO_ESM2 = _data_to_esm2()


def _esm2_packed_batch(batch: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """A packed masked-LM batch whose crops have a free slot before and after them (``data.packing_frame=2``) ->
    ESM-2 ``tokens`` / ``target`` ``[B, W]`` with ``<cls>`` and ``<eos>`` in those slots, the scored ``mask`` and
    ``segment_ids`` (-1 on padding)."""
    tokens, target, pad_mask, seg = batch["tokens"], batch["target"], batch["pad_mask"], batch["segment_ids"]
    real = seg >= 0
    edge = torch.ones_like(seg[:, :1], dtype=torch.bool)
    first = real & torch.cat([edge, seg[:, 1:] != seg[:, :-1]], 1)  # a segment's first slot
    last = real & torch.cat([seg[:, :-1] != seg[:, 1:], edge], 1)  # its last slot
    # a residue in a crop's first or last slot, or a gap inside a crop: the batch has no frame (one host read)
    misplaced = ((first | last) & pad_mask) | (real & ~pad_mask & ~first & ~last)
    if bool(misplaced.any()):
        raise ValueError("packed ESM batches need a free slot before and after each crop for <cls> and <eos>: set "
                         "data.packing_frame=2 with data.packing=true")
    lut = DATA_TO_ESM2.to(tokens.device)

    def esm(t: torch.Tensor) -> torch.Tensor:
        out = torch.where(pad_mask, lut[t.clamp(0, len(TOKENS) - 1)], ALPHABET.padding_idx)
        return out.masked_fill(first, ALPHABET.cls_idx).masked_fill(last, ALPHABET.eos_idx)

    return {"tokens": esm(tokens), "target": esm(target), "mask": batch["loss_mask"] & pad_mask,
            "segment_ids": seg}


def esm2_batch(batch: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """A masked-LM batch (tokens, target, loss_mask, pad_mask ``[B, L]``, right-padded) -> ESM-2 ``tokens`` and
    ``target`` ``[B, L + 2]`` (``<cls>`` residues ``<eos>`` ``<pad>``...) and the scored ``mask`` ``[B, L + 2]``.
    A packed batch (``segment_ids``; ``data.packing=true`` with ``data.packing_frame=2``) keeps its width: each crop's
    ``<cls>`` and ``<eos>`` go into the slots kept around it, and ``segment_ids`` comes along."""
    if batch.get("segment_ids") is not None:
        return _esm2_packed_batch(batch)
    tokens, target, pad_mask = batch["tokens"], batch["target"], batch["pad_mask"]
    if tokens.ndim != 2 or tokens.shape != pad_mask.shape or tokens.shape != target.shape:
        raise ValueError(f"ESM-2 batches need tokens, target and pad_mask [B, L] of one shape, got "
                         f"{tuple(tokens.shape)}, {tuple(target.shape)}, {tuple(pad_mask.shape)}")
    lengths = pad_mask.sum(1)  # [B]
    if not torch.equal(pad_mask, torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]):
        raise ValueError("ESM-2 batches must be right-padded (pad_mask True on a prefix of each row)")
    lut = DATA_TO_ESM2.to(tokens.device)
    b = tokens.shape[0]

    def wrap(t: torch.Tensor) -> torch.Tensor:  # [B, L] data tokens -> [B, L + 2] ESM-2 tokens
        out = torch.full((b, t.shape[1] + 2), ALPHABET.padding_idx, dtype=torch.long, device=t.device)
        out[:, 1:-1] = torch.where(pad_mask, lut[t.clamp(0, len(TOKENS) - 1)], ALPHABET.padding_idx)
        out[:, 0] = ALPHABET.cls_idx
        out[torch.arange(b, device=t.device), lengths + 1] = ALPHABET.eos_idx
        return out

    mask = torch.zeros(b, tokens.shape[1] + 2, dtype=torch.bool, device=tokens.device)
    mask[:, 1:-1] = batch["loss_mask"] & pad_mask
    return {"tokens": wrap(tokens), "target": wrap(target), "mask": mask}


class ESMMaskedLMTask(Task):
    """Masked-LM training (from scratch or fine-tuning) of an :class:`~attn_zoo.models.esm2.ESM2` or an
    :class:`~attn_zoo.models.esmc.ESMC`.

    ``net``: the ESM2 or ESMC (``configs/model/esm2.yaml``, ``esmc.yaml``). ``size``: the published size the
    config named (``model.size``), kept for the hyperparameter record only (the net was built with it). Loss:
    mean CE over the masked residues; logged: loss, perplexity, accuracy. ``cuda_graphs``: training steps on a GPU
    replay the net's forward and backward as CUDA graphs (:class:`~attn_zoo.models.graphs.CUDAGraphs`, the
    gradients in the capture's memory), one capture per batch shape: for batches of fixed shape (``data.packing``
    rows, or a fixed crop); one process only (not with DDP / FSDP). Other arguments:
    :class:`~attn_zoo.models.tasks.Task`.
    """

    def __init__(self, net: Optional[torch.nn.Module] = None, size: Optional[str] = None, cuda_graphs: bool = False,
                 **kwargs):
        if cuda_graphs and kwargs.get("compile"):
            raise ValueError("ESMMaskedLMTask takes cuda_graphs or compile, not both (model.cuda_graphs, "
                             "model.compile)")
        super().__init__(net=net, **kwargs)
        if not isinstance(self.net, (ESM2, ESMC)):
            raise TypeError(f"{type(self).__name__} trains an attn_zoo ESM2 or ESMC (model.net._target_: "
                            f"attn_zoo.models.esm2.ESM2 or attn_zoo.models.esmc.ESMC), got {type(self.net).__name__}")
        # not a sub-module: the state_dict (and checkpoints) stay the net's
        self.__dict__["_graphed"] = None
        if isinstance(self.net, ESM2):  # the masked-LM loss never reaches the contact regression: frozen, so DDP
            self.net.contact_head.requires_grad_(False)  # finds no unused parameter and no optimizer state is kept

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        # masked-LM training never trains ESM-2's contact regression: one that no file provided stays refused
        head = getattr(self.net, "contact_head", None)
        if head is not None:
            checkpoint["attn_zoo_contacts"] = bool(head.loaded)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.hparams.get("cuda_graphs") and stage == "fit" and self.trainer.world_size > 1:
            raise ValueError(f"model.cuda_graphs runs in one process; this run has {self.trainer.world_size} "
                             f"(trainer.strategy): set model.cuda_graphs=false")

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        if self._graphed is not None:
            # Lightning zeroes the gradients after the next step's forward, whose replay rewrites the capture's
            # gradient buffers: the wrapper would first copy every gradient out (one copy of all of them a step)
            self.net.zero_grad(set_to_none=True)

    def _logits(self, tokens: torch.Tensor, segment_ids: Optional[torch.Tensor]) -> torch.Tensor:
        keyword = "sequence_id" if isinstance(self.net, ESMC) else "segment_ids"
        if self.hparams.get("cuda_graphs") and self.training:  # (CUDAGraphs runs the net itself where it cannot
            if self._graphed is None:                            # capture: off CUDA, autograd off)
                self.__dict__["_graphed"] = CUDAGraphs(Logits(self.net, keyword), share_grad_memory=True)
            return self._graphed(tokens, *(() if segment_ids is None else (segment_ids,)))
        return self.net(tokens, **({} if segment_ids is None else {keyword: segment_ids}))["logits"]

    def step(self, batch):
        b = esm2_batch(batch)
        logits = self._logits(b["tokens"], b.get("segment_ids"))  # [B, L', 33] (ESM C: 64 rows, 31 never targets)
        loss, _ = masked_cross_entropy(logits, b["target"], b["mask"], loss_group(self))
        logs = {"perplexity": loss.detach().exp(), "accuracy": masked_accuracy(logits.detach(), b["target"], b["mask"])}
        return loss, logs, b["tokens"].shape[0]
