"""from_openfold3: OpenFold3's trunk Pairformer (openfold3 0.5.0, PairFormerStack) loaded into PairformerStack.

Parity against the real package's modules on random weights (fp32, a hole inside one sequence and padding at the end
of the other, pair holes): s and z at real positions and the gradients of the inputs, on the torch and chunked
backends, triton under the interpreter, and the memory-bounded inference path; bf16 error against OpenFold3's fp32
output bounded by OpenFold3's own; the to_openfold3 round trip bit for bit; the published sizes' names and shapes;
every bad state dict raises ZooCheckpointError naming what is wrong.
"""
import copy

import pytest
import torch

pytest.importorskip("openfold3.core.model.latent.pairformer",
                    reason="openfold3==0.5.0 (installed with --no-deps, plus gemmi, ml-collections, pandas and "
                           "optree: .ci/run) is a test dependency")
from openfold3.core.model.latent.pairformer import PairFormerStack  # noqa: E402

from attn_zoo.models.pairformer import PairformerBlock, PairformerStack  # noqa: E402
from attn_zoo.models.zoo import ZooCheckpointError, from_openfold3, to_openfold3  # noqa: E402
from helpers import (assert_bad_keys_named_together, assert_padded_parity, assert_published_names,  # noqa: E402
                     assert_round_trip, randomize_, real_err, run_on)
from helpers import padded_inputs as inputs  # noqa: E402
from test_primitives import skip_unless_backend  # noqa: E402

# small widths; head dims 16 so that triton serves every attention
SIZES = dict(c_s=32, c_z=8, c_hidden_pair_bias=16, no_heads_pair_bias=2, c_hidden_mul=8, c_hidden_pair_att=16,
             no_heads_pair=2, no_blocks=2, transition_n=2)
PUBLISHED = dict(c_s=384, c_z=128, c_hidden_pair_bias=24, no_heads_pair_bias=16, c_hidden_mul=128,
                 c_hidden_pair_att=32, no_heads_pair=4, no_blocks=48, transition_n=4)


def of3_stack(seed=0, **over):
    """OpenFold3's PairFormerStack (the model config's fixed arguments) with random weights everywhere (its own
    init zeroes the last layers)."""
    torch.manual_seed(seed)
    m = PairFormerStack(**{**SIZES, **over}, transition_type="swiglu", pair_dropout=0.25,
                        fuse_projection_weights=False, blocks_per_ckpt=None, inf=1e9).eval()
    return randomize_(m, seed + 1)


def run(module, s, z, mask, pair_mask, theirs, grad=False):
    masks = (mask.float(), pair_mask.float()) if theirs else (mask, pair_mask)
    return run_on(lambda s, z: module(s, z, *masks), s, z, grad)


def check_parity(backend, N=7, tol=1e-5, **opts):
    m = of3_stack()
    assert_padded_parity(m, from_openfold3(m, attention={"backend": backend, **opts}), N, tol)


@pytest.mark.parametrize("backend,opts", [("torch", {}), ("chunked", {"chunk_size": 3})])
def test_outputs_and_input_grads_equal_openfold3(backend, opts):
    check_parity(backend, **opts)


@pytest.mark.slow
def test_outputs_equal_openfold3_with_triton_interpreter():
    skip_unless_backend("triton")
    check_parity("triton", N=5)


def test_memory_bounded_inference_path_equals_openfold3():
    m = of3_stack()
    stack = from_openfold3(m, attention="torch")
    s, z, mask, pair_mask = inputs()
    _, ref = run(m, s, z, mask, pair_mask, theirs=True)
    with torch.no_grad():
        out = stack.forward_inference(s, z, mask, pair_mask, mode="bounded")
    assert stack.last_inference.path == "bounded"
    es, ez = real_err(out, ref, mask)
    assert es < 1e-5 and ez < 1e-5, (es, ez)


def test_each_openfold3_difference_is_needed():
    """The ending node's bias transposed and the masked transitions: without either, the outputs differ."""
    m = of3_stack()
    s, z, mask, pair_mask = inputs()
    _, ref = run(m, s, z, mask, pair_mask, theirs=True)
    for undo in ("transpose_bias", "mask_transitions"):
        stack = from_openfold3(m, attention="torch")
        for b in stack.blocks:
            if undo == "transpose_bias":
                b.tri_att_end.transpose_bias = False
            else:
                b.mask_transitions = False
        _, out = run(stack, s, z, mask, pair_mask, theirs=False)
        assert max(real_err(out, ref, mask)) > 1e-2, undo


