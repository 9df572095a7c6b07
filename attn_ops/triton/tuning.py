"""Block-size choice for the kernels: a small pruned candidate list, timed once per length bucket and cached in
memory and on disk, with configs measured ahead for known GPUs shipped in the package (``tuned/``).

Keys hold the length bucket (:func:`bucket`), not the exact length, so a new protein length reuses its bucket's
choice instead of stalling on compiles and timing. Timed choices persist in a JSON file (:class:`DiskCache`) keyed
by GPU name, Triton version and a hash of the kernel sources, so a second process starts warm. A key in neither
is looked up in the shipped tables (:func:`shipped`: configs timed on that GPU model with that Triton release,
``scripts/ship_tuning.py``), so that even a first process on such a GPU compiles one config per kernel instead of
timing every candidate (``settings.shipped_configs`` False: always time). Only then are candidates timed; a miss's
candidates compile at once on ``settings.compile_threads`` threads. With
``settings.tune`` False nothing is timed: the first candidate that launches (the lists are ordered best-first),
the same in every process. Under ``TRITON_INTERPRET=1`` (CPU tests) there is no timing: one small config is used.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import triton
from triton.runtime.errors import OutOfResources

from ..settings import get as _settings, interpreting


class Cfg(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    rows: int = 1  # batch rows per program sharing each bias tile (2: a bias broadcast over R)
    splits: int = 0  # dbias: programs per SM its split aims at (1: no split; 0: the launcher's default, 8)


class TuningState:
    """The tuner's caches and the compile threads' bookkeeping, one instance (:data:`TUNER`); ``reset()`` empties the
    caches and bumps ``generation``, which launch plans check (a plan holds configs picked before)."""

    __slots__ = ("picks", "disks", "shipped", "pool", "jobs", "ahead", "generation", "lock")

    def __init__(self):
        self.picks: Dict[Tuple, Cfg] = {}  # full key (see pick) -> config
        self.disks: Dict[Tuple, "DiskCache"] = {}  # (folder, device) -> its disk cache
        self.shipped: Dict[Tuple, Dict[str, Cfg]] = {}  # (folder, gpu, triton release) -> shipped table
        self.pool = None  # the background compiles' one thread (made at the first)
        self.jobs: Dict[Tuple, object] = {}  # background compiles: signature key -> Future
        # (pool, {signature key: Future}) while compile_ahead() runs, for the whole process
        # (autograd runs a CUDA backward on threads of its own, so not a context variable)
        self.ahead = None
        self.generation = 0
        self.lock = threading.Lock()  # compile_ahead's start and end against submissions; the pool's making

    def reset(self) -> None:
        """Forget every pick, disk cache, shipped table and background job."""
        with self.lock:
            for cache in (self.picks, self.disks, self.shipped, self.jobs):
                cache.clear()
            self.generation += 1


TUNER = TuningState()


def compiling_ahead() -> bool:
    """Whether :func:`compile_ahead` is active: launches submit their kernel's compile and run nothing."""
    return TUNER.ahead is not None


def background_compiles() -> bool:
    """Whether compiles can run off the launching thread: on the direct path only (the CPU interpreter and
    ``settings.fast_launch`` False always launch through Triton, which compiles where it must)."""
    return not interpreting() and _settings().fast_launch


@contextlib.contextmanager
def compile_ahead(threads: Optional[int] = None) -> Iterator[None]:
    """Inside the block every kernel launch (``launch.launch_kernel``, in any thread) runs nothing: a kernel not
    compiled yet is compiled on one of ``threads`` threads (default ``settings.compile_threads``), all at once. The
    block ends when every compile has. Outputs of the calls inside are garbage: run throwaway steps there (one
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
    pool = ThreadPoolExecutor(threads or _settings().compile_threads, thread_name_prefix="attn_zoo_ahead")
    jobs: Dict[Tuple, object] = {}
    with TUNER.lock:
        TUNER.ahead = (pool, jobs)
    try:
        yield
    finally:
        with TUNER.lock:
            TUNER.ahead = None
        pool.shutdown()  # (waits for every compile submitted)
        failed = [e for e in (f.exception() for f in jobs.values()) if e is not None]
        if failed:
            warnings.warn(f"compile_ahead: {len(failed)} of {len(jobs)} compiles failed (each compiles again at its "
                          f"first real launch, which raises if it fails there too): {failed[0]!r}", RuntimeWarning,
                          stacklevel=3)




def wait_background(timeout: Optional[float] = None) -> float:
    """Wait until every background compile submitted so far has ended (or ``timeout`` seconds passed); returns
    the seconds waited. Benchmarks call it before timing a steady state: until then a tile-multiple length runs
    its general stand-in variants."""
    t0 = time.perf_counter()
    wait([j for j in list(TUNER.jobs.values()) if not j.done()], timeout=timeout)
    return time.perf_counter() - t0


# Set by compile_only() in the thread (context) that compiles a tuning key's candidates; other threads launching
# at the same time are not affected.
_WARMUP_ONLY: contextvars.ContextVar = contextvars.ContextVar("attn_zoo_warmup_only", default=False)


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Inside the block ``launch.launch_kernel`` compiles (``kernel.warmup``) and launches nothing, in this thread
    only: under Triton's asynchronous compile mode the tuner submits every candidate's compile at once this way."""
    token = _WARMUP_ONLY.set(True)
    try:
        yield
    finally:
        _WARMUP_ONLY.reset(token)

