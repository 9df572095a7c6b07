"""Kernel launches that skip Triton's per-call argument binding once a launch signature has been seen.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument on each call (a native specialisation
call per argument: a few times the cost of the launch itself for the ~45 arguments of these kernels), and a small
shape's step is bound by such host time. :func:`launch` keeps the compiled kernel Triton returned for a launch
signature and calls it directly the next time; :func:`bound` hands a launch plan (``launch.py``) that direct call
with the fixed arguments already in place.

The signature holds everything Triton specialises on: the constexprs, warps and stages, the value of every scalar
argument and each tensor argument's dtype and 16-byte alignment; and the current device, since a compiled
kernel's handle is loaded for the device it was launched on. Integer scalars count as Triton sees them: their
type (int32/int64) and, unless the kernel marks them ``do_not_specialize``, whether they equal 1 and (unless marked
``do_not_specialize_on_alignment``) whether they divide by 16, not their value (so a new sequence length reuses
the entry). A new signature goes through Triton's own path again (which finds its cached binary) and is
remembered too.

The direct call passes the arguments in the kernel's parameter order, constexprs included, as Triton's own
``JITFunction.run`` does in 3.x; kernels whose constexprs are not the trailing parameters, the CPU interpreter
(``TRITON_INTERPRET=1``) and Triton versions whose launch does not return a compiled kernel take the plain path.
``settings.fast_launch`` False (``attn_ops.settings.update(fast_launch=False)``) forces the plain path (for
comparison).
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from .. import settings as _settings
from ..settings import interpreting
from . import precompile
from .precompile import _WARMUP_ONLY
from .tuning import TUNER

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

class LaunchState:
    """The launch layer's caches, one instance (:data:`STATE`); ``reset()`` empties them. Lookups take no lock (a
    single dict get or set is atomic under the GIL, and the fast path's host time counts); ``lock`` guards only
    evictions, clearing and ``reset``."""

    __slots__ = ("compiled", "exact", "exact_max", "params", "plans", "plans_max", "devices", "tma_min_scores",
                 "tables", "lock")

    def __init__(self):
        self.compiled: Dict[Tuple, object] = {}  # signature key -> compiled kernel
        # exact argument values -> compiled kernel: a hit skips the per-argument specialisation work (ints hash in
        # C); a miss falls back to the signature key, so a new length still finds its compiled kernel
        self.exact: Dict[Tuple, object] = {}
        self.exact_max = 4096
        # kernel -> (number of leading non-constexpr params, -1: not trailing; per param how Triton specialises it)
        self.params: Dict[object, Tuple[int, Tuple[int, ...]]] = {}
        self.plans: Dict[Tuple, object] = {}  # launch plans by call key (launch.py)
        self.plans_max = 1024  # geometries kept; past it the oldest plan goes
        self.devices: Dict[int, Tuple[int, int]] = {}  # CUDA device index -> (compute capability major, SM count)
        # Below this many attention scores per launch (B*R*H*Lq*Lk; 2**29 is the triangle [1,512,4,512,*]) the bias
        # is read by pointer loads, not TMA: Triton encodes a descriptor on the host at every launch, which costs
        # such a step more host time than its kernels save (docs/bench/history.md, "Design measurements").
        self.tma_min_scores = 2 ** 29
        self.tables: list = []  # segment tables: (key, weak refs to the ids' base tensors, flat tables), newest first
        self.lock = threading.Lock()

    def reset(self) -> None:
        """Forget every compiled kernel, plan, device fact and segment table; the TMA threshold back to its
        default."""
        with self.lock:
            for cache in (self.compiled, self.exact, self.params, self.plans, self.devices, self.tables):
                cache.clear()
            self.tma_min_scores = 2 ** 29


STATE = LaunchState()


def _params(kernel) -> Tuple[int, Tuple[int, ...]]:
    """(the number of ``kernel``'s leading non-constexpr params, -1 where a constexpr lies between runtime params: the
    plain path; per param how Triton specialises an int's value: 2 (== 1 and divisibility by 16), 1 (== 1 only:
    ``do_not_specialize_on_alignment``) or 0 (``do_not_specialize``))."""
    known = STATE.params.get(kernel)
    if known is None:
        params = getattr(kernel, "params", ())
        flags = [bool(getattr(p, "is_constexpr", False)) for p in params]
        n = flags.index(True) if True in flags else len(flags)
        if not flags or any(not f for f in flags[n:]):
            n = -1
        known = STATE.params[kernel] = (n, tuple(
            0 if getattr(p, "do_not_specialize", False) else 1 if getattr(p, "do_not_specialize_on_alignment", False)
            else 2 for p in params))
    return known


def _arg_key(a, specialize: int = 2):
    if type(a) is int:
        # int32 / int64 always; the value only through Triton's specialisations (== 1, divisible by 16)
        wide = not -0x80000000 <= a <= 0x7FFFFFFF
        if specialize is True or specialize == 2:
            return int, wide, a == 1, a % 16 == 0
        return (int, wide, a == 1) if specialize else (int, wide)
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if TensorDescriptor is not None and isinstance(a, TensorDescriptor):
        # specialised on the base's dtype and the block shape; shape and strides are runtime values of the
        # descriptor that Triton's launcher encodes on every call
        return TensorDescriptor, a.base.dtype, tuple(a.block_shape), a.padding
    if type(a) is float:
        return (float,)  # fp32, never specialised on its value
    return type(a), a


def signature(args: Sequence, specialize: Sequence[int] = ()) -> Tuple:
    """What Triton specialises a launch on, from the runtime arguments: each tensor's dtype and whether its data
    pointer is 16-byte aligned; a tensor descriptor's dtype and block shape; an int's width (int32 / int64) and, as
    ``specialize[i]`` says (:func:`_params`; default 2, True and False read as 2 and 0), whether it is 1 and
    whether it divides by 16; other scalars with their type and value (the type keeps True, 1 and 1.0 apart, which
    compare equal in Python)."""
    n = len(specialize)
    return tuple(_arg_key(a, specialize[i] if i < n else 2) for i, a in enumerate(args))


def _device() -> int:
    """The device Triton launches on (its current CUDA device)."""
    return torch.cuda.current_device()


@contextlib.contextmanager
def compile_ahead(threads: Optional[int] = None, processes: Optional[int] = None) -> Iterator[None]:
    """Inside the block every kernel launch (this module's :func:`launch`, in any thread) runs nothing: a kernel not
    compiled yet is compiled on one of ``threads`` threads (default ``settings.compile_threads``), all at once, or,
    with ``processes`` > 0 (default ``settings.compile_processes``), in that many worker processes
    (``precompile.py``: not bound by the GIL; this process then loads each binary from Triton's cache). The block
    ends when every compile has. Outputs of the calls inside are garbage: run throwaway steps there (one
    per input shape a run will meet) so the run itself compiles nothing. A tuning miss inside submits every
    candidate's compile and times nothing (the real call times them). A no-op on the CPU interpreter and with
    ``settings.fast_launch`` off (Triton compiles where it launches). Not during a CUDA graph capture (the graph
    would lack the kernels): RuntimeError."""
    if not background_compiles():
        yield
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("compile_ahead() during a CUDA graph capture: the graph would hold no kernel launches")
    if TUNER.ahead is not None:
        raise RuntimeError("compile_ahead() is already active")
    s = _settings.get()
    processes = s.compile_processes if processes is None else processes
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
        raise ValueError(f"compile_ahead: processes must be an int >= 0, got {processes!r}")
    if processes and not precompile._supported():
        processes = 0  # this Triton cannot hand compiles to workers: threads
    # (with workers, each thread waits on one worker's compile and then loads its binary here)
    pool = ThreadPoolExecutor(processes or threads or s.compile_threads, thread_name_prefix="attn_zoo_ahead")
    jobs: Dict[Tuple, object] = {}
    with TUNER.lock:
        TUNER.ahead = (pool, jobs, processes)
    try:
        yield
    finally:
        with TUNER.lock:
            TUNER.ahead = None
        wait(list(jobs.values()))
        pool.shutdown()
        if processes and not _settings.get().compile_processes:
            precompile.shutdown()  # the workers were for this block only (tuning misses compile in threads)
        failed = [e for e in (f.exception() for f in jobs.values()) if e is not None]
        if failed:
            warnings.warn(f"compile_ahead: {len(failed)} of {len(jobs)} compiles failed (each compiles again at its "
                          f"first real launch, which raises if it fails there too): {failed[0]!r}", RuntimeWarning,
                          stacklevel=3)


def _compile_job(kernel, grid, args, num_warps: int, num_stages: int, constexprs: dict, key: Tuple,
                 processes: int = 0, load: bool = False) -> Callable:
    """The work of compiling one launch's kernel off the caller's thread; remembered for direct launches.
    ``processes`` > 0: compiled in one of that many worker processes first (``precompile.run_jobs``), so the compile
    here only loads the binary from Triton's cache (a worker's failure leaves the compile to this thread). ``load``:
    also build Triton's launcher and load the module (only where no launch of the kernel can run meanwhile: a
    launch would race the loading; ``compile_ahead``, where launches only submit)."""
    device = key[1]

    def warmup():
        return kernel.warmup(*args, grid=grid, num_warps=num_warps, num_stages=num_stages, **constexprs)

    def work():
        if device >= 0 and torch.cuda.is_available():
            torch.cuda.set_device(device)  # the compile's target and cache are the caller's device's
        if processes:
            try:
                specs = precompile.capture([None], lambda _: warmup())
                if specs:
                    precompile.run_jobs(specs, processes)
            except Exception:  # noqa: BLE001 - the workers are an optimisation: compiled here below
                pass
        result = warmup()
        if load and device >= 0 and torch.cuda.is_available() and hasattr(result, "_init_handles"):
            # Triton's launcher for this signature (a C compile on a cold cache) and the module's load, here rather
            # than in the first real launch
            try:
                result._init_handles()
            except Exception:  # noqa: BLE001 - e.g. out of resources: the launch raises it again
                pass
        if _direct_ok(kernel, args, constexprs, result):
            STATE.compiled[key] = result
    return work


def _submit_ahead(kernel, grid, args: Sequence, num_warps: int, num_stages: int, constexprs: dict) -> bool:
    """Submit this launch's compile (once per signature) if compile_ahead is active; False if it is not (any more)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a kernel launch inside compile_ahead() during a CUDA graph capture: the graph would "
                           "hold no launch (capture outside the block)")
    key = _signature_key(kernel, args, num_warps, num_stages, constexprs)
    with TUNER.lock:
        if TUNER.ahead is None:
            return False
        pool, jobs, processes = TUNER.ahead
        if key not in STATE.compiled and key not in jobs:
            jobs[key] = pool.submit(_compile_job(kernel, grid, args, num_warps, num_stages, constexprs, key,
                                                 processes, load=True))
    return True


