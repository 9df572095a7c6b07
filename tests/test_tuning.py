"""The block-size tuner (attn_ops/triton/tuning.py) on the CPU: candidate pruning, and pick()'s timing, cache and
switches with the interpreter shortcut turned off. A fake ``launch`` and a fake ``triton.testing.do_bench`` stand
in for the GPU; the last test times real interpreter launches of the op's launchers."""
import pytest
import torch

pytest.importorskip("triton")

import triton.testing  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from attn_ops import settings  # noqa: E402
from attn_ops.triton import tuning  # noqa: E402
from attn_ops.triton.tuning import Cfg, candidates, pick  # noqa: E402
from helpers import check_against_reference, make_inputs  # noqa: E402

KERNELS = ("fwd", "dkdv", "dq", "dbias")


def _pow2(n):
    return max(16, 1 << (n - 1).bit_length())


@pytest.mark.parametrize("kernel", KERNELS)
def test_candidates_never_empty_and_fit_the_head_width(kernel):
    """Every (head width, Lq, Lk, pair) gets at least one config; wide heads only get tiles that fit (> 128: at
    most 64 x 64 and 2 stages; dK/dV > 64: at most 64 x 128); tiles are no larger than L needs (head widths up to
    128, whose list is pruned from the kernel's own candidates)."""
    for width in (16, 32, 64, 96, 128, 192, 256, 512):
        for lq, lk in ((1, 1), (5, 300), (16, 16), (37, 20), (100, 100), (1000, 1000)):
            for pair in (False, True):
                cands = candidates(kernel, width, lq, lk, pair)
                assert cands and all(isinstance(c, Cfg) for c in cands), (width, lq, lk, pair)
                for c in cands:
                    if width > 128:
                        assert c.block_m * c.block_n <= 64 * 64 and c.num_stages <= 2, (width, c)
                    if width > 64 and kernel == "dkdv":
                        assert c.block_m * c.block_n <= 64 * 128, (width, c)
                    if width <= 128:
                        assert c.block_m <= _pow2(lq) and c.block_n <= _pow2(lk), (width, lq, lk, c)
                    assert c.rows == 1 or (pair and width <= 64), (width, pair, c)


def test_fp32_doubles_the_width_and_prunes_more():
    """The launchers pass the head width in 16-bit units: fp32 D = 128 counts as 256, so its forward drops every
    3-stage / big-tile config that fp16 D = 128 keeps."""
    from attn_ops.triton.launch import _width

    q16, q32 = torch.empty(1, 1, 1, 4, 128, dtype=torch.float16), torch.empty(1, 1, 1, 4, 128)
    assert _width(q16, 128, 128) == 128 and _width(q32, 128, 128) == 256
    assert _width(q32, 16, 64) == 128  # the wider of D and Dv
    fp16, fp32 = candidates("fwd", 128, 512, 512), candidates("fwd", 256, 512, 512)
    assert fp16 == tuning._CANDIDATES["fwd"]
    assert fp32 and not set(fp32) & set(fp16)
    assert all(c.block_m * c.block_n <= 64 * 64 and c.num_stages <= 2 for c in fp32)


def test_tiny_sequences_get_one_small_config():
    assert candidates("fwd", 64, 1, 1) == [Cfg(16, 16, 4, 1)]
    assert candidates("dq", 64, 8, 300) == [Cfg(16, 16, 4, 1)]  # Lq = 8: every query tile is too big


def test_pair_and_dbias_candidate_expansion():
    """``pair``: each tile shape also with two rows per program (small heads only). dbias: each tile shape with
    every split count, 2 first (an untimed pick then runs the fp32-partials path)."""
    base = candidates("dkdv", 64, 256, 256)
    assert candidates("dkdv", 64, 256, 256, pair=True) == base + [c._replace(rows=2) for c in base]
    assert candidates("dkdv", 128, 256, 256, pair=True) == candidates("dkdv", 128, 256, 256)
    tiles = [c for c in tuning._CANDIDATES["dbias"]]
    dbias = candidates("dbias", 32, 256, 256)
    assert dbias == [c._replace(splits=n) for c in tiles for n in tuning._DBIAS_SPLITS]
    assert dbias[0].splits == 2


