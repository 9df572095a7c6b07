"""Train any attn-zoo model from configs (``attn-zoo-train`` installed, ``python train.py`` in a checkout).

    python train.py                                    # default: tiny Evoformer on the bundled real MSAs (CPU)
    python train.py experiment=longctx_clm trainer=gpu model.attention.backend=triton
    python train.py attention=chunked                  # same as model.attention.backend=chunked (+ chunk_size)
    python train.py ckpt_path=logs/train/runs/X/checkpoints/last.ckpt    # resume
    python train.py run_name=myrun resume=true         # resume run "myrun" from its last.ckpt if it exists
    python train.py debug=fdr                          # fast_dev_run: one batch of train/val/test

Everything is built by ``hydra.utils.instantiate`` (lightning-hydra-template conventions).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf


def validate_attention(cfg: DictConfig) -> None:
    """Fail before any data is loaded if ``model.attention`` names an unknown backend (the
    ValueError lists the valid names)."""
    from .models.primitives import AttentionConfig

    if cfg.get("model") is not None and cfg.model.get("attention") is not None:
        AttentionConfig.coerce(cfg.model.attention)


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiate every entry with a ``_target_`` in a callbacks/logger group (None entries skipped)."""
    out = []
    for name, conf in (group or {}).items():
        if conf is None:
            continue
        if not isinstance(conf, DictConfig) or "_target_" not in conf:
            raise ValueError(f"config entry {name!r} has no _target_: {conf}")
        out.append(hydra.utils.instantiate(conf))
    return out


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """``ckpt_path`` if given (must exist); else with ``resume=true`` the run's ``last.ckpt`` if it exists."""
    if cfg.get("ckpt_path"):
        path = Path(cfg.ckpt_path).expanduser()
        if not path.is_file():
            raise ValueError(f"ckpt_path {str(path)!r} does not exist")
        return str(path)
    if cfg.get("resume"):
        last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
        if last.is_file():
            print(f"[train] resuming from {last}", flush=True)
            return str(last)
        print(f"[train] resume=true but {last} does not exist: starting from scratch", flush=True)
    return None


def train(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Seed, instantiate data/model/callbacks/loggers/trainer, fit, test.

    Returns (metrics: the trainer's callback metrics as floats after fit and test, objects: cfg,
    datamodule, model, callbacks, loggers, trainer).
    """
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    if cfg.get("matmul_precision"):  # "high" lets fp32 matmuls use TF32 tensor cores
        import torch

        torch.set_float32_matmul_precision(cfg.matmul_precision)
    validate_attention(cfg)

    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data)
    model: L.LightningModule = hydra.utils.instantiate(cfg.model)
    if cfg.model.get("net") is not None and hasattr(model, "record_net_config"):  # zoo.load_checkpoint rebuilds from it
        model.record_net_config(OmegaConf.to_container(cfg.model.net, resolve=True))
    callbacks = instantiate_group(cfg.get("callbacks"))
    loggers = instantiate_group(cfg.get("logger"))
    if not loggers:  # LearningRateMonitor refuses to run without a logger
        callbacks = [c for c in callbacks if not isinstance(c, L.pytorch.callbacks.LearningRateMonitor)]
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers)

    attention = cfg.model.get("attention")
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"[train] model {cfg.model._target_} ({n_params / 1e6:.2f}M parameters), attention "
        f"{OmegaConf.to_container(attention) if attention is not None else None}, data {cfg.data._target_}",
        flush=True,
    )
    hparams = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    for logger in loggers:
        logger.log_hyperparams(hparams)

    metrics: dict[str, Any] = {}
    if cfg.get("train", True):
        trainer.fit(model=model, datamodule=datamodule, ckpt_path=resolve_ckpt_path(cfg))
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    if cfg.get("test", False):
        ckpt = getattr(trainer.checkpoint_callback, "best_model_path", "") or None
        if ckpt is None and not cfg.get("train", True):  # test only: the checkpoint the user named
            ckpt = resolve_ckpt_path(cfg)
        if ckpt is None:
            print("[train] no best checkpoint: testing the current weights", flush=True)
        trainer.test(model=model, datamodule=datamodule, ckpt_path=ckpt)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})

    summary = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if k.startswith(("val/", "test/")))
    print(f"[train] done at global step {trainer.global_step}: {summary}", flush=True)
    objects = dict(cfg=cfg, datamodule=datamodule, model=model, callbacks=callbacks, loggers=loggers, trainer=trainer)
    return metrics, objects


@hydra.main(version_base="1.3", config_path="pkg://attn_zoo.configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    metrics, _ = train(cfg)
    name = cfg.get("optimized_metric")  # for Hydra sweepers
    return metrics.get(name) if name else None


if __name__ == "__main__":
    main()
