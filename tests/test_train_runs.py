"""A run a user can trust: last.ckpt holds the final step, a finished run's resume does nothing, a resumed
run keeps its best checkpoint, a reused run name is refused, bad values fail before any work naming the
option, failed runs leave no empty folder, and the end-of-run summary (splits, checkpoints, early stop)."""
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import hydra
import lightning as L
import pytest
import torch

from attn_ops import registry
from attn_zoo import train
from attn_zoo.checks import ConfigError, check_config
from test_configs import make_cfg
from test_train import TINY_MSA

TINY = ["experiment=evoformer_msa", "attention=chunked", "model.net.trunk.num_blocks=1", "model.net.trunk.c_m=16",
        "model.net.trunk.c_z=8", "~callbacks.progress_bar", "logger=csv"] + TINY_MSA
# the sample gives 6 training proteins; 8 samples in batches of 2 = 4 steps per epoch


def _files(folder: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in (folder / "checkpoints").glob("*.ckpt")}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One tiny finished run: 2 epochs = 8 steps, last.ckpt's periodic saves at steps 3 and 6."""
    out = tmp_path_factory.mktemp("run")
    metrics, objs = train.train(make_cfg(TINY + ["trainer.max_epochs=2", "callbacks.last_checkpoint.every_n_train_steps=3"],
                                         out))
    return out, metrics, objs


def test_last_ckpt_holds_the_final_step(finished_run):
    out, _, objs = finished_run
    assert objs["trainer"].global_step == 8
    state = train.run_state(out / "checkpoints" / "last.ckpt")
    assert state["global_step"] == 8 and state["finished"] is True
    assert [p.name for p in (out / "checkpoints").glob("last*")] == ["last.ckpt"]


def test_summary_names_folder_checkpoints_and_each_split(finished_run):
    out, metrics, objs = finished_run
    s = json.loads((out / "summary.json").read_text())
    assert s["run_folder"] == str(out) and Path(s["best_checkpoint"]).is_file()
    assert s["last_checkpoint"] == str(out / "checkpoints" / "last.ckpt")
    assert set(s["splits"]) == {"train", "val", "test"}
    assert s["splits"]["val"]["weights"] == s["splits"]["test"]["weights"] == f"checkpoint {Path(s['best_checkpoint']).name}"
    assert s["splits"]["val"]["loss"] != s["splits"]["test"]["loss"]  # a held-out test set, not the val set again
    assert s["splits"]["val"]["loss"] == pytest.approx(s["best_score"]["val/loss"], rel=1e-6)
    data = json.loads((out / "data.json").read_text())
    assert not set(data["splits"]["test"]) & set(data["splits"]["train"])


def test_loss_curve_png_beside_the_csv(finished_run):
    pytest.importorskip("matplotlib")
    out, _, _ = finished_run
    s = json.loads((out / "summary.json").read_text())
    png = Path(s["loss_curve"])
    assert png.parent == Path(s["metrics_csv"]).parent and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_of_a_finished_run_does_nothing(finished_run, capsys):
    out, _, _ = finished_run
    before = _files(out)
    metrics, objs = train.train(make_cfg(TINY + ["trainer.max_epochs=2", "callbacks.last_checkpoint.every_n_train_steps=3",
                                                 "resume=true"], out))
    assert metrics == {} and "trainer" not in objs
    assert "already finished at step 8" in capsys.readouterr().out
    assert _files(out) == before


def test_reused_run_name_without_resume_is_refused(finished_run):
    out, _, _ = finished_run
    before = _files(out)
    with pytest.raises(train.RunFolderInUse, match="resume=true"):
        train.train(make_cfg(TINY + ["trainer.max_epochs=2"], out))
    assert _files(out) == before and out.is_dir()


