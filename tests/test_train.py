"""train.py end to end on CPU with tiny models: fast_dev_run of every experiment, the same first steps
across attention backends, crash-safe checkpoints and resume (step count and optimizer state)."""
import csv
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from attn_zoo import train
from test_configs import CONFIG_DIR, make_cfg

TINY_MSA = ["data.crop_size=16", "data.msa_depth=4", "data.batch_size=2", "data.train_samples=8", "data.val_samples=4",
            "data.max_msa_rows=64"]
TINY_LM = ["model.net.d_model=32", "model.net.num_layers=1", "model.net.num_heads=2", "data.batch_size=2",
           "data.train_samples=4", "data.val_samples=2"]
TINY_ESM2 = ["model.size=null", "model.net.num_layers=2", "model.net.embed_dim=32", "model.net.attention_heads=4",
             "data.batch_size=2", "data.train_samples=4", "data.val_samples=2"]
TINY_ESMC = ["model.size=null", "model.net.num_layers=2", "model.net.width=32", "model.net.heads=4",
             "data.batch_size=2", "data.train_samples=4", "data.val_samples=2"]
EXPERIMENTS = {
    "evoformer_msa": TINY_MSA + ["model.net.trunk.num_blocks=1", "model.net.trunk.c_m=16", "model.net.trunk.c_z=8"],
    "pairformer_msa": TINY_MSA + ["model.net.trunk.stack.num_blocks=1"],
    "transformer_mlm": TINY_LM + ["data.max_len=32", "data.msa_rows=query"],
    "esm2_mlm": TINY_ESM2 + ["data.max_len=32", "data.msa_rows=query"],
    "esmc_mlm": TINY_ESMC + ["data.max_len=32", "data.msa_rows=query"],
    "longctx_clm": TINY_LM + ["data.seq_len=32", "data.msa_rows=query"],
    # GPU benchmarks, on CPU here with tiny shapes and fp32
    "bench_evoformer": ["trainer=cpu", "model.net.trunk.num_blocks=1", "model.net.trunk.c_m=16", "model.net.trunk.c_z=8",
                        "model.net.trunk.c_hidden_mul=8", "data.msa_depth=3", "data.length=12", "data.train_samples=2"],
    "bench_longctx": ["trainer=cpu", "data.seq_len=32", "data.train_samples=2"] + TINY_LM[:3],
}
EXPERIMENT_FILES = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def test_every_experiment_is_covered():
    assert sorted(EXPERIMENTS) == EXPERIMENT_FILES


@pytest.mark.parametrize("backend", ["chunked"])
@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_experiment_fast_dev_run(experiment, backend, tmp_path):
    cfg = make_cfg([f"experiment={experiment}", f"attention={backend}", "debug=fdr", "logger=csv"]
                   + EXPERIMENTS[experiment], tmp_path)
    metrics, objs = train.train(cfg)
    assert objs["trainer"].global_step == 1
    for stage in ("val", "test"):
        assert math.isfinite(metrics[f"{stage}/loss"]) and metrics[f"{stage}/loss"] > 0
    backends = {m.attention.backend for m in objs["model"].modules() if hasattr(m, "attention")
                and hasattr(m.attention, "backend")}
    assert backends == {backend}


