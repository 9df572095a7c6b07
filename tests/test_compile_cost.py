"""Triton's own compile cache, counted for real (scripts/compile_cost.py cross-compiles for sm_90 on any machine):
lengths that differ only in their remainder by 16 reuse the kernels compiled for the first of them, also where a
length is a stride (the ending-node triangle attention's transposed mask: 48 divides by 16, 50 and 61 do not).

The CPU suite imports the kernels under TRITON_INTERPRET=1 (interpreted functions, nothing to compile), so the run
goes to a fresh process without it; its Triton cache is a new empty folder.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from helpers import have_cuda_compiler  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.skipif(not have_cuda_compiler(), reason="Triton without its CUDA backend (ptxas): nothing to compile")
def test_lengths_differing_mod_16_compile_nothing_new_for_real():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "compile_cost.py"), "--lengths", "48,50,61", "--no-tune",
           "--threads", "1", "--kinds", "triangle,triangle_end"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {int(cells[0]): cells for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in res.stdout.splitlines())
            if cells[0].isdigit()}
    assert sorted(rows) == [48, 50, 61], res.stdout
    first = rows[48][3]
    # every kernel of a fwd + bwd with a broadcast bias compiled once per mask key stride (1 for the starting node,
    # N for the ending node's transposed mask; only the kernels that read the mask tell them apart)
    for kernel in ("fwd 2", "bwd_dkdv 2", "bwd_dq 2", "bwd_dbias 2", "bwd_preprocess 1", "sum_splits 1"):
        assert kernel in first, res.stdout
    assert rows[50][1] == "0" and rows[61][1] == "0", res.stdout
