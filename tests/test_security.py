"""Files are data: no file a user opens runs code. A pickle whose ``__reduce__`` writes a marker file is planted
where each loader, train.py (resume=true, model.pretrained) and the embed tool read it; a weights-only checkpoint
whose config names a callable that is not a network class is refused. The one way through is the caller's code:
``allow_globals=[TheClass]`` (objects, never names) lets that class in and nothing else. A static check holds every
``torch.load`` of the project to ``weights_only=True``."""
import ast
import json
import os
import pickle
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
from attn_zoo.checks import ConfigError
from attn_zoo.models.zoo import UnsafeCheckpointError, ZooCheckpointError
from test_configs import make_cfg

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs" / "model").glob("*.yaml"))


class Settings:
    """A class of the caller's own code that a checkpoint pickles beside its weights (module level: pickled by
    name, ``test_security.Settings``)."""

    def __init__(self, width=2, name="tiny"):
        self.width, self.name = width, name


def write_marker(path):
    """Harmless code a file could make run: it writes ``path``."""
    Path(path).write_text("ran")


class RunsCode:
    """Unpickling it calls :func:`write_marker` (a function of this module, so allowing a class of the same
    module must still not let it run)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return write_marker, (self.path,)


SETTINGS = f"{__name__}.Settings"
OPEN = f"{open.__module__}.open"  # how a pickle names open: io.open up to Python 3.11, _io.open from 3.12


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
    return ("refused to unpickle Python objects" in text and "re-save the checkpoint as plain tensors" in text
            and "trust" not in text.lower())


LOADERS = {  # every public loader of a file, each taking allow_globals
    "read_checkpoint": lambda p, **kw: zoo.read_checkpoint(p, **kw),
    "load_checkpoint": lambda p, **kw: zoo.load_checkpoint(p, **kw),
    "load_checkpoint(task=True)": lambda p, **kw: zoo.load_checkpoint(p, task=True, **kw),
    "load_pretrained": lambda p, **kw: zoo.load_pretrained(p, into=nn.Linear(2, 2), **kw),
    "load_esm2": lambda p, **kw: zoo.load_esm2(p, **kw),
    "load_language_model": lambda p, **kw: zoo.load_language_model(p, **kw),
    "from_fair_esm": lambda p, **kw: zoo.from_fair_esm(p, **kw),
    "from_hf_esm": lambda p, **kw: zoo.from_hf_esm(p, **kw),
    "from_esmc": lambda p, **kw: zoo.from_esmc(p, **kw),
    "from_boltz": lambda p, **kw: zoo.from_boltz(p, **kw),
    "from_openfold3": lambda p, **kw: zoo.from_openfold3(p, **kw),
    "from_protenix": lambda p, **kw: zoo.from_protenix(p, **kw),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_every_loader_refuses_a_pickle_that_runs_code(loader, tmp_path, marker):
    path = evil_checkpoint(tmp_path / "model.ckpt", marker)
    with pytest.raises(ZooCheckpointError) as err:
        LOADERS[loader](path)
    assert refused(err) and str(path) in str(err.value), str(err.value)
    assert f"({OPEN})" in str(err.value) and f"{OPEN} runs code, not data: never allow it" in str(err.value)
    assert not marker.exists()


def test_the_planted_pickles_do_run_code(tmp_path):
    """The refusals here are no accident of a file that would not run anything: plain pickle runs both."""
    for i, obj in enumerate([WritesMarker(tmp_path / "a"), RunsCode(tmp_path / "b")]):
        pickle.loads(pickle.dumps(obj))
    assert (tmp_path / "a").exists() and (tmp_path / "b").read_text() == "ran"


def settings_checkpoint(path, **extra):
    """A checkpoint trained here (a Linear net) that also pickles an object of the caller's own class."""
    return weights_only_checkpoint(path, {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2},
                                   check=False, extra={"settings": Settings(3, "mine"), **extra})


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_allow_globals_lets_your_own_class_through(loader, tmp_path):
    path = settings_checkpoint(tmp_path / "model.ckpt")
    with pytest.raises(UnsafeCheckpointError) as err:
        LOADERS[loader](path)
    assert refused(err) and err.value.globals == [SETTINGS], str(err.value)
    assert f"({SETTINGS})" in str(err.value) and f"allow_globals=[{SETTINGS}]" in str(err.value)
    try:
        LOADERS[loader](path, allow_globals=[Settings])
    except ZooCheckpointError as e:  # the file is no model of that kind: it was read all the same
        assert "unpickle" not in str(e), (loader, str(e))
    with pytest.raises(UnsafeCheckpointError):  # allowed for that call only
        LOADERS[loader](path)
    assert Settings not in torch.serialization.get_safe_globals()


