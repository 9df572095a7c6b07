"""The kernels' loops as Triton's pipeliner leaves them for Hopper, compiled offline (``scripts/kernel_ir.py``; no GPU
needed): what a kernel's key loop waits on each iteration is fixed by its code, not by the machine."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = """
import json, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {scripts!r})
import kernel_ir as K
out = {{}}
for name, kernel, in_range in (("fwd_ragged", "fwd", False), ("fwd_in_range", "fwd", True), ("dq_ragged", "dq", False),
                               ("dkdv_ragged", "dkdv", False)):
    loops = K.loop_loads(K.compile_ttgir(kernel, K.constexprs(kernel, in_range=in_range)))
    out[name] = [dict(asynchronous=l["async"], sync=l["sync"], prefetch=l["prefetch"]) for l in loops]
print("RESULT " + json.dumps(out))
"""


def _nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.fixture(scope="module")
def loops():
    """Per kernel variant, its loops' asynchronous copies, the loads an iteration waits on and register prefetches (a fresh process: the test session
    runs Triton's interpreter, whose kernels cannot be compiled)."""
    if not _nvidia_backend():
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = _PROBE.format(root=ROOT, scripts=os.path.join(ROOT, "scripts"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_forward_ragged_tiles_copy_k_without_waiting_on_the_mask(loops):
    """Key mask + pair bias on ragged tiles (any length that is not a tile multiple): the key loop's bias, K and V
    tiles are asynchronous copies, and one load an iteration waits on remains (the mask row for the logits' select):
    K's copy does not take a synchronously loaded mask as its predicate (it did before ``596ee92``: two loads)."""
    (loop,) = loops["fwd_ragged"]
    assert loop["asynchronous"] >= 3
    assert len(loop["sync"]) == 1 and loop["sync"][0].startswith("common.py:")


def test_forward_and_dq_keep_pipelined_copies(loops):
    """Tiles in range (the forward) and the dQ kernel keep K rows of masked keys zeroed through a mask-predicated copy
    (two mask loads per iteration, docs/bench/issue20_h200.md "Stop 40"); their bias, K and V still go through
    asynchronous copies, and nothing else is loaded synchronously."""
    for name in ("fwd_in_range", "dq_ragged"):
        (loop,) = loops[name]
        assert loop["asynchronous"] >= 3, name
        assert len(loop["sync"]) <= 2, (name, loop)


def test_dkdv_loop_waits_on_no_load(loops):
    """The dK/dV pass (the largest kernel of the backward) copies q, dO, lse and delta asynchronously and prefetches
    the bias tile into registers an iteration ahead: no load of its query loop is waited on where it is issued."""
    (loop,) = loops["dkdv_ragged"]
    assert loop["asynchronous"] >= 4
    assert loop["sync"] == [] and len(loop["prefetch"]) == 1, loop
