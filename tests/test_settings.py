"""attn_ops.settings: one object for the triton kernels' switches (environment at import, code, context manager),
and its place in the cache keys it affects."""
import dataclasses
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from attn_ops import settings
from attn_ops.settings import KernelSettings, kernel_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    monkeypatch.setattr(settings, "_current", KernelSettings(cache_dir=None))


def test_environment_gives_the_initial_values():
    assert settings.from_env({}) == KernelSettings(cache_dir=settings._default_cache_dir())
    env = {"ATTN_ZOO_NO_TUNE": "1", "ATTN_ZOO_NO_TMA": "1", "ATTN_ZOO_CACHE_DIR": "/tmp/somewhere",
           "ATTN_ZOO_COMPILE_THREADS": "3"}
    assert settings.from_env(env) == KernelSettings(tune=False, tma=False, cache_dir="/tmp/somewhere",
                                                    compile_threads=3)
    assert settings.from_env({"ATTN_ZOO_NO_TUNE": "0", "ATTN_ZOO_CACHE_DIR": ""}) == KernelSettings(cache_dir=None)
    assert sorted(settings.ENV) == sorted(env)  # four variables, no more


@pytest.mark.parametrize("name, value, field, expected", [
    ("ATTN_ZOO_TUNE_LOG", "1", "tune_log", "tune_log=True"),
    ("ATTN_ZOO_PLAIN_LAUNCH", "1", "fast_launch", "fast_launch=False"),
    ("ATTN_ZOO_NO_SHIPPED", "1", "shipped_configs", "shipped_configs=False"),
    ("ATTN_ZOO_NO_TILE_VARIANTS", "1", "tile_variants", "tile_variants=False"),
])
def test_removed_variables_warn_once_and_name_the_setting(monkeypatch, name, value, field, expected):
    """A variable that is no longer read changes nothing, and is not ignored silently: the first read warns, naming
    the setting that replaces it (an os.environ read again, e.g. by reload_from_env, does not warn twice)."""
    monkeypatch.setattr(settings, "_warned", set())
    with pytest.warns(UserWarning, match=rf"{name}='{value}' is set but no longer read.*"
                                         rf"attn_ops\.settings\.update\({expected}\)") as seen:
        got = settings.from_env({name: value, "ATTN_ZOO_CACHE_DIR": ""})
    assert len(seen) == 1
    assert getattr(got, field) == getattr(KernelSettings(), field)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings.from_env({name: value})
        settings.from_env({"ATTN_ZOO_NO_TUNE": "1"})  # the four kept variables never warn


@pytest.mark.parametrize("raw", ["0", "-2", "many"])
def test_bad_compile_threads_names_the_variable(raw):
    with pytest.raises(ValueError, match="ATTN_ZOO_COMPILE_THREADS must be a positive integer"):
        settings.from_env({"ATTN_ZOO_COMPILE_THREADS": raw})
    with pytest.raises(TypeError, match="compile_threads must be an int >= 1"):
        KernelSettings(compile_threads=0)


def test_removed_compile_processes_is_refused_naming_threads():
    """Worker-process compiles are gone: the field is refused by name, saying that threads do the work; its former
    variable warns that it is not read, without suggesting a setting."""
    for call in (lambda: settings.update(compile_processes=2),
                 lambda: settings.kernel_settings(compile_processes=2).__enter__()):
        with pytest.raises(TypeError, match=r"compile_processes: worker-process compiles were removed.*"
                                            r"compile_threads"):
            call()
    with pytest.raises(TypeError, match="compile_processes"):
        KernelSettings(compile_processes=2)
    assert not hasattr(settings.get(), "compile_processes")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(settings, "_warned", set())
    try:
        with pytest.warns(UserWarning, match=r"ATTN_ZOO_COMPILE_PROCESSES='6' is set but no longer read.*"
                                             r"compiles run on compile_threads threads") as seen:
            settings.from_env({"ATTN_ZOO_COMPILE_PROCESSES": "6", "ATTN_ZOO_CACHE_DIR": ""})
    finally:
        monkeypatch.undo()
    assert not any("settings.update" in str(w.message) for w in seen)


