"""ESM-2 end to end as the walk-through in docs/zoo.md runs it: a fair-esm-layout file (``encoder.sentence_encoder.*``
keys and a ``cfg``) or a Hugging Face folder is fine-tuned with ``train.py experiment=esm2_mlm model.pretrained=``,
and the checkpoint it writes is embedded with ``attn-zoo-embed``; the console script's exit codes; FASTA labels
that name two proteins are refused in training data."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attn_zoo.embed import run as embed_run
from attn_zoo.models.data import DataError
from attn_zoo.models.data.lm import load_sequences
from attn_zoo.models.esm2 import ALPHABET, ESM2
from attn_zoo.models.esmc import ESMC
from attn_zoo.models.tasks.lm_esm import esm2_batch
from attn_zoo.models.transformer import TransformerLM
from attn_zoo.models.zoo import (ZooCheckpointError, load_checkpoint, load_pretrained, to_esmc, to_fair_esm,
                                  to_hf_esm)

from test_graphs import stand_in  # noqa: F401  (the stand-in capture fixture)

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(num_layers=2, embed_dim=32, attention_heads=4)
TINY_ARGS = ["model.size=null", "model.net.num_layers=2", "model.net.embed_dim=32", "model.net.attention_heads=4"]
TINY_ESMC = dict(num_layers=2, width=32, heads=4)
TINY_ESMC_ARGS = ["model.size=null", "model.net.num_layers=2", "model.net.width=32", "model.net.heads=4"]


def pretrained_esm2(seed=0, cls=ESM2, sizes=TINY):
    """A tiny ESM-2 (or ESM C) with weights far from any fresh initialisation (N(0, 0.3) everywhere)."""
    torch.manual_seed(seed)
    m = cls(**sizes)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def fair_esm_file(path: Path, model: ESM2) -> Path:
    ckpt = to_fair_esm(model, layout="checkpoint")
    assert all(k.startswith(("encoder.sentence_encoder.", "encoder.lm_head.")) for k in ckpt["model"])
    assert ckpt["cfg"]["model"].encoder_layers == 2  # fair-esm's layout: weights under "model", config in "cfg"
    torch.save(ckpt, path)
    return path


def hf_folder(path: Path, model) -> Path:
    """A ``save_pretrained``-style folder (config.json + model.safetensors) of an ESM2 or ESMC."""
    from safetensors.torch import save_file

    sd, config = to_hf_esm(model) if isinstance(model, ESM2) else to_esmc(model, layout="hf")
    path.mkdir()
    save_file({k: v.clone().contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    model_type = "esm" if isinstance(model, ESM2) else "esmc"
    (path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return path


def write_fasta(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            seq = "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(20, 40)))
            f.write(f">prot{i} a description\n{seq}\n")
    return path


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --------------------------------------------------------------------------------------------------
# load_pretrained: the readers of from_fair_esm / from_hf_esm, into the ESM2 being trained
# --------------------------------------------------------------------------------------------------
def test_load_pretrained_reads_a_fair_esm_file(tmp_path):
    src = pretrained_esm2()
    path = fair_esm_file(tmp_path / "esm2_t2_tiny.pt", src)
    net = ESM2(**TINY)
    assert load_pretrained(path, into=net) is net and same_weights(net, src)


def test_load_pretrained_reads_a_hugging_face_folder_into_the_esm2_of_a_network(tmp_path):
    src = pretrained_esm2()
    net = torch.nn.ModuleDict({"esm": ESM2(**TINY), "head": torch.nn.Linear(32, 2)})  # a user's network
    head = net["head"].weight.clone()
    load_pretrained(hf_folder(tmp_path / "hf", src), into=net)
    assert same_weights(net["esm"], src) and torch.equal(net["head"].weight, head)


@pytest.mark.slow
def test_load_pretrained_reads_an_esmc_folder_and_state_dict(tmp_path):
    src = pretrained_esm2(cls=ESMC, sizes=TINY_ESMC)
    net = ESMC(**TINY_ESMC)
    load_pretrained(hf_folder(tmp_path / "hf", src), into=net)
    assert same_weights(net, src)
    torch.save(to_esmc(src, layout="esm"), tmp_path / "esmc.pt")  # the esm package's names
    other = ESMC(**TINY_ESMC)
    load_pretrained(tmp_path / "esmc.pt", into=other)
    assert same_weights(other, src)
    with pytest.raises(ZooCheckpointError, match=r"ESM C of num_layers 2, width 32.*model.size=null "
                                                 r"model.net.num_layers=2 model.net.width=32"):
        load_pretrained(tmp_path / "hf", into=ESMC(size="300M"))
    with pytest.raises(ZooCheckpointError, match="loads into an attn_zoo ESMC.*holds 0"):
        load_pretrained(tmp_path / "hf", into=ESM2(**TINY))


def test_load_pretrained_names_the_size_to_set(tmp_path):
    path = fair_esm_file(tmp_path / "esm2_t2_tiny.pt", pretrained_esm2())
    net = ESM2(size="8M")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ZooCheckpointError, match=r"num_layers 2, embed_dim 32, attention_heads 4; the network's ESM2 "
                                                 r"has num_layers 6, embed_dim 320, attention_heads 20 \(8M\).*"
                                                 r"model.size=null model.net.num_layers=2 model.net.embed_dim=32"):
        load_pretrained(path, into=net)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # untouched
    lm = TransformerLM(vocab_size=24, d_model=32, num_layers=1, num_heads=2)
    with pytest.raises(ZooCheckpointError, match="loads into an attn_zoo ESM2.*holds 0"):
        load_pretrained(path, into=lm)


def test_a_contact_regression_no_file_gave_stays_refused_after_training(tmp_path):
    from attn_zoo.models.tasks import ESMMaskedLMTask
    from attn_zoo.models.zoo import load_esm2

    ckpt = to_fair_esm(pretrained_esm2(), layout="checkpoint")
    for k in ("weight", "bias"):  # fair-esm's .pt files ship the contact regression in a file of its own
        del ckpt["model"][f"encoder.sentence_encoder.contact_head.regression.{k}"]
    torch.save(ckpt, tmp_path / "esm2_t2_tiny.pt")
    task = ESMMaskedLMTask(net=ESM2(**TINY), pretrained=str(tmp_path / "esm2_t2_tiny.pt"))
    assert task.net.contact_head.loaded is False
    task.record_net_config({"_target_": "attn_zoo.models.esm2.ESM2", **TINY})
    saved = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams)}
    task.on_save_checkpoint(saved)  # what Lightning adds to every checkpoint it writes
    torch.save(saved, tmp_path / "last.ckpt")
    model = load_esm2(tmp_path / "last.ckpt", attention="torch")
    tokens = ALPHABET.get_batch_converter()([("p", "MKTAYIAK")])[2]
    with pytest.raises(ValueError, match="no contact regression"):
        model(tokens, return_contacts=True)
    assert load_checkpoint(tmp_path / "last.ckpt").contact_head.loaded is False
    fasta = write_fasta(tmp_path / "in.fasta", 2)
    with pytest.raises(ValueError, match="--include contacts: this model has no contact regression"):
        embed_run(["--model", str(tmp_path / "last.ckpt"), "--fasta", str(fasta), "--out", str(tmp_path / "emb"),
                   "--include", "contacts", "--no-progress"])
    assert not (tmp_path / "emb").exists()  # refused before any work


@pytest.mark.parametrize("net", [lambda: ESM2(**TINY), lambda: ESMC(**TINY_ESMC)], ids=["esm2", "esmc"])
def test_every_trainable_parameter_gets_a_gradient(net):
    """DDP (trainer=ddp) fails on a parameter the loss never reaches: ESM-2's contact regression is frozen."""
    from attn_zoo.models.data.alphabet import encode
    from attn_zoo.models.tasks import ESMMaskedLMTask

    task = ESMMaskedLMTask(net=net())
    t = encode("MKTAYIAKQRQISFVK")
    batch = {"tokens": t[None], "target": t[None], "loss_mask": torch.arange(len(t))[None] % 3 == 0,
             "pad_mask": torch.ones(1, len(t), dtype=torch.bool)}
    task.step(batch)[0].backward()
    unused = [n for n, p in task.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused


def test_esm2_batch_wraps_crops_in_cls_and_eos():
    from attn_zoo.models.data.alphabet import MASK, PAD, encode

    a, b = encode("MKV"), encode("AC")
    tokens = torch.stack([torch.cat([a[:1], torch.tensor([MASK]), a[2:]]), torch.cat([b, torch.tensor([PAD])])])
    batch = {"tokens": tokens, "target": torch.stack([a, torch.cat([b, torch.tensor([PAD])])]),
             "loss_mask": torch.tensor([[False, True, False], [True, False, True]]),
             "pad_mask": torch.tensor([[True, True, True], [True, True, False]])}
    out = esm2_batch(batch)
    _, _, want = ALPHABET.get_batch_converter()([("a", "M<mask>V"), ("b", "AC")])
    assert torch.equal(out["tokens"], want)
    assert torch.equal(out["target"], ALPHABET.get_batch_converter()([("a", "MKV"), ("b", "AC")])[2])
    assert out["mask"].tolist() == [[False, False, True, False, False], [False, True, False, False, False]]
    with pytest.raises(ValueError, match="data.packing_frame=2"):  # packed, but no slots for <cls> / <eos>
        esm2_batch({**batch, "segment_ids": torch.zeros_like(tokens)})


def _lm_examples(seqs, seed=0):
    """Masked-LM examples (tokens, target, loss_mask) of ``seqs``, as the dataset makes them."""
    from attn_zoo.models.data.alphabet import encode
    from attn_zoo.models.data.transforms import bert_mask

    g = torch.Generator().manual_seed(seed)
    out = []
    for seq in seqs:
        t = encode(seq)
        corrupted, chosen = bert_mask(t, 0.3, g)
        out.append({"tokens": corrupted, "target": t, "loss_mask": chosen})
    return out


def test_collate_packed_keeps_a_frame_around_each_crop():
    from attn_zoo.models.data.packing import collate_packed

    ex = _lm_examples(["MKV", "AC", "GGGG"])
    b = collate_packed(ex, rows=2, width=10, frame=2)
    for r in range(2):
        seg, real = b["segment_ids"][r], b["pad_mask"][r]
        for s in seg[seg >= 0].unique().tolist():
            where = (seg == s).nonzero().flatten()
            assert not real[where[0]] and not real[where[-1]] and real[where[1:-1]].all()  # frame slots, then real
            assert b["positions"][r, where].tolist() == list(range(len(where)))
    assert int(b["pad_mask"].sum()) == 9 and int((b["segment_ids"] >= 0).sum()) == 9 + 2 * 3
    with pytest.raises(ValueError, match="frame must be 0 or 2"):
        collate_packed(ex, rows=2, width=10, frame=1)


@pytest.mark.parametrize("net", [lambda: ESM2(**TINY), lambda: ESMC(**TINY_ESMC)], ids=["esm2", "esmc"])
def test_packed_batches_train_as_the_padded_ones(net):
    """data.packing=true with packing_frame=2: each crop in its own <cls> ... <eos> slots of a packed row; the
    task's loss and every gradient as with the same crops padded one per row (float64)."""
    from attn_zoo.models.data.batching import collate_lm
    from attn_zoo.models.data.packing import collate_packed
    from attn_zoo.models.tasks import ESMMaskedLMTask

    ex = _lm_examples(["MKTAYIAKQR", "ACDEFG", "LLKKV", "WYYHHPPST"])
    padded, packed = collate_lm(ex), collate_packed(ex, rows=2, width=20, frame=2)
    assert int(packed["pad_mask"].sum()) == int(padded["pad_mask"].sum())
    torch.manual_seed(0)
    task = ESMMaskedLMTask(net=net()).double().eval()  # eval: ESM-2's token dropout statistics are per row
    results = []
    for batch in (padded, packed):
        task.zero_grad(set_to_none=True)
        b = esm2_batch(batch)
        if batch is packed:  # the frame slots hold <cls> and <eos>, one pair per crop
            assert int((b["tokens"] == ALPHABET.cls_idx).sum()) == int((b["tokens"] == ALPHABET.eos_idx).sum()) == 4
        loss = task.step(batch)[0]
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in task.parameters() if p.grad is not None])
    assert len(results[0]) == len(results[1])
    # ESM-2's positions restart per crop: the same sums. ESM C's run on over the row (as ESM C does), which changes
    # no score but rounds its float32 rotary tables at other angles: 1e-5 of each tensor's largest value
    bound = 1e-12 if isinstance(task.net, ESM2) else 1e-5
    for a, b in zip(*results):
        assert (a - b).abs().max() <= bound * b.abs().max()