# Candidates per kernel (BLOCK_M = query tile, BLOCK_N = key tile), for H100-class GPUs with triton 3.x.
_CANDIDATES = {
    "fwd": [Cfg(128, 64, 4, 3), Cfg(128, 128, 8, 3), Cfg(64, 64, 4, 3), Cfg(128, 32, 4, 3), Cfg(64, 128, 4, 3)],
    "dkdv": [Cfg(64, 128, 8, 3), Cfg(32, 128, 4, 3), Cfg(64, 64, 4, 3), Cfg(32, 64, 4, 3), Cfg(128, 128, 8, 2)],
    "dq": [Cfg(128, 64, 8, 3), Cfg(64, 64, 4, 3), Cfg(128, 32, 4, 3), Cfg(64, 128, 8, 3)],
    # dbias: 4 warps and 64x64 tiles win since its steps lost their load masks (H100 triangle 768: docs/bench);
    # each tile shape is also timed with several split counts.
    "dbias": [Cfg(64, 64, 4, 3), Cfg(64, 64, 4, 4), Cfg(64, 32, 4, 3), Cfg(32, 64, 4, 3), Cfg(128, 64, 8, 3),
              Cfg(64, 128, 8, 3), Cfg(32, 32, 4, 3)],
}
# Split counts of the dbias batch loop, as programs per SM (the launcher's _dbias_splits; 0 is its default, 8), so a
# choice scales with the tile count over a bucket's lengths; 1 is no split (shapes with many output tiles). 0 first:
# an untimed pick then runs the fp32-partials path where tiles are few. The timed launch includes the sum over the
# splits (timing the kernel alone picked too many splits on the H100 triangle; docs/bench).
_DBIAS_SPLITS = (0, 1, 4)
# The default aim (``Cfg.splits`` 0), programs per SM (here, not in the launcher: in source_hash, so a change
# invalidates disk caches whose picks meant another default): the fastest count at most crop shapes on the H100
# and the H200 (docs/bench/history.md).
DBIAS_PER_SM = 8
_INTERPRETER = Cfg(32, 16, 4, 1)


def bucket(n: int) -> int:
    """The length bucket of ``n`` in tuning keys: the next power of two, at least 16.

    Powers of two, not finer steps: the candidate lists are pruned by exactly this value (so every length of a
    bucket has the same candidates), a bucket's tile counts differ by less than 2x, and a run over lengths
    180-520 meets three buckets per dim, each timed once (multiples of 64 would time seven).
    """
    return max(16, 1 << (n - 1).bit_length())


def candidates(kernel: str, head_dim: int, lq: int, lk: int, pair: bool = False) -> List[Cfg]:
    """Pruned candidates: big head dims need small tiles (registers, shared memory); tiny L, small tiles.

    ``head_dim`` is the padded width in 16-bit units (the caller doubles it for fp32 inputs). ``pair``: the
    kernel can run two batch rows per program on one bias tile; each tile shape is tried both ways. Depends on
    ``lq`` and ``lk`` only through :func:`bucket`.
    """
    out = [c for c in _CANDIDATES[kernel] if c.block_m <= bucket(lq) and c.block_n <= bucket(lk)
           and not (head_dim > 128 and (c.block_m * c.block_n > 64 * 64 or c.num_stages > 2))
           and not (head_dim > 64 and kernel == "dkdv" and c.block_m * c.block_n > 64 * 128)]
    if head_dim > 128:
        out += [Cfg(32, 32, 4, 2), Cfg(64, 32, 4, 2)]
    out = out or [Cfg(16, 16, 4, 1)]
    if pair and head_dim <= 64:  # two rows' accumulators: only for small heads (the pair-bias layouts)
        out += [c._replace(rows=2) for c in out]
    if kernel == "dbias":  # the split count is a launch argument, not a compile-time one: cheap to time
        out = [c._replace(splits=n) for c in out for n in _DBIAS_SPLITS]
    return out


