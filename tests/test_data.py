"""Data: parsers (A3M, FASTA, mmCIF) incl. file:line errors, tokenisation, transforms, batching, DataModules."""

import pytest
import torch

from attn_zoo.models.data import (
    CausalLMDataModule, MaskedLMDataModule, MSADataModule, SAMPLE_DIR, SyntheticMSADataModule, decode, distogram_bins,
    encode, read_a3m, read_fasta, read_mmcif,
)
from attn_zoo.models.data.alphabet import GAP, MASK, PAD, UNK, VOCAB_SIZE
from attn_zoo.models.data.batching import collate_msa
from attn_zoo.models.data.transforms import bert_mask, subsample_msa


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


# ---------------------------------------------------------------- alphabet
def test_alphabet_roundtrip_and_unknowns():
    assert VOCAB_SIZE == 24 and len({UNK, GAP, MASK, PAD}) == 4
    t = encode("ACDEFGHIKLMNPQRSTVWY-")
    assert decode(t) == "ACDEFGHIKLMNPQRSTVWY-"
    assert encode("BZUOJ").tolist() == [UNK] * 5
    assert encode("acd").tolist() == encode("ACD").tolist()


# ---------------------------------------------------------------- A3M
def test_a3m_drops_insertions_and_keeps_gaps(tmp_path):
    p = write(tmp_path, "x.a3m", ">query\nACDE\n>hit1 desc\nA-cDE\n>hit2\nAkkC-.E\n")
    msa = read_a3m(p)
    assert msa.aligned == ["ACDE", "A-DE", "AC-E"]
    assert msa.unaligned == ["ACDE", "ACDE", "AKKCE"]
    assert msa.query == "ACDE" and len(msa) == 3


def test_a3m_sample_files_parse():
    files = sorted((SAMPLE_DIR / "msa").glob("*.a3m"))
    assert len(files) == 6 and (SAMPLE_DIR / "msa" / "LICENSE-esm-examples.txt").is_file()
    for f in files:
        msa = read_a3m(f, max_rows=64)
        assert 1 < len(msa) <= 64
        assert {len(r) for r in msa.aligned} == {len(msa.query)}
        assert "-" not in msa.query


@pytest.mark.parametrize(
    "text, line, what",
    [
        (">q\nACDE\n>h\nACD\n", 3, "aligned columns"),  # row shorter than the query
        (">q\nACDE\n>h\nAC1E\n", 4, "invalid character '1'"),
        ("ACDE\n>q\nACDE\n", 1, "before the first"),
        (">q\nACDE\n>h\n\n>h2\nACDE\n", 3, "empty sequence"),
    ],
)
def test_a3m_malformed_names_file_and_line(tmp_path, text, line, what):
    p = write(tmp_path, "bad.a3m", text)
    with pytest.raises(ValueError) as e:
        read_a3m(p)
    assert f"{p}:{line}:" in str(e.value) and what in str(e.value)


# ---------------------------------------------------------------- FASTA
def test_fasta_sample_and_stop_codon(tmp_path):
    recs = read_fasta(SAMPLE_DIR / "some_proteins.fasta")
    assert len(recs) == 15 and all(r.sequence.isalpha() and r.sequence.isupper() for r in recs)
    p = write(tmp_path, "s.fasta", ">a\nMKV\nLLa*\n>b\nQQ\n")
    assert [r.sequence for r in read_fasta(p)] == ["MKVLLA", "QQ"]


@pytest.mark.parametrize(
    "text, line, what",
    [(">a\nMKV\nMK V\n", 3, "invalid character ' '"), (">a\nMKV\n>b\n", 3, "empty sequence"), ("", 1, "no '>'")],
)
def test_fasta_malformed_names_file_and_line(tmp_path, text, line, what):
    p = write(tmp_path, "bad.fasta", text)
    with pytest.raises(ValueError) as e:
        read_fasta(p)
    assert f"{p}:{line}:" in str(e.value) and what in str(e.value)


# ---------------------------------------------------------------- mmCIF
def test_mmcif_sample_structure_and_distogram():
    s = read_mmcif(SAMPLE_DIR / "mmcif" / "3u8v.cif")
    assert len(s.sequence) == s.coords.shape[0] == s.mask.shape[0] > 50
    bins, pair_mask = distogram_bins(s.coords, s.mask)
    assert torch.equal(bins, bins.T) and (bins.diagonal() == 0).all() and pair_mask.all()
    # neighbouring C-beta atoms sit 4-7 A apart: bins 6..15 (edges 2.3125 + 0.3125 k)
    neighbours = bins.diagonal(offset=1)
    assert ((neighbours >= 6) & (neighbours <= 15)).float().mean() > 0.9
    assert (bins.max() == 63) and (SAMPLE_DIR / "mmcif" / "LICENSE-openfold-test-data.txt").is_file()


def _atom_lines(src):
    return [i for i, l in enumerate(src) if l.startswith("ATOM")]


