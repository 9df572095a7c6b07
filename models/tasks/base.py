"""Shared LightningModule plumbing: the network comes in as an argument, the optimizer and scheduler
as partials (lightning-hydra-template style)."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import lightning as L
import torch

from ..compiling import compile_module


class Task(L.LightningModule):
    """Base task.

    net: the nn.Module to train. optimizer: ``partial(torch.optim.X, lr=...)`` called with the
    parameters. scheduler: optional ``partial(torch.optim.lr_scheduler.Y, ...)`` called with the
    optimizer, stepped every ``scheduler_interval`` ('step' or 'epoch'). attention: the attention
    config the net was built with, kept only for the hyperparameter record (the net's modules
    already hold it). compile: wrap the net in ``torch.compile`` at fit start.

    Reloading: ``net_config`` is the net's constructor config (``_target_`` dicts, as in ``model.net``;
    ``train.py`` records it with ``record_net_config``). It is saved in the checkpoint's hyperparameters, so
    ``attn_zoo.models.zoo.load_checkpoint(path)`` (or ``Task.load_from_checkpoint(path)``) rebuilds the net
    with no config at hand; with ``net=None`` the net is built from it.
    pretrained: a path the zoo loads into the net before training (``zoo.load_pretrained``: a checkpoint
    trained here, a Boltz-2 checkpoint, a fair-esm ``.pt`` or a Hugging Face folder), read as data.
    allow_globals: classes ``pretrained`` pickles, named by your code; the file still cannot name anything else
    (``zoo.read_checkpoint``). ``net_config`` builds registered network classes only (``zoo.register_network``).
    Neither ``pretrained`` nor ``allow_globals`` is saved in the hyperparameters, and ``load_from_checkpoint``
    never takes them from the file.
    """

    def __init__(
        self,
        net: Optional[torch.nn.Module] = None,
        optimizer: Optional[Callable] = None,
        scheduler: Optional[Callable] = None,
        scheduler_interval: str = "step",
        attention: Any = None,
        compile: bool = False,
        net_config: Optional[Mapping[str, Any]] = None,
        pretrained: Optional[str] = None,
        allow_globals: Sequence[Any] = (),
    ):
        super().__init__()
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
        if net is None:
            if net_config is None:
                raise ValueError(f"{type(self).__name__} needs net (a module) or net_config (to build one); got neither")
            from ..zoo import build_network

            net = build_network(net_config)
        # hparams hold plain values only, so checkpoints load with torch.load(weights_only=True); the pretrained
        # path is not one of them: a reloaded checkpoint already holds the weights and the file may be gone
        self.save_hyperparameters(
            logger=False, ignore=["net", "optimizer", "scheduler", "attention", "pretrained", "allow_globals"]
        )
        if net_config is not None:
            self.record_net_config(net_config)
        if attention is not None:
            from ..primitives import AttentionConfig

            a = AttentionConfig.coerce(attention)
            self.hparams["attention"] = {"backend": a.backend, **a.options}
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.net = net
        if pretrained:
            from ..zoo import load_pretrained

            load_pretrained(pretrained, into=self.net, allow_globals=allow_globals)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, *args, allow_globals: Sequence[Any] = (), **kwargs):
        """Lightning's ``load_from_checkpoint``, always with ``weights_only=True``, and the file's hyperparameters
        never choose a file to read (``pretrained``). ``allow_globals``: classes your file pickles, named by your
        code; the file still cannot name anything else (``zoo.read_checkpoint``)."""
        from ..zoo_files import _allowed, data_only

        if kwargs.pop("weights_only", None) not in (None, True):
            raise ValueError("files are always read as data (weights_only=True); for classes your checkpoint "
                             "pickles, pass allow_globals=[YourClass] from your code")
        extra = _allowed(allow_globals)
        kwargs.setdefault("pretrained", None)  # the file's hyperparameters never choose a file to read ...
        kwargs["allow_globals"] = extra  # ... nor what it may unpickle
        with data_only(extra):
            return super().load_from_checkpoint(checkpoint_path, *args, weights_only=True, **kwargs)

    def record_net_config(self, config: Mapping[str, Any]) -> None:
        """Keep the net's constructor config (``_target_`` dicts, interpolations resolved) in the hparams
        that every checkpoint saves, so the net can be rebuilt from the checkpoint alone."""
        from ..primitives import _plain

        if not isinstance(config, Mapping) or "_target_" not in config:
            raise ValueError(f"net_config must be a mapping with a _target_, got {type(config).__name__}: {config!r}")
        self.hparams["net_config"] = _plain(config)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # which task class to rebuild (load_checkpoint(path, task=True)); a checkpoint key, not an hparam
        checkpoint["attn_zoo_task"] = f"{type(self).__module__}.{type(self).__qualname__}"

    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            compile_module(self.net, in_place=True)  # state_dict keys (and checkpoints) stay those of the plain net

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError(f"{type(self).__name__} was built without an optimizer: it can run, not train")
        optimizer = self.optimizer_factory(params=self.trainer.model.parameters())
        if self.scheduler_factory is None:
            return {"optimizer": optimizer}
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.hparams.scheduler_interval,
                             "frequency": 1, "monitor": "val/loss"},
        }

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        from .parallel import clip_sharded_gradients

        if not clip_sharded_gradients(self, gradient_clip_val, gradient_clip_algorithm):  # FSDP: its own norm
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

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