@pytest.mark.parametrize("mode", ["autocast", "bf16 weights"])
def test_bf16_error_within_2x_openfold3_own(mode):
    """bf16 against OpenFold3's fp32 output: ours at most 2x the error OpenFold3's own bf16 run makes (s and z at
    real positions; STYLE's bound). Under CPU autocast, or with both stacks' weights and inputs in bf16."""
    m = of3_stack()
    stack = from_openfold3(m, attention="torch")
    s, z, mask, pair_mask = inputs()
    _, ref = run(m, s, z, mask, pair_mask, theirs=True)
    if mode == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, peer = run(m, s, z, mask, pair_mask, theirs=True)
            _, out = run(stack, s, z, mask, pair_mask, theirs=False)
    else:
        mb, sb, zb = copy.deepcopy(m).to(torch.bfloat16), s.bfloat16(), z.bfloat16()
        with torch.no_grad():
            peer = mb(sb, zb, mask.bfloat16(), pair_mask.bfloat16())
            out = stack.to(torch.bfloat16)(sb, zb, mask, pair_mask)
    (ps, pz), (os_, oz) = real_err(peer, ref, mask), real_err(out, ref, mask)
    assert 0 < ps and 0 < pz, "the bf16 run must differ from fp32"
    assert os_ <= 2 * ps and oz <= 2 * pz, ((os_, ps), (oz, pz))


def test_sizes_are_read_off_the_weights_and_round_trip_is_bitwise():
    over = dict(no_blocks=3, c_s=48, c_z=12, no_heads_pair_bias=3, c_hidden_pair_att=4, no_heads_pair=3,
                c_hidden_mul=5, transition_n=3)
    m = of3_stack(**over, c_hidden_pair_bias=16)
    stack = from_openfold3(m.state_dict())
    assert len(stack.blocks) == 3
    blk = stack.blocks[0]
    assert blk.variant == "openfold3" and blk.attention_pair_bias.mha.num_heads == 3
    assert blk.tri_att_start.mha.num_heads == 3 and blk.tri_att_start.mha.c_hidden == 4
    assert blk.tri_mul_out.c_hidden == 5 and blk.pair_transition.linear_out.in_features == 36
    assert_round_trip(m, stack, to_openfold3, from_openfold3, of3_stack(seed=3, **over, c_hidden_pair_bias=16))


def test_published_sizes_map_key_for_key_without_compute():
    """OpenFold3's model config (48 blocks, c_s 384, c_z 128, 16 / 4 heads): every name and shape, on the meta
    device (one block of theirs built: its init draws on the CPU even there; the 48 blocks have its names)."""
    with torch.device("meta"):
        block = PairFormerStack(**{**PUBLISHED, "no_blocks": 1}, transition_type="swiglu", pair_dropout=0.25,
                                fuse_projection_weights=False, blocks_per_ckpt=None, inf=1e9).state_dict()
        ours = PairformerStack(384, 128, 48, 16, 4, 32, 128, 4, variant="openfold3")
    theirs = assert_published_names(block, ours, to_openfold3)
    from attn_zoo.models.zoo_openfold3 import openfold3_sizes

    assert openfold3_sizes(theirs, "x") == dict(c_s=384, c_z=128, num_blocks=48, num_heads_single=16,
                                                num_heads_pair=4, c_hidden_pair=32, c_hidden_mul=128, transition_n=4)


def test_whole_model_checkpoint_file_picks_the_trunk_stack(tmp_path):
    """A checkpoint of a whole model: the trunk stack beside the auxiliary head's Pairformer, under model.*."""
    m, head = of3_stack(), of3_stack(seed=5, no_blocks=1)
    state = {f"model.pairformer_stack.{k}": v for k, v in m.state_dict().items()}
    state.update({f"model.aux_heads.pairformer_embedding.pairformer_stack.{k}": v
                  for k, v in head.state_dict().items()})
    state["model.linear_s.weight"] = torch.randn(32, 32)
    path = tmp_path / "of3.ckpt"
    torch.save({"state_dict": state, "epoch": 3}, path)
    stack = from_openfold3(path)
    assert len(stack.blocks) == 2
    assert torch.equal(stack.blocks[1].tri_mul_in.linear_z.weight,
                       m.state_dict()["blocks.1.pair_stack.tri_mul_in.linear_z.weight"])
    one = from_openfold3(path, prefix="model.aux_heads.pairformer_embedding.pairformer_stack.")
    assert len(one.blocks) == 1
    with pytest.raises(ZooCheckpointError, match="nothing under prefix 'nope.'"):
        from_openfold3(path, prefix="nope.")