@pytest.mark.parametrize("net", [lambda: ESM2(**TINY), lambda: ESMC(**TINY_ESMC)], ids=["esm2", "esmc"])
def test_cuda_graphs_option_runs_training_steps_through_a_capture(net, stand_in):
    """model.cuda_graphs: training steps go through CUDAGraphs (a stand-in capture on the CPU, as in
    test_graphs.py): loss and gradients as the eager task's; evaluation runs the net itself; the state_dict keys
    stay the net's; not together with compile."""
    from attn_zoo.models.data.packing import collate_packed
    from attn_zoo.models.tasks import ESMMaskedLMTask

    batches = [collate_packed(_lm_examples(seqs), rows=2, width=16, frame=2)
               for seqs in (["MKTAYIAKQR", "ACDEFG", "LLKKV"], ["GGSWLK", "PPRTEDAKLM", "YV"])]
    assert batches[0]["tokens"].shape == batches[1]["tokens"].shape
    torch.manual_seed(0)
    plain = ESMMaskedLMTask(net=net()).train()
    graphed = ESMMaskedLMTask(net=net(), cuda_graphs=True).train()
    graphed.load_state_dict(plain.state_dict())
    for step, micro in enumerate((batches[:1], batches)):  # the second step accumulates over two micro-batches
        results = []
        for task in (plain, graphed):
            task.zero_grad(set_to_none=True)
            losses = []
            for batch in micro:
                loss = task.step(batch)[0]
                loss.backward()
                losses.append(loss.detach())
                del loss
            results.append(losses + [p.grad.clone() for p in task.parameters() if p.grad is not None])
        assert len(results[0]) == len(results[1])
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*results)), step
    assert len(stand_in.captures) == 1  # one shape: captured once, replayed after
    assert graphed.state_dict().keys() == plain.state_dict().keys()  # the wrapper is no sub-module
    graphed.eval()
    with torch.no_grad():
        graphed.step(batch)
    assert len(stand_in.captures) == 1
    with pytest.raises(ValueError, match="cuda_graphs or compile"):
        ESMMaskedLMTask(net=net(), cuda_graphs=True, compile=True)


