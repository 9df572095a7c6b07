"""The kernels' loops as Triton's pipeliner leaves them for Hopper, compiled offline (``scripts/kernel_ir.py``; no GPU
needed): what a kernel's key loop waits on each iteration is fixed by its code, not by the machine."""
import json
import os
import subprocess
import sys

import pytest

# Compiling the kernels offline to inspect their IR takes a while (a module fixture): the slow suite.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = """
import json, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {scripts!r})
import kernel_ir as K

out = {{}}
for name, kernel, in_range in (("fwd_ragged", "fwd", False), ("fwd_in_range", "fwd", True), ("dq_ragged", "dq", False),
                               ("dkdv_ragged", "dkdv", False)):
    loops = K.loop_loads(K.compile_ttgir(kernel, K.constexprs(kernel, in_range=in_range)))
    out[name] = [dict(asynchronous=l["async"], sync=l["sync"], prefetch=l["prefetch"], waiting=l["waiting_copies"])
                 for l in loops]
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
    """Per kernel variant, its loops' asynchronous copies, the loads an iteration waits on, register prefetches and
    copies predicated on a load (in a fresh process: the test process runs Triton's interpreter, whose kernels
    cannot be compiled)."""
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
    tiles are asynchronous copies, and none of them is predicated on a synchronously loaded value (before
    ``596ee92`` K's copy took the key-mask row as its predicate: every iteration waited on that load). The mask row
    the logits' select reads is the one load left."""
    (loop,) = loops["fwd_ragged"]
    assert loop["asynchronous"] >= 3
    assert loop["waiting"] == [], loop
    assert len(loop["sync"]) == 1 and loop["sync"][0].startswith("common.py:")


def test_dq_and_in_range_forward_keep_pipelined_copies(loops):
    """Tiles in range (the forward) and the dQ kernel keep K rows of masked keys zeroed through a mask-predicated copy
    (docs/bench/history.md); their bias, K and V still go through asynchronous copies, and no other
    load is waited on."""
    for name in ("fwd_in_range", "dq_ragged"):
        (loop,) = loops[name]
        assert loop["asynchronous"] >= 3, name
        assert len(loop["sync"]) <= 2, (name, loop)


def test_dkdv_loop_waits_on_no_load(loops):
    """The dK/dV pass (the largest kernel of the backward) copies q, dO, lse and delta asynchronously and prefetches
    the bias tile into registers an iteration ahead: no load of its query loop is waited on where it is issued."""
    (loop,) = loops["dkdv_ragged"]
    assert loop["asynchronous"] >= 4
    assert loop["sync"] == [] and loop["waiting"] == [] and len(loop["prefetch"]) == 1, loop


# ---------------------------------------------------------------------------------------------- the TTGIR reader
def _kernel_ir():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import kernel_ir
    finally:
        sys.path.pop(0)
    return kernel_ir


_LOOP = """  tt.func @k(%a: !tt.ptr<f32>) {
    %c = arith.constant 0 : i32 loc(#loc1)
    %r:2 = scf.for %i = %c to %c step %c iter_args(%x = %c, %y = %c) -> (i32, i32) : i32 {
      %p = tt.load %a : !tt.ptr<f32> loc(#loc2)
      %q = tt.load %a : !tt.ptr<f32> loc(#loc3)
      %u = tt.load %a : !tt.ptr<f32> loc(#loc4)
      %cond = arith.cmpf one, %q, %q : f32 loc(#loc1)
      %w = scf.if %cond -> (f32) {
        scf.yield %u : f32 loc(#loc1)
      } else {
        scf.yield %u : f32 loc(#loc1)
      } loc(#loc1)
      %cp = ttg.async_copy_global_to_local %a, %s mask %cond : tensor loc(#loc5)
      %n:1 = scf.for %j = %c to %c step %c iter_args(%z = %p) -> (f32) : i32 {
        %v = tt.load %a : !tt.ptr<f32> loc(#loc6)
        scf.yield %v : f32 loc(#loc1)
      } loc(#loc1)
      scf.yield %p, %w : i32, i32 loc(#loc1)
    } loc(#loc1)
    %last = tt.load %a : !tt.ptr<f32> loc(#loc7)
    tt.return loc(#loc1)
  } loc(#loc1)
#loc1 = loc("k.py":1:1)
#loc2 = loc("k.py":2:1)
#loc3 = loc("k.py":3:1)
#loc4 = loc("k.py":4:1)
#loc5 = loc("k.py":5:1)
#loc6 = loc("k.py":6:1)
#loc7 = loc(callsite(#loc8 at #loc1))
#loc8 = loc("helper"(#loc9))
#loc9 = loc("h.py":9:1)
"""


def test_loop_reader_on_handwritten_ir():
    """What the reader tells apart, on a hand-written loop: a load used by a nested loop (p: waited on, though the
    loop's own yield also carries it), one used in the iteration through a condition (q), one used only through an
    ``scf.if``'s yield (u: waited on, not a prefetch), a copy predicated on a loaded value, a nested loop's load
    only carried by its own yield (a prefetch), and source lines through call sites and named locations."""
    k = _kernel_ir()
    outer, inner = k.loop_loads(_LOOP)
    assert outer["sync"] == ["k.py:2", "k.py:3", "k.py:4"] and outer["prefetch"] == []
    assert outer["async"] == 1 and outer["waiting_copies"] == ["k.py:5"]
    assert inner["sync"] == [] and inner["prefetch"] == ["k.py:6"] and inner["waiting_copies"] == []
    assert k._source_lines(_LOOP)["#loc7"] == "h.py:9"
