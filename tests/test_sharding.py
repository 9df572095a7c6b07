"""The row-sharded Pairformer, Evoformer and extra-MSA stacks on gloo (2 and 4 CPU ranks) against the
single-process stacks in float64.

Each rank builds the same stack and inputs from a shared seed, runs the single-process stack on the whole
inputs (the reference), then the sharded stack on its rows of the inputs padded to a multiple of the ranks
(N = 11 and 13, MSA depths 5 and 7: padding on every world size), with masks that have holes. The outputs, the
input gradients (summed over ranks: each rank holds its rows') and every parameter gradient (``reduce_gradients``)
must equal the reference to 1e-10 relative; the in-place inference path's outputs likewise. Cases cover both
Pairformer variants, checkpointing of blocks and of modules, chunks, uneven channel groups and batches of 2.
"""
import pytest
import torch
import torch.distributed as dist

from gloo_harness import spawn_gloo
from test_primitives import randomize_, rel_err

from attn_zoo.models.evoformer import EvoformerStack, ExtraMSAStack
from attn_zoo.models.pairformer import PairformerStack
from attn_zoo.models.sharding import ShardedEvoformerStack, ShardedPairformerStack

W = dict(c_s=8, c_z=8, num_heads_single=2, num_heads_pair=2, c_hidden_pair=4, c_hidden_mul=8, transition_n=2,
         pair_dropout=0.0, attention="torch")
TOL = 1e-10

EVO = dict(c_m=8, c_z=8, num_heads_msa=2, c_hidden_msa=4, num_heads_pair=2, c_hidden_pair=4, c_hidden_opm=4,
           c_hidden_mul=8, transition_n=2, msa_dropout=0.0, pair_dropout=0.0, attention="torch")

CASES = [
    # kind, N, batch, blocks, checkpoint_every (0: every module checkpointed instead), training chunk_size,
    # variant / MSA sequences, post_norm_s
    ("pairformer", 11, 1, 2, 1, None, "default", False),
    ("pairformer", 13, 2, 1, 0, 4, "boltz2", True),
    ("evoformer", 11, 1, 2, 1, None, 5, None),
    ("extra_msa", 13, 2, 1, 0, 4, 7, None),
]


def _inputs(case, seed):
    kind, n, batch = case[:3]
    g = torch.Generator().manual_seed(seed)
    if kind == "pairformer":
        x = torch.randn(batch, n, W["c_s"], generator=g, dtype=torch.float64)
        x_mask = torch.rand(batch, n, generator=g) > 0.2
        x_mask[:, :2] = True
        x_mask[:, -1] = False  # a masked residue at the end, next to the padding
        residues = x_mask
    else:
        x = torch.randn(batch, case[6], n, EVO["c_m"], generator=g, dtype=torch.float64)
        x_mask = torch.rand(batch, case[6], n, generator=g) > 0.2
        x_mask[:, 0] = True
        x_mask[:, -1, -3:] = False
        residues = torch.ones(batch, n, dtype=torch.bool)
        residues[:, -1] = False
    z = torch.randn(batch, n, n, W["c_z"], generator=g, dtype=torch.float64)
    pair_mask = residues[:, :, None] & residues[:, None, :] & (torch.rand(batch, n, n, generator=g) > 0.15)
    dx = torch.randn(x.shape, generator=g, dtype=torch.float64)
    dz = torch.randn(z.shape, generator=g, dtype=torch.float64)
    return x, z, x_mask, pair_mask, dx, dz


def _stack(case, seed):
    kind, n, batch, blocks, every, chunk, variant, post = case
    if kind == "pairformer":
        stack = PairformerStack(**W, num_blocks=blocks, checkpoint_every=every, chunk_size=chunk, variant=variant,
                                post_norm_s=post)
    else:
        cls = EvoformerStack if kind == "evoformer" else ExtraMSAStack
        stack = cls(**EVO, num_blocks=blocks, checkpoint_every=every, chunk_size=chunk)
    return randomize_(stack, seed=seed).double()


