"""attn_ops.triton.launch, direct launches: when a launch reuses a remembered compiled kernel and when it must not.

A stand-in kernel records how it was launched, so the caching rules run on the CPU without a GPU or the
interpreter (which always takes the plain path). The real kernels take the direct path on the GPU, where
tests/test_triton_gpu.py checks their results.
"""
import threading
import types

import pytest
import torch

pytest.importorskip("triton")

import attn_ops  # noqa: E402
from attn_ops import settings  # noqa: E402
from attn_ops.triton import launch, tuning  # noqa: E402


class FakeCompiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class FakeKernel:
    """Params (name, is_constexpr) in order; ``kernel[grid](...)`` logs a plain launch and returns a compiled one.
    ``dns``, ``dnsoa``: names of params marked ``do_not_specialize``, ``do_not_specialize_on_alignment``."""

    def __init__(self, params, dns=(), dnsoa=()):
        self.params = [types.SimpleNamespace(name=n, is_constexpr=c, do_not_specialize=n in dns,
                                             do_not_specialize_on_alignment=n in dnsoa) for n, c in params]
        self.log = []

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages, **constexprs):
            self.log.append(("plain", grid, args, num_warps, num_stages, constexprs))
            return FakeCompiled(self.log)
        return run


@pytest.fixture(autouse=True)
def compiled_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(settings, "_current", settings.KernelSettings(cache_dir=None))
    for name in ("compiled", "exact", "params"):
        monkeypatch.setattr(launch.STATE, name, {})
    monkeypatch.setattr(launch, "_device", lambda: 0)  # no CUDA here


def _kernel():
    return FakeKernel([("X", False), ("n", False), ("s", False), ("BLOCK", True), ("EVEN", True)])