def test_resume_continues_and_keeps_the_best_checkpoint(tmp_path):
    first_metrics, first = train.train(make_cfg(TINY + ["trainer.max_epochs=1"], tmp_path))
    best = first["summary"]["best_checkpoint"]
    # one more epoch without validation: the best checkpoint can only be the first run's
    _, objs = train.train(make_cfg(TINY + ["trainer.max_epochs=2", "resume=true", "trainer.limit_val_batches=0",
                                           "test=false"], tmp_path))
    assert objs["trainer"].global_step == 8
    assert objs["summary"]["best_checkpoint"] == best and Path(best).is_file()
    assert [p.name for p in (tmp_path / "checkpoints").glob("last*")] == ["last.ckpt"]
    assert train.run_state(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 8


def test_early_stopping_says_when_and_why(tmp_path):
    _, objs = train.train(make_cfg(TINY + ["trainer.max_epochs=5", "callbacks.early_stopping.patience=1",
                                           "callbacks.early_stopping.min_delta=100", "test=false"], tmp_path))
    assert objs["trainer"].current_epoch == 2  # epoch 0 sets the best, epoch 1 fails to improve by 100
    msg = objs["summary"]["early_stopping"]
    assert "early stopping after epoch 1 (step 8" in msg and "val/loss" in msg and "patience 1" in msg
    assert "min_delta 100)" in msg  # as configured (Lightning keeps it negated for mode=min)


# ---------------------------------------------------------------- config checks before any work
BAD = [
    ("trainer.max_epochs=abc", "trainer.max_epochs must be an int >= -1"),
    ("trainer.max_steps=1.5", "trainer.max_steps must be an int"),
    ("trainer.limit_val_batches=-1", "trainer.limit_val_batches"),
    ("trainer.precision=33", "trainer.precision must be one of"),
    ("trainer.accelerator=gpux", "trainer.accelerator"),
    ("+trainer.max_epoch=3", "trainer.max_epoch is not an option of lightning.pytorch.trainer.Trainer"),
    ("data.batch_size=four", "data.batch_size must be an int >= 1"),
    ("data.crop_size=-5", "data.crop_size must be an int >= 1"),
    ("data.mask_prob=1.0", "data.mask_prob must be a number in [0, 1)"),
    ("data.val_fraction=0.9", "data.val_fraction + data.test_fraction must be < 1"),
    ("+data.msa_folder=/x", "data.msa_folder is not an option of attn_zoo.models.data.MSADataModule"),
    ("model.attention.chunk_size=0", "model.attention.chunk_size must be an int >= 1"),
    ("model.attention.bwd=fused", "model.attention.bwd='fused' does not apply to backend 'chunked'; it is an option of triton"),
    ("model.attention.deterministic=maybe", "model.attention.deterministic must be true or false"),
    ("seed=x", "seed must be an int"),
    ("trainer.max_epochs=-1", "trainer.max_epochs=-1 with trainer.max_steps=-1 trains until killed"),
] + ([] if torch.cuda.is_available() else [("trainer=gpu", "trainer.accelerator=gpu but this machine has no CUDA device")])


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_bad_value_fails_before_any_work_naming_the_option(override, message, tmp_path, monkeypatch):
    def no_instantiate(*a, **k):
        raise AssertionError("instantiated something before the config was checked")

    monkeypatch.setattr(hydra.utils, "instantiate", no_instantiate)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("{}")
    with pytest.raises(ConfigError) as e:
        train.train(make_cfg(TINY + [override], run))
    assert message in str(e.value)
    assert not run.exists()  # the failed run's empty folder is not left behind


def test_chunk_size_with_backend_override_works(tmp_path):
    cfg = make_cfg(["model.attention.backend=chunked", "model.attention.chunk_size=32"], tmp_path)
    check_config(cfg)
    from attn_zoo.models.primitives import AttentionConfig

    assert AttentionConfig.coerce(cfg.model.net.trunk.attention) == AttentionConfig("chunked", {"chunk_size": 32})
    assert AttentionConfig.coerce(make_cfg([], tmp_path).model.attention) == AttentionConfig("auto")


def test_backend_that_cannot_run_on_the_device_fails_with_the_fix(tmp_path, monkeypatch):
    cuda_only = dataclasses.replace(registry.BACKENDS["triton"], devices=frozenset({"cuda"}))
    monkeypatch.setitem(registry.BACKENDS, "triton", cuda_only)  # as without TRITON_INTERPRET
    with pytest.raises(ConfigError) as e:
        check_config(make_cfg(["attention=triton", "trainer=cpu"], tmp_path))
    msg = str(e.value)
    assert "model.attention.backend=triton cannot run on the trainer's device (cpu" in msg
    assert "model.attention.backend=chunked" in msg and "trainer=gpu" in msg and "TRITON_INTERPRET" in msg
    with pytest.raises(ConfigError, match="flex has no backward on cpu.*model.attention.backend=chunked"):
        check_config(make_cfg(["attention=flex", "trainer=cpu"], tmp_path))
    check_config(make_cfg(["attention=flex", "trainer=cpu", "train=false"], tmp_path))  # inference only: fine


def test_only_the_users_data_through_the_config(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    for i, seq in enumerate(["MKVLAAGIVLQW", "PPGWSTQRREKL", "ACDEFGHIKLMN", "WYVTSRQPNMLK"]):
        (d / f"p{i}.a3m").write_text(f">q\n{seq}\n>h\n{seq[:-1]}-\n")
    cfg = make_cfg(TINY + [f"data.msa_dir={d}"], tmp_path / "run")
    assert cfg.data.mmcif_dir == str(d)  # follows msa_dir: the bundled structures are not mixed in
    dm = hydra.utils.instantiate(cfg.data)
    dm.setup("fit")
    assert sorted(dm.train_names + dm.val_names + dm.test_names) == ["p0", "p1", "p2", "p3"]
    with pytest.raises(ValueError, match="data.msa_dir=null"):
        train.train(make_cfg(TINY + [f"data.mmcif_dir={d}"], tmp_path / "run2"))
    assert not (tmp_path / "run2").exists()


def test_max_epochs_minus_one_with_a_step_or_time_limit_is_accepted(tmp_path):
    for limit in ("trainer.max_steps=5", "+trainer.max_time=00:01:00:00"):
        check_config(make_cfg(TINY + ["trainer.max_epochs=-1", limit], tmp_path))


# ---------------------------------------------------------------- one run per run folder
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": "2026-01-01T00:00:00Z", **fields}
    (folder / train.LOCK_NAME).write_text(json.dumps(record))
    return folder / train.LOCK_NAME


def test_lock_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path, capsys):
    first = train.RunLock(tmp_path).acquire()
    held = json.loads((tmp_path / "run.lock").read_text())
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname() and held["started"]
    with pytest.raises(train.RunFolderInUse, match=f"in use by another run: pid {os.getpid()} on host "
                                                   f"{socket.gethostname()}.*Wait for it to end"):
        train.RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / "run.lock").exists()
    train.RunLock(tmp_path).acquire().release()

    _write_lock(tmp_path, pid=_dead_pid())  # a run killed without cleaning up
    lock = train.RunLock(tmp_path).acquire()
    assert "taking over the stale lock" in capsys.readouterr().out
    assert json.loads((tmp_path / "run.lock").read_text())["token"] == lock.record["token"]
    lock.release()

    _write_lock(tmp_path, proc_start=-1)  # this pid, but a process that started at another time: pid reused
    train.RunLock(tmp_path).acquire().release()
    _write_lock(tmp_path, boot_id="another-boot")
    if train._boot_id():
        train.RunLock(tmp_path).acquire().release()

    lock = _write_lock(tmp_path, host="elsewhere.example")
    lock_data = lock.read_text()
    with pytest.raises(train.RunFolderInUse, match=f"pid {os.getpid()} on host elsewhere.example.*delete {lock}"):
        train.RunLock(tmp_path).acquire()
    assert lock.read_text() == lock_data  # another host's lock is never taken over
    lock.write_text("")
    with pytest.raises(train.RunFolderInUse, match="cannot be read"):
        train.RunLock(tmp_path).acquire()


