"""ESM C: parity with the Hugging Face port (transformers' EsmcForMaskedLM, random weights, fp32) and exact
round trips through both weight layouts (Hugging Face and the esm package's).

The esm package itself is not installed in CI: it pins transformers < 4.49 and a CUDA build of torch, and its
import name ``esm`` is fair-esm's, which the ESM-2 tests need. Its layout is tested by round trips and by
loading into the same model as the Hugging Face layout (whose port splits exactly those fused weights).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "EsmcForMaskedLM"):
    pytest.skip("this transformers has no ESM C (needs >= 5.x)", allow_module_level=True)
from transformers import EsmcConfig, EsmcForMaskedLM, EsmcModel, EsmcTokenizer  # noqa: E402

from attn_zoo.models.esmc import ALPHABET, ESMC, ESMC_CONFIGS, EsmcLogits, esmc  # noqa: E402
from attn_zoo.models.zoo import ZooCheckpointError, from_esmc, to_esmc  # noqa: E402

TOL = 1e-5  # fp32 parity, relative to the largest reference value


def _hf(layers=3, width=64, heads=4, ffn=192, seed=0, cls=EsmcForMaskedLM):
    torch.manual_seed(seed)
    cfg = EsmcConfig(hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # HF's init leaves LayerNorms at 1/0: draw everything
            p.normal_(0.0, 0.2)
    return model, cfg


def _tokens(seed=1):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(4, 29, (3, 14), generator=g)
    tok[:, 0] = ALPHABET.cls_idx
    for row, n in enumerate((14, 9, 5)):  # right padding of different lengths
        tok[row, n - 1] = ALPHABET.eos_idx
        tok[row, n:] = ALPHABET.padding_idx
    return tok


def _rel(a, b, keep):
    return ((a - b)[keep].abs().max() / b[keep].abs().max()).item()


@pytest.mark.parametrize("layers,width,heads,ffn", [(3, 64, 4, 192), (2, 48, 3, 256)])
def test_parity_with_hf_padded(layers, width, heads, ffn):
    hf, cfg = _hf(layers, width, heads, ffn)
    ours = from_esmc(hf.state_dict(), config=cfg, attention="torch")
    tok = _tokens()
    keep = tok.ne(ALPHABET.padding_idx)
    with torch.no_grad():
        ref = hf(input_ids=tok, attention_mask=keep.long(), output_hidden_states=True)
        out = ours(tok, repr_layers=range(layers + 1))
    assert _rel(out["logits"], ref.logits, keep) < TOL
    assert len(ref.hidden_states) == layers + 1
    for i, h in enumerate(ref.hidden_states):  # embeddings, block outputs, the last after the final norm
        assert _rel(out["representations"][i], h, keep) < TOL, i
    # a protein's outputs do not depend on its batch's padding
    with torch.no_grad():
        alone = ours(tok[1:2, :9])["logits"]
    assert _rel(out["logits"][1:2, :9], alone, torch.ones_like(alone[..., 0], dtype=torch.bool)) < TOL


def test_parity_chunked_backend_and_multichain():
    hf, cfg = _hf()
    ours = from_esmc(hf.state_dict(), config=cfg, attention={"backend": "chunked", "chunk_size": 4})
    tok = _tokens()
    tok[0, 6] = ALPHABET.get_idx("|")
    seq = torch.zeros_like(tok)
    seq[0, 7:] = 1  # two chains in row 0 (positions stay absolute)
    seq[tok.eq(ALPHABET.padding_idx)] = -1
    keep = seq.ge(0)
    with torch.no_grad():
        ref = hf(input_ids=tok, sequence_id=seq).logits
        out = ours(tok, sequence_id=seq)["logits"]
    assert _rel(out, ref, keep) < TOL
    with torch.no_grad():  # the chains really are separated: one chain's tokens change, the other's outputs do not
        tok2 = tok.clone()
        tok2[0, 8:13] = torch.tensor([5, 6, 7, 8, 9])
        out2 = ours(tok2, sequence_id=seq)["logits"]
    assert torch.allclose(out2[0, :7], out[0, :7], atol=1e-6) and not torch.allclose(out2[0, 7:], out[0, 7:])


def test_esmmodel_without_head():
    hf, cfg = _hf(cls=EsmcModel)
    ours = from_esmc(hf.state_dict(), config=cfg, attention="torch")
    assert ours.lm_head.loaded is False
    tok = _tokens()
    keep = tok.ne(ALPHABET.padding_idx)
    with torch.no_grad():
        ref = hf(input_ids=tok, attention_mask=keep.long()).last_hidden_state
        out = ours(tok)["embeddings"]
    assert _rel(out, ref, keep) < TOL


def test_round_trips_bitwise():
    hf, cfg = _hf()
    sd = hf.state_dict()
    ours = from_esmc(sd, config=cfg)
    back, config = to_esmc(ours)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    reloaded = EsmcForMaskedLM(EsmcConfig(**config)).eval()
    reloaded.load_state_dict(back, strict=True)
    # ours -> esm layout -> ours, and the esm layout loads into the same model as the HF one
    esm_sd = to_esmc(ours, layout="esm")
    assert "transformer.blocks.0.attn.layernorm_qkv.1.weight" in esm_sd and "sequence_head.3.bias" in esm_sd
    assert esm_sd["transformer.blocks.0.attn.layernorm_qkv.1.weight"].shape == (3 * 64, 64)
    assert esm_sd["transformer.blocks.0.ffn.1.weight"].shape == (2 * 192, 64)
    again = from_esmc(esm_sd, num_heads=4)
    a, b = ours.state_dict(), again.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(esm_sd[k], v) for k, v in to_esmc(again, layout="esm").items())


def test_save_pretrained_folder(tmp_path):
    hf, _ = _hf()
    hf.save_pretrained(tmp_path)
    ours = from_esmc(str(tmp_path), attention="torch")
    assert (ours.num_layers, ours.width, ours.heads, ours.ffn_width) == (3, 64, 4, 192)
    tok = _tokens()
    keep = tok.ne(ALPHABET.padding_idx)
    with torch.no_grad():
        assert _rel(ours(tok)["logits"], hf(input_ids=tok, attention_mask=keep.long()).logits, keep) < TOL


def test_published_sizes_match_hf():
    for name, c in ESMC_CONFIGS.items():
        if name == "6B":
            continue
        cfg = EsmcConfig(hidden_size=c.width, intermediate_size=c.ffn_width, num_hidden_layers=c.num_layers,
                         num_attention_heads=c.heads)
        with torch.device("meta"):
            ref = {k: v.shape for k, v in EsmcForMaskedLM(cfg).state_dict().items()}
            ours = esmc(name)
        sd, _ = to_esmc(ours)
        assert {k: v.shape for k, v in sd.items()} == ref, name
    assert (ESMC_CONFIGS["300M"].ffn_width, ESMC_CONFIGS["600M"].ffn_width) == (2560, 3072)


def test_tokenizer_matches_hf():
    tk = EsmcTokenizer()
    for s in ("ACDEFGHIKLMNPQRSTVWY", "MKT|LLX<mask>BZUO"):
        ids = tk(s)["input_ids"]
        assert ids == [ALPHABET.cls_idx] + ALPHABET.encode(s) + [ALPHABET.eos_idx], s


def test_bad_checkpoints_name_the_keys():
    hf, cfg = _hf()
    sd = dict(hf.state_dict())
    missing = dict(sd)
    missing.pop("esmc.layers.1.self_attn.q_norm.weight")
    with pytest.raises(ZooCheckpointError, match=r"layers\.1\.self_attn\.q_norm\.weight"):
        from_esmc(missing, config=cfg)
    wrong = dict(sd, **{"esmc.layers.2.mlp.down_proj.weight": torch.zeros(64, 100)})
    with pytest.raises(ZooCheckpointError, match=r"layers\.2\.mlp\.down_proj\.weight has shape \(64, 100\)"):
        from_esmc(wrong, config=cfg)
    extra = dict(sd, **{"esmc.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(ZooCheckpointError, match=r"unexpected keys.*q_proj\.bias"):
        from_esmc(extra, config=cfg)
    with pytest.raises(ZooCheckpointError, match="num_hidden_layers|layers of width"):
        from_esmc(sd, config=EsmcConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                                        num_attention_heads=4))
    with pytest.raises(ZooCheckpointError, match="cannot tell the number of attention heads"):
        from_esmc(sd)  # width 64 is no published size and there is no config
    esm_sd = to_esmc(from_esmc(sd, config=cfg), layout="esm")
    esm_sd.pop("transformer.blocks.1.ffn.1.weight")
    with pytest.raises(ZooCheckpointError, match=r"transformer\.blocks\.1\.ffn\.1\.weight"):
        from_esmc(esm_sd, num_heads=4)
    esm2_like = {"embed_tokens.weight": torch.zeros(33, 64)}
    with pytest.raises(ZooCheckpointError, match="33 rows"):
        from_esmc(esm2_like, num_heads=4)


def test_logits_module_is_the_models_logits():
    torch.manual_seed(0)
    model = ESMC(num_layers=1, width=32, heads=2, attention="torch").eval()
    tokens = torch.randint(4, 24, (1, 10))
    seq = torch.tensor([[0] * 6 + [1] * 4])
    logits = EsmcLogits(model)
    assert torch.equal(logits(tokens), model(tokens)["logits"])
    assert torch.equal(logits(tokens, seq), model(tokens, sequence_id=seq)["logits"])
    with pytest.raises(ValueError, match="at most one sequence_id"):
        logits(tokens, seq, seq)


def test_forward_checks_inputs():
    m = ESMC(1, 32, 2, 64)
    with pytest.raises(ValueError, match="tokens must lie"):
        m(torch.tensor([[0, 64, 2]]))
    with pytest.raises(ValueError, match="sequence_id must be an integer tensor"):
        m(torch.tensor([[0, 5, 2]]), sequence_id=torch.zeros(1, 3))


def test_registered_for_checkpoints():
    from attn_zoo.models.zoo import build_network

    net = build_network({"_target_": "attn_zoo.models.esmc.ESMC", "num_layers": 1, "width": 32, "heads": 2,
                         "ffn_width": 64, "attention": {"backend": "torch"}})
    assert isinstance(net, ESMC) and net.ffn_width == 64


@pytest.mark.slow
def test_embed_command_takes_esmc(tmp_path):
    from attn_zoo.embed import main

    hf, _ = _hf()
    hf.save_pretrained(tmp_path / "esmc")
    fasta = tmp_path / "x.fa"
    fasta.write_text(">p1 first\nMKTAYIAKQR\n>p2\nGAVLIW\n")
    assert main(["--model", str(tmp_path / "esmc"), "--fasta", str(fasta), "--out", str(tmp_path / "emb"),
                 "--include", "mean", "per_tok", "--repr-layers", "-1", "1", "--attention", "torch",
                 "--no-progress"]) == 0
    item = torch.load(tmp_path / "emb" / "p2.pt", weights_only=True)
    tok = torch.tensor([[ALPHABET.cls_idx] + ALPHABET.encode("GAVLIW") + [ALPHABET.eos_idx]])
    with torch.no_grad():
        ref = hf(input_ids=tok, output_hidden_states=True).hidden_states
    assert _rel(item["representations"][3], ref[3][0, 1:-1], torch.ones(6, dtype=torch.bool)) < TOL
    assert _rel(item["mean_representations"][1], ref[1][0, 1:-1].mean(0), torch.ones(64, dtype=torch.bool)) < TOL
    # the esm package's state_dict in a .pt file loads too (a published width: 960 -> 15 heads)
    torch.manual_seed(3)
    small = ESMC(1, 960, 15, 64, attention="torch").eval()
    sd_path = tmp_path / "esmc.pt"
    torch.save(to_esmc(small, layout="esm"), sd_path)
    assert main(["--model", str(sd_path), "--fasta", str(fasta), "--out", str(tmp_path / "emb2"),
                 "--attention", "torch", "--no-progress"]) == 0
    with torch.no_grad():
        want = small(tok, repr_layers=[1])["representations"][1][0, 1:-1].mean(0)
    got = torch.load(tmp_path / "emb2" / "p2.pt", weights_only=True)["mean_representations"][1]
    assert _rel(got, want, torch.ones(960, dtype=torch.bool)) < TOL
    # contacts are refused with a reason
    assert main(["--model", str(tmp_path / "esmc"), "--fasta", str(fasta), "--out", str(tmp_path / "emb3"),
                 "--include", "contacts", "--no-progress"]) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_matches_hf_fp32_and_bf16():
    """On CUDA (the rotary/q-k norm kernel and the triton backend), TF32 off: fp32 logits within 1e-5 of the Hugging
    Face model's; every parameter's fp32 gradient no further from HF's float64 gradient than twice HF's own fp32
    gradient is (plus 1e-6 of its largest entry); bf16 autocast logits no further from HF's fp32 ones than 1.5x HF's
    own bf16 logits are."""
    import copy

    torch.backends.cuda.matmul.allow_tf32 = False
    hf, cfg = _hf(3, 128, 4, 256)
    hf = hf.cuda()
    hf64 = copy.deepcopy(hf).double()
    ours = from_esmc(hf.state_dict(), config=cfg, attention="triton").cuda()
    tok = _tokens().cuda()
    keep = tok.ne(ALPHABET.padding_idx)
    ref = hf(input_ids=tok, attention_mask=keep.long()).logits
    out = ours(tok)["logits"]
    assert _rel(out, ref, keep) < TOL
    for model, logits in ((hf, ref), (ours, out), (hf64, hf64(input_ids=tok, attention_mask=keep.long()).logits)):
        logits[keep].square().mean().backward()
    theirs, exact = dict(hf.named_parameters()), dict(hf64.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        key = "esmc." + name if "esmc." + name in theirs else name
        if key not in theirs or theirs[key].grad is None:
            continue
        g64 = exact[key].grad
        e_ours = (p.grad.double() - g64).abs().max().item()
        e_hf = (theirs[key].grad.double() - g64).abs().max().item()
        assert e_ours <= 2 * e_hf + 1e-6 * g64.abs().max().item(), (name, e_ours, e_hf)
        checked += 1
    assert checked >= 10
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ref_bf = hf(input_ids=tok, attention_mask=keep.long()).logits.float()
        out_bf = ours(tok)["logits"].float()
    assert _rel(out_bf, ref, keep) <= 1.5 * _rel(ref_bf, ref, keep) + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpu_cuda_graphs_packed_rows_equal_eager(checkpointing):
    """ESM C replayed as CUDA graphs (the model checks its tokens and picks its mask on the host: a capture must skip
    that) on packed rows (sequence ids, padding at the end) and on padded rows, with activation checkpointing or
    not, sharing the capture's gradient memory: loss and every gradient bitwise the eager model's."""
    from attn_zoo.models.esmc import EsmcLogits as Logits
    from attn_zoo.models.graphs import CUDAGraphs

    torch.manual_seed(0)
    model = ESMC(num_layers=2, width=64, heads=4, attention="triton",
                 activation_checkpointing=checkpointing).cuda().train()
    graphed = CUDAGraphs(Logits(model), share_grad_memory=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 24, (2, 96), generator=g)
    tokens[1, 70:] = ALPHABET.padding_idx
    packed = torch.cat([tokens[0], tokens[1, :70], torch.full((26,), ALPHABET.padding_idx)])[None]
    seq = torch.cat([torch.zeros(96), torch.ones(70), torch.full((26,), -1)]).long()[None]
    for args in ((tokens.cuda(),), (packed.cuda(), seq.cuda())):
        results = []
        for fn in (Logits(model), graphed, graphed):  # eager, the capture, a replay
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                loss = fn(*args).float().logsumexp(-1).mean()
            loss.backward()
            results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
            # (a loss kept alive keeps the eager step's gradient accumulators, made on the default stream: a capture
            # that meets them fails, as torch warns)
            del loss
        for j, got in enumerate(results[1:]):
            for i, (a, b) in enumerate(zip(results[0], got)):
                assert torch.equal(a, b), (len(args), j, i, (a - b).abs().max().item(), a.abs().max().item())