def test_allowed_class_comes_back_as_saved(tmp_path):
    path = settings_checkpoint(tmp_path / "model.ckpt")
    obj = zoo.read_checkpoint(path, allow_globals=(Settings,))
    assert type(obj["settings"]) is Settings and vars(obj["settings"]) == {"width": 3, "name": "mine"}
    assert isinstance(zoo.load_checkpoint(path, allow_globals=[Settings]), nn.Linear)
    assert isinstance(zoo.load_checkpoint(path, task=True, allow_globals=[Settings]), LanguageModelTask)
    legacy = tmp_path / "legacy.pt"  # a pre-zip torch.save: its globals cannot be listed, torch's refusal names one
    torch.save({"settings": Settings()}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpointError, match=rf"allow_globals=\[{SETTINGS}\]"):
        zoo.read_checkpoint(legacy)
    assert isinstance(zoo.read_checkpoint(legacy, allow_globals=[Settings])["settings"], Settings)


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_allowing_a_class_lets_nothing_else_run(loader, tmp_path, marker):
    """The file pickles the allowed class and a function of the same module (and io.open): still refused, the
    marker never written."""
    path = settings_checkpoint(tmp_path / "model.ckpt", runs=RunsCode(marker), opens=WritesMarker(marker))
    with pytest.raises(UnsafeCheckpointError) as err:
        LOADERS[loader](path, allow_globals=[Settings, nn.Linear])
    assert refused(err) and err.value.globals == sorted([OPEN, f"{__name__}.write_marker"]), str(err.value)
    assert SETTINGS not in str(err.value)
    assert not marker.exists()


BAD_ALLOWS = {"a name in a list": ["os.system"], "a bare name": "os.system", "a number": [42],
              "an instance": [Settings()], "a class then a name": [Settings, "builtins.eval"]}


@pytest.mark.parametrize("allow", sorted(BAD_ALLOWS))
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_allow_globals_takes_objects_of_your_code_not_names(loader, allow, tmp_path, marker):
    path = settings_checkpoint(tmp_path / "model.ckpt", runs=RunsCode(marker))
    with pytest.raises(TypeError, match="allow_globals") as err:
        LOADERS[loader](path, allow_globals=BAD_ALLOWS[allow])
    bad = BAD_ALLOWS[allow]
    bad = bad if isinstance(bad, str) else bad[-1]
    assert repr(bad) in str(err.value) and type(bad).__name__ in str(err.value), str(err.value)
    assert not marker.exists()


def test_task_load_from_checkpoint_reads_data_only(tmp_path, marker):
    path = settings_checkpoint(tmp_path / "model.ckpt")
    with pytest.raises(pickle.UnpicklingError, match=SETTINGS):
        LanguageModelTask.load_from_checkpoint(path, map_location="cpu")
    task = LanguageModelTask.load_from_checkpoint(path, map_location="cpu", allow_globals=[Settings])
    assert isinstance(task.net, nn.Linear)
    with pytest.raises(TypeError, match="allow_globals.*'os.system'"):
        LanguageModelTask.load_from_checkpoint(path, map_location="cpu", allow_globals=["os.system"])
    with pytest.raises(ValueError, match="always read as data"):
        LanguageModelTask.load_from_checkpoint(path, map_location="cpu", **{"weights_only": False})
    evil = settings_checkpoint(tmp_path / "evil.ckpt", runs=RunsCode(marker))
    with pytest.raises(pickle.UnpicklingError):
        LanguageModelTask.load_from_checkpoint(evil, map_location="cpu", allow_globals=[Settings])
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
    assert "last.ckpt" in str(err.value) and refused(err)
    assert not marker.exists()


