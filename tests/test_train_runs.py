"""A run a user can trust: last.ckpt holds the final step, a finished run's resume does nothing, a resumed
run keeps its best checkpoint, a reused run name is refused, bad values fail before any work naming the
option, failed runs leave no empty folder, and the end-of-run summary (splits, checkpoints, early stop)."""
import dataclasses
import json
from pathlib import Path

import hydra
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
