"""from_protenix: Protenix's trunk Pairformer (protenix 2.0.0, PairformerStack) loaded into PairformerStack.

Protenix's module chain compiles a CUDA layer-norm extension at import unless LAYERNORM_TYPE names another layer norm
(``protenix.model.triangular.layers``): it is set to "torch" here, Protenix's own PyTorch layer norm.

Parity against the real package's modules on random weights: with pair-mask holes (Protenix's stack takes a pair mask
and no single mask) s and z, and the gradients of the inputs, on the torch and chunked backends, triton under the
interpreter and the memory-bounded inference path; on a padded batch (a hole inside one sequence, padding at the end
of the other) ours equals Protenix run on each unpadded sequence; bf16 error against Protenix's fp32 output bounded
by Protenix's own; the to_protenix round trip bit for bit; the published sizes' names and shapes; every bad state
dict raises ZooCheckpointError naming what is wrong.
"""
import os

import pytest
import torch

os.environ.setdefault("LAYERNORM_TYPE", "torch")
pytest.importorskip("protenix.model.modules.pairformer",
                    reason="protenix==2.0.0 (installed with --no-deps, plus rdkit and optree: .ci/run) is a test "
                           "dependency")
from protenix.model.modules.pairformer import PairformerBlock as TheirBlock  # noqa: E402
from protenix.model.modules.pairformer import PairformerStack as TheirStack  # noqa: E402

from attn_zoo.models.pairformer import PairformerBlock, PairformerStack  # noqa: E402
from attn_zoo.models.zoo import ZooCheckpointError, from_protenix, to_protenix  # noqa: E402
from helpers import (assert_bad_keys_named_together, assert_parity, assert_published_names,  # noqa: E402
                     assert_round_trip, randomize_, run_on)
from test_primitives import rel_err, skip_unless_backend  # noqa: E402

# small widths; head dims 16 so that triton serves every attention. Protenix's stack fixes the triangle widths
# (128 / 4 x 32): its own blocks with small ones replace them.
BLOCK = dict(n_heads=2, c_z=8, c_s=32, c_hidden_mul=8, c_hidden_pair_att=16, no_heads_pair=2, num_intermediate_factor=4)


def protenix_stack(seed=0, n_blocks=2, **over):
    """Protenix's PairformerStack of its own PairformerBlocks with random weights everywhere (its init zeroes
    the last layers and the gates)."""
    torch.manual_seed(seed)
    kw = {**BLOCK, **over}
    m = TheirStack(n_blocks=0, n_heads=kw["n_heads"], c_z=kw["c_z"], c_s=kw["c_s"], dropout=0.25)
    m.blocks = torch.nn.ModuleList(TheirBlock(**kw, dropout=0.25) for _ in range(n_blocks))
    return randomize_(m, seed + 1).eval()


