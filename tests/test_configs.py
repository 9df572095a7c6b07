"""Every config in every group composes and instantiates; the attention backend flag works both ways and
an unknown backend fails at config time with the list of valid names."""
from pathlib import Path

import hydra
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from attn_ops import registry
import attn_zoo.models.tasks  # noqa: F401  (import before any torch.device("meta") context)
from attn_zoo.models.primitives import AttentionConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
GROUPS = ["model", "attention", "data", "trainer", "callbacks", "logger", "paths", "debug", "experiment"]
ALL = [(g, p.stem) for g in GROUPS for p in sorted((CONFIG_DIR / g).glob("*.yaml"))]
ON_GPU = torch.cuda.is_available()


def make_cfg(overrides=(), output_dir="/tmp/attn-zoo-test") -> DictConfig:
    """Compose train.yaml with overrides, outside a Hydra run (paths.output_dir set by hand)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
        cfg.paths.work_dir = str(Path.cwd())
    return cfg


def instantiate_model(cfg):
    """Build the model on the meta device: AlphaFold-size configs cost no memory or init time."""
    with torch.device("meta"):
        return hydra.utils.instantiate(cfg.model)


def test_every_group_has_configs():
    names = {g: [n for gg, n in ALL if gg == g] for g in GROUPS}
    assert set(names["model"]) == {"evoformer_tiny", "evoformer_af2", "pairformer_tiny", "pairformer_af3",
                                   "transformer_mlm", "esm2", "esmc", "longctx_lm"}
    assert set(names["attention"]) == {"auto", "torch", "chunked", "triton", "sdpa", "flex", "cudnn"}
    assert {"cpu", "gpu", "ddp", "fsdp"} <= set(names["trainer"])
    assert {"csv", "tensorboard"} <= set(names["logger"]) and {"fdr", "overfit", "profiler"} <= set(names["debug"])


@pytest.mark.parametrize("group,name", ALL, ids=[f"{g}/{n}" for g, n in ALL])
def test_config_composes_and_instantiates(group, name, tmp_path):
    cfg = make_cfg([f"{group}={name}"], tmp_path)
    node = cfg.model.attention if group == "attention" else cfg.get(group)
    assert node is not None or group in ("debug", "experiment")  # those two are @package _global_
    if group == "attention":
        assert node.backend == name
    if group in ("model", "attention", "experiment"):
        model = instantiate_model(cfg)
        assert sum(p.numel() for p in model.parameters()) > 0
        assert AttentionConfig.coerce(cfg.model.attention).backend == cfg.model.attention.backend
    if group in ("data", "experiment"):
        dm = hydra.utils.instantiate(cfg.data)
        assert dm.hparams or hasattr(dm, "shape")
    if group in ("callbacks", "experiment", "debug"):
        for conf in cfg.callbacks.values():
            if conf is not None:
                hydra.utils.instantiate(conf)
    if group == "logger":
        for conf in cfg.logger.values():
            hydra.utils.instantiate(conf)
    if group in ("trainer", "debug", "experiment"):
        with open_dict(cfg):
            if not ON_GPU:  # GPU trainer configs are checked for composition here, built with the CPU accelerator
                cfg.trainer.accelerator, cfg.trainer.devices = "cpu", 1
                cfg.trainer.precision = "32-true" if cfg.trainer.precision == "bf16-mixed" else cfg.trainer.precision
                strategy = cfg.trainer.get("strategy")
                if isinstance(strategy, DictConfig):  # FSDP refuses the CPU accelerator: build it alone
                    from lightning.pytorch.strategies import Strategy

                    assert isinstance(hydra.utils.instantiate(strategy), Strategy)
                    cfg.trainer.strategy = "auto"
        trainer = hydra.utils.instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
        assert trainer.max_epochs == cfg.trainer.get("max_epochs", trainer.max_epochs)
    if group == "paths":
        assert Path(cfg.paths.log_dir).name == "logs"


@pytest.mark.parametrize("override", ["attention=torch", "model.attention.backend=torch"])
def test_backend_flag_reaches_every_attention_module(override, tmp_path):
    cfg = make_cfg(["model=evoformer_tiny", override], tmp_path)
    assert cfg.model.net.trunk.attention.backend == "torch"
    model = instantiate_model(cfg)
    configs = {m.attention.backend for m in model.modules() if isinstance(getattr(m, "attention", None), AttentionConfig)}
    assert configs == {"torch"}


def test_chunked_options_reach_the_model(tmp_path):
    cfg = make_cfg(["model=pairformer_tiny", "attention=chunked", "model.attention.chunk_size=16"], tmp_path)
    assert AttentionConfig.coerce(cfg.model.net.trunk.stack.attention) == AttentionConfig("chunked", {"chunk_size": 16})


@pytest.mark.parametrize("model", ["evoformer_tiny", "longctx_lm"])
def test_unknown_backend_fails_at_config_time_with_valid_names(model, tmp_path):
    cfg = make_cfg([f"model={model}", "model.attention.backend=trtion"], tmp_path)
    with pytest.raises(Exception) as e:
        instantiate_model(cfg)
    msg = str(e.value)
    assert "trtion" in msg and all(name in msg for name in ("triton", "torch", "chunked", "sdpa", "flex", "auto"))
    from attn_zoo import train

    with pytest.raises(ValueError, match="valid names"):
        train.validate_attention(cfg)


def test_valid_names_come_from_the_registry():
    with pytest.raises(ValueError) as e:
        registry.validate_backend_name("nope")
    for name in ("triton", "torch", "chunked", "sdpa", "flex"):
        assert name in str(e.value)


def test_packing_with_ddp_is_refused_at_config_time(tmp_path):
    from attn_zoo.checks import ConfigError, check_config

    cfg = make_cfg(["experiment=transformer_mlm", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                    "trainer.precision=32-true", "attention=chunked", "data.packing=true"], tmp_path)
    with pytest.raises(ConfigError, match="data.packing=true runs in one process"):
        check_config(cfg)
    check_config(make_cfg(["experiment=transformer_mlm", "data.packing=true"], tmp_path))  # one process: fine