def test_locked_folder_refuses_a_run_before_any_work(finished_run, monkeypatch):
    out, _, _ = finished_run
    before = _files(out)
    summary = (out / "summary.json").read_bytes()
    holder = train.RunLock(out).acquire()
    try:
        with pytest.raises(train.RunFolderInUse, match=f"pid {os.getpid()}"):
            train.train(make_cfg(TINY + ["trainer.max_epochs=2", "callbacks.last_checkpoint.every_n_train_steps=3",
                                         "resume=true"], out))
        # the other ranks of a multi-process run use the folder rank 0 locked: no refusal there
        monkeypatch.setenv("LOCAL_RANK", "1")
        assert not train.is_rank_zero()
        with pytest.raises(ConfigError):
            train.train(make_cfg(TINY + ["trainer.max_epochs=abc"], out))
    finally:
        holder.release()
    assert _files(out) == before and (out / "summary.json").read_bytes() == summary


def test_lock_is_held_for_the_run_and_released_when_it_fails(tmp_path, monkeypatch):
    seen = []

    def fails(cfg):
        seen.append(json.loads((tmp_path / "run.lock").read_text())["pid"])
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(train, "check_run_folder", fails)
    (tmp_path / "notes.txt").write_text("keeps the folder")
    with pytest.raises(RuntimeError, match="simulated failure"):
        train.train(make_cfg(TINY, tmp_path))
    assert seen == [os.getpid()] and not (tmp_path / "run.lock").exists()


