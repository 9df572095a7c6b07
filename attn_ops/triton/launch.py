"""Host launch layer: direct launches of Triton's compiled kernels, launch plans (``Recorder``, replayed per
call) and the stride, grid and device helpers of the launch records (``passes.py``).

Canonical layout (see ``op.py``): q ``[B, R, H, Lq, D]``, k ``[B, R, H, Lk, D]``, v ``[B, R, H, Lk, Dv]`` with a
contiguous last dim; bias ``[B|1, R|1, H|1, Lq|1, Lk|1]`` (any float dtype) and mask (bool, same rule) in
their own shapes: a size-1 dim is passed with stride 0, so nothing is expanded.

Direct launches: ``kernel[grid](*args, **constexprs)`` binds and specializes every argument on each call (a native
specialisation call per argument: a few times the cost of the launch itself for the ~45 arguments of these
kernels), and a small shape's step is bound by such host time. :func:`launch_kernel` keeps the compiled kernel
Triton returned for a launch signature and calls it directly the next time; :func:`bound` hands a launch plan that
direct call with the fixed arguments already in place.

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
import math
import operator
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..settings import get as _settings, interpreting
from . import tuning
from .tuning import _WARMUP_ONLY, TUNER, compiling_ahead, pick

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

Tensor = torch.Tensor


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
        self.plans: Dict[Tuple, object] = {}  # call key -> launch plan (Plan)
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
        n = n if flags and all(flags[n:]) else -1  # (no params, or a runtime param after a constexpr)
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


def _compile_job(kernel, grid, args, num_warps: int, num_stages: int, constexprs: dict, key: Tuple,
                 load: bool = False) -> Callable:
    """The work of compiling one launch's kernel off the caller's thread; remembered for direct launches. ``load``:
    also build Triton's launcher and load the module (only where no launch of the kernel can run meanwhile: a
    launch would race the loading; ``compile_ahead``, where launches only submit)."""
    device = key[1]

    def work():
        if device >= 0 and torch.cuda.is_available():
            torch.cuda.set_device(device)  # the compile's target and cache are the caller's device's
        result = kernel.warmup(*args, grid=grid, num_warps=num_warps, num_stages=num_stages, **constexprs)
        if load and device >= 0 and torch.cuda.is_available() and hasattr(result, "_init_handles"):
            # Triton's launcher for this signature (a C compile on a cold cache) and the module's load, here rather
            # than in the first real launch; an error (e.g. out of resources) the launch raises again
            with contextlib.suppress(Exception):
                result._init_handles()
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
        pool, jobs = TUNER.ahead
        if key not in STATE.compiled and key not in jobs:
            jobs[key] = pool.submit(_compile_job(kernel, grid, args, num_warps, num_stages, constexprs, key, load=True))
    return True


def launch_kernel(kernel, grid: Tuple[int, ...], args: Sequence, num_warps: int, num_stages: int, **constexprs) -> None:
    """``kernel[grid](*args, num_warps=.., num_stages=.., **constexprs)``, directly on a remembered compiled kernel
    when this launch signature was seen before. ``args`` are the runtime params in order; ``constexprs`` must be
    exactly the kernel's trailing constexpr params, in order."""
    if _WARMUP_ONLY.get():
        kernel.warmup(*args, grid=grid, num_warps=num_warps, num_stages=num_stages, **constexprs)
        return
    if TUNER.ahead is not None and tuning.background_compiles() and \
            _submit_ahead(kernel, grid, args, num_warps, num_stages, constexprs):
        return
    if interpreting() or not _settings().fast_launch:
        kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
        return
    state = STATE
    head = (kernel, _device(), num_warps, num_stages, tuple(constexprs.values()))
    exact = (head, _exact_key(args))
    compiled = state.exact.get(exact)
    if compiled is None:
        key = head + (signature(args, _params(kernel)[1]),)
        compiled = state.compiled.get(key)
        if compiled is not None:
            _remember_exact(exact, compiled)
    if compiled is not None:
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
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
    n = len(args)
    return _params(kernel)[0] == n and n + len(constexprs) == len(kernel.params) and all(
        p.name == name for p, name in zip(kernel.params[n:], constexprs)) and hasattr(type(result), "__getitem__")