def pick(kernel: str, key: Tuple, head_dim: int, lq: int, lk: int, launch: Callable[[Cfg], None],
         pair: bool = False, device: Optional[int] = None) -> Cfg:
    """The cached config for ``key`` (which holds length buckets, not lengths); on a miss, the on-disk cache's, else
    the shipped table's (:func:`shipped`; not written to disk), else time each candidate with ``launch(cfg)`` and
    keep the best (``settings.tune`` False: the first candidate that launches, no timing, no disk).

    ``launch`` must be repeatable (it re-zeroes any buffer it accumulates into). ``pair``: see :func:`candidates`
    (the CPU interpreter then always runs the two-row path, so the tests cover it). ``device``: the CUDA device
    index (which GPU's disk cache; part of the in-memory key).
    """
    if interpreting():
        return _INTERPRETER._replace(rows=2 if pair else 1)
    s = _settings()
    full_key = (kernel, pair) + key + (s.tune, s.shipped_configs, device)
    cfg = TUNER.picks.get(full_key)
    if cfg is not None:
        return cfg
    cands, name = candidates(kernel, head_dim, lq, lk, pair), (kernel, pair) + key
    disk = disk_cache(s.cache_dir, device) if s.tune else None
    cfg = None if disk is None else disk.get(name)
    cfg = cfg if cfg in cands else None  # (not a config the current candidate lists no longer offer)
    ship = shipped(device).get(DiskCache._name(name)) if cfg is None and s.tune and s.shipped_configs else None
    ship = ship if ship in cands else None
    if cfg is None and compiling_ahead():  # nothing runs: submit the compiles the real call will want (the shipped
        # config, else every candidate to time, else the first); check, time and cache nothing (the real call does)
        _launch_each([ship] if ship is not None else (cands if s.tune else cands[:1]), launch)
        return ship or cands[0]
    if cfg is None and ship is not None:  # (launched once: a kernel changed since the table was made may not fit it)
        cfg = _first_that_launches([ship] + [c for c in cands if c != ship], launch)
    if cfg is None:
        if len(cands) == 1 or not s.tune:
            cfg = _first_that_launches(cands, launch)
        else:
            _compile_all(cands, launch, s.compile_threads)
            cfg = _time(kernel, key, cands, launch, s.tune_log)
            if disk is not None:
                disk.put(name, cfg)
    TUNER.picks[full_key] = cfg
    return cfg


def _compile_all(cands: List[Cfg], launch: Callable[[Cfg], None], threads: int) -> None:
    """Compile every candidate at once on ``threads`` threads (Triton's asynchronous compile mode; its compiles
    spend most of their time outside the GIL), so a tuning miss waits for about one compile, not one per candidate.
    Nothing runs; a candidate that fails here fails again when timed and is skipped there."""
    if threads <= 1 or len(cands) <= 1:
        return
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # pragma: no cover - Triton before the asynchronous compile mode: compiled when timed
        return
    with ThreadPoolExecutor(min(threads, len(cands))) as pool:
        with AsyncCompileMode(pool, ignore_errors=True), compile_only():
            _launch_each(cands, launch)


def _launch_each(cands: List[Cfg], launch: Callable[[Cfg], None]) -> None:
    """``launch(c)`` for every candidate, errors ignored (the real call, or the timing, reports them)."""
    for c in cands:
        with contextlib.suppress(Exception):
            launch(c)


def _time(kernel: str, key: Tuple, cands: List[Cfg], launch: Callable[[Cfg], None], log: bool) -> Cfg:
    timed = []
    for c in cands:
        try:
            ms = measure(lambda: launch(c))
        except Exception:  # out of resources for this shape: skip the candidate
            continue
        if log:
            print(f"tune {kernel} {key}: {c} {ms:.3f} ms", flush=True)
        timed.append((ms, c))
    return min(timed, key=lambda t: t[0])[1] if timed else cands[-1]  # (the first of equal times)




