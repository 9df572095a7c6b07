"""The block-size tuner (attn_ops/triton/tuning.py) on the CPU: candidate pruning, and pick()'s timing, cache and
switches with the interpreter shortcut turned off. A fake ``launch`` and a fake ``tuning.measure`` stand
in for the GPU; the last test times real interpreter launches of the op's launchers."""
import json
import os

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from attn_ops import settings  # noqa: E402
from attn_ops.triton import launch as launch_mod  # noqa: E402
from attn_ops.triton import passes, tuning  # noqa: E402
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
    from attn_ops.triton.passes import _width

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
    every split aim, the launcher's default first (an untimed pick then splits where tiles are few)."""
    base = candidates("dkdv", 64, 256, 256)
    assert candidates("dkdv", 64, 256, 256, pair=True) == base + [c._replace(rows=2) for c in base]
    assert candidates("dkdv", 128, 256, 256, pair=True) == candidates("dkdv", 128, 256, 256)
    tiles = [c for c in tuning._CANDIDATES["dbias"]]
    dbias = candidates("dbias", 32, 256, 256)
    assert dbias == [c._replace(splits=n) for c in tiles for n in tuning._DBIAS_SPLITS]
    assert dbias[0].splits == 0


def test_dbias_split_count_is_programs_per_sm(monkeypatch):
    """``Cfg.splits`` aims at programs per SM, so one tuned value fills the GPU alike at every length of its bucket;
    1 is no split, 0 the default (``tuning.DBIAS_PER_SM``); capped by the batch steps and at 64."""
    import torch

    dev = torch.device("cuda", 0)
    monkeypatch.setitem(launch_mod.STATE.devices, 0, (9, 132))
    assert passes._dbias_splits(1, 144, 384, dev) == 1
    assert passes._dbias_splits(0, 144, 384, dev) == 8  # 8 per SM: 1056 programs over 144 tiles
    assert passes._dbias_splits(4, 144, 384, dev) == 4
    assert passes._dbias_splits(4, 100, 300, dev) == 6  # N=300's fewer tiles get more splits, not the same 4
    assert passes._dbias_splits(0, 2000, 384, dev) == 1
    assert passes._dbias_splits(4, 4, 384, dev) == 64
    assert passes._dbias_splits(4, 4, 6, dev) == 6
    assert passes._dbias_splits(4, 4, 6, torch.device("cpu")) == 2  # the interpreter counts 2 SMs
    monkeypatch.setitem(launch_mod.STATE.devices, 0, (9, 66))  # half the SMs: half the splits for the same aim
    assert passes._dbias_splits(0, 144, 384, dev) == 4
    assert passes._dbias_splits(4, 100, 300, dev) == 3


class FakeBench:
    """Stands in for ``tuning.measure`` and a launch callable: ``launch`` records each config it gets (raising for
    those in ``fail``); its ``do_bench`` (patched in as ``measure``) runs the function once and returns the time set
    for the config it launched."""

    def __init__(self):
        self.ms, self.fail, self.error = {}, set(), OutOfResources(1 << 20, 1 << 17, "shared memory")
        self.launched, self.timed = [], []

    def launch(self, cfg):
        self.launched.append(cfg)
        if cfg in self.fail:
            raise self.error

    def do_bench(self, fn, **kw):
        fn()
        self.timed.append(self.launched[-1])
        return self.ms.get(self.launched[-1], 10.0)