def inputs(B=2, N=7, seed=0, c_s=32, c_z=8):
    """s, z and a bool pair mask with holes off the diagonal (no padding: Protenix runs unpadded)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, N, c_s, generator=g)
    z = torch.randn(B, N, N, c_z, generator=g)
    pair_mask = ~((torch.rand(B, N, N, generator=g) < 0.15) & ~torch.eye(N, dtype=torch.bool))
    assert not pair_mask.all(), "the pair mask must have holes"
    return s, z, pair_mask


def run(module, s, z, pair_mask, theirs, grad=False):
    masks = (pair_mask.float(),) if theirs else (None, pair_mask)
    return run_on(lambda s, z: module(s, z, *masks), s, z, grad)


def check_parity(backend, N=7, tol=1e-5, **opts):
    m = protenix_stack()
    stack = from_protenix(m, attention={"backend": backend, **opts})
    s, z, pair_mask = inputs(N=N)
    assert_parity(lambda s, z: m(s, z, pair_mask.float()), lambda s, z: stack(s, z, None, pair_mask), s, z, tol=tol)


@pytest.mark.parametrize("backend,opts", [("torch", {}), ("chunked", {"chunk_size": 3})])
def test_outputs_and_input_grads_equal_protenix(backend, opts):
    check_parity(backend, **opts)


@pytest.mark.slow
def test_outputs_equal_protenix_with_triton_interpreter():
    skip_unless_backend("triton")
    check_parity("triton")  # N=7: at N=5 this seed's z gradient sits near 1e-5 on every backend (torch: 7e-6)


def test_memory_bounded_inference_path_equals_protenix():
    m = protenix_stack()
    stack = from_protenix(m, attention="torch")
    s, z, pair_mask = inputs()
    _, ref = run(m, s, z, pair_mask, theirs=True)
    with torch.no_grad():
        out = stack.forward_inference(s, z, None, pair_mask, mode="bounded")
    assert stack.last_inference.path == "bounded"
    assert rel_err(out[0], ref[0]) < 1e-5 and rel_err(out[1], ref[1]) < 1e-5


def test_padded_batch_equals_protenix_on_each_unpadded_sequence():
    """Protenix's single attention takes no mask; ours masks padded keys: on a padded batch ours gives, at the real
    positions, what Protenix gives on each sequence with its padding cut out."""
    m = protenix_stack()
    stack = from_protenix(m, attention="torch")
    B, N = 2, 7
    s, z, holes = inputs(B=B, N=N)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, 3] = False
    mask[1, N - 2:] = False
    pair_mask = holes & mask[:, :, None] & mask[:, None, :]
    with torch.no_grad():
        out_s, out_z = stack(s, z, mask, pair_mask)
        for b in range(B):
            keep = mask[b].nonzero().squeeze(-1)
            pm = pair_mask[b][keep][:, keep]
            ref_s, ref_z = m(s[b, keep][None], z[b][keep][:, keep][None], pm[None].float())
            assert rel_err(out_s[b, keep], ref_s[0]) < 1e-5
            assert rel_err(out_z[b][keep][:, keep], ref_z[0]) < 1e-5


def test_bf16_error_within_2x_protenix_own():
    """bf16 under CPU autocast against Protenix's fp32 output: ours at most 2x the error Protenix's own autocast run
    makes (STYLE's bound). Autocast is Protenix's bf16 path: with bf16 weights its single attention stops (it casts
    q and k to float32, not v, and scaled_dot_product_attention refuses the mix)."""
    m = protenix_stack()
    stack = from_protenix(m, attention="torch")
    s, z, pair_mask = inputs()
    _, ref = run(m, s, z, pair_mask, theirs=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, peer = run(m, s, z, pair_mask, theirs=True)
        _, out = run(stack, s, z, pair_mask, theirs=False)
    errs = [(rel_err(o.float(), r), rel_err(p.float(), r)) for o, p, r in zip(out, peer, ref)]
    assert all(p > 0 for _, p in errs), "the bf16 run must differ from fp32"
    assert all(o <= 2 * p for o, p in errs), errs


def test_sizes_are_read_off_the_weights_and_round_trip_is_bitwise():
    over = dict(n_heads=3, c_z=12, c_s=48, c_hidden_mul=5, c_hidden_pair_att=4, no_heads_pair=3)
    m = protenix_stack(n_blocks=3, **over)
    stack = from_protenix(m.state_dict())
    assert len(stack.blocks) == 3
    blk = stack.blocks[0]
    assert blk.variant == "protenix" and blk.attention_pair_bias.mha.num_heads == 3
    assert blk.tri_att_start.mha.num_heads == 3 and blk.tri_att_start.mha.c_hidden == 4
    assert blk.tri_mul_out.c_hidden == 5 and not blk.tri_att_end.transpose_bias and not blk.mask_transitions
    assert_round_trip(m, stack, to_protenix, from_protenix, protenix_stack(seed=3, n_blocks=3, **over))


def test_published_sizes_map_key_for_key_without_compute():
    """Protenix's trunk config (48 blocks, c_s 384, c_z 128, 16 heads; its block's 4 x 32 triangle heads, 128 wide
    products): every name and shape, on the meta device (one block of theirs built; the 48 have its names)."""
    with torch.device("meta"):
        block = TheirStack(n_blocks=1, n_heads=16, c_z=128, c_s=384).state_dict()
        ours = PairformerStack(384, 128, 48, 16, 4, 32, 128, 4, variant="protenix")
    theirs = assert_published_names(block, ours, to_protenix)
    from attn_zoo.models.zoo_protenix import protenix_sizes

    assert protenix_sizes(theirs, "x") == dict(c_s=384, c_z=128, num_blocks=48, num_heads_single=16,
                                               num_heads_pair=4, c_hidden_pair=32, c_hidden_mul=128, transition_n=4)


def test_whole_model_checkpoint_picks_the_trunk_stack(tmp_path):
    """Protenix's checkpoint layout: {"model": state dict} with DDP's module. prefix, the trunk stack beside the
    confidence head's."""
    m, head = protenix_stack(), protenix_stack(seed=5, n_blocks=1)
    state = {f"module.pairformer_stack.{k}": v for k, v in m.state_dict().items()}
    state.update({f"module.confidence_head.pairformer_stack.{k}": v for k, v in head.state_dict().items()})
    state["module.linear_no_bias_sinit.weight"] = torch.randn(32, 40)
    path = tmp_path / "protenix.pt"
    torch.save({"model": state, "step": 10}, path)
    stack = from_protenix(path)
    assert len(stack.blocks) == 2
    assert torch.equal(stack.blocks[1].tri_mul_in.linear_z.weight,
                       m.state_dict()["blocks.1.tri_mul_in.linear_z.weight"])
    assert len(from_protenix(path, prefix="module.confidence_head.pairformer_stack.").blocks) == 1


