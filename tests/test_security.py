"""Files are data: no file a user opens runs code. A pickle whose ``__reduce__`` writes a marker file is planted
where each loader, train.py (resume=true, model.pretrained) and the embed tool read it; a weights-only checkpoint
whose config names a callable that is not a network class is refused; ``trust_file=True`` is the one way through."""
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
import torch
from torch import nn

from attn_zoo import train
from attn_zoo.models import zoo
from attn_zoo.models.tasks import LanguageModelTask, Task
from attn_zoo.models.zoo import ZooCheckpointError
from test_configs import make_cfg

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs" / "model").glob("*.yaml"))


class WritesMarker:
    """Unpickling it creates ``path`` (what a planted checkpoint could do with any code)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "code-ran"


def evil_checkpoint(path, marker):
    """A file shaped like a Lightning checkpoint trained here, with a pickled object that runs code."""
    net = nn.Linear(2, 2)
    torch.save({"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()},
                "hyper_parameters": {"net_config": {"_target_": "torch.nn.Linear", "in_features": 2,
                                                    "out_features": 2}},
                "attn_zoo_task": "attn_zoo.models.tasks.language_model.LanguageModelTask",
                "model": {"embed_tokens.weight": torch.zeros(33, 4)},
                "callbacks": {"x": WritesMarker(marker)}}, path)
    return path


def refused(err) -> bool:
    text = str(err.value)
    return "refused to unpickle Python objects" in text and "trust_file=True" in text


LOADERS = {
    "read_checkpoint": lambda p: zoo.read_checkpoint(p),
    "load_checkpoint": lambda p: zoo.load_checkpoint(p),
    "load_checkpoint(task=True)": lambda p: zoo.load_checkpoint(p, task=True),
    "load_pretrained": lambda p: zoo.load_pretrained(p, into=nn.Linear(2, 2)),
    "load_esm2": lambda p: zoo.load_esm2(p),
    "from_fair_esm": lambda p: zoo.from_fair_esm(p),
    "from_hf_esm": lambda p: zoo.from_hf_esm(p),
    "from_boltz": lambda p: zoo.from_boltz(p),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_every_loader_refuses_a_pickle_that_runs_code(loader, tmp_path, marker):
    path = evil_checkpoint(tmp_path / "model.ckpt", marker)
    with pytest.raises(ZooCheckpointError) as err:
        LOADERS[loader](path)
    assert refused(err) and str(path) in str(err.value), str(err.value)
    assert "(io.open)" in str(err.value)  # names what it would have run
    assert not marker.exists()


def test_hugging_face_folder_with_a_pickled_bin_is_refused(tmp_path, marker):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 4}))
    evil_checkpoint(folder / "pytorch_model.bin", marker)
    for load in (zoo.from_hf_esm, zoo.load_esm2, lambda p: zoo.load_pretrained(p, into=nn.Linear(2, 2))):
        with pytest.raises(ZooCheckpointError) as err:
            load(folder)
        assert refused(err), str(err.value)
    assert not marker.exists()


def test_trust_file_is_the_one_way_through(tmp_path):
    """The keyword exists on every loader and really unpickles (the marker appears): the refusals above are the
    safe default, not a file the test failed to make."""
    path = evil_checkpoint(tmp_path / "model.ckpt", tmp_path / "ran")
    obj = zoo.read_checkpoint(path, trust_file=True)
    assert (tmp_path / "ran").exists() and "callbacks" in obj
    for name, load in [("load_checkpoint", lambda p: zoo.load_checkpoint(p, trust_file=True)),
                       ("load_pretrained", lambda p: zoo.load_pretrained(p, into=nn.Linear(2, 2), trust_file=True)),
                       ("from_fair_esm", lambda p: zoo.from_fair_esm(p, trust_file=True)),
                       ("from_hf_esm", lambda p: zoo.from_hf_esm(p, trust_file=True)),
                       ("from_boltz", lambda p: zoo.from_boltz(p, trust_file=True)),
                       ("load_esm2", lambda p: zoo.load_esm2(p, trust_file=True))]:
        (tmp_path / "ran").unlink()
        try:
            load(path)
        except ZooCheckpointError as e:  # the file is no model of that kind: it was read all the same
            assert "unpickle" not in str(e), name
        assert (tmp_path / "ran").exists(), name


def test_resume_does_not_unpickle_a_planted_last_ckpt(tmp_path, marker):
    out = tmp_path / "run"
    evil_checkpoint((out / "checkpoints").mkdir(parents=True) or out / "checkpoints" / "last.ckpt", marker)
    with pytest.raises(ZooCheckpointError) as err:
        train.run_state(out / "checkpoints" / "last.ckpt")
    assert refused(err)
    cfg = make_cfg(["resume=true", "run_name=planted", "attention=chunked", "~logger", "callbacks=none",
                    "trainer.max_steps=1", "test=false"], out)
    good = out / "checkpoints" / "step1.ckpt"  # an older, safe checkpoint beside it is not resumed silently
    torch.save({"global_step": 1, "epoch": 0}, good)
    with pytest.raises(ZooCheckpointError) as err:
        train.train(cfg)
    assert "last.ckpt" in str(err.value) and refused(err) and "trust_file=true for train.py" in str(err.value)
    assert not marker.exists()


def test_ckpt_path_is_refused_with_the_option_to_pass(tmp_path, marker):
    path = evil_checkpoint(tmp_path / "other.ckpt", marker)
    cfg = make_cfg(["attention=chunked", "~logger", "callbacks=none", f"ckpt_path={path}", "test=false"],
                   tmp_path / "run")
    with pytest.raises(ZooCheckpointError) as err:
        train.train(cfg)
    assert refused(err) and "trust_file=true for train.py" in str(err.value)
    assert not marker.exists()


def test_model_pretrained_does_not_unpickle_code(tmp_path, marker):
    path = evil_checkpoint(tmp_path / "pretrained.ckpt", marker)
    cfg = make_cfg(["attention=chunked", "~logger", "callbacks=none", "train=false", "test=false",
                    f"model.pretrained={path}"], tmp_path / "run")
    with pytest.raises(Exception) as err:
        train.train(cfg)
    assert "refused to unpickle" in str(err.value) and "trust_file" in str(err.value), str(err.value)
    assert not marker.exists()


def weights_only_checkpoint(file, net_config, task="attn_zoo.models.tasks.language_model.LanguageModelTask",
                            **hparams):
    """A file that passes torch.load(weights_only=True): plain values only, which the loader then acts on."""
    net = nn.Linear(2, 2)
    torch.save({"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()},
                "hyper_parameters": {"net_config": net_config, **hparams}, "attn_zoo_task": task,
                "pytorch-lightning_version": lightning.__version__}, file)
    torch.load(file, weights_only=True)
    return file


CALLS = {  # functions a config could name to run a second file's code, with the arguments that would do it
    "attn_zoo.train.run_state": {"path": "EVIL"},
    "attn_zoo.models.zoo._torch_load": {"path": "EVIL", "weights_only": False},
    "attn_zoo.models.zoo.read_checkpoint": {"path": "EVIL", "trust_file": True},
    "os.system": {"command": "touch MARKER"},
}


@pytest.mark.parametrize("target", sorted(CALLS))
def test_a_config_naming_a_function_is_refused(target, tmp_path, marker):
    evil = evil_checkpoint(tmp_path / "second.pt", marker)
    kwargs = {k: v.replace("EVIL", str(evil)).replace("MARKER", str(marker)) if isinstance(v, str) else v
              for k, v in CALLS[target].items()}
    path = weights_only_checkpoint(tmp_path / "model.ckpt", {"_target_": target, **kwargs})
    for load in (zoo.load_checkpoint, zoo.load_esm2):
        with pytest.raises(ZooCheckpointError, match=f"{target}' is not a registered class") as err:
            load(path)
        assert "trust_file=True" in str(err.value)
    nested = weights_only_checkpoint(tmp_path / "nested.ckpt", {
        "_target_": "torch.nn.ModuleList", "modules": [{"_target_": target, "path": str(evil)}]})
    with pytest.raises(ZooCheckpointError, match=r"net config net\.modules\[0\].*not a registered class"):
        zoo.load_checkpoint(nested)
    assert not marker.exists()


def test_a_checkpoint_naming_a_function_as_its_task_is_refused(tmp_path, marker):
    evil = evil_checkpoint(tmp_path / "second.pt", marker)
    linear = {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2}
    path = weights_only_checkpoint(tmp_path / "model.ckpt", linear, task="attn_zoo.train.run_state", path=str(evil))
    assert isinstance(zoo.load_checkpoint(path), nn.Linear)  # the net alone never looks at the task
    with pytest.raises(ZooCheckpointError, match="task 'attn_zoo.train.run_state' is not a registered class"):
        zoo.load_checkpoint(path, task=True)
    assert not marker.exists()


def test_hyperparameters_never_choose_a_file_to_trust(tmp_path, marker):
    """A file's hparams naming ``pretrained`` plus ``trust_file`` (or the old ``pretrained_weights_only``) are
    dropped by both reloads: the task comes back without reading the second file."""
    evil = evil_checkpoint(tmp_path / "second.pt", marker)
    linear = {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2}
    for i, trusting in enumerate([{"pretrained_weights_only": False}, {"trust_file": True}]):
        path = weights_only_checkpoint(tmp_path / f"model{i}.ckpt", linear, pretrained=str(evil), **trusting)
        assert isinstance(zoo.load_checkpoint(path, task=True), LanguageModelTask)
        assert isinstance(LanguageModelTask.load_from_checkpoint(path, map_location="cpu").net, nn.Linear)
        assert not marker.exists()


def test_embed_refuses_a_pickle_and_a_function_config(tmp_path, marker):
    from attn_zoo import embed as E

    fasta = tmp_path / "in.fasta"
    fasta.write_text(">p1\nMKTAYIAK\n")
    evil = evil_checkpoint(tmp_path / "esm.pt", marker)
    with pytest.raises(ZooCheckpointError) as err:
        E.run(["--model", str(evil), "--fasta", str(fasta), "--out", str(tmp_path / "o"), "--no-progress"])
    assert refused(err) and "--trust-file" in str(err.value)
    config = weights_only_checkpoint(tmp_path / "cfg.ckpt", {"_target_": "attn_zoo.train.run_state",
                                                               "path": str(evil)})
    with pytest.raises(ZooCheckpointError, match="not a registered class"):
        E.run(["--model", str(config), "--fasta", str(fasta), "--out", str(tmp_path / "o"), "--no-progress"])
    assert not marker.exists()


@pytest.mark.slow
def test_embed_command_line_refuses_a_pickle(tmp_path, marker):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">p1\nMKTAYIAK\n")
    evil = evil_checkpoint(tmp_path / "esm.pt", marker)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "embed.py"), "--model", str(evil), "--fasta",
                        str(fasta), "--out", str(tmp_path / "cli"), "--device", "cpu", "--no-progress"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode != 0 and "refused to unpickle" in r.stderr and "--trust-file" in r.stderr, r.stderr
    assert not marker.exists()


def net_targets(node):
    if isinstance(node, dict):
        if "_target_" in node:
            yield node["_target_"]
        for v in node.values():
            yield from net_targets(v)
    elif isinstance(node, list):
        for v in node:
            yield from net_targets(v)


@pytest.mark.parametrize("config", [p.stem for p in CONFIGS])
def test_every_shipped_model_config_reloads_through_the_registries(config, tmp_path):
    from omegaconf import OmegaConf

    cfg = make_cfg([f"model={config}"], tmp_path)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    targets = list(net_targets(model["net"]))
    assert targets and all(t in zoo.NETWORKS for t in targets), [t for t in targets if t not in zoo.NETWORKS]
    assert model["_target_"] in zoo.TASKS
    for t in targets:
        assert issubclass(zoo.NETWORKS.resolve(t), nn.Module), t
    assert issubclass(zoo.TASKS.resolve(model["_target_"]), Task)


def test_register_network_lets_your_own_class_reload(tmp_path):
    class MyNet(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.proj = nn.Linear(width, width)

    name = f"{__name__}.MyNet"
    path = tmp_path / "mine.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in MyNet(3).state_dict().items()},
                "hyper_parameters": {"net_config": {"_target_": name, "width": 3}}}, path)
    with pytest.raises(ZooCheckpointError, match="register_network"):
        zoo.load_checkpoint(path)
    zoo.register_network(MyNet, name)
    try:
        assert isinstance(zoo.load_checkpoint(path), MyNet)
    finally:
        zoo.NETWORKS.unregister(name)
    with pytest.raises(ZooCheckpointError, match="not a registered class"):
        zoo.load_checkpoint(path)
    with pytest.raises(TypeError, match="nn.Module|Module subclasses"):
        zoo.register_network(len)