def launch(kernel, grid: Tuple[int, ...], args: Sequence, num_warps: int, num_stages: int, **constexprs) -> None:
    """``kernel[grid](*args, num_warps=.., num_stages=.., **constexprs)``, directly on a remembered compiled kernel
    when this launch signature was seen before. ``args`` are the runtime params in order; ``constexprs`` must be
    exactly the kernel's trailing constexpr params, in order."""
    if _WARMUP_ONLY.get():
        kernel.warmup(*args, grid=grid, num_warps=num_warps, num_stages=num_stages, **constexprs)
        return
    if TUNER.ahead is not None and background_compiles() and \
            _submit_ahead(kernel, grid, args, num_warps, num_stages, constexprs):
        return
    if interpreting() or not _settings.get().fast_launch:
        kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
        return
    state = STATE
    head = (kernel, _device(), num_warps, num_stages, tuple(constexprs.values()))
    exact = (head, _exact_key(args))
    compiled = state.exact.get(exact)
    key = None
    if compiled is None:
        key = head + (signature(args, _params(kernel)[1]),)
        compiled = state.compiled.get(key)
        if compiled is not None:
            _remember_exact(exact, compiled)
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    if compiled is not None:
        compiled[grid3](*args, *constexprs.values())
        return
    result = kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
    if _direct_ok(kernel, args, constexprs, result):
        state.compiled[key] = result
        _remember_exact(exact, result)