def test_variant_has_no_biases_and_default_dropout():
    o, b = PairformerBlock(32, 8, 2, 2, 16, 8, 2, variant="openfold3"), PairformerBlock(32, 8, 2, 2, 16, 8, 2,
                                                                                       variant="boltz2")
    assert set(o.state_dict()) == set(b.state_dict())
    assert type(o.pair_dropout_row).__name__ == "SharedDropout" and o.tri_att_end.transpose_bias
    assert not o.tri_att_start.transpose_bias and o.mask_transitions


def test_sharded_stack_refuses_the_variant():
    from attn_zoo.models.sharding import ShardedPairformerStack

    with pytest.raises(ValueError, match="no sharded form of the 'openfold3'"):
        ShardedPairformerStack(from_openfold3(of3_stack()))


# ---- bad state dicts ---------------------------------------------------------------------------------
def test_missing_unexpected_and_misshapen_keys_are_named_together():
    assert_bad_keys_named_together(from_openfold3, of3_stack().state_dict(),
                                   "blocks.1.pair_stack.tri_att_end.mha.linear_g.weight",
                                   "blocks.0.pair_stack.tri_mul_out.linear_a_p.bias",
                                   "blocks.1.single_transition.swiglu.linear_b.weight", (32, 32), (64, 32))


def test_non_float_entry_is_named():
    sd = of3_stack().state_dict()
    sd["blocks.0.attn_pair_bias.linear_z.weight"] = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ZooCheckpointError, match=r"blocks\.0\.attn_pair_bias\.linear_z\.weight \(torch\.int64\)"):
        from_openfold3(sd)


def test_other_layouts_and_files_are_refused(tmp_path):
    with pytest.raises(ZooCheckpointError, match="not an OpenFold3 PairFormerStack"):
        from_openfold3(PairformerStack(32, 8, num_blocks=1, num_heads_single=2, num_heads_pair=2, c_hidden_pair=16,
                                       c_hidden_mul=8, transition_n=2).state_dict())
    fused = PairFormerStack(**SIZES, transition_type="swiglu", pair_dropout=0.25, fuse_projection_weights=True,
                            blocks_per_ckpt=None, inf=1e9)
    with pytest.raises(ZooCheckpointError, match="fused triangle projections"):
        from_openfold3(fused)
    path = tmp_path / "x.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(ZooCheckpointError, match="holds a list"):
        from_openfold3(path)
    with pytest.raises(ZooCheckpointError, match="does not exist"):
        from_openfold3(tmp_path / "nope.pt")
    with pytest.raises(TypeError, match="variant='openfold3'"):
        to_openfold3(PairformerStack(32, 8, num_blocks=1, num_heads_single=2, num_heads_pair=2, c_hidden_pair=16,
                                     c_hidden_mul=8, transition_n=2))


# ---- GPU: OpenFold3's published widths (c_s 384, c_z 128, 16 / 4 heads, pair head width 32), 4 blocks ----
def _gpu_case(N=192, seed=0):
    m = of3_stack(seed, **{**PUBLISHED, "no_blocks": 4}).cuda()
    s, z, mask, pair_mask = (t.cuda() for t in inputs(B=2, N=N, seed=seed, c_s=384, c_z=128))
    return m, s, z, mask, pair_mask


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "chunked"])
def test_gpu_fp32_parity_at_published_widths(backend):
    """fp32 on the GPU (no TF32: the triton backend's fp32 uses tf32 dots, so it is checked in bf16 below)."""
    m, s, z, mask, pair_mask = _gpu_case()
    stack = from_openfold3(m, attention=backend).cuda()
    _, ref = run(m, s, z, mask, pair_mask, theirs=True)
    _, out = run(stack, s, z, mask, pair_mask, theirs=False)
    es, ez = real_err(out, ref, mask)
    assert es < 1e-5 and ez < 1e-5, (es, ez)


@pytest.mark.gpu
def test_gpu_triton_bf16_within_2x_openfold3_own_bf16_error():
    """Under bf16 autocast, ours on the triton backend against OpenFold3's fp32 output: at most 2x the error
    OpenFold3's own autocast run makes (s and z at real positions)."""
    m, s, z, mask, pair_mask = _gpu_case()
    stack = from_openfold3(m, attention="triton").cuda()
    _, ref = run(m, s, z, mask, pair_mask, theirs=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, peer = run(m, s, z, mask, pair_mask, theirs=True)
        _, out = run(stack, s, z, mask, pair_mask, theirs=False)
    (ps, pz), (os_, oz) = real_err(peer, ref, mask), real_err(out, ref, mask)
    print(f"bf16 error vs OpenFold3 fp32: s ours {os_:.3g} theirs {ps:.3g}; z ours {oz:.3g} theirs {pz:.3g}")
    assert os_ <= 2 * ps and oz <= 2 * pz
