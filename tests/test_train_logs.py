"""What a run leaves to read: one metrics file per run across resumes (no rows twice), a log without progress-bar
redraws or Lightning's tip where stdout is not a terminal, and only the newest ``keep_last`` step checkpoints."""
import csv
import io
from collections import Counter
from pathlib import Path

import lightning as L
import pytest

from attn_zoo import train
from test_configs import make_cfg
from test_train_runs import RESUMABLE, TINY, SignalAt, _cli


def _rows(csv_file: Path) -> list[dict]:
    with open(csv_file, newline="") as fh:
        return list(csv.DictReader(fh))


def _steps_of(rows: list[dict], key: str) -> list[int]:
    return [int(float(r["step"])) for r in rows if r.get(key)]


# ---------------------------------------------------------------- one metrics file per run
def test_csv_logger_continues_the_file_and_drops_rows_after_the_checkpoint(tmp_path):
    from attn_zoo.models.tasks.loggers import RunCSVLogger

    first = RunCSVLogger(tmp_path, name="csv")
    for step in range(6):  # an interrupted run logged steps 0..5; its checkpoint was taken after 3 steps
        first.log_metrics({"train/loss_step": 10.0 + step}, step=step)
    first.save()
    resumed = RunCSVLogger(tmp_path, name="csv")
    resumed.continue_from(3)
    resumed.log_metrics({"train/loss_step": 1.0, "val/loss": 2.0}, step=3)  # a new key: the header grows
    resumed.save()
    files = list(tmp_path.glob("csv/*/metrics.csv"))
    assert files == [tmp_path / "csv" / "version_0" / "metrics.csv"]
    rows = _rows(files[0])
    assert [(int(r["step"]), float(r["train/loss_step"])) for r in rows] == [(0, 10.0), (1, 11.0), (2, 12.0), (3, 1.0)]
    assert [r["val/loss"] for r in rows] == ["", "", "", "2.0"]
    with pytest.raises(ValueError, match="step must be an int >= 0 or None, got -1"):
        RunCSVLogger(tmp_path).continue_from(-1)


