"""scripts/embed.py (attn_zoo.embed): FASTA -> per-residue / mean embeddings and contacts, against fair-esm's own
model with the same random weights; batching, resume, atomic files, FASTA errors, long sequences, the CLI; the
folder's manifest (a rerun with other settings is refused), stale partial files, file modes, the memory check."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

esm = pytest.importorskip("esm")
from esm.model.esm2 import ESM2 as FairESM2  # noqa: E402

from attn_zoo import embed as E  # noqa: E402
from attn_zoo.models.zoo import ZooCheckpointError, from_fair_esm, load_esm2, to_fair_esm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROTEINS = [("p1", "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"), ("sp|Q9|odd:name", "GGAKACLLWWVD"), ("p3", "M"),
            ("p4", "ACDEFGHIKLMNPQRSTVWYXBZUO"), ("p5", "LLLLKKKKEEEEDDDDRRRR")]


def rel(ours, peer):
    return ((ours.double() - peer.double()).abs().max() / peer.double().abs().max()).item()


@pytest.fixture(scope="module")
def fair():
    torch.manual_seed(0)
    m = FairESM2(num_layers=2, embed_dim=64, attention_heads=4,
                 alphabet=esm.data.Alphabet.from_architecture("ESM-1b"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


@pytest.fixture(scope="module")
def ckpt(fair, tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "esm2_t2_tiny.pt"
    torch.save(to_fair_esm(from_fair_esm(fair.state_dict()), layout="checkpoint"), path)
    return path


def write_fasta(path, proteins, width=10):
    with open(path, "w") as f:
        for label, seq in proteins:
            f.write(f">{label} some description\n")
            for i in range(0, len(seq), width):  # wrapped lines, as FASTA files are
                f.write(seq[i:i + width] + "\n")
    return path


@pytest.fixture
def fasta(tmp_path):
    return write_fasta(tmp_path / "in.fasta", PROTEINS)


def run(ckpt, fasta, out, *extra):
    return E.run(["--model", str(ckpt), "--fasta", str(fasta), "--out", str(out), "--attention", "torch",
                   "--no-progress", *extra])


def test_embeddings_and_contacts_match_fair_esm(fair, ckpt, fasta, tmp_path):
    run(ckpt, fasta, tmp_path / "out", "--include", "mean", "per_tok", "contacts", "--repr-layers", "0", "-1",
        "--toks-per-batch", "70")  # several batches, padded rows
    conv = esm.data.Alphabet.from_architecture("ESM-1b").get_batch_converter()
    for label, seq in PROTEINS:
        got = torch.load(tmp_path / "out" / E.file_name(label), weights_only=True)
        assert got["label"] == label and got["sequence"] == seq
        with torch.no_grad():
            ref = fair(conv([(label, seq)])[2], repr_layers=[0, 2], return_contacts=True)
        n = len(seq)
        for layer in (0, 2):
            want = ref["representations"][layer][0, 1:n + 1]
            assert got["representations"][layer].shape == (n, 64)
            assert rel(got["representations"][layer], want) < 1e-5, (label, layer)
            assert rel(got["mean_representations"][layer], want.mean(0)) < 1e-5, (label, layer)
        assert got["contacts"].shape == (n, n) and rel(got["contacts"], ref["contacts"][0]) < 1e-5, label


def test_batching_does_not_change_a_protein(ckpt, fasta, tmp_path):
    run(ckpt, fasta, tmp_path / "one", "--toks-per-batch", "100000")  # everything in one padded batch
    run(ckpt, fasta, tmp_path / "alone", "--toks-per-batch", "1")  # every protein alone
    for label, _ in PROTEINS:
        a = torch.load(tmp_path / "one" / E.file_name(label), weights_only=True)["mean_representations"][2]
        b = torch.load(tmp_path / "alone" / E.file_name(label), weights_only=True)["mean_representations"][2]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_length_multiple_pads_batches_and_keeps_embeddings(ckpt, fasta, tmp_path, monkeypatch):
    """``--length-multiple 16``: every batch the model sees is a multiple of 16 wide; embeddings and contacts are
    the unpadded run's."""
    run(ckpt, fasta, tmp_path / "plain", "--include", "per_tok", "contacts")
    widths = []
    from attn_zoo.models.esm2 import ESM2

    forward = ESM2.forward
    monkeypatch.setattr(ESM2, "forward", lambda self, tokens, *a, **k: (widths.append(tokens.shape[1]),
                                                                        forward(self, tokens, *a, **k))[1])
    run(ckpt, fasta, tmp_path / "padded", "--include", "per_tok", "contacts", "--length-multiple", "16")
    assert widths and all(w % 16 == 0 for w in widths)
    for label, _ in PROTEINS:
        a, b = (torch.load(tmp_path / d / E.file_name(label), weights_only=True) for d in ("plain", "padded"))
        torch.testing.assert_close(b["representations"][2], a["representations"][2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b["contacts"], a["contacts"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="length_multiple must be an int >= 1, got 0"):
        list(E.batches(PROTEINS, 128, length_multiple=0))


def test_batches_respect_the_token_budget():
    proteins = [(str(i), "A" * n) for i, n in enumerate([5, 50, 7, 300, 31, 8, 8, 120])]
    got = list(E.batches(proteins, 128))
    assert sorted(p for b in got for p in b) == sorted(proteins)
    for b in got:
        width = max(len(s) for _, s in b) + 2
        assert width * len(b) <= 128 or len(b) == 1
    assert got[0] == [("3", "A" * 300)]  # longer than the budget: alone, first (longest first)
    assert len(got) < len(proteins)  # the short ones share batches
    for b in E.batches(proteins, 128, length_multiple=32):  # the budget counts the rounded width
        assert -(-(max(len(s) for _, s in b) + 2) // 32) * 32 * len(b) <= 128 or len(b) == 1


def test_resume_skips_written_proteins(ckpt, fasta, tmp_path):
    out = tmp_path / "out"
    first = run(ckpt, fasta, out)
    assert sorted(first.written) == sorted(label for label, _ in PROTEINS) and not first.skipped
    gone = out / E.file_name("p3")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    kept = torch.load(gone, weights_only=True)
    gone.unlink()
    again = run(ckpt, fasta, out)
    assert again.written == ["p3"] and len(again.skipped) == len(PROTEINS) - 1
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p != gone} == {
        k: v for k, v in before.items() if k != gone.name}
    again = torch.load(gone, weights_only=True)
    torch.testing.assert_close(again["mean_representations"], kept["mean_representations"])
    assert run(ckpt, fasta, out, "--overwrite").written  # --overwrite recomputes all


def test_an_interrupted_run_leaves_no_partial_file(ckpt, fasta, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_save, calls = torch.save, []

    def failing_save(obj, f):
        calls.append(1)
        if len(calls) == 3:
            f.write(b"half a file")
            raise KeyboardInterrupt
        real_save(obj, f)

    monkeypatch.setattr(E.torch, "save", failing_save)
    with pytest.raises(KeyboardInterrupt):
        run(ckpt, fasta, out)
    monkeypatch.setattr(E.torch, "save", real_save)
    files = sorted(out.glob("*.pt"))
    assert len(files) == 2 and all(not p.name.startswith(".partial") for p in out.iterdir())
    for p in files:
        assert "mean_representations" in torch.load(p, weights_only=True)  # complete files only
    assert len(run(ckpt, fasta, out).written) == len(PROTEINS) - 2


@pytest.mark.parametrize("text, line, what", [
    ("MKT\n>a\nMK\n", 1, "before the first '>' header"),
    (">a\nMKT\n>b\n\n>c\nGG\n", 3, "empty sequence"),
    (">a\nMKT\n>b\nMK1T\n", 4, "invalid character '1'"),
    (">a\nMKT\n>b\nMKJT\n", 3, "'J'"),
    (">a\nMKT\n>a other\nGG\n", 3, "duplicate label 'a'"),
    (">x\nMKT\n>X\nGG\n", 3, "differ only in letter case"),
    ("", 1, "no '>' records"),
])
def test_bad_fasta_names_file_and_line(tmp_path, text, line, what):
    path = tmp_path / "bad.fasta"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        E.read_proteins(path)
    assert f"{path}:{line}:" in str(err.value) and what in str(err.value)


def test_long_sequences_run_and_truncate(ckpt, tmp_path):
    seq = ("MKTAYIAKQRQISFVKSHFSRQ" * 60)[:1100]
    fasta = write_fasta(tmp_path / "long.fasta", [("long", seq)], width=60)
    run(ckpt, fasta, tmp_path / "out", "--include", "per_tok")
    assert torch.load(tmp_path / "out" / "long.pt", weights_only=True)["representations"][2].shape == (1100, 64)
    run(ckpt, fasta, tmp_path / "cut", "--include", "per_tok", "--truncate", "300")
    assert torch.load(tmp_path / "cut" / "long.pt", weights_only=True)["representations"][2].shape == (300, 64)


def test_file_names_are_safe_and_distinct():
    names = {E.file_name(x) for x in ["a/b", "a_b", "a b", "..", "ok.1-x"]}
    assert len(names) == 5 and "ok.1-x.pt" in names and "a_b.pt" in names
    assert all("/" not in n and " " not in n and not n.startswith("..") for n in names)


def test_load_esm2_reads_state_dicts_and_refuses_other_files(fair, tmp_path):
    sd_path = tmp_path / "sd.pt"
    torch.save(fair.state_dict(), sd_path)
    assert load_esm2(sd_path, attention="torch").num_layers == 2
    torch.save({"weights": [1, 2]}, tmp_path / "other.pt")
    with pytest.raises(ZooCheckpointError, match="not an ESM-2"):
        load_esm2(tmp_path / "other.pt")
    with pytest.raises(ZooCheckpointError, match="no such file"):
        load_esm2(tmp_path / "missing.pt")


def test_bad_arguments(ckpt, fasta, tmp_path):
    with pytest.raises(ValueError, match="--repr-layers 5"):
        run(ckpt, fasta, tmp_path / "o", "--repr-layers", "5")
    with pytest.raises(FileNotFoundError, match="--fasta"):
        run(ckpt, tmp_path / "none.fasta", tmp_path / "o")


@pytest.mark.slow
def test_command_line(ckpt, fasta, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "embed.py"), "--model", str(ckpt), "--fasta",
                        str(fasta), "--out", str(tmp_path / "cli"), "--device", "cpu", "--attention", "chunked",
                        "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "5 written, 0 skipped" in r.stderr
    assert len(list((tmp_path / "cli").glob("*.pt"))) == len(PROTEINS)
    assert (tmp_path / "cli" / E.MANIFEST).is_file()


def test_a_rerun_with_other_settings_is_refused(fair, ckpt, fasta, tmp_path):
    out = tmp_path / "out"
    run(ckpt, fasta, out, "--truncate", "20")
    manifest = json.loads((out / E.MANIFEST).read_text())
    assert manifest["include"] == ["mean"] and manifest["repr_layers"] == [2] and manifest["truncate"] == 20
    assert manifest["model"]["layers"] == 2 and manifest["version"] and manifest["run"]["source"] == str(ckpt)
    for extra, what in [(["--include", "mean", "contacts"], "include ['mean'] -> ['contacts', 'mean']"),
                        (["--repr-layers", "0"], "repr_layers [2] -> [0]"), ([], "truncate 20 -> None"),
                        (["--dtype", "bf16"], "dtype 'float32' -> 'bfloat16'")]:
        args = extra + (["--truncate", "20"] if what != "truncate 20 -> None" else [])
        with pytest.raises(ValueError, match=r"other settings \(" + what.replace("[", r"\[").replace("]", r"\]")
                           .replace("(", r"\(").replace(")", r"\)") + r".*--overwrite"):
            run(ckpt, fasta, out, *args)
    # the same architecture with other weights (a fine-tuned model)
    other = from_fair_esm(fair.state_dict())
    with torch.no_grad():
        other.layers[0].fc1.weight.add_(0.1)
    other_path = tmp_path / "tuned.pt"
    torch.save(to_fair_esm(other, layout="checkpoint"), other_path)
    with pytest.raises(ValueError, match=r"model.weights_sha256 .* -> "):
        run(other_path, fasta, out, "--truncate", "20")
    assert run(ckpt, fasta, out, "--truncate", "20").skipped  # the same settings resume
    redone = run(other_path, fasta, out, "--truncate", "20", "--overwrite")
    assert len(redone.written) == len(PROTEINS) and not redone.skipped
    assert json.loads((out / E.MANIFEST).read_text())["model"] != manifest["model"]


def test_a_folder_of_unknown_files_is_refused(ckpt, fasta, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"label": "p1"}, out / "p1.pt")
    with pytest.raises(ValueError, match=r"1 \.pt file\(s\) \(p1\.pt\.\.\.\) but no manifest\.json.*--overwrite"):
        run(ckpt, fasta, out)
    assert len(run(ckpt, fasta, out, "--overwrite").written) == len(PROTEINS)


def test_stale_partial_files_are_removed_and_files_keep_the_umask(ckpt, fasta, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stale = out / ".partial-abc123.pt"
    stale.write_bytes(b"half a file")
    old = os.umask(0o027)
    try:
        run(ckpt, fasta, out)
    finally:
        os.umask(old)
    assert not stale.exists()
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {0o640}, modes  # 0o666 & ~umask, as open() gives; not mkstemp's 0o600


def test_memory_check_refuses_long_contacts_before_any_work(ckpt, tmp_path):
    model = load_esm2(ckpt, attention="torch")
    long = [("long", "MKTAYIAKQRQISFVKSHFSRQ" * 230)]  # 5060 residues
    budget = 2 ** 28
    with pytest.raises(MemoryError) as err:
        E.embed(model, long, tmp_path / "out", include=["mean", "contacts"], progress=False, memory_budget=budget)
    text = str(err.value)
    assert "contacts of 'long' (5060 residues)" in text and "--include mean per_tok" in text, text
    assert not (tmp_path / "out").exists()  # refused before the folder, the manifest or a forward
    fit = int(text.split("--truncate ")[1].split()[0])
    need = E.memory_estimate(model, 1, fit + 2, ["contacts"], 1)
    assert 0 < fit < 5060 and need <= budget < E.memory_estimate(model, 1, fit + 3, ["contacts"], 1)
    # the suggested cut runs (256 MiB: about 1100 residues for this 2-layer, 4-head model)
    done = E.embed(model, [("long", long[0][1][:fit])], tmp_path / "cut", include=["mean", "contacts"],
                   progress=False, memory_budget=budget)
    assert done.written == ["long"]
    # several proteins that fit alone but not together: the batch size is named
    many = [(f"p{i}", "MKTAYIAKQR" * 20) for i in range(8)]
    one = E.memory_estimate(model, 1, 202, ["mean", "contacts"], 1)
    with pytest.raises(MemoryError, match="in a batch of 8 .*a smaller --toks-per-batch"):
        E.embed(model, many, tmp_path / "many", include=["mean", "contacts"], progress=False,
                memory_budget=2 * one, toks_per_batch=100000)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1000, 3000])
def test_memory_estimate_bounds_the_measured_contacts_peak_on_cuda(length):
    """The estimate the memory check uses is an upper bound of the CUDA peak of a contacts forward, and not a
    loose one (within 1.5x), for an ESM-2-8M-sized model."""
    from attn_zoo.models.esm2 import ESM2

    model = ESM2(num_layers=6, embed_dim=320, attention_heads=20, attention="auto").cuda().eval()
    tokens = torch.randint(4, 24, (1, length + 2), device="cuda")
    tokens[:, 0], tokens[:, -1] = 0, 2  # <cls> ... <eos>
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = model(tokens, repr_layers=[6], return_contacts=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    want = E.memory_estimate(model, 1, length + 2, ["mean", "contacts"], 1)
    assert peak <= want <= 1.5 * peak, (peak / 2**20, want / 2**20)
