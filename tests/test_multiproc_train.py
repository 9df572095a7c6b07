"""Training on several CPU processes (gloo) from configs: DDP, FSDP and context parallel give the steps of one
process holding the same global batch, checkpoints are written by rank 0 only, and a DDP checkpoint resumes on one
process.

Each run is ``python train.py`` (Lightning's DDP launcher starts the second process by running the same command).
The 1-process reference is ``trainer=ddp_cpu trainer.devices=1``: Lightning shuffles a distributed run's training
data with a distributed sampler seeded by ``seed``; one replica of it draws the same order that the 2 ranks split,
so step s sees the same examples in both runs. Dropout is off (each rank would draw its own masks).

Tolerance: fp32, relative 1e-5 on each step's loss. The runs differ only in summation order (the batch in two
halves, the gradient all-reduce, the ring's merge of partial softmaxes), a few fp32 ulps (1.2e-7) per step that
10 AdamW steps carry forward; a wrong normalisation (the mean of the ranks' means instead of the global mean)
or a wrong shard changes the first step's loss by 1e-3 or more.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.io import TorchCheckpointIO

from gloo_harness import spawn_gloo

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-5
STEPS = 10

QUIET = ["callbacks=last_checkpoint", "logger=csv", "test=false", "trainer.limit_val_batches=0",
         "trainer.num_sanity_val_steps=0", "+trainer.enable_progress_bar=false", "attention=torch"]
# 40 synthetic MSAs of 4 x 16, a 1-block Evoformer without dropout: 10 steps of a global batch of 4 = one epoch
EVO = QUIET + ["data=msa_synthetic", "data.msa_depth=4", "data.length=16", "data.train_samples=40",
               "data.val_samples=4", "model.net.trunk.num_blocks=1", "model.net.trunk.c_m=16", "model.net.trunk.c_z=8",
               "model.net.trunk.msa_dropout=0", "model.net.trunk.pair_dropout=0"]
# the long-context causal LM (RoPE, relative-position bias) on 40 random windows of 32 tokens, a global batch of 2
LM_NET = QUIET + ["experiment=longctx_clm", "data.batch_size=2", "model.net.d_model=32", "model.net.num_layers=1",
                  "model.net.num_heads=2"]
LM = LM_NET + ["data=lm_synthetic", "data.seq_len=32", "data.train_samples=40", "data.val_samples=4"]
ONE = ["trainer=ddp_cpu", "trainer.devices=1"]
TWO_CPU = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


class StepLosses(L.Callback):
    """Appends each step's loss of the whole global batch (the mean of the ranks' shares) to ``path`` (rank 0),
    with the size of the group the network's attention runs over (1: not sharded) and, in one process, the norm of
    the step's parameter update (it depends on the optimizer's moments and the learning rate)."""

    def __init__(self, path: str):
        self.path = path
        self.before = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.world_size == 1:
            self.before = [p.detach().double().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        update = None
        if self.before is not None:
            update = float(sum(((p.detach().double() - b) ** 2).sum() for p, b in zip(pl_module.parameters(),
                                                                                       self.before)) ** 0.5)
        loss = outputs["loss"].detach().double().clone()
        if trainer.world_size > 1:
            dist.all_reduce(loss)
            loss /= trainer.world_size
        blocks = getattr(pl_module.net, "blocks", None)
        group = getattr(blocks[0], "process_group", None) if blocks is not None else None
        ring = dist.get_world_size(group) if group is not None and not isinstance(group, str) else 1
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps(dict(step=trainer.global_step, loss=float(loss), ring=ring, update=update)) + "\n")


class CountingCheckpointIO(TorchCheckpointIO):
    """Torch checkpoint files, each save also noted in ``log`` with the writing process's rank."""

    def __init__(self, log: str):
        super().__init__()
        self.log = log

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with open(self.log, "a") as f:
            f.write(json.dumps(dict(rank=int(os.environ.get("LOCAL_RANK", 0)), path=str(path))) + "\n")
        super().save_checkpoint(checkpoint, path, storage_options)


def _train(tmp: Path, name: str, args: list) -> dict:
    """Run ``train.py`` with ``args`` in run folder ``tmp/logs/train/runs/<name>``; its per-step losses, the
    checkpoint saves and the folder."""
    losses, saves = tmp / f"{name}.losses.jsonl", tmp / f"{name}.saves.jsonl"
    extra = [f"paths.log_dir={tmp / 'logs'}", f"run_name={name}",
             "+callbacks.step_losses._target_=test_multiproc_train.StepLosses", f"+callbacks.step_losses.path={losses}",
             f"+trainer.plugins=[{{_target_: test_multiproc_train.CountingCheckpointIO, log: '{saves}'}}]"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, *extra], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    read = lambda p: [json.loads(line) for line in p.read_text().splitlines()] if p.is_file() else []  # noqa: E731
    return dict(losses=read(losses), saves=read(saves), folder=tmp / "logs" / "train" / "runs" / name)


