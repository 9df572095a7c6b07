"""AlphaFold 2 parameters -> EvoformerStack / ExtraMSAStack: parity with AlphaFold 2's own Haiku modules
(``alphafold-colabfold`` with JAX and dm-haiku on the CPU), random parameters of the released layout, with masks,
and exact round trips through the npz layout.

The reference needs ``alphafold-colabfold`` (+ ``colabfold-kernels``, ``dm-haiku``, ``jax``); ``.ci/run`` installs
them. Without them the parity tests skip with that reason; the round-trip and error tests run without JAX.
"""
import copy

import numpy as np
import pytest
import torch

from attn_zoo.models.zoo import ZooCheckpointError, from_alphafold, to_alphafold
from attn_zoo.models.zoo_alphafold import PREFIX, AlphaFold2Trunk

TOL = 1e-5  # fp32, relative to the largest reference value

SIZES = dict(c_m=16, c_z=12, num_blocks=2, num_heads_msa=4, c_hidden_msa=4, num_heads_pair=2, c_hidden_pair=6,
             c_hidden_opm=8, c_hidden_mul=12, transition_n=4)
EXTRA = dict(SIZES, c_m=12, num_heads_msa=4, c_hidden_msa=3, num_blocks=1)


def _random_trunk(multimer=False, fused=False, seed=0):
    torch.manual_seed(seed)
    trunk = AlphaFold2Trunk(SIZES, EXTRA, attention="torch", multimer=multimer, fused_triangle_weights=fused)
    with torch.no_grad():
        for p in trunk.parameters():
            p.normal_(0.0, 0.3)
    return trunk.eval()


# --------------------------------------------------------------------------------------------------
# Without JAX: round trips and errors
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("multimer,fused", [(False, False), (True, True)])
def test_round_trips_bitwise(multimer, fused, tmp_path):
    trunk = _random_trunk(multimer, fused)
    arrays = to_alphafold(trunk)
    names = "projection//weights" if fused else "left_projection//weights"
    assert f"{PREFIX}evoformer_iteration/triangle_multiplication_incoming/{names}" in arrays
    assert arrays[f"{PREFIX}evoformer_iteration/msa_row_attention_with_pair_bias/attention//query_w"].shape == (2, 16, 4, 4)
    assert arrays[f"{PREFIX}extra_msa_stack/msa_column_global_attention/attention//key_w"].shape == (1, 12, 3)
    if multimer:
        arrays[f"{PREFIX}~_relative_encoding/position_activations//weights"] = np.zeros((3, 12), np.float32)
    np.savez(tmp_path / "params.npz", **arrays)
    back = from_alphafold(str(tmp_path / "params.npz"), attention="torch")
    assert back.multimer == multimer and back.fused_triangle_weights == fused
    a, b = trunk.state_dict(), back.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    again = to_alphafold(back)
    assert all(np.array_equal(again[k], arrays[k]) for k in again)
    # the outputs agree too (same weights, same order)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(1, 3, 5, 16, generator=g), torch.randn(1, 5, 5, 12, generator=g),
         torch.randn(1, 4, 5, 12, generator=g))
    with torch.no_grad():
        assert all(torch.equal(u, v) for u, v in zip(trunk(*x), back(*x)))


@pytest.mark.parametrize("multimer", [False, True])
def test_bounded_inference_path_keeps_the_variant(multimer):
    """The memory-bounded inference path (in place, by chunks) runs the AlphaFold order and outer product mean."""
    stack = _random_trunk(multimer).evoformer
    g = torch.Generator().manual_seed(2)
    m, z = torch.randn(1, 4, 7, 16, generator=g), torch.randn(1, 7, 7, 12, generator=g)
    mm = torch.rand(1, 4, 7, generator=g) > 0.2
    pm = torch.ones(1, 7, 7, dtype=torch.bool)
    with torch.no_grad():
        ref = stack.blocks[1](*stack.blocks[0](m, z, mm, pm), mm, pm)
        out = stack.forward_inference(m, z, mm, pm, mode="bounded")
    for a, b in zip(out, ref):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_other_modules_ignored_and_nested_form():
    arrays = to_alphafold(_random_trunk())
    arrays["alphafold/alphafold_iteration/structure_module//some_w"] = np.zeros(3, np.float32)
    nested = {}
    for k, v in arrays.items():
        mod, name = k.split("//")
        nested.setdefault(mod, {})[name] = v
    trunk = from_alphafold(nested)
    assert trunk.evoformer.blocks[0].outer_product_mean.bias_in_mean and not trunk.multimer