def test_cuda_graphs_option_under_lightning_copies_no_gradient(stand_in, monkeypatch, tmp_path):
    """model.cuda_graphs under a Lightning Trainer (which zeroes gradients after the next step's forward): the task
    drops the gradients after each optimizer step, so no replay has a gradient to copy out of the capture's
    buffers; the losses are the eager task's."""
    import functools

    import lightning as L

    from attn_zoo.models import graphs
    from attn_zoo.models.data.packing import collate_packed
    from attn_zoo.models.tasks import ESMMaskedLMTask

    copied = []
    original = graphs.CUDAGraphs._copy_out_shared_grads
    monkeypatch.setattr(graphs.CUDAGraphs, "_copy_out_shared_grads",
                        lambda self, params: copied.append(original(self, params)) or copied[-1])
    batches = [collate_packed(_lm_examples(seqs, seed=i), rows=2, width=16, frame=2) for i, seqs in
               enumerate((["MKTAYIAKQR", "ACDEFG"], ["GGSWLK", "PPRTEDAKLM"], ["YVLKAAGHE", "MMQT"]))]

    class Losses(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.seen.append(float(outputs["loss"]))
            if module.hparams.get("cuda_graphs"):
                assert all(p.grad is None for p in module.parameters())  # dropped after the optimizer step

    losses = []
    for graphed in (False, True):
        torch.manual_seed(0)
        task = ESMMaskedLMTask(net=ESM2(**TINY), cuda_graphs=graphed,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        cb = Losses()
        trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=[cb], default_root_dir=str(tmp_path))
        trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
        losses.append(cb.seen)
    assert len(losses[1]) == 3 and all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(*losses)), losses
    assert copied and not any(copied), copied  # replays ran, and none had a gradient to copy


