"""Online-softmax attention over key chunks in pure PyTorch, with its own backward.

Forward and backward visit one ``[*batch, H, Lq, chunk]`` score tile at a time, so memory is
O(Lq * chunk) instead of O(Lq * Lk). Runs on any device; the CPU default and the fallback elsewhere.
"""
from __future__ import annotations


import torch

from .inputs import causal_mask, narrow_bcast, segment_mask

Tensor = torch.Tensor
DEFAULT_CHUNK = 256


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile_mask(mask, causal, lq, lk, start, stop, device, segment_ids=None):
    m = narrow_bcast(mask, -1, start, stop)
    if segment_ids is not None:  # [*b, 1, Lq, c]: this chunk's keys' ids against every query's
        sm = segment_mask(segment_ids, k_lo=start, k_hi=stop)
        m = sm if m is None else m & sm
    if causal:
        cm = causal_mask(lq, stop - start, device, q_offset=lk - lq, k_offset=start)
        m = cm if m is None else m & cm
    return m


def _scores(q, k_c, bias_c, mask_c, scale, acc):
    s = torch.matmul(q.to(acc), k_c.to(acc).transpose(-1, -2)) * scale  # [*b, H, Lq, c]
    if bias_c is not None:
        s = s + bias_c.to(acc)
    if mask_c is not None:
        s = s.masked_fill(~mask_c, float("-inf"))
    return s


def _sum_to(x: Tensor, shape) -> Tensor:
    """Sum x over the dims where ``shape`` has size 1 (the broadcast dims), keeping them."""
    dims = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return x.sum(dim=dims, keepdim=True) if dims else x


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, mask, scale, causal, chunk, q_ids, k_ids):
        seg = None if q_ids is None else (q_ids, k_ids)
        acc = _acc_dtype(q.dtype)
        lq, lk = q.shape[-2], k.shape[-2]
        row_max = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # [*b, H, Lq]
        row_sum = torch.zeros(q.shape[:-1], dtype=acc, device=q.device)
        out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc, device=q.device)  # [*b, H, Lq, Dv]
        for start in range(0, lk, chunk):
            stop = min(start + chunk, lk)
            s = _scores(q, k[..., start:stop, :], narrow_bcast(bias, -1, start, stop),
                        _tile_mask(mask, causal, lq, lk, start, stop, q.device, seg), scale, acc)
            new_max = torch.maximum(row_max, s.amax(-1))
            safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            p = torch.exp(s - safe_max.unsqueeze(-1))  # [*b, H, Lq, c]
            alpha = torch.exp(row_max - safe_max)
            row_sum = row_sum * alpha + p.sum(-1)
            out = out * alpha.unsqueeze(-1) + torch.matmul(p, v[..., start:stop, :].to(acc))
            row_max = new_max
        ok = row_sum > 0
        safe_sum = torch.where(ok, row_sum, torch.ones_like(row_sum))
        out = out / safe_sum.unsqueeze(-1)
        lse = torch.where(ok, row_max + torch.log(safe_sum), torch.full_like(row_sum, float("-inf")))
        out = out.to(q.dtype)
        lse = lse.to(_acc_dtype(q.dtype))
        ctx.save_for_backward(q, k, v, bias, mask, out, lse, q_ids, k_ids)
        ctx.scale, ctx.causal, ctx.chunk = scale, causal, chunk
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, bias, mask, out, lse, q_ids, k_ids = ctx.saved_tensors
        seg = None if q_ids is None else (q_ids, k_ids)
        dq, dk, dv, db = chunked_lse_backward(q, k, v, bias, mask, ctx.scale, ctx.causal, out, lse, d_out, d_lse,
                                              bias is not None and ctx.needs_input_grad[3], chunk_size=ctx.chunk,
                                              segment_ids=seg)
        return dq, dk, dv, db, None, None, None, None, None, None


def chunked_lse_backward(q, k, v, bias, mask, scale, causal, out, lse, d_out, d_lse, need_dbias,
                         chunk_size=DEFAULT_CHUNK, segment_ids=None):
    """Gradients of attention given its (out, lse), one key chunk at a time.

    ``out``/``lse`` may be the merged result over a larger key set (ring attention passes the merged
    ones): then these are exactly this key block's contributions. Returns ``(dq, dk, dv, dbias or None)``.
    """
    acc = _acc_dtype(q.dtype)
    lq, lk = q.shape[-2], k.shape[-2]
    if d_out is None:
        d_out = torch.zeros_like(out)
    d_out = d_out.to(acc)
    delta = (d_out * out.to(acc)).sum(-1)  # [*b, H, Lq]
    if d_lse is not None:
        delta = delta - d_lse.to(acc)
    lse_sub = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf"))).to(acc)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    db = torch.zeros(bias.shape, dtype=acc, device=q.device) if need_dbias else None
    for start in range(0, lk, chunk_size):
        stop = min(start + chunk_size, lk)
        k_c, v_c = k[..., start:stop, :].to(acc), v[..., start:stop, :].to(acc)
        s = _scores(q, k_c, narrow_bcast(bias, -1, start, stop),
                    _tile_mask(mask, causal, lq, lk, start, stop, q.device, segment_ids), scale, acc)
        p = torch.exp(s - lse_sub.unsqueeze(-1))  # [*b, H, Lq, c]
        dv[..., start:stop, :] = torch.matmul(p.transpose(-1, -2), d_out)
        dp = torch.matmul(d_out, v_c.transpose(-1, -2))
        ds = p * (dp - delta.unsqueeze(-1))  # dL/dS for this tile
        dq += torch.matmul(ds, k_c) * scale
        dk[..., start:stop, :] = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        if need_dbias:
            if bias.shape[-1] == 1:
                db += _sum_to(ds.sum(-1, keepdim=True), bias.shape)
            else:
                db[..., start:stop] = _sum_to(ds, bias.shape[:-1] + (stop - start,))
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None if db is None else db.to(bias.dtype))


def chunked_attention(q, k, v, bias, mask, scale, causal, deterministic=True, chunk_size=DEFAULT_CHUNK,
                      segment_ids=None):
    """Backend entry point: returns (out, lse). ``chunk_size`` = keys per tile; ``segment_ids`` = (q_ids,
    k_ids), each chunk's mask built from its slice of the key ids."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    q_ids, k_ids = (None, None) if segment_ids is None else segment_ids
    return _ChunkedAttention.apply(q, k, v, bias, mask, scale, causal, chunk_size, q_ids, k_ids)
