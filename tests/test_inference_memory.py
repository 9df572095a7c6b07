"""The memory-bounded Pairformer block's extra memory on the CPU, measured: at most the plan's estimate, and far
below today's row-chunked path. torch's CPU allocator keeps no peak counter, so (as in test_chunked_memory.py) a
fresh subprocess samples its resident set from a thread while the block runs, with glibc mmapping every tensor
buffer so that freed memory leaves the resident set. The GPU version (allocator statistics) is in
test_inference.py."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os, threading, time, torch
from attn_zoo.models.pairformer import PairformerBlock
from attn_zoo.models.inference import _RESERVE_BYTES, Dims, estimate_plain_memory, plan_inference, score_bytes_of
torch.set_num_threads(2)
PAGE = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

def extra_peak(fn):
    base, peak, done = rss(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)
    t = threading.Thread(target=sample); t.start()
    try:
        out = fn()
    finally:
        done.set(); t.join()
    return max(peak[0], rss()) - base

N = 256
torch.manual_seed(0)
blk = PairformerBlock(c_s=64, num_heads_single=4, attention="torch").eval()
with torch.no_grad():
    for p in blk.parameters():
        p.normal_(0.0, p.shape[-1] ** -0.5)
s, z = torch.randn(1, N, 64), torch.randn(1, N, N, 128)
single = torch.ones(1, N, dtype=torch.bool); single[:, -5:] = False
pair = single[:, :, None] & single[:, None, :]
small = (s[:, :16].clone(), z[:, :16, :16].clone(), single[:, :16].clone(), pair[:, :16, :16].clone())
with torch.no_grad():  # warm up kernels and thread pools on a small input
    blk(*small, chunk_size=8); blk.forward_inference(*small, chunk_size=8, mode="bounded")
    z_bytes = z.numel() * 4
    plan = plan_inference(Dims.of(blk), N, None, dtype=torch.float32, chunk_size=4)
    bounded = extra_peak(lambda: blk.forward_inference(s, z, single, pair, chunk_size=4, mode="bounded"))
    plain = extra_peak(lambda: blk(s, z, single, pair, chunk_size=16))
# the estimate assumes a fused attention backend; the torch backend adds a chunk's scores (logits, softmax, biased)
scores = 3 * 4 * 4 * N * N * 4
plain_est = estimate_plain_memory(Dims.of(blk), N, 16, dtype=torch.float32,
                                  scores=score_bytes_of(blk, torch.device("cpu"), torch.float32))
print(json.dumps({"z": z_bytes, "bounded": bounded, "plain": plain,
                  "estimate": plan.estimate.extra - _RESERVE_BYTES + scores,
                  "plain_estimate": plain_est.extra - _RESERVE_BYTES}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_bounded_block_memory_on_cpu():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=root, timeout=600,
                         env={**os.environ, "PYTHONPATH": root, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout.strip().splitlines()[-1])
    z = st["z"]
    # the result (a new z) and triangle multiplication's stored projection are two z; the rest is chunks of 4 rows
    assert 1.5 * z < st["bounded"] <= st["estimate"] < 2.6 * z, {k: v / z for k, v in st.items()}
    assert st["plain"] > 2 * st["bounded"], {k: v / z for k, v in st.items()}
    # the plain path's estimate (what the auto choice compares with the budget) bounds it (within the resident set's
    # page and allocator overhead, a few percent) and not loosely
    assert st["plain"] <= 1.03 * st["plain_estimate"] < 2 * st["plain"], {k: v / z for k, v in st.items()}