def test_ckpt_path_is_refused_with_the_option_to_pass(tmp_path, marker):
    path = evil_checkpoint(tmp_path / "other.ckpt", marker)
    cfg = make_cfg(["attention=chunked", "~logger", "callbacks=none", f"ckpt_path={path}", "test=false"],
                   tmp_path / "run")
    with pytest.raises(ZooCheckpointError) as err:
        train.train(cfg)
    assert refused(err) and str(path) in str(err.value)
    assert not marker.exists()


def test_model_pretrained_does_not_unpickle_code(tmp_path, marker):
    path = evil_checkpoint(tmp_path / "pretrained.ckpt", marker)
    cfg = make_cfg(["attention=chunked", "~logger", "callbacks=none", "train=false", "test=false",
                    f"model.pretrained={path}"], tmp_path / "run")
    with pytest.raises(Exception) as err:
        train.train(cfg)
    assert "refused to unpickle" in str(err.value) and "re-save" in str(err.value), str(err.value)
    assert not marker.exists()


def weights_only_checkpoint(file, net_config, task="attn_zoo.models.tasks.language_model.LanguageModelTask",
                            check=True, extra=None, **hparams):
    """A file that passes torch.load(weights_only=True): plain values only, which the loader then acts on
    (``extra``: more top-level entries, then not checked)."""
    net = nn.Linear(2, 2)
    torch.save({"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()},
                "hyper_parameters": {"net_config": net_config, **hparams}, "attn_zoo_task": task,
                "pytorch-lightning_version": lightning.__version__, **(extra or {})}, file)
    if check:
        torch.load(file, weights_only=True)
    return file


CALLS = {  # functions a config could name to run a second file's code, with the arguments that would do it
    "attn_zoo.train.run_state": {"path": "EVIL"},
    "torch.load": {"f": "EVIL", "weights_only": False},
    "attn_zoo.models.zoo.read_checkpoint": {"path": "EVIL"},
    "os.system": {"command": "touch MARKER"},
    "builtins.eval": {"source": "open('MARKER', 'w')"},
}


@pytest.mark.parametrize("target", sorted(CALLS))
def test_a_config_naming_a_function_is_refused(target, tmp_path, marker):
    evil = evil_checkpoint(tmp_path / "second.pt", marker)
    kwargs = {k: v.replace("EVIL", str(evil)).replace("MARKER", str(marker)) if isinstance(v, str) else v
              for k, v in CALLS[target].items()}
    path = weights_only_checkpoint(tmp_path / "model.ckpt", {"_target_": target, **kwargs})
    for load in (zoo.load_checkpoint, zoo.load_esm2, lambda p: zoo.load_checkpoint(p, allow_globals=[Settings]),
                 lambda p: zoo.build_network(torch.load(p, weights_only=True)["hyper_parameters"]["net_config"])):
        with pytest.raises(ZooCheckpointError, match=f"{target}' is not a registered class") as err:
            load(path)
        assert "register_network(YourClass)" in str(err.value) and "trust" not in str(err.value).lower()
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


def test_hyperparameters_never_choose_a_file_to_read_nor_what_it_unpickles(tmp_path, marker):
    """A file's hparams naming ``pretrained`` plus ``allow_globals`` (or older versions' options that lifted the
    data-only read) are dropped by both reloads: the task comes back without reading the second file."""
    evil = evil_checkpoint(tmp_path / "second.pt", marker)
    linear = {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2}
    for i, trusting in enumerate([{"pretrained_weights_only": False}, {"trust_file": True},
                                  {"allow_globals": [OPEN]}]):
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
    assert refused(err)
    config = weights_only_checkpoint(tmp_path / "cfg.ckpt", {"_target_": "attn_zoo.train.run_state",
                                                               "path": str(evil)})
    with pytest.raises(ZooCheckpointError, match="not a registered class"):
        E.run(["--model", str(config), "--fasta", str(fasta), "--out", str(tmp_path / "o"), "--no-progress"])
    with pytest.raises(SystemExit) as err:  # no option lifts it
        E.run(["--model", str(evil), "--fasta", str(fasta), "--out", str(tmp_path / "o"), "--trust-file"])
    assert err.value.code == 2
    assert not marker.exists()