def test_training_fasta_refuses_labels_that_name_two_proteins(tmp_path):
    fasta = tmp_path / "train.fasta"
    fasta.write_text(">p1\nMKTAYIAK\n>p3 first\nGGAKACLL\n>p3 second\nLLLLKKKK\n")
    with pytest.raises(DataError, match=r"train.fasta:5: duplicate label 'p3' \(first at line 3\)"):
        load_sequences(str(fasta), None)
    fasta.write_text(">p1\nMKTAYIAK\n>P1\nGGAKACLL\n")
    with pytest.raises(DataError, match=r"train.fasta:3: label 'P1' differs from 'p1' only in letter case"):
        load_sequences(str(fasta), None)


# --------------------------------------------------------------------------------------------------
# The walk-through: train.py and the embed command line, as processes
# --------------------------------------------------------------------------------------------------
def _run(args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=str(ROOT))


def _console(args):
    """``attn-zoo-embed`` exactly as its installed script runs it: ``sys.exit(main())``."""
    code = ("import sys; from importlib.metadata import entry_points; "
            "ep, = [e for e in entry_points(group='console_scripts') if e.name == 'attn-zoo-embed']; "
            "sys.argv[0] = 'attn-zoo-embed'; sys.exit(ep.load()())")
    return _run(["-c", code, *args])