def test_environment_is_read_once_at_import():
    """A fresh interpreter with the variables set starts with them; changing os.environ afterwards changes nothing
    until reload_from_env(). A removed variable set there (ATTN_ZOO_PLAIN_LAUNCH) changes nothing and warns once."""
    code = ("import os, attn_ops; s = attn_ops.settings.get(); os.environ['ATTN_ZOO_NO_TMA'] = '0';"
            "t = attn_ops.settings.get(); u = attn_ops.settings.reload_from_env();"
            "print(s.tune, s.tma, s.fast_launch, s.cache_dir, t.tma, u.tma)")
    env = dict(os.environ, ATTN_ZOO_NO_TUNE="1", ATTN_ZOO_NO_TMA="1", ATTN_ZOO_CACHE_DIR="/tmp/az",
               ATTN_ZOO_PLAIN_LAUNCH="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True", "/tmp/az", "False", "True"]
    assert out.stderr.count("ATTN_ZOO_PLAIN_LAUNCH='1' is set but no longer read") == 1, out.stderr
    assert "attn_ops.settings.update(fast_launch=False)" in out.stderr


def test_update_and_context_manager_restore():
    assert settings.get().tune and settings.get().tma
    with kernel_settings(tma=False) as s:
        assert s.tma is False and settings.get() is s
        with kernel_settings(tune=False):
            assert settings.get() == KernelSettings(tune=False, tma=False, cache_dir=None)
        assert settings.get() is s
    assert settings.get().tma
    with pytest.raises(RuntimeError):
        with kernel_settings(fast_launch=False):
            raise RuntimeError("inside")
    assert settings.get().fast_launch  # restored on an exception too
    settings.update(tune=False)
    assert settings.get().tune is False


def test_bad_settings_are_refused_by_name():
    with pytest.raises(TypeError, match=r"unknown kernel setting\(s\) \['no_tma'\]"):
        settings.update(no_tma=True)
    with pytest.raises(TypeError, match="tune must be a bool"):
        settings.update(tune="no")
    with pytest.raises(TypeError, match="unknown kernel setting"):
        with kernel_settings(plain_launch=True):
            pass
    assert settings.get() == KernelSettings(cache_dir=None)


def test_settings_are_in_the_cache_keys_they_affect(monkeypatch):
    """tma changes the launchers' tuning key (the kernels differ); tune gets picks of its own in the tuner's cache;
    the direct-launch cache sees TMA through the kernels' arguments (a descriptor vs a tensor, HAS_BIAS)."""
    from attn_ops.triton import launch, passes, tuning

    q = torch.zeros(1, 2, 2, 40, 16)
    bias = torch.zeros(1, 1, 2, 40, 24)
    key = passes._key(q, q[..., :24, :], bias, None, False)
    with kernel_settings(tma=False):
        assert passes._key(q, q[..., :24, :], bias, None, False) != key
        assert passes.bias_tma(bias, 40, 24) is None
    assert passes._key(q, q[..., :24, :], bias, None, False) == key
    td = pytest.importorskip("triton.tools.tensor_descriptor")
    desc = td.TensorDescriptor(bias.view(2, 40, 24), [2, 40, 24], [960, 24, 1], [1, 32, 16])
    assert launch.signature((desc,)) != launch.signature((bias,))

    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning.TUNER, "picks", {})
    launched = []

    def fake_launch(cfg):
        launched.append(cfg)

    monkeypatch.setattr(tuning, "measure", lambda fn, **kw: fn() or 1.0)
    monkeypatch.setattr(settings, "_current", KernelSettings(cache_dir=None, compile_threads=1))
    with kernel_settings(tune=False):
        untuned = tuning.pick("fwd", ("k",), 64, 256, 256, fake_launch)
    tuned = tuning.pick("fwd", ("k",), 64, 256, 256, fake_launch)
    assert len(launched) == 1 + len(tuning.candidates("fwd", 64, 256, 256))  # the tuned pick did not reuse it
    assert set(tuning.chosen()) == {("fwd", False, "k", False, True, None), ("fwd", False, "k", True, True, None)}
    assert untuned == tuning.candidates("fwd", 64, 256, 256)[0] and tuned is not None


def test_docs_table_lists_the_variables_and_every_setting():
    """docs/backends.md's one table: a row per field, the four variables beside theirs, no removed variable."""
    with open(os.path.join(ROOT, "docs", "backends.md")) as f:
        rows = [line for line in f if re.match(r"\| (`ATTN_ZOO_[^`]*`|-) \|", line)]
    found = {}
    for row in rows:
        variable, setting = [c.strip().strip("`") for c in row.split("|")[1:3]]
        found[setting.split("=")[0]] = variable.split("=")[0]
    assert sorted(found) == sorted(f.name for f in dataclasses.fields(KernelSettings))
    assert {v: k.split("=")[0] for v, k in settings.ENV.items()} == {v: k for k, v in found.items() if v != "-"}