def _check_case(case, rank, world, seed):
    n = case[1]
    # the single-process reference
    ref = _stack(case, seed)
    s, z, single_mask, pair_mask, ds, dz = _inputs(case, seed + 1)
    s.requires_grad_(), z.requires_grad_()
    s_ref, z_ref = ref(s, z, single_mask, pair_mask)
    ((s_ref * ds).sum() + (z_ref * dz).sum()).backward()
    grads_ref = {k: p.grad.clone() for k, p in ref.named_parameters()}
    ds_ref, dz_ref = s.grad.clone(), z.grad.clone()

    # the sharded stack: this rank's rows, loss on its rows
    stack = _stack(case, seed)
    wrapper = ShardedPairformerStack if case[0] == "pairformer" else ShardedEvoformerStack
    # uneven groups of the 8 channels; every module checkpointed where the stack checkpoints no blocks
    sharded = wrapper(stack, channel_groups=3, checkpoint_modules=case[4] == 0)
    s2, z2 = s.detach().clone().requires_grad_(), z.detach().clone().requires_grad_()
    s_r, z_r, sm, pm = sharded.shard(s2, z2, single_mask, pair_mask)
    assert z_r.shape[1] * world == z_r.shape[2] >= n and z_r.shape[2] < n + world
    gather_kw = {} if case[0] == "pairformer" else {"n_seq": case[6]}
    out_s, out_z = sharded(s_r, z_r, sm, pm)
    ds_r, dz_r, _, _ = sharded.shard(ds, dz)
    ((out_s * ds_r).sum() + (out_z * dz_r).sum()).backward()
    sharded.reduce_gradients()
    for t in (s2, z2):
        dist.all_reduce(t.grad)
    with torch.no_grad():
        s_all, z_all = sharded.gather(out_s, out_z, n=n, **gather_kw)
    errs = {"s": rel_err(s_all, s_ref), "z": rel_err(z_all, z_ref), "grad s": rel_err(s2.grad, ds_ref),
            "grad z": rel_err(z2.grad, dz_ref)}
    names = dict(stack.named_parameters())
    assert set(names) == set(grads_ref)
    # relative to the largest parameter gradient where a tensor's own is analytically zero (the single attention's
    # layer_norm_z.bias: a per-head shift of all logits, which the softmax ignores)
    scale = max(g.abs().max().item() for g in grads_ref.values())
    errs.update({k: rel_err(names[k].grad, g, floor=scale) for k, g in grads_ref.items()})
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, f"world {world} case {case}: {bad}"

    if sharded.checkpoint_modules:  # the forward keeps a fraction of what it keeps without
        kept = [_saved_numel(sharded, s_r, z_r, sm, pm, flag) for flag in (True, False)]
        assert kept[0] < 0.5 * kept[1], kept

    # inference: the in-place chunked path on each rank
    stack.eval().configure_inference(chunk_size=2)
    with torch.no_grad():
        out_s, out_z = sharded(s_r.detach(), z_r.detach(), sm, pm)
        s_all, z_all = sharded.gather(out_s, out_z, n=n, **gather_kw)
    errs = {"s": rel_err(s_all, s_ref), "z": rel_err(z_all, z_ref)}
    assert all(v < TOL for v in errs.values()), f"inference, world {world} case {case}: {errs}"
    # inplace: the caller's z (and an MSA) hold the result; the planned chunk size (none configured)
    stack.configure_inference(chunk_size=None)
    stack.chunk_size = None
    x_in, z_in = s_r.detach().clone(), z_r.detach().clone()
    with torch.no_grad():
        out_x, out_z = sharded.forward_inference(x_in, z_in, sm, pm, inplace=True)
        assert out_z.data_ptr() == z_in.data_ptr() and torch.equal(out_z, z_in)
        if case[0] != "pairformer":
            assert torch.equal(out_x, x_in)
        s_all, z_all = sharded.gather(out_x, out_z, n=n, **gather_kw)
    errs = {"s": rel_err(s_all, s_ref), "z": rel_err(z_all, z_ref)}
    assert all(v < TOL for v in errs.values()), f"inference in place, world {world} case {case}: {errs}"


def _saved_numel(sharded, x, z, x_mask, pair_mask, checkpoint_modules):
    """Elements the autograd graph keeps from one forward (checkpointed regions keep theirs out of reach)."""
    sharded.checkpoint_modules = checkpoint_modules
    numel = [0]

    def pack(t):
        numel[0] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sharded(x, z, x_mask, pair_mask)
    sharded.checkpoint_modules = True
    return numel[0]


def _check(rank, world):
    torch.manual_seed(0)
    for i, case in enumerate(CASES):
        _check_case(case, rank, world, seed=10 * i)
    if world == 2:
        _check_errors()


