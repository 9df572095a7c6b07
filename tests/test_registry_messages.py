"""The registry's error names what would work (backends that can, the option that would unlock one) and
never suggests a flag that cannot help."""
from dataclasses import replace

import pytest
import torch

from attn_ops import attention, registry
from attn_ops.inputs import AttnInputs

CPU_TRAIN = AttnInputs(device="cpu", dtype=torch.float32, head_dim=16, head_dim_v=16, has_bias=True, has_mask=False,
                       causal=False, needs_lse=False, needs_grad=True, bias_needs_grad=True, bias_is_broadcast=False,
                       lse_needs_grad=False, deterministic=True)


def _message(name, inputs):
    with pytest.raises(registry.UnsupportedInputs) as e:
        registry.select(name, inputs)
    return str(e.value)


def test_flex_on_cpu_names_working_backends_and_no_useless_flag():
    msg = _message("flex", CPU_TRAIN)
    assert "flex: no backward on cpu" in msg
    assert "deterministic=False" not in msg  # it cannot give flex a CPU backward
    assert "Backends that can: chunked, torch" in msg


def test_sdpa_on_cuda_names_the_flag_that_unlocks_it():
    cuda = replace(CPU_TRAIN, device="cuda", has_bias=False, bias_needs_grad=False)
    msg = _message("sdpa", cuda)
    assert "sdpa: backward is not deterministic on cuda (deterministic=False would allow it)" in msg
    lse = replace(cuda, needs_lse=True, lse_needs_grad=True)  # sdpa cannot give lse: the flag cannot help
    assert "deterministic=False" not in _message("sdpa", lse).split("Backends that can")[0]


def test_triton_on_cpu_names_chunked_and_the_interpreter(monkeypatch):
    b = registry.BACKENDS["triton"]
    monkeypatch.setitem(registry.BACKENDS, "triton", replace(b, devices=frozenset({"cuda"})))
    msg = _message("triton", CPU_TRAIN)
    assert "TRITON_INTERPRET=1" in msg and "chunked" in msg.split("Backends that can:")[1]


def test_other_backends_reasons_are_listed():
    msg = _message("sdpa", replace(CPU_TRAIN, needs_lse=True, lse_needs_grad=True))
    assert "Others:" in msg and "flex: no backward on cpu" in msg


def test_the_op_raises_the_same_message():
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    bias = torch.randn(1, 2, 8, 8, requires_grad=True)
    with pytest.raises(registry.UnsupportedInputs, match="Backends that can: chunked"):
        attention(q, q, q, bias, backend="flex")
