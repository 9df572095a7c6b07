"""Backend capabilities as data, the reasons a backend cannot serve some inputs, and ``auto`` selection.

This module is the one place where a backend is chosen.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence

import torch

from . import settings
from .inputs import AttnInputs

FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
LOW_AND_FP32 = frozenset({torch.float16, torch.bfloat16, torch.float32})
DEFAULT_TOLERANCE = {torch.float16: 2.0, torch.bfloat16: 2.0, torch.float32: 2.0, torch.float64: 2.0}


class UnsupportedInputs(ValueError):
    """No requested backend can serve the inputs; the message lists every backend's reasons."""


@dataclass(frozen=True)
class Backend:
    """What one backend supports. ``entry`` is ``"module:function"`` relative to ``attn_ops``."""

    name: str
    entry: str
    description: str
    devices: FrozenSet[str]
    dtypes: FrozenSet[torch.dtype]
    min_head_dim: int = 1
    max_head_dim: Optional[int] = None
    head_dim_multiple: int = 1  # head dims (D and Dv) must be multiples of this
    bias: bool = True
    bias_grad: bool = True
    broadcast_bias_grad: bool = True
    mask: bool = True
    causal: bool = True
    # causal with Lq > Lk, where the first Lq - Lk queries have no key (out 0, lse -inf by the contract)
    causal_rows_without_keys: bool = True
    lse: bool = True
    lse_grad: bool = True
    deterministic_bias_grad: bool = True  # bias gradient reduced without atomics
    # takes ``segment_ids=(q_ids, k_ids)`` (packed variable-length rows; see attn_ops.attention). A backend that
    # declares it must accept the keyword in its entry and, if it has one, in its lse_backward.
    segment_ids: bool = False
    # devices where the q/k/v backward gives the same bits every run; None = all of ``devices``
    deterministic_devices: Optional[FrozenSet[str]] = None
    grad_devices: Optional[FrozenSet[str]] = None  # devices where backward works; None = all of ``devices``
    options: FrozenSet[str] = field(default_factory=frozenset)
    requires: Optional[str] = None  # module that must import
    # "module:function" computing (dq, dk, dv, dbias) from saved (out, lse): lets ring attention run each
    # step's backward against the merged out/lse without recomputing the forward. None: not offered.
    lse_backward: Optional[str] = None
    # Forward memory beyond inputs and outputs, for planners (attn_zoo's inference path): ``score_buffers`` float32
    # tiles of ``[*batch, H, Lq, keys]`` held at once, keys = Lk or, with ``score_chunk``, that option's value
    # (default ``score_chunk_default``). 0: a fused kernel that holds no scores.
    score_buffers: int = 0
    # Workspace of the deterministic backward, an upper estimate in bytes per query-key pair of each problem (batch
    # dims x heads); refused above ``settings.cudnn_workspace_gib`` (the one backend with such a workspace), whether
    # named or picked by auto. 0: none that grows with Lq * Lk.
    det_bwd_pair_bytes: int = 0
    cuda_graphs: bool = True  # runs inside a CUDA graph capture (False: refused while the stream captures)
    score_chunk: Optional[str] = None
    score_chunk_default: Optional[int] = None
    # Tests bound this backend's error vs a float64 reference by tolerance * (plain PyTorch's error in the
    # same dtype) + a floor of a few ulps; see tests/helpers.py.
    tolerance: Dict[torch.dtype, float] = field(default_factory=lambda: dict(DEFAULT_TOLERANCE))

    def unavailable_reason(self) -> Optional[str]:
        return _probe(self.requires)

    def load(self, entry: Optional[str] = None) -> Callable:
        return _resolve(entry or self.entry)

    def load_lse_backward(self) -> Optional[Callable]:
        return None if self.lse_backward is None else self.load(self.lse_backward)


_PROBED: Dict[str, Optional[str]] = {}
_RESOLVED: Dict[str, Callable] = {}


def _probe(module: Optional[str]) -> Optional[str]:
    """Why ``module`` cannot be imported (None if it can); probed once, so compiled code only reads a dict."""
    if module is None:
        return None
    if module not in _PROBED:
        try:
            importlib.import_module(module)
            _PROBED[module] = None
        except Exception as exc:  # ImportError, or a broken install
            _PROBED[module] = f"{module} cannot be imported ({type(exc).__name__}: {exc})"
    return _PROBED[module]


def _resolve(entry: str) -> Callable:
    """The function named ``"module:function"`` (relative to attn_ops), imported once and cached."""
    if entry not in _RESOLVED:
        mod, fn = entry.split(":")
        _RESOLVED[entry] = getattr(importlib.import_module(f"attn_ops.{mod}" if mod else "attn_ops"), fn)
    return _RESOLVED[entry]


