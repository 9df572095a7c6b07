"""Triton compiles done in worker processes: a tuning miss's candidates, and ``compile_ahead(processes=N)``'s jobs.

Part of every Triton compile holds the GIL (its Python front end and more), so compile threads overlap only partly
on a many-core host (docs/bench/varlen_h100.md); worker processes are not bound by it. Here the launches run
compile-only in this process while Triton's ``jit_cache_hook`` captures each compile's specialization and skips it
(unless Triton's cache already holds the binary: :func:`cached`, then it loads here); worker processes compile them
(``JITFunction.preload``) into Triton's on-disk cache, and the launches that follow load the binaries from there.

Workers are plain subprocesses (``python -c``, so a user's script is never re-imported as with multiprocessing's
spawn), one per thread of a small pool, started at the first job and kept until :func:`shutdown` (which
``compile_ahead`` calls at its end unless ``settings.compile_processes`` keeps them for tuning misses) or the
process's exit. They never touch a GPU: Triton's driver there is a stand-in that reports this process's compile
target. Anything that fails leaves the compile to this process, as without workers (one warning says why). Off by
default (``settings.compile_processes`` 0): worker processes did not beat 8 threads on the H100 host measured
(docs/bench/varlen_h100.md, docs/bench/history.md).
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import importlib
import json
import os
import select
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from . import tuning
from .tuning import compile_only

# set while candidates are captured (in the tuning thread only): the hook appends (module, name, spec) and skips
_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("attn_zoo_precompile_capture", default=None)
_HOOK_LOCK = threading.Lock()
_HOOK_USERS = 0  # captures in progress (the hook is installed only while one is)
_PREVIOUS_HOOK = None  # the jit_cache_hook installed before ours, restored when the last capture ends
_POOL: Optional[ThreadPoolExecutor] = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()  # each pool thread's worker process
_PROCS: List[subprocess.Popen] = []
_PROCS_LOCK = threading.Lock()
_WARNED = False
_REPLY_TIMEOUT_S = 600.0  # a worker that has not answered a compile by then is killed (the parent compiles it)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds attn_ops/
COUNTS = {"compiled": 0, "failed": 0}  # worker compiles in this process's life


def _hook(**kw):
    sink = _CAPTURE.get()
    if sink is None:  # another thread's compile during a capture: as if our hook were not there
        return _PREVIOUS_HOOK(**kw) if _PREVIOUS_HOOK is not None else None
    if cached(kw):
        return None  # only a load from Triton's cache: done here (milliseconds; no worker need start)
    fn = kw["fn"]
    sink.append((fn.module, fn.name, kw["compile"]["specialization_data"]))
    return True  # compiled by a worker, not here


def cached(hook_kw: dict) -> bool:
    """Whether Triton's on-disk cache holds the binary of the compile that ``jit_cache_hook`` was called with
    (``hook_kw``): the lookup ``triton.compile`` makes (its key from the kernel source, the backend, the options as
    ``JITFunction.preload`` rebuilds them from the specialization data, and the environment). False where it cannot
    tell (another Triton's internals): the compile then goes to a worker, which finds the binary itself."""
    try:
        import hashlib

        from triton import knobs
        from triton.runtime.cache import get_cache_key, get_cache_manager
        from triton.runtime.jit import get_cache_invalidating_env_vars

        if getattr(knobs.compilation, "always_compile", False) or \
                getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None:
            return False  # triton.compile would compile anyway
        fn, spec = hook_kw["fn"].jit_function, hook_kw["compile"]
        backend = fn.device_caches[spec["device"]][3]
        options = {k: tuple(v) if isinstance(v, list) else v
                   for k, v in json.loads(spec["specialization_data"])["options"].items()}
        src = fn.ASTSource(fn, spec["signature"], spec["constants"], spec["configs"][0])
        options = backend.parse_options(dict(backend.parse_options(options).__dict__, **src.parse_options()))
        key = get_cache_key(src, backend, options, get_cache_invalidating_env_vars())
        name = f"{src.name[:150]}.json"
        group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name)
        return bool(group) and name in group
    except Exception:  # noqa: BLE001 - not knowing costs only a worker's time
        return False


def supported() -> bool:
    """Whether this Triton has ``knobs.runtime.jit_cache_hook`` and ``JITFunction.preload``."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - Triton before its knobs
        return False
    return hasattr(JITFunction, "preload") and hasattr(knobs.runtime, "jit_cache_hook")


@contextlib.contextmanager
def _hook_installed() -> Iterator[None]:
    """Our hook in ``triton.knobs.runtime.jit_cache_hook`` for the block only (counted across threads), the
    previous one back after it: a hook makes Triton serialise every compile's specialization, which some
    kernels' constexprs do not survive, so it must not stay for unrelated compiles."""
    global _HOOK_USERS, _PREVIOUS_HOOK
    from triton import knobs

    with _HOOK_LOCK:
        if _HOOK_USERS == 0:
            _PREVIOUS_HOOK = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = _hook
        _HOOK_USERS += 1
    try:
        yield
    finally:
        with _HOOK_LOCK:
            _HOOK_USERS -= 1
            if _HOOK_USERS == 0:
                if knobs.runtime.jit_cache_hook is _hook:
                    knobs.runtime.jit_cache_hook = _PREVIOUS_HOOK
                _PREVIOUS_HOOK = None