def test_variant_has_no_biases_and_default_dropout():
    p, b = PairformerBlock(32, 8, 2, 2, 16, 8, 2, variant="protenix"), PairformerBlock(32, 8, 2, 2, 16, 8, 2,
                                                                                      variant="boltz2")
    assert set(p.state_dict()) == set(b.state_dict())
    assert type(p.pair_dropout_row).__name__ == "SharedDropout" and not p.single_fp32


# ---- bad state dicts ---------------------------------------------------------------------------------
def test_missing_unexpected_and_misshapen_keys_are_named_together():
    assert_bad_keys_named_together(from_protenix, protenix_stack().state_dict(),
                                   "blocks.1.tri_att_end.mha.linear_g.weight", "blocks.0.tri_mul_out.linear_a_p.bias",
                                   "blocks.1.single_transition.linear_no_bias_b.weight", (64, 32), (128, 32))


def test_transition_factors_that_differ_are_refused():
    sd = protenix_stack(num_intermediate_factor=2).state_dict()  # pair 2 x c_z, single 4 x c_s
    with pytest.raises(ZooCheckpointError, match=r"transitions 16 wide for c_z=8 and 4 x c_s=32"):
        from_protenix(sd)


def test_other_files_are_refused(tmp_path):
    with pytest.raises(ZooCheckpointError, match="not a Protenix PairformerStack"):
        from_protenix(PairformerStack(32, 8, num_blocks=1, num_heads_single=2, num_heads_pair=2, c_hidden_pair=16,
                                      c_hidden_mul=8, transition_n=2).state_dict())
    path = tmp_path / "x.pt"
    torch.save({"model": {"blocks.0.tri_mul_out.linear_g.weight": torch.zeros(8, 8)}}, path)
    with pytest.raises(ZooCheckpointError, match="not a Protenix PairformerStack"):
        from_protenix(path)
    with pytest.raises(TypeError, match="variant='protenix'"):
        to_protenix(PairformerStack(32, 8, num_blocks=1, num_heads_single=2, num_heads_pair=2, c_hidden_pair=16,
                                    c_hidden_mul=8, transition_n=2, variant="openfold3"))


# ---- GPU: Protenix's published widths (c_s 384, c_z 128, 16 heads, 4 x 32 triangle heads), 4 blocks ----
def _gpu_case(N=192, seed=0):
    m = protenix_stack(seed, n_blocks=4, n_heads=16, c_z=128, c_s=384, c_hidden_mul=128, c_hidden_pair_att=32,
                       no_heads_pair=4).cuda()
    s, z, pair_mask = (t.cuda() for t in inputs(B=1, N=N, seed=seed, c_s=384, c_z=128))
    return m, s, z, pair_mask


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "chunked"])
def test_gpu_fp32_parity_at_published_widths(backend):
    """fp32 on the GPU (no TF32: the triton backend's fp32 uses tf32 dots, so it is checked in bf16 below)."""
    m, s, z, pair_mask = _gpu_case()
    stack = from_protenix(m, attention=backend).cuda()
    _, ref = run(m, s, z, pair_mask, theirs=True)
    _, out = run(stack, s, z, pair_mask, theirs=False)
    assert rel_err(out[0], ref[0]) < 1e-5 and rel_err(out[1], ref[1]) < 1e-5


@pytest.mark.gpu
def test_gpu_triton_bf16_within_2x_protenix_own_bf16_error():
    """Under bf16 autocast, ours on the triton backend against Protenix's fp32 output: at most 2x the error
    Protenix's own autocast run makes."""
    m, s, z, pair_mask = _gpu_case()
    stack = from_protenix(m, attention="triton").cuda()
    _, ref = run(m, s, z, pair_mask, theirs=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, peer = run(m, s, z, pair_mask, theirs=True)
        _, out = run(stack, s, z, pair_mask, theirs=False)
    errs = [(rel_err(o.float(), r), rel_err(p.float(), r)) for o, p, r in zip(out, peer, ref)]
    print(f"bf16 error vs Protenix fp32 (ours, theirs): s {errs[0]}, z {errs[1]}")
    assert all(o <= 2 * p for o, p in errs), errs