def _signature_key(kernel, args: Sequence, num_warps: int, num_stages: int, constexprs: dict) -> Tuple:
    return kernel, _device(), num_warps, num_stages, tuple(constexprs.values()), signature(args, _params(kernel)[1])


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
            TUNER.pool = TUNER.pool or ThreadPoolExecutor(1, thread_name_prefix="attn_zoo_compile")
        TUNER.jobs[key] = TUNER.pool.submit(_compile_job(kernel, grid, args, num_warps, num_stages, constexprs, key))
        return "pending"
    if not job.done():
        return "pending"
    return "failed" if job.exception() is not None else "ready"


def bound(kernel, grid: Tuple[int, ...], args: Sequence, num_warps: int, num_stages: int, n_leading: int,
          **constexprs) -> Optional[Callable[..., None]]:
    """After a :func:`launch_kernel` with exactly these arguments: ``f(*leading)`` launching the same compiled kernel
    on the same grid with ``leading`` in place of ``args[:n_leading]`` and the other arguments fixed as given here
    (what a launch plan replays). None where that launch took Triton's plain path (the CPU interpreter,
    ``settings.fast_launch`` False, a kernel whose constexprs are not trailing): the caller keeps calling
    :func:`launch_kernel`. The leading arguments must have the dtypes and 16-byte alignment of those given here, and
    the current device must stay the same (the plan's key holds both)."""
    if _WARMUP_ONLY.get() or TUNER.ahead is not None or interpreting() or not _settings().fast_launch:
        return None
    compiled = STATE.compiled.get(_signature_key(kernel, args, num_warps, num_stages, constexprs))
    if compiled is None:
        return None
    runner = compiled[(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)]
    rest = tuple(args[n_leading:]) + tuple(constexprs.values())
    device = _device()
    if _RAW_STREAM is None or "stream" not in inspect.signature(runner).parameters:
        return lambda *leading: runner(*leading, *rest)
    # the current stream handed over: the runner would look up the device and its stream on every launch
    return lambda *leading: runner(*leading, *rest, stream=_RAW_STREAM(device))


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


def _bstrides(t: Tensor) -> Tuple[int, ...]:
    """Strides of a 5-D tensor, 0 on size-1 dims (broadcast)."""
    (n0, n1, n2, n3, n4), (s0, s1, s2, s3, s4) = t.shape, t.stride()  # unrolled: called ~20 times per fwd + bwd
    return (0 if n0 == 1 else s0, 0 if n1 == 1 else s1, 0 if n2 == 1 else s2, 0 if n3 == 1 else s3,
            0 if n4 == 1 else s4)


def _rows(t: Tensor) -> Tuple[int, int, int, int]:
    """(b, r, h, row) strides of a canonical [B, R, H, L, D] tensor."""
    return (*_bstrides(t)[:3], t.stride(3))  # the row stride as is, also for a single row


def empty_in_order(like: Tensor, shape, dtype: torch.dtype) -> Tensor:
    """A dense ``shape`` tensor whose dims are laid out in ``like``'s stride order (largest stride outermost).

    The op's output takes q's dim order, so that a caller who split heads out of ``[*, L, H*C]`` gets ``out``
    back as a view of ``[*, L, H*C]`` memory (no copy to merge the heads). Also used by the fake impl.
    """
    return torch.empty_permuted(shape, _order(like), dtype=dtype, device=like.device)


def _cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a constexpr function: ~1.5 us per call from Python, and
    the launchers make a few dozen such calls per forward + backward)."""
    return -(-a // b)


def _pow2(n: int) -> int:
    """The head-dim block: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (n - 1).bit_length())


def _align(*tensors: Tensor) -> int:
    """The kernels' ALIGN (``common.aligned``): the largest power of two, at most 16, dividing every stride the
    kernels get for these canonical tensors: the batch strides (dims B, R, H; size-1 dims pass 0) and the row
    stride. Row starts then keep the base pointer's alignment, so rows load as 16-byte vectors for head widths such
    as 24, whose strides Triton does not specialise (it does so only for multiples of 16)."""
    g = math.gcd(*(s for t in tensors for s in _rows(t)))  # (a size-1 dim's 0 divides by anything)
    return 16 if g == 0 else min(16, g & -g)


def _even(length: int, block: int) -> bool:
    """Whether a launch asks for the variant of a length that is a multiple of the tile (EVEN_M / EVEN_N: no load
    masks); ``settings.tile_variants`` False: never, every length runs the general variant (fewer compiles)."""
    return length % block == 0 and _settings().tile_variants


def _device_facts(device: torch.device) -> Tuple[int, int]:
    """(compute capability major, SM count) of a CUDA device, asked once per device (launches ask on every call:
    the host's share of a small step counts)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    facts = STATE.devices.get(index)
    if facts is None:
        props = torch.cuda.get_device_properties(index)
        facts = STATE.devices[index] = (props.major, props.multi_processor_count)
    return facts


def sm_count(device: torch.device) -> int:
    """The CUDA device's SM count."""
    return _device_facts(device)[1]


