"""Training on several processes: the global-mean loss, FSDP on any device, and context (sequence) parallelism.

Every task's masked means are taken over the whole global batch (:func:`global_mean`): each rank returns its
share ``sum_r / N * W`` (``N``: the scored count summed over the ``W`` ranks), so the gradient average that DDP and
FSDP make, and the mean of the ranks' losses, are those of one process holding the whole batch, whatever the
ranks' counts. Strategies, selected by the ``trainer`` config group:

- ``trainer=ddp`` / ``trainer=ddp_cpu``: Lightning's DDP (NCCL on GPUs; gloo for 2 CPU processes).
- ``trainer=fsdp``: :class:`FullyShardedStrategy`, Lightning's FSDP also on CPU processes (gloo).
- ``trainer=context_parallel``: :class:`ContextParallelStrategy`: every rank holds the same batches and its slice
  of every sequence; the network runs ring attention over a process group of all ranks.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

Tensor = torch.Tensor


def loss_group(module) -> Optional[object]:
    """The process group a task's losses are averaged over: the default group while a multi-process trainer runs
    ``module``, else None (a single process, or a module used outside a trainer)."""
    trainer = _trainer(module)
    if trainer is None or trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD


def _trainer(module):
    try:
        return module.trainer
    except RuntimeError:  # a LightningModule not attached to a trainer
        return None


def global_mean(total: Tensor, count: Tensor, group=None) -> Tensor:
    """This rank's share of a mean over every rank of ``group``: ``total / (count summed over the ranks) * W``.

    ``total``: this rank's sum (differentiable), ``count``: how many values it summed (a tensor). The mean over
    ranks of the result (DDP's gradient average, a ``sync_dist`` log) is the global mean; without a group it is
    ``total / count``. A zero global count gives 0, not NaN. Every rank of the group must call it together.
    """
    n = count.detach().to(torch.float64 if total.dtype == torch.float64 else torch.float32).reshape(())
    if group is None:
        return total / n.clamp(min=1.0)
    n = n.clone()
    dist.all_reduce(n, group=group)  # sum of the ranks' counts
    return total / n.clamp(min=1.0) * dist.get_world_size(group)


def clip_sharded_gradients(module, clip_val, algorithm) -> bool:
    """Norm clipping where the strategy shards the parameters (FSDP, which Lightning's precision plugin refuses):
    FSDP's own ``clip_grad_norm_``, the norm over every rank's shard, so the step equals one process's. Returns
    whether it clipped (False: not sharded, or not norm clipping; Lightning's path applies)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    trainer = _trainer(module)
    wrapped = None if trainer is None else trainer.strategy.model
    if not clip_val or algorithm not in (None, "norm") or not isinstance(wrapped, FullyShardedDataParallel):
        return False
    wrapped.clip_grad_norm_(float(clip_val))
    return True


class FullyShardedStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``, also on CPU processes (``accelerator=cpu``: gloo), which Lightning refuses for
    its own class by name; on GPUs it is that strategy unchanged. PyTorch's FSDP shards over CPU ranks too; the
    multi-process tests run it there. Gradient norm clipping (``trainer.gradient_clip_val``) works through the tasks
    (:func:`clip_sharded_gradients`)."""

    strategy_name = "fsdp_any_device"

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu" or any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return super()._setup_model(model)
        from lightning.pytorch.strategies.fsdp import _setup_activation_checkpointing

        # Lightning passes device_id=None on CPU, which FSDP takes as "find an accelerator": name the CPU instead
        model = FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                         mixed_precision=self.mixed_precision_config,
                                         sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                         **self.kwargs)
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model

    def _cpu_full_state(self) -> bool:
        return self.root_device.type == "cpu" and self._state_dict_type == "full"

    def _full_state_dict_context(self):
        """Lightning's full state-dict context without ``offload_to_cpu``: on CPU ranks FSDP's offload copies
        views of storage it has already freed (the save fails), and the tensors are on the CPU anyway."""
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.state_dict_type(
            self.model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True))

    def lightning_module_state_dict(self) -> dict:
        if not self._cpu_full_state():
            return super().lightning_module_state_dict()
        with self._full_state_dict_context():
            return self.model.state_dict()

    def optimizer_state(self, optimizer) -> dict:
        if not self._cpu_full_state():
            return super().optimizer_state(optimizer)
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        with self._full_state_dict_context():
            state = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # the standard layout (parameter ids), as Lightning's full checkpoints
                state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
            return state


class ContextParallelStrategy(DDPStrategy):
    """Sequence (context) parallelism: every rank trains on the same batches and holds ``1/W`` of each sequence.

    The data loader of every rank yields the whole global batch in the same order (a distributed sampler of one
    replica) and every rank trains on rank 0's copy of it (one broadcast per step); the task keeps this rank's
    shard (``net.shard_batch``, zigzag layout: equal causal work per rank); the network's attention runs
    ``attn_ops.ring_attention`` over a process group of all ranks, separate from the one DDP all-reduces
    gradients on. Losses are global means over the ranks' tokens (:func:`global_mean`), and
    parameters stay replicated with gradients averaged as in DDP, so a step equals one process's step on the whole
    sequence. Needs a network with sequence-sharded attention (``models.transformer.TransformerLM``).
    """

    strategy_name = "context_parallel"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sequence_group = None

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": 1, "rank": 0}  # every rank draws the same batches; the task shards the sequence

    def batch_to_device(self, batch, device=None, dataloader_idx: int = 0):
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self._rank0_batch(batch) if self.world_size > 1 else batch

    def _rank0_batch(self, batch):
        """Rank 0's batch on every rank: the same indices can still give each rank other random crops or masks
        (a worker's generator is seeded with its rank), and shards of different rows would train on nonsense."""
        if not isinstance(batch, dict):
            return batch
        keys = sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor))
        meta = [[(tuple(batch[k].shape), batch[k].dtype) for k in keys]]
        dist.broadcast_object_list(meta, src=0)  # rank 0's shapes (a padded batch may be wider elsewhere)
        out = dict(batch)
        for k, (shape, dtype) in zip(keys, meta[0]):
            t = batch[k]
            t = t.contiguous() if (tuple(t.shape), t.dtype) == (shape, dtype) else t.new_empty(shape, dtype=dtype)
            wire = t.to(torch.uint8) if t.dtype == torch.bool else t  # gloo has no bool broadcast
            dist.broadcast(wire, src=0)
            out[k] = wire.bool() if t.dtype == torch.bool else wire
        return out

    def setup(self, trainer) -> None:
        from ..transformer import TransformerBlock, TransformerLM

        net = getattr(self.lightning_module, "net", None)
        if not isinstance(net, TransformerLM):
            raise ValueError(f"trainer=context_parallel shards each sequence over the ranks and needs a network with "
                             f"ring attention (attn_zoo.models.transformer.TransformerLM), got "
                             f"{type(net).__name__}: use trainer=ddp or trainer=fsdp for this model")
        if self.sequence_group is None:  # every rank creates it, in the same order
            self.sequence_group = dist.new_group(list(range(self.world_size)))
        for module in net.modules():
            if isinstance(module, (TransformerLM, TransformerBlock)):
                module.process_group = self.sequence_group
        super().setup(trainer)
