"""Config checks that run before any data is read or any model is built.

A typed schema for the ``trainer``, ``data`` and ``model.attention`` groups: a wrong type or range fails
with the option's full name (``trainer.max_epochs must be an int >= -1, got 'abc'``), an unknown key
names the valid ones, and an attention backend that cannot run (or train) on the chosen device fails
with the fix. Hydra's struct mode already refuses unknown *override* keys; these checks cover values.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf


class ConfigError(ValueError):
    """A config value that cannot work; the message names the option (``group.key``)."""


@dataclass(frozen=True)
class Opt:
    """What one option accepts: a checker returning None (fine) or a description of what is expected."""

    check: Callable[[Any], bool]
    expected: str
    nullable: bool = False

    def validate(self, name: str, value: Any) -> None:
        if value is None:
            if self.nullable:
                return
            raise ConfigError(f"{name} must be {self.expected}, got null")
        ok = False
        try:
            ok = bool(self.check(value))
        except Exception:
            ok = False
        if not ok:
            raise ConfigError(f"{name} must be {self.expected}{' (or null)' if self.nullable else ''}, got {value!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def Int(lo: int | None = None, nullable=False) -> Opt:
    return Opt(lambda v: _is_int(v) and (lo is None or v >= lo), "an int" + (f" >= {lo}" if lo is not None else ""), nullable)


def Float(lo=None, hi=None, hi_open=False, nullable=False) -> Opt:
    def ok(v):
        return _is_num(v) and (lo is None or v >= lo) and (hi is None or (v < hi if hi_open else v <= hi))

    rng = ""
    if lo is not None and hi is not None:
        rng = f" in [{lo}, {hi}{')' if hi_open else ']'}"
    elif lo is not None:
        rng = f" >= {lo}"
    return Opt(ok, "a number" + rng, nullable)


def Bool(nullable=False) -> Opt:
    return Opt(lambda v: isinstance(v, bool), "true or false", nullable)


def Str(nullable=False) -> Opt:
    return Opt(lambda v: isinstance(v, str) and v != "", "a non-empty string", nullable)


def Choice(*values, nullable=False) -> Opt:
    return Opt(lambda v: v in values, "one of " + ", ".join(repr(v) for v in values), nullable)


def Any_(*opts: Opt, expected: str, nullable=False) -> Opt:
    def ok(v):
        for o in opts:
            try:
                o.validate("", v)
                return True
            except ConfigError:
                pass
        return False

    return Opt(ok, expected, nullable)


def StrList(nullable=True) -> Opt:
    return Opt(lambda v: isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)),
               "a list of names (or one comma-separated string)", nullable)


# a batch limit: an int count >= 0 or a fraction in [0, 1]
LIMIT = Any_(Int(0), Float(0, 1), expected="an int >= 0 (batches) or a fraction in [0, 1]", nullable=True)

TRAINER: dict[str, Opt] = {
    "max_epochs": Int(-1, nullable=True),
    "min_epochs": Int(0, nullable=True),
    "max_steps": Int(-1),
    "min_steps": Int(0, nullable=True),
    "accelerator": Choice("cpu", "gpu", "cuda", "mps", "tpu", "auto"),
    "devices": Any_(Int(-1), Str(), Opt(lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v), ""),
                    expected="an int (-1 = all), 'auto' or a list of device ids"),
    "num_nodes": Int(1),
    "precision": Choice("64-true", "64", 64, "32-true", "32", 32, "16-mixed", "16", 16, "bf16-mixed", "bf16",
                        "16-true", "bf16-true", "transformer-engine", "transformer-engine-float16", nullable=True),
    "gradient_clip_val": Float(0, nullable=True),
    "gradient_clip_algorithm": Choice("norm", "value", nullable=True),
    "accumulate_grad_batches": Int(1),
    "check_val_every_n_epoch": Int(1, nullable=True),
    "val_check_interval": Any_(Int(1), Float(0, 1), expected="an int >= 1 (batches) or a fraction in [0, 1]",
                               nullable=True),
    "log_every_n_steps": Int(1, nullable=True),
    "deterministic": Opt(lambda v: isinstance(v, bool) or v == "warn", "true, false or 'warn'", True),
    "benchmark": Bool(nullable=True),
    "limit_train_batches": LIMIT,
    "limit_val_batches": LIMIT,
    "limit_test_batches": LIMIT,
    "limit_predict_batches": LIMIT,
    "num_sanity_val_steps": Int(-1, nullable=True),
    "fast_dev_run": Any_(Bool(), Int(0), expected="true, false or an int >= 0 (batches)"),
    "overfit_batches": Any_(Int(0), Float(0, 1), expected="an int >= 0 (batches) or a fraction in [0, 1]"),
    "enable_progress_bar": Bool(nullable=True),
    "enable_checkpointing": Bool(nullable=True),
    "enable_model_summary": Bool(nullable=True),
    "sync_batchnorm": Bool(),
    "use_distributed_sampler": Bool(),
    "default_root_dir": Str(nullable=True),
}

PATH = Str(nullable=True)
FRACTION = Float(0, 1, hi_open=True)
DATA: dict[str, Opt] = {
    "msa_dir": PATH, "mmcif_dir": PATH, "fasta": PATH, "cluster_file": PATH,
    "batch_size": Int(1),
    "crop_size": Int(1, nullable=True),
    "msa_depth": Int(1),
    "mask_prob": Float(0, 1, hi_open=True),
    "max_msa_rows": Int(1, nullable=True),
    "train_samples": Int(1, nullable=True),
    "val_samples": Int(1, nullable=True),
    "test_samples": Int(1, nullable=True),
    "val_fraction": FRACTION,
    "test_fraction": FRACTION,
    "val_names": StrList(), "test_names": StrList(),
    "split_seed": Int(0),
    "num_workers": Int(0),
    "max_len": Int(1),
    "seq_len": Int(1),
    "length": Int(1),
    "msa_rows": Choice("query", "all"),
    "packing": Bool(),
}

ATTENTION_OPTIONS: dict[str, Opt] = {
    "deterministic": Bool(),
    "chunk_size": Int(1),
    "bwd": Choice("split", "fused"),
}


def _target_params(target: str) -> dict[str, inspect.Parameter] | None:
    """The keyword parameters of a ``_target_`` class or function (None if it takes ``**kwargs`` or
    cannot be imported: then unknown keys are left to the target itself)."""
    mod, _, attr = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(mod), attr)
        params = inspect.signature(obj).parameters
    except Exception:
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return {n: p for n, p in params.items() if n != "self"}


def _check_group(group: str, node: Mapping, schema: Mapping[str, Opt], known_extra=()) -> None:
    params = _target_params(node["_target_"]) if "_target_" in node else None
    for key, value in node.items():
        key = str(key)
        if key.startswith("_"):
            continue
        if params is not None and key not in params and key not in known_extra:
            raise ConfigError(
                f"{group}.{key} is not an option of {node['_target_']}; its options: {', '.join(sorted(params))}"
            )
        if key in schema:
            schema[key].validate(f"{group}.{key}", value)


def _plain(node):
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def check_trainer(trainer: Mapping) -> None:
    _check_group("trainer", trainer, TRAINER)
    if trainer.get("accelerator") in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"trainer.accelerator={trainer['accelerator']} but this machine has no CUDA device: use trainer=cpu "
                f"(and model.attention.backend=chunked or auto), or run on a GPU machine"
            )
    if trainer.get("max_epochs") == -1 and trainer.get("max_steps", -1) in (-1, None) \
            and trainer.get("max_time") is None and not trainer.get("fast_dev_run"):
        raise ConfigError(
            "trainer.max_epochs=-1 with trainer.max_steps=-1 trains until killed (Lightning's 'no limit'): set "
            "trainer.max_steps=N or trainer.max_time=DD:HH:MM:SS as well, or a trainer.max_epochs >= 1"
        )
    for lo, hi in (("min_epochs", "max_epochs"), ("min_steps", "max_steps")):
        a, b = trainer.get(lo), trainer.get(hi)
        if _is_int(a) and _is_int(b) and b >= 0 and a > b:
            raise ConfigError(f"trainer.{lo}={a} is larger than trainer.{hi}={b}")


def check_data(data: Mapping) -> None:
    _check_group("data", data, DATA)
    fractions = [data.get(k) for k in ("val_fraction", "test_fraction")]
    if all(_is_num(f) for f in fractions) and sum(fractions) >= 1.0:
        raise ConfigError(
            f"data.val_fraction + data.test_fraction must be < 1 (some proteins must train), got {fractions[0]} + {fractions[1]}"
        )


def _devices(trainer: Mapping) -> str:
    """'cuda' or 'cpu': where the trainer will run the model."""
    import torch

    acc = trainer.get("accelerator", "auto")
    if acc in ("gpu", "cuda"):
        return "cuda"
    if acc == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu" if acc == "cpu" else str(acc)


def check_attention(attention: Mapping | None, trainer: Mapping, training: bool = True) -> None:
    """``model.attention``: a known backend, options that backend takes (typed), and a backend that runs
    (and trains) on the trainer's device; each failure names the option and what would work."""
    if attention is None:
        return
    from attn_ops import registry

    backend = attention.get("backend", "auto")
    if not isinstance(backend, str):
        raise ConfigError(f"model.attention.backend must be a backend name, got {backend!r}; "
                          f"valid names: {', '.join(registry.valid_names())}")
    try:
        registry.validate_backend_name(backend)
    except ValueError as e:
        raise ConfigError(f"model.attention.backend: {e}") from None
    takes = {"deterministic"} | (set() if backend == registry.AUTO else set(registry.get(backend).options))
    for key, value in attention.items():
        key = str(key)
        if key.startswith("_") or key == "backend" or value is None:
            continue  # a null option is unset
        if key not in takes:
            owners = [n for n, b in registry.BACKENDS.items() if key in b.options]
            hint = (f"it is an option of {', '.join(owners)}: set model.attention.backend={owners[0]}" if owners
                    else f"backend {backend!r} takes: {', '.join(sorted(takes))}")
            raise ConfigError(f"model.attention.{key}={value!r} does not apply to backend {backend!r}; {hint} "
                              f"(or model.attention.{key}=null)")
        ATTENTION_OPTIONS[key].validate(f"model.attention.{key}", value)
    if backend == registry.AUTO:
        return
    device = _devices(trainer)
    b = registry.get(backend)
    why = b.unavailable_reason()
    runs = {n for n, x in registry.BACKENDS.items() if device in x.devices and x.unavailable_reason() is None
            and (not training or device in (x.grad_devices or x.devices))}
    fix_other = ", ".join(f"model.attention.backend={n}" for n in ("chunked", "auto") if n == "auto" or n in runs)
    if why:
        raise ConfigError(f"model.attention.backend={backend}: {why}; use {fix_other}")
    if device not in b.devices:
        extra = ""
        if backend == "triton" and device == "cpu":
            extra = " (TRITON_INTERPRET=1 runs the kernels on the CPU in Triton's interpreter: for debugging, very slow)"
        raise ConfigError(
            f"model.attention.backend={backend} cannot run on the trainer's device ({device}; trainer.accelerator="
            f"{trainer.get('accelerator')}): it runs on {', '.join(sorted(b.devices))}. Use {fix_other}, or a GPU "
            f"(trainer=gpu){extra}"
        )
    grad = b.grad_devices or b.devices
    if training and device not in grad:
        raise ConfigError(
            f"model.attention.backend={backend} has no backward on {device} (training needs one; it trains on "
            f"{', '.join(sorted(grad))}). Use {fix_other}, or a GPU (trainer=gpu)"
        )
    deterministic = attention.get("deterministic", True)
    det = b.deterministic_devices or b.devices
    if training and deterministic is not False and device not in det:
        raise ConfigError(
            f"model.attention.backend={backend} has no deterministic backward on {device}: set "
            f"model.attention.deterministic=false to allow it, or use model.attention.backend=triton|chunked"
        )


