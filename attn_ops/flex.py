"""The ``flex`` backend: ``flex_attention`` with a score_mod that reads the bias and mask through indices.

On CUDA it stays compiled across lengths. Each call is zero-padded up to length buckets (see
:func:`bucket_length`, :func:`bucket_batch`), the padded keys are masked through the score_mod, and a block
mask built from the real lengths makes the kernels skip the padded tiles; the padded query rows and batch
entries are sliced off. So a data set of varying lengths compiles once per bucket, not once per length, and
the compile count stays far below Dynamo's recompile limit, which this module raises for its own function
only while it compiles a new bucket. If flex cannot stay fused (compile failure, too many buckets) it says
so once per reason and runs flex unfused. Off CUDA, flex runs unfused (materialised scores), forward only.
"""
from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from functools import cache

import torch
import torch.nn.functional as F

from .inputs import combine_masks

Tensor = torch.Tensor

BLOCK = 128  # flex's default sparse block size: the unit of the block mask and of the length buckets
MAX_COMPILES = 128  # padded shapes compiled per process before new ones run unfused (with a warning)
_PLAN_CACHE_SIZE = 256

_COMPILED: set = set()  # compile keys (padded shapes, dtypes, structure) compiled so far
_UNFUSED: dict = {}  # compile key -> reason it runs unfused
_WARNED: set = set()  # reasons already warned about
_PLANS: OrderedDict[tuple, tuple] = OrderedDict()


def _grid(n: int, quantum: int) -> int:
    """``n`` rounded up to a multiple of ``max(quantum, a quarter of the power of two below n)``."""
    step = max(quantum, 1 << max(0, (n - 1).bit_length() - 3))
    return -(-n // step) * step


def bucket_length(n: int) -> int:
    """Padded size of a query/key length ``n``: a multiple of 128 up to 512, then 4 sizes per octave (640, 768,
    896, 1024, 1280, ...).

    Multiples of 128 are whole tiles of flex's block mask and kernels (no boundary checks, and a padded tile is
    skipped, so padding within a tile costs no compute); 4 per octave above 512 keep padded memory within 25%
    with 4 compiles per doubling of length.
    """
    if n < 1:
        raise ValueError(f"length must be >= 1, got {n}")
    return _grid(n, BLOCK)


def bucket_batch(n: int) -> int:
    """Padded size of a leading batch dim ``n`` (R = L for triangle attention): exact up to 8, then 4 sizes per
    octave, and the length buckets above 128, so R = L pads like L."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    return bucket_length(n) if n > BLOCK else _grid(n, 1)


def _warn_once(reason: str, message: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(message, UserWarning, stacklevel=6)  # the caller of attn_ops.attention


def _index(t: Tensor, lead_sizes, b, *tail):
    """``t[b0, b1, ..., *tail]`` for a flattened batch index ``b`` (``tail`` = h, q_idx[, kv_idx]); dims of
    size 1 (broadcast) are read at 0."""
    idx = []
    rest = b
    for i in range(len(lead_sizes) - 1, -1, -1):
        idx.append(0 if t.shape[i] == 1 else rest % lead_sizes[i])
        rest = rest // lead_sizes[i]
    idx.reverse()
    n = len(lead_sizes)
    idx += [0 if t.shape[n + j] == 1 else x for j, x in enumerate(tail)]
    return t[tuple(idx)]


def _score_mod(bias, mask, live, lead, causal, shift):
    """score + bias, -inf where ``mask`` (or causal) hides a key; a dead row (``live`` False: no key to attend)
    keeps its scores so that it gives no NaN (its output is zeroed afterwards)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        if bias is not None:
            score = score + _index(bias, lead, b, h, q_idx, kv_idx).to(score.dtype)
        keep = None
        if mask is not None:
            keep = _index(mask, lead, b, h, q_idx, kv_idx)
        if causal:
            c = kv_idx <= q_idx + shift
            keep = c if keep is None else keep & c
        if keep is not None:
            if live is not None:
                keep = keep | ~_index(live, lead, b, h, q_idx)
            score = torch.where(keep, score, -float("inf"))
        return score

    return score_mod


def _flex_call(q, k, v, bias, mask, live, block_mask, scale, lead, causal, shift):
    """flex_attention on ``[N, H, L, D]`` q, k, v; bias/mask/live have the padded lead dims ``lead``.
    Returns (out, lse). Compiled on CUDA; also the eager path."""
    from torch.nn.attention import flex_attention as fa

    score_mod = _score_mod(bias, mask, live, lead, causal, shift)
    if hasattr(fa, "AuxRequest"):
        out, aux = fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                     return_aux=fa.AuxRequest(lse=True))
        return out, aux.lse
    return fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, return_lse=True)