def test_mismatches_name_the_keys_and_load_nothing():
    arrays = to_alphafold(_random_trunk())
    k_missing = f"{PREFIX}evoformer_iteration/triangle_attention_ending_node/attention//gating_b"
    k_shape = f"{PREFIX}extra_msa_stack/pair_transition/transition2//bias"
    k_extra = f"{PREFIX}evoformer_iteration/msa_transition/transition3//bias"
    bad = dict(arrays)
    bad.pop(k_missing)
    bad[k_shape] = np.zeros((1, 13), np.float32)
    bad[k_extra] = np.zeros((2, 4), np.float32)
    with pytest.raises(ZooCheckpointError) as e:
        from_alphafold(bad)
    msg = str(e.value)
    assert k_missing in msg and k_shape in msg and "(1, 13)" in msg and k_extra in msg
    no_stack = {k: v for k, v in arrays.items() if "extra_msa_stack" not in k}
    with pytest.raises(ZooCheckpointError, match="extra_msa_stack/msa_row_attention_with_pair_bias"):
        from_alphafold(no_stack)
    with pytest.raises(ZooCheckpointError, match="do not exist"):
        from_alphafold("/nonexistent/params_model_1.npz")


def test_published_shapes():
    """The released sizes: 48 Evoformer iterations (c_m 256, c_z 128, 8 x 32 MSA heads, 4 x 32 pair heads),
    4 extra-MSA iterations (c_e 64, 8 x 8 heads), outer product 32, triangle multiplication 128."""
    evo = dict(c_m=256, c_z=128, num_blocks=48, num_heads_msa=8, c_hidden_msa=32, num_heads_pair=4,
               c_hidden_pair=32, c_hidden_opm=32, c_hidden_mul=128, transition_n=4)
    ext = dict(evo, c_m=64, num_blocks=4, c_hidden_msa=8)
    with torch.device("meta"):
        arrays = to_alphafold(AlphaFold2Trunk(evo, ext), as_numpy=False)
    shapes = {k[len(PREFIX):]: tuple(v.shape) for k, v in arrays.items()}
    assert shapes["evoformer_iteration/msa_row_attention_with_pair_bias/attention//output_w"] == (48, 8, 32, 256)
    assert shapes["evoformer_iteration/outer_product_mean//output_w"] == (48, 32, 32, 128)
    assert shapes["extra_msa_stack/msa_column_global_attention/attention//query_w"] == (4, 64, 8, 8)
    assert shapes["extra_msa_stack/msa_column_global_attention/attention//value_w"] == (4, 64, 8)
    assert len(shapes) == 2 * 93  # 93 arrays per unfused iteration, as AlphaFold's own tree (the parity test)


# --------------------------------------------------------------------------------------------------
# Parity with AlphaFold 2's Haiku modules
# --------------------------------------------------------------------------------------------------
def _haiku_stack(extra, fused, first, sizes, seed):
    """Random parameters of the released tree for ``num_blocks`` iterations (stacked as the npz stores them),
    random masked inputs, and AlphaFold's outputs after the iterations."""
    jax = pytest.importorskip("jax")
    hk = pytest.importorskip("haiku")
    pytest.importorskip("alphafold.model.modules", reason="alphafold-colabfold (AlphaFold 2 model code) not installed")
    from alphafold.model import config, modules

    cfg = config.model_config("model_1_multimer_v3" if first else "model_1_ptm")
    gc = cfg.model.global_config
    gc.bfloat16, gc.use_pallas = False, False
    ec = copy.deepcopy(cfg.model.embeddings_and_evoformer.evoformer)
    for t in ("triangle_multiplication_outgoing", "triangle_multiplication_incoming"):
        ec[t].fuse_projection_weights = fused
    ec.outer_product_mean.first = first
    for key in ("msa_row_attention_with_pair_bias", "msa_column_attention"):
        ec[key].num_head = sizes["num_heads_msa"]
    for key in ("triangle_attention_starting_node", "triangle_attention_ending_node"):
        ec[key].num_head = sizes["num_heads_pair"]
    ec.outer_product_mean.num_outer_channel = sizes["c_hidden_opm"]
    for t in ("triangle_multiplication_outgoing", "triangle_multiplication_incoming"):
        ec[t].num_intermediate_channel = sizes["c_hidden_mul"]
    name = "extra_msa_stack" if extra else "evoformer_iteration"
    S, N, cm, cz = 5, 6, sizes["c_m"], sizes["c_z"]

    def f(m, z, mm, pm):
        it = modules.EvoformerIteration(ec, gc, is_extra_msa=extra, name=name)
        return it({"msa": m, "pair": z}, {"msa": mm, "pair": pm}, is_training=False)

    t = hk.transform(f)
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(S, N, cm)).astype(np.float32)
    z = rng.normal(size=(N, N, cz)).astype(np.float32)
    mm = np.ones((S, N), np.float32)
    mm[-1, :], mm[:, -1], mm[1, 2] = 0, 0, 0  # a padded MSA row, a padded residue, one gap
    pm = np.ones((N, N), np.float32)
    pm[-1, :], pm[:, -1] = 0, 0
    tree = t.init(jax.random.PRNGKey(0), m, z, mm, pm)
    blocks = [{mod: {k: (rng.normal(size=v.shape) * 0.3 + (k == "scale")).astype(np.float32) for k, v in d.items()}
               for mod, d in tree.items()} for _ in range(sizes["num_blocks"])]
    def run(dtype):  # AlphaFold's iterations with parameters and inputs in ``dtype``, outputs as float32
        cast = lambda x: jax.numpy.asarray(x).astype(dtype)  # noqa: E731
        mj, zj = cast(m), cast(z)
        with jax.default_matmul_precision("highest"):  # full fp32 dots (the CPU's default already is)
            for p in blocks:
                out = t.apply(jax.tree_util.tree_map(cast, p), jax.random.PRNGKey(1), mj, zj, cast(mm), cast(pm))
                mj, zj = out["msa"], out["pair"]
        return np.asarray(mj.astype(np.float32)), np.asarray(zj.astype(np.float32))

    flat = {f"{PREFIX}{mod}//{k}": np.stack([b[mod][k] for b in blocks]) for mod in tree for k in tree[mod]}
    _haiku_stack.run = run  # (the bf16 test runs it again in bfloat16)
    return flat, (m, z, mm, pm), run(np.float32)