def warm_up() -> None:
    """Probe availability and import every available backend's functions (done at import of attn_ops),
    so that dispatch inside ``torch.compile`` is plain dict reads."""
    for b in BACKENDS.values():
        if b.unavailable_reason() is None:
            b.load()
            if b.lse_backward:
                b.load_lse_backward()


def _triton_devices() -> FrozenSet[str]:
    # The interpreter runs the kernels on CPU tensors (slowly): for tests and debugging only. Like Triton
    # itself, this reads TRITON_INTERPRET when attn_ops is first imported.
    return frozenset({"cuda", "cpu"}) if os.environ.get("TRITON_INTERPRET") == "1" else frozenset({"cuda"})


def _registry() -> Dict[str, Backend]:
    return {
        "torch": Backend(
            name="torch", entry="reference:attention_reference_backend",
            description="plain PyTorch reference; materialises [*batch, H, Lq, Lk] scores",
            devices=frozenset({"cpu", "cuda"}), dtypes=FLOATS, segment_ids=True,
            score_buffers=3,  # biased logits, masked logits, probabilities
        ),
        "chunked": Backend(
            name="chunked", entry="chunked:chunked_attention",
            description="online softmax over key chunks in PyTorch; memory O(Lq * chunk)",
            devices=frozenset({"cpu", "cuda"}), dtypes=FLOATS, options=frozenset({"chunk_size"}),
            lse_backward="chunked:chunked_lse_backward", segment_ids=True,
            score_buffers=4, score_chunk="chunk_size", score_chunk_default=256,  # logits, biased, exp, p @ v input
        ),
        "triton": Backend(
            name="triton", entry="triton:triton_attention",
            description="this project's fused Triton kernels",
            # any head dim in range: the kernels pad D, Dv to blocks of a power of two >= 16 (masked columns)
            devices=_triton_devices(), dtypes=LOW_AND_FP32, min_head_dim=8, max_head_dim=256,
            options=frozenset({"bwd"}), requires="attn_ops.triton", lse_backward="triton:triton_lse_backward",
            segment_ids=True,
        ),
        "sdpa": Backend(
            name="sdpa", entry="adapters:sdpa_attention",
            description="torch.nn.functional.scaled_dot_product_attention; bias as attn_mask; no lse",
            devices=frozenset({"cpu", "cuda"}), dtypes=FLOATS, lse=False, lse_grad=False,
            # its flash / memory-efficient CUDA backwards accumulate dq with atomics
            deterministic_devices=frozenset({"cpu"}), segment_ids=True,
            score_buffers=2,  # the bias-and-mask attn_mask broadcast to the scores, and the math kernel's logits
        ),
        "cudnn": Backend(
            name="cudnn", entry="adapters:cudnn_attention",
            description="cuDNN's fused attention through NVIDIA's cuDNN frontend (nvidia-cudnn-frontend): no bias "
                        "or mask; its deterministic backward, which torch's SDPA does not reach",
            devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}), min_head_dim=8,
            max_head_dim=128, head_dim_multiple=8, bias=False, bias_grad=False, broadcast_bias_grad=False,
            mask=False, causal_rows_without_keys=False, lse_grad=False, requires="cudnn.sdpa.fwd.torch_op",
            # cuDNN 9.19 on Hopper: the deterministic backward keeps dP, 2 bytes per pair (8 GiB at 16 x 16384^2)
            det_bwd_pair_bytes=2,
            cuda_graphs=False,  # the frontend's execute breaks a capture (cudaErrorStreamCaptureImplicit, H200)
        ),
        "flex": Backend(
            name="flex", entry="flex:flex_attention",
            description="flex_attention with a score_mod reading bias and mask; on CUDA compiled once per "
                        "length bucket (inputs padded)",
            devices=frozenset({"cpu", "cuda"}), grad_devices=frozenset({"cuda"}), dtypes=LOW_AND_FP32,
            # its compiled CUDA kernels refuse head dims < 16 (tl.dot's minimum; only the unfused path takes less)
            min_head_dim=16, deterministic_bias_grad=False, requires="torch.nn.attention.flex_attention",
            segment_ids=True,
        ),
    }


BACKENDS: Dict[str, Backend] = _registry()
AUTO = "auto"


def valid_names() -> List[str]:
    return [AUTO] + list(BACKENDS)


