"""attn_zoo.patch on OpenFold3's own modules (openfold3 0.5.0, installed by .ci/run with --no-deps): its trunk
Pairformer (triangle attention around both nodes, the single attention with pair bias in high precision) and MSA
row and column attention, patched against unpatched on random weights in fp32: outputs at real positions, the
gradients of the inputs and of every parameter (within 1e-5 relative), with chunk_size and OpenFold3's kernel
switches, masks with holes and padding; unpatch restoring the outputs bitwise, state untouched, patching twice
being patching once.
"""
import copy

import pytest
import torch

pytest.importorskip("openfold3.core.model.latent.pairformer",
                    reason="openfold3==0.5.0 (installed with --no-deps, plus gemmi, ml-collections, pandas and "
                           "optree: .ci/run) is a test dependency")
from openfold3.core.model.latent.pairformer import PairFormerStack  # noqa: E402
from openfold3.core.model.layers.msa import MSAColumnAttention, MSARowAttentionWithPairBias  # noqa: E402

import attn_zoo  # noqa: E402
from attn_zoo.models.integrations import is_patched, looked_for  # noqa: E402
from attn_zoo.models.integrations.common import patched  # noqa: E402
from helpers import loss_at_real, padded_inputs, randomize_, real_err, run_on  # noqa: E402
from test_integrations import BACKENDS, TOL, assert_close_grads, assert_state_untouched, param_grads, snapshot  # noqa: E402
from test_primitives import rel_err  # noqa: E402

SIZES = dict(c_s=32, c_z=8, c_hidden_pair_bias=16, no_heads_pair_bias=2, c_hidden_mul=8, c_hidden_pair_att=16,
             no_heads_pair=2, no_blocks=2, transition_n=2)


def of3_stack(seed=0):
    torch.manual_seed(seed)
    m = PairFormerStack(**SIZES, transition_type="swiglu", pair_dropout=0.25, fuse_projection_weights=False,
                        blocks_per_ckpt=None, inf=1e9).eval()
    return randomize_(m, seed + 1)


def stack_run(m, s, z, mask, pair_mask, **kw):
    """Outputs, input gradients and parameter gradients of the stack under a loss over real positions."""
    m.zero_grad(set_to_none=True)
    (s_in, z_in), out = run_on(lambda s, z: m(s, z, mask.float(), pair_mask.float(), **kw), s, z, grad=True)
    loss_at_real(*out, mask).backward()
    return [o.detach() for o in out], (s_in.grad, z_in.grad), param_grads(m)


def assert_stack_close(got, ref, mask, model):
    es, ez = real_err(got[0], ref[0], mask)
    assert es < TOL and ez < TOL, (es, ez)
    assert rel_err(got[1][0], ref[1][0]) < TOL and rel_err(got[1][1], ref[1][1]) < TOL
    # the pair bias' own layer-norm shift and linear bias add one constant per head to a whole softmax row
    assert_close_grads(model, got[2], ref[2], zero=("attn_pair_bias.layer_norm_z.bias", "linear_z.bias"))


def test_openfold3_is_looked_for():
    names = " ".join(looked_for())
    for cls in ("triangular_attention.TriangleAttention", "attention_pair_bias.AttentionPairBias", "msa.MSAAttention"):
        assert f"openfold3.core.model.layers.{cls}" in names


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.slow) if b == "torch" else b for b in BACKENDS])
def test_pairformer_stack_patched_equals_unpatched_with_grads(backend):
    m = of3_stack()
    s, z, mask, pair_mask = padded_inputs(N=7)
    before = snapshot(m)
    ref = stack_run(m, s, z, mask, pair_mask)
    attn_zoo.patch(m, backend=backend)
    assert is_patched(m)
    blocks = m.blocks
    names = [type(mod).__name__ for blk in blocks for mod in (blk.pair_stack.tri_att_start,
                                                               blk.pair_stack.tri_att_end, blk.attn_pair_bias)
               if "forward" in mod.__dict__]
    assert len(names) == 3 * len(blocks), names
    assert_stack_close(stack_run(m, s, z, mask, pair_mask), ref, mask, m)
    # OpenFold3's switches are served by the op, its inference chunking by rows
    assert_stack_close(stack_run(m, s, z, mask, pair_mask, chunk_size=3, use_lma=True), ref, mask, m)
    assert_stack_close(stack_run(m, s, z, mask, pair_mask, chunk_size=2, use_deepspeed_evo_attention=True,
                                 use_cueq_triangle_kernels=False), ref, mask, m)
    assert_state_untouched(m, before)
    attn_zoo.patch(m, backend=backend)  # twice is once: each patch still wraps the class's own forward
    assert all(patched(mod).previous is None for mod in m.modules() if patched(mod) is not None)
    attn_zoo.unpatch(m)
    assert not is_patched(m)
    back = stack_run(m, s, z, mask, pair_mask)
    assert torch.equal(back[0][0], ref[0][0]) and torch.equal(back[0][1], ref[0][1])


