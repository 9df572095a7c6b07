"""CUDA graphs for a block in eager mode: :class:`CUDAGraphs`.

At a fixed crop size an eager block's training step is bound by PyTorch's per-op host time; replaying its forward and
backward as CUDA graphs takes that out without ``torch.compile`` (docs/bench/blocks_h200.md). PyTorch's
``torch.cuda.make_graphed_callables`` captures the graphs; this wrapper keeps one capture per input signature and
hands out results that behave like the plain module's: outputs and gradients in tensors of their own, not in the
graphs' buffers (which the next replay rewrites).
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

import attn_ops
from . import kernels as _kernels

Tensor = torch.Tensor

# devices whose tensors a capture takes (tests add "cpu", with make_graphed_callables replaced by a stand-in)
CAPTURE_DEVICES = ("cuda",)


class _OwnGrad(torch.autograd.Function):
    """Identity whose backward hands on a copy of the gradient: an input's gradient from a replay would otherwise be
    the graph's buffer."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.clone()


class _Pending:
    """Held by a replay's :class:`_Done` node: while it lives and its backward has not run, the replay's activations
    in the capture's buffers are still needed (``live`` holds the ids of such replays)."""

    def __init__(self, live: set):
        self.live = live
        live.add(id(self))

    def release(self) -> None:
        self.live.discard(id(self))

    __del__ = release


class _Done(torch.autograd.Function):
    """Identity on a replay's outputs whose backward (or the end of its graph) releases the replay's activations."""

    @staticmethod
    def forward(ctx, live, before_backward, *outs):
        ctx.pending, ctx.before_backward = _Pending(live), before_backward
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.pending.release()
        ctx.before_backward()  # (runs before the replay's backward, which rewrites the capture's gradient buffers)
        return (None, None) + grads