def _same_steps(got: list, want: list, steps: int = STEPS) -> None:
    assert [r["step"] for r in got[:steps]] == list(range(1, steps + 1)), got
    a = torch.tensor([r["loss"] for r in got[:steps]], dtype=torch.float64)
    b = torch.tensor([r["loss"] for r in want[:steps]], dtype=torch.float64)
    assert torch.allclose(a, b, rtol=RTOL, atol=0), f"per-step losses differ:\n{a.tolist()}\n{b.tolist()}"


def _written_once(run: dict) -> None:
    """Every checkpoint save came from rank 0, once per file (no rank wrote a file another one wrote)."""
    assert run["saves"], "no checkpoint was saved"
    assert {s["rank"] for s in run["saves"]} == {0}, run["saves"]
    assert (run["folder"] / "checkpoints" / "last.ckpt").is_file()
    assert sorted(p.name for p in (run["folder"] / "checkpoints").glob("*.ckpt")) == ["last.ckpt"]


@pytest.fixture(scope="module")
def evo_reference(tmp_path_factory):
    """The 1-process Evoformer run: a global batch of 4, 12 steps (the 2-process runs stop at 10)."""
    return _train(tmp_path_factory.mktemp("evo1"), "one", EVO + ONE + ["data.batch_size=4", "trainer.max_steps=12"])


@pytest.fixture(scope="module")
def evo_ddp(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("evo2"), "ddp", EVO + ["trainer=ddp_cpu", "data.batch_size=2",
                                                                  f"trainer.max_steps={STEPS}"])


@pytest.mark.slow
def test_ddp_two_processes_take_the_steps_of_one(evo_reference, evo_ddp):
    _same_steps(evo_ddp["losses"], evo_reference["losses"])
    _written_once(evo_ddp)


@pytest.mark.slow
def test_ddp_checkpoint_resumes_on_one_process(evo_reference, evo_ddp, tmp_path):
    """The 2-process run's last.ckpt (step 10, the end of the first epoch) continues on one process with the step the
    1-process run took after its step 10: the same loss (weights), the same update (AdamW moments, learning rate)."""
    ckpt = evo_ddp["folder"] / "checkpoints" / "last.ckpt"
    run = _train(tmp_path, "resumed", EVO + ONE + ["data.batch_size=4", "trainer.max_steps=11", f"ckpt_path={ckpt}"])
    assert [r["step"] for r in run["losses"]] == [11]
    got, want = run["losses"][0], evo_reference["losses"][10]
    assert want["step"] == 11 and want["update"] > 0
    assert got["loss"] == pytest.approx(want["loss"], rel=RTOL, abs=0)
    assert got["update"] == pytest.approx(want["update"], rel=RTOL, abs=0)


@pytest.mark.slow
def test_pairformer_ddp_two_processes_take_the_steps_of_one(tmp_path):
    pair = [a for a in EVO if not a.startswith("model.net.trunk.")] + [
        "model=pairformer_tiny", "model.net.embedder.c_m=16", "model.net.trunk.stack.c_s=16",
        "model.net.trunk.stack.c_z=8", "model.net.trunk.stack.num_blocks=1", "model.net.trunk.stack.pair_dropout=0",
        f"trainer.max_steps={STEPS}"]
    one = _train(tmp_path, "one", pair + ONE + ["data.batch_size=4"])
    two = _train(tmp_path, "ddp", pair + ["trainer=ddp_cpu", "data.batch_size=2"])
    _same_steps(two["losses"], one["losses"])


@pytest.fixture(scope="module")
def evo_fsdp(tmp_path_factory):
    """FULL_SHARD over 2 CPU processes, one unit per Evoformer block, norm clipping by FSDP's own clip_grad_norm_."""
    return _train(tmp_path_factory.mktemp("fsdp"), "fsdp", EVO + ["trainer=fsdp", *TWO_CPU, "data.batch_size=2",
                                                                  f"trainer.max_steps={STEPS}"])


@pytest.mark.slow
def test_esm2_ddp_two_processes_take_the_steps_of_one(tmp_path):
    """ESM-2 (its 33-token alphabet, token dropout's rescaling) on random token windows, 1 layer of width 32. The
    masked-LM loss leaves the contact head without a gradient: DDP is told to look for unused parameters."""
    esm = QUIET + ["experiment=esm2_mlm", "data=lm_synthetic", "~data.max_len", "data.seq_len=16",
                   "data.train_samples=40", "data.val_samples=4", "model.size=null", "model.net.num_layers=1",
                   "model.net.embed_dim=32", "model.net.attention_heads=2", f"trainer.max_steps={STEPS}",
                   "trainer=ddp_cpu", "+trainer.strategy.find_unused_parameters=true"]
    one = _train(tmp_path, "one", esm + ["trainer.devices=1", "data.batch_size=4"])
    two = _train(tmp_path, "ddp", esm + ["data.batch_size=2"])
    _same_steps(two["losses"], one["losses"])


