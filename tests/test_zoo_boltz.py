"""from_boltz: Boltz-2's trunk Pairformer (boltz 2.2.1, PairformerModule(v2=True)) loaded into PairformerStack.

Parity against the real package on random weights (fp32, masks with holes inside and padding at the end, pair
holes): outputs s and z at real positions and the gradients of the inputs, on the torch and chunked backends and
triton under the interpreter; the to_boltz round trip; the boltz2 variant's dropout pattern; every bad
checkpoint below (wrong, missing or extra entries) raises ZooCheckpointError naming what is wrong.
"""
import pytest
import torch

pytest.importorskip("boltz.model.layers.pairformer", reason="boltz==2.2.1 (installed with --no-deps) is a test dependency")
from boltz.model.layers.pairformer import PairformerModule  # noqa: E402

from attn_zoo.models.pairformer import PairformerBlock, PairformerStack  # noqa: E402
from attn_zoo.models.primitives import LineDropout  # noqa: E402
from attn_zoo.models.zoo import ZooCheckpointError, from_boltz, to_boltz  # noqa: E402
from helpers import assert_padded_parity, randomize_, real_err, run_on  # noqa: E402
from helpers import padded_inputs as inputs  # noqa: E402
from test_primitives import rel_err, skip_unless_backend  # noqa: E402

# small widths; head dims 16 so that triton serves every attention
SIZES = dict(token_s=32, token_z=8, num_blocks=2, num_heads=2, pairwise_head_width=16, pairwise_num_heads=2)


def boltz_module(seed=0, **over):
    """A Boltz-2 PairformerModule with random weights everywhere (its own init zeroes the last layers)."""
    torch.manual_seed(seed)
    m = PairformerModule(**{**SIZES, **over}, v2=True, dropout=0.25).eval()
    return randomize_(m, seed + 1)


def run_boltz(m, s, z, mask, pair_mask, grad=False):
    return run_on(lambda s, z: m(s, z, mask.float(), pair_mask.float()), s, z, grad)


def run_ours(stack, s, z, mask, pair_mask, grad=False):
    return run_on(lambda s, z: stack(s, z, mask, pair_mask), s, z, grad)


def check_parity(backend, N=7, tol=1e-5, **opts):
    m = boltz_module()
    assert_padded_parity(m, from_boltz(m.state_dict(), attention={"backend": backend, **opts}).eval(), N, tol)


@pytest.mark.parametrize("backend,opts", [("torch", {}), ("chunked", {"chunk_size": 3})])
def test_outputs_and_input_grads_equal_boltz(backend, opts):
    check_parity(backend, **opts)


@pytest.mark.slow
def test_outputs_equal_boltz_with_triton_interpreter():
    skip_unless_backend("triton")
    check_parity("triton", N=5)


def test_sizes_are_read_off_the_weights_and_round_trip_is_bitwise():
    m = boltz_module(num_blocks=3, token_s=48, token_z=12, num_heads=3, pairwise_head_width=4, pairwise_num_heads=3)
    stack = from_boltz(m.state_dict(), attention="torch")
    assert len(stack.blocks) == 3
    blk = stack.blocks[0]
    assert blk.attention_pair_bias.mha.num_heads == 3 and blk.tri_att_start.mha.num_heads == 3
    assert blk.tri_att_start.mha.c_hidden == 4 and blk.tri_mul_out.c_hidden == 12
    assert blk.post_norm_s is None
    sd, back = m.state_dict(), to_boltz(stack)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    PairformerModule(**{**SIZES, "num_blocks": 3, "token_s": 48, "token_z": 12, "num_heads": 3,
                        "pairwise_head_width": 4, "pairwise_num_heads": 3}, v2=True).load_state_dict(back, strict=True)


def test_post_layer_norm_variant_loads_and_matches():
    m = boltz_module(post_layer_norm=True)
    stack = from_boltz(m.state_dict(), attention="torch").eval()
    assert stack.blocks[0].post_norm_s is not None
    s, z, mask, pair_mask = inputs()
    _, (s_ref, z_ref) = run_boltz(m, s, z, mask, pair_mask)
    _, (s_out, z_out) = run_ours(stack, s, z, mask, pair_mask)
    assert rel_err(s_out[mask], s_ref[mask]) < 1e-5


