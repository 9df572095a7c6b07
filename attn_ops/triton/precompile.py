"""A tuning miss's candidate compiles, done in worker processes.

Part of every Triton compile holds the GIL (its Python front end and more), so the tuner's compile threads overlap
only partly on a many-core host (docs/bench/varlen_h100.md); worker processes are not bound by it. Here the
candidates' launches run compile-only in this process while Triton's ``jit_cache_hook`` captures each compile's
specialization and skips it; worker processes compile them (``JITFunction.preload``) into Triton's on-disk cache,
and the timing launches that follow load the binaries from there.

Workers are plain subprocesses (``python -c``, so a user's script is never re-imported as with multiprocessing's
spawn), one per thread of a small pool, started at the first miss and kept for the process's life. They never
touch a GPU: Triton's driver there is a stand-in that reports this process's compile target. Anything that fails
leaves the compile to the timing launch, as without workers (one warning says why). Off by default
(``settings.compile_processes`` 0) until measured on a GPU host.
"""
from __future__ import annotations

import atexit
import contextvars
import importlib
import json
import os
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

# set while candidates are captured (in the tuning thread only): the hook appends (module, name, spec) and skips
_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("attn_zoo_precompile_capture", default=None)
_PREVIOUS_HOOK = None  # whatever jit_cache_hook was installed before ours (called when not capturing)
_POOL: Optional[ThreadPoolExecutor] = None
_POOL_SIZE = 0
_LOCAL = threading.local()  # each pool thread's worker process
_PROCS: List[subprocess.Popen] = []
_LOCK = threading.Lock()
_WARNED = False
COUNTS = {"compiled": 0, "failed": 0}  # worker compiles in this process's life
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds attn_ops/


def _hook(**kw):
    sink = _CAPTURE.get()
    if sink is None:
        return _PREVIOUS_HOOK(**kw) if _PREVIOUS_HOOK is not None else None
    fn = kw["fn"]
    sink.append((fn.module, fn.name, kw["compile"]["specialization_data"]))
    return True  # compiled by a worker, not here


def _install_hook() -> bool:
    """Our hook in ``triton.knobs.runtime.jit_cache_hook`` (chaining one installed before); False where Triton has
    no such hook or no ``JITFunction.preload`` (then the tuner compiles in threads)."""
    global _PREVIOUS_HOOK
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - Triton before its knobs
        return False
    if not hasattr(JITFunction, "preload") or not hasattr(knobs.runtime, "jit_cache_hook"):
        return False  # pragma: no cover - older Triton
    current = knobs.runtime.jit_cache_hook
    if current is not _hook:
        _PREVIOUS_HOOK = current
        knobs.runtime.jit_cache_hook = _hook
    return True


def capture(cands: Sequence, launch: Callable) -> List[Tuple[str, str, str]]:
    """(module, kernel name, specialization data) of every compile that ``launch(c)`` for the candidates would do
    here, in order, without compiling (compile-only launches; kernels already compiled in this process capture
    nothing). A candidate whose launch raises is left out (the timing loop skips it)."""
    from .fastlaunch import compile_only

    sink: List[Tuple[str, str, str]] = []
    token = _CAPTURE.set(sink)
    try:
        with compile_only():
            for c in cands:
                try:
                    launch(c)
                except Exception:  # noqa: BLE001 - reported when the candidate is timed
                    pass
    finally:
        _CAPTURE.reset(token)
    return list(dict.fromkeys(sink))


def compile_candidates(cands: Sequence, launch: Callable, processes: int) -> bool:
    """Compile what the candidates' launches need in ``processes`` workers; returns when all are done. False where
    this Triton cannot (the caller compiles in threads instead)."""
    if processes < 1 or not _install_hook():
        return False
    jobs = capture(cands, launch)
    if jobs:
        run_jobs(jobs, processes)
    return True


def _target_and_cache() -> Tuple[list, str]:
    from triton import knobs
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return [target.backend, target.arch, target.warp_size], str(knobs.cache.dir)


def run_jobs(jobs: Iterable[Tuple[str, str, str]], processes: int) -> int:
    """Compile each (module, name, spec) in a worker; returns how many failed (warned once per process)."""
    global _POOL, _POOL_SIZE, _WARNED
    target, cache_dir = _target_and_cache()
    with _LOCK:
        if _POOL is None or _POOL_SIZE != processes:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL, _POOL_SIZE = ThreadPoolExecutor(processes, thread_name_prefix="attn_zoo_compile"), processes
        pool = _POOL
    futures = [pool.submit(_job, job, target, cache_dir) for job in jobs]
    errors = []
    for f in futures:
        try:
            f.result()
        except Exception as exc:  # noqa: BLE001 - the timing launch compiles it here
            errors.append(exc)
    COUNTS["compiled"] += len(futures) - len(errors)
    COUNTS["failed"] += len(errors)
    if errors and not _WARNED:
        _WARNED = True
        warnings.warn(f"attn_ops: {len(errors)} of {len(futures)} candidate compiles failed in worker processes "
                      f"(compiled in this process instead; settings.compile_processes=0 skips the workers): "
                      f"{errors[0]}", RuntimeWarning, stacklevel=2)
    return len(errors)


def _job(job: Tuple[str, str, str], target: list, cache_dir: str) -> None:
    proc = getattr(_LOCAL, "proc", None)
    if proc is None or proc.poll() is not None or proc.attn_zoo_setup != (target, cache_dir):
        if proc is not None:
            _stop(proc)
        proc = _LOCAL.proc = _start(target, cache_dir)
    try:
        proc.stdin.write(json.dumps(list(job)) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
    except OSError as exc:
        raise RuntimeError(f"compile worker failed: {exc}") from exc
    if not line:
        raise RuntimeError(f"compile worker exited (code {proc.poll()})")
    error = json.loads(line)
    if error:
        raise RuntimeError(f"{job[1]}: {error}")


def _start(target: list, cache_dir: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the workers compile only
    env["TRITON_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    code = "from attn_ops.triton.precompile import serve; serve()"
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(target)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    proc.attn_zoo_setup = (target, cache_dir)
    with _LOCK:
        _PROCS.append(proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=5)
    except Exception:  # noqa: BLE001 - a worker that will not stop is killed
        proc.kill()


@atexit.register
def _shutdown() -> None:
    for proc in list(_PROCS):
        if proc.poll() is None:
            _stop(proc)


class _TargetDriver:
    """Triton's driver in a worker: the parent's compile target, no GPU."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def serve() -> None:
    """A worker's loop: a JSON line [module, kernel name, specialization data] in, a JSON line out ("" or the
    error). Replies go to a private copy of stdout; anything printed goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    driver.set_active(_TargetDriver(GPUTarget(*json.loads(sys.argv[1]))))
    for line in sys.stdin:
        try:
            module, name, spec = json.loads(line)
            getattr(importlib.import_module(module), name).preload(spec)
            reply = ""
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which compiles it itself
            reply = f"{type(exc).__name__}: {exc}"
        out.write(json.dumps(reply) + "\n")
        out.flush()