ROOT = Path(__file__).resolve().parents[1]


def _cli(args, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT, **kw)


def _snapshot(folder: Path) -> dict:
    """Every file of a run folder but log files: {path: (size, mtime, bytes hash)}."""
    import hashlib

    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns,
                                          hashlib.sha1(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix != ".log"}


class SecondRunAt(L.Callback):
    """At optimizer step ``step``, starts ``python train.py *args`` (class attribute) in another process while
    this run trains, and records its exit code, stderr and this run's files before and after it."""

    args: list = []
    seen: dict = {}

    def __init__(self, step: int, folder: str):
        self.step, self.folder = step, Path(folder)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.seen:
            before = _snapshot(self.folder)
            proc = _cli(self.args)
            self.seen.update(rc=proc.returncode, err=proc.stderr, before=before, after=_snapshot(self.folder))


@pytest.mark.slow
def test_second_run_with_the_same_run_name_is_refused_and_the_first_runs_on(tmp_path):
    logs = tmp_path / "logs"
    out = logs / "train" / "runs" / "r1"
    SecondRunAt.args = [f"paths.log_dir={logs}", "run_name=r1"] + TINY + ["trainer.max_epochs=1"]
    SecondRunAt.seen = {}
    record = out / ".hydra" / "2026-01-01_00-00-00-000000"  # the first run's Hydra record, as the CLI writes it
    record.mkdir(parents=True)
    (record / "overrides.yaml").write_text("- run_name=r1\n")
    metrics, objs = train.train(make_cfg(
        TINY + ["trainer.max_epochs=2", "callbacks.last_checkpoint.every_n_train_steps=2",
                f"+callbacks.second._target_={__name__}.SecondRunAt", "+callbacks.second.step=3",
                f"+callbacks.second.folder={out}"], out))
    seen = SecondRunAt.seen
    assert seen["rc"] != 0, seen["err"]
    lines = [line for line in seen["err"].splitlines() if line.strip()]
    assert lines[-1].startswith("[train] error: run folder") and f"pid {os.getpid()} on host" in lines[-1]
    assert "Traceback" not in seen["err"]
    before, after = seen["before"], seen["after"]
    assert any(k.endswith(".ckpt") for k in before) and any(k.startswith(".hydra") for k in before)
    # the first run's files untouched (its Hydra record too); the refused run added only a record of its own
    assert {k: after.get(k) for k in before} == before
    added = [Path(k).parts for k in set(after) - set(before)]
    assert added and all(len(p) == 3 and p[0] == ".hydra" and p[1] != record.name for p in added), added
    assert objs["trainer"].global_step == 8 and not (out / "run.lock").exists()
    assert train.run_state(out / "checkpoints" / "last.ckpt")["global_step"] == 8


# ---------------------------------------------------------------- interrupted runs and resuming
class SignalAt(L.Callback):
    """Sends this process ``signum`` after optimizer step ``step`` (a scheduler's SIGTERM, a Ctrl-C)."""

    def __init__(self, step: int, signum: int = signal.SIGTERM):
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