@pytest.fixture
def tuner(monkeypatch):
    """pick() as on a GPU: no interpreter shortcut, an empty cache, default settings without a disk cache or shipped
    tables (a GPU machine's own would answer real keys), a fake timer."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning.TUNER, "picks", {})
    monkeypatch.setattr(settings, "_current", settings.KernelSettings(cache_dir=None, compile_threads=1,
                                                                      shipped_configs=False))
    bench = FakeBench()
    monkeypatch.setattr(tuning, "measure", bench.do_bench)
    return bench


ARGS = dict(head_dim=64, lq=256, lk=256)  # five forward candidates


def test_pick_times_every_candidate_and_keeps_the_fastest(tuner):
    cands = candidates("fwd", **ARGS)
    assert len(cands) >= 4
    tuner.ms = {c: 2.0 + i for i, c in enumerate(cands)}
    tuner.ms[cands[2]] = 0.5  # neither the first nor the last
    assert pick("fwd", ("shape",), launch=tuner.launch, **ARGS) == cands[2]
    assert tuner.timed == cands
    assert tuning.chosen() == {("fwd", False, "shape", True, False, None): cands[2]}


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
    assert tuning.chosen() == {("fwd", False, "a", False, False, None): cands[0], ("fwd", False, "b", False, False, None): cands[1]}
    settings.update(tune=True)  # the same process times again once the switch is off, also for key "a"
    tuner.fail = set()
    assert pick("fwd", ("a",), launch=tuner.launch, **ARGS) != cands[0]
    assert tuner.timed == cands


def test_single_candidate_is_not_timed(tuner):
    assert pick("fwd", ("k",), 64, 8, 8, tuner.launch) == Cfg(16, 16, 4, 1)
    assert tuner.timed == []


def test_interpreter_shortcut(monkeypatch):
    """Under TRITON_INTERPRET=1: the fixed small config (two rows for pair layouts), nothing launched or cached."""
    monkeypatch.setattr(tuning.TUNER, "picks", {})
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
@pytest.mark.slow
def test_timed_launchers_are_repeatable(monkeypatch, opts):
    """The op's real launch closures, timed by pick() over several configs each (interpreter launches, fake
    clock), must re-zero what they accumulate into (the fused dQ and the atomic dBias accumulators): the result
    after tuning still matches the reference."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning.TUNER, "picks", {})
    monkeypatch.setattr(settings, "_current", settings.KernelSettings(cache_dir=None))
    timed = []

    def do_bench(fn, **kw):
        fn()
        timed.append(fn)
        return float(len(timed) % 3)  # not the first candidate every time

    monkeypatch.setattr(tuning, "measure", do_bench)
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


# --- length buckets -------------------------------------------------------------------------------------------


def test_buckets_are_powers_of_two_and_candidates_depend_only_on_them():
    assert [tuning.bucket(n) for n in (1, 15, 16, 17, 33, 129, 200, 256, 257, 520)] == [
        16, 16, 16, 32, 64, 256, 256, 256, 512, 1024]
    for kernel in KERNELS:
        for lo, hi in ((17, 32), (129, 256), (257, 512)):
            assert candidates(kernel, 32, lo, lo) == candidates(kernel, 32, hi, hi) == candidates(kernel, 32, lo, hi)


def _fake_timer(monkeypatch, ms):
    """do_bench -> ms(cfg, L) for the config being launched (the launch closure's cfg) and the current length."""
    state = {}

    def do_bench(fn, **kw):
        fn()
        return ms(state["cfg"], state["L"])

    real_pick = tuning.pick

    def pick(kernel, key, head_dim, lq, lk, launch, pair=False, device=None):
        def tracked(c):
            state["cfg"] = c
            state["timed"] = state.get("timed", 0) + 1
            return launch(c)
        state["L"] = lk
        return real_pick(kernel, key, head_dim, lq, lk, tracked, pair, device)

    monkeypatch.setattr(tuning, "measure", do_bench)
    monkeypatch.setattr(launch_mod, "pick", pick)
    return state


def _run(L, seed=3):
    """out, lse and every gradient of a tiny pair-bias case with L keys and queries (fp32, interpreter)."""
    from attn_ops.triton import triton_attention

    q, k, v, bias, mask = make_inputs((1, 2), 2, L, L, 16, bias_shape=(1, 1, 2, L, L), mask_shape=(1, 2, 1, 1, L),
                                      seed=seed)
    out, lse = triton_attention(q, k, v, bias, mask, 0.25, False)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad((out * g).sum() + lse.masked_fill(lse.isinf(), 0).sum(), (q, k, v, bias))
    return (out, lse) + grads, (q, k, v, bias, mask)