# options that no longer exist, with why: an old config or override naming one fails, never silently ignored
REMOVED = {
    "trust_file": "was removed: checkpoints (resume, ckpt_path, model.pretrained) are always read as data "
                  "(torch.load(weights_only=True)) and nothing in a file chooses code to run. Re-save a checkpoint "
                  "that pickles other Python objects as plain tensors, or load it from your own code with "
                  "allow_globals=[YourClass] (zoo.load_checkpoint, zoo.load_pretrained, ...)",
}


def _removed(key: str) -> None:
    name = key.split(".")[-1]
    if name in REMOVED and key in (name, f"model.{name}"):
        raise ConfigError(f"{key} {REMOVED[name]}")


def check_overrides(args) -> None:
    """The command line's overrides (``trust_file=true``, ``+trust_file=true``) naming a removed option: a
    ConfigError saying so, before Hydra composes (it would only say the key is unknown)."""
    for arg in args:
        if "=" in arg and not arg.startswith("-"):
            _removed(arg.split("=", 1)[0].lstrip("+~"))


def check_config(cfg: DictConfig) -> None:
    """Every check above, on the composed config, before any work."""
    for key in REMOVED:  # an old config file (or a + override) still setting one
        if key in cfg:
            _removed(key)
        if isinstance(cfg.get("model"), DictConfig) and key in cfg.model:
            _removed(f"model.{key}")
    trainer = _plain(cfg.get("trainer")) or {}
    check_trainer(trainer)
    if cfg.get("data") is not None:
        check_data(_plain(cfg.data))
        strategy = trainer.get("strategy")
        strategy = strategy.get("_target_", "") if isinstance(strategy, Mapping) else str(strategy or "")
        if _plain(cfg.data).get("packing") and ("ddp" in strategy.lower() or "fsdp" in strategy.lower()):
            raise ConfigError(
                "data.packing=true runs in one process for now: its token-budget batch sampler is not sharded "
                f"over ranks (trainer.strategy={trainer.get('strategy')!r}); use one device or data.packing=false"
            )
    model = cfg.get("model")
    if model is not None and model.get("attention") is not None:
        check_attention(_plain(model.attention), trainer, training=bool(cfg.get("train", True)))
    for key, opt in (("seed", Int(0, nullable=True)), ("resume", Bool()), ("train", Bool()), ("test", Bool()),
                     ("ckpt_path", Str(nullable=True))):
        if key in cfg:
            opt.validate(key, cfg.get(key))