def _check_errors():
    stack = PairformerStack(**W, num_blocks=1).double()
    sharded = ShardedPairformerStack(stack)
    s, z = torch.randn(1, 3, 8, dtype=torch.float64), torch.randn(1, 3, 5, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"z \(1, 3, 5, 8\) \[B, n, N', c_z\] with N' = 2 \* n"):
        sharded(s, z)
    z = torch.randn(1, 3, 6, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="pair_mask must be bool"):
        sharded(s, z, None, torch.ones(1, 6, 6))
    with pytest.raises(ValueError, match=r"single_mask has shape \(1, 5\), expected the whole padded mask \(1, 6\)"):
        sharded(s, z, torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="stack must be a PairformerStack"):
        ShardedPairformerStack(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_sharded_pairformer_two_ranks():
    spawn_gloo(_check, 2)


@pytest.mark.slow
def test_sharded_pairformer_four_ranks():
    spawn_gloo(_check, 4)


@pytest.mark.slow
def test_bench_script_on_gloo(tmp_path):
    """scripts/bench_shard.py under torchrun on 2 CPU ranks: every benchmark mode writes an ok row, the check passes."""
    import os
    import subprocess
    import sys

    from gloo_harness import free_port

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "rows.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def command(mode, out, *extra):
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                os.path.join(root, "scripts", "bench_shard.py"), "--device", "cpu", "--mode", mode, "--residues", "19",
                "--c-z", "8", "--c-s", "16", "--heads-s", "2", "--heads-z", "2", "--c-pair", "4", "--blocks", "2",
                "--iters", "1", "--out", str(out), *extra]

    for mode in ("block-fwd", "block-train", "stack-infer", "check"):
        res = subprocess.run(command(mode, out), capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        if mode == "check":
            assert "check: PASS" in res.stdout, res.stdout[-2000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "mode" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == ["block-fwd", "block-train", "stack-infer"]
    assert all(r.rstrip(" |").endswith("ok") for r in rows) and all(" | 2 | sharded | 19 | 20 | " in r for r in rows)
    # --profile: one more call profiled on each rank, a row per rank and rank 0's heaviest ops after the timing row
    prof = tmp_path / "prof.md"
    res = subprocess.run(command("block-train", prof, "--profile", "4"), capture_output=True, text=True, timeout=300,
                         env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    text = prof.read_text()
    assert "Profile of one more call of: `| block-train | 2 | sharded |" in text, text
    ranks = [line.split(" | ") for line in text.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    # collectives seen, each once: every rank makes the same calls (c10d's op and gloo's own event are one)
    assert len(ranks) == 2 and int(ranks[0][5]) > 0 and ranks[0][5] == ranks[1][5], text
    assert all(float(r[1]) > 0 and float(r[6].strip(" |")) <= 2 * float(r[1]) for r in ranks), text
    heavy = text.split("Rank 0's heaviest host ops by self CPU time:")[1].splitlines()
    assert len([line for line in heavy if line.startswith("| ") and "`" in line]) == 4, text


@pytest.mark.gpu
def test_check_mode_on_cuda():
    """The sharded stack on NCCL (up to 2 GPUs), float32 against float64: no worse than one process
    (``bench_shard.py --mode check``)."""
    import os
    import subprocess
    import sys

    from gloo_harness import free_port

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    world = min(2, torch.cuda.device_count())
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={free_port()}",
           os.path.join(root, "scripts", "bench_shard.py"), "--mode", "check", "--residues", "77"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "check: PASS" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_bench_profile_counts_each_collective_once_and_tables_every_rank():
    """bench_shard's profile helpers: a collective nested in another (c10d's op around a group's own) counts once;
    the table has a row per rank, '-' kernel columns off CUDA, and names the rank whose kernels it lists."""
    import os
    import sys
    from types import SimpleNamespace as E

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_shard

    step = E(name="ProfilerStep", cpu_parent=None)
    outer = E(name="c10d::allgather_", cpu_parent=step)
    inner = E(name="c10d::_allgather_base_", cpu_parent=outer)
    other = E(name="aten::mm", cpu_parent=outer)
    functional = E(name="_c10d_functional::all_reduce", cpu_parent=None)
    assert [bench_shard.outer_collective(e) for e in (step, outer, inner, other, functional)] == \
        [False, True, False, False, True]
    cuda = dict(wall_ms=12.0, kernel_ms=10.0, comm_kernel_ms=4.0, comm_calls=7, comm_host_ms=0.5,
                heavy=[("nccl_AllGather", 4.0), ("attn_fwd_kernel", 3.0)], device="cuda")
    text = bench_shard.profile_markdown([None, cuda], "| block-fwd | 2 |")
    rows = [line for line in text.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert rows[0].startswith("| 0 | not profiled") and rows[1] == "| 1 | 12.0 | 10.0 | 4.0 | 6.0 | 7 | 0.5 |"
    assert "Rank 1's heaviest kernels by device time:" in text and "| 4.00 | `nccl_AllGather` |" in text
    cpu = dict(cuda, device="cpu", heavy=[("aten::mm", 1.0)])
    assert "| 0 | 12.0 | - | - | - | 7 | 0.5 |" in bench_shard.profile_markdown([cpu], "| r |")
