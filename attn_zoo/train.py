"""Train any attn-zoo model from configs (``attn-zoo-train`` installed, ``python train.py`` in a checkout).

    python train.py                                    # default: tiny Evoformer on the bundled real MSAs (CPU)
    python train.py experiment=longctx_clm trainer=gpu model.attention.backend=triton
    python train.py attention=chunked                  # same as model.attention.backend=chunked (+ chunk_size)
    python train.py ckpt_path=logs/train/runs/X/checkpoints/last.ckpt    # resume
    python train.py run_name=myrun resume=true         # resume run "myrun" from its newest readable checkpoint
    python train.py debug=fdr                          # fast_dev_run: one batch of train/val/test

Everything is built by ``hydra.utils.instantiate`` (lightning-hydra-template conventions). Before any work
the run folder is locked (``RunLock``: one run per folder), the config is checked (``attn_zoo.checks``) and
the run folder too (a folder with checkpoints is resumed or refused; a finished run resumed with the same
limits does nothing). SIGTERM or Ctrl-C saves a checkpoint and exits with 128 + the signal number. The data are read and split before
the model is built; the run ends with a summary (folder, checkpoints, each split's metrics, loss curve).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf


class RunFolderInUse(ValueError):
    """The run folder is locked by another run, or holds checkpoints the config does not resume."""


class RunInterrupted(Exception):
    """SIGTERM or SIGINT stopped the run (after the on-exception checkpoint). ``exit_code``: 128 + the signal
    number (143 for SIGTERM, 130 for SIGINT), what a shell or scheduler sees for a run a signal ended."""

    def __init__(self, message: str, signame: str, step: int | None, checkpoint: str | None):
        super().__init__(message)
        self.signal, self.step, self.checkpoint = signame, step, checkpoint
        self.exit_code = 128 + int(getattr(signal, signame))


class CheckpointUnreadable(ValueError):
    """``ckpt_path`` cannot be read; the message names the other checkpoints of its folder."""


LOCK_NAME = "run.lock"


def is_rank_zero() -> bool:
    """Whether this process is a run's first (or only) process. The other ranks of a multi-process run
    (Lightning's DDP launcher, torchrun, SLURM set these variables) share the folder rank 0 has locked."""
    for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(var, "").strip()
        if value and value != "0":
            return False
    return True


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> int | None:
    """A process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None where unknown."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError, TypeError):
        return False
    return True


class RunLock:
    """``run.lock`` in a run folder, held for the run's life: one run per folder. Created atomically
    (``O_CREAT | O_EXCL``) with the holder's pid, host and start time; removed when the run ends, also on an
    exception. A lock of this host whose process is gone (dead pid, another boot, or the pid reused by a
    process that started later) is stale and taken over with a message; a live one, or any lock of another
    host (this machine cannot see its processes), refuses the run with ``RunFolderInUse`` naming the holder."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.record: dict | None = None

    def acquire(self) -> "RunLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        record = dict(pid=pid, host=socket.gethostname(), started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      boot_id=_boot_id(), proc_start=_proc_start(pid), token=os.urandom(8).hex())
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._refuse_or_clear()
                continue
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
            finally:
                os.close(fd)
            self.record = record
            return self
        raise RunFolderInUse(f"run folder {self.folder}: could not take {self.path} (other runs kept taking it)")

    def _refuse_or_clear(self) -> None:
        """The lock exists: raise RunFolderInUse naming its holder, or remove it if it is stale."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:  # released meanwhile: try again
            return
        try:
            held = json.loads(text)
            pid, host, started = held["pid"], held["host"], held.get("started", "?")
        except (ValueError, KeyError, TypeError):
            raise RunFolderInUse(
                f"run folder {self.folder} is locked by {self.path}, which cannot be read ({text[:80]!r}): another "
                f"run may be starting there. If no run uses this folder, delete {self.path}") from None
        holder = f"pid {pid} on host {host}, started {started} (lock file {self.path})"
        if host != socket.gethostname():
            raise RunFolderInUse(
                f"run folder {self.folder} is in use by another run: {holder}. This machine cannot tell whether that "
                f"run still goes on: choose another run_name, or, if it has ended, delete {self.path}")
        boot, start = _boot_id(), (_proc_start(pid) if _pid_alive(pid) else None)
        gone = (not _pid_alive(pid) or (boot and held.get("boot_id") and boot != held["boot_id"])
                or (start is not None and held.get("proc_start") is not None and start != held["proc_start"]))
        if not gone:
            raise RunFolderInUse(
                f"run folder {self.folder} is in use by another run: {holder}. Wait for it to end, or choose another "
                f"run_name")
        print(f"[train] run folder {self.folder}: taking over the stale lock of {holder}: that process no longer "
              f"runs", flush=True)
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
        try:
            os.rename(self.path, aside)  # atomic: of two runs taking over, one moves it
        except FileNotFoundError:
            return
        try:
            if aside.read_text() != text:  # a new run locked it between the read and the move: put it back
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
        finally:
            aside.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock if it is still this run's."""
        if self.record is None:
            return
        try:
            if json.loads(self.path.read_text()).get("token") == self.record["token"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass
        self.record = None


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


def checkpoint_dir(cfg: DictConfig) -> Path:
    return Path(cfg.paths.output_dir) / "checkpoints"


def check_run_folder(cfg: DictConfig) -> None:
    """Refuse a run folder that already holds checkpoints unless the run resumes them (``resume=true``
    or a ``ckpt_path`` inside it): a reused ``run_name`` never mixes two runs' checkpoints."""
    ckpts = sorted(p.name for p in checkpoint_dir(cfg).glob("*.ckpt")) if checkpoint_dir(cfg).is_dir() else []
    if not ckpts or cfg.get("resume") or not cfg.get("train", True):
        return
    if cfg.get("ckpt_path") and Path(cfg.ckpt_path).expanduser().resolve().parent == checkpoint_dir(cfg).resolve():
        return
    raise RunFolderInUse(
        f"run folder {cfg.paths.output_dir} already holds checkpoints ({', '.join(ckpts)}): pass resume=true to "
        f"continue that run (run_name={cfg.get('run_name')}), or choose another run_name"
    )


def _expected_max_epochs(trainer_cfg) -> int:
    """Lightning's resolution of ``max_epochs`` (None -> 1000 without max_steps, else -1)."""
    max_epochs, max_steps = trainer_cfg.get("max_epochs"), trainer_cfg.get("max_steps", -1)
    if max_epochs is None:
        return 1000 if max_steps == -1 and trainer_cfg.get("max_time") is None else -1
    return max_epochs


def run_state(path: str | Path) -> dict:
    """The run record ``LastCheckpoint`` stores in a checkpoint (``finished``, ``max_steps``,
    ``max_epochs``) plus its ``global_step``; {} for checkpoints without one. The file is read as data
    (``zoo.read_checkpoint``: a pickle that names code is refused before anything runs)."""
    from .models.tasks.callbacks import RUN_STATE_KEY
    from .models.zoo import read_checkpoint

    ckpt = read_checkpoint(path, map_location="cpu", mmap=True)
    if not isinstance(ckpt, dict):
        raise ValueError(f"checkpoint {str(path)!r} holds a {type(ckpt).__name__}, not a Lightning checkpoint dict")
    return {**ckpt.get(RUN_STATE_KEY, {}), "global_step": ckpt.get("global_step"), "epoch": ckpt.get("epoch")}


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """``ckpt_path`` if given (must exist); else with ``resume=true`` the run's newest readable checkpoint
    (``resume_checkpoint``)."""
    if cfg.get("ckpt_path"):
        path = Path(cfg.ckpt_path).expanduser()
        if not path.is_file():
            raise ValueError(f"ckpt_path {str(path)!r} does not exist")
        try:
            run_state(path)  # a file naming code is refused here, clearly
        except ValueError as err:
            others = [p.name for p in sorted(path.parent.glob("step*.ckpt"), key=_step_number, reverse=True)
                      if p != path]
            if not others or "refused to unpickle" in str(err):
                raise
            raise CheckpointUnreadable(f"{err}. Its folder also holds {', '.join(others)}: pass the newest readable "
                                       f"one as ckpt_path (resume=true picks it by itself)") from None
        return str(path)
    if cfg.get("resume"):
        return resume_checkpoint(cfg)
    return None


def _step_number(path: Path) -> int:
    found = re.search(r"step(\d+)", path.stem)
    return int(found.group(1)) if found else -1


def resume_checkpoint(cfg: DictConfig) -> str | None:
    """The checkpoint ``resume=true`` continues: ``last.ckpt`` if it can be read, else the newest readable
    ``step*.ckpt`` (each read with ``run_state``), printed with why the ones before it were passed over.
    None (a start from scratch) only where the run folder holds no checkpoint at all: a folder whose
    checkpoints cannot be resumed is refused (``RunFolderInUse``), never trained over."""
    from .models.zoo import UnsafeCheckpointError

    folder = checkpoint_dir(cfg)
    candidates = [folder / "last.ckpt"] + sorted(folder.glob("step*.ckpt"), key=_step_number, reverse=True)
    passed = []
    for path in candidates:
        if not path.is_file():
            passed.append(f"{path.name} does not exist")
            continue
        try:
            state = run_state(path)
        except UnsafeCheckpointError:  # code in a checkpoint is no damage to pass over: stop and say what it names
            raise
        except Exception as err:  # truncated or corrupt (zip reader, unpickler), unreadable
            why = (str(err).strip().splitlines() or [""])[0][:160]
            passed.append(f"{path.name} cannot be read ({type(err).__name__}: {why})")
            continue
        because = f": {'; '.join(passed)}" if passed else ""
        print(f"[train] resuming from {path} (step {state.get('global_step')}){because}", flush=True)
        return str(path)
    held = sorted(p.name for p in folder.glob("*.ckpt")) if folder.is_dir() else []
    if held:
        raise RunFolderInUse(
            f"resume=true but no checkpoint of run folder {cfg.paths.output_dir} can be resumed ({'; '.join(passed)}); "
            f"it holds {', '.join(held)}: not starting from scratch over them. Resume one with ckpt_path=PATH, "
            f"or choose another run_name")
    print(f"[train] resume=true but {folder} holds no checkpoint: starting from scratch", flush=True)
    return None


def finished_already(cfg: DictConfig, ckpt: str | None) -> dict | None:
    """The run state if ``ckpt`` is the end-of-training checkpoint of a run with the same step and epoch
    limits as this config (resuming it would do nothing), else None."""
    if not ckpt:
        return None
    state = run_state(ckpt)
    if not state.get("finished"):
        return None
    t = cfg.trainer
    if state.get("max_steps") == t.get("max_steps", -1) and state.get("max_epochs") == _expected_max_epochs(t):
        return state
    return None


def _resume_command(cfg: DictConfig, last: str) -> str:
    """The command that resumes this run: under Hydra, this run's overrides with ``run_name`` of its folder
    and ``resume=true`` (a sweep's job folder: ``ckpt_path``); else the config keys to set."""
    import shlex

    name = Path(cfg.paths.output_dir).name
    in_runs = Path(cfg.paths.output_dir).parent.name == "runs"  # logs/<task>/runs/<run_name>
    how = [f"run_name={name}", "resume=true"] if in_runs else [f"ckpt_path={last}"]
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    except Exception:
        overrides = None
    if overrides is None:
        return f"resume=true run_name={name} (run folder {cfg.paths.output_dir})"
    keep = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("run_name", "resume", "ckpt_path")]
    return " ".join(["python train.py", *map(shlex.quote, keep + how)])


def _interruptible(cfg: DictConfig, trainer, callbacks, stage: str, fn, **kwargs):
    """``fn(**kwargs)`` (the trainer's fit, validate or test); a run SIGTERM or SIGINT stopped (Lightning saved
    the on-exception checkpoint) -> ``RunInterrupted`` naming the step, the checkpoint and how to resume."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from .models.tasks.callbacks import GracefulInterrupt

    try:
        return fn(**kwargs)
    except SIGTERMException:
        graceful = _objects_by_type(callbacks, GracefulInterrupt)
        signame = (graceful[0].signal if graceful else None) or "SIGTERM"
    except SystemExit as err:  # Lightning's exit(1) after a KeyboardInterrupt (a second Ctrl-C)
        if not isinstance(err.__context__, KeyboardInterrupt):
            raise
        signame = "SIGINT"
    step = trainer.global_step
    last = checkpoint_paths(callbacks).get("last_checkpoint")
    if stage != "fit":
        msg = (f"interrupted at step {step} while running {stage} ({signame})"
               + (f"; training had finished: {last}" if last and cfg.get("train", True) else ""))
    elif last and Path(last).is_file():
        msg = f"interrupted at step {step}; resume with: {_resume_command(cfg, last)} ({signame}; checkpoint {last})"
    else:
        msg = (f"interrupted at step {step} ({signame}); no checkpoint was saved (no last_checkpoint callback, "
               f"or trainer.fast_dev_run)")
    raise RunInterrupted(msg, signame, step, last) from None


def _is_empty_run_folder(path: Path) -> bool:
    """Nothing but Hydra's record (.hydra/) and log files."""
    if not path.is_dir():
        return False
    for p in path.rglob("*"):
        rel = p.relative_to(path)
        if p.is_file() and rel.parts[0] != ".hydra" and p.suffix != ".log" and p.name != LOCK_NAME:
            return False
    return True


def _objects_by_type(callbacks, cls):
    return [c for c in callbacks if isinstance(c, cls)]


def _csv_file(loggers) -> Path | None:
    for lg in loggers:
        if isinstance(lg, L.pytorch.loggers.CSVLogger):
            f = Path(lg.log_dir) / "metrics.csv"
            if f.is_file():
                return f
    return None


def plot_losses(csv_file: Path) -> Path | None:
    """A loss-curve PNG beside ``metrics.csv`` (train loss per logged step and per epoch, validation loss per
    validation run); None without matplotlib. Called right after fit, before the final validate/test rows."""
    import csv

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series: dict[str, tuple[list, list]] = {}
    with open(csv_file) as fh:
        for row in csv.DictReader(fh):
            for key in ("train/loss_step", "train/loss_epoch", "val/loss"):
                if row.get(key) not in (None, "") and row.get("step") not in (None, ""):
                    xs, ys = series.setdefault(key, ([], []))
                    xs.append(int(float(row["step"])))
                    ys.append(float(row[key]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, (xs, ys) in series.items():
        step = key.endswith("_step")
        ax.plot(xs, ys, marker=None if step else "o", markersize=4, linewidth=0.8 if step else 1.5,
                alpha=0.6 if step else 1.0, label=key)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    out = csv_file.with_name("loss_curve.png")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _stage_metrics(metrics: dict, stage: str) -> dict:
    """``stage/name`` metrics as {name: value}: per-step values left out, ``loss_epoch`` as ``loss``."""
    out = {}
    for k, v in sorted(metrics.items()):
        if k.startswith(stage + "/") and not k.endswith("_step"):
            name = k.split("/", 1)[1]
            out[name[: -len("_epoch")] if name.endswith("_epoch") else name] = v
    return out


def _split_metrics(metrics: dict, stage: str) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in _stage_metrics(metrics, stage).items())


def checkpoint_paths(callbacks) -> dict:
    """{'best_checkpoint', 'best_score', 'last_checkpoint'} as the checkpoint callbacks hold them now
    (read right after fit: validate/test with a checkpoint restore older callback states)."""
    from .models.tasks.callbacks import LastCheckpoint

    out: dict[str, Any] = {}
    best_cb = [c for c in _objects_by_type(callbacks, L.pytorch.callbacks.ModelCheckpoint) if c.monitor]
    last_cb = _objects_by_type(callbacks, LastCheckpoint)
    if best_cb and best_cb[0].best_model_path:
        out["best_checkpoint"] = best_cb[0].best_model_path
        score = best_cb[0].best_model_score
        out["best_score"] = {best_cb[0].monitor: None if score is None else float(score)}
    if last_cb and last_cb[0].last_model_path:
        out["last_checkpoint"] = last_cb[0].last_model_path
    return out


def summarize(cfg: DictConfig, trainer, callbacks, loggers, metrics: dict, stages: dict, ckpts: dict) -> dict:
    """Print (and write ``summary.json``) the run folder, best and last checkpoints, each split's
    metrics, why training stopped early if it did, and the loss-curve PNG beside the CSV."""
    import json

    from .models.tasks.callbacks import ReportingEarlyStopping

    out_dir = Path(cfg.paths.output_dir)
    summary: dict[str, Any] = {"run_folder": str(out_dir), "global_step": trainer.global_step, **ckpts}
    stopped = [c.report for c in _objects_by_type(callbacks, ReportingEarlyStopping) if c.report]
    if stopped:
        summary["early_stopping"] = stopped[0]
    summary["splits"] = {}
    for stage, where in stages.items():
        vals = _stage_metrics(metrics, stage)
        if vals:
            summary["splits"][stage] = {"weights": where, **vals}
    csv_file = _csv_file(loggers)
    if csv_file is not None:
        summary["metrics_csv"] = str(csv_file)
        png = csv_file.with_name("loss_curve.png")
        if png.is_file():
            summary["loss_curve"] = str(png)
    if not trainer.is_global_zero:
        return summary
    lines = [f"run folder: {out_dir}"]
    if "best_checkpoint" in summary or "last_checkpoint" in summary:
        lines.append(f"best checkpoint: {summary.get('best_checkpoint', 'none')}"
                     + (f" ({', '.join(f'{k}={v:.4g}' for k, v in summary['best_score'].items() if v is not None)})"
                        if summary.get("best_score") else ""))
        lines.append(f"last checkpoint: {summary.get('last_checkpoint', 'none')} (step {trainer.global_step})")
    for stage, where in stages.items():
        text = _split_metrics(metrics, stage)
        if text:
            lines.append(f"{stage} ({where}): {text}")
    if stopped:
        lines.append(stopped[0])
    if csv_file is not None:
        lines.append(f"metrics: {csv_file}" + (f"; loss curve: {summary['loss_curve']}" if "loss_curve" in summary
                                              else " (pip install matplotlib for a loss-curve PNG)"))
    print("[train] " + "\n[train] ".join(lines), flush=True)
    if out_dir.is_dir():
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def train(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check the config, seed, instantiate data/model/callbacks/loggers/trainer, fit, test, summarize.

    Returns (metrics: the trainer's callback metrics as floats after fit and test, objects: cfg,
    datamodule, model, callbacks, loggers, trainer, summary). A run folder that this call found empty
    and leaves empty (a run that failed before writing anything) is removed.
    """
    import threading

    out_dir = Path(cfg.paths.output_dir)
    # one run per folder: a refused run stops here, before it reads or writes anything of the holder's
    lock = RunLock(out_dir).acquire() if is_rank_zero() else None
    was_empty = not out_dir.exists() or _is_empty_run_folder(out_dir)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm_outside_the_trainer(cfg)) if main_thread else None
    try:
        with _quiet_lightning():
            return _train(cfg)
    except BaseException:
        if was_empty and _is_empty_run_folder(out_dir):  # (still locked: no other run is starting there)
            import shutil

            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if lock is not None:
            lock.release()


def _sigterm_outside_the_trainer(cfg: DictConfig):
    """A SIGTERM handler for the run's life. Outside the trainer's loops (reading data, building the model,
    the summary) it raises ``RunInterrupted`` at once: the lock is released, the exit status is 143. Inside
    them Lightning's handler runs, and calls this one after its own: then it does nothing, and the trainer
    stops at the end of the step (``_interruptible``)."""

    def handler(signum, frame):
        if signal.getsignal(signal.SIGTERM) is not handler:
            return  # called by Lightning's handler
        last = checkpoint_dir(cfg) / "last.ckpt"
        raise RunInterrupted("interrupted outside the training loop (SIGTERM)"
                             + (f"; the run's last checkpoint: {last}" if last.is_file() else ""),
                             "SIGTERM", None, str(last) if last.is_file() else None)

    return handler


class _DropLightningTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip:")


@contextlib.contextmanager
def _quiet_lightning():
    """Keep out of the run's log what a user cannot act on: Lightning's advertising tip (shown when no
    LitLogger is used), the deprecation torch >= 2.10 raises inside Lightning 2.6's own code, and the
    warning that a resumed run's checkpoint folder is not empty (check_run_folder has already decided)."""
    tip = _DropLightningTip()
    names = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
    for name in names:
        logging.getLogger(name).addFilter(tip)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            yield
    finally:
        for name in names:
            logging.getLogger(name).removeFilter(tip)


def _continue_metrics(cfg: DictConfig, loggers, ckpt_path: str | None) -> None:
    """One metrics file per run: a resumed run continues its run's ``metrics.csv`` from the checkpoint's step
    (the rows the interrupted run logged after it are dropped), a test-only run adds to it."""
    training = cfg.get("train", True)
    if training and not ckpt_path:
        return
    step = run_state(ckpt_path)["global_step"] if training else None
    for logger in loggers:
        if hasattr(logger, "continue_from"):
            logger.continue_from(step)


def _progress_for_this_output(cfg: DictConfig, callbacks: list) -> tuple[list, dict]:
    """The progress bar where stdout is a terminal; elsewhere (a log file, a pipe, a scheduler's output) no
    bar, whose redraws would fill the file with carriage returns and escape codes, and one line per epoch
    instead (``EpochLines``). ``trainer.enable_progress_bar`` set in the config is followed as given."""
    if cfg.trainer.get("enable_progress_bar") is not None or sys.stdout.isatty():
        return callbacks, {}
    from .models.tasks.callbacks import EpochLines

    kept = [c for c in callbacks if not isinstance(c, L.pytorch.callbacks.ProgressBar)]
    return kept + [EpochLines()], {"enable_progress_bar": False}


def _train(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    from .checks import check_config

    check_config(cfg)  # types, ranges, the attention backend on this device: before any work
    validate_attention(cfg)
    check_run_folder(cfg)
    ckpt_path = resolve_ckpt_path(cfg) if cfg.get("train", True) else None
    done = finished_already(cfg, ckpt_path) if cfg.get("resume") and not cfg.get("ckpt_path") else None
    if done is not None:
        print(
            f"[train] run {cfg.paths.output_dir} already finished at step {done['global_step']} "
            f"(max_steps={done['max_steps']}, max_epochs={done['max_epochs']}): nothing to do. Raise "
            f"trainer.max_epochs or trainer.max_steps to train it further.", flush=True,
        )
        return {}, dict(cfg=cfg, finished=done)

    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    if cfg.get("matmul_precision"):  # "high" lets fp32 matmuls use TF32 tensor cores
        import torch

        torch.set_float32_matmul_precision(cfg.matmul_precision)

    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data)
    if hasattr(datamodule, "prepare_report"):  # read and split the data now: a data error stops the run here
        datamodule.prepare_report(Path(cfg.paths.output_dir))
    model: L.LightningModule = hydra.utils.instantiate(cfg.model)
    if cfg.model.get("net") is not None and hasattr(model, "record_net_config"):  # zoo.load_checkpoint rebuilds from it
        model.record_net_config(OmegaConf.to_container(cfg.model.net, resolve=True))
    from .models.tasks.callbacks import GracefulInterrupt

    callbacks = instantiate_group(cfg.get("callbacks")) + [GracefulInterrupt()]  # Ctrl-C: stop with a checkpoint
    loggers = instantiate_group(cfg.get("logger"))
    if not loggers:  # LearningRateMonitor refuses to run without a logger
        callbacks = [c for c in callbacks if not isinstance(c, L.pytorch.callbacks.LearningRateMonitor)]
    _continue_metrics(cfg, loggers, ckpt_path)
    callbacks, bar = _progress_for_this_output(cfg, callbacks)
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers, **bar)

    attention = cfg.model.get("attention")
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"[train] model {cfg.model._target_} ({n_params / 1e6:.2f}M parameters), attention "
        f"{ {k: v for k, v in OmegaConf.to_container(attention).items() if v is not None} if attention is not None else None}"
        f", data {cfg.data._target_}",
        flush=True,
    )
    hparams = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    for logger in loggers:
        logger.log_hyperparams(hparams)

    metrics: dict[str, Any] = {}
    stages: dict[str, str] = {}
    ckpts: dict[str, Any] = {}
    if cfg.get("train", True):
        _interruptible(cfg, trainer, callbacks, "fit", trainer.fit, model=model, datamodule=datamodule,
                       ckpt_path=ckpt_path, weights_only=True)
        ckpts = checkpoint_paths(callbacks)
        csv_file = _csv_file(loggers)
        if csv_file is not None and trainer.is_global_zero:
            plot_losses(csv_file)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
        stages["train"] = "last epoch"
        stages["val"] = "last validation"
    if cfg.get("test", False):
        ckpt = getattr(trainer.checkpoint_callback, "best_model_path", "") or None
        if ckpt is None and not cfg.get("train", True):  # test only: the checkpoint the user named
            ckpt = resolve_ckpt_path(cfg)
        if ckpt is None:
            print("[train] no best checkpoint: testing the current weights", flush=True)
        has_test = getattr(datamodule, "has_test_set", lambda: True)()
        if not has_test:
            print("[train] no test set (data.test_fraction=0 and no data.test_names): not testing", flush=True)
        else:
            where = f"checkpoint {Path(ckpt).name}" if ckpt else "final weights"
            if ckpt and cfg.get("train", True) and not trainer.fast_dev_run:
                # validation metrics of the same weights the test set sees, not the last epoch's
                val = _interruptible(cfg, trainer, callbacks, "validation", trainer.validate, model=model,
                                     datamodule=datamodule, ckpt_path=ckpt, verbose=False,
                                     weights_only=True)
                metrics.update({k: float(v) for k, v in (val[0] if val else {}).items()})
                stages["val"] = where
            _interruptible(cfg, trainer, callbacks, "test", trainer.test, model=model, datamodule=datamodule,
                           ckpt_path=ckpt, weights_only=True)
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")})
            stages["test"] = where

    summary = summarize(cfg, trainer, callbacks, loggers, metrics, stages, ckpts)
    objects = dict(cfg=cfg, datamodule=datamodule, model=model, callbacks=callbacks, loggers=loggers, trainer=trainer,
                   summary=summary)
    return metrics, objects


def main() -> float | None:
    """The ``attn-zoo-train`` entry point: Hydra composes the config from the command line (``sys.argv``)."""
    from .checks import ConfigError, check_overrides

    try:
        check_overrides(sys.argv[1:])  # a removed option: say so, not Hydra's "not in struct"
    except ConfigError as err:
        raise SystemExit(f"[train] error: {err}") from None
    return _main()


@hydra.main(version_base="1.3", config_path="pkg://attn_zoo.configs", config_name="train")
def _main(cfg: DictConfig) -> float | None:
    from .checks import ConfigError
    from .models.data.sample import DataError

    try:
        metrics, _ = train(cfg)
    except (ConfigError, RunFolderInUse, DataError, CheckpointUnreadable) as err:  # says what to change: no traceback
        raise SystemExit(f"[train] error: {err}") from None
    except RunInterrupted as err:
        if is_rank_zero():
            print(f"[train] {err}", file=sys.stderr, flush=True)
        raise SystemExit(err.exit_code) from None
    name = cfg.get("optimized_metric")  # for Hydra sweepers
    return metrics.get(name) if name else None


if __name__ == "__main__":
    main()