def _direct_ok(kernel, args: Sequence, constexprs: dict, result) -> bool:
    """Whether ``result`` (what Triton returned for this launch) can be called directly with the arguments in
    order: the runtime args lead, the constexprs are exactly the trailing params, and it is a compiled kernel."""
    # (the type's: Triton 3.9's placeholder for a compile still pending elsewhere answers hasattr through
    # __getattr__ yet cannot be subscripted)
    return _params(kernel)[0] == len(args) and len(args) + len(constexprs) == len(kernel.params) and all(
        p.name == name for p, name in zip(kernel.params[len(args):], constexprs)) and hasattr(type(result),
                                                                                             "__getitem__")


def _signature_key(kernel, args: Sequence, num_warps: int, num_stages: int, constexprs: dict) -> Tuple:
    return (kernel, _device(), num_warps, num_stages, tuple(constexprs.values()),
            signature(args, _params(kernel)[1]))


def background_compiles() -> bool:
    """Whether :func:`compile_in_background` applies: on the direct path only (the CPU interpreter and
    ``settings.fast_launch`` False always launch through Triton, which compiles where it must)."""
    return not interpreting() and _settings.get().fast_launch


def is_compiled(kernel, args: Sequence, num_warps: int, num_stages: int, **constexprs) -> bool:
    """Whether this launch would find its compiled kernel (it was launched, or compiled in the background)."""
    return _signature_key(kernel, args, num_warps, num_stages, constexprs) in STATE.compiled