RESUMABLE = TINY + ["trainer.max_epochs=2", "callbacks.last_checkpoint.every_n_train_steps=2", "test=false"]


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    """A run SIGTERM stops after step 3 (periodic saves every 2 steps): step2.ckpt, then step3.ckpt and
    last.ckpt saved on the signal."""
    out = tmp_path_factory.mktemp("interrupted")
    with pytest.raises(train.RunInterrupted) as e:
        train.train(make_cfg(RESUMABLE + [f"+callbacks.sig._target_={__name__}.SignalAt", "+callbacks.sig.step=3"],
                             out))
    return out, e.value


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _resume(out: Path, *extra):
    """Resume the run in ``out`` for one more step (to 4) without validation."""
    return train.train(make_cfg(RESUMABLE + ["resume=true", "trainer.max_steps=4", "trainer.limit_val_batches=0",
                                             *extra], out))


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_non_zero_and_resumes_from_that_step(interrupted_run, tmp_path, capsys):
    src, err = interrupted_run
    assert (err.signal, err.step, err.exit_code) == ("SIGTERM", 3, 143)
    assert str(err).startswith("interrupted at step 3; resume with: resume=true run_name=")
    assert err.checkpoint == str(src / "checkpoints" / "last.ckpt")
    state = train.run_state(src / "checkpoints" / "last.ckpt")
    assert state["global_step"] == 3 and state["finished"] is False
    assert (src / "checkpoints" / "step3.ckpt").is_file() and not (src / "run.lock").exists()
    out = _copy_run(src, tmp_path / "run")
    _, objs = _resume(out)
    assert "resuming from" in capsys.readouterr().out
    assert objs["trainer"].global_step == 4
    assert {int(s["step"]) for s in objs["trainer"].optimizers[0].state.values()} == {4}  # Adam went on from 3


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["corrupt", "deleted"])
def test_resume_without_a_readable_last_ckpt_continues_from_the_newest_step_ckpt(interrupted_run, tmp_path, capsys,
                                                                                damage):
    out = _copy_run(interrupted_run[0], tmp_path / "run")
    last = out / "checkpoints" / "last.ckpt"
    if damage == "corrupt":
        last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a save cut short
    else:
        last.unlink()
    _, objs = _resume(out)
    said = capsys.readouterr().out
    why = "last.ckpt cannot be read (" if damage == "corrupt" else "last.ckpt does not exist"
    assert f"resuming from {out / 'checkpoints' / 'step3.ckpt'} (step 3): {why}" in said
    assert objs["trainer"].global_step == 4
    assert {int(s["step"]) for s in objs["trainer"].optimizers[0].state.values()} == {4}


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_with_a_checkpoint(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(train.RunInterrupted) as e:
        train.train(make_cfg(RESUMABLE + ["trainer.max_steps=4", f"+callbacks.sig._target_={__name__}.SignalAt",
                                          "+callbacks.sig.step=1", f"+callbacks.sig.signum={int(signal.SIGINT)}"],
                             tmp_path))
    assert (e.value.signal, e.value.step, e.value.exit_code) == ("SIGINT", 1, 130)
    assert str(e.value).startswith("interrupted at step 1; resume with: ")
    assert train.run_state(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 1
    assert signal.getsignal(signal.SIGINT) == before and not (tmp_path / "run.lock").exists()


def test_sigterm_outside_the_training_loop_releases_the_lock(tmp_path, monkeypatch):
    """SIGTERM while the data are read (no trainer loop runs, so Lightning's handler is not there): the run stops
    at once with RunInterrupted (exit status 143), its lock removed and the SIGTERM handler restored."""
    from attn_zoo.models.data import MSADataModule

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(MSADataModule, "prepare_report", lambda self, folder=None: os.kill(os.getpid(), signal.SIGTERM))
    (tmp_path / "notes.txt").write_text("keeps the folder")
    with pytest.raises(train.RunInterrupted, match=r"interrupted outside the training loop \(SIGTERM\)") as e:
        train.train(make_cfg(TINY + ["debug=fdr"], tmp_path))
    assert e.value.exit_code == 143 and signal.getsignal(signal.SIGTERM) == before
    assert not (tmp_path / "run.lock").exists()


def test_resume_never_starts_from_scratch_over_checkpoints(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    for name in ("last.ckpt", "step4.ckpt", "best-epoch000-step4.ckpt"):
        (ckpts / name).write_bytes(b"PK\x03\x04 not a whole checkpoint")
    before = _files(tmp_path)
    with pytest.raises(train.RunFolderInUse, match=r"last.ckpt cannot be read .*step4.ckpt cannot be read .*"
                                                   r"not starting from scratch"):
        train.train(make_cfg(RESUMABLE + ["resume=true"], tmp_path))
    assert _files(tmp_path) == before


def test_unreadable_ckpt_path_names_the_step_checkpoints_beside_it(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "last.ckpt").write_bytes(b"PK\x03\x04 a save cut short")
    for n in (2, 10):
        (ckpts / f"step{n}.ckpt").write_bytes(b"")
    with pytest.raises(train.CheckpointUnreadable, match=r"last.ckpt.*also holds step10.ckpt, step2.ckpt: pass the "
                                                         r"newest readable one as ckpt_path"):
        train.resolve_ckpt_path(make_cfg(TINY + [f"ckpt_path={ckpts / 'last.ckpt'}"], tmp_path / "other"))


@pytest.mark.slow
def test_cli_sigterm_exits_143_with_the_resume_command(tmp_path):
    logs = tmp_path / "logs"
    proc = _cli([f"paths.log_dir={logs}", "run_name=cut"] + RESUMABLE
                + [f"+callbacks.sig._target_={__name__}.SignalAt", "+callbacks.sig.step=2"])
    assert proc.returncode == 143, proc.stderr[-3000:]
    line = next(l for l in proc.stderr.splitlines() if l.startswith("[train] interrupted"))
    assert line.startswith("[train] interrupted at step 2; resume with: python train.py ")
    assert "run_name=cut resume=true" in line and "+callbacks.sig.step=2" in line
    assert train.run_state(logs / "train" / "runs" / "cut" / "checkpoints" / "last.ckpt")["global_step"] == 2


# ---------------------------------------------------------------- data errors
def _bad_data(folder: Path) -> list[Path]:
    folder.mkdir()
    (folder / "good.a3m").write_text(">q\nMKVLAAGIVL\n>h\nMKV-AAGIVL\n")
    bad = [folder / "a.a3m", folder / "b.a3m", folder / "c.cif"]
    bad[0].write_text("MKVL\n")  # no header
    bad[1].write_text(">q\nMKVL\n>h\nMK\n")  # rows of different lengths
    bad[2].write_text("data_x\n#\nloop_\n_atom_site.id\n")
    return bad


def test_every_bad_data_file_is_named_at_once(tmp_path):
    from attn_zoo.models.data import DataError, MSADataModule

    bad = _bad_data(tmp_path / "d")
    with pytest.raises(DataError) as e:
        MSADataModule(msa_dir=str(tmp_path / "d"), mmcif_dir=str(tmp_path / "d")).setup("fit")
    assert str(e.value).startswith("3 data file(s) cannot be read: ")
    assert all(str(p) in str(e.value) for p in bad) and "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"data.msa_dir: msa path '.*nope1' does not exist.*; "
                                        r"data.mmcif_dir: mmcif path '.*nope2' does not exist"):
        MSADataModule(msa_dir=str(tmp_path / "nope1"), mmcif_dir=str(tmp_path / "nope2")).setup("fit")


@pytest.mark.slow
def test_cli_data_error_is_one_line(tmp_path):
    bad = _bad_data(tmp_path / "d")
    proc = _cli([f"paths.log_dir={tmp_path / 'logs'}", f"data.msa_dir={tmp_path / 'd'}"] + TINY)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("[train] error: 3 data file(s) cannot be read: ")
    assert all(str(p) in lines[-1] for p in bad)