def _step_losses(run_dir: Path) -> list[float]:
    rows = list(csv.DictReader(open(next(run_dir.glob("csv/version_*/metrics.csv")))))
    return [float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")]


def _three_steps(backend, tmp_path, precision="32-true"):
    out = tmp_path / f"{backend}-{precision}"
    cfg = make_cfg(["experiment=evoformer_msa", f"attention={backend}", "callbacks=none", "logger=csv", "test=false",
                    "trainer.max_steps=3", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1",
                    f"trainer.precision={precision}", "model.net.trunk.msa_dropout=0", "model.net.trunk.pair_dropout=0",
                    "model.net.trunk.num_blocks=1", "model.net.trunk.c_m=16", "model.net.trunk.c_z=8"] + TINY_MSA, out)
    train.train(cfg)
    return torch.tensor(_step_losses(out), dtype=torch.float64)


def test_same_seed_same_losses_across_backends(tmp_path):
    """Steps 1-3 of the same seeded run with the torch and chunked backends. The residual blocks
    start as identity (zero-init output layers), so step 1 alone cannot tell backends apart; steps
    2-3 run on weights the attention gradients have moved. Tolerance: 3x the torch backend's own
    float32 error against a float64 run of the same steps, floored at float32 rounding."""
    ref = _three_steps("torch", tmp_path, "64-true")
    ref_torch = _three_steps("torch", tmp_path)
    chunked = _three_steps("chunked", tmp_path)
    assert len(ref) == len(ref_torch) == len(chunked) == 3
    assert not torch.allclose(ref[0], ref[2])  # training moved the weights
    floor = 8 * torch.finfo(torch.float32).eps * ref.abs()
    tol = 3 * (ref_torch - ref).abs() + floor
    assert ((chunked - ref).abs() <= tol).all(), (chunked - ref, tol)


class CrashAtStep(L.Callback):
    """Raises after optimizer step ``step`` (a simulated crash mid-run)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


def _adam_steps(trainer) -> set:
    return {int(s["step"]) for s in trainer.optimizers[0].state.values()}


def test_crash_then_resume_continues_step_and_optimizer_state(tmp_path):
    common = ["experiment=evoformer_msa", "attention=torch", "callbacks=default", "~callbacks.progress_bar", "test=false",
              "trainer.max_steps=6", "trainer.max_epochs=-1", "trainer.limit_val_batches=1",
              "callbacks.last_checkpoint.every_n_train_steps=2", "model.net.trunk.num_blocks=1", "model.net.trunk.c_m=16",
              "model.net.trunk.c_z=8", "~logger"] + TINY_MSA
    crash = make_cfg(common + [f"+callbacks.crash._target_={__name__}.CrashAtStep", "+callbacks.crash.step=3"], tmp_path)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train.train(crash)
    last = tmp_path / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3  # saved on the exception: no step lost
    assert {int(s["step"]) for s in saved["optimizer_states"][0]["state"].values()} == {3}

    resumed = make_cfg(common + ["resume=true"], tmp_path)
    _, objs = train.train(resumed)
    assert objs["trainer"].global_step == 6
    assert _adam_steps(objs["trainer"]) == {6}  # Adam moments continued from step 3, not restarted
    # the same through an explicit ckpt_path (last.ckpt now holds the resumed run's step 6), another run dir
    explicit = make_cfg(common + [f"ckpt_path={last}", "trainer.max_steps=7"], tmp_path / "again")
    _, objs = train.train(explicit)
    assert objs["trainer"].global_step == 7 and _adam_steps(objs["trainer"]) == {7}


def test_missing_ckpt_path_is_an_error(tmp_path):
    cfg = make_cfg(["experiment=evoformer_msa", f"ckpt_path={tmp_path / 'nope.ckpt'}"], tmp_path)
    with pytest.raises(ValueError, match="nope.ckpt"):
        train.resolve_ckpt_path(cfg)


def test_contact_precision_counts_separation_in_residue_numbers():
    from attn_zoo.models.tasks.metrics import long_range_contact_precision

    n, bins = 30, 64
    distogram = torch.full((1, n, n), bins - 1)
    distogram[0, 0, 10] = distogram[0, 10, 0] = 0  # the only contact: 10 apart in the crop
    logits = torch.zeros(1, n, n, bins)
    logits[..., bins - 1] = 5.0
    logits[0, 0, 10, :] = 0.0
    logits[0, 0, 10, 0] = 10.0
    pair_mask = torch.ones(1, n, n, dtype=torch.bool)
    gap = torch.cat([torch.arange(6), torch.arange(6, n) + 20])[None]  # 20 unresolved residues after #5
    p_plain, k_plain = long_range_contact_precision(logits, distogram, pair_mask)
    p_gap, k_gap = long_range_contact_precision(logits, distogram, pair_mask, residue_index=gap)
    assert k_plain == k_gap == 1
    assert p_plain == 0  # |0 - 10| < 24 in crop positions: not a long-range pair
    assert p_gap > 0  # 30 residues apart in the chain: long-range, and the top-scored pair


@pytest.mark.parametrize("experiment", ["transformer_mlm", "longctx_clm"])
def test_packing_flag_trains(experiment, tmp_path):
    """``data.packing=true``: batches carry segment ids through the task into the network, one step runs."""
    cfg = make_cfg([f"experiment={experiment}", "attention=chunked", "debug=fdr", "logger=csv", "data.packing=true"]
                   + EXPERIMENTS[experiment], tmp_path)
    seen = []
    net_forward = None

    metrics, objs = None, None
    from attn_zoo.models.transformer import TransformerLM

    net_forward = TransformerLM.forward

    def spy(self, tokens, pad_mask=None, segment_ids=None, positions=None):
        seen.append(segment_ids is not None and positions is not None)
        return net_forward(self, tokens, pad_mask, segment_ids, positions)

    TransformerLM.forward = spy
    try:
        metrics, objs = train.train(cfg)
    finally:
        TransformerLM.forward = net_forward
    assert objs["trainer"].global_step == 1 and seen and all(seen)
    assert math.isfinite(metrics["val/loss"])


@pytest.mark.parametrize("experiment", ["pairformer_msa", "transformer_mlm", "esm2_mlm", "esmc_mlm"])
def test_length_multiple_pads_batches_and_keeps_the_loss(experiment, tmp_path):
    """``data.length_multiple``: every batch's length is a multiple of it, and the task's loss on a batch is the
    unpadded batch's (padding is masked everywhere)."""
    import hydra

    over = [f"experiment={experiment}", "attention=torch"] + EXPERIMENTS[experiment]
    key = "msa" if experiment == "pairformer_msa" else "tokens"

    def val_batch(multiple):
        cfg = make_cfg(over + [f"data.length_multiple={multiple}"], tmp_path)
        dm = hydra.utils.instantiate(cfg.data)
        dm.setup("fit")
        return cfg, next(iter(dm.val_dataloader()))  # the val set is seeded: the same examples every time

    cfg, plain = val_batch(1)
    n = plain[key].shape[-1]
    _, padded = val_batch(n + 3)  # padded to n + 3: three masked positions more
    assert padded[key].shape[-1] == n + 3
    torch.manual_seed(0)
    task = hydra.utils.instantiate(cfg.model).eval()
    with torch.no_grad():
        (loss1, logs1, _), (loss2, logs2, _) = task.step(plain), task.step(padded)
    torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-6)
    for name in logs1:
        torch.testing.assert_close(torch.as_tensor(logs2[name]), torch.as_tensor(logs1[name]), rtol=1e-5, atol=1e-6)