def test_mmcif_keeps_selenomethionine_and_true_residue_numbers():
    # 4zey chain A: two selenomethionines (MSE, stored as HETATM) and an unresolved loop after the first
    # residue (author numbers jump), which must keep its sequence separation.
    s = read_mmcif(SAMPLE_DIR / "mmcif" / "4zey.cif")
    assert s.sequence.startswith("GMEGPL") and "YLSEAMKLT" in s.sequence  # M = MSE, not dropped
    gaps = (s.residue_index[1:] - s.residue_index[:-1])
    assert (gaps >= 1).all() and (gaps > 1).any()  # strictly increasing, with the unresolved loop kept
    assert s.residue_index.shape == (len(s.sequence),) and s.residue_index[0] == 0


def test_mmcif_bad_coordinate_names_file_and_line(tmp_path):
    src = (SAMPLE_DIR / "mmcif" / "3u8v.cif").read_text().splitlines()
    i = _atom_lines(src)[7]
    fields = src[i].split()
    fields[10] = "x1.5"  # Cartn_x
    src[i] = " ".join(fields)
    p = write(tmp_path, "bad.cif", "\n".join(src) + "\n")
    with pytest.raises(ValueError) as e:
        read_mmcif(p)
    assert f"{p}:{i + 1}:" in str(e.value) and "Cartn_x" in str(e.value)


def test_mmcif_truncated_row_names_file_and_line(tmp_path):
    src = (SAMPLE_DIR / "mmcif" / "4zey.cif").read_text().splitlines()
    i = _atom_lines(src)[20]
    src[i] = " ".join(src[i].split()[:-4])
    p = write(tmp_path, "bad.cif", "\n".join(src) + "\n")
    with pytest.raises(ValueError) as e:
        read_mmcif(p)
    assert f"{p}:{i + 1}:" in str(e.value) and "values" in str(e.value)


def test_mmcif_without_atoms(tmp_path):
    p = write(tmp_path, "empty.cif", "data_X\n#\n_entry.id X\n#\n")
    with pytest.raises(ValueError, match=rf"{p}:1: no _atom_site"):
        read_mmcif(p)


# ---------------------------------------------------------------- transforms and batching
def test_bert_mask_rates():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 20, (200, 200), generator=g)
    out, chosen = bert_mask(tokens, 0.15, g)
    assert abs(chosen.float().mean().item() - 0.15) < 0.01
    assert not (out[~chosen] != tokens[~chosen]).any()  # unchosen positions untouched
    masked = (out == MASK)[chosen].float().mean().item()
    kept = (out == tokens)[chosen].float().mean().item()  # 10% unchanged + random draws that hit the same residue
    assert abs(masked - 0.8) < 0.02 and 0.08 < kept < 0.13


def test_subsample_msa_keeps_query_and_prefers_informative_rows():
    g = torch.Generator().manual_seed(0)
    msa = torch.randint(0, 20, (50, 12), generator=g)
    msa[1::2] = GAP  # half the rows are empty in this window
    sub = subsample_msa(msa, 10, g)
    assert sub.shape == (10, 12) and torch.equal(sub[0], msa[0])
    assert (sub[1:] != GAP).any(dim=1).all()
    assert subsample_msa(msa[:3], 10, g).shape == (3, 12)


def test_collate_pads_and_masks():
    def ex(s, n):
        t = torch.randint(0, 20, (s, n))
        return {"msa": t, "msa_target": t, "msa_loss_mask": torch.rand(s, n) > 0.5, "residue_index": torch.arange(n),
                "distogram": torch.randint(0, 64, (n, n)), "distogram_mask": torch.rand(n, n) > 0.3}

    b = collate_msa([ex(3, 5), ex(2, 7)])
    assert b["msa"].shape == (2, 3, 7)
    assert b["msa_mask"][0, :3, :5].all() and not b["msa_mask"][0, :, 5:].any()
    assert not b["msa_mask"][1, 2].any() and (b["msa"][1, 2] == PAD).all()
    assert b["pair_mask"][0, :5, :5].all() and not b["pair_mask"][0, 5:].any()
    assert b["has_structure"].tolist() == [True, True]


# ---------------------------------------------------------------- DataModules
def test_msa_datamodule_on_sample_splits_by_protein_and_is_deterministic_on_val():
    dm = MSADataModule(crop_size=32, msa_depth=8, batch_size=4, train_samples=8, val_samples=4)
    dm.setup("fit")
    assert not set(dm.train_names) & set(dm.val_names) and not (set(dm.train_names) | set(dm.val_names)) & set(dm.test_names)
    everything = dm.train_names + dm.val_names + dm.test_names
    assert "3zee" in everything and "4i6p" not in everything  # duplicate dropped
    b = next(iter(dm.train_dataloader()))
    assert b["msa"].shape[0] == 4 and b["msa"].shape[2] <= 32 and b["msa"].shape[1] <= 8
    assert b["msa_loss_mask"].any()
    v1, v2 = next(iter(dm.val_dataloader())), next(iter(dm.val_dataloader()))
    assert all(torch.equal(v1[k], v2[k]) for k in v1)


