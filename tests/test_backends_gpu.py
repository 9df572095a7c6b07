"""The PyTorch-side backends on CUDA (bf16/fp16/fp32), gradients included: flex's and sdpa's GPU paths and
chunked on the GPU. The triton backend has its own GPU tests."""
import pytest
import torch

from helpers import check_against_reference, empty_some_rows, make_inputs

pytestmark = pytest.mark.gpu

SHAPES = {  # (batch, H, Lq, Lk, D, bias shape, mask shape, causal)
    "pair-bias-over-rows": ((1, 8), 4, 67, 67, 32, (1, 1, 4, 67, 67), (1, 8, 1, 1, 67), False),
    "dense-bias-causal": ((2,), 4, 96, 160, 64, (2, 4, 96, 160), None, True),
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("backend", ["chunked", "sdpa", "flex"])
def test_gpu_backend_matches_reference(backend, dtype, name):
    batch, h, lq, lk, d, bshape, mshape, causal = SHAPES[name]
    q, k, v, bias, mask = make_inputs(batch, h, lq, lk, d, dtype=dtype, bias_shape=bshape, mask_shape=mshape,
                                      seed=11, device="cuda")
    if mask is not None:
        empty_some_rows(mask)
    opts = {"deterministic": False} if backend in ("flex", "sdpa") else {}  # atomics in their CUDA backward
    check_against_reference(backend, q, k, v, bias, mask, causal=causal, **opts)