def measure(fn: Callable[[], None], budget_ms: float = 2.0, min_runs: int = 5, max_runs: int = 40) -> float:
    """Median GPU time (ms) of ``fn``: one untimed run, then enough runs for about ``budget_ms`` of GPU time, each
    between CUDA events after clearing a buffer of twice the L2 size, at least 64 MB (cold L2, as in training; the
    clear also hides most of the host's launch latency from the events). Not ``triton.testing.do_bench``: its fixed
    warm-up and repetition windows made timing the larger part of a tuning stall, where the choice between
    candidates only needs their order (docs/bench/varlen_h100.md)."""
    device = torch.cuda.current_device()
    # A buffer per call, not one kept: tuning may run inside a CUDA-graph tree's warm-up, whose memory pool must
    # hold no tensor that outlives the call (torch.compile(mode="reduce-overhead") refuses such a pool).
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    flush = torch.empty(max(64 << 20, 2 * l2), dtype=torch.int8, device="cuda")

    def timed(pairs) -> List[float]:
        for start, end in pairs:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return sorted(start.elapsed_time(end) for start, end in pairs)

    fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(max_runs)]
    first = timed(events[:1])[0]
    times = timed(events[:max(min_runs, min(max_runs, int(budget_ms / max(first, 1e-3))))])
    return times[len(times) // 2]


def _first_that_launches(cands: List[Cfg], launch: Callable[[Cfg], None]) -> Cfg:
    """The first candidate whose kernel compiles and launches (shared memory and registers permitting)."""
    for c in cands[:-1]:
        with contextlib.suppress(OutOfResources):
            launch(c)
            return c
    return cands[-1]


def chosen() -> Dict[Tuple, Cfg]:
    """Configs picked so far (for benchmark reports): key ``(kernel, pair, *launcher key, tune, shipped_configs,
    device)``."""
    return dict(TUNER.picks)


# ---------------------------------------------------------------------------------------------------------------
# On-disk cache


_KERNEL_FILES = ("common.py", "forward.py", "backward.py", "dbias.py")


def source_hash() -> str:
    """A hash of what a cached pick means: the kernel sources and the tuner's candidates, split counts and dbias
    default. A change to any invalidates disk caches; a change to the rest of this file (compile threads, the cache
    itself) does not."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _KERNEL_FILES:
        with open(os.path.join(here, name), "rb") as fh:
            h.update(name.encode() + b"\0" + fh.read())
    h.update(repr((sorted(_CANDIDATES.items()), _DBIAS_SPLITS, DBIAS_PER_SM)).encode())
    return h.hexdigest()[:16]


def _gpu_and_triton(device=None) -> Tuple[str, str]:
    return (torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"), triton.__version__


def identity(device=None) -> Dict[str, str]:
    """What a cached config is valid for: the GPU's name, Triton's version and the kernel sources."""
    gpu, version = _gpu_and_triton(device)
    return {"gpu": gpu, "triton": version, "source": source_hash()}


class DiskCache:
    """Tuned configs in one JSON file per identity under ``folder``: ``{"identity": {...}, "configs": {key: cfg}}``.

    Robust by construction: a corrupt file or one written for another identity is ignored with one warning and
    rebuilt on the next write; writes merge with what is on disk under a lock and land by ``os.replace`` of a temp
    file (two processes writing at once lose nothing and never leave a torn file); a folder that cannot be written
    warns once and the cache lives on in memory.
    """

    def __init__(self, folder: str, ident: Dict[str, str]):
        self.ident = dict(ident)
        tag = hashlib.sha256(json.dumps(self.ident, sort_keys=True).encode()).hexdigest()[:16]
        self.path = os.path.join(os.fspath(folder), f"tuning-{tag}.json")
        self.configs: Dict[str, Cfg] = {}
        self.writable = True
        self._stamp = None  # (mtime_ns, size) of the file last read
        self._warned = set()

    def _warn(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"attn_ops tuning cache {self.path}: {msg}", RuntimeWarning, stacklevel=3)

    def _read(self) -> Dict[str, Cfg]:
        """The file's configs ({} when absent, corrupt or foreign: one warning each)."""
        try:
            ident, configs = _read_table(self.path, self.ident)
        except FileNotFoundError:
            return {}
        except _TABLE_ERRORS as exc:
            self._warn("corrupt", f"unreadable or malformed ({type(exc).__name__}: {exc}); ignored, rebuilt")
            return {}
        if ident != self.ident:  # (configs is {} then)
            self._warn("foreign", f"written for {ident}, not {self.ident}; ignored, rebuilt")
        return configs

    def refresh(self) -> None:
        """Re-read the file if it changed since the last read (another process may have tuned more)."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            return
        if stamp != self._stamp:
            self._stamp = stamp
            self.configs.update(self._read())

    _name = staticmethod(repr)  # a tuner key's name in the file

    def get(self, key: Tuple) -> Optional[Cfg]:
        name = self._name(key)
        if name not in self.configs:
            self.refresh()
        return self.configs.get(name)

    def put(self, key: Tuple, cfg: Cfg) -> None:
        self.configs[self._name(key)] = cfg
        if self.writable:
            try:
                self._write()
            except OSError as exc:
                self.writable = False
                self._warn("readonly", f"cannot be written ({type(exc).__name__}: {exc}); kept in memory only")

    def _write(self) -> None:
        folder = os.path.dirname(self.path)
        os.makedirs(folder, exist_ok=True)
        with _locked(self.path + ".lock"):
            self.configs = merged = {**self._read(), **self.configs}  # ours over the file's
            fd, tmp = tempfile.mkstemp(prefix=".tuning-", suffix=".tmp", dir=folder)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump({"identity": self.ident, "configs": {k: list(c) for k, c in sorted(merged.items())}},
                              fh, indent=0)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            st = os.stat(self.path)
            self._stamp = (st.st_mtime_ns, st.st_size)


_TABLE_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError)


def _read_table(path: str, want) -> Tuple[object, Dict[str, Cfg]]:
    """(identity, configs) of a tuning JSON file (disk cache or shipped table), the configs parsed only when the
    identity is ``want`` (another GPU's or release's entries may have another form: not this reader's to judge);
    raises one of ``_TABLE_ERRORS``."""
    with open(path, "r", encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    ident = data.get("identity")
    return ident, ({k: Cfg(*v) for k, v in data["configs"].items()} if ident == want else {})


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if needed) for a read-merge-write; no lock where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: os.replace still keeps the file whole
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


# ---------------------------------------------------------------------------------------------------------------
# Shipped tables: {"identity": {"gpu": name, "triton": "major.minor"}, "measured": text, "configs": {key: cfg}}, the
# disk cache's keys and configs without its source hash (a config stays valid when a kernel changes; one that the
# candidate lists no longer offer is ignored).

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")


def triton_release(version: str) -> str:
    """``"3.6.0"`` -> ``"3.6"``: shipped tables hold for a Triton release line (its code generation)."""
    return ".".join(version.split(".")[:2])


def shipped(device=None) -> Dict[str, Cfg]:
    """The shipped configs for the current GPU model and Triton release (``{}`` when no table matches), read once
    per GPU model from :data:`SHIPPED_DIR`. An unreadable or malformed table warns and is skipped."""
    folder = SHIPPED_DIR
    gpu, version = _gpu_and_triton(device)
    want = {"gpu": gpu, "triton": triton_release(version)}
    key = (folder, want["gpu"], want["triton"])
    table = TUNER.shipped.get(key)
    if table is None:
        table = {}
        for name in sorted(n for n in os.listdir(folder) if n.endswith(".json")) if os.path.isdir(folder) else []:
            path = os.path.join(folder, name)
            try:
                table.update(_read_table(path, want)[1])
            except _TABLE_ERRORS as exc:
                warnings.warn(f"attn_ops shipped tuning table {path}: unreadable ({type(exc).__name__}: {exc}); "
                              "skipped", RuntimeWarning, stacklevel=2)
        TUNER.shipped[key] = table
    return table


def disk_cache(folder: Optional[str], device=None) -> Optional[DiskCache]:
    """The disk cache for ``folder`` and the current GPU (None: no folder set)."""
    if not folder:
        return None
    index = torch.cuda.current_device() if device is None and torch.cuda.is_available() else device
    key = (os.fspath(folder), index)
    cache = TUNER.disks.get(key)
    if cache is None:
        cache = TUNER.disks[key] = DiskCache(folder, identity(index))
    return cache