def _eager(*args):
    with warnings.catch_warnings():
        # Unfused is intended here (CPU, or a reason already warned about by this module).
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex_call(*args)


@cache
def _compiled():
    # fullgraph: a graph break or Dynamo's recompile limit raises instead of running flex unfused in silence.
    return torch.compile(_flex_call, fullgraph=True, dynamic=False)


def _live_rows(mask: Tensor | None, causal: bool, lq: int, lk: int, device) -> Tensor | None:
    """[..., Lq or 1, 1] True where a query row has at least one key to attend; None if every row has one."""
    if mask is None and causal:
        if lk >= lq:
            return None
        return (torch.arange(lq, device=device) + (lk - lq) >= 0)[:, None]  # [Lq, 1]
    full = combine_masks(mask, causal, lq, lk, device)
    return None if full is None else full.any(-1, keepdim=True)


def _pad_to(t: Tensor, sizes, value=0) -> Tensor:
    """``t`` zero-padded (``value``) at the end of each dim up to ``sizes``; dims of size 1 stay 1 (broadcast).
    Always contiguous, so one padded shape has one stride pattern (one compile)."""
    target = [1 if s == 1 else n for s, n in zip(t.shape, sizes)]
    pad = []
    for s, n in zip(reversed(t.shape), reversed(target)):
        pad += [0, n - s]
    if any(pad):
        return F.pad(t, pad, value=value)
    return t.contiguous()


def _plan(lead, lead_b, lq, lk, lq_b, lk_b, causal, ndim, device):
    """(block mask, key-valid mask) for real sizes padded to buckets; cached (a few small tensors per entry).

    The block mask lists, per query tile, the key tiles holding a real key the tile's real rows may see
    (causal: up to the diagonal); padded tiles, padded batch entries and query tiles past the real rows get
    none, so the kernels skip them. The key-valid mask ``[1, ..., 1, Lk_b]`` hides padded keys when there is no
    user mask to carry them (None when Lk is not padded)."""
    key = (lead, lead_b, lq, lk, lq_b, lk_b, causal, ndim, str(device))
    hit = _PLANS.get(key)
    if hit is not None:
        _PLANS.move_to_end(key)
        return hit
    from torch.nn.attention.flex_attention import BlockMask

    nq, nk = lq_b // BLOCK, lk_b // BLOCK
    nk_real = -(-lk // BLOCK)
    last_row = torch.clamp(torch.arange(1, nq + 1) * BLOCK, max=lq) - 1  # [nq]
    counts = torch.full((nq,), nk_real, dtype=torch.int64)
    if causal:
        counts = torch.clamp(torch.div(last_row + (lk - lq), BLOCK, rounding_mode="floor") + 1, 0, nk_real)
    counts = torch.where(torch.arange(nq) * BLOCK < lq, counts, torch.zeros_like(counts))
    valid = torch.ones((), dtype=torch.bool)
    for n, nb in zip(lead, lead_b):  # flattened row-major, as q.reshape(N, ...)
        valid = (valid[..., None] & (torch.arange(nb) < n)).reshape(-1)
    valid = valid.reshape(-1)
    if bool(valid.all()):
        num = counts.reshape(1, 1, nq)
    else:
        num = torch.where(valid[:, None], counts[None, :], 0).reshape(-1, 1, nq)
    idx = torch.arange(nk, dtype=torch.int32).expand(num.shape[0], 1, nq, nk).contiguous()
    block_mask = BlockMask.from_kv_blocks(num.to(torch.int32).to(device), idx.to(device), BLOCK_SIZE=BLOCK,
                                          seq_lengths=(lq_b, lk_b))
    key_valid = None
    if lk_b != lk:
        key_valid = (torch.arange(lk_b, device=device) < lk).reshape((1,) * (ndim - 1) + (lk_b,))
    plan = _PLANS[key] = (block_mask, key_valid)
    if len(_PLANS) > _PLAN_CACHE_SIZE:
        _PLANS.popitem(last=False)
    return plan


def _finish(out, lse, live):
    """Dead rows: out 0, lse -inf; lse float32 (float64 for float64 inputs)."""
    lse = lse.to(torch.float64 if out.dtype == torch.float64 else torch.float32)
    if live is not None:
        out = torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))
        lse = torch.where(live.squeeze(-1), lse, torch.full((), float("-inf"), device=lse.device))
    return out, lse