def validate_backend_name(name) -> str:
    """Return ``name`` if it is a known backend (or ``auto``); else a ValueError listing the valid names."""
    if not isinstance(name, str) or (name != AUTO and name not in BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; valid names: {', '.join(valid_names())}")
    return name


def get(name: str) -> Backend:
    validate_backend_name(name)
    return BACKENDS[name]


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never asked while torch.compile traces)."""
    return (not torch.compiler.is_compiling() and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing())


def not_supported_reasons(name: str, inputs: AttnInputs) -> List[str]:
    """Every reason why backend ``name`` cannot serve ``inputs`` (empty list: it can)."""
    b = get(name)
    reasons: List[str] = []
    why = b.unavailable_reason()
    if why:
        reasons.append(why)
    if inputs.device not in b.devices:
        hint = ""
        if name == "triton" and inputs.device == "cpu":
            hint = "; TRITON_INTERPRET=1 set before Python starts runs it on the CPU in Triton's interpreter (very slow: for debugging)"
        reasons.append(f"device {inputs.device} not supported (supports {sorted(b.devices)}{hint})")
    grad_devices = b.devices if b.grad_devices is None else b.grad_devices
    if inputs.needs_grad and inputs.device not in grad_devices:
        reasons.append(f"no backward on {inputs.device} (backward on {sorted(grad_devices)})")
    if inputs.dtype not in b.dtypes:
        reasons.append(f"dtype {inputs.dtype} not supported (supports {sorted(str(d) for d in b.dtypes)})")
    for what, d in (("q/k", inputs.head_dim), ("v", inputs.head_dim_v)):
        if d < b.min_head_dim or (b.max_head_dim is not None and d > b.max_head_dim):
            reasons.append(f"{what} head dim {d} outside [{b.min_head_dim}, {b.max_head_dim or 'any'}]")
        elif d % b.head_dim_multiple:
            reasons.append(f"{what} head dim {d} not a multiple of {b.head_dim_multiple}")
    if inputs.has_bias and not b.bias:
        reasons.append("bias not supported")
    if inputs.bias_needs_grad and not b.bias_grad:
        reasons.append("bias gradient not supported")
    if inputs.bias_needs_grad and inputs.bias_is_broadcast and not b.broadcast_bias_grad:
        reasons.append("gradient of a bias broadcast over batch dims not supported")
    if inputs.has_mask and not b.mask:
        reasons.append("mask not supported")
    if inputs.causal and not b.causal:
        reasons.append("causal not supported")
    if inputs.causal and inputs.lq > inputs.lk and not b.causal_rows_without_keys:
        reasons.append(f"causal with Lq {inputs.lq} > Lk {inputs.lk} (queries without a key) not supported")
    if inputs.has_segments and not b.segment_ids:
        reasons.append("segment_ids (packed variable-length rows) not supported")
    if inputs.needs_lse and not b.lse:
        reasons.append("does not return lse")
    if inputs.lse_needs_grad and not b.lse_grad:
        reasons.append("no gradient through lse")
    det_devices = b.devices if b.deterministic_devices is None else b.deterministic_devices
    if inputs.deterministic and inputs.needs_grad and inputs.device not in det_devices:
        reasons.append(f"backward is not deterministic on {inputs.device}")
    if inputs.deterministic and inputs.bias_needs_grad and not b.deterministic_bias_grad:
        reasons.append("bias gradient uses atomics, not deterministic")
    if not b.cuda_graphs and inputs.device == "cuda" and _capturing():
        reasons.append("cannot run inside a CUDA graph capture")
    if inputs.deterministic and inputs.needs_grad and b.det_bwd_pair_bytes:
        need = b.det_bwd_pair_bytes * inputs.problems * inputs.lq * inputs.lk
        limit = settings.get().cudnn_workspace_gib * 2 ** 30
        if need > limit:
            reasons.append(f"deterministic backward needs a {need / 2 ** 30:.2f} GiB workspace for {inputs.problems} "
                           f"problems of {inputs.lq} x {inputs.lk}, above attn_ops.settings' cudnn_workspace_gib="
                           f"{settings.get().cudnn_workspace_gib:g}")
    return reasons


CUDNN_AUTO_MIN_HEAD_DIM = 128
CUDNN_AUTO_MIN_WORK = 2 ** 28  # attended query-key pairs over all problems (causal: half of Lq * Lk)


def priority(inputs: AttnInputs) -> Sequence[str]:
    """Order in which ``auto`` tries backends."""
    if inputs.device == "cuda":
        # sdpa (cuDNN/flash) is fastest without a bias; with deterministic=True and gradients it is
        # rejected (atomics in its backward) and triton serves, or cudnn (cuDNN's deterministic backward, where
        # installed and its workspace fits) where it was measured faster in two runs: head dim 128 from 2^28
        # attended query-key pairs over all heads and batch on (H200, fwd+bwd: 1.0 against 1.3 ms [4,16,2048,128],
        # 2.1-2.2 against 2.7-2.8 causal [1,16,8192,128]); below that a call is host-bound and either may win; at
        # head dim 64 triton is faster at 8192 and at ESM's 1024 (cuDNN's deterministic dQ is a second matmul over
        # the kept score gradient), level at 16384 causal (docs/bench/cudnn_h200.md).
        work = inputs.problems * inputs.lq * inputs.lk // (2 if inputs.causal else 1)
        if not inputs.has_bias and not inputs.needs_lse:
            if inputs.head_dim >= CUDNN_AUTO_MIN_HEAD_DIM and work >= CUDNN_AUTO_MIN_WORK:
                return ("sdpa", "cudnn", "triton", "flex", "chunked", "torch")
            return ("sdpa", "triton", "flex", "cudnn", "chunked", "torch")
        return ("triton", "flex", "sdpa", "chunked", "torch")
    return ("chunked", "torch", "sdpa")


def select(name: str, inputs: AttnInputs) -> Backend:
    """Resolve ``name`` (or ``auto``) to a backend that can serve ``inputs``; else raise listing every reason."""
    validate_backend_name(name)
    candidates = priority(inputs) if name == AUTO else (name,)
    rejected = {}
    for cand in candidates:
        reasons = not_supported_reasons(cand, inputs)
        if not reasons:
            return get(cand)
        rejected[cand] = reasons
    raise UnsupportedInputs(unsupported_message(name, inputs, rejected))


def _unlocked_by_nondeterminism(name: str, inputs: AttnInputs) -> bool:
    """True when ``deterministic=False`` alone would let backend ``name`` serve ``inputs``."""
    return inputs.deterministic and not not_supported_reasons(name, replace(inputs, deterministic=False))


def unsupported_message(name: str, inputs: AttnInputs, rejected: Dict[str, List[str]]) -> str:
    """Why the requested backend(s) cannot serve ``inputs`` and what would: the backends that can as they
    are, and those that ``deterministic=False`` would allow (suggested only where it alone suffices)."""
    parts = []
    for n, r in rejected.items():
        unlock = " (deterministic=False would allow it)" if _unlocked_by_nondeterminism(n, inputs) else ""
        parts.append(f"{n}: {', '.join(r)}{unlock}")
    msg = f"no attention backend can serve these inputs (backend={name!r}). Rejected: {'; '.join(parts)}."
    order = list(priority(inputs)) + [n for n in BACKENDS if n not in priority(inputs)]
    others = [n for n in order if n not in rejected]
    can = [n for n in others if not not_supported_reasons(n, inputs)]
    unlock = [n for n in others if n not in can and _unlocked_by_nondeterminism(n, inputs)]
    cannot = [n for n in others if n not in can and n not in unlock]
    if can:
        msg += f" Backends that can: {', '.join(can)} (backend='{can[0]}', or 'auto')."
    if unlock:
        msg += f" With deterministic=False also: {', '.join(unlock)}."
    if not can and not unlock:
        msg += " No other backend can serve them either."
    if cannot:
        msg += " Others: " + "; ".join(f"{n}: {', '.join(not_supported_reasons(n, inputs))}" for n in cannot) + "."
    return msg


def forward_scratch_bytes(name: str, *, device: str, dtype: torch.dtype, head_dim: int, batch: int, lq: int,
                          lk: int, has_bias: bool = True, has_mask: bool = True, options=None) -> int:
    """Upper estimate of the bytes backend ``name`` (``auto``: as resolved for these inputs, without gradients)
    holds during a forward beyond its inputs and outputs: its score tiles for ``batch`` (batch dims times heads)
    attention problems of ``lq`` queries and ``lk`` keys. 0 when no backend can serve the inputs."""
    inputs = AttnInputs(device=device, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, has_bias=has_bias,
                        has_mask=has_mask, causal=False, needs_lse=False, needs_grad=False, bias_needs_grad=False,
                        bias_is_broadcast=has_bias, lse_needs_grad=False, deterministic=True, problems=batch,
                        lq=lq, lk=lk)
    try:
        b = select(name, inputs)
    except UnsupportedInputs:
        return 0
    keys = lk
    if b.score_chunk is not None:
        keys = min(lk, int((options or {}).get(b.score_chunk, b.score_chunk_default)))
    return b.score_buffers * 4 * batch * lq * keys


def available() -> List[str]:
    """Backends usable in this process (importable and supporting some local device)."""
    local = {"cpu"} | ({"cuda"} if torch.cuda.is_available() else set())
    names = []
    for n in BACKENDS:
        b = get(n)
        if b.unavailable_reason() is None and b.devices & local:
            names.append(n)
    return names