def test_length_multiple_is_checked():
    from attn_zoo.models.data import MaskedLMDataModule, MSADataModule

    for bad in (0, -8, 2.0, True):
        with pytest.raises(ValueError, match="length_multiple must be an int >= 1"):
            MSADataModule(length_multiple=bad)
    with pytest.raises(ValueError, match="no effect with packing"):
        MaskedLMDataModule(packing=True, length_multiple=8)


@pytest.mark.parametrize("experiment", ["pairformer_msa", "transformer_mlm"])
def test_warmup_batches_cover_every_width_the_loader_makes(experiment, tmp_path):
    """``warmup_batches``: one batch of ``batch_size`` rows per multiple the training examples pad to, each exactly
    that wide, in increasing order; none with ``length_multiple`` 1; a cap on the number of widths is an error."""
    import hydra

    from attn_zoo.models.primitives import round_up

    key = "msa" if experiment == "pairformer_msa" else "tokens"
    lengths = ["data.train_samples=64"] + (["data.crop_size=100"] if experiment == "pairformer_msa" else
                                            ["data.max_len=200"])

    def module(multiple):
        cfg = make_cfg([f"experiment={experiment}"] + EXPERIMENTS[experiment] + lengths
                       + [f"data.length_multiple={multiple}"], tmp_path)
        dm = hydra.utils.instantiate(cfg.data)
        dm.setup("fit")
        return cfg, dm

    cfg, dm = module(32)
    widths = sorted({round_up(n, 32) for n in dm.train_set.lengths()})
    got = dm.warmup_batches()
    assert [w for w, _ in got] == widths and len(widths) >= 2
    for w, batch in got:
        assert batch[key].shape[0] == cfg.data.batch_size and batch[key].shape[-1] == w
    assert module(1)[1].warmup_batches() == []
    with pytest.raises(ValueError, match="max_widths=1"):
        dm.warmup_batches(max_widths=1)


