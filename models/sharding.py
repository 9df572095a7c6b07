"""The Pairformer and Evoformer stacks over the ranks of a ``torch.distributed`` process group: the pair tensor
split by rows (``docs/sharding.md``).

Each of the ``P`` ranks holds rows ``I_r = [r n, (r+1) n)`` of the pair tensor, ``z_r [B, n, N', c_z]``, and the
same residues of the single representation, ``s_r [B, n, c_s]``, or of the MSA, ``m_r [B, S', n, c_m]``; ``N' = P n``
is N padded up to a multiple of P (the padding is masked out, so real positions are exact). The masks are passed
whole to every rank (one byte a pair). The blocks and their parameters are the stack's own: one ``state_dict``
serves the single-process and the sharded stack, and the blocks know nothing of the group.

Per block, in the order it runs (1-D row sharding, FastFold's DAP scheme):
- triangle multiplication outgoing ``x_ij = sum_k a_ik b_jk``: rows i of ``a`` are local, ``b`` is all-gathered;
- incoming ``x_ij = sum_k a_ki b_kj``: the columns ``I_r`` of ``a`` by an all-to-all, ``b`` all-gathered;
- triangle attention around the starting node: rows attend along themselves, the bias ``[H, N', N']`` (H channels)
  all-gathered;
- around the ending node and the pair transition: on the transposed pair tensor (an all-to-all puts columns on
  ranks as rows), then transposed back;
- attention with pair bias: query rows ``I_r`` with their bias rows (local), keys and values from the gathered
  ``LN(s)``; the single transition on local rows;
- Evoformer: the MSA row attention on this rank's sequences (m resharded there and back, the bias gathered), the
  column attention and transition on the local residues, the outer product mean with ``b`` gathered.
The local contribution of each product is computed while the gather is in flight.

Gradients are exact: every collective is an ``autograd.Function`` whose backward is its adjoint (all-gather ->
reduce-scatter, the transposing all-to-all -> itself), and the products' Functions keep only local operands,
gathering again in the backward. The loss is the sum of the ranks' losses on their shards; each rank's parameter
gradients are its share, summed over the group by ``reduce_gradients``. Dropout masks are drawn whole and sliced,
so every rank of the group must start from the same RNG state.

Without autograd in eval mode each rank runs an in-place chunked path built from ``attn_zoo.models.inference``'s
pieces: the incoming product on z^T (the outgoing form with a and b swapped), both products by channel groups, so
a rank holds its rows, the product of its rows and one group's operands, never a whole projection.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from . import inference
from .inference import _gated_projection, _spans, _transition_fn, pair_bias, rows_update_
from .kernels import layer_norm_rows
from .evoformer import _Stack as EvoformerStacks, _default_masks as evoformer_masks
from .pairformer import PairformerStack, _default_masks as pairformer_masks
from .primitives import LineDropout, SharedDropout, at_least_fp32, chunk_rows, run_blocks

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------------
# Collectives: a buffer with the group's ranks as its leading dim
# --------------------------------------------------------------------------------------------------
# (newer PyTorch renames the flat-buffer collectives; the old names warn there)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_into(buf: Tensor, x: Tensor, group, async_op: bool = False):
    """Every rank's ``x`` into ``buf [P, *x.shape]`` (``x`` may be this rank's entry of ``buf``)."""
    flat = buf.view(buf.shape[0] * buf.shape[1], *buf.shape[2:]) if x.ndim else buf
    return _ALL_GATHER(flat, x, group=group, async_op=async_op)


def _gather(x: Tensor, group, async_op: bool = False):
    """``[P, *x.shape]``: every rank's ``x`` (with ``async_op`` also the work handle)."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    buf = x.new_empty(world, *x.shape)
    work = _gather_into(buf, x, group, async_op)
    return (buf, work) if async_op else buf


def _exchange(send: Tensor, group, async_op: bool = False):
    """All-to-all of ``send [P, ...]``: entry s goes to rank s; entry s of the result came from rank s."""
    send = send.contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    return (recv, work) if async_op else recv


def _reduce_scatter(blocks: Tensor, group) -> Tensor:
    """``sum over ranks of blocks[rank]`` for ``blocks [P, ...]``."""
    blocks = blocks.contiguous()
    out = blocks.new_empty(blocks.shape[1:])
    _REDUCE_SCATTER(out, blocks.flatten(0, 1), group=group)
    return out