def capture(cands: Sequence, launch: Callable) -> List[Tuple[str, str, str]]:
    """(module, kernel name, specialization data) of every compile that ``launch(c)`` for the candidates would do
    here, in order, without compiling (compile-only launches; kernels already compiled in this process capture
    nothing). A candidate whose launch raises is left out (the timing loop skips it)."""
    sink: List[Tuple[str, str, str]] = []
    token = _CAPTURE.set(sink)
    try:
        with _hook_installed(), compile_only():
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
    this Triton cannot or every job failed (the caller compiles in threads instead; it does so too if this raises,
    e.g. where no subprocess may start)."""
    if processes < 1 or not supported():
        return False
    jobs = capture(cands, launch)
    return not jobs or run_jobs(jobs, processes) < len(jobs)


def _setup() -> Tuple[list, str, Tuple]:
    """What a worker must share with this process: the compile target, Triton's cache folder and the
    environment variables that enter Triton's cache key."""
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import get_cache_invalidating_env_vars

    target = driver.active.get_current_target()
    env = tuple(sorted((k, str(v)) for k, v in get_cache_invalidating_env_vars().items()))
    return [target.backend, target.arch, target.warp_size], str(knobs.cache.dir), env


def run_jobs(jobs: Sequence[Tuple[str, str, str]], processes: int) -> int:
    """Compile each (module, name, spec) in a worker; returns how many failed (warned once per process)."""
    global _POOL, _POOL_SIZE, _WARNED
    setup = _setup()
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE != processes:
            if _POOL is not None:  # its threads' workers go with it
                _POOL.shutdown(wait=True)
                _stop_all()
            _POOL, _POOL_SIZE = ThreadPoolExecutor(processes, thread_name_prefix="attn_zoo_compile"), processes
        futures = [_POOL.submit(_job, job, setup) for job in jobs]
    errors = []
    try:
        for f in futures:
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001 - the timing launch compiles it here
                errors.append(exc)
    except BaseException:  # interrupted: drop what has not started
        for f in futures:
            f.cancel()
        raise
    with _POOL_LOCK:
        COUNTS["compiled"] += len(futures) - len(errors)
        COUNTS["failed"] += len(errors)
    if errors and not _WARNED:
        _WARNED = True
        warnings.warn(f"attn_ops: {len(errors)} of {len(futures)} candidate compiles failed in worker processes "
                      f"(compiled in this process instead; settings.compile_processes=0 skips the workers): "
                      f"{errors[0]}", RuntimeWarning, stacklevel=2)
    return len(errors)


def _job(job: Tuple[str, str, str], setup: Tuple) -> None:
    proc = getattr(_LOCAL, "proc", None)
    if proc is None or proc.poll() is not None or proc.attn_zoo_setup != setup:
        if proc is not None:
            _stop(proc)
        proc = _LOCAL.proc = _start(setup)
    try:
        proc.stdin.write(json.dumps(list(job)) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], _REPLY_TIMEOUT_S)
        line = proc.stdout.readline() if ready else None
    except (OSError, ValueError) as exc:
        _stop(proc)
        raise RuntimeError(f"compile worker failed: {exc}") from exc
    if line is None:
        _stop(proc)
        raise RuntimeError(f"compile worker gave no answer in {_REPLY_TIMEOUT_S:.0f} s")
    if not line:
        _stop(proc)
        raise RuntimeError(f"compile worker exited (code {proc.poll()})")
    error = json.loads(line)
    if error:
        raise RuntimeError(f"{job[1]}: {error}")


# The worker's first lines move stdout aside before anything is imported: replies go to a private copy of it,
# and whatever an import or a compile prints goes to stderr.
_BOOT = ("import os, sys; out = os.dup(1); os.dup2(2, 1); "
         "from attn_ops.triton.precompile import serve; serve(out)")


def _start(setup: Tuple) -> subprocess.Popen:
    target, cache_dir, triton_env = setup
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.update(triton_env)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the workers compile only
    env["TRITON_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(target)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    proc.attn_zoo_setup = setup
    with _PROCS_LOCK:
        _PROCS.append(proc)
    return proc


def _stop(*procs: subprocess.Popen) -> None:
    """Stop these workers: all are told at once (their stdin closes), then each is waited for (killed after 5 s in
    all), so the interpreters exit side by side rather than one after another."""
    import time

    for proc in procs:
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except Exception:  # noqa: BLE001 - a broken pipe is already closed enough
                pass
    deadline = time.monotonic() + 5
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a worker that will not stop is killed
            proc.kill()
            proc.wait()
    with _PROCS_LOCK:
        for proc in procs:
            if proc in _PROCS:
                _PROCS.remove(proc)


def _stop_all() -> None:
    """Stop every worker this process started (:func:`_stop`)."""
    with _PROCS_LOCK:
        procs = list(_PROCS)
    _stop(*procs)


def shutdown() -> None:
    """Stop the worker processes and their pool (the next job starts new ones)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        pool, _POOL, _POOL_SIZE = _POOL, None, 0
    if pool is not None:
        pool.shutdown(wait=True)
    _stop_all()


atexit.register(_stop_all)


class CompileOnlyDriver:
    """A stand-in for Triton's active driver that compiles for ``target`` (a ``GPUTarget``) and has no GPU: the
    workers' (with the parent's target) and ``scripts/compile_cost.py``'s (cross-compiling on any machine)."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def serve(reply_fd: int) -> None:
    """A worker's loop: a JSON line [module, kernel name, specialization data] in, a JSON line out ("" or the
    error) on ``reply_fd`` (the process's stdout, moved aside by ``_BOOT``)."""
    out = os.fdopen(reply_fd, "w")
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    driver.set_active(CompileOnlyDriver(GPUTarget(*json.loads(sys.argv[1]))))
    for line in sys.stdin:
        try:
            module, name, spec = json.loads(line)
            getattr(importlib.import_module(module), name).preload(spec)
            reply = ""
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which compiles it itself
            reply = f"{type(exc).__name__}: {exc}"
        out.write(json.dumps(reply) + "\n")
        out.flush()


tuning.TUNER.workers = sys.modules[__name__]  # the tuner's worker-process compiler (it cannot import this module)