def test_pairformer_stack_patched_under_bf16_autocast_keeps_high_precision_attention():
    """The single attention runs in float32 with autocast off (OpenFold3 asks for high precision there): patched
    and unpatched stay within bf16 noise of each other, and the patched one's error against fp32 is no larger than
    twice OpenFold3's own."""
    m = of3_stack()
    s, z, mask, pair_mask = padded_inputs(N=7)
    with torch.no_grad():
        want = m(s, z, mask.float(), pair_mask.float())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = m(s, z, mask.float(), pair_mask.float())
            attn_zoo.patch(m)
            ours = m(s, z, mask.float(), pair_mask.float())
    attn_zoo.unpatch(m)
    for i in range(2):
        e_theirs = max(real_err(theirs, want, mask)[i], 1e-3)
        assert real_err(ours, want, mask)[i] <= 2 * e_theirs, (i, real_err(ours, want, mask), real_err(theirs, want, mask))


def msa_inputs(B=2, S=3, N=6, c_m=16, c_z=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(B, S, N, c_m, generator=g)
    z = torch.randn(B, N, N, c_z, generator=g)
    mask = torch.ones(B, S, N)
    mask[0, :, 2] = 0  # a hole inside every sequence of the first MSA
    mask[1, 1, N - 2:] = 0  # padding at the end of one sequence of the second
    return m, z, mask


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("module", ["row", "column"])
def test_msa_attention_patched_equals_unpatched_with_grads(module, chunk):
    torch.manual_seed(0)
    mod = (MSARowAttentionWithPairBias(c_m=16, c_z=8, c_hidden=8, no_heads=2) if module == "row"
           else MSAColumnAttention(c_m=16, c_hidden=8, no_heads=2))
    randomize_(mod, 1)
    m, z, mask = msa_inputs()
    kw = dict(z=z) if module == "row" else {}

    def run():
        mod.zero_grad(set_to_none=True)
        mi, zi = m.clone().requires_grad_(True), z.clone().requires_grad_(True)
        out = mod(mi, mask=mask, chunk_size=chunk, **({"z": zi} if kw else {}))
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        (out * w * mask[..., None]).sum().backward()  # real positions: a row or column with no key differs
        return out.detach(), mi.grad, (zi.grad if kw else None), param_grads(mod)

    ref = run()
    attn_zoo.patch(mod)
    got = run()
    real = mask.bool()
    assert rel_err(got[0][real], ref[0][real]) < TOL
    assert rel_err(got[1], ref[1]) < TOL
    if kw:
        assert rel_err(got[2], ref[2]) < TOL
    assert_close_grads(mod, got[3], ref[3], zero=("layer_norm_z.bias", "linear_z.bias"))  # a shift per softmax row
    attn_zoo.unpatch(mod)
    assert torch.equal(run()[0], ref[0])


def test_wrong_mask_shape_is_named():
    m = of3_stack()
    attn_zoo.patch(m)
    tri = m.blocks[0].pair_stack.tri_att_start
    with pytest.raises(ValueError, match=r"mask: expected shape \(1, 5, 5\)"):
        tri(torch.randn(1, 5, 5, 8), mask=torch.ones(1, 5, 4))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        tri(torch.randn(1, 5, 5, 8), chunk_size=0)
    apb = m.blocks[0].attn_pair_bias
    with pytest.raises(ValueError, match=r"mask: expected shape \(1, 5\)"):
        apb(torch.randn(1, 5, 32), torch.randn(1, 5, 5, 8), mask=torch.ones(1, 4))
    # a patched model deep-copies into a patched twin computing the same
    twin = copy.deepcopy(m)
    assert is_patched(twin) and patched(twin.blocks[0].attn_pair_bias).module is twin.blocks[0].attn_pair_bias
    x = torch.randn(1, 5, 5, 8)
    with torch.no_grad():
        assert torch.equal(twin.blocks[0].pair_stack.tri_att_start(x), tri(x))