@pytest.mark.slow
@pytest.mark.parametrize("same_pick", [True, False], ids=["same_config", "other_config"])
def test_bucketed_tuning_matches_exact_tuning(monkeypatch, same_pick):
    """L = 20 is timed; L = 24 (same bucket, 32) reuses its picks without timing. Against tuning keyed by the exact
    length (the bucket function made the identity): the same bits where both pick the same config, results within
    the reference's tolerance where the exact tuner picks another (the fake clock prefers other tiles at L = 24)."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(settings, "_current", settings.KernelSettings(cache_dir=None))
    monkeypatch.setattr(tuning, "candidates", _small_candidates)

    def ms(cfg, L):  # at L = 24 the exact tuner prefers the 32-row tiles unless same_pick
        return float(cfg.block_m == (16 if same_pick or L != 24 else 32)) + 0.1 * cfg.rows

    state = _fake_timer(monkeypatch, ms)
    monkeypatch.setattr(tuning.TUNER, "picks", {})
    _run(20)
    timed_first = state["timed"]
    assert timed_first >= 6
    bucketed, inputs = _run(24)
    assert state["timed"] == timed_first  # every kernel's pick came from L = 20's bucket
    picks_bucketed = dict(tuning.chosen())

    tuning.TUNER.reset()  # no picks, and the plans that hold the old ones are made again
    monkeypatch.setattr(passes, "bucket", lambda n: n)  # exact-length keys
    _run(20)
    before = state["timed"]
    exact, _ = _run(24)
    assert state["timed"] - before >= 6  # L = 24 timed again
    after_exact = state["timed"]
    picks_exact = {k: c for k, c in tuning.chosen().items() if 24 in k}
    same = {c.block_m for c in picks_exact.values()} == {c.block_m for c in picks_bucketed.values()}
    assert same == same_pick
    if same_pick:
        for a, b in zip(bucketed, exact):
            assert torch.equal(a, b)
    else:
        monkeypatch.setattr(passes, "bucket", tuning.bucket)
        tuning.TUNER.reset()
        tuning.TUNER.picks.update(picks_bucketed)
        check_against_reference("triton", *inputs)  # the bucketed picks (cached) against float64
        assert state["timed"] == after_exact  # no new timing there
        for a, b in zip(bucketed, exact):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --- on-disk cache --------------------------------------------------------------------------------------------

IDENT = {"gpu": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "source": "0123456789abcdef"}


def _json(path):
    import json

    with open(path) as fh:
        return json.load(fh)


def test_disk_cache_round_trip(tmp_path):
    a = tuning.DiskCache(tmp_path, IDENT)
    a.put(("fwd", False, "k"), Cfg(64, 64, 4, 3))
    b = tuning.DiskCache(tmp_path, IDENT)  # another process, same folder and identity
    assert b.get(("fwd", False, "k")) == Cfg(64, 64, 4, 3)
    assert b.get(("fwd", False, "other")) is None
    assert _json(a.path)["identity"] == IDENT
    other = tuning.DiskCache(tmp_path, dict(IDENT, gpu="NVIDIA A100"))  # another GPU: another file
    assert other.path != a.path and other.get(("fwd", False, "k")) is None


@pytest.mark.parametrize("content", ["{not json", "", '{"identity": 3}', '["a"]',
                                     '{"identity": %s, "configs": {"x": [1]}}'],
                         ids=["garbage", "empty", "bad_identity", "list", "bad_config"])
def test_corrupt_file_is_ignored_with_one_warning_and_rebuilt(tmp_path, content):
    import json
    import warnings

    cache = tuning.DiskCache(tmp_path, IDENT)
    with open(cache.path, "w") as fh:
        fh.write(content.replace("%s", json.dumps(IDENT)))
    with pytest.warns(RuntimeWarning, match="ignored"):
        assert cache.get(("fwd", False, "k")) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per look-up
        os.utime(cache.path, ns=(1, 1))  # looks changed: read again
        assert cache.get(("fwd", False, "j")) is None
        cache.put(("fwd", False, "k"), Cfg(32, 32, 4, 2))
    data = _json(cache.path)
    assert data == {"identity": IDENT, "configs": {repr(("fwd", False, "k")): [32, 32, 4, 2, 1, 0]}}


@pytest.mark.parametrize("field", ["gpu", "triton", "source"], ids=["device_name", "triton_version", "source_hash"])
def test_foreign_file_is_ignored_with_a_warning_and_rebuilt(tmp_path, field):
    """A file at this identity's path written for another GPU / Triton / kernel source (copied, or a hash clash)."""
    foreign = tuning.DiskCache(tmp_path, dict(IDENT, **{field: "other"}))
    foreign.put(("fwd", False, "k"), Cfg(128, 128, 8, 3))
    cache = tuning.DiskCache(tmp_path, IDENT)
    os.replace(foreign.path, cache.path)
    with pytest.warns(RuntimeWarning, match="written for"):
        assert cache.get(("fwd", False, "k")) is None
    cache.put(("fwd", False, "j"), Cfg(64, 64, 4, 3))
    data = _json(cache.path)
    assert data["identity"] == IDENT and list(data["configs"]) == [repr(("fwd", False, "j"))]