@pytest.mark.slow
def test_fsdp_two_processes_take_the_steps_of_one(evo_reference, evo_fsdp):
    _same_steps(evo_fsdp["losses"], evo_reference["losses"])
    _written_once(evo_fsdp)


@pytest.mark.slow
def test_fsdp_full_checkpoint_resumes_on_one_process(evo_reference, evo_fsdp, tmp_path):
    """A full (gathered) FSDP checkpoint holds plain weights and optimizer state: one process continues it."""
    ckpt = evo_fsdp["folder"] / "checkpoints" / "last.ckpt"
    run = _train(tmp_path, "resumed", EVO + ONE + ["data.batch_size=4", "trainer.max_steps=11", f"ckpt_path={ckpt}"])
    got, want = run["losses"][0], evo_reference["losses"][10]
    assert got["step"] == want["step"] == 11
    assert got["loss"] == pytest.approx(want["loss"], rel=RTOL, abs=0)
    assert got["update"] == pytest.approx(want["update"], rel=RTOL, abs=0)


@pytest.mark.slow
def test_context_parallel_two_processes_take_the_steps_of_one(tmp_path):
    """Each rank holds half of every sequence (zigzag) and the attention runs as ring attention over both; the loss
    is the mean over all tokens of the batch."""
    one = _train(tmp_path, "one", LM + ONE + [f"trainer.max_steps={STEPS}"])
    two = _train(tmp_path, "cp", LM + ["trainer=context_parallel", *TWO_CPU, f"trainer.max_steps={STEPS}"])
    assert {r["ring"] for r in one["losses"]} == {1} and {r["ring"] for r in two["losses"]} == {2}
    _same_steps(two["losses"], one["losses"])
    _written_once(two)


@pytest.mark.slow
def test_context_parallel_trains_every_rank_on_rank0s_batch(tmp_path):
    """The bundled proteins in random windows drawn by a loader worker, whose generator Lightning seeds with the
    rank: the ranks' loaders give other windows for the same indices, and the run still takes the 1-process steps
    (rank 0's batch, broadcast)."""
    data = ["data.seq_len=32", "data.train_samples=20", "data.val_samples=4", "data.num_workers=1"]  # clm_sample
    one = _train(tmp_path, "one", LM_NET + data + ONE + ["trainer.max_steps=4"])
    two = _train(tmp_path, "cp", LM_NET + data + ["trainer=context_parallel", *TWO_CPU, "trainer.max_steps=4"])
    _same_steps(two["losses"], one["losses"], steps=4)


@pytest.mark.slow
def test_context_parallel_packed_rows_take_the_steps_of_one(tmp_path):
    """Packed rows (several proteins in about half of the windows, segment ids; positions restart at each protein)
    with the sequence split over 2 ranks. The 1-process run is the same strategy on one process (the config check
    refuses packing under DDP)."""
    data = ["data.seq_len=64", "data.train_samples=20", "data.val_samples=4", "data.packing=true"]  # clm_sample
    cp = ["trainer=context_parallel", "trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.max_steps=4"]
    one = _train(tmp_path, "one", LM_NET + data + cp + ["trainer.devices=1"])
    two = _train(tmp_path, "cp", LM_NET + data + cp + ["trainer.devices=2"])
    assert {r["ring"] for r in two["losses"]} == {2}
    _same_steps(two["losses"], one["losses"], steps=4)


@pytest.mark.slow
def test_context_parallel_refuses_a_network_without_ring_attention(tmp_path):
    args = EVO + ["trainer=context_parallel", "trainer.accelerator=cpu", "trainer.devices=1",
                  "trainer.precision=32-true", "trainer.max_steps=1", f"paths.log_dir={tmp_path}", "run_name=x"]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode != 0
    assert "trainer=context_parallel" in proc.stderr and "MSADistogramNet" in proc.stderr, proc.stderr[-2000:]


def _check_global_mean(rank, world):
    from attn_zoo.models.tasks.parallel import global_mean

    g = torch.Generator().manual_seed(0)
    values = torch.randn(7, generator=g, dtype=torch.float64)
    sizes = [2, 5]  # the ranks score different counts
    lo = sum(sizes[:rank])
    mine = values[lo:lo + sizes[rank]].clone().requires_grad_()
    share = global_mean(mine.sum(), torch.tensor(float(sizes[rank])), dist.group.WORLD)
    share.backward()
    total = share.detach().clone()
    dist.all_reduce(total)
    assert torch.allclose(total / world, values.mean(), rtol=1e-12, atol=0)  # the mean of the whole batch
    # averaged over ranks (as DDP does), each value's gradient is 1 / (all values), not 1 / (this rank's count)
    assert torch.allclose(mine.grad / world, torch.full_like(mine, 1 / 7), rtol=1e-12, atol=0)
    empty = global_mean(torch.zeros((), dtype=torch.float64), torch.tensor(0.0), dist.group.WORLD)
    assert float(empty) == 0.0


@pytest.mark.slow
def test_global_mean_over_ranks_is_the_mean_of_the_whole_batch():
    spawn_gloo(_check_global_mean, 2)