@pytest.mark.slow
def test_embed_command_line_refuses_a_pickle(tmp_path, marker):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">p1\nMKTAYIAK\n")
    evil = evil_checkpoint(tmp_path / "esm.pt", marker)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "embed.py"), "--model", str(evil), "--fasta",
                        str(fasta), "--out", str(tmp_path / "cli"), "--device", "cpu", "--no-progress"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode != 0 and "refused to unpickle" in r.stderr and "re-save" in r.stderr, r.stderr
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


# ----------------------------------------------------------------------------------------------------------------
# train.py: the option that lifted the data-only read is gone, and saying so beats ignoring it
# ----------------------------------------------------------------------------------------------------------------
REMOVED = "trust_file"  # the removed option


@pytest.mark.parametrize("override", [f"+{REMOVED}=true", f"+{REMOVED}=false", f"+model.{REMOVED}=true"])
def test_train_refuses_the_removed_option(override, tmp_path):
    cfg = make_cfg(["attention=chunked", "~logger", "callbacks=none", override], tmp_path / "run")
    with pytest.raises(ConfigError, match=rf"{REMOVED} was removed: .*always read as data"):
        train.train(cfg)
    assert not (tmp_path / "run").exists()  # before any work


def test_an_old_config_setting_the_removed_option_is_refused(tmp_path):
    from omegaconf import open_dict

    cfg = make_cfg(["attention=chunked"], tmp_path / "run")
    with open_dict(cfg):
        cfg[REMOVED] = True  # what an old train.yaml or a saved .hydra/config.yaml still holds
    with pytest.raises(ConfigError, match=f"{REMOVED} was removed.*allow_globals"):
        train.train(cfg)