def test_msa_datamodule_own_directory(tmp_path):
    d = tmp_path / "msas"
    d.mkdir()
    write(d, "a.a3m", ">q\nMKVLAAGIVL\n>h\nMKV-AAGcIVL\n")
    write(d, "b.a3m", ">q\nPPGWSTQRRE\n>h\nPPG-STQRRE\n")
    dm = MSADataModule(msa_dir=str(d), mmcif_dir=None, crop_size=8, msa_depth=4, batch_size=2, train_samples=2,
                       val_samples=2, test_fraction=0)
    dm.setup("fit")
    assert sorted(dm.train_names + dm.val_names) == ["a", "b"] and dm.test_names == [] and not dm.has_test_set()
    b = next(iter(dm.train_dataloader()))
    assert b["msa"].shape == (2, 2, 8) and not b["distogram_mask"].any()
    with pytest.raises(ValueError, match="does not exist"):
        MSADataModule(msa_dir=str(tmp_path / "nope"), mmcif_dir=None).setup("fit")


def test_lm_datamodules_on_sample():
    clm = CausalLMDataModule(seq_len=64, batch_size=2, train_samples=4, val_samples=2)
    clm.setup("fit")
    b = next(iter(clm.train_dataloader()))
    assert b["tokens"].shape == (2, 64) and torch.equal(b["tokens"][:, 1:], b["target"][:, :-1])
    mlm = MaskedLMDataModule(max_len=50, batch_size=3, train_samples=6, val_samples=3)
    mlm.setup("fit")
    b = next(iter(mlm.train_dataloader()))
    assert b["tokens"].shape[1] <= 50 and b["pad_mask"].any()
    assert (b["tokens"][~b["loss_mask"] & b["pad_mask"]] == b["target"][~b["loss_mask"] & b["pad_mask"]]).all()


def test_synthetic_msa_shapes():
    dm = SyntheticMSADataModule(batch_size=2, train_samples=2, val_samples=2, msa_depth=3, length=9)
    b = next(iter(dm.train_dataloader()))
    assert b["msa"].shape == (2, 3, 9) and b["distogram"].shape == (2, 9, 9) and b["distogram_mask"].all()


def test_structure_of_an_aligned_protein_joins_its_msa(tmp_path):
    from attn_zoo.models.data.msa import load_entries
    from attn_zoo.models.data.structure import read_mmcif

    s = read_mmcif(SAMPLE_DIR / "mmcif" / "3u8v.cif")
    d = tmp_path / "msas"
    d.mkdir()
    write(d, "3u8v.a3m", f">query\n{s.sequence}\n>hit\n{s.sequence[:-3]}---\n")
    entries = load_entries(msa_dir=str(d), mmcif_dir=str(SAMPLE_DIR / "mmcif" / "3u8v.cif"))
    assert len(entries) == 1  # one protein: the alignment, now carrying the structure's distogram
    e = entries[0]
    assert e.msa.shape[0] == 2 and e.distogram_mask.any()
    assert torch.equal(e.residue_index, s.residue_index)


def test_collate_pads_to_a_length_multiple():
    from attn_zoo.models.data.batching import collate_lm, pad_stack
    from attn_zoo.models.primitives import round_up

    def ex(s, n):
        t = torch.randint(0, 20, (s, n))
        return {"msa": t, "msa_target": t, "msa_loss_mask": torch.ones(s, n, dtype=torch.bool),
                "residue_index": torch.arange(n), "distogram": torch.randint(0, 64, (n, n)),
                "distogram_mask": torch.ones(n, n, dtype=torch.bool)}

    exs = [ex(3, 5), ex(2, 7)]
    plain, b = collate_msa(exs), collate_msa(exs, length_multiple=8)
    assert b["msa"].shape == (2, 3, 8) and b["distogram"].shape == (2, 8, 8) and b["residue_index"].shape == (2, 8)
    for k, v in plain.items():  # the padded batch is the plain one plus masked padding
        assert torch.equal(b[k][tuple(slice(0, n) for n in v.shape)], v), k
    assert not b["seq_mask"][:, 7:].any() and not b["pair_mask"][:, 7:].any() and not b["msa_loss_mask"][..., 7:].any()
    assert collate_msa(exs, length_multiple=7)["msa"].shape[-1] == 7  # already a multiple: unchanged
    lm = collate_lm([{"tokens": torch.arange(5), "target": torch.arange(5), "loss_mask": torch.ones(5, dtype=bool)}],
                    length_multiple=4)
    assert lm["tokens"].shape == (1, 8) and lm["pad_mask"].sum() == 5 and not lm["loss_mask"][0, 5:].any()
    assert [round_up(n, 32) for n in (1, 32, 33)] == [32, 32, 64]
    with pytest.raises(ValueError, match="length_multiple must be an int >= 1, got 0"):
        collate_msa(exs, length_multiple=0)
    with pytest.raises(ValueError, match=r"below the batch maximum \[3, 7\]"):
        pad_stack([e["msa"] for e in exs], 0, (None, 6))
    with pytest.raises(ValueError, match="do not match the tensors' rank 2"):
        pad_stack([e["msa"] for e in exs], 0, (8,))