def _rel(ours, ref, mask):
    return float(np.abs(ours - ref)[mask].max() / np.abs(ref[mask]).max())


@pytest.mark.slow
@pytest.mark.parametrize("multimer,fused", [(False, False), (True, True)])
def test_parity_with_alphafold_haiku(multimer, fused):
    flat_e, inp_e, ref_e = _haiku_stack(True, fused, multimer, EXTRA, seed=1)
    flat_m, inp_m, ref_m = _haiku_stack(False, fused, multimer, SIZES, seed=2)
    trunk = from_alphafold({**flat_e, **flat_m}, attention="torch", multimer=multimer)
    assert trunk.evoformer.blocks[0].opm_first == multimer
    for stack, (m, z, mm, pm), (rm, rz) in ((trunk.extra_msa_stack, inp_e, ref_e), (trunk.evoformer, inp_m, ref_m)):
        with torch.no_grad():
            om, oz = stack(torch.from_numpy(m)[None], torch.from_numpy(z)[None], torch.from_numpy(mm)[None].bool(),
                           torch.from_numpy(pm)[None].bool())
        assert _rel(om[0].numpy(), rm, mm.astype(bool)) < TOL
        assert _rel(oz[0].numpy(), rz, pm.astype(bool)) < TOL
    back = to_alphafold(trunk)
    assert all(np.array_equal(back[k], v) for k, v in {**flat_e, **flat_m}.items())


@pytest.mark.slow
def test_bf16_error_at_most_twice_alphafolds_own():
    """Parameters and inputs in bfloat16 on both sides (AlphaFold's bf16 path casts them so): our stacks' error
    against AlphaFold's float32 outputs at most 2x AlphaFold's own bf16 error (STYLE's bound); the errors print."""
    import jax.numpy as jnp

    cases = []
    for extra, sizes, seed in ((True, EXTRA, 1), (False, SIZES, 2)):
        flat, inputs, ref = _haiku_stack(extra, False, False, sizes, seed)
        cases.append((extra, flat, inputs, ref, _haiku_stack.run(jnp.bfloat16)))
    trunk = from_alphafold({**cases[0][1], **cases[1][1]}, attention="torch").to(torch.bfloat16)
    for extra, _, (m, z, mm, pm), (rm, rz), (theirs_m, theirs_z) in cases:
        stack = trunk.extra_msa_stack if extra else trunk.evoformer
        with torch.no_grad():
            om, oz = stack(torch.from_numpy(m)[None].bfloat16(), torch.from_numpy(z)[None].bfloat16(),
                           torch.from_numpy(mm)[None].bool(), torch.from_numpy(pm)[None].bool())
        for name, ours, theirs, ref, mask in (("msa", om, theirs_m, rm, mm), ("pair", oz, theirs_z, rz, pm)):
            e_ours = _rel(ours[0].float().numpy(), ref, mask.astype(bool))
            e_theirs = _rel(theirs, ref, mask.astype(bool))
            print(f"{'extra' if extra else 'evoformer'} {name}: ours bf16 {e_ours:.2e}, AlphaFold bf16 {e_theirs:.2e}")
            assert e_ours <= 2 * e_theirs, (extra, name, e_ours, e_theirs)