@pytest.mark.parametrize("arg", [f"{REMOVED}=true", f"+{REMOVED}=true", f"++{REMOVED}=1", f"model.{REMOVED}=true"])
def test_train_command_line_names_the_removed_option(arg, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attn-zoo-train", "attention=chunked", arg])
    with pytest.raises(SystemExit) as err:
        train.main()
    assert f"[train] error: {arg.lstrip('+').split('=')[0]} was removed" in str(err.value.code), err.value.code
    assert "always read as data" in str(err.value.code)
    assert f"{REMOVED}: false" not in (ROOT / "configs" / "train.yaml").read_text()


def test_no_config_sets_the_removed_option():
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml") if REMOVED in p.read_text()]
    assert not found


# ----------------------------------------------------------------------------------------------------------------
# A static check: every torch.load of the project reads data only
# ----------------------------------------------------------------------------------------------------------------
SOURCE_DIRS = ("attn_zoo", "attn_ops", "models", "scripts")
TORCH_LOADS = {"torch.load", "torch.serialization.load"}
RUNS_PICKLES = {"pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "dill.load",
                "dill.loads", "marshal.load", "marshal.loads", "torch.jit.load", "joblib.load"}


def _bound_names(tree):
    """Names that imports bind to modules (``{"torch": "torch", "T": "torch", "ser": "torch.serialization"}``)
    and to functions (``{"load": "torch.load"}``), anywhere in the file."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node, names):
    """``torch.serialization.load`` for a call's function, through the names imports bound; None if not known."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, names)
        return f"{base}.{node.attr}" if base else None
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_loads(source: str, name: str = "<snippet>") -> list:
    """Every place in ``source`` that could read a file as code: a torch.load without a literal
    ``weights_only=True``, any ``weights_only=`` other than a literal True (Lightning's fit / validate / test /
    load_from_checkpoint take it too), ``allow_pickle=`` other than False, pickle-family loads, and the text
    a weights_only keyword set to False even in a comment or string."""
    tree = ast.parse(source)
    names = _bound_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        what = _dotted(node.func, names)
        kw = {k.arg: k.value for k in node.keywords}
        if what in TORCH_LOADS and not _is_true(kw.get("weights_only")):
            found.append(f"{name}:{node.lineno}: {what} without weights_only=True")
        if "weights_only" in kw and not _is_true(kw["weights_only"]):
            found.append(f"{name}:{node.lineno}: weights_only={ast.unparse(kw['weights_only'])}")
        if "allow_pickle" in kw and not (isinstance(kw["allow_pickle"], ast.Constant)
                                         and kw["allow_pickle"].value is False):
            found.append(f"{name}:{node.lineno}: allow_pickle={ast.unparse(kw['allow_pickle'])}")
        if what in RUNS_PICKLES:
            found.append(f"{name}:{node.lineno}: {what}")
    if f"weights_only={False}" in source.replace(" ", ""):
        found.append(f"{name}: the text weights_only={False}")
    return found


def project_sources():
    files = sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")) + [ROOT / "train.py"]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_the_static_check_finds_what_it_looks_for():
    """Each of these would read a file as code (or could): the check below cannot pass by missing them."""
    no = False  # spelled through a name, so that this file never holds the text it looks for
    bad = [
        "import torch\ntorch.load(p)\n",
        f"import torch as T\nT.load(p, map_location='cpu', weights_only={no})\n",
        "from torch import load\nload(p)\n",
        "from torch.serialization import load as L\nL(p, weights_only=flag)\n",
        "import torch.serialization\ntorch.serialization.load(p, weights_only=None)\n",
        "from torch import serialization as s\ns.load(p, mmap=True)\n",
        "def f(p):\n    import torch\n    return torch.load(p, **kw)\n",
        "import pickle\npickle.loads(blob)\n",
        "import numpy as np\nnp.load(p, allow_pickle=True)\n",
        "import torch\ntorch.jit.load(p)\n",
        f"trainer.fit(model, ckpt_path=p, weights_only=not cfg.get('x'))\n",
        f"Task.load_from_checkpoint(p, weights_only={no})\n",
        f"# torch.load(p, weights_only = {no}) in a comment\n",
    ]
    for snippet in bad:
        assert unsafe_loads(snippet), snippet
    good = ["import torch\ntorch.load(p, map_location='cpu', weights_only=True, mmap=True)\n",
            "import triton.language as tl\nx = tl.load(ptr, mask=m)\n", "import json\njson.load(f)\n",
            "import numpy as np\nnp.load(p, allow_pickle=False)\n", "chosen.load()(q)\n"]
    for snippet in good:
        assert not unsafe_loads(snippet), snippet


def test_every_torch_load_of_the_project_reads_data_only():
    sources = project_sources()
    assert "models/zoo_files.py" in sources and "attn_zoo/train.py" in sources and len(sources) > 40
    problems = [p for name, text in sources.items() for p in unsafe_loads(text, name)]
    assert not problems, "\n".join(problems)
    # the check saw the real calls: read_checkpoint's torch.load and Lightning's fit / validate / test
    loads = []
    for name, text in sources.items():
        tree = ast.parse(text)
        names = _bound_names(tree)
        loads += [(name, node.lineno) for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and _dotted(node.func, names) in TORCH_LOADS]
    assert [name for name, _ in loads] == ["models/zoo_files.py"], loads
    train_src = sources["attn_zoo/train.py"]
    assert train_src.count("weights_only=True") >= 3


def test_nothing_read_from_a_file_imports_by_name():
    """The registries are the only way from a name in a file to a class: no importlib/getattr path of a file's
    ``_target_`` is left in the zoo (it was ``_import_anything``)."""
    src = (ROOT / "models" / "zoo.py").read_text()
    assert "_import_anything" not in src
    assert not hasattr(zoo, "_import_anything")
    import inspect

    for fn in (zoo.build_network, zoo.load_checkpoint, zoo.read_checkpoint, zoo.load_pretrained, zoo.load_esm2,
               zoo.load_language_model, zoo.from_fair_esm, zoo.from_hf_esm, zoo.from_esmc, zoo.from_boltz,
               zoo.from_openfold3, zoo.from_protenix, Task.__init__, Task.load_from_checkpoint, train.run_state):
        params = inspect.signature(fn).parameters
        assert REMOVED not in params, fn
        if fn not in (zoo.build_network, train.run_state):
            assert "allow_globals" in params, fn