def _tma_capable(device: torch.device) -> bool:
    """Tensor-memory-accelerator copies: Hopper or newer GPUs with a Triton that has host tensor descriptors, and
    the CPU interpreter (so the CPU tests run this path too); ``settings.tma`` False (``ATTN_ZOO_NO_TMA=1``) turns
    it off."""
    if TensorDescriptor is None or not _settings().tma:
        return False
    return interpreting() or (device.type == "cuda" and _device_facts(device)[0] >= 9)


# ---------------------------------------------------------------------------------------------------------------
# Launch plans. A call's host work (strides, grids, tile choice, TMA and buffer decisions, Triton's argument
# binding) depends only on its tensors' geometry: the first call with a geometry runs its record (``passes.py``)
# through a Recorder, which keeps each allocation and launch as a step over ``env`` (the call's tensors: inputs
# first, then the buffers the steps allocate, in order); later calls with the same key replay those steps with
# their own tensors, launching the compiled kernels directly (:func:`bound`): an eager call of a small shape is bound
# by its host time, and replaying skips most of it (docs/bench/crop_h100.md).


class Plan(NamedTuple):
    steps: Tuple[Callable[[list], None], ...]
    outputs: Tuple[Optional[int], ...]  # env slots of the results (None: no such result)
    guard: Tuple  # what the plan was made under besides its key (see _guard)
    pending: Tuple = ()  # background compiles of the variants it stands in for (see Recorder._ready_variant)


def clear_plans() -> None:
    """Forget every launch plan (the next call of each geometry runs the launchers again)."""
    STATE.plans.clear()


def _guard() -> Tuple:
    """What a plan was made under besides its key (which holds the settings, by value): the tuner's generation
    and picks dict (configs picked before a reset, or before the dict was replaced), the interpreter's config and
    the TMA threshold (values that tests and experiments replace)."""
    return (TUNER.generation, tuning._INTERPRETER, STATE.tma_min_scores, TUNER.picks)


