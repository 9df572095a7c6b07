"""Shared LightningModule plumbing: the network comes in as an argument, the optimizer and scheduler
as partials (lightning-hydra-template style)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import lightning as L
import torch


class Task(L.LightningModule):
    """Base task.

    net: the nn.Module to train. optimizer: ``partial(torch.optim.X, lr=...)`` called with the
    parameters. scheduler: optional ``partial(torch.optim.lr_scheduler.Y, ...)`` called with the
    optimizer, stepped every ``scheduler_interval`` ('step' or 'epoch'). attention: the attention
    config the net was built with, kept only for the hyperparameter record (the net's modules
    already hold it). compile: wrap the net in ``torch.compile`` at fit start.
    """

    def __init__(
        self,
        net: torch.nn.Module,
        optimizer: Callable,
        scheduler: Optional[Callable] = None,
        scheduler_interval: str = "step",
        attention: Any = None,
        compile: bool = False,
    ):
        super().__init__()
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
        # hparams hold plain values only, so checkpoints load with torch.load(weights_only=True)
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer", "scheduler", "attention"])
        if attention is not None:
            from ..primitives import AttentionConfig

            a = AttentionConfig.coerce(attention)
            self.hparams["attention"] = {"backend": a.backend, **a.options}
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.net = net

    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            self.net.compile()  # in place: state_dict keys (and checkpoints) stay those of the plain net

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=self.trainer.model.parameters())
        if self.scheduler_factory is None:
            return {"optimizer": optimizer}
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.hparams.scheduler_interval,
                             "frequency": 1, "monitor": "val/loss"},
        }

    # subclasses implement: step(batch) -> (loss, {name: value}, batch_size)
    def step(self, batch: dict):
        raise NotImplementedError

    def _shared(self, batch, stage: str):
        loss, logs, batch_size = self.step(batch)
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, on_step=on_step, on_epoch=True, prog_bar=True, batch_size=batch_size)
        for name, value in logs.items():
            self.log(f"{stage}/{name}", value, on_step=False, on_epoch=True, batch_size=batch_size)
        return loss

    def training_step(self, batch, batch_idx):
        return self._shared(batch, "train")

    def validation_step(self, batch, batch_idx):
        return self._shared(batch, "val")

    def test_step(self, batch, batch_idx):
        return self._shared(batch, "test")
