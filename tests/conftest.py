import os
import sys

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. Triton (and attn_ops'
# registry) read this at import, so it is set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No on-disk tuning cache in tests unless a test points one at its own folder (attn_ops.settings reads this once).
os.environ.setdefault("ATTN_ZOO_CACHE_DIR", "")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: slower CPU test")
    config.addinivalue_line("markers", "interpreter: runs kernels on CPU tensors (needs TRITON_INTERPRET=1)")


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", default=False,
                     help="run the slow tests too (by default they run only when -m names them: -m slow)")


# Interpreter-heavy grids: the fast suite keeps the cases whose id holds the slice named here (one dtype, one
# backward), the rest of each grid is marked slow.
FAST_SLICES = {
    "test_triton_cpu.py::test_matches_reference": "-float32-split",
    "test_triton_cpu.py::test_tma_bias_tiles_equal_pointer_loads": "full-float32-split",
    "test_triton_cpu.py::test_head_widths_match_reference": "d8_dv24_causal_lk129-float32-split",
    "test_triton_cpu.py::test_kernels_read_only_inside_lq_lk_d": "odd_lq_even_lk_causal-split",
    "test_triton_cpu.py::test_dbias_split_counts_match_reference": "two_splits",
    "test_triton_cpu.py::test_garbage_at_masked_keys_changes_nothing": "split-fp32",
    "test_triton_cpu.py::test_lse_backward_matches_autograd": "two_lead_dims",
    "test_segments.py::test_triton_matches_sequences": "-float32",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        keep = FAST_SLICES.get(f"{item.path.name}::{getattr(item, 'originalname', item.name)}")
        if keep is not None and keep not in item.callspec.id:
            item.add_marker(pytest.mark.slow)
    # The default run is the fast suite, for every commit; slow tests (interpreter-heavy grids, multi-process
    # runs, training runs, packaging) run with -m slow or --all, and CI runs both.
    if not config.getoption("--all") and "slow" not in (config.getoption("markexpr") or ""):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    if os.environ.get("TRITON_INTERPRET") != "1":  # a GPU machine: Triton compiles for the GPU, not CPU tensors
        no_interpreter = pytest.mark.skip(reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
        for item in items:
            if "interpreter" in item.keywords:
                item.add_marker(no_interpreter)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Each test starts with the triton backend's state reset (launch plans, compiled kernels, tuning picks): its first
    call of a geometry records, whatever ran before it, so tests that spy on the launchers do not depend on test
    order."""
    launch = sys.modules.get("attn_ops.triton.launch")
    if launch is not None:
        launch.STATE.reset()
    tuning = sys.modules.get("attn_ops.triton.tuning")
    if tuning is not None:
        tuning.TUNER.reset()