def _geo(t: Optional[Tensor]):
    """What a plan depends on of one tensor: shape, strides, dtype, device and 16-byte alignment."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15)


# the current CUDA device (a plan's compiled kernels are loaded for it): the C call behind torch.cuda.current_device
_current_device = getattr(torch._C, "_cuda_getDevice", None) if torch.cuda.is_available() else None
_current_device = _current_device or (lambda: -1)


def run_plan(key: Tuple, env: list, record: Callable, *args) -> Tuple[Optional[int], ...]:
    """The env slots of a call's results: the plan for ``key`` replayed on ``env``, else ``record(Recorder(env),
    *args)`` run and kept as that plan (one made under other settings, or whose pending variants are ready, is
    recorded anew)."""
    state = STATE
    plan = state.plans.get(key)
    if plan is not None:
        guard = plan.guard
        if guard[0] != TUNER.generation or guard[1] is not tuning._INTERPRETER or guard[2] != state.tma_min_scores \
                or guard[3] is not TUNER.picks:
            plan = None
        elif plan.pending and all(job.done() for job in plan.pending):  # its own variants are ready: record anew
            state.plans.pop(key, None)  # (another thread may have dropped it first)
            plan = None
        else:
            for step in plan.steps:
                step(env)
            return plan.outputs
    rec = Recorder(env)
    outputs = record(rec, *args)
    _keep(key, rec, outputs)
    return outputs


def _keep(key: Tuple, rec: "Recorder", outputs: Tuple[Optional[int], ...]) -> None:
    if compiling_ahead():  # its launches ran nothing: no plan
        return
    plans = STATE.plans
    if key not in plans and len(plans) >= STATE.plans_max:  # many geometries seen: drop the oldest plan
        # (under the lock: two threads evicting at once would pick the same one; another thread inserting between
        # iter and next raises RuntimeError: evict at a later call)
        with STATE.lock, contextlib.suppress(RuntimeError):
            plans.pop(next(iter(plans), None), None)
    plans[key] = Plan(tuple(rec.steps), outputs, rec.guard, tuple(rec.pending))


def _getter(leading: Sequence) -> Callable[[list], tuple]:
    """env -> the leading kernel arguments: env slots (ints) or per-call makers (tensor descriptors)."""
    if all(type(x) is int for x in leading):
        get = operator.itemgetter(*leading)
        return get if len(leading) > 1 else (lambda env: (get(env),))
    return lambda env: tuple(env[x] if type(x) is int else x(env) for x in leading)


class Recorder:
    """Runs one call's allocations and launches on ``env`` and keeps them as a plan's steps.

    ``new(make)`` appends ``make(env)`` to env (returns its slot); ``do(step)`` runs ``step(env)``; ``launch``
    launches a kernel whose leading arguments are env slots or makers (the rest are fixed). ``tuned`` picks a
    config, timing candidates off the record (buffers they allocate are dropped after each one), then runs the chosen
    one on it."""

    def __init__(self, env: list):
        # pending: background compiles of the variants that stand-ins ran for (see _ready_variant)
        self.env, self.steps, self.recording, self.guard, self.pending = env, [], True, _guard(), []

    def do(self, step: Callable[[list], None]) -> None:
        step(self.env)
        if self.recording:
            self.steps.append(step)

    def new(self, make: Callable[[list], Tensor]) -> int:
        slot = len(self.env)
        self.do(lambda env: env.append(make(env)))
        return slot

    def launch(self, kernel, grid, leading: Sequence, rest: Sequence, num_warps: int, num_stages: int,
               **constexprs) -> None:
        get, rest = _getter(leading), tuple(rest)
        args = get(self.env) + rest
        if self.recording and not compiling_ahead():
            constexprs = self._ready_variant(kernel, grid, args, num_warps, num_stages, constexprs)
        launch_kernel(kernel, grid, args, num_warps, num_stages, **constexprs)
        if not self.recording:
            return
        run = bound(kernel, grid, args, num_warps, num_stages, len(leading), **constexprs)
        # None: the plain path (interpreter, fast_launch off), through launch_kernel every time
        self.steps.append((lambda env: run(*get(env))) if run is not None else (
            lambda env: launch_kernel(kernel, grid, get(env) + rest, num_warps, num_stages, **constexprs)))

    def _ready_variant(self, kernel, grid, args, num_warps: int, num_stages: int, constexprs: dict) -> dict:
        """``constexprs``, or the general variant's while theirs compiles in the background. A length that is a
        multiple of a tile asks for an EVEN_M / EVEN_N specialisation (no load masks) of the config its length
        bucket chose; the first such length would stall on that compile (seconds, per kernel). Where the general
        variant (masks everywhere, the same results) is compiled, it runs instead; the call's plan is kept with the
        pending compiles, replayed while they run and recorded anew once they have ended (:func:`run_plan`), so the
        calls meanwhile cost no more host time than any replay and a later one takes the specialisation."""
        if not (constexprs.get("EVEN_M") or constexprs.get("EVEN_N")) or not tuning.background_compiles() or \
                is_compiled(kernel, args, num_warps, num_stages, **constexprs):
            return constexprs
        general = dict(constexprs, EVEN_M=False, EVEN_N=False)
        if general.get("HAS_BIAS") == 1:
            general["BIAS_ALIGN"] = 1  # HAS_BIAS 1: vector bias loads only where no tile carries masks
        # the general variant not compiled, or this one ready by now or failed: compiled here (its error raised) as ever
        if not is_compiled(kernel, args, num_warps, num_stages, **general) or \
                compile_in_background(kernel, grid, args, num_warps, num_stages, **constexprs) != "pending":
            return constexprs
        self.pending.append(TUNER.jobs[_signature_key(kernel, args, num_warps, num_stages, constexprs)])
        return general

    def tuned(self, name: str, key: Tuple, width: int, Lq: int, Lk: int, run: Callable, **kw):
        """``pick`` with ``run(cfg)`` timing candidates unrecorded, then ``run(chosen)`` recorded; returns what that
        last call returned."""
        n = len(self.env)

        def trial(c):
            try:
                run(c)
            finally:
                del self.env[n:]

        self.recording = False
        try:
            cfg = pick(name, key, width, Lq, Lk, trial, **kw)
        finally:
            self.recording = True
        return run(cfg)


def _empty(shape, dtype, device, stride=None, order=None) -> Callable[[list], Tensor]:
    if order is not None:
        return lambda env: torch.empty_permuted(shape, order, dtype=dtype, device=device)
    if stride is not None:
        return lambda env: torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return lambda env: torch.empty(shape, dtype=dtype, device=device)


def _order(like: Tensor) -> List[int]:
    """``like``'s dims, outermost (largest stride) first; ties keep dim order."""
    return sorted(range(like.ndim), key=lambda d: (-like.stride(d), d))


