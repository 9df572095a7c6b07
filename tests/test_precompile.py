"""Candidate compiles in worker processes (attn_ops/triton/precompile.py), with real Triton compiles: the kernels
cross-compile for sm_90 on any machine (scripts/compile_cost.py's stand-in driver), in a fresh process without
TRITON_INTERPRET (the CPU suite's kernels are interpreted functions, which compile nothing)."""
import os
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("triton")

from attn_ops.triton import precompile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _have_cuda_compiler() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas"))


needs_ptxas = pytest.mark.skipif(not _have_cuda_compiler(), reason="Triton without its CUDA backend (ptxas)")


def _compile_cost(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "compile_cost.py"), *args]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {int(c[0]): c for c in ([x.strip() for x in line.strip("|").split("|")] for line in res.stdout.splitlines())
            if c[0].isdigit()}
    tail = res.stdout.split("binaries in Triton's cache:")[1]
    binaries = int(tail.split(";")[0])
    workers = int(tail.split("compiled in worker processes:")[1].split(",")[0])
    failed = int(tail.split("failed there:")[1].split()[0])
    return rows, binaries, workers, failed, res.stdout


@needs_ptxas
def test_workers_compile_what_this_process_then_loads():
    """A tuned fwd + bwd (every candidate of each key) with two worker processes: the same compiles are counted in
    this process as without workers, and Triton's cache holds one binary per compile, i.e. the binaries the
    workers wrote are the ones this process asked for (a worker compiling under another cache key would leave this
    process to compile again and the cache with twice as many)."""
    rows, binaries, workers, failed, out = _compile_cost("--lengths", "40", "--kinds", "triangle", "--threads", "1",
                                                         "--processes", "2")
    compiles = int(rows[40][1])
    assert compiles > 6, out  # more than one candidate per kernel were compiled
    # the tuned keys' candidates went to the workers (kernels with a single candidate at this length compile here)
    assert failed == 0 and compiles > workers >= compiles // 2, out
    assert binaries == compiles, out
    rows0, binaries0, workers0, _, out0 = _compile_cost("--lengths", "40", "--kinds", "triangle", "--threads", "1")
    assert workers0 == 0 and binaries0 == binaries, out0
    assert rows0[40][1] == rows[40][1] and rows0[40][3] == rows[40][3], (out0, out)


def test_a_failing_worker_compile_warns_once_and_is_counted(monkeypatch, tmp_path):
    """A job the worker cannot do (here: an unknown module) comes back as a failure, with one warning naming the
    setting that skips the workers; the next failure does not warn again."""
    monkeypatch.setattr(precompile, "_target_and_cache", lambda: (["cuda", 90, 32], str(tmp_path)))
    monkeypatch.setattr(precompile, "_WARNED", False)
    with pytest.warns(RuntimeWarning, match="compile_processes=0"):
        assert precompile.run_jobs([("attn_zoo_no_such_module", "kernel", "{}")], 1) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precompile.run_jobs([("attn_zoo_no_such_module", "kernel", "{}")], 1) == 1