class _AllGather(torch.autograd.Function):
    """The ranks' ``x`` concatenated along ``dim``; backward: the reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group = dim % x.ndim, group
        return _gather(x, group).movedim(0, ctx.dim).flatten(ctx.dim, ctx.dim + 1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        world = dist.get_world_size(ctx.group)
        blocks = grad.unflatten(ctx.dim, (world, -1)).movedim(ctx.dim, 0)  # [P, *x.shape]
        return _reduce_scatter(blocks, ctx.group), None, None


def _transpose_send(z: Tensor, group, async_op: bool = False):
    """Send ``z``'s column blocks transposed: the all-to-all of :func:`_transpose_blocks` (with ``async_op`` also
    the work handle); :func:`_transpose_recv` assembles what comes back."""
    world = dist.get_world_size(group)
    send = z.unflatten(-2, (world, z.shape[-3])).movedim(-3, 0).transpose(-2, -3)  # [P, *, n_j, n_i, c]
    return _exchange(send, group, async_op)  # entry s: [*, n_j (mine), n_i (rank s's rows), c]


def _transpose_recv(recv: Tensor) -> Tensor:
    return recv.movedim(0, -3).flatten(-3, -2)  # [*, n_j, P n_i, c]


def _transpose_blocks(z: Tensor, group) -> Tensor:
    """Rows of ``z^T`` from rows of ``z``: ``z_r [*, n, N', c] -> zt_r [*, n, N', c]`` with ``zt_r[*, j, i] =
    z[*, i, r n + j]`` (one all-to-all)."""
    return _transpose_recv(_transpose_send(z, group))


class _Transpose(torch.autograd.Function):
    """:func:`_transpose_blocks` with its adjoint (the inverse permutation: itself) as backward."""

    @staticmethod
    def forward(ctx, z: Tensor, group) -> Tensor:
        ctx.group = group
        return _transpose_blocks(z, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _transpose_blocks(grad, ctx.group), None


# --------------------------------------------------------------------------------------------------
# The triangle products over sharded rows
# --------------------------------------------------------------------------------------------------
class _OutgoingProduct(torch.autograd.Function):
    """``x[*, c, i, j] = sum_k a[*, c, i, k] b[*, c, j, k]`` for local rows i of ``a, b [*, C, n, N']`` and all j
    (``b`` gathered). Only the local operands are saved: the backward gathers ``b`` again."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, group) -> Tensor:
        ctx.group = group
        ctx.save_for_backward(a, b)
        rank = dist.get_rank(group)
        bs, work = _gather(b, group, async_op=True)
        local = torch.matmul(a, b.transpose(-1, -2))  # computed while b travels
        work.wait()
        return torch.cat([local if s == rank else torch.matmul(a, bs[s].transpose(-1, -2))
                          for s in range(bs.shape[0])], dim=-1)  # [*, C, n, N']

    @staticmethod
    def backward(ctx, dx: Tensor):
        a, b = ctx.saved_tensors
        dx = dx.to(a.dtype)
        bs = _gather(b, ctx.group)  # [P, *, C, n, N']
        n = a.shape[-2]
        da = sum(torch.matmul(dx[..., s * n:(s + 1) * n], bs[s]) for s in range(bs.shape[0]))
        db = torch.stack([torch.matmul(dx[..., s * n:(s + 1) * n].transpose(-1, -2), a)
                          for s in range(bs.shape[0])])  # [P, *, C, n_j, N']: rank s's rows j
        return da, _reduce_scatter(db, ctx.group), None


def _incoming_operands(a: Tensor, b: Tensor, group, async_op: bool = False):
    """Columns ``I_r`` of ``a`` from every rank (entry s: ``a[K_s, I_r]``, ``[*, C, n_k, n_i]``) and every rank's
    ``b`` (entry s: ``b[K_s, :]``)."""
    world = dist.get_world_size(group)
    send = a.unflatten(-1, (world, a.shape[-2])).movedim(-2, 0)  # [P, *, C, n_k, n_i]: columns I_s to rank s
    if async_op:  # (a_cols, work, b_all, work)
        return _exchange(send, group, True) + _gather(b, group, True)
    return _exchange(send, group), _gather(b, group)


class _IncomingProduct(torch.autograd.Function):
    """``x[*, c, i, j] = sum_k a[*, c, k, i] b[*, c, k, j]`` for local rows i and all j, from local rows k of
    ``a, b [*, C, n, N']``: ``a``'s columns ``I_r`` by an all-to-all, ``b`` gathered."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, group) -> Tensor:
        ctx.group = group
        ctx.save_for_backward(a, b)
        rank, n = dist.get_rank(group), a.shape[-2]
        ar, w1, bs, w2 = _incoming_operands(a, b, group, async_op=True)
        x = torch.matmul(a[..., rank * n:(rank + 1) * n].transpose(-1, -2), b)  # the local k while data travels
        w1.wait()
        w2.wait()
        for s in range(bs.shape[0]):
            if s != rank:
                x = x + torch.matmul(ar[s].transpose(-1, -2), bs[s])  # [*, C, n_i, N']
        return x

    @staticmethod
    def backward(ctx, dx: Tensor):
        a, b = ctx.saved_tensors
        dx = dx.to(a.dtype)
        ar, bs = _incoming_operands(a, b, ctx.group)
        dar = torch.matmul(bs, dx.transpose(-1, -2))  # [P, *, C, n_k, n_i]: gradient of a[K_s, I_r]
        db = torch.matmul(ar, dx)  # [P, *, C, n_k, N']: gradient of b[K_s, :]
        da = _exchange(dar, ctx.group).movedim(0, -2).flatten(-2)  # entry s: my a[K_r, I_s]
        return da, _reduce_scatter(db, ctx.group), None


# --------------------------------------------------------------------------------------------------
# The group and the rows a rank holds
# --------------------------------------------------------------------------------------------------
class _Shard:
    """A process group, this rank's place in it and the local row count ``n`` of a padded length ``N' = P n``."""

    def __init__(self, group, n: int, checkpoint: bool = False):
        self.group = group
        self.checkpoint = checkpoint  # activation checkpointing of every module update
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.n = n

    def rows(self, t: Tensor, dim: int = -2) -> Tensor:
        """This rank's rows of a whole (replicated) tensor along ``dim``."""
        return t.narrow(dim, self.rank * self.n, self.n)


def _dropout(mod: nn.Module, x: Tensor, sh: _Shard) -> Tensor:
    """The block's pair dropout on local rows ``x [B, n, N', C]``, for a module that drops along rows (a row-wise
    one on z, or a column-wise one on z^T): the full mask is drawn (the same on every rank) and sliced."""
    if not mod.training or mod.p == 0.0:
        return x
    if isinstance(mod, SharedDropout):  # one mask shared by all rows: [B, 1, N', C]
        shape = (x.shape[0], 1, x.shape[-2], x.shape[-1])
        keep = torch.empty(shape, device=x.device, dtype=x.dtype).bernoulli_(1.0 - mod.p)
    elif isinstance(mod, LineDropout):  # one draw per row: [B, N', 1, 1], this rank's rows
        shape = (x.shape[0], sh.world * sh.n, 1, 1)
        keep = sh.rows(torch.empty(shape, device=x.device, dtype=x.dtype).bernoulli_(1.0 - mod.p), -3)
    else:
        raise TypeError(f"sharded pair dropout supports SharedDropout and LineDropout, got {type(mod).__name__}")
    return x * keep.div_(1.0 - mod.p)


# --------------------------------------------------------------------------------------------------
# One Pairformer block on local rows, with autograd
# --------------------------------------------------------------------------------------------------
def _gated_ab(mod: nn.Module, zn: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """``a, b = sigmoid(Linear_g(zn)) * Linear_p(zn)``, zeroed at masked pairs, channels-first ``[*, C, n, N']``."""
    y = (mod.linear_ab_g(zn).sigmoid() * mod.linear_ab_p(zn)) * mask.unsqueeze(-1).to(zn.dtype)  # [*, n, N', 2C]
    a, b = y.movedim(-1, -3).split(mod.c_hidden, dim=-3)
    return a.contiguous(), b.contiguous()


def triangle_multiplication(mod: nn.Module, z: Tensor, mask_rows: Tensor, sh: _Shard,
                            chunk_size: Optional[int]) -> Tensor:
    """``mod``'s update of local rows ``z [B, n, N', c_z]`` (``mask_rows [B, n, N']``)."""
    zn = mod.layer_norm_in(z)
    a, b = _gated_ab(mod, zn, mask_rows)
    product = _OutgoingProduct if mod.outgoing else _IncomingProduct
    x = product.apply(a, b, sh.group).movedim(-3, -1)  # [B, n, N', C]
    g = mod.linear_g(zn)

    def out(x_rows: Tensor, g_rows: Tensor) -> Tensor:
        return mod.linear_z(mod.layer_norm_out(x_rows)) * torch.sigmoid(g_rows)

    return chunk_rows(out, [x, g], [-3, -3], chunk_size, out_dim=-3)


def triangle_attention(mod: nn.Module, z: Tensor, mask_rows: Tensor, sh: _Shard, chunk_size: Optional[int]) -> Tensor:
    """``mod``'s update of local rows attending along themselves (z for the starting node, z^T for the ending
    node); the pair bias of all rows gathered."""
    zn = mod.layer_norm(z)
    q, k, v, g, bias = mod.mha.project(zn, zn, extra=[mod.linear_bias])  # [B, n, N', H*C] / [B, n, N', H]
    bias = _AllGather.apply(bias.movedim(-1, -3).contiguous(), -2, sh.group).unsqueeze(-4)  # [B, 1, H, N', N']
    mask = mask_rows[..., :, None, None, :]  # [B, n, 1, 1, N']
    return chunk_rows(lambda q, k, v, g, m: mod.mha.attend(q, k, v, g, bias, m),
                      [q, k, v, g, mask], [-3, -3, -3, -3, -4], chunk_size, out_dim=-3)


def attention_pair_bias(mod: nn.Module, s: Tensor, z: Tensor, single_mask: Tensor, sh: _Shard,
                        chunk_size: Optional[int]) -> Tensor:
    """AF3 Alg. 24 for the local query rows ``s [B, n, c_s]``: bias rows from local ``z``, keys from all of LN(s)."""
    sn = mod.layer_norm_s(s)
    sn_all = _AllGather.apply(sn, -2, sh.group)  # [B, N', c_s]
    bias = mod.linear_z(mod.layer_norm_z(z)).movedim(-1, -3)  # [B, H, n, N']
    mask = single_mask[:, None, None, :]  # [B, 1, 1, N']
    return chunk_rows(lambda q, b: mod.mha(q, sn_all, bias=b, mask=mask), [sn, bias], [-2, -2], chunk_size,
                      out_dim=-2)


def _residual(sh: _Shard, fn, x: Tensor, *others: Tensor) -> Tensor:
    """``x + fn(x, *others)``; with ``sh.checkpoint`` (and grad on) under activation checkpointing: only the inputs
    are kept, and the backward recomputes the update, its collectives and its dropout draws (the RNG state is
    restored) in the same order on every rank."""
    if sh.checkpoint and torch.is_grad_enabled():
        return x + torch.utils.checkpoint.checkpoint(fn, x, *others, use_reentrant=False)
    return x + fn(x, *others)


def pair_stack(blk: nn.Module, z: Tensor, pair_mask: Tensor, sh: _Shard, c: Optional[int]) -> Tensor:
    """The pair half shared by both blocks on local rows ``z [B, n, N', c_z]``: triangle multiplications, triangle
    attentions, pair transition (the ending node and the transition on z^T)."""
    rows, cols = sh.rows(pair_mask), sh.rows(pair_mask.transpose(-1, -2))  # [B, n, N'] of z and z^T
    row_drop, col_drop = blk.pair_dropout_row, blk.pair_dropout_col
    z = _residual(sh, lambda x: _dropout(row_drop, triangle_multiplication(blk.tri_mul_out, x, rows, sh, c), sh), z)
    z = _residual(sh, lambda x: _dropout(row_drop, triangle_multiplication(blk.tri_mul_in, x, rows, sh, c), sh), z)
    z = _residual(sh, lambda x: _dropout(row_drop, triangle_attention(blk.tri_att_start, x, rows, sh, c), sh), z)
    zt = _Transpose.apply(z, sh.group)  # rows of z^T: columns of z
    zt = _residual(sh, lambda x: _dropout(col_drop, triangle_attention(blk.tri_att_end, x, cols, sh, c), sh), zt)
    zt = _residual(sh, lambda x: blk.pair_transition(x, c), zt)
    return _Transpose.apply(zt, sh.group)


def pairformer_block(blk: nn.Module, s: Tensor, z: Tensor, single_mask: Tensor, pair_mask: Tensor, sh: _Shard,
                     chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``PairformerBlock.forward`` on local rows: ``s [B, n, c_s]``, ``z [B, n, N', c_z]``, whole masks."""
    c = chunk_size
    z = pair_stack(blk, z, pair_mask, sh, c)
    with torch.autocast(s.device.type, enabled=False) if blk.single_fp32 else contextlib.nullcontext():
        if blk.single_fp32:  # Boltz-2: the single track in float32, autocast off
            s, z = at_least_fp32(s), at_least_fp32(z)
        apb = blk.attention_pair_bias
        s = _residual(sh, lambda x, zz: attention_pair_bias(apb, x, zz, single_mask, sh, c), s, z)
        s = _residual(sh, lambda x: blk.single_transition(x, c), s)
        if blk.post_norm_s is not None:
            s = blk.post_norm_s(s)
    return s, z


# --------------------------------------------------------------------------------------------------
# One Pairformer block on local rows, in place without autograd
# --------------------------------------------------------------------------------------------------
def _channel_slices(c: int, groups: int):
    """``groups`` near-equal slices of ``range(c)`` (fewer when c is small)."""
    groups = max(1, min(groups, c))
    cuts = [c * i // groups for i in range(groups + 1)]
    return [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def _group_projection(wb: Tuple[Tensor, Optional[Tensor]], c: int, g: slice) -> Tuple[Tensor, Optional[Tensor]]:
    """Channels ``g`` of a ``[gate | projection]`` weight ``[2C, c_z]`` and bias."""
    w, b = wb
    rows = lambda t: torch.cat([t[g], t[c + g.start:c + g.stop]])  # noqa: E731
    return rows(w), None if b is None else rows(b)


def triangle_multiplication_(mod: nn.Module, z: Tensor, mask_rows: Tensor, sh: _Shard, chunk: int, groups: int,
                             proj_chunk: int) -> Tensor:
    """``z += mod(z)`` in place on local rows ``z [B, n, N', c_z]`` (``mask_rows [B, n, N']``): outgoing on rows of
    z; incoming on rows of z^T (the caller transposes), where ``x^T[j, i] = sum_k b[k, j] a[k, i]`` is the outgoing
    form with ``a`` and ``b`` swapped.

    The product ``x [C, n, N']`` of the local rows is accumulated ``groups`` channel groups at a time: the gathered
    operand of a group comes from all ranks (computed by chunks of ``proj_chunk`` rows), so a rank holds x and one
    group's operands, never the whole projection; z is written, by chunks of ``chunk`` rows, after the last group."""
    for bi in range(z.shape[0]):
        _triangle_multiplication_one_(mod, z[bi], mask_rows[bi], sh, chunk, groups, proj_chunk)
    return z


def _triangle_multiplication_one_(mod: nn.Module, z: Tensor, mask: Tensor, sh: _Shard, chunk: int, groups: int,
                                  proj_chunk: int) -> None:
    c, n, world, rank = mod.c_hidden, z.shape[0], sh.world, sh.rank
    w_a, w_b = _gated_projection(mod, 0), _gated_projection(mod, 1)
    w_local, w_all = (w_a, w_b) if mod.outgoing else (w_b, w_a)  # x[i, j] = sum_k local[i, k] all[j, k]
    dev = z.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else z.dtype  # the GEMMs' output
    x = z.new_empty(c, n, z.shape[1], dtype=dtype)  # [C, n(i), N'(j)]
    for g in _channel_slices(c, groups):
        cg = g.stop - g.start
        # both operands' gates, then both projections: one GEMM on LN(z) for the two
        wa, wl = _group_projection(w_all, c, g), _group_projection(w_local, c, g)
        w = torch.cat([wa[0][:cg], wl[0][:cg], wa[0][cg:], wl[0][cg:]])  # [4Cg, c_z]
        bias = None if wa[1] is None else torch.cat([wa[1][:cg], wl[1][:cg], wa[1][cg:], wl[1][cg:]])
        gathered = z.new_empty(world, cg, n, z.shape[1], dtype=dtype)  # [P, Cg, n, N']: every rank's rows
        local = z.new_empty(cg, n, z.shape[1], dtype=dtype)
        for idx in _spans(n, proj_chunk):
            zn = layer_norm_rows(z[idx], mod.layer_norm_in)
            both = inference._gated_channels_first(zn, (w, bias), mask[idx], 2 * cg)  # [2Cg, R N']
            del zn
            gathered[rank, :, idx] = both[:cg].view(cg, -1, z.shape[1])
            local[:, idx] = both[cg:].view(cg, -1, z.shape[1])
            del both
        work = _gather_into(gathered, gathered[rank], sh.group, async_op=True)
        xg = x[g]  # [Cg, n, N'], contiguous
        xg[:, :, rank * n:(rank + 1) * n] = torch.matmul(local, gathered[rank].transpose(-1, -2))  # while it travels
        work.wait()
        for s in range(world):
            if s != rank:
                xg[:, :, s * n:(s + 1) * n] = torch.matmul(local, gathered[s].transpose(-1, -2))
        del local, gathered, xg
    for idx in _spans(n, chunk):
        zc = z[idx]  # [R, N', c_z]
        g = mod.linear_g(layer_norm_rows(zc, mod.layer_norm_in)).sigmoid_()
        upd = mod.linear_z(layer_norm_rows(x[:, idx], mod.layer_norm_out, channels_first=True))  # [R, N', c_z]
        zc.addcmul_(upd, g)
        del upd, g


def _gathered_bias(z: Tensor, layer_norm: nn.Module, linear: nn.Module, sh: _Shard, chunk: int) -> Tensor:
    """The pair bias of all rows, ``[B, H, N', N']``, from the local rows ``z``."""
    local = pair_bias(z, layer_norm, linear, chunk)  # [B, H, n, N']
    return _gather(local, sh.group).permute(1, 2, 0, 3, 4).flatten(2, 3)


def triangle_attention_(mod: nn.Module, z: Tensor, mask_rows: Tensor, sh: _Shard, chunk: int) -> Tensor:
    """``z += update`` in place for local rows attending along themselves (z: starting node, z^T: ending)."""
    bias = _gathered_bias(z, mod.layer_norm, mod.linear_bias, sh, chunk).unsqueeze(-4)  # [B, 1, H, N', N']
    for idx in _spans(z.shape[-3], chunk):
        zr = z[..., idx, :, :]
        zn = layer_norm_rows(zr, mod.layer_norm)
        q, k, v, g = mod.mha.project(zn, zn)
        del zn
        zr += mod.mha.attend(q, k, v, g, bias, mask_rows[..., idx, None, None, :])
    return z


def _transpose_(z: Tensor, sh: _Shard, groups: int) -> Tensor:
    """``z`` overwritten with its transposed rows (:func:`_transpose_blocks`), ``groups`` channel groups at a time:
    a group is written once it has been sent, and the next group is packed and sent while one travels, so the
    buffers on the way are those of two groups."""
    pending = None
    for g in _channel_slices(z.shape[-1], groups):
        recv, work = _transpose_send(z[..., g], sh.group, async_op=True)
        if pending is not None:
            pending[2].wait()
            z[..., pending[0]] = _transpose_recv(pending[1])
        pending = (g, recv, work)
    pending[2].wait()
    z[..., pending[0]] = _transpose_recv(pending[1])
    return z


def pair_stack_(blk: nn.Module, z: Tensor, pair_mask: Tensor, sh: _Shard, chunk: int, groups: int) -> Tensor:
    """:func:`pair_stack` in place without autograd. The incoming product and the ending node run on z^T: four
    transposes (one group of channels at a time), no buffer of z's size."""
    rows, cols = sh.rows(pair_mask), sh.rows(pair_mask.transpose(-1, -2))
    # the projection phase runs beside x and a group's operands: its LN(z) and projections (c_z + 6 Cg values a
    # pair) within an eighth of z's rows, in chunks longer than the others (fewer launches)
    cg = -(-blk.tri_mul_out.c_hidden // max(1, groups))
    proj_chunk = max(chunk, z.shape[-3] * z.shape[-1] // (8 * (z.shape[-1] + 6 * cg)))
    triangle_multiplication_(blk.tri_mul_out, z, rows, sh, chunk, groups, proj_chunk)
    _transpose_(z, sh, groups)
    triangle_multiplication_(blk.tri_mul_in, z, cols, sh, chunk, groups, proj_chunk)
    _transpose_(z, sh, groups)
    triangle_attention_(blk.tri_att_start, z, rows, sh, chunk)
    _transpose_(z, sh, groups)
    triangle_attention_(blk.tri_att_end, z, cols, sh, chunk)
    rows_update_(z, -3, chunk, _transition_fn(blk.pair_transition))
    return _transpose_(z, sh, groups)


def pairformer_block_(blk: nn.Module, s: Tensor, z: Tensor, single_mask: Tensor, pair_mask: Tensor, sh: _Shard,
                      chunk: int, groups: int = 8) -> Tuple[Tensor, Tensor]:
    """:func:`pairformer_block` without autograd, ``z`` updated in place by chunks of ``chunk`` rows (the triangle
    products and the transposes by ``groups`` channel groups); returns ``(s, z)``."""
    pair_stack_(blk, z, pair_mask, sh, chunk, groups)
    fp32 = blk.single_fp32
    with torch.autocast(s.device.type, enabled=False) if fp32 else contextlib.nullcontext():
        s = at_least_fp32(s) if fp32 else s
        mod = blk.attention_pair_bias
        bias = pair_bias(z, mod.layer_norm_z, mod.linear_z, chunk, fp32)  # [B, H, n, N']
        sn = mod.layer_norm_s(s)
        sn_all = _gather(sn, sh.group).movedim(0, 1).flatten(1, 2)  # [B, N', c_s]
        mask = single_mask[:, None, None, :]
        s = s + chunk_rows(lambda q, b: mod.mha(q, sn_all, bias=b, mask=mask), [sn, bias], [-2, -2], chunk,
                           out_dim=-2)
        s = s + blk.single_transition(s, chunk)
        if blk.post_norm_s is not None:
            s = blk.post_norm_s(s)
    return s, z


# --------------------------------------------------------------------------------------------------
# The Evoformer's MSA half: m split by residue columns, by sequences for the row attention
# --------------------------------------------------------------------------------------------------
def _reshard(x: Tensor, src: int, dst: int, group) -> Tensor:
    """From this rank's slab along ``src`` (whole along ``dst``) to its slab along ``dst`` (whole along ``src``);
    ``src``, ``dst`` non-negative. One all-to-all."""
    world = dist.get_world_size(group)
    send = x.unflatten(dst, (world, -1)).movedim(dst, 0)  # [P, ...]: block s along dst goes to rank s
    recv = _exchange(send, group)  # entry s: rank s's slab along src, my block along dst
    return recv.movedim(0, src).flatten(src, src + 1)


class _Reshard(torch.autograd.Function):
    """:func:`_reshard` with the reverse resharding as backward."""

    @staticmethod
    def forward(ctx, x: Tensor, src: int, dst: int, group) -> Tensor:
        ctx.src, ctx.dst, ctx.group = src % x.ndim, dst % x.ndim, group
        return _reshard(x, ctx.src, ctx.dst, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reshard(grad, ctx.dst, ctx.src, ctx.group), None, None, None


def _sequences(msa_mask: Tensor, sh: _Shard) -> Tensor:
    """This rank's sequences of the whole ``msa_mask [B, S', N']``."""
    s_loc = msa_mask.shape[-2] // sh.world
    return msa_mask.narrow(-2, sh.rank * s_loc, s_loc)


def msa_row_attention(mod: nn.Module, m: Tensor, z: Tensor, seq_mask: Tensor, sh: _Shard,
                      chunk_size: Optional[int]) -> Tensor:
    """AF2 Alg. 7 for this rank's sequences ``m [B, s, N', c_m]`` (``seq_mask [B, s, N']``): the pair bias of the
    local rows of z, gathered."""
    mn = mod.layer_norm_m(m)
    bias = mod.linear_z(mod.layer_norm_z(z)).movedim(-1, -3).contiguous()  # [B, H, n, N']
    bias = _AllGather.apply(bias, -2, sh.group).unsqueeze(-4)  # [B, 1, H, N', N']
    mask = seq_mask[..., :, None, None, :]  # [B, s, 1, 1, N']
    return chunk_rows(lambda x, k: mod.mha(x, x, bias=bias, mask=k), [mn, mask], [-3, -4], chunk_size, out_dim=-3)


def _opm_rows(mod: nn.Module, a_rows: Tensor, b_flat: Tensor, count_rows: Tensor) -> Tensor:
    """``OuterProductMean`` for rows i: ``a_rows [B, S, R, C]``, ``b_flat [B, S, N*C]``, ``count_rows [B, R, N]``."""
    ni, cc = a_rows.shape[-2], mod.c_hidden
    outer = torch.matmul(a_rows.flatten(-2).transpose(-1, -2), b_flat)  # [B, R*C, N*C]
    outer = outer.unflatten(-1, (-1, cc)).unflatten(-3, (ni, cc)).transpose(-2, -3).flatten(-2)  # [B, R, N, C*C]
    out = nn.functional.linear(outer, mod.linear_out.weight)  # [B, R, N, c_z]
    out = out / (count_rows.unsqueeze(-1) + mod.eps).to(out.dtype)
    return out if mod.linear_out.bias is None else out + mod.linear_out.bias.to(out.dtype)


def _opm_operands(mod: nn.Module, m: Tensor, msa_mask: Tensor, sh: _Shard, gather):
    """``a`` of the local residues, ``b`` of all (``gather``), the pair counts of the local rows ``[B, n, N']``."""
    mn = mod.layer_norm(m)
    w_all = msa_mask.to(mn.dtype)  # [B, S', N']
    w = sh.rows(w_all, -1)  # [B, S', n]
    a = mod.linear_a(mn) * w.unsqueeze(-1)  # [B, S', n, C]
    b = gather(mod.linear_b(mn) * w.unsqueeze(-1))  # [B, S', N', C]
    return a, b.flatten(-2), torch.einsum("...si,...sj->...ij", w, w_all)


def outer_product_mean(mod: nn.Module, m: Tensor, msa_mask: Tensor, sh: _Shard, chunk_size: Optional[int]) -> Tensor:
    """AF2 Alg. 10 for the local rows of z from the local residue columns ``m [B, S', n, c_m]``: ``b`` gathered."""
    a, b_flat, count = _opm_operands(mod, m, msa_mask, sh, lambda b: _AllGather.apply(b, -2, sh.group))
    return chunk_rows(lambda a_rows, c_rows: _opm_rows(mod, a_rows, b_flat, c_rows), [a, count], [-2, -2],
                      chunk_size, out_dim=-3)


def evoformer_block(blk: nn.Module, m: Tensor, z: Tensor, msa_mask: Tensor, pair_mask: Tensor, sh: _Shard,
                    chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``EvoformerBlock`` / ``ExtraMSABlock`` forward on local residues: ``m [B, S', n, c_m]``, ``z [B, n, N', c_z]``,
    whole masks. The row attention runs on this rank's sequences (m resharded there and back)."""
    c = chunk_size
    m_seq = _Reshard.apply(m, -2, -3, sh.group)  # [B, S'/P, N', c_m]
    seqs = _sequences(msa_mask, sh)
    m_seq = _residual(sh, lambda x, zz: _dropout(
        blk.msa_dropout_row, msa_row_attention(blk.msa_row_attention, x, zz, seqs, sh, c), sh), m_seq, z)
    m = _Reshard.apply(m_seq, -3, -2, sh.group)
    cols = sh.rows(msa_mask, -1)  # [B, S', n]
    m = _residual(sh, lambda x: blk.msa_column_attention(x, cols, c), m)
    m = _residual(sh, lambda x: blk.msa_transition(x, c), m)
    z = _residual(sh, lambda zz, x: outer_product_mean(blk.outer_product_mean, x, msa_mask, sh, c), z, m)
    return m, pair_stack(blk, z, pair_mask, sh, c)


def evoformer_block_(blk: nn.Module, m: Tensor, z: Tensor, msa_mask: Tensor, pair_mask: Tensor, sh: _Shard,
                     chunk: int, msa_chunk: int, groups: int) -> Tuple[Tensor, Tensor]:
    """:func:`evoformer_block` without autograd, m and z updated in place by chunks; returns ``(m, z)``."""
    mod = blk.msa_row_attention
    m_seq = _reshard(m, m.ndim - 2, m.ndim - 3, sh.group)  # [B, S'/P, N', c_m], a new tensor
    seq_mask = _sequences(msa_mask, sh)
    bias = _gathered_bias(z, mod.layer_norm_z, mod.linear_z, sh, chunk).unsqueeze(-4)  # [B, 1, H, N', N']
    for idx in _spans(m_seq.shape[-3], msa_chunk):
        part = m_seq[..., idx, :, :]
        xn = mod.layer_norm_m(part)
        part += mod.mha(xn, xn, bias=bias, mask=seq_mask[..., idx, None, None, :])
        del xn
    del bias
    m.copy_(_reshard(m_seq, m.ndim - 3, m.ndim - 2, sh.group))
    del m_seq
    cols = sh.rows(msa_mask, -1)
    inference.msa_column_attention_(blk.msa_column_attention, m, cols, msa_chunk)
    rows_update_(m, -3, msa_chunk, _transition_fn(blk.msa_transition))
    opm = blk.outer_product_mean
    gather = lambda b: _gather(b, sh.group).movedim(0, -3).flatten(-3, -2)  # noqa: E731  [B, S', N', C]
    a, b_flat, count = _opm_operands(opm, m, msa_mask, sh, gather)
    for idx in _spans(z.shape[-3], chunk):
        z[..., idx, :, :] += _opm_rows(opm, a[..., idx, :], b_flat, count[..., idx, :])
    del a, b_flat, count
    pair_stack_(blk, z, pair_mask, sh, chunk, groups)
    return m, z


# --------------------------------------------------------------------------------------------------
# The wrappers
# --------------------------------------------------------------------------------------------------
class _ShardedStack(nn.Module):
    """What both wrappers share: the group, padding, the chunk plan, the gradient sum, the two paths."""

    stack_types: tuple = ()

    def __init__(self, stack: nn.Module, group=None, channel_groups: int = 8, checkpoint_modules: bool = False):
        super().__init__()
        if not isinstance(stack, self.stack_types):
            names = " or ".join(t.__name__ for t in self.stack_types)
            raise TypeError(f"stack must be a {names}, got {type(stack).__name__}")
        if any(getattr(b, "variant", None) == "openfold3" for b in getattr(stack, "blocks", ())):
            raise ValueError(f"{type(self).__name__} has no sharded form of the 'openfold3' Pairformer variant (its "
                             "ending-node bias and masked transitions): run that stack unsharded")
        if isinstance(channel_groups, bool) or not isinstance(channel_groups, int) or channel_groups < 1:
            raise ValueError(f"channel_groups must be an int >= 1, got {channel_groups!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialised torch.distributed process group")
        self.stack = stack
        self.group = group
        self.channel_groups = channel_groups
        self.checkpoint_modules = bool(checkpoint_modules)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def padded_length(self, n: int) -> int:
        """``n`` rounded up to a multiple of the group size."""
        return -(-n // self.world) * self.world

    def _pad_pair(self, z: Tensor, pair_mask: Tensor) -> Tuple[Tensor, Tensor, int]:
        pad = self.padded_length(z.shape[1]) - z.shape[1]
        if pad:
            z = nn.functional.pad(z, (0, 0, 0, pad, 0, pad))
            pair_mask = nn.functional.pad(pair_mask, (0, pad, 0, pad))
        return z, pair_mask, pad

    def _check_z(self, z: Tensor, pair_mask: Optional[Tensor], default_mask: Optional[Tensor]) -> Tensor:
        if z.ndim != 4 or z.shape[2] != self.world * z.shape[1]:
            raise ValueError(f"z {tuple(z.shape)} must be this rank's rows [B, n, N', c_z] with N' = {self.world} * n "
                             "(use shard())")
        if pair_mask is None:
            pair_mask = default_mask
        return pair_mask

    @staticmethod
    def _check_mask(name: str, t: Tensor, want: tuple, device) -> Tensor:
        if t.dtype != torch.bool:
            raise TypeError(f"{name} must be bool (True = real position), got {t.dtype}")
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected the whole padded mask {tuple(want)}")
        return t.to(device)

    def _run(self, x: Tensor, z: Tensor, masks: Tuple[Tensor, Tensor], block_fn, inplace_fn, inplace: bool,
             bounded: bool) -> Tuple[Tensor, Tensor]:
        stack = self.stack
        sh = _Shard(self.group, z.shape[1], self.checkpoint_modules)
        if not bounded:
            blocks = [_BlockCall(block_fn, blk, sh) for blk in stack.blocks]
            return run_blocks(blocks, x, z, masks, stack.checkpoint_every, stack.chunk_size, stack.training)
        if stack.training:
            raise ValueError("the sharded inference path applies no dropout: call .eval() first")
        if stack.inference_settings.offload:
            raise ValueError("the sharded stack keeps z on the device (offload=False); each rank holds 1/P of it")
        with torch.no_grad():
            chunk = self.plan_chunk(z)
            if not inplace:
                x, z = x.clone(), z.clone()
            for blk in stack.blocks:
                x, z = inplace_fn(blk, x, z, *masks, sh, chunk)
        return x, z

    def plan_chunk(self, z: Tensor) -> int:
        """Pair rows per chunk for local rows ``z [B, n, N', c_z]``: the settings' or stack's chunk size, else the
        largest of n and the powers of two below it whose chunk temporaries (:func:`chunk_bytes_per_pair`) stay
        under half of z's rows (at least 64 MiB; the triangle products' peak, z's rows, x and a group's operands,
        stays above it) and within the free memory left beside the product ``x``."""
        stack, settings = self.stack, self.stack.inference_settings
        chunk = settings.chunk_size if settings.chunk_size is not None else stack.chunk_size
        if chunk is not None:
            return chunk
        if len(stack.blocks) == 0:
            return 1
        b, n, n_all = z.shape[:3]
        e = torch.empty((), dtype=z.dtype).element_size()
        per_row = b * n_all * chunk_bytes_per_pair(inference.Dims.of(stack.blocks[0]), e)
        cap = max(0.5 * z.numel() * e, 64 * 2 ** 20)
        budget = settings.memory_budget
        if budget is None:
            free = inference.free_device_memory(z.device)
            budget = None if free is None else 0.9 * free
        if budget is not None:  # beside x [C, n, N'] of a triangle product
            cap = min(cap, budget - b * n * n_all * stack.blocks[0].tri_mul_out.c_hidden * e)
        candidates = [n] + [1 << k for k in range(max(0, n.bit_length() - 1), -1, -1) if 1 << k < n]
        return next((r for r in candidates if r * per_row <= cap), 1)

    def reduce_gradients(self) -> None:
        """Sum every parameter's gradient over the group (each rank holds the gradient of its own rows' loss): one
        all-reduce per dtype and device, on the gradients flattened into one buffer."""
        by_kind: dict = {}
        for p in self.stack.parameters():
            if p.grad is not None:
                by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in by_kind.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))


class ShardedPairformerStack(_ShardedStack):
    """A :class:`PairformerStack` run over the ranks of ``group`` (None: the default group), the pair tensor
    split by rows. ``stack`` is used as is (its blocks, parameters, checkpointing, chunk size and inference
    settings); every rank builds it the same way and loads the same weights. ``channel_groups``: the in-place path
    runs the triangle products and the transposes that many channel groups at a time (memory against calls).
    ``checkpoint_modules``: training keeps only every module's input and recomputes its update in the backward
    (one block's peak: the largest module's activations instead of all of them; the stack's ``checkpoint_every``
    acts between blocks).

    Use::

        sharded = ShardedPairformerStack(stack, group)
        s_r, z_r, single_mask, pair_mask = sharded.shard(s, z, single_mask, pair_mask)  # pad, take this rank's rows
        s_r, z_r = sharded(s_r, z_r, single_mask, pair_mask)
        s, z = sharded.gather(s_r, z_r, n=N)  # whole tensors on every rank (differentiable)
        loss_r.backward(); sharded.reduce_gradients()  # sum the ranks' parameter gradients

    A model that builds z already split can pass its rows directly (``padded_length`` gives N').
    """

    stack_types = (PairformerStack,)

    def shard(self, s: Tensor, z: Tensor, single_mask: Optional[Tensor] = None,
              pair_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """Whole inputs ``s [B, N, c_s]``, ``z [B, N, N, c_z]`` (masks as ``PairformerStack``) -> this rank's rows
        ``s_r [B, n, c_s]``, ``z_r [B, n, N', c_z]`` and the whole masks padded to ``N'`` (padding False)."""
        single_mask, pair_mask = pairformer_masks(s, z, single_mask, pair_mask)
        z, pair_mask, pad = self._pad_pair(z, pair_mask)
        s = nn.functional.pad(s, (0, 0, 0, pad))
        single_mask = nn.functional.pad(single_mask, (0, pad))
        sh = _Shard(self.group, z.shape[1] // self.world)
        return sh.rows(s, -2), sh.rows(z, -3), single_mask, pair_mask

    def gather(self, s: Tensor, z: Tensor, n: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        """Every rank's rows concatenated (differentiable: the gradient goes back to the rows' owners); ``n``
        crops the padding."""
        s_all = _AllGather.apply(s, -2, self.group)
        z_all = _AllGather.apply(z, -3, self.group)
        if n is not None:
            s_all, z_all = s_all[:, :n], z_all[:, :n, :n]
        return s_all, z_all

    def _check(self, s: Tensor, z: Tensor, single_mask: Optional[Tensor], pair_mask: Optional[Tensor]):
        if s.ndim != 3 or z.ndim != 4 or s.shape[:2] != z.shape[:2] or z.shape[2] != self.world * z.shape[1]:
            raise ValueError(f"s {tuple(s.shape)} must be this rank's rows [B, n, c_s] and z {tuple(z.shape)} "
                             f"[B, n, N', c_z] with N' = {self.world} * n (use shard())")
        b, n_all = z.shape[0], z.shape[2]
        if single_mask is None:
            single_mask = torch.ones(b, n_all, dtype=torch.bool, device=z.device)
        single_mask = self._check_mask("single_mask", single_mask, (b, n_all), z.device)
        if pair_mask is None:
            pair_mask = single_mask[:, :, None] & single_mask[:, None, :]
        return single_mask, self._check_mask("pair_mask", pair_mask, (b, n_all, n_all), z.device)

    def forward(self, s: Tensor, z: Tensor, single_mask: Optional[Tensor] = None,
                pair_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """This rank's rows ``s [B, n, c_s]``, ``z [B, n, N', c_z]`` and the whole masks ``[B, N']``,
        ``[B, N', N']`` -> the rows of the stack's output (s, z). Without grad in eval mode (or with the stack's
        inference mode ``bounded``): :meth:`forward_inference`."""
        masks = self._check(s, z, single_mask, pair_mask)
        return self._run(s, z, masks, pairformer_block, self._block_, False, _inference_path(self.stack))

    def forward_inference(self, s: Tensor, z: Tensor, single_mask: Optional[Tensor] = None,
                          pair_mask: Optional[Tensor] = None, *, inplace: bool = False) -> Tuple[Tensor, Tensor]:
        """The memory-bounded path on each rank: no autograd, local z updated in place block by block
        (``inplace``: the caller's z itself). Chunk sizes from the stack's settings or planned for a rank's memory."""
        masks = self._check(s, z, single_mask, pair_mask)
        return self._run(s, z, masks, pairformer_block, self._block_, inplace, True)

    def _block_(self, blk, s, z, single_mask, pair_mask, sh, chunk):
        return pairformer_block_(blk, s, z, single_mask, pair_mask, sh, chunk, self.channel_groups)


class ShardedEvoformerStack(_ShardedStack):
    """An ``EvoformerStack`` or ``ExtraMSAStack`` over the ranks of ``group``: z split by rows as in
    :class:`ShardedPairformerStack`, the MSA ``m`` by the same residues (columns), all sequences on every rank
    (``m_r [B, S', n, c_m]``, S padded to ``S' = P s``); the row attention reshards m by sequences and back. The MSA
    half of the in-place path runs by chunks on m (m stays a copy, small beside z).

        m_r, z_r, msa_mask, pair_mask = sharded.shard(m, z, msa_mask, pair_mask)
        m_r, z_r = sharded(m_r, z_r, msa_mask, pair_mask)
        m, z = sharded.gather(m_r, z_r, n=N, n_seq=S)
    """

    stack_types = (EvoformerStacks,)

    def shard(self, m: Tensor, z: Tensor, msa_mask: Optional[Tensor] = None,
              pair_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """Whole ``m [B, S, N, c_m]``, ``z [B, N, N, c_z]`` (masks as ``EvoformerStack``) -> this rank's residues
        ``m_r [B, S', n, c_m]``, rows ``z_r [B, n, N', c_z]`` and the whole masks padded (padding False)."""
        msa_mask, pair_mask = evoformer_masks(m, z, msa_mask, pair_mask)
        z, pair_mask, pad = self._pad_pair(z, pair_mask)
        pad_s = self.padded_length(m.shape[1]) - m.shape[1]
        m = nn.functional.pad(m, (0, 0, 0, pad, 0, pad_s))
        msa_mask = nn.functional.pad(msa_mask, (0, pad, 0, pad_s))
        sh = _Shard(self.group, z.shape[1] // self.world)
        return sh.rows(m, -2), sh.rows(z, -3), msa_mask, pair_mask

    def gather(self, m: Tensor, z: Tensor, n: Optional[int] = None,
               n_seq: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        """Every rank's residues concatenated (differentiable); ``n``, ``n_seq`` crop the padding."""
        m_all = _AllGather.apply(m, -2, self.group)
        z_all = _AllGather.apply(z, -3, self.group)
        if n is not None:
            m_all, z_all = m_all[:, :, :n], z_all[:, :n, :n]
        if n_seq is not None:
            m_all = m_all[:, :n_seq]
        return m_all, z_all

    def _check(self, m: Tensor, z: Tensor, msa_mask: Optional[Tensor], pair_mask: Optional[Tensor]):
        if m.ndim != 4 or z.ndim != 4 or m.shape[0] != z.shape[0] or m.shape[2] != z.shape[1] or \
                z.shape[2] != self.world * z.shape[1] or m.shape[1] % self.world:
            raise ValueError(f"m {tuple(m.shape)} must be this rank's residues [B, S', n, c_m] with S' a multiple of "
                             f"{self.world} and z {tuple(z.shape)} its rows [B, n, N', c_z] with N' = {self.world} * n "
                             "(use shard())")
        b, s_all, n_all = m.shape[0], m.shape[1], z.shape[2]
        if msa_mask is None:
            msa_mask = torch.ones(b, s_all, n_all, dtype=torch.bool, device=z.device)
        if pair_mask is None:
            pair_mask = torch.ones(b, n_all, n_all, dtype=torch.bool, device=z.device)
        return (self._check_mask("msa_mask", msa_mask, (b, s_all, n_all), z.device),
                self._check_mask("pair_mask", pair_mask, (b, n_all, n_all), z.device))

    def forward(self, m: Tensor, z: Tensor, msa_mask: Optional[Tensor] = None,
                pair_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """This rank's ``m [B, S', n, c_m]``, ``z [B, n, N', c_z]`` and the whole masks ``[B, S', N']``,
        ``[B, N', N']`` -> its part of the stack's output (m, z)."""
        masks = self._check(m, z, msa_mask, pair_mask)
        return self._run(m, z, masks, evoformer_block, self._block_, False, _inference_path(self.stack))

    def forward_inference(self, m: Tensor, z: Tensor, msa_mask: Optional[Tensor] = None,
                          pair_mask: Optional[Tensor] = None, *, inplace: bool = False) -> Tuple[Tensor, Tensor]:
        """The memory-bounded path on each rank (``inplace``: the caller's m and z updated)."""
        masks = self._check(m, z, msa_mask, pair_mask)
        return self._run(m, z, masks, evoformer_block, self._block_, inplace, True)

    def _block_(self, blk, m, z, msa_mask, pair_mask, sh, chunk):
        msa_chunk = self.stack.inference_settings.msa_chunk_size or chunk
        return evoformer_block_(blk, m, z, msa_mask, pair_mask, sh, chunk, msa_chunk, self.channel_groups)


def _inference_path(stack: nn.Module) -> bool:
    """Whether the stack's settings send a call to the in-place path: ``mode="bounded"``, or ``"auto"`` without
    grad in eval mode (``"plain"``: the autograd path)."""
    mode = stack.inference_settings.mode
    if mode != "auto":
        return mode != "plain"
    return not torch.is_grad_enabled() and not stack.training


def chunk_bytes_per_pair(d: "inference.Dims", e: int) -> int:
    """Bytes of chunk temporaries per pair of a chunk of rows, the largest over the pair modules (``e``: bytes of
    the activations' dtype): a triangle product's output stage, a triangle attention's projections, the pair
    transition's hidden layer."""
    hc = d.num_heads_pair * d.c_hidden_pair
    return max(e * (3 * d.c_z + 3 * d.c_hidden_mul), e * (2 * d.c_z + 10 * hc + d.num_heads_pair + 8)
               + 4 * d.num_heads_pair, e * d.c_z * (2 + 4 * d.transition_n))


class _BlockCall:
    """``block_fn(blk, x, z, *masks, sh, chunk_size)`` as ``block(x, z, *masks, chunk_size=...)`` for
    ``run_blocks`` (checkpointing)."""

    def __init__(self, block_fn, blk: nn.Module, sh: _Shard):
        self.block_fn, self.blk, self.sh = block_fn, blk, sh

    def __call__(self, x: Tensor, z: Tensor, mask_x: Tensor, pair_mask: Tensor,
                 chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        return self.block_fn(self.blk, x, z, mask_x, pair_mask, self.sh, chunk_size)