def compile_in_background(kernel, grid: Tuple[int, ...], args: Sequence, num_warps: int, num_stages: int,
                          **constexprs) -> str:
    """Compile this launch's kernel on a background thread (once per signature) and remember it for direct
    launches. Returns ``"ready"`` (compiled), ``"pending"`` or ``"failed"`` (the compile raised: a launch compiles it
    again in the caller and raises there). The thread holds ``args`` until its compile ends."""
    key = _signature_key(kernel, args, num_warps, num_stages, constexprs)
    if key in STATE.compiled:
        return "ready"
    job = TUNER.jobs.get(key)
    if job is None:
        with TUNER.lock:
            if TUNER.pool is None:
                TUNER.pool = ThreadPoolExecutor(1, thread_name_prefix="attn_zoo_compile")
        TUNER.jobs[key] = TUNER.pool.submit(_compile_job(kernel, grid, args, num_warps, num_stages, constexprs, key))
        return "pending"
    if not job.done():
        return "pending"
    return "failed" if job.exception() is not None else "ready"


def background_job(kernel, args: Sequence, num_warps: int, num_stages: int, **constexprs):
    """The background compile of this launch's kernel (a ``concurrent.futures.Future``); None if none was asked."""
    return TUNER.jobs.get(_signature_key(kernel, args, num_warps, num_stages, constexprs))


def wait_background(timeout: Optional[float] = None) -> float:
    """Wait until every background compile submitted so far has ended (or ``timeout`` seconds passed); returns
    the seconds waited. Benchmarks call it before timing a steady state: until then a tile-multiple length runs
    its general stand-in variants."""
    t0 = time.perf_counter()
    jobs = [j for j in list(TUNER.jobs.values()) if not j.done()]
    if jobs:
        wait(jobs, timeout=timeout)
    return time.perf_counter() - t0


def bound(kernel, grid: Tuple[int, ...], args: Sequence, num_warps: int, num_stages: int, n_leading: int,
          **constexprs) -> Optional[Callable[..., None]]:
    """After a :func:`launch` with exactly these arguments: ``f(*leading)`` launching the same compiled kernel on the
    same grid with ``leading`` in place of ``args[:n_leading]`` and the other arguments fixed as given here (what a
    launch plan replays: ``launch.py``). None where that launch took Triton's plain path (the CPU interpreter,
    ``settings.fast_launch`` False, a kernel whose constexprs are not trailing): the caller keeps calling
    :func:`launch`. The leading arguments must have the dtypes and 16-byte alignment of those given here, and the
    current device must stay the same (the plan's key holds both)."""
    if _WARMUP_ONLY.get() or TUNER.ahead is not None or interpreting() or not _settings.get().fast_launch:
        return None
    head = (kernel, _device(), num_warps, num_stages, tuple(constexprs.values()))
    compiled = STATE.exact.get((head, _exact_key(args)))
    if compiled is None:
        compiled = STATE.compiled.get(head + (signature(args, _params(kernel)[1]),))
    if compiled is None:
        return None
    runner = compiled[(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)]
    rest = tuple(args[n_leading:]) + tuple(constexprs.values())
    device = _device()
    if _RAW_STREAM is None or "stream" not in inspect.signature(runner).parameters:
        def run(*leading):
            runner(*leading, *rest)
    else:  # the current stream handed over: the runner would look up the device and its stream on every launch
        def run(*leading):
            runner(*leading, *rest, stream=_RAW_STREAM(device))
    return run


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None) if torch.cuda.is_available() else None


def _exact_key(args: Sequence) -> Tuple:
    """The exact-argument key: ints and floats by value, a plain tensor by (dtype, 16-byte alignment), anything else
    by :func:`_arg_key`. A kernel's param keeps one type from call to call, so equal values of different types
    (True, 1, 1.0) never meet at one position."""
    key = []
    for a in args:
        t = type(a)
        if t is int or t is float:
            key.append(a)
        elif t is torch.Tensor:
            key.append((a.dtype, not a.data_ptr() & 15))
        else:
            key.append(_arg_key(a))
    return tuple(key)


def _remember_exact(exact: Tuple, compiled) -> None:
    cache = STATE.exact
    if len(cache) >= STATE.exact_max:  # many shapes seen: start over (the specialisation cache keeps everything)
        with STATE.lock:
            cache.clear()
    cache[exact] = compiled