def _fine_tune(tmp_path, pretrained, lr="1e-3", experiment="esm2_mlm", extra=()):
    fasta = write_fasta(tmp_path / "train.fasta", 12)
    logs = tmp_path / "logs"
    sizes = TINY_ARGS if experiment == "esm2_mlm" else TINY_ESMC_ARGS
    r = _run(["train.py", f"experiment={experiment}", f"model.pretrained={pretrained}", *sizes,
              f"model.optimizer.lr={lr}", "model.scheduler.start_factor=1.0", f"data.fasta={fasta}",
              "data.batch_size=2", "data.train_samples=6", "data.val_samples=2", "trainer.max_steps=3",
              "trainer.max_epochs=1", "test=false", "logger=csv", f"paths.log_dir={logs}", "run_name=ft", *extra])
    assert r.returncode == 0, r.stderr[-3000:]
    last = logs / "train" / "runs" / "ft" / "checkpoints" / "last.ckpt"
    assert last.is_file(), r.stderr[-2000:]
    return last, fasta


@pytest.mark.slow
def test_fine_tune_a_fair_esm_file_then_embed_with_the_checkpoint(tmp_path):
    src = pretrained_esm2()
    last, fasta = _fine_tune(tmp_path, fair_esm_file(tmp_path / "esm2_t2_tiny.pt", src))
    tuned = load_checkpoint(last, attention="torch")
    assert isinstance(tuned, ESM2) and (tuned.num_layers, tuned.embed_dim) == (2, 32)
    # started from the file (a fresh init is ~0.3 away everywhere), then trained: 3 Adam steps of lr 1e-3
    src_sd, tuned_sd = src.state_dict(), tuned.state_dict()
    moved = max((tuned_sd[k] - src_sd[k]).abs().max().item() for k in src_sd)
    assert 0 < moved < 0.05

    out = tmp_path / "emb"
    r = _console(["--model", str(last), "--fasta", str(fasta), "--out", str(out), "--include", "mean", "contacts",
                  "--attention", "torch", "--device", "cpu", "--no-progress"])
    assert r.returncode == 0, r.stderr
    assert "12 written, 0 skipped" in r.stderr
    got = torch.load(out / "prot0.pt", weights_only=True)
    seq = got["sequence"]
    with torch.no_grad():
        ref = tuned.eval()(ALPHABET.get_batch_converter()([("prot0", seq)])[2], repr_layers=[2])
    want = ref["representations"][2][0, 1:len(seq) + 1].mean(0)
    torch.testing.assert_close(got["mean_representations"][2], want, rtol=1e-5, atol=1e-6)
    assert got["contacts"].shape == (len(seq), len(seq))

    # the same run through scripts/embed.py, and a failure: exit 1 with one line
    r = _run(["scripts/embed.py", "--model", str(last), "--fasta", str(fasta), "--out", str(out), "--no-progress"])
    assert r.returncode != 0 and "other settings" in r.stderr  # --include differs from the folder's manifest
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("attn-zoo-embed: error:"), r.stderr