class FakeBench:
    """Stands in for ``triton.testing.do_bench`` and a launch callable: ``launch`` records each config it gets
    (raising for those in ``fail``); ``do_bench`` runs the function once and returns the time set for the config
    it launched."""

    def __init__(self):
        self.ms, self.fail, self.error = {}, set(), OutOfResources(1 << 20, 1 << 17, "shared memory")
        self.launched, self.timed = [], []

    def launch(self, cfg):
        self.launched.append(cfg)
        if cfg in self.fail:
            raise self.error

    def do_bench(self, fn, warmup=25, rep=100, **kw):
        fn()
        self.timed.append(self.launched[-1])
        return self.ms.get(self.launched[-1], 10.0)


@pytest.fixture
def tuner(monkeypatch):
    """pick() as on a GPU: no interpreter shortcut, an empty cache, default settings without a disk cache, a fake
    timer."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_CACHE", {})
    monkeypatch.setattr(settings, "_current", settings.KernelSettings(cache_dir=None))
    bench = FakeBench()
    monkeypatch.setattr(triton.testing, "do_bench", bench.do_bench)
    return bench


ARGS = dict(head_dim=64, lq=256, lk=256)  # five forward candidates


def test_pick_times_every_candidate_and_keeps_the_fastest(tuner):
    cands = candidates("fwd", **ARGS)
    assert len(cands) >= 4
    tuner.ms = {c: 2.0 + i for i, c in enumerate(cands)}
    tuner.ms[cands[2]] = 0.5  # neither the first nor the last
    assert pick("fwd", ("shape",), launch=tuner.launch, **ARGS) == cands[2]
    assert tuner.timed == cands
    assert tuning.chosen() == {("fwd", False, "shape", True, None): cands[2]}


def test_pick_caches_per_key(tuner):
    cands = candidates("fwd", **ARGS)
    tuner.ms = {c: 1.0 for c in cands}
    tuner.ms[cands[1]] = 0.5
    first = pick("fwd", ("a",), launch=tuner.launch, **ARGS)
    tuner.launched.clear()
    tuner.timed.clear()
    tuner.ms[cands[3]] = 0.1  # now faster, but the key is cached
    assert pick("fwd", ("a",), launch=tuner.launch, **ARGS) == first == cands[1]
    assert tuner.launched == [] and tuner.timed == []
    assert pick("fwd", ("b",), launch=tuner.launch, **ARGS) == cands[3]  # a new key is timed
    assert tuner.timed == cands
    tuner.timed.clear()
    pick("dq", ("b",), launch=tuner.launch, **ARGS)  # the kernel name and pair flag are part of the key
    pick("fwd", ("b",), launch=tuner.launch, pair=True, **ARGS)
    assert tuner.timed == candidates("dq", **ARGS) + candidates("fwd", pair=True, **ARGS)


@pytest.mark.parametrize("error", [OutOfResources(1 << 20, 1 << 17, "shared memory"), RuntimeError("PTX failed")],
                         ids=["out_of_resources", "other_error"])
def test_pick_skips_candidates_that_fail_to_launch(tuner, error):
    cands = candidates("fwd", **ARGS)
    tuner.ms = {c: 1.0 + i for i, c in enumerate(cands)}
    tuner.fail, tuner.error = {cands[0], cands[1]}, error  # the two fastest do not fit
    assert pick("fwd", ("k",), launch=tuner.launch, **ARGS) == cands[2]
    assert tuner.launched == cands and tuner.timed == cands[2:]


def test_pick_with_no_candidate_launching_falls_back_to_the_last(tuner):
    cands = candidates("fwd", **ARGS)
    tuner.fail = set(cands)
    assert pick("fwd", ("k",), launch=tuner.launch, **ARGS) == cands[-1]
    assert tuner.launched == cands


def test_no_tune_switch_launches_the_first_candidate_without_timing(tuner, monkeypatch):
    """settings.tune False (read at each pick): the first candidate that launches, no timing; one that is out of
    resources is passed over; the choice is cached like a timed one, under a key of its own."""
    cands = candidates("fwd", **ARGS)
    tuner.ms = {cands[0]: 50.0}  # the slowest: only the switch picks it
    settings.update(tune=False)
    assert pick("fwd", ("a",), launch=tuner.launch, **ARGS) == cands[0]
    assert tuner.launched == cands[:1] and tuner.timed == []
    tuner.fail = {cands[0]}
    tuner.launched.clear()
    assert pick("fwd", ("b",), launch=tuner.launch, **ARGS) == cands[1]
    assert tuner.launched == cands[:2] and tuner.timed == []
    assert tuning.chosen() == {("fwd", False, "a", False, None): cands[0], ("fwd", False, "b", False, None): cands[1]}
    settings.update(tune=True)  # the same process times again once the switch is off, also for key "a"
    tuner.fail = set()
    assert pick("fwd", ("a",), launch=tuner.launch, **ARGS) != cands[0]
    assert tuner.timed == cands


def test_single_candidate_is_not_timed(tuner):
    assert pick("fwd", ("k",), 64, 8, 8, tuner.launch) == Cfg(16, 16, 4, 1)
    assert tuner.timed == []


def test_interpreter_shortcut(monkeypatch):
    """Under TRITON_INTERPRET=1: the fixed small config (two rows for pair layouts), nothing launched or cached."""
    monkeypatch.setattr(tuning, "_CACHE", {})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuning.interpreting()

    def launch(cfg):
        raise AssertionError("no launch under the interpreter")

    assert pick("dkdv", ("k",), 64, 256, 256, launch) == tuning._INTERPRETER
    assert pick("dkdv", ("k",), 64, 256, 256, launch, pair=True) == tuning._INTERPRETER._replace(rows=2)
    assert tuning.chosen() == {}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not tuning.interpreting()


@pytest.mark.parametrize("opts", [dict(bwd="fused", deterministic=False), dict(bwd="split", deterministic=False)],
                         ids=["fused", "atomic"])
def test_timed_launchers_are_repeatable(monkeypatch, opts):
    """The op's real launch closures, timed by pick() over several configs each (interpreter launches, fake
    clock), must re-zero what they accumulate into (the fused dQ and the atomic dBias accumulators): the result
    after tuning still matches the reference."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_CACHE", {})
    monkeypatch.setattr(settings, "_current", settings.KernelSettings(cache_dir=None))
    timed = []

    def do_bench(fn, warmup=25, rep=100, **kw):
        fn()
        timed.append(fn)
        return float(len(timed) % 3)  # not the first candidate every time

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(tuning, "candidates", _small_candidates)
    q, k, v, bias, mask = make_inputs((1, 3), 2, 20, 20, 16, bias_shape=(1, 1, 2, 20, 20),
                                      mask_shape=(1, 3, 1, 1, 20), seed=7)
    check_against_reference("triton", q, k, v, bias, mask, **opts)
    kernels = {key[0] for key in tuning.chosen()}
    assert {"fwd", "dkdv"} <= kernels and len(timed) >= 6


def _small_candidates(kernel, head_dim, lq, lk, pair=False):
    """Interpreter-sized candidates: three tile shapes (two rows per program too where ``pair``)."""
    out = [Cfg(16, 16, 4, 1), Cfg(32, 16, 4, 1), Cfg(16, 32, 4, 1)]
    return out + [c._replace(rows=2) for c in out] if pair else out