def test_warmup_batches_take_the_deepest_msa_of_each_width():
    """A batch has as many MSA rows as its deepest example, narrower ones included, so the warm-up batch of a width
    holds that width's deepest example and, in its other places, the deepest example of that width or narrower: the
    row count a training batch of that width most likely gets, even where a shallower example of the width comes
    first, and for a width of shallow examples only (the sample's structure-only proteins have one row)."""
    import dataclasses

    from attn_zoo.models.data.msa import MSADataModule
    from attn_zoo.models.primitives import round_up

    dm = MSADataModule(crop_size=100, train_samples=16, length_multiple=32, batch_size=2)
    dm.setup("fit")
    ds = dm.train_set
    # the shallowest first, and one deep alignment cut short: a narrow width with a deep MSA below a wider one of
    # single sequences (the sample's structure-only proteins)
    ds.entries = sorted(ds.entries, key=lambda e: e.msa.shape[0])
    cut = next(i for i, e in enumerate(ds.entries) if e.msa.shape[0] >= 32)
    e = ds.entries[cut]
    ds.entries[cut] = dataclasses.replace(e, msa=e.msa[:, :60], distogram=e.distogram[:60, :60],
                                          distogram_mask=e.distogram_mask[:60, :60],
                                          residue_index=None if e.residue_index is None else e.residue_index[:60])
    deepest = {}
    for n, d in zip(ds.lengths(), ds.depths()):
        deepest.setdefault(round_up(n, 32), set()).add(d)
    assert any(len(d) > 1 for d in deepest.values()), deepest  # a width whose first example is not its deepest
    assert any(max(deepest[v]) > max(deepest[w]) for v in deepest for w in deepest if v < w), deepest
    got = dm.warmup_batches()
    assert [w for w, _ in got] == sorted(deepest)
    for w, batch in got:
        rows = max(d for v, ds_ in deepest.items() if v <= w for d in ds_)
        assert batch["msa"].shape == (2, rows, w)
        assert round_up(int(batch["seq_mask"][0].sum()), 32) == w  # the first example is of this width


@pytest.mark.slow
def test_length_warmup_steps_every_width_and_changes_nothing(tmp_path, monkeypatch):
    """The ``length_warmup`` callback (in the default callbacks, off unless enabled) runs a training step at every
    width the data pads to, first under ``compile_ahead`` and then for real, before the first optimizer step, and
    the run's losses and weights are exactly those of the same run without it (gradients dropped, random
    generators restored)."""
    import contextlib

    import attn_ops
    from attn_zoo.models.tasks import callbacks as cb

    ahead, seen, inside = [], [], []
    real_step = cb.LengthWarmup._step

    @contextlib.contextmanager
    def compile_ahead():  # (the real block does nothing on the CPU interpreter)
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setattr(attn_ops, "compile_ahead", compile_ahead)

    def step(trainer, pl_module, batch):
        ahead.append(bool(inside))
        seen.append((batch["msa"].shape[-1], trainer.global_step))
        real_step(trainer, pl_module, batch)

    monkeypatch.setattr(cb.LengthWarmup, "_step", staticmethod(step))
    runs = {}
    for enabled in (True, False):
        out = tmp_path / f"warmup-{enabled}"
        cfg = make_cfg(["experiment=pairformer_msa", "attention=torch", "logger=csv", "test=false",
                        "trainer.max_steps=2", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1",
                        "data.length_multiple=32", "data.crop_size=100", f"callbacks.length_warmup.enabled={enabled}"]
                       + EXPERIMENTS["pairformer_msa"][1:], out)
        _, objs = train.train(cfg)
        warm = next(c for c in objs["trainer"].callbacks if isinstance(c, cb.LengthWarmup))
        runs[enabled] = (_step_losses(out), {k: v.clone() for k, v in objs["model"].state_dict().items()}, warm)
    widths = runs[True][2].summary["widths"]
    assert len(widths) >= 2 and all(w % 32 == 0 for w in widths)
    assert seen == [(w, 0) for w in widths] * 2 and ahead == [True] * len(widths) + [False] * len(widths)
    assert runs[False][2].summary == {}
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 2
    for name, value in runs[True][1].items():
        assert torch.equal(value, runs[False][1][name]), name


def test_length_warmup_skips_a_wrapped_module():
    """Where the strategy wraps the module (DDP, FSDP) or several processes run, the warm-up is skipped with a
    warning naming the strategy, before any step or data preparation."""
    import types

    from attn_zoo.models.tasks.callbacks import LengthWarmup

    asked = []
    module = torch.nn.Linear(2, 2)
    for world, wrapped in ((1, object()), (2, module)):
        trainer = types.SimpleNamespace(world_size=world, strategy=types.SimpleNamespace(model=wrapped),
                                        datamodule=types.SimpleNamespace(warmup_batches=asked.append))
        with pytest.warns(RuntimeWarning, match=f"skipped under SimpleNamespace \\(world size {world}\\)"):
            LengthWarmup(enabled=True).on_train_start(trainer, module)
    assert asked == []
    with pytest.raises(ValueError, match="max_widths must be >= 1, got 0"):
        LengthWarmup(max_widths=0)