def test_second_launch_with_same_signature_is_direct_with_all_params_in_order():
    k, x = _kernel(), torch.zeros(64)
    launch.launch_kernel(k, (3, 2), (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=True)
    launch.launch_kernel(k, (3, 2), (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=True)
    assert [e[0] for e in k.log] == ["plain", "direct"]
    assert k.log[0][3:] == (4, 2, {"BLOCK": 16, "EVEN": True})
    assert k.log[1][1] == (3, 2, 1)  # the grid padded to three dims
    assert k.log[1][2][0] is x and k.log[1][2][1:] == (64, 0.5, 16, True)


@pytest.mark.parametrize("change", ["scalar", "scalar_type", "dtype", "alignment", "constexpr", "warps", "stages",
                                    "device"])
def test_anything_triton_specialises_on_goes_through_triton_again(change, monkeypatch):
    k = _kernel()
    base = torch.zeros(64)
    args, kw, warps, stages = (base, 64, 0.5), {"BLOCK": 16, "EVEN": True}, 4, 2
    launch.launch_kernel(k, (1,), args, warps, stages, **kw)
    if change == "scalar":
        args = (base, 65, 0.5)  # 65: not divisible by 16
    elif change == "scalar_type":
        args = (base, 64, 1)  # int 1 after float 0.5: another Triton signature
    elif change == "dtype":
        args = (base.half(), 64, 0.5)
    elif change == "alignment":
        args = (base[1:], 64, 0.5)  # data pointer 4 bytes past a 16-byte boundary
    elif change == "constexpr":
        kw = {"BLOCK": 32, "EVEN": True}
    elif change == "warps":
        warps = 8
    elif change == "device":  # a compiled kernel's handle belongs to the device it was loaded on
        monkeypatch.setattr(launch, "_device", lambda: 1)
    else:
        stages = 3
    launch.launch_kernel(k, (1,), args, warps, stages, **kw)
    launch.launch_kernel(k, (1,), args, warps, stages, **kw)
    assert [e[0] for e in k.log] == ["plain"] * 2 + ["direct"]


def test_constexprs_not_trailing_or_misnamed_keep_the_plain_path():
    mixed = FakeKernel([("X", False), ("BLOCK", True), ("n", False)])
    for _ in range(2):
        launch.launch_kernel(mixed, (1,), (torch.zeros(4), 4), 4, 1, BLOCK=16)
    assert [e[0] for e in mixed.log] == ["plain", "plain"]
    k, x = _kernel(), torch.zeros(4)
    for _ in range(2):  # constexprs given in another order than the kernel's: never called positionally
        launch.launch_kernel(k, (1,), (x, 4, 1.0), 4, 1, EVEN=True, BLOCK=16)
    assert [e[0] for e in k.log] == ["plain", "plain"]


def test_interpreter_and_settings_switch_take_the_plain_path(monkeypatch):
    k, x = _kernel(), torch.zeros(4)
    with settings.kernel_settings(fast_launch=False):
        for _ in range(2):
            launch.launch_kernel(k, (1,), (x, 4, 1.0), 4, 1, BLOCK=16, EVEN=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for _ in range(2):
        launch.launch_kernel(k, (1,), (x, 4, 1.0), 4, 1, BLOCK=16, EVEN=True)
    assert [e[0] for e in k.log] == ["plain"] * 4


def test_tensor_descriptors_key_on_dtype_and_block_shape():
    """A bias read through a TMA descriptor: Triton specialises on the base's dtype and the block shape (shape and
    strides are encoded per launch), so two descriptors that differ only in data share a compiled kernel and a
    new block shape or dtype does not."""
    td = pytest.importorskip("triton.tools.tensor_descriptor")
    a = torch.zeros(4, 40, 24)
    b = torch.ones(6, 40, 24)

    def desc(t, block):
        return td.TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    key = launch.signature([desc(a, [1, 32, 16]), 3])
    assert key == launch.signature([desc(b, [1, 32, 16]), 3])
    assert key != launch.signature([desc(a, [1, 16, 16]), 3])
    assert key != launch.signature([desc(a.half(), [1, 32, 16]), 3])
    hash(key)


def test_integers_key_on_what_triton_specialises_not_their_value():
    """A specialised int keys on (width, == 1, divisible by 16): 64 and 80 share a compiled kernel, 65 and 1 do
    not; a ``do_not_specialize`` int keys on its width only, so every length below 2**31 shares one."""
    k, x = FakeKernel([("X", False), ("n", False), ("L", False), ("BLOCK", True)], dns=("L",)), torch.zeros(4)
    runs = [(64, 200), (80, 201), (65, 207), (1, 16), (64, 1), (64, 2 ** 31)]
    for n, L in runs:
        launch.launch_kernel(k, (1,), (x, n, L), 4, 1, BLOCK=16)
    assert [e[0] for e in k.log] == ["plain", "direct", "plain", "plain", "direct", "plain"]
    assert k.log[1][2][1:] == (80, 201, 16)  # the direct call gets this launch's values (and BLOCK)
    assert launch._params(k)[0] == 3 and len(launch.STATE.compiled) == 4
    assert launch.signature((x, 64, 200), (True, True, False)) == launch.signature((x, 80, 17),
                                                                                           (True, True, False))
    assert launch.signature((True,)) != launch.signature((1,)) != launch.signature((1.0,))
    assert launch.signature((0.5,)) == launch.signature((1.0,))  # fp32, never specialised on its value


def test_integers_unspecialised_on_alignment_key_on_being_one_only():
    """A ``do_not_specialize_on_alignment`` int (a key stride that is 1 or a length) keys on == 1 only: 1 has its
    own compiled kernel, 48, 50 and 496 share one."""
    k, x = FakeKernel([("X", False), ("s", False), ("BLOCK", True)], dnsoa=("s",)), torch.zeros(4)
    for s in (48, 50, 496, 1, 1):
        launch.launch_kernel(k, (1,), (x, s), 4, 1, BLOCK=16)
    assert [e[0] for e in k.log] == ["plain", "direct", "direct", "plain", "direct"]
    assert launch._params(k)[1] == (2, 1, 2)
    assert launch.signature((x, 48), (2, 1)) == launch.signature((x, 50), (2, 1))
    assert launch.signature((x, 48), (2, 2)) != launch.signature((x, 50), (2, 2))


def test_bound_launches_the_remembered_kernel_with_new_leading_args():
    """``bound`` after a launch: a call with other tensors in the leading places goes straight to the compiled kernel
    with the fixed arguments and constexprs after them; None where the launch had to take Triton's plain path."""
    k, x, y = _kernel(), torch.zeros(64), torch.ones(64)
    launch.launch_kernel(k, (3,), (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=True)
    run = launch.bound(k, (3,), (x, 64, 0.5), 4, 2, 1, BLOCK=16, EVEN=True)
    run(y)
    assert k.log[-1][0] == "direct" and k.log[-1][1] == (3, 1, 1)
    assert k.log[-1][2][0] is y and k.log[-1][2][1:] == (64, 0.5, 16, True)
    assert launch.bound(k, (3,), (x, 64, 0.5), 4, 2, 1, BLOCK=32, EVEN=True) is None  # never launched so
    settings.update(fast_launch=False)
    assert launch.bound(k, (3,), (x, 64, 0.5), 4, 2, 1, BLOCK=16, EVEN=True) is None


def test_compile_only_holds_in_its_own_thread_only():
    """The tuner's compile-only block in one thread leaves another thread's launches running (they must not turn
    into compile-only warm-ups that launch nothing)."""

    k, x = _kernel(), torch.zeros(64)
    inside, done = threading.Event(), threading.Event()

    def other():
        inside.wait(5)
        launch.launch_kernel(k, (1,), (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=True)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with tuning.compile_only():
        inside.set()
        assert done.wait(5)
    thread.join()
    assert [e[0] for e in k.log] == ["plain"]


def test_background_compile_reports_pending_ready_and_failed(monkeypatch):
    """compile_in_background submits one job per signature, remembers its compiled kernel for direct launches
    (is_compiled) and reports a compile error as "failed" (the caller then compiles in its own thread)."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(tuning.TUNER, "jobs", {})
    monkeypatch.setattr(tuning.TUNER, "pool", ThreadPoolExecutor(1))
    monkeypatch.setattr(launch, "_device", lambda: -1)
    k, x = _kernel(), torch.zeros(64)
    go = threading.Event()
    k.warmup = lambda *args, grid, num_warps, num_stages, **c: (
        go.wait(30) and k.log.append(("warmup", grid, args, c)) or FakeCompiled(k.log))
    assert tuning.background_compiles()
    assert not launch.is_compiled(k, (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=True)
    assert launch.compile_in_background(k, (3,), (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=True) == "pending"
    assert tuning.wait_background(timeout=0.05) >= 0.04  # waited, then gave up while the compile is held
    assert attn_ops.wait_compiles(timeout=0.05) >= 0.04  # the public face of the same wait
    assert launch.compile_in_background(k, (3,), (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=True) == "pending"
    go.set()
    tuning.wait_background()  # what benchmarks call before timing a steady state: the job has ended after it
    assert launch.compile_in_background(k, (3,), (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=True) == "ready"
    assert launch.is_compiled(k, (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=True)
    assert [e[0] for e in k.log] == ["warmup"]
    launch.launch_kernel(k, (3,), (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=True)  # direct, on the background's kernel
    assert [e[0] for e in k.log] == ["warmup", "direct"]

    def broken(*args, **kw):
        raise RuntimeError("ptxas")

    k.warmup = broken
    monkeypatch.setattr(tuning.TUNER, "pool", ThreadPoolExecutor(1))
    launch.compile_in_background(k, (3,), (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=False)
    tuning.TUNER.pool.shutdown(wait=True)
    assert launch.compile_in_background(k, (3,), (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=False) == "failed"
    assert not launch.is_compiled(k, (x, 64, 0.5), 4, 2, BLOCK=16, EVEN=False)
    with settings.kernel_settings(fast_launch=False):
        assert not tuning.background_compiles()


def test_a_placeholder_answering_hasattr_is_not_remembered():
    """Triton 3.9's placeholder for a compile pending in another thread answers ``hasattr(x, "__getitem__")``
    through ``__getattr__`` but cannot be subscripted: it must not become a direct launch."""
    class Placeholder:
        def __getattr__(self, name):
            return lambda *a, **k: None

    k, x = _kernel(), torch.zeros(4)
    assert hasattr(Placeholder(), "__getitem__")
    assert not launch._direct_ok(k, (x, 64, 0.5), dict(BLOCK=16, EVEN=True), Placeholder())
    assert launch._direct_ok(k, (x, 64, 0.5), dict(BLOCK=16, EVEN=True), FakeCompiled([]))
