"""Reloading and fine-tuning through the zoo: a checkpoint trained with train.train reloads outside train.py
in one call (zoo.load_checkpoint, and Lightning's load_from_checkpoint) with the same outputs;
model.pretrained=PATH loads a checkpoint trained here (or Boltz-2 weights) before training; load_pretrained
leaves the network untouched when the file does not fit; the fair-esm / Hugging Face dispatch (run once the ESM
converters are in the zoo)."""

import pytest
import torch
from torch import nn

from attn_zoo import train
from attn_zoo.models import zoo
from attn_zoo.models.pairformer import PairformerStack
from attn_zoo.models.tasks import MSADistogramTask
from attn_zoo.models.zoo import ZooCheckpointError, build_network, load_checkpoint, load_pretrained
from test_configs import make_cfg
from test_train import TINY_MSA

TINY = {
    "evoformer_msa": ["model.net.trunk.num_blocks=1", "model.net.trunk.c_m=16", "model.net.trunk.c_z=8"],
    "pairformer_msa": ["model.net.trunk.stack.num_blocks=1"],
}


def train_two_steps(experiment, out, extra=()):
    cfg = make_cfg([f"experiment={experiment}", "attention=chunked", "callbacks=last_checkpoint", "~logger",
                    "test=false", "trainer.max_steps=2", "trainer.max_epochs=-1", "trainer.limit_val_batches=0",
                    "callbacks.last_checkpoint.every_n_train_steps=1"] + TINY_MSA + TINY[experiment] + list(extra), out)
    _, objs = train.train(cfg)
    return objs, out / "checkpoints" / "last.ckpt"


def a_batch(objs):
    dm = objs["datamodule"]
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """experiment -> (objects of the run, its last.ckpt): each trained once for the whole module."""
    runs = {}
    for experiment in TINY:
        runs[experiment] = train_two_steps(experiment, tmp_path_factory.mktemp(experiment))
    return runs


@pytest.mark.parametrize("experiment", sorted(TINY))
def test_trained_checkpoint_reloads_in_one_call_with_the_same_outputs(trained, experiment):
    objs, last = trained[experiment]
    assert objs["trainer"].global_step == 2 and last.is_file()
    batch = a_batch(objs)
    trained_net = objs["model"].net.eval()
    with torch.no_grad():
        want = trained_net(batch)

    net = load_checkpoint(last).eval()
    assert type(net) is type(trained_net) and net is not trained_net
    with torch.no_grad():
        got = net(batch)
    for k in want:
        assert torch.equal(got[k], want[k]), k

    task = load_checkpoint(last, task=True).eval()
    assert type(task) is MSADistogramTask and task.hparams.distogram_weight == objs["model"].hparams.distogram_weight
    with torch.no_grad():
        assert torch.equal(task.net(batch)["distogram_logits"], want["distogram_logits"])
    lightning = MSADistogramTask.load_from_checkpoint(last, map_location="cpu").eval()  # no net passed in
    with torch.no_grad():
        assert torch.equal(lightning.net(batch)["msa_logits"], want["msa_logits"])

    # another backend on reload: every attention module switches, outputs agree to fp32 rounding
    torch_net = load_checkpoint(last, attention="torch").eval()
    assert {m.attention.backend for m in torch_net.modules() if hasattr(getattr(m, "attention", None), "backend")} \
        == {"torch"}
    with torch.no_grad():
        got = torch_net(batch)
    for k in want:
        assert (got[k] - want[k]).abs().max() <= 1e-5 * want[k].abs().max(), k


def test_pretrained_checkpoint_is_loaded_before_training(trained, tmp_path):
    objs, last = trained["evoformer_msa"]
    want = objs["model"].net.state_dict()
    cfg = make_cfg(["experiment=evoformer_msa", "attention=chunked", "~logger", "callbacks=none", "train=false",
                    "test=false", f"model.pretrained={last}"] + TINY_MSA + TINY["evoformer_msa"], tmp_path)
    _, fresh = train.train(cfg)
    got = fresh["model"].net.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert "pretrained" not in fresh["model"].hparams  # a reload must not need the file again
    # and training goes on from there
    objs2, last2 = train_two_steps("evoformer_msa", tmp_path / "ft", [f"model.pretrained={last}"])
    assert objs2["trainer"].global_step == 2 and last2.is_file()
    moved = objs2["model"].net.state_dict()
    assert any(not torch.equal(moved[k], want[k]) for k in want)


def test_pretrained_that_does_not_fit_leaves_the_net_untouched(trained, tmp_path):
    _, last = trained["evoformer_msa"]
    cfg = make_cfg(["experiment=evoformer_msa", "attention=chunked"] + TINY_MSA
                   + ["model.net.trunk.num_blocks=1", "model.net.trunk.c_m=16", "model.net.trunk.c_z=16"], tmp_path)
    import hydra

    net = hydra.utils.instantiate(cfg.model.net)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ZooCheckpointError, match=r"wrong shape: .*\(expected"):
        load_pretrained(last, into=net)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    _, pair_last = trained["pairformer_msa"]
    with pytest.raises(ZooCheckpointError, match=r"missing key\(s\).*unexpected key\(s\)"):
        load_pretrained(pair_last, into=net)


