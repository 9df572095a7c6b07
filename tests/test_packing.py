"""Packed batches (data and blocks): a packed row gives every sequence exactly what it gets alone (ESM-2
with token dropout, TransformerLM causal and bidirectional with RoPE and a relative bias), outputs and gradients;
the packer, the data modules' ``packing`` flag, the loss over real tokens, bad input."""
import math

import pytest
import torch

from attn_zoo.models.data.lm import CausalLMDataset, MaskedLMDataModule, MaskedLMDataset
from attn_zoo.models.data.packing import TokenBudgetSampler, collate_packed, first_fit
from attn_zoo.models.esm2 import ALPHABET, ESM2
from attn_zoo.models.primitives import segment_positions
from attn_zoo.models.tasks.metrics import masked_cross_entropy
from attn_zoo.models.transformer import TransformerLM

LENGTHS = [7, 1, 12, 5, 9]  # odd lengths and a sequence of length 1


def pack(pieces, width):
    """[1-D tensors] -> one row (padded to width with -1 ids) + its segment ids."""
    row = torch.cat(pieces)
    ids = torch.cat([torch.full((len(p),), i) for i, p in enumerate(pieces)])
    pad = width - len(row)
    return row, torch.cat([ids, torch.full((pad,), -1)]), pad


def test_segment_positions_restart_per_sequence():
    ids = torch.tensor([[0, 0, 0, 1, 2, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert segment_positions(ids).tolist() == [[0, 1, 2, 0, 0, 1, 0, 0], list(range(8))]


@pytest.mark.parametrize("causal, rel", [(True, False), (False, True), (True, True)])
def test_transformer_lm_packed_row_equals_sequences_alone(causal, rel):
    torch.manual_seed(0)
    net = TransformerLM(24, 32, 2, 4, causal=causal, rel_pos_bias=rel, attention="torch").double()
    seqs = [torch.randint(0, 24, (n,)) for n in LENGTHS]
    width = sum(LENGTHS) + 3  # padding at the end of the row
    row, ids, pad = pack(seqs, width)
    tokens = torch.cat([row, torch.zeros(pad, dtype=torch.long)])[None]
    out = net(tokens, segment_ids=ids[None])
    g = torch.randn_like(out)
    g[:, len(row):] = 0  # padding positions are not scored
    grads = torch.autograd.grad((out * g).sum(), list(net.parameters()))
    at, want_grads = 0, None
    for s in seqs:
        alone = net(s[None])
        torch.testing.assert_close(out[0, at:at + len(s)], alone[0], rtol=1e-10, atol=1e-10)
        gs = torch.autograd.grad((alone * g[:, at:at + len(s)]).sum(), list(net.parameters()))
        want_grads = gs if want_grads is None else [a + b for a, b in zip(want_grads, gs)]
        at += len(s)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter test (CPU); test_esm2_packed_triton_gpu on a GPU")
def test_transformer_lm_packed_rows_under_the_triton_interpreter():
    torch.manual_seed(1)
    net = TransformerLM(24, 32, 1, 2, causal=True, attention="triton")
    seqs = [torch.randint(0, 24, (n,)) for n in (5, 9, 3)]
    row, ids, pad = pack(seqs, 20)
    out = net(torch.cat([row, torch.zeros(pad, dtype=torch.long)])[None], segment_ids=ids[None])
    at = 0
    for s in seqs:
        torch.testing.assert_close(out[0, at:at + len(s)], net(s[None])[0], rtol=1e-4, atol=1e-5)
        at += len(s)


@pytest.mark.parametrize("token_dropout", [True, False])
def test_esm2_packed_row_equals_sequences_alone(token_dropout):
    torch.manual_seed(0)
    net = ESM2(2, 32, 4, token_dropout=token_dropout, attention="torch").double()
    texts = ["MKT<mask>YIAK", "G", "LL<mask><mask>KKAEWV", "ACD"]
    seqs = [torch.tensor([ALPHABET.cls_idx, *ALPHABET.encode(t), ALPHABET.eos_idx]) for t in texts]
    row, ids, pad = pack(seqs, sum(map(len, seqs)) + 4)
    tokens = torch.cat([row, torch.full((pad,), ALPHABET.padding_idx)])[None]
    params = [p for name, p in net.named_parameters() if not name.startswith("contact_head")]
    out = net(tokens, repr_layers=[0, 2], segment_ids=ids[None])
    g = torch.randn_like(out["logits"])
    g[:, len(row):] = 0  # padding positions are not scored
    grads = torch.autograd.grad((out["logits"] * g).sum(), params)
    at, want = 0, None
    for s in seqs:
        alone = net(s[None], repr_layers=[0, 2])
        for key in (0, 2):
            torch.testing.assert_close(out["representations"][key][0, at:at + len(s)], alone["representations"][key][0],
                                       rtol=1e-10, atol=1e-10)
        gs = torch.autograd.grad((alone["logits"] * g[:, at:at + len(s)]).sum(), params)
        want = gs if want is None else [a + b for a, b in zip(want, gs)]
        at += len(s)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match="packed rows"):
        net(tokens, return_contacts=True, segment_ids=ids[None])


def test_bad_segment_ids_name_the_argument():
    net = TransformerLM(24, 16, 1, 2, attention="torch")
    tokens = torch.randint(0, 24, (2, 6))
    with pytest.raises(ValueError, match="segment_ids"):
        net(tokens, segment_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="segment_ids"):
        net(tokens, segment_ids=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="segment_ids"):  # returns to an earlier id inside a row: the op refuses
        net(tokens, segment_ids=torch.tensor([[0, 0, 1, 1, 0, 0]] * 2))
    esm = ESM2(1, 16, 2, attention="torch")
    with pytest.raises(ValueError, match="segment_ids"):
        esm(torch.full((1, 4), 5), segment_ids=torch.zeros(1, 3, dtype=torch.long))


def test_first_fit_and_collate_packed():
    lengths = [9, 3, 7, 1, 5, 4]
    placed = first_fit(lengths, 3, 10)
    assert sorted(i for row in placed for i in row) == list(range(6))
    assert all(sum(lengths[i] for i in row) <= 10 for row in placed)
    assert first_fit(lengths, 2, 10) is None
    with pytest.raises(ValueError, match="does not fit"):
        first_fit([11], 1, 10)
    examples = [{"tokens": torch.arange(n) + 1, "target": torch.arange(n) + 1, "loss_mask": torch.ones(n, dtype=torch.bool)}
                for n in lengths]
    b = collate_packed(examples, 3, 10)
    assert b["tokens"].shape == (3, 10) and int(b["pad_mask"].sum()) == sum(lengths)
    for r in range(3):
        ids = b["segment_ids"][r]
        real = ids[ids >= 0]
        assert (real.diff() >= 0).all() and (ids[len(real):] == -1).all()  # contiguous, padding at the end
        assert (b["positions"][r][b["pad_mask"][r]] == segment_positions(ids)[b["pad_mask"][r]]).all()
    found = sorted(int(b["segment_ids"][r].eq(s).sum()) for r in range(3) for s in range(int(b["segment_ids"][r].max()) + 1))
    assert found == sorted(lengths)


def test_token_budget_sampler_covers_every_example_once():
    lengths = [5, 30, 12, 64, 3, 3, 40, 22, 17, 9, 64, 1]
    s = TokenBudgetSampler(lengths, rows=2, width=64, shuffle=True, seed=3)
    n = len(s)
    batches = list(s)
    assert len(batches) == n and sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(first_fit([lengths[i] for i in b], 2, 64) is not None for b in batches)
    assert list(TokenBudgetSampler(lengths, 2, 64, seed=3)) == batches  # deterministic per seed and epoch
    with pytest.raises(ValueError, match="longer than the packed row width"):
        TokenBudgetSampler([65], 1, 64)


def test_packed_loss_counts_real_tokens_like_the_padded_batch():
    torch.manual_seed(0)
    ds = MaskedLMDataset(["MKTAYIAKQRQISFVKSHFSRQ", "GGA", "LLKKAEWVDDRRPQ", "M"], max_len=16, seed=1)
    examples = [ds[i] for i in range(4)]
    from attn_zoo.models.data.batching import collate_lm

    padded, packed = collate_lm(examples), collate_packed(examples, 2, 32)
    net = TransformerLM(24, 32, 1, 4, causal=False, attention="torch").double()
    lp = net(padded["tokens"], padded["pad_mask"])
    lk = net(packed["tokens"], packed["pad_mask"], packed["segment_ids"])
    a, na = masked_cross_entropy(lp, padded["target"], padded["loss_mask"] & padded["pad_mask"])
    b, nb = masked_cross_entropy(lk, packed["target"], packed["loss_mask"] & packed["pad_mask"])
    assert int(na) == int(nb) > 0
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_causal_windows_carry_segments_per_protein():
    ds = CausalLMDataset(["MKTAY", "GG", "LLKKAE"], seq_len=10, seed=0, segments=True)
    e = ds[0]
    from attn_zoo.models.data.alphabet import GAP

    sep = e["tokens"] == GAP
    assert (e["segment_ids"].diff() >= 0).all() and not e["loss_mask"][sep].any()
    starts = torch.nonzero(sep).flatten() + 1
    assert all(e["segment_ids"][i] == e["segment_ids"][i - 1] + 1 for i in starts if i < 10)


def test_packing_flag_in_the_data_module(tmp_path):
    fasta = tmp_path / "mix.fasta"
    g = torch.Generator().manual_seed(0)
    fasta.write_text("".join(f">p{i}\n" + "".join("ACDEFGHIKLMNPQRSTVWY"[j] for j in torch.randint(0, 20, (n,), generator=g))
                             + "\n" for i, n in enumerate([8, 60, 15, 33, 4, 21, 50, 12, 9, 27])))
    dm = MaskedLMDataModule(fasta=str(fasta), msa_dir=None, max_len=64, batch_size=2, train_samples=24,
                            val_samples=8, val_fraction=0.2, test_fraction=0.0, packing=True)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert all(b["tokens"].shape == (2, 64) and "segment_ids" in b for b in batches)
    assert sum(int(b["segment_ids"].max(-1).values.add(1).sum()) for b in batches) == 24  # every crop once
    assert len(batches) < 12  # more crops per batch than the padded loader's 2


@pytest.mark.slow
def test_bench_packing_smoke(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench_packing

    rows, curves = bench_packing.main(["--smoke", "--out", str(tmp_path)])
    assert [r["run"] for r in rows] == ["padded", "packed"] and all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["proteins_per_batch"] >= rows[0]["proteins_per_batch"]
    assert all(math.isfinite(v) for c in curves.values() for v in c)
    # the same proteins per step: packing changes nothing but rounding (fp32 on the CPU)
    torch.testing.assert_close(torch.tensor(curves["packed, same proteins"]), torch.tensor(curves["padded"]),
                               rtol=1e-4, atol=1e-5)
    assert (tmp_path / "packing.md").is_file()


@pytest.mark.slow
def test_esm2_training_on_the_same_proteins_packed_or_padded_gives_the_same_losses():
    """Ten AdamW steps of a tiny ESM-2 on the same proteins per step: packed rows and padded rows give the same
    loss at every step (float64), so any gap between packed and padded runs comes from what the batches hold."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench_packing as bp

    g = torch.Generator().manual_seed(0)
    proteins = [bp.make_protein(n, g) for n in (30, 7, 19, 44, 3, 25, 12, 38, 9, 21)]
    curves = []
    for packed in (False, True):
        torch.manual_seed(0)
        model = ESM2(2, 32, 4, attention="torch").double().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for s in range(10):
            group = [proteins[(s + j) % 10] for j in range(4)]
            b = bp.packed_batch(group, 2, 64) if packed else bp.padded_batch(group)
            losses.append(float(bp.step(model, b, torch.device("cpu"), opt, amp=False)))
        curves.append(losses)
    # the step's cross-entropy is taken in float32 (as in training): equal to float32 rounding
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=1e-6, atol=1e-6)
    assert curves[0][-1] < curves[0][0]


@pytest.mark.gpu
def test_esm2_packed_triton_gpu():
    """The triton kernels on a GPU (fp32): a packed row of ESM-2 equals its sequences alone, outputs and gradients."""
    torch.manual_seed(0)
    net = ESM2(2, 64, 4, attention="triton").cuda()
    texts = ["MKT<mask>YIAKQQ" * 3, "GA", "LL<mask><mask>KKAEWV" * 5, "ACDWW"]
    seqs = [torch.tensor([ALPHABET.cls_idx, *ALPHABET.encode(t), ALPHABET.eos_idx]) for t in texts]
    row, ids, pad = pack(seqs, 200)
    tokens = torch.cat([row, torch.full((pad,), ALPHABET.padding_idx)])[None].cuda()
    params = [p for name, p in net.named_parameters() if not name.startswith("contact_head")]
    out = net(tokens, segment_ids=ids[None].cuda())["logits"]
    g = torch.randn_like(out)
    g[:, len(row):] = 0
    grads = torch.autograd.grad((out * g).sum(), params)
    at, want = 0, None
    for s in seqs:
        alone = net(s[None].cuda())["logits"]
        torch.testing.assert_close(out[0, at:at + len(s)], alone[0], rtol=1e-4, atol=1e-4)
        gs = torch.autograd.grad((alone * g[:, at:at + len(s)]).sum(), params)
        want = gs if want is None else [a + b for a, b in zip(want, gs)]
        at += len(s)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
