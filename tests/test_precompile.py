"""Candidate compiles in worker processes (attn_ops/triton/precompile.py), with real Triton compiles: the kernels
cross-compile for sm_90 on any machine (scripts/compile_cost.py's stand-in driver), in a fresh process without
TRITON_INTERPRET (the CPU suite's kernels are interpreted functions, which compile nothing)."""
import os
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("triton")

from helpers import have_cuda_compiler  # noqa: E402

from attn_ops.triton import precompile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


needs_ptxas = pytest.mark.skipif(not have_cuda_compiler(), reason="Triton without its CUDA backend (ptxas)")


def _compile_cost(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "compile_cost.py"), *args]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {int(c[0]): c for c in ([x.strip() for x in line.strip("|").split("|")] for line in res.stdout.splitlines())
            if c[0].isdigit()}
    tail = res.stdout.split("binaries in Triton's cache:")[1]
    numbers = dict(binaries=int(tail.split(";")[0]), jobs=int(tail.split("worker jobs:")[1].split(",")[0]),
                   written=int(tail.split("binaries they wrote:")[1].split(",")[0]),
                   failed=int(tail.split("failed there:")[1].split(";")[0]),
                   workers_left=int(tail.split("workers left:")[1].split()[0]))
    return rows, numbers, res.stdout


@pytest.mark.slow
@needs_ptxas
def test_workers_compile_what_this_process_then_loads():
    """A tuned fwd + bwd (every candidate of each key) with two worker processes: each job writes one binary into
    this process's Triton cache before anything here loads it; the same compiles are counted here as without
    workers, and the cache ends with one binary per compile, i.e. this process loaded the workers' binaries (under
    another cache key it would compile again and the cache would hold twice as many)."""
    rows, n, out = _compile_cost("--lengths", "40", "--kinds", "triangle", "--threads", "1", "--processes", "2")
    compiles = int(rows[40][1])
    assert compiles > 6, out  # more than one candidate per kernel were compiled
    # the tuned keys' candidates went to the workers (kernels with a single candidate at this length compile here)
    assert n["failed"] == 0 and compiles > n["jobs"] >= compiles // 2 and n["written"] == n["jobs"], out
    assert n["binaries"] == compiles, out
    rows0, n0, out0 = _compile_cost("--lengths", "40", "--kinds", "triangle", "--threads", "2")
    assert n0["jobs"] == 0 and n0["binaries"] == n["binaries"], out0
    assert rows0[40][1] == rows[40][1] and rows0[40][3] == rows[40][3], (out0, out)


def test_a_failing_worker_compile_warns_once_and_is_counted(monkeypatch, tmp_path):
    """A job the worker cannot do (here: an unknown module) comes back as a failure, with one warning naming the
    setting that skips the workers; the next failure does not warn again."""
    monkeypatch.setattr(precompile, "_setup", lambda: (["cuda", 90, 32], str(tmp_path), ()))
    monkeypatch.setattr(precompile, "_WARNED", False)
    with pytest.warns(RuntimeWarning, match="compile_processes=0"):
        assert precompile.run_jobs([("attn_zoo_no_such_module", "kernel", "{}")], 1) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precompile.run_jobs([("attn_zoo_no_such_module", "kernel", "{}")], 1) == 1


def test_the_hook_is_installed_only_while_capturing():
    """Outside a capture Triton's jit_cache_hook is whatever it was (a hook makes Triton serialise every compile's
    specialization, which some user kernels' constexprs do not survive); nested captures restore it once."""
    from triton import knobs

    def theirs(**kw):
        return None

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = theirs
    try:
        seen = []
        with precompile._hook_installed():
            seen.append(knobs.runtime.jit_cache_hook)
            with precompile._hook_installed():
                seen.append(knobs.runtime.jit_cache_hook)
            seen.append(knobs.runtime.jit_cache_hook)
        assert seen == [precompile._hook] * 3 and knobs.runtime.jit_cache_hook is theirs
        assert precompile.capture([1, 2], lambda c: None) == [] and knobs.runtime.jit_cache_hook is theirs
    finally:
        knobs.runtime.jit_cache_hook = before


@pytest.mark.slow
@needs_ptxas
def test_compile_ahead_compiles_what_a_run_then_needs():
    """Steps under ``attn_ops.compile_ahead()`` (sm_90 cross-compiles, on threads) compile at least what the plain
    steps compile (those leave a tile-multiple length's variant to a background compile, still pending when the
    row is counted; compile_ahead asks for it at once), and the same steps run after it compile nothing."""
    def tables(out):
        got, which = {}, "plain"
        for line in out.splitlines():
            if line.endswith("compile_ahead():"):
                which = line.split()[0]
            elif line.startswith("| all |"):
                got[which] = int(line.split("|")[2])
        return got

    # (64: a tile multiple; untuned: one config per kernel, the tuned path is the worker test's below)
    args = ("--lengths", "40,64", "--kinds", "triangle", "--threads", "2", "--no-tune")
    _, _, plain = _compile_cost(*args)
    _, _, ahead = _compile_cost(*args, "--ahead")
    p, a = tables(plain), tables(ahead)
    assert p["plain"] >= 8 and p["plain"] <= a["ahead"] <= p["plain"] + 2 and a["after"] == 0, (plain, ahead)


@pytest.mark.slow
@needs_ptxas
def test_compile_ahead_in_worker_processes_then_a_warm_cache_needs_none(tmp_path):
    """``compile_ahead`` with worker processes: every compile it asks for is a worker's job (none fails), this
    process then loads each binary the workers wrote (one binary per compile in the cache: a compile here under
    another key would add a second), the same steps compile nothing after the block, and the workers are stopped
    at its end (``settings.compile_processes`` is 0 outside it). A second run on that Triton cache finds every
    compile there (``precompile.cached``): it loads them in this process and gives no worker a job, under
    ``compile_ahead`` and for a tuning miss's candidates alike."""
    base = ("--lengths", "40", "--kinds", "triangle", "--threads", "2", "--triton-cache", str(tmp_path / "triton"))
    rows, n, out = _compile_cost(*base, "--ahead", "--ahead-processes", "2")
    ahead = next(int(line.split("|")[2]) for line in out.splitlines() if line.startswith("| all |"))
    assert ahead > 6 and n["failed"] == 0 and n["jobs"] == ahead and n["written"] == ahead, out
    assert n["binaries"] == ahead and int(rows[40][1]) == 0, out  # (the "after" row: nothing left to compile)
    assert n["workers_left"] == 0, out
    _, again, out2 = _compile_cost(*base, "--processes", "2", "--ahead")
    assert again["jobs"] == 0 and again["binaries"] == n["binaries"], (out, out2)
    _, tuned, out3 = _compile_cost(*base, "--processes", "2")  # tuning misses alone (no compile_ahead)
    assert tuned["jobs"] == 0 and tuned["binaries"] == n["binaries"], (out, out3)