def test_boltz_weights_load_into_the_pairformer_of_a_network(tmp_path):
    pytest.importorskip("boltz.model.layers.pairformer")
    from test_zoo_boltz import boltz_module

    m = boltz_module()
    path = tmp_path / "boltz2.ckpt"
    torch.save({"state_dict": {f"pairformer_module.{k}": v for k, v in m.state_dict().items()}}, path)
    sizes = dict(c_s=32, c_z=8, num_blocks=2, num_heads_single=2, num_heads_pair=2, c_hidden_pair=16,
                 c_hidden_mul=8, transition_n=4)
    net = nn.Sequential(nn.Linear(3, 3), PairformerStack(**sizes, variant="boltz2"))
    load_pretrained(path, into=net)
    want = zoo.from_boltz(m.state_dict()).state_dict()
    for k, v in net[1].state_dict().items():
        assert torch.equal(v, want[k]), k
    default = nn.Sequential(PairformerStack(**sizes))
    with pytest.raises(ZooCheckpointError, match=r"variant='boltz2'.*missing key\(s\)"):
        load_pretrained(path, into=default)
    with pytest.raises(ZooCheckpointError, match="exactly one PairformerStack"):
        load_pretrained(path, into=nn.Linear(2, 2))


def test_bad_files_for_load_checkpoint_and_load_pretrained(trained, tmp_path):
    _, last = trained["evoformer_msa"]
    net = nn.Linear(2, 2)
    junk = tmp_path / "junk.pt"
    torch.save({"weights": [1, 2]}, junk)
    with pytest.raises(ZooCheckpointError, match="none of what the zoo loads"):
        load_pretrained(junk, into=net)
    with pytest.raises(ZooCheckpointError, match="not a checkpoint trained with attn-zoo"):
        load_checkpoint(junk)
    truncated = tmp_path / "last.ckpt"
    truncated.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(ZooCheckpointError, match="truncated"):
        load_checkpoint(truncated)
    with pytest.raises(ZooCheckpointError, match="truncated"):
        load_pretrained(truncated, into=net)
    # a Lightning checkpoint without the recorded net config (trained before it was recorded)
    old = torch.load(last, map_location="cpu", weights_only=True)
    del old["hyper_parameters"]["net_config"], old["attn_zoo_task"]
    torch.save(old, tmp_path / "old.ckpt")
    with pytest.raises(ZooCheckpointError, match="without the net config"):
        load_checkpoint(tmp_path / "old.ckpt")


def test_build_network_refuses_unregistered_targets():
    assert isinstance(build_network({"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}), nn.Linear)
    for target, kwargs in [("os.system", {"command": "true"}), ("builtins.eval", {"source": "1"})]:
        with pytest.raises(ZooCheckpointError,
                           match=rf"'{target}' is not a registered class.*register_network\(YourClass\)"):
            build_network({"_target_": target, **kwargs})
    with pytest.raises(ZooCheckpointError, match="_partial_"):
        build_network({"_target_": "torch.nn.Linear", "_partial_": True})


def test_fair_esm_file_dispatches_to_from_fair_esm(tmp_path):
    from attn_zoo.models.zoo import from_fair_esm
    esm2 = pytest.importorskip("esm.model.esm2")
    torch.manual_seed(0)
    src, other = esm2.ESM2(num_layers=2, embed_dim=32, attention_heads=4), esm2.ESM2(num_layers=2, embed_dim=32, attention_heads=4)
    path = tmp_path / "esm2_tiny.pt"
    torch.save({"model": src.state_dict()}, path)
    into = from_fair_esm(other.state_dict())
    load_pretrained(path, into=into)
    want = from_fair_esm(src.state_dict()).state_dict()
    for k, v in into.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_hugging_face_folder_dispatches_to_from_hf_esm(tmp_path):
    from attn_zoo.models.zoo import from_hf_esm
    transformers = pytest.importorskip("transformers")
    config = transformers.EsmConfig(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, position_embedding_type="rotary", token_dropout=True,
                                    pad_token_id=1, mask_token_id=32)
    torch.manual_seed(0)
    src = transformers.EsmForMaskedLM(config)
    src.save_pretrained(tmp_path / "hf")
    into = from_hf_esm(transformers.EsmForMaskedLM(config).state_dict(), config.to_dict())
    load_pretrained(tmp_path / "hf", into=into)
    want = from_hf_esm(src.state_dict(), config.to_dict()).state_dict()
    for k, v in into.state_dict().items():
        assert torch.equal(v, want[k]), k