class CrashBeforeStep(L.Callback):
    """Raises before optimizer step ``step`` + 1 starts: the rows of the steps up to ``step`` are logged,
    the last checkpoint may be older (a crash that is no signal and saves nothing)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated crash before step {self.step + 1}")


def test_resumed_run_continues_one_metrics_file_without_repeated_steps(tmp_path):
    common = TINY + ["trainer.max_steps=6", "trainer.max_epochs=-1", "trainer.limit_val_batches=0", "test=false",
                     "trainer.log_every_n_steps=1", "callbacks.last_checkpoint.every_n_train_steps=2",
                     "callbacks.last_checkpoint.save_on_exception=false"]
    with pytest.raises(RuntimeError, match="simulated crash"):
        train.train(make_cfg(common + [f"+callbacks.crash._target_={__name__}.CrashBeforeStep",
                                       "+callbacks.crash.step=3"], tmp_path))
    assert train.run_state(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 2
    crashed = _rows(next(tmp_path.glob("csv/*/metrics.csv")))
    assert _steps_of(crashed, "train/loss_step") == [0, 1, 2]  # step 2 was logged after the checkpoint
    _, objs = train.train(make_cfg(common + ["resume=true"], tmp_path))
    files = list(tmp_path.glob("csv/*/metrics.csv"))
    assert len(files) == 1 and objs["summary"]["metrics_csv"] == str(files[0])
    rows = _rows(files[0])
    assert _steps_of(rows, "train/loss_step") == list(range(6))
    assert _steps_of(rows, "lr-AdamW") == list(range(6))
    losses = {int(r["step"]): r["train/loss_step"] for r in rows if r["train/loss_step"]}
    assert [losses[s] for s in (0, 1)] == [r["train/loss_step"] for r in crashed if r["train/loss_step"]][:2]
    assert Path(objs["summary"]["loss_curve"]).parent == files[0].parent


# ---------------------------------------------------------------- the log of a run whose output is no terminal
class _Out(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_only_on_a_terminal(tty, monkeypatch):
    from attn_zoo.models.tasks.callbacks import EpochLines

    monkeypatch.setattr("sys.stdout", _Out(tty))
    bar = L.pytorch.callbacks.TQDMProgressBar()
    cfg = make_cfg(["logger=csv"])
    callbacks, extra = train._progress_for_this_output(cfg, [bar])
    if tty:
        assert callbacks == [bar] and extra == {}
    else:
        assert not any(isinstance(c, L.pytorch.callbacks.ProgressBar) for c in callbacks)
        assert any(isinstance(c, EpochLines) for c in callbacks) and extra == {"enable_progress_bar": False}
    # a bar asked for in the config is kept, also in a log file
    cfg = make_cfg(["logger=csv", "+trainer.enable_progress_bar=true"])
    assert train._progress_for_this_output(cfg, [bar]) == ([bar], {})


@pytest.mark.slow
def test_cli_log_has_no_bar_redraws_tip_or_deprecations_and_resume_keeps_both_records(tmp_path):
    logs = tmp_path / "logs"
    common = [f"paths.log_dir={logs}", "run_name=r1", "test=false"] + [o for o in TINY if o != "~callbacks.progress_bar"]
    first = _cli(common + ["trainer.max_epochs=1"])
    assert first.returncode == 0, first.stderr[-3000:]
    out = logs / "train" / "runs" / "r1"
    records = sorted((out / ".hydra").glob("*/overrides.yaml"))
    first_record = records[0].read_text()
    resumed = _cli(common + ["resume=true", "trainer.max_epochs=2"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for proc in (first, resumed):
        log = proc.stdout + proc.stderr
        assert "\r" not in log and "\x1b[" not in log, log[-2000:]
        assert "Tip:" not in log and "litlogger" not in log and "LeafSpec" not in log and "is deprecated" not in log
        assert "exists and is not empty" not in log
    assert "[train] epoch 0 (1/1), step 4/4: train/loss=" in first.stdout
    assert "[train] epoch 1 (2/2), step 8/8: train/loss=" in resumed.stdout
    records = sorted((out / ".hydra").glob("*/overrides.yaml"))
    assert len(records) == 2 and records[0].read_text() == first_record and "resume=true" in records[1].read_text()
    assert [p.relative_to(out).as_posix() for p in out.glob("csv/*/metrics.csv")] == ["csv/version_0/metrics.csv"]
    assert _steps_of(_rows(out / "csv" / "version_0" / "metrics.csv"), "val/loss") == [3, 7]


# ---------------------------------------------------------------- step checkpoints
def _step_files(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoints").glob("step*.ckpt"))


def test_keep_last_deletes_older_step_checkpoints_after_the_new_one_is_written(tmp_path, monkeypatch):
    from lightning.pytorch.strategies import SingleDeviceStrategy

    seen = []  # at each deletion: the step files on disk

    def remove(self, filepath):
        seen.append((Path(filepath).name, _step_files(tmp_path)))
        Path(filepath).unlink()

    monkeypatch.setattr(SingleDeviceStrategy, "remove_checkpoint", remove)
    # SIGTERM after step 3: step2.ckpt (periodic), step3.ckpt (on the signal); keep_last=2 keeps both
    with pytest.raises(train.RunInterrupted):
        train.train(make_cfg(RESUMABLE + ["trainer.limit_val_batches=0", f"+callbacks.sig._target_={SignalAt.__module__}"
                                          f".SignalAt", "+callbacks.sig.step=3"], tmp_path))
    assert _step_files(tmp_path) == ["step2.ckpt", "step3.ckpt"]
    _, objs = train.train(make_cfg(RESUMABLE + ["trainer.limit_val_batches=0", "resume=true", "trainer.max_steps=6"],
                                   tmp_path))
    assert objs["trainer"].global_step == 6
    assert _step_files(tmp_path) == ["step4.ckpt", "step6.ckpt"]  # the signal's step3.ckpt is pruned too
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step4.ckpt",
                                                                                "step6.ckpt"]
    # every deletion came after a newer file was on disk: keep_last + 1 step files were there at the time
    assert [name for name, _ in seen] == ["step2.ckpt", "step3.ckpt"]
    assert seen[0][1] == ["step2.ckpt", "step3.ckpt", "step4.ckpt"]
    assert seen[1][1] == ["step3.ckpt", "step4.ckpt", "step6.ckpt"]
    # last.ckpt and the newest step file cut short: resume=true falls back on the one kept before it
    for name in ("last.ckpt", "step6.ckpt"):
        path = tmp_path / "checkpoints" / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    cfg = make_cfg(RESUMABLE + ["resume=true"], tmp_path)
    assert train.resume_checkpoint(cfg) == str(tmp_path / "checkpoints" / "step4.ckpt")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_keep_last_is_checked(bad, tmp_path):
    from attn_zoo.models.tasks.callbacks import LastCheckpoint

    with pytest.raises(ValueError, match=f"keep_last must be an int >= 1 or null .*got {bad!r}"):
        LastCheckpoint(dirpath=str(tmp_path), keep_last=bad)


def test_keep_last_touches_only_files_of_its_own_pattern(tmp_path):
    from attn_zoo.models.tasks.callbacks import LastCheckpoint

    for name in ("step1.ckpt", "step12.ckpt", "step3.ckpt", "last.ckpt", "best-epoch000-step12.ckpt", "mystep9.ckpt",
                 "step5.ckpt.tmp"):
        (tmp_path / name).write_bytes(b"x")
    cb = LastCheckpoint(dirpath=str(tmp_path), filename="step{step}", keep_last=1)
    assert [Path(p).name for _, p in cb._step_files()] == ["step12.ckpt", "step3.ckpt", "step1.ckpt"]
    named = LastCheckpoint(dirpath=str(tmp_path), filename="{epoch}-{step}", auto_insert_metric_name=True)
    (tmp_path / "epoch=0-step=7.ckpt").write_bytes(b"x")
    assert [Path(p).name for _, p in named._step_files()] == ["epoch=0-step=7.ckpt"]