def test_boltz2_checkpoint_file_loads(tmp_path):
    """A Lightning checkpoint of a whole Boltz-2 model: the trunk Pairformer among other modules' keys
    (including another Pairformer, the confidence module's); dropout comes from pairformer_args."""
    m = boltz_module()
    other = boltz_module(seed=5)
    state = {f"pairformer_module.{k}": v for k, v in m.state_dict().items()}
    state.update({f"confidence_module.pairformer_stack.{k}": v for k, v in other.state_dict().items()})
    state["s_init.weight"] = torch.randn(32, 32)
    ckpt = {"state_dict": state, "hyper_parameters": {"pairformer_args": {"num_blocks": 2, "dropout": 0.1, "v2": True}},
            "epoch": 3}
    path = tmp_path / "boltz2.ckpt"
    torch.save(ckpt, path)
    stack = from_boltz(path, attention="torch").eval()
    assert stack.blocks[0].pair_dropout_row.p == 0.1
    s, z, mask, pair_mask = inputs()
    _, (s_ref, _) = run_boltz(m, s, z, mask, pair_mask)
    _, (s_out, _) = run_ours(stack, s, z, mask, pair_mask)
    assert rel_err(s_out[mask], s_ref[mask]) < 1e-5
    # a compiled model's keys (pairformer_module._orig_mod.layers...) load too
    compiled = {f"pairformer_module._orig_mod.{k}": v for k, v in m.state_dict().items()}
    assert torch.equal(from_boltz(compiled).blocks[1].tri_mul_in.linear_z.weight,
                       m.state_dict()["layers.1.tri_mul_in.p_out.weight"])


def test_boltz2_variant_keeps_the_default_block_unchanged():
    default, boltz = PairformerBlock(32, 8, 2, 2, 16, 8, 2), PairformerBlock(32, 8, 2, 2, 16, 8, 2, variant="boltz2")
    d, b = set(default.state_dict()), set(boltz.state_dict())
    assert b < d
    assert d - b == {
        "tri_mul_out.linear_ab_p.bias", "tri_mul_out.linear_ab_g.bias", "tri_mul_out.linear_z.bias",
        "tri_mul_out.linear_g.bias", "tri_mul_in.linear_ab_p.bias", "tri_mul_in.linear_ab_g.bias",
        "tri_mul_in.linear_z.bias", "tri_mul_in.linear_g.bias", "tri_att_start.mha.linear_g.bias",
        "tri_att_start.mha.linear_o.bias", "tri_att_end.mha.linear_g.bias", "tri_att_end.mha.linear_o.bias",
        "attention_pair_bias.mha.linear_g.bias",
    }
    with pytest.raises(ValueError, match="variant must be one of"):
        PairformerBlock(32, 8, variant="boltz")


def test_boltz2_dropout_drops_whole_rows_and_columns():
    torch.manual_seed(0)
    x = torch.ones(3, 16, 16, 4)
    for dim, kept_shape in ((-3, (3, 16, 1, 1)), (-2, (3, 1, 16, 1))):
        drop = LineDropout(0.5, dim=dim).train()
        y = drop(x)
        line = y.amax(dim=tuple(d for d in (1, 2, 3) if d != x.ndim + dim), keepdim=True)
        assert torch.equal(y, line.expand_as(y)), "one draw per row (or column), shared by the rest"
        assert line.shape == kept_shape and set(line.unique().tolist()) == {0.0, 2.0}
        assert torch.equal(drop.eval()(x), x)
    block = PairformerBlock(32, 8, 2, 2, 16, 8, 2, variant="boltz2")
    assert isinstance(block.pair_dropout_row, LineDropout) and block.pair_dropout_row.dim == -3
    assert isinstance(block.pair_dropout_col, LineDropout) and block.pair_dropout_col.dim == -2


# ---- bad checkpoints ---------------------------------------------------------------------------------
def test_missing_key_is_named():
    sd = boltz_module().state_dict()
    del sd["layers.1.tri_att_end.mha.linear_g.weight"]
    with pytest.raises(ZooCheckpointError, match=r"1 missing key\(s\): layers\.1\.tri_att_end\.mha\.linear_g\.weight"):
        from_boltz(sd)


def test_unexpected_key_is_named():
    sd = boltz_module().state_dict()
    sd["layers.0.tri_mul_out.p_in.bias"] = torch.zeros(16)
    with pytest.raises(ZooCheckpointError, match=r"1 unexpected key\(s\): layers\.0\.tri_mul_out\.p_in\.bias"):
        from_boltz(sd)