@pytest.mark.slow
def test_fine_tune_from_a_hugging_face_folder(tmp_path):
    src = pretrained_esm2(seed=1)
    last, _ = _fine_tune(tmp_path, hf_folder(tmp_path / "hf", src), lr="0")
    tuned = load_checkpoint(last, attention="torch")
    assert same_weights(tuned, src)  # lr 0: the checkpoint holds exactly the folder's weights


@pytest.mark.slow
def test_fine_tune_esmc_then_embed(tmp_path):
    src = pretrained_esm2(seed=2, cls=ESMC, sizes=TINY_ESMC)
    last, fasta = _fine_tune(tmp_path, hf_folder(tmp_path / "hf", src), lr="0", experiment="esmc_mlm")
    tuned = load_checkpoint(last, attention="torch")
    assert isinstance(tuned, ESMC) and same_weights(tuned, src)
    r = _console(["--model", str(last), "--fasta", str(fasta), "--out", str(tmp_path / "emb"), "--attention", "torch",
                  "--device", "cpu", "--no-progress"])
    assert r.returncode == 0, r.stderr
    assert "12 written, 0 skipped" in r.stderr


@pytest.mark.slow
def test_fine_tune_esmc_packed_with_cuda_graphs_option(tmp_path):
    """data.packing=true with data.packing_frame=2 and model.cuda_graphs=true from the command line: the
    run trains from the folder and writes a checkpoint of the plain net (on the CPU the steps run eagerly)."""
    src = pretrained_esm2(seed=2, cls=ESMC, sizes=TINY_ESMC)
    last, _ = _fine_tune(tmp_path, hf_folder(tmp_path / "hf", src), experiment="esmc_mlm",
                         extra=["data.packing=true", "data.packing_frame=2", "model.cuda_graphs=true"])
    tuned = load_checkpoint(last, attention="torch")
    src_sd, tuned_sd = src.state_dict(), tuned.state_dict()
    assert src_sd.keys() == tuned_sd.keys()
    assert 0 < max((tuned_sd[k] - src_sd[k]).abs().max().item() for k in src_sd) < 0.05


@pytest.mark.slow
def test_console_script_exit_codes(tmp_path):
    fasta = write_fasta(tmp_path / "in.fasta", 3)
    model = fair_esm_file(tmp_path / "esm2_t2_tiny.pt", pretrained_esm2())
    ok = _console(["--model", str(model), "--fasta", str(fasta), "--out", str(tmp_path / "o"), "--no-progress"])
    assert ok.returncode == 0, ok.stderr
    bad = _console(["--model", str(fasta), "--fasta", str(fasta), "--out", str(tmp_path / "o2"), "--no-progress"])
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
    assert "not a torch checkpoint" in bad.stderr and "Traceback" not in bad.stderr
    usage = _console(["--fasta", str(fasta)])
    assert usage.returncode == 2 and "--model" in usage.stderr
    help_ = _console(["--help"])
    assert help_.returncode == 0 and "(default: 4096)" in help_.stdout and "(default: mean)" in help_.stdout