def _shift(causal: bool, lq: int, lk: int) -> int:
    """The causal diagonal's offset Lk - Lq; 0 when not causal, so that it is no compile-time constant then."""
    return lk - lq if causal else 0


def _run_unpadded(q, k, v, bias, mask, scale, causal, runner):
    lead = tuple(q.shape[:-3])
    n = math.prod(lead) if lead else 1
    lq, lk = q.shape[-2], k.shape[-2]
    live = _live_rows(mask, causal, lq, lk, q.device)  # [..., Lq, 1]
    live_idx = None if live is None else live.squeeze(-1)
    if live_idx is not None and live_idx.ndim < q.ndim - 1:
        live_idx = live_idx.reshape((1,) * (q.ndim - 1 - live_idx.ndim) + tuple(live_idx.shape))
    q4, k4, v4 = (t.reshape((n,) + t.shape[-3:]) for t in (q, k, v))  # [N, H, L, D]
    out, lse = runner(q4, k4, v4, bias, mask, live_idx, None, scale, lead, causal, _shift(causal, lq, lk))
    out = out.reshape(q.shape[:-1] + v.shape[-1:])
    return _finish(out, lse.reshape(q.shape[:-1]), live)


def _run_padded(q, k, v, bias, mask, scale, causal, runner):
    """Pad to buckets, run ``runner`` (``_flex_call``'s signature) on the padded inputs, drop the padding."""
    nd = q.ndim
    lead = tuple(q.shape[:-3])
    lead_b = tuple(bucket_batch(s) for s in lead)
    h, lq, lk = q.shape[-3], q.shape[-2], k.shape[-2]
    lq_b, lk_b = bucket_length(lq), bucket_length(lk)
    block_mask, key_valid = _plan(lead, lead_b, lq, lk, lq_b, lk_b, causal, nd, q.device)
    live = _live_rows(mask, causal, lq, lk, q.device)  # [..., Lq or 1, 1] (unpadded, for the final zeroing)
    live_p = None
    if live is not None:  # padded rows and batch entries count as dead: their finite garbage is dropped
        live_idx = live.squeeze(-1)
        live_idx = live_idx.reshape((1,) * (nd - 1 - live_idx.ndim) + tuple(live_idx.shape))
        live_p = _pad_to(live_idx, lead_b + (h, lq_b), value=False)
    full = lead_b + (h, lq_b, lk_b)
    q4 = _pad_to(q, lead_b + (h, lq_b, q.shape[-1])).reshape(-1, h, lq_b, q.shape[-1])  # [N_b, H, Lq_b, D]
    k4 = _pad_to(k, lead_b + (h, lk_b, k.shape[-1])).reshape(-1, h, lk_b, k.shape[-1])  # [N_b, H, Lk_b, D]
    v4 = _pad_to(v, lead_b + (h, lk_b, v.shape[-1])).reshape(-1, h, lk_b, v.shape[-1])  # [N_b, H, Lk_b, Dv]
    bias_p = None if bias is None else _pad_to(bias, full)  # its gradient is sliced back to bias's own shape
    mask_p = key_valid if mask is None else _pad_to(mask, full, value=False)
    out, lse = runner(q4, k4, v4, bias_p, mask_p, live_p, block_mask, scale, lead_b, causal,
                      _shift(causal, lq, lk))
    keep = tuple(slice(0, s) for s in lead) + (slice(None), slice(0, lq))
    out = out.reshape(lead_b + (h, lq_b, v.shape[-1]))[keep]  # [*batch, H, Lq, Dv]
    lse = lse.reshape(lead_b + (h, lq_b))[keep]  # [*batch, H, Lq]
    return _finish(out, lse, live)