def test_wrong_shape_is_named_with_both_shapes():
    sd = boltz_module().state_dict()
    sd["layers.1.transition_s.fc2.weight"] = torch.zeros(64, 32)  # transition factor 2 instead of 4
    with pytest.raises(ZooCheckpointError, match=r"layers\.1\.transition_s\.fc2\.weight \(64, 32\) \(expected \(128, 32\)\)"):
        from_boltz(sd)


def test_missing_layer_is_reported():
    sd = {k: v for k, v in boltz_module(num_blocks=3).state_dict().items() if not k.startswith("layers.1.")}
    with pytest.raises(ZooCheckpointError, match=r"missing key\(s\): layers\.1\."):
        from_boltz(sd)


def test_another_models_file_is_refused(tmp_path):
    ours = PairformerStack(32, 8, num_blocks=1, num_heads_single=2, num_heads_pair=2, c_hidden_pair=16,
                           c_hidden_mul=8, transition_n=2).state_dict()
    with pytest.raises(ZooCheckpointError, match="not a Boltz-2 Pairformer"):
        from_boltz(ours)
    esm_like = {"model": {"layers.0.self_attn.k_proj.weight": torch.zeros(4, 4)}, "args": {}}
    path = tmp_path / "esm.pt"
    torch.save(esm_like, path)
    with pytest.raises(ZooCheckpointError, match="not a Boltz-2 Pairformer"):
        from_boltz(path)
    torch.save([1, 2, 3], path)
    with pytest.raises(ZooCheckpointError, match="holds a list"):
        from_boltz(path)


def test_boltz1_pairformer_is_refused():
    torch.manual_seed(0)
    v1 = PairformerModule(**SIZES, v2=False).state_dict()
    with pytest.raises(ZooCheckpointError, match="Boltz-1"):
        from_boltz(v1)


def test_truncated_empty_and_absent_files(tmp_path):
    path = tmp_path / "boltz.ckpt"
    torch.save({"state_dict": {f"pairformer_module.{k}": v for k, v in boltz_module().state_dict().items()}}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ZooCheckpointError, match="truncated, corrupt or not a torch checkpoint"):
        from_boltz(path)
    path.write_bytes(b"")
    with pytest.raises(ZooCheckpointError, match=r"\(0 bytes\)"):
        from_boltz(path)
    with pytest.raises(ZooCheckpointError, match="does not exist"):
        from_boltz(tmp_path / "nope.ckpt")


# ---- GPU: the published widths (Boltz-2 trunk: token_s 384, token_z 128, 16 / 4 heads, pair head width 32) ----
PUBLISHED = dict(token_s=384, token_z=128, num_heads=16, pairwise_head_width=32, pairwise_num_heads=4)


def _gpu_case(num_blocks=4, N=192, seed=0):
    m = boltz_module(seed, num_blocks=num_blocks, **PUBLISHED).cuda()
    s, z, mask, pair_mask = (t.cuda() for t in inputs(B=2, N=N, seed=seed, c_s=384, c_z=128))
    return m, s, z, mask, pair_mask


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "chunked"])
def test_gpu_fp32_parity_at_published_widths(backend):
    """fp32 on the GPU (no TF32: the triton backend's fp32 uses tf32 dots, so it is checked in bf16 below)."""
    m, s, z, mask, pair_mask = _gpu_case()
    stack = from_boltz(m.state_dict(), attention=backend).cuda().eval()
    with torch.no_grad():
        ref = m(s, z, mask.float(), pair_mask.float())
        out = stack(s, z, mask, pair_mask)
    es, ez = real_err(out, ref, mask)
    assert es < 1e-5 and ez < 1e-5, (es, ez)


@pytest.mark.gpu
def test_gpu_triton_bf16_within_2x_boltz_own_bf16_error():
    """Under bf16 autocast, ours with the triton backend against Boltz's fp32 output: at most 2x the error
    Boltz's own bf16 run makes against its fp32 output (s and z at real positions)."""
    m, s, z, mask, pair_mask = _gpu_case()
    stack = from_boltz(m.state_dict(), attention="triton").cuda().eval()
    with torch.no_grad():
        ref = m(s, z, mask.float(), pair_mask.float())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            peer = m(s, z, mask.float(), pair_mask.float())
            out = stack(s, z, mask, pair_mask)
    peer_s, peer_z = real_err(peer, ref, mask)
    ours_s, ours_z = real_err(out, ref, mask)
    print(f"bf16 error vs Boltz fp32: s ours {ours_s:.3g} boltz {peer_s:.3g}; z ours {ours_z:.3g} boltz {peer_z:.3g}")
    assert ours_s <= 2 * peer_s and ours_z <= 2 * peer_z
