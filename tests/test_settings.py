"""attn_ops.settings: one object for the triton kernels' switches (environment at import, code, context manager),
and its place in the cache keys it affects."""
import os
import subprocess
import sys

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
    env = {"ATTN_ZOO_NO_TUNE": "1", "ATTN_ZOO_TUNE_LOG": "1", "ATTN_ZOO_PLAIN_LAUNCH": "1", "ATTN_ZOO_NO_TMA": "1",
           "ATTN_ZOO_CACHE_DIR": "/tmp/somewhere", "ATTN_ZOO_NO_SHIPPED": "1"}
    assert settings.from_env(env) == KernelSettings(tune=False, tune_log=True, fast_launch=False, tma=False,
                                                    cache_dir="/tmp/somewhere", shipped_configs=False)
    assert settings.from_env({"ATTN_ZOO_NO_TUNE": "0", "ATTN_ZOO_CACHE_DIR": ""}) == KernelSettings(cache_dir=None)
    assert settings.from_env({"ATTN_ZOO_COMPILE_THREADS": "3"}).compile_threads == 3
    assert settings.from_env({"ATTN_ZOO_COMPILE_PROCESSES": "0"}).compile_processes == 0
    assert settings.from_env({"ATTN_ZOO_COMPILE_PROCESSES": "6"}).compile_processes == 6
    assert settings.from_env({"ATTN_ZOO_NO_TILE_VARIANTS": "1"}).tile_variants is False
    assert settings.from_env({}).tile_variants is True


@pytest.mark.parametrize("raw", ["0", "-2", "many"])
def test_bad_compile_threads_names_the_variable(raw):
    with pytest.raises(ValueError, match="ATTN_ZOO_COMPILE_THREADS must be a positive integer"):
        settings.from_env({"ATTN_ZOO_COMPILE_THREADS": raw})
    with pytest.raises(TypeError, match="compile_threads must be an int >= 1"):
        KernelSettings(compile_threads=0)


@pytest.mark.parametrize("raw", ["-1", "some"])
def test_bad_compile_processes_names_the_variable(raw):
    with pytest.raises(ValueError, match="ATTN_ZOO_COMPILE_PROCESSES must be an integer >= 0"):
        settings.from_env({"ATTN_ZOO_COMPILE_PROCESSES": raw})
    with pytest.raises(TypeError, match="compile_processes must be an int >= 0"):
        KernelSettings(compile_processes=-1)


def test_environment_is_read_once_at_import():
    """A fresh interpreter with the variables set starts with them; changing os.environ afterwards changes nothing
    until reload_from_env()."""
    code = ("import os, attn_ops; s = attn_ops.settings.get(); os.environ['ATTN_ZOO_NO_TMA'] = '0';"
            "t = attn_ops.settings.get(); u = attn_ops.settings.reload_from_env();"
            "print(s.tune, s.tma, s.fast_launch, s.cache_dir, t.tma, u.tma)")
    env = dict(os.environ, ATTN_ZOO_NO_TUNE="1", ATTN_ZOO_NO_TMA="1", ATTN_ZOO_CACHE_DIR="/tmp/az",
               PYTHONPATH=ROOT)
    env.pop("ATTN_ZOO_PLAIN_LAUNCH", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True", "/tmp/az", "False", "True"]


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
    from attn_ops.triton import fastlaunch, launch, tuning

    q = torch.zeros(1, 2, 2, 40, 16)
    bias = torch.zeros(1, 1, 2, 40, 24)
    key = launch._key(q, q[..., :24, :], bias, None, False)
    with kernel_settings(tma=False):
        assert launch._key(q, q[..., :24, :], bias, None, False) != key
        assert launch.bias_tma(bias, 40, 24) is None
    assert launch._key(q, q[..., :24, :], bias, None, False) == key
    td = pytest.importorskip("triton.tools.tensor_descriptor")
    desc = td.TensorDescriptor(bias.view(2, 40, 24), [2, 40, 24], [960, 24, 1], [1, 32, 16])
    assert fastlaunch.signature((desc,)) != fastlaunch.signature((bias,))

    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_CACHE", {})
    launched = []

    def fake_launch(cfg):
        launched.append(cfg)

    monkeypatch.setattr(tuning, "measure", lambda fn, **kw: fn() or 1.0)
    monkeypatch.setattr(settings, "_current", KernelSettings(cache_dir=None, compile_threads=1, compile_processes=0))
    with kernel_settings(tune=False):
        untuned = tuning.pick("fwd", ("k",), 64, 256, 256, fake_launch)
    tuned = tuning.pick("fwd", ("k",), 64, 256, 256, fake_launch)
    assert len(launched) == 1 + len(tuning.candidates("fwd", 64, 256, 256))  # the tuned pick did not reuse it
    assert set(tuning.chosen()) == {("fwd", False, "k", False, True, None), ("fwd", False, "k", True, True, None)}
    assert untuned == tuning.candidates("fwd", 64, 256, 256)[0] and tuned is not None