def _compile_key(args):
    q, k, v, bias, mask, live, block_mask, scale, lead, causal, shift = args
    grad = torch.is_grad_enabled()
    meta = tuple(None if t is None else (tuple(t.shape), t.dtype, t.requires_grad)
                 for t in (q, k, v, bias, mask, live))
    return (q.device, meta, tuple(block_mask.kv_num_blocks.shape), scale, lead, causal, shift, grad)


def _recompile_room(n: int):
    """Dynamo's per-function recompile limit raised to at least ``n`` while ``_flex_call`` compiles a new bucket
    (its compiles are bounded by MAX_COMPILES, not by the limit meant for runaway recompiles)."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{name: max(getattr(cfg, name), n)})


def _fused(*args):
    """``_flex_call`` compiled, or eager with a one-time warning (per reason) when it cannot stay compiled."""
    import torch._dynamo
    from torch._dynamo.exc import TorchDynamoException

    limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", TorchDynamoException)
    key = _compile_key(args)
    unfused = _UNFUSED.get(key)  # (reason, message)
    if unfused is None and key not in _COMPILED and len(_COMPILED) >= MAX_COMPILES:
        unfused = _UNFUSED[key] = ("cap", (f"flex backend: {MAX_COMPILES} padded shapes compiled already "
                                           "(attn_ops.flex.MAX_COMPILES); new shapes run flex unfused "
                                           "(materialised scores, slow)"))
    if unfused is not None:
        _warn_once(*unfused)
        return _eager(*args)
    try:
        if key in _COMPILED:
            try:
                return _compiled()(*args)
            except limit_hit:  # a guard this module does not model failed (e.g. an autocast change)
                pass
        with _recompile_room(len(_COMPILED) + 8):
            result = _compiled()(*args)
        _COMPILED.add(key)
        return result
    except (TorchDynamoException, limit_hit) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        unfused = _UNFUSED[key] = (type(exc).__name__, (
            f"flex backend: flex_attention could not be compiled for q {tuple(args[0].shape)} {args[0].dtype} "
            f"({type(exc).__name__}: {first}); running it unfused (materialised scores, slow)"))
        _warn_once(*unfused)
        return _eager(*args)


def flex_attention(q, k, v, bias, mask, scale, causal, deterministic=True, segment_ids=None) -> tuple[Tensor, Tensor]:
    """The ``flex`` backend (canonical inputs: bias/mask have q.ndim dims). Returns (out, lse float32).
    ``segment_ids`` are folded into the mask (equal ids attend), which the padded path reads like any mask."""
    if segment_ids is not None:
        from .inputs import fold_segments

        mask = fold_segments(mask, segment_ids)
    if torch.compiler.is_compiling():
        return _run_unpadded(q, k, v, bias, mask, scale, causal, _flex_call)  # the caller's compile fuses it
    if q.device.type != "cuda":
        return _run_unpadded(q, k, v, bias, mask, scale, causal, _eager)
    return _run_padded(q, k, v, bias, mask, scale, causal, _fused)
