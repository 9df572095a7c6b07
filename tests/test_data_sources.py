"""Data a user brings: only the named sources, files found / kept / dropped reported, a real train/val/test
split by protein (cluster-aware, overlap refused), gzip, BOM/CRLF, lower-case queries, subfolders and
truncated mmCIF files."""
import gzip
import json

import pytest

from attn_zoo.models.data import MaskedLMDataModule, MSADataModule, SAMPLE_DIR, read_a3m, read_mmcif
from attn_zoo.models.data.sources import check_disjoint, split_proteins

A3M = ">query\nMKVLAAGIVL\n>hit1\nMKV-AAGcIVL\n>hit2\nMKVLA-GIVL\n"
SEQS = ["MKVLAAGIVLQW", "PPGWSTQRREKL", "ACDEFGHIKLMN", "WYVTSRQPNMLK", "GGHHKKLLMMNN", "QWERTYIPASDF"]


def write_a3m(folder, name, seq):
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text(f">{name}\n{seq}\n>hit\n{seq[:-2]}--\n")
    return p


def small(**kw):
    return dict(crop_size=8, msa_depth=2, batch_size=2, train_samples=2, val_samples=2, **kw)


# ---------------------------------------------------------------- file formats
def test_a3m_with_bom_and_crlf_reads_like_plain(tmp_path):
    plain = tmp_path / "plain.a3m"
    plain.write_text(A3M)
    odd = tmp_path / "odd.a3m"
    odd.write_bytes(b"\xef\xbb\xbf" + A3M.replace("\n", "\r\n").encode())
    assert read_a3m(odd).aligned == read_a3m(plain).aligned == ["MKVLAAGIVL", "MKV-AAGIVL", "MKVLA-GIVL"]


def test_gzip_a3m_and_mmcif(tmp_path):
    (tmp_path / "x.a3m.gz").write_bytes(gzip.compress(A3M.encode()))
    msa = read_a3m(tmp_path / "x.a3m.gz")
    assert msa.name == "x" and msa.aligned[0] == "MKVLAAGIVL"
    src = SAMPLE_DIR / "mmcif" / "3u8v.cif"
    (tmp_path / "3u8v.cif.gz").write_bytes(gzip.compress(src.read_bytes()))
    s, ref = read_mmcif(tmp_path / "3u8v.cif.gz"), read_mmcif(src)
    assert s.name == "3u8v" and s.sequence == ref.sequence and (s.coords == ref.coords).all()


def test_all_lowercase_query_is_read_as_columns(tmp_path):
    p = tmp_path / "low.a3m"
    p.write_text(">q\nmkvlaagivl\n>h\nmkv-aagivl\n")
    assert read_a3m(p).aligned == ["MKVLAAGIVL", "MKV-AAGIVL"]