def _writer(folder, name, n, barrier):
    cache = tuning.DiskCache(folder, IDENT)
    barrier.wait()
    for i in range(n):
        cache.put(("fwd", False, name, i), Cfg(16 * (1 + i % 4), 64, 4, 3))


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), name, 25, barrier)) for name in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    cache = tuning.DiskCache(tmp_path, IDENT)
    for name in ("a", "b"):
        for i in range(25):
            assert cache.get(("fwd", False, name, i)) == Cfg(16 * (1 + i % 4), 64, 4, 3), (name, i)
    assert len(_json(cache.path)["configs"]) == 50
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []  # no temp file left behind


@pytest.mark.parametrize("how", ["cannot_create_files", "folder_is_a_file"])
def test_read_only_folder_warns_once_and_keeps_memory(tmp_path, monkeypatch, how):
    import warnings

    if how == "cannot_create_files":  # EACCES as in a read-only folder (the tests may run as root, which chmod
        folder = tmp_path                 # does not stop)

        def refuse(*a, **k):
            raise PermissionError(13, "Permission denied", str(tmp_path))

        monkeypatch.setattr(tuning.tempfile, "mkstemp", refuse)
    else:
        (tmp_path / "file").write_text("")
        folder = tmp_path / "file" / "cache"
    cache = tuning.DiskCache(folder, IDENT)
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        cache.put(("fwd", False, "k"), Cfg(64, 64, 4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.put(("fwd", False, "j"), Cfg(32, 64, 4, 3))
    assert cache.get(("fwd", False, "k")) == Cfg(64, 64, 4, 3) and cache.get(("fwd", False, "j")) == Cfg(32, 64, 4, 3)
    assert not os.path.exists(cache.path)


def test_pick_uses_the_disk_cache_across_processes(tuner, tmp_path, monkeypatch):
    """A timed pick lands on disk; a fresh process (empty memory caches) picks it up without timing; a stored
    config the candidate lists no longer offer is timed again; an untuned pick neither reads nor writes it."""
    monkeypatch.setattr(tuning, "identity", lambda device=None: IDENT)
    monkeypatch.setattr(tuning.TUNER, "disks", {})
    settings.update(cache_dir=str(tmp_path))
    cands = candidates("fwd", **ARGS)
    tuner.ms = {c: 1.0 for c in cands}
    tuner.ms[cands[2]] = 0.5
    assert pick("fwd", ("k",), launch=tuner.launch, **ARGS) == cands[2]
    assert len(tuner.timed) == len(cands)
    path = tuning.disk_cache(str(tmp_path)).path
    assert list(_json(path)["configs"]) == [repr(("fwd", False, "k"))]

    monkeypatch.setattr(tuning.TUNER, "picks", {})
    monkeypatch.setattr(tuning.TUNER, "disks", {})
    tuner.timed.clear()
    assert pick("fwd", ("k",), launch=tuner.launch, **ARGS) == cands[2]
    assert tuner.timed == []

    with settings.kernel_settings(tune=False):  # the first candidate, as in every process; the file untouched
        assert pick("fwd", ("j",), launch=tuner.launch, **ARGS) == cands[0]
    assert list(_json(path)["configs"]) == [repr(("fwd", False, "k"))]

    tuning.disk_cache(str(tmp_path)).put(("fwd", False, "stale"), Cfg(256, 256, 16, 9))
    assert pick("fwd", ("stale",), launch=tuner.launch, **ARGS) == cands[2]
    assert len(tuner.timed) == len(cands)


@pytest.mark.slow
def test_pretune_fills_the_disk_cache_for_a_later_process(monkeypatch, tmp_path):
    """attn_ops.pretune times every kernel of a forward + backward for a shape and stores the picks; a later
    process (empty memory caches) running another length of the same bucket times nothing."""
    import attn_ops

    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning.TUNER, "picks", {})
    monkeypatch.setattr(tuning.TUNER, "disks", {})
    monkeypatch.setattr(tuning, "identity", lambda device=None: IDENT)
    monkeypatch.setattr(tuning, "candidates", _small_candidates)
    monkeypatch.setattr(settings, "_current", settings.KernelSettings(tune=False, cache_dir=str(tmp_path)))
    timed = []
    monkeypatch.setattr(tuning, "measure", lambda fn, **kw: timed.append(fn()) or float(len(timed) % 3))
    with pytest.raises(ValueError, match="bias must be one of"):
        attn_ops.pretune([(1, 2, 2, 20, 16)], bias="shared")
    chosen = attn_ops.pretune([(1, 2, 2, 20, 16)], dtype=torch.float32)
    assert {k[0] for k in chosen} == {"fwd", "dkdv", "dq", "dbias"} and timed
    assert settings.get().tune is False  # pretune tuned inside its own settings block
    stored = _json(tuning.disk_cache(str(tmp_path)).path)["configs"]
    assert {eval(k)[0] for k in stored} == {"fwd", "dkdv", "dq", "dbias"}

    monkeypatch.setattr(tuning.TUNER, "picks", {})
    monkeypatch.setattr(tuning.TUNER, "disks", {})
    settings.update(tune=True)
    timed.clear()
    _run(24)
    assert timed == []


def _launch_keys(monkeypatch, R, Lq, Lk=20, transposed_mask=False):
    """(kernel, constexprs, Triton's specialisation of each runtime arg) of every launch of a forward + backward
    with a pair bias shared over R rows and a key mask: the key of Triton's compiled-kernel cache (warps and stages
    come from the config, the same here). Ints go through Triton's own specialisation function.
    ``transposed_mask``: the mask a view of ``[Lk, R]`` memory (key stride R, as the ending-node triangle
    attention's mask has a length there)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from attn_ops.triton import triton_attention

    keys = []
    real = launch_mod.launch_kernel

    def record(kernel, grid, args, num_warps, num_stages, **constexprs):
        dns = set(getattr(kernel, "kwargs", {}).get("do_not_specialize") or ())
        dnsoa = set(getattr(kernel, "kwargs", {}).get("do_not_specialize_on_alignment") or ())
        names = [p for p in kernel.arg_names if p not in constexprs]
        spec = tuple(native_specialize_impl(BaseBackend, a, False, n not in dns, n not in dnsoa)
                     if isinstance(a, (int, float)) else launch_mod._arg_key(a) for n, a in zip(names, args))
        keys.append((kernel.__name__, tuple(constexprs.items()), num_warps, num_stages, spec))
        return real(kernel, grid, args, num_warps, num_stages, **constexprs)

    monkeypatch.setattr(launch_mod, "launch_kernel", record)
    q, k, v, bias, mask = make_inputs((1, R), 2, Lq, Lk, 16, bias_shape=(1, 1, 2, Lq, Lk), mask_shape=(1, R, 1, 1, Lk),
                                      seed=R)
    if transposed_mask:
        mask = mask[0, :, 0, 0, :].t().contiguous().t()[None, :, None, None, :]
        assert mask.stride(-1) == R
    out, lse = triton_attention(q, k, v, bias, mask, 0.25, False)
    torch.autograd.grad(out.sum() + lse.masked_fill(lse.isinf(), 0).sum(), (q, k, v, bias))
    return keys


@pytest.mark.slow
def test_lengths_differing_mod_16_compile_nothing_new(monkeypatch):
    """Row counts and query lengths 16 / 20 / 29 and 2 / 3 / 16 (one tile either way in the interpreter's configs,
    so the EVEN flags agree): every kernel launch has the same Triton specialisation, i.e. the GPU would reuse the
    kernels compiled for the first shape. (There is no compile to count under the interpreter.)"""
    first = _launch_keys(monkeypatch, 2, 16)
    assert {k[0] for k in first} >= {"attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel",
                                     "attn_bwd_dbias_kernel", "bwd_preprocess_kernel", "sum_splits_kernel"}
    for R, Lq in ((3, 20), (16, 29)):
        monkeypatch.undo()
        assert _launch_keys(monkeypatch, R, Lq) == first, (R, Lq)


@pytest.mark.interpreter
def test_dbias_split_counts_compile_nothing_new():
    """The split sum's count follows the tile count (a multiple of 16 at some lengths): Triton specialises none of
    the counts, so a length whose count is 16, 32 or 48 reuses the compiled sum kernel."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from attn_ops.triton.dbias import sum_splits_kernel

    dns = set(sum_splits_kernel.kwargs.get("do_not_specialize") or ())
    assert "splits" in dns and "numel" in dns
    keys = {native_specialize_impl(BaseBackend, n, False, "splits" not in dns, True) for n in (3, 16, 32, 48)}
    assert len(keys) == 1


@pytest.mark.slow
def test_transposed_mask_key_strides_compile_nothing_new(monkeypatch):
    """A mask whose key stride is a length (the ending-node triangle attention's, a transposed pair mask): row
    counts 2 and 16 give the same Triton specialisation, so the one of 16 (a multiple of 16 there, like N=496 in
    the varlen run) compiles nothing new. A key stride of 1 stays specialised (the contiguous mask's loads)."""
    first = _launch_keys(monkeypatch, 2, 16, transposed_mask=True)
    monkeypatch.undo()
    assert _launch_keys(monkeypatch, 16, 16, transposed_mask=True) == first
    monkeypatch.undo()
    assert _launch_keys(monkeypatch, 2, 16) != first  # key stride 1: its own (faster) variant


def test_a_miss_compiles_every_candidate_at_once_before_timing(tuner, monkeypatch):
    """compile_threads > 1: each candidate goes through the launcher once in compile-only mode (inside Triton's
    asynchronous compile mode), a failing compile is left to the timing loop, and the timing launches for real."""
    from triton.runtime import _async_compile

    monkeypatch.setattr(settings, "_current", settings.KernelSettings(cache_dir=None, compile_threads=4))
    modes = []
    real = tuner.launch

    def launch(cfg):
        modes.append((cfg, tuning._WARMUP_ONLY.get(), _async_compile.active_mode.get() is not None))
        return real(cfg)

    cands = candidates("fwd", **ARGS)
    tuner.ms = {c: 1.0 + i for i, c in enumerate(cands)}
    tuner.fail = {cands[0]}
    assert pick("fwd", ("par",), launch=launch, **ARGS) == cands[1]
    n = len(cands)
    assert modes[:n] == [(c, True, True) for c in cands]  # all compiles submitted first
    assert [m[0] for m in modes[n:]] == cands and not any(m[1] or m[2] for m in modes[n:])  # then timed for real
    assert tuner.timed == cands[1:]
    assert tuning._WARMUP_ONLY.get() is False and _async_compile.active_mode.get() is None


def test_compile_only_launch_warms_up_and_runs_nothing(monkeypatch):
    calls = []

    class Kernel:
        def warmup(self, *args, grid, **kw):
            calls.append(("warmup", args, grid, kw))

        def __getitem__(self, grid):
            raise AssertionError("launched in compile-only mode")

    with tuning.compile_only():
        launch_mod.launch_kernel(Kernel(), (3,), (1, 2), 4, 2, BLOCK=16)
    assert calls == [("warmup", (1, 2), (3,), {"num_warps": 4, "num_stages": 2, "BLOCK": 16})]
    assert tuning._WARMUP_ONLY.get() is False



# ---------------------------------------------------------------------------------------------------------------
# shipped tables (attn_ops/triton/tuned/, scripts/ship_tuning.py)


def _ship(folder, name, gpu="Fake GPU", release="3.6", configs=None):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as fh:
        json.dump({"identity": {"gpu": gpu, "triton": release}, "measured": "test", "configs": configs or {}}, fh)


@pytest.fixture
def shipped_dir(tuner, tmp_path, monkeypatch):
    """An empty shipped-table folder, seen by pick() as that of a 'Fake GPU' with Triton 3.6.x."""
    folder = str(tmp_path / "tuned")
    monkeypatch.setattr(tuning, "SHIPPED_DIR", folder)
    monkeypatch.setattr(tuning.TUNER, "shipped", {})
    monkeypatch.setattr(tuning, "_gpu_and_triton", lambda device=None: ("Fake GPU", "3.6.2"))
    settings.update(shipped_configs=True)
    return folder, tuner


def test_pick_takes_the_shipped_config_without_timing(shipped_dir, tmp_path, monkeypatch):
    """A shipped config for this GPU model and Triton release is used as it is: nothing timed, nothing written to
    the disk cache; a later key that no table holds is timed as before."""
    folder, timer = shipped_dir
    cands = candidates("fwd", **ARGS)
    _ship(folder, "a.json", configs={repr(("fwd", False, "k")): list(cands[3])})
    monkeypatch.setattr(tuning, "identity", lambda device=None: IDENT)
    monkeypatch.setattr(tuning.TUNER, "disks", {})
    settings.update(cache_dir=str(tmp_path / "disk"))
    assert pick("fwd", ("k",), launch=timer.launch, **ARGS) == cands[3]
    assert timer.timed == [] and not os.path.exists(str(tmp_path / "disk"))
    pick("fwd", ("other",), launch=timer.launch, **ARGS)
    assert timer.timed == cands
    assert set(tuning.chosen()) == {("fwd", False, "k", True, True, None), ("fwd", False, "other", True, True, None)}


def test_shipped_configs_are_skipped_when_off_stale_or_foreign(shipped_dir):
    """Timed as before: a config no candidate list offers, a table of another GPU model or Triton release, and
    any key with ``shipped_configs`` off."""
    shipped_dir, timer = shipped_dir
    cands = candidates("fwd", **ARGS)
    timer.ms = {c: 1.0 for c in cands}
    timer.ms[cands[1]] = 0.5
    configs = {repr(("fwd", False, k)): list(cands[3]) for k in ("k", "off")}
    configs[repr(("fwd", False, "stale"))] = [256, 256, 16, 9, 1, 0]  # no candidate list offers it
    _ship(shipped_dir, "a.json", configs=configs)
    _ship(shipped_dir, "b.json", gpu="Other GPU", configs={repr(("fwd", False, "g")): list(cands[3])})
    _ship(shipped_dir, "c.json", release="3.5", configs={repr(("fwd", False, "r")): list(cands[3])})
    assert pick("fwd", ("k",), launch=timer.launch, **ARGS) == cands[3] and timer.timed == []
    for key in ("stale", "g", "r"):
        timer.timed.clear()
        assert pick("fwd", (key,), launch=timer.launch, **ARGS) == cands[1]
        assert timer.timed == cands, key
    timer.timed.clear()
    with settings.kernel_settings(shipped_configs=False):
        assert pick("fwd", ("off",), launch=timer.launch, **ARGS) == cands[1]
    assert timer.timed == cands


def test_unreadable_shipped_table_warns_and_is_skipped(shipped_dir):
    shipped_dir, _ = shipped_dir
    cands = candidates("fwd", **ARGS)
    _ship(shipped_dir, "good.json", configs={repr(("fwd", False, "k")): list(cands[2])})
    with open(os.path.join(shipped_dir, "bad.json"), "w") as fh:
        fh.write("{not json")
    with pytest.warns(RuntimeWarning, match="bad.json"):
        table = tuning.shipped()
    assert table == {repr(("fwd", False, "k")): cands[2]}
    assert tuning.shipped() is table  # read once


def test_ship_tuning_script_turns_a_cache_into_a_table_pick_uses(shipped_dir, tmp_path, monkeypatch):
    """A disk cache written by pick() on one machine, shipped by scripts/ship_tuning.py, serves a fresh process
    (empty memory caches, no disk cache) on the same GPU model with a later Triton patch release."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "ship_tuning", os.path.join(os.path.dirname(__file__), "..", "scripts", "ship_tuning.py"))
    ship = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship)
    shipped_dir, timer = shipped_dir

    monkeypatch.setattr(tuning, "identity", lambda device=None: dict(IDENT, gpu="Fake GPU", triton="3.6.0"))
    monkeypatch.setattr(tuning.TUNER, "disks", {})
    settings.update(cache_dir=str(tmp_path / "disk"))
    cands = candidates("fwd", **ARGS)
    timer.ms = {c: 1.0 for c in cands}
    timer.ms[cands[4]] = 0.5
    assert pick("fwd", ("k",), launch=timer.launch, **ARGS) == cands[4]
    out = os.path.join(shipped_dir, "fake.json")
    ship.main([str(tmp_path / "disk"), "--out", out, "--measured", "test"])
    assert _json(out)["identity"] == {"gpu": "Fake GPU", "triton": "3.6"}

    monkeypatch.setattr(tuning.TUNER, "picks", {})
    monkeypatch.setattr(tuning.TUNER, "shipped", {})
    settings.update(cache_dir=None)
    timer.timed.clear()
    assert pick("fwd", ("k",), launch=timer.launch, **ARGS) == cands[4] and timer.timed == []

    other = tmp_path / "other"  # a cache of another GPU model is refused, not mixed in
    _ship(str(other), "tuning-x.json", gpu="Other GPU", release="3.6.0")
    with pytest.raises(ValueError, match="Other GPU"):
        ship.merge([str(other / "tuning-x.json")], previous=_json(out))


def test_shipped_tables_in_the_package_are_well_formed():
    """Every table under attn_ops/triton/tuned/ names a GPU and a Triton release line, and each entry is a key
    pick() can make (kernel, pair, launcher key) with a config of the candidate lists' shape."""
    import ast

    names = [n for n in os.listdir(tuning.SHIPPED_DIR) if n.endswith(".json")]
    assert names
    for name in names:
        data = _json(os.path.join(tuning.SHIPPED_DIR, name))
        assert set(data["identity"]) == {"gpu", "triton"} and data["identity"]["triton"].count(".") == 1, name
        assert data["measured"] and data["configs"], name
        for key, cfg in data["configs"].items():
            parsed = ast.literal_eval(key)
            assert parsed[0] in ("fwd", "dkdv", "dq", "dbias") and isinstance(parsed[1], bool), key
            c = Cfg(*cfg)
            assert len(cfg) == len(Cfg._fields) and c.block_m >= 16 and c.block_n >= 16, key
            assert c.splits == 0 or (parsed[0] == "dbias" and c.splits in tuning._DBIAS_SPLITS), key


def test_source_hash_follows_kernels_and_candidates_not_the_rest(monkeypatch, tmp_path):
    """What a cached pick means: a changed kernel file or candidate list changes the hash (stale picks are
    dropped); a change elsewhere in tuning.py (compile threads, the cache code) keeps users' caches."""
    base = tuning.source_hash()
    assert "tuning.py" not in tuning._KERNEL_FILES
    monkeypatch.setitem(tuning._CANDIDATES, "fwd", tuning._CANDIDATES["fwd"][:1])
    assert tuning.source_hash() != base
    monkeypatch.undo()
    assert tuning.source_hash() == base
    monkeypatch.setattr(tuning, "DBIAS_PER_SM", tuning.DBIAS_PER_SM + 1)
    assert tuning.source_hash() != base
    monkeypatch.undo()
    here = os.path.dirname(tuning.__file__)
    for name in tuning._KERNEL_FILES:  # a copy of the kernel sources with one file changed
        text = open(os.path.join(here, name)).read()
        (tmp_path / name).write_text(text + ("\n# changed\n" if name == "forward.py" else ""))
    monkeypatch.setattr(tuning, "__file__", str(tmp_path / "tuning.py"))
    assert tuning.source_hash() != base