class CUDAGraphs(nn.Module):
    """``module`` (a block taking tensors: ``CUDAGraphs(block)(s, z, single_mask, pair_mask)``) with its forward and
    backward replayed as CUDA graphs.

    The first call with an input signature (shapes, dtypes, which inputs require grad, train/eval mode, the autocast
    dtype) captures it with ``torch.cuda.make_graphed_callables`` (``warmup_iters`` eager steps on a side stream, then
    the capture); later calls with that signature replay it. At most ``max_graphs`` captures are kept, each with its
    own memory pool (about one step's activations); the least recently used goes first. A new length is a new
    capture: use it where lengths repeat (a training crop size).

    Differences from calling ``module`` (otherwise the same outputs and gradients: GPU test):
    - under autocast, the module runs with ``cache_enabled=False`` (CUDA graphs need it);
    - the capture runs inside ``kernels.device_bound()``: from ``kernels.DEVICE_BOUND_MIN_ROWS`` rows (pair tensors
      of N >= 256) layer norms and linear-bias gradients take the kernels with less device time that the eager
      module takes only from more rows: the same math, rounded otherwise;
    - dropout draws new masks on every replay, from the graph-safe generator state, not the eager sequence;
    - in-place parameter updates (optimizers, ``load_state_dict``) are seen by the captured steps;
    - recent PyTorch (2.11 measured) warns once that "The AccumulateGrad node's stream does not match the stream of
      the node that produced the incoming gradient": ``make_graphed_callables`` keeps the parameters' gradient
      accumulators of its capture, made on its side stream, so each backward syncs that stream per parameter.
      Harmless: no measurable step time (docs/bench/history.md); accumulators made on the caller's
      stream instead break the capture;
    - a capture fails (``cudaErrorStreamCaptureImplicit``, after the same warning) while an autograd graph of an
      earlier eager call of the module is still alive (a loss kept from the step before): drop such references
      before the first call of each new input signature (an ESM C GPU test met it, 2026-12-03).

    Calls it cannot capture run ``module`` as is: tensors off CUDA or on several devices, non-tensor or keyword
    arguments, autograd off (the graphs hold a backward), ``torch.compile`` tracing, an ongoing capture; and a call
    whose capture still holds the activations of an earlier call that has not been backpropagated (two forwards before
    one backward: weight sharing, recycling), which a replay would overwrite. A backward with ``retain_graph=True``
    followed by another replay and a second backward of the first call is not detected.

    Parameters are part of the signature by their memory and ``requires_grad``: one replaced (``.to()``,
    ``load_state_dict(assign=True)``) or unfrozen gets a new capture. Copies (``copy.deepcopy``, pickling) start
    without captures.

    Gradients that ``torch.autograd.grad`` returns for parameters through a replay can be the capture's buffers
    (``.grad`` is kept right, those results are not): clone the ones kept past the next call of the wrapper.

    ``share_grad_memory=True``: a parameter's gradient in a step where it had none (``zero_grad(set_to_none=True)``)
    is the capture's own gradient buffer rather than a copy of it, which saves the memory of one copy of all
    gradients (2.1 GiB for ESM C 600M in float32). A gradient still held in that buffer is copied out before each
    replay, forward or backward (the forward graph's temporaries share the capture's memory pool with the backward's
    gradient outputs: a GPU test met the forward rewriting them), so that accumulating over several backward passes
    stays right, also through one replay with ``retain_graph`` or ``torch.autograd.grad``: only a reference to
    ``.grad`` kept past the next call or backward through the wrapper sees it rewritten.
    """

    def __init__(self, module: nn.Module, max_graphs: int = 2, warmup_iters: int = 3, share_grad_memory: bool = False):
        super().__init__()
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be an int >= 1, got {max_graphs!r}")
        if not isinstance(warmup_iters, int) or warmup_iters < 1:
            raise ValueError(f"warmup_iters must be an int >= 1, got {warmup_iters!r}")
        self.module = module
        self.max_graphs, self.warmup_iters = max_graphs, warmup_iters
        self._graphs: "OrderedDict[Tuple, Tuple[Callable, set]]" = OrderedDict()
        self._hooks: Dict[int, Any] = {}  # id(parameter) -> its hook handle
        # share_grad_memory: id(parameter) -> data_ptr of the capture's gradient buffer it was handed (no reference:
        # one would stop autograd from taking the buffer as .grad without a copy)
        self.share_grad_memory = bool(share_grad_memory)
        self._shared: Dict[int, int] = {}
        self._warned = False

    def __getstate__(self):
        state = dict(super().__getstate__())
        # captures belong to this object's parameters
        state["_graphs"], state["_hooks"], state["_shared"] = OrderedDict(), {}, {}
        return state

    def reset(self) -> None:
        """Drop every capture (and its memory pool, once nothing refers to its outputs) and the gradient hooks."""
        self._graphs.clear()
        for h in self._hooks.values():
            h.remove()
        self._hooks.clear()
        self._shared.clear()
        gc.collect()  # a capture's autograd Function class refers to itself: only the cycle collector frees it

    @property
    def num_graphs(self) -> int:
        """How many captures are kept."""
        return len(self._graphs)

    def _can_capture(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        if kwargs or not args or not torch.is_grad_enabled() or torch.compiler.is_compiling() or \
                attn_ops.compiling_ahead():  # (its calls launch no kernel: a capture would hold none)
            return False
        dev = args[0].device
        if not all(type(a) in (Tensor, nn.Parameter) and a.device == dev for a in args):
            return False
        return dev.type in CAPTURE_DEVICES and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def forward(self, *args, **kwargs):
        if not self._can_capture(args, kwargs):
            return self.module(*args, **kwargs)
        device = args[0].device
        dev = device.type
        auto = torch.is_autocast_enabled(dev)
        dtype = torch.get_autocast_dtype(dev) if auto else None
        params = list(self.module.parameters())
        key = (self.module.training, dtype, tuple((a.shape, a.dtype, a.requires_grad, a.device) for a in args),
               tuple((p.data_ptr(), p.requires_grad) for p in params))
        entry = self._graphs.get(key)
        if entry is not None and entry[1]:  # its buffers hold an earlier call's activations, not yet backpropagated
            if not self._warned:
                self._warned = True
                warnings.warn("CUDAGraphs: a call before the backward of the previous call with these input shapes "
                              "runs the module eagerly (the capture holds that call's activations)", stacklevel=2)
            return self.module(*args)
        uncached = torch.autocast(dev, dtype=dtype, cache_enabled=False) if auto else contextlib.nullcontext()
        on_device = torch.cuda.device(device) if dev == "cuda" else contextlib.nullcontext()
        with uncached, on_device:
            if entry is None:
                entry = self._capture(args, params), set()  # (replay, ids of replays awaiting their backward)
                self._graphs[key] = entry
                if len(self._graphs) > self.max_graphs:  # (one new entry: one to drop)
                    self._graphs.popitem(last=False)
                    gc.collect()  # (see reset)
            else:
                self._graphs.move_to_end(key)
            replay, live = entry
            # a forward replay reuses the backward's gradient buffers for its own temporaries (one memory pool)
            self._copy_out_shared_grads(params)
            outs = replay(*(_OwnGrad.apply(a) if a.requires_grad else a for a in args))
        flat, spec = torch.utils._pytree.tree_flatten(outs)
        tensors = [i for i, t in enumerate(flat) if isinstance(t, Tensor)]
        marked = [flat[i] for i in tensors]
        if any(t.requires_grad for t in marked):
            marked = list(_Done.apply(live, lambda: self._copy_out_shared_grads(params), *marked))
        for i, t in zip(tensors, marked):
            # the replay's outputs are the graph's buffers: copies (autograd passes gradients through them)
            flat[i] = t.clone()
        return torch.utils._pytree.tree_unflatten(flat, spec)

    def _copy_out_shared_grads(self, params: List[Tensor]) -> int:
        """Gradients that are still a capture's buffer become copies before a replay rewrites that buffer: a forward
        replay (its temporaries), a backward (another step's, or the same replay's again with ``retain_graph``, or
        ``torch.autograd.grad`` through it). Returns how many were copied; the records checked are dropped (a
        gradient that is None or a copy is no buffer any more), so a step that starts with no gradients costs a
        dict test."""
        if not self._shared:
            return 0
        copied = 0
        for p in params:
            ptr = self._shared.pop(id(p), None)
            if ptr is not None and p.grad is not None and p.grad.data_ptr() == ptr:
                p.grad = p.grad.clone()
                copied += 1
        return copied

    def _capture(self, args: Tuple[Tensor, ...], params: List[Tensor]) -> Callable:
        """The graphed forward of ``module`` for inputs like ``args`` (``module`` itself is left as it was)."""
        own = self.module.__dict__.get("forward")
        # the graphs read their inputs from the sample tensors, into which each later call copies its own: private
        # copies, not the caller's tensors
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        with _kernels.device_bound():  # a replay runs no host code: the kernels with the least device time
            torch.cuda.make_graphed_callables(self.module, sample, num_warmup_iters=self.warmup_iters)
        replay = self.module.__dict__.pop("forward")  # make_graphed_callables sets the instance's forward
        if own is not None:
            self.module.forward = own
        # a parameter's first gradient of a step would be the graph's buffer (autograd keeps an incoming gradient as
        # .grad when there is none): a copy instead, so that a second backward accumulates into it (or, sharing,
        # the buffer itself, copied out before the next replay, forward or backward: _copy_out_shared_grads)
        for p in params:
            if p.requires_grad and id(p) not in self._hooks:
                self._hooks[id(p)] = p.register_hook(_first_grad(p, self._shared if self.share_grad_memory else None))
        return replay


def _first_grad(p: Tensor, shared: Optional[Dict[int, int]]) -> Callable[[Tensor], Tensor]:
    """The hook on ``p``'s gradient: the first one of a step copied, or with ``shared`` passed on as it is and its
    memory recorded."""
    def hook(g: Tensor) -> Tensor:
        if p.grad is not None:
            return g
        if shared is None:
            return g.clone()
        shared[id(p)] = g.data_ptr()
        return g

    return hook


class Logits(nn.Module):
    """``model(tokens, **{ids_keyword: ids})["logits"]`` taking tensors as positional arguments only, which is what
    :class:`CUDAGraphs` captures: ``CUDAGraphs(Logits(esm2_model, "segment_ids"))(tokens, segment_ids)`` (the ids
    optional). The parameters are ``model``'s."""

    def __init__(self, model: nn.Module, ids_keyword: str):
        super().__init__()
        self.model, self.ids_keyword = model, ids_keyword

    def forward(self, tokens: Tensor, *ids: Tensor) -> Tensor:
        if len(ids) > 1:
            raise ValueError(f"{type(self).__name__} takes tokens and at most one {self.ids_keyword} tensor, got "
                             f"{1 + len(ids)} arguments")
        return self.model(tokens, **({self.ids_keyword: ids[0]} if ids else {}))["logits"]