def test_truncated_mmcif_is_reported_with_file_and_line(tmp_path):
    lines = (SAMPLE_DIR / "mmcif" / "4zey.cif").read_text().splitlines()
    atoms = [i for i, l in enumerate(lines) if l.startswith(("ATOM", "HETATM"))]
    cut = lines[: atoms[len(atoms) // 2]]  # cut at a line boundary inside _atom_site
    p = tmp_path / "cut.cif"
    p.write_text("\n".join(cut) + "\n")
    with pytest.raises(ValueError, match=rf"{p}:{len(cut)}: .*_atom_site.*truncated"):
        read_mmcif(p)


# ---------------------------------------------------------------- sources
def test_subfolders_gz_and_only_the_named_data(tmp_path):
    d = tmp_path / "mine"
    for i, seq in enumerate(SEQS[:4]):
        write_a3m(d / ("sub" if i % 2 else ""), f"p{i}.a3m", seq)
    (d / "p4.a3m.gz").write_bytes(gzip.compress(f">q\n{SEQS[4]}\n".encode()))
    (d / "notes.txt").write_text("not data")
    # the DataModule's defaults point mmcif_dir at the bundled sample: naming only msa_dir must not mix it in
    with pytest.raises(ValueError, match="data.mmcif_dir=null"):
        MSADataModule(msa_dir=str(d), **small()).setup("fit")
    dm = MSADataModule(msa_dir=str(d), mmcif_dir=str(d), **small(val_fraction=0.25, test_fraction=0.25))
    dm.setup("fit")
    names = sorted(dm.train_names + dm.val_names + dm.test_names)
    assert names == ["p0", "p2", "p4", "sub/p1", "sub/p3"]
    report = dm.report.to_dict()
    assert report["sources"]["msa_dir"]["ignored"] == ["notes.txt"] and report["kept"] == 5
    assert "sample" not in json.dumps(report["sources"])
    assert {s: len(v) for s, v in report["splits"].items()} == {"train": 3, "val": 1, "test": 1}


def test_empty_or_wrong_folder_fails_naming_the_option(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"data.msa_dir=.*empty: no .a3m files"):
        MSADataModule(msa_dir=str(tmp_path / "empty"), mmcif_dir=None, **small()).setup("fit")
    write_a3m(tmp_path / "a3m", "x.a3m", SEQS[0])
    (tmp_path / "cif").mkdir()
    with pytest.raises(ValueError, match=r"data.mmcif_dir=.*cif: no .cif/.mmcif files"):
        MSADataModule(msa_dir=str(tmp_path / "a3m"), mmcif_dir=str(tmp_path / "cif"), **small()).setup("fit")


def test_duplicates_dropped_with_why(tmp_path):
    write_a3m(tmp_path, "a.a3m", SEQS[0])
    write_a3m(tmp_path, "b.a3m", SEQS[0])  # the same protein again
    for i in (1, 2):
        write_a3m(tmp_path, f"c{i}.a3m", SEQS[i])
    dm = MSADataModule(msa_dir=str(tmp_path), mmcif_dir=None, **small(val_fraction=0.3, test_fraction=0.3))
    dm.setup("fit")
    assert dm.report.to_dict()["dropped"] == [{"name": "b", "why": "same query sequence as a"}]


def test_lm_data_from_one_user_fasta(tmp_path):
    f = tmp_path / "mine.fasta"
    f.write_text("".join(f">s{i}\n{s}\n" for i, s in enumerate(SEQS)))
    dm = MaskedLMDataModule(fasta=str(f), msa_dir=str(f), max_len=8, batch_size=2, train_samples=2, val_samples=2)
    dm.setup("fit")
    splits = dm.report.splits
    assert sorted(sum(splits.values(), [])) == [f"fasta:mine:s{i}" for i in range(6)]
    assert all(splits[s] for s in ("train", "val", "test"))
    with pytest.raises(ValueError, match="data.msa_dir=null"):
        MaskedLMDataModule(fasta=str(f)).setup("fit")  # msa_dir left at 'sample'


# ---------------------------------------------------------------- splits
def test_split_is_disjoint_and_keeps_clusters_together():
    names = [f"p{i}" for i in range(12)]
    clusters = {f"p{i}": f"c{i // 3}" for i in range(12)}  # 4 clusters of 3
    for seed in range(5):
        s = split_proteins(names, val_fraction=0.25, test_fraction=0.25, seed=seed, clusters=clusters)
        assert sorted(sum(s.values(), [])) == sorted(names)
        assert all(len(v) == 3 for v in (s["val"], s["test"]))
        for a in s:
            for b in s:
                if a != b:
                    assert not {clusters[n] for n in s[a]} & {clusters[n] for n in s[b]}
    fixed = split_proteins(names, val_fraction=0.25, test_fraction=0.0, test_names=["p4"], clusters=clusters)
    assert fixed["test"] == ["p3", "p4", "p5"]  # the named protein's whole cluster


def test_uniref_cluster_ids_in_names_keep_a_cluster_together():
    names = ["fasta:seqs:UniRef50_A0A1", "msa:UniRef50_A0A1", "msa:sub/UniRef50_A0A1_deep"] + [f"p{i}" for i in range(6)]
    for seed in range(6):
        s = split_proteins(names, val_fraction=0.3, test_fraction=0.3, seed=seed)
        where = {n: k for k, v in s.items() for n in v}
        assert len({where[n] for n in names[:3]}) == 1


def test_overlapping_test_set_is_refused():
    names = ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match="'b'.*(val|test)_names.*(val|test)_names"):
        split_proteins(names, val_fraction=0.2, test_fraction=0.2, val_names=["a", "b"], test_names=["b"])
    with pytest.raises(ValueError, match="cluster"):
        split_proteins(names, val_fraction=0.2, test_fraction=0.2, val_names=["a"], test_names=["b"],
                       clusters={"a": "x", "b": "x"})
    with pytest.raises(ValueError, match="test set overlaps the train set.*identical sequence"):
        check_disjoint({"train": ["a"], "test": ["b"]}, sequences={"a": "MKV", "b": "MKV"})
    with pytest.raises(ValueError, match="not among the proteins"):
        split_proteins(names, val_fraction=0.2, test_fraction=0.2, test_names=["zz"])


def test_one_protein_cannot_be_train_val_and_test(tmp_path):
    write_a3m(tmp_path, "only.a3m", SEQS[0])
    with pytest.raises(ValueError, match="1 protein.*cannot be split into train, val, test"):
        MSADataModule(msa_dir=str(tmp_path), mmcif_dir=None, **small()).setup("fit")


def test_sample_split_has_a_real_test_set():
    dm = MSADataModule(**small(val_fraction=0.2, test_fraction=0.2))
    dm.setup("fit")
    tr, va, te = set(dm.train_names), set(dm.val_names), set(dm.test_names)
    assert te and va and not (tr & va or tr & te or va & te)
    batch = next(iter(dm.test_dataloader()))
    assert batch["msa"].shape[0] == 2
