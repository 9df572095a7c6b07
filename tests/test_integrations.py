"""attn_zoo.patch / unpatch on other projects' models: Hugging Face ESM (attention registry), fair-esm ESM-2 and
Boltz-1/2 layers, on random weights in fp32.

For each: patched vs unpatched outputs and the gradient of every parameter (within 1e-5 relative), padding masks
with holes inside sequences, parameters and state_dict untouched, unpatch restoring the original outputs bitwise,
patching twice being patching once; and the refusal message for a model of unknown layout.
"""
import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import attn_zoo
from attn_zoo.models.integrations import is_patched, looked_for
from attn_zoo.models.integrations.common import PatchedForward
from helpers import randomize_
from test_primitives import rel_err

TOL = 1e-5
BACKENDS = ["auto", "torch"]  # auto is the chunked backend on CPU


def param_grads(model: nn.Module) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(model: nn.Module, got: dict, ref: dict, unused: str = "\0", zero: tuple = ()):
    """Every parameter (except those named ``unused*``, off the loss's path) has a gradient, patched as unpatched.
    Those named ``*zero`` are analytically 0 (they only shift every logit of a softmax row): both must be 0 up to
    rounding, TOL times the largest gradient."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad and not n.startswith(unused)}
    assert set(ref) == trainable, f"parameters without a gradient: {sorted(trainable - set(ref))}"
    assert set(got) == set(ref)
    scale = max(g.abs().max().item() for g in ref.values())
    for n in ref:
        if n.endswith(zero or "\0"):
            assert max(got[n].abs().max().item(), ref[n].abs().max().item()) < TOL * scale, n
        else:
            assert rel_err(got[n], ref[n], floor=1e-3) < TOL, (n, rel_err(got[n], ref[n], floor=1e-3))


def snapshot(model: nn.Module) -> dict:
    return {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}


def assert_state_untouched(model: nn.Module, before: dict):
    after = model.state_dict()
    assert list(after) == list(before)
    for k, (ptr, val) in before.items():
        assert after[k].data_ptr() == ptr and torch.equal(after[k], val), k


def test_refuses_unknown_model_naming_what_it_looked_for():
    with pytest.raises(TypeError) as err:
        attn_zoo.patch(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    msg = str(err.value)
    assert "Sequential" in msg
    for name in ["AttentionInterface", "esm.multihead_attention.MultiheadAttention", "TriangleAttention",
                 "attention.AttentionPairBias", "attentionv2.AttentionPairBias", "openfold.model.msa.MSAAttention",
                 "pairformer.PairformerLayer", "PairformerNoSeqLayer",
                 "openfold.model.triangular_attention.TriangleAttention",
                 "openfold3.core.model.layers.triangular_attention.TriangleAttention",
                 "openfold3.core.model.layers.attention_pair_bias.AttentionPairBias",
                 "openfold3.core.model.layers.msa.MSAAttention",
                 "triangular_mult.TriangleMultiplicationOutgoing", "transition.Transition"]:
        assert name in msg
    assert len(looked_for()) == 13
    with pytest.raises(ValueError, match="backend"):
        attn_zoo.patch(nn.Linear(2, 2), backend="no-such-backend")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        attn_zoo.patch("model")


# --------------------------------------------------------------------------------------------------
# fair-esm
# --------------------------------------------------------------------------------------------------
def fair_esm_model(seed=0):
    esm2 = pytest.importorskip("esm.model.esm2", reason="fair-esm is a test dependency")
    torch.manual_seed(seed)
    return randomize_(esm2.ESM2(num_layers=2, embed_dim=32, attention_heads=4), seed).eval()


def fair_esm_tokens(m, B=3, L=11, seed=1):
    """cls ... eos with padding tokens inside (holes) and at the end."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(4, 24, (B, L), generator=g)
    tok[:, 0] = m.cls_idx
    tok[0, -1] = m.eos_idx
    tok[1, 4] = m.padding_idx
    tok[1, 7] = m.padding_idx
    tok[1, -1] = m.eos_idx
    tok[2, 7] = m.eos_idx
    tok[2, 8:] = m.padding_idx
    assert tok.eq(m.padding_idx).any(-1).tolist() == [False, True, True]
    return tok


def fair_esm_run(m, tok, seed=2):
    m.zero_grad(set_to_none=True)
    out = m(tok, repr_layers=[2])
    w = torch.randn(out["logits"].shape, generator=torch.Generator().manual_seed(seed))
    (out["logits"] * w).sum().backward()
    return out["logits"].detach(), param_grads(m)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fair_esm_patched_equals_unpatched_with_grads(backend):
    m = fair_esm_model()
    tok = fair_esm_tokens(m)
    ref, ref_g = fair_esm_run(m, tok)
    before = snapshot(m)
    assert attn_zoo.patch(m, backend=backend) is m
    assert is_patched(m) and all(type(layer.self_attn).__name__ == "MultiheadAttention" for layer in m.layers)
    assert_state_untouched(m, before)
    got, got_g = fair_esm_run(m, tok)
    assert rel_err(got, ref) < TOL
    assert_close_grads(m, got_g, ref_g, unused="contact_head.")


def test_fair_esm_rotary_kernel_in_interpreter(monkeypatch):
    """The patched attention's q/k rotation on the Triton kernel itself (the CPU interpreter), fed fair-esm's
    time-first projection as a transposed view: outputs and every gradient as unpatched."""
    from test_primitives import skip_unless_backend

    skip_unless_backend("triton")
    from attn_zoo.models import kernels

    rotary_qkv = kernels.rotary_qkv

    m = fair_esm_model()
    tok = fair_esm_tokens(m)
    ref, ref_g = fair_esm_run(m, tok)
    calls = []
    monkeypatch.setattr(kernels, "rotary_qkv",
                        lambda *a, **kw: calls.append(1) or rotary_qkv(*a, **kw, force=True))
    attn_zoo.patch(m, backend="torch")
    got, got_g = fair_esm_run(m, tok)
    assert calls and rel_err(got, ref) < TOL
    assert_close_grads(m, got_g, ref_g, unused="contact_head.")


def test_fair_esm_patch_is_used_and_unpatch_restores_bitwise():
    m = fair_esm_model()
    tok = fair_esm_tokens(m)
    with torch.no_grad():
        ref = m(tok)["logits"]
    calls = []
    attn_zoo.patch(m, backend="torch")
    attn_zoo.patch(m, backend="torch")  # idempotent
    fwd = m.layers[0].self_attn.forward
    m.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        got = m(tok)["logits"]
    assert calls and not torch.equal(got, ref) and rel_err(got, ref) < TOL  # a different computation, same result
    assert m.layers[0].self_attn.forward is fwd
    assert all(isinstance(layer.__dict__.get("forward"), PatchedForward) for layer in m.layers)  # the fused GELU
    attn_zoo.unpatch(m)
    assert not is_patched(m) and "forward" not in m.layers[0].self_attn.__dict__
    assert not any("forward" in layer.__dict__ for layer in m.layers)
    with torch.no_grad():
        assert torch.equal(m(tok)["logits"], ref)
    attn_zoo.unpatch(m)  # a no-op once unpatched


def test_fair_esm_layer_gelu_fused_only_for_the_known_forward():
    modules = pytest.importorskip("esm.modules", reason="fair-esm is a test dependency")
    m = fair_esm_model()
    x = torch.randn(5, 2, 32)
    layer = m.layers[0]
    with torch.no_grad():
        ref = layer(x)[0]
        attn_zoo.patch(layer, backend="torch")
        got = layer(x)[0]
    assert rel_err(got, ref) < TOL

    class Custom(modules.TransformerLayer):  # the user's own layer: its forward is theirs, not fair-esm's
        def forward(self, x, **kw):
            return super().forward(x, **kw)

    custom = Custom(32, 64, 4, add_bias_kv=False, use_esm1b_layer_norm=True, use_rotary_embeddings=True)
    attn_zoo.patch(custom)
    assert "forward" not in custom.__dict__ and "forward" in custom.self_attn.__dict__


def test_fair_esm_head_weights_and_contacts_served_exactly():
    m = fair_esm_model()
    tok = fair_esm_tokens(m)
    with torch.no_grad():
        ref = m(tok, return_contacts=True)
        attn_zoo.patch(m)
        got = m(tok, return_contacts=True)
    for key in ("logits", "attentions", "contacts"):
        assert torch.equal(got[key], ref[key]), key


def test_fair_esm_patched_model_copies_and_pickles():
    m = attn_zoo.patch(fair_esm_model())
    tok = fair_esm_tokens(m)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert is_patched(clone) and clone.layers[0].self_attn.forward.module is clone.layers[0].self_attn
        with torch.no_grad():
            assert torch.equal(clone(tok)["logits"], m(tok)["logits"])


# --------------------------------------------------------------------------------------------------
# Hugging Face transformers (attention registry)
# --------------------------------------------------------------------------------------------------
def hf_model(impl="sdpa", seed=0):
    tr = pytest.importorskip("transformers", reason="transformers is a test dependency")
    config = tr.EsmConfig(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64, position_embedding_type="rotary",
                          pad_token_id=1, mask_token_id=32, token_dropout=False, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    m = tr.EsmForMaskedLM(config)
    m.set_attn_implementation(impl)
    return randomize_(m, seed).eval()


def hf_inputs(B=3, L=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 24, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    am[1, 3] = am[1, 8] = 0  # holes inside a sequence
    am[2, 7:] = 0  # padding at the end
    return ids, am


def hf_run(m, ids, am, seed=2, **kw):
    m.zero_grad(set_to_none=True)
    logits = m(input_ids=ids, attention_mask=am, **kw).logits
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    (logits * w).sum().backward()
    return logits.detach(), param_grads(m)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_esm_patched_equals_sdpa_with_grads(backend):
    m = hf_model()
    ids, am = hf_inputs()
    ref, ref_g = hf_run(m, ids, am)
    before = snapshot(m)
    attn_zoo.patch(m, backend=backend)
    assert m.config._attn_implementation == ("attn_zoo" if backend == "auto" else f"attn_zoo_{backend}")
    assert all(isinstance(layer.intermediate.__dict__.get("forward"), PatchedForward) and
               isinstance(layer.attention.self.__dict__.get("forward"), PatchedForward) for layer in m.esm.encoder.layer)
    assert_state_untouched(m, before)
    got, got_g = hf_run(m, ids, am)
    assert rel_err(got, ref) < TOL
    assert_close_grads(m, got_g, ref_g, unused="esm.contact_head.")
    attn_zoo.unpatch(m)
    assert m.config._attn_implementation == "sdpa" and not is_patched(m)
    assert not any("forward" in layer.intermediate.__dict__ or "forward" in layer.attention.self.__dict__
                   for layer in m.esm.encoder.layer)
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids, attention_mask=am).logits, ref)


def test_hf_padding_mask_reaches_the_op_as_a_key_mask(monkeypatch):
    """ESM's bidirectional padding mask is one row per batch: the op is handed ``[B, 1, 1, L]``, not ``[B, 1, L,
    L]``; a mask that varies along the queries (a causal builder over padding) keeps its full shape."""
    import attn_ops
    from transformers import masking_utils

    from attn_zoo.models.integrations import hf as hf_integration

    m = hf_model()
    ids, am = hf_inputs()
    ref, _ = hf_run(m, ids, am)
    seen = []
    real = attn_ops.attention
    monkeypatch.setattr(attn_ops, "attention", lambda *a, **kw: seen.append(kw.get("mask")) or real(*a, **kw))
    attn_zoo.patch(m, backend="torch")
    got, _ = hf_run(m, ids, am)
    assert rel_err(got, ref) < TOL
    assert seen and all(mk is not None and tuple(mk.shape) == (3, 1, 1, 12) for mk in seen)
    assert torch.equal(seen[0][:, 0, 0], am.bool())
    build = hf_integration._key_mask_builder(masking_utils.sdpa_mask)
    causal = build(batch_size=3, q_length=12, kv_length=12, mask_function=masking_utils.causal_mask_function,
                   attention_mask=am.bool(), allow_is_causal_skip=False)
    assert causal.shape == (3, 1, 12, 12) and torch.equal(causal, masking_utils.sdpa_mask(
        batch_size=3, q_length=12, kv_length=12, mask_function=masking_utils.causal_mask_function,
        attention_mask=am.bool(), allow_is_causal_skip=False))
    attn_zoo.unpatch(m)


def test_hf_from_pretrained_with_attn_implementation(tmp_path):
    m = hf_model()
    m.save_pretrained(tmp_path)
    ids, am = hf_inputs()
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=am).logits
    assert attn_zoo.register_hf() == "attn_zoo"
    import transformers

    registered = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["attn_zoo"]
    assert attn_zoo.register_hf() == "attn_zoo"  # registering again keeps the function
    assert transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["attn_zoo"] is registered

    loaded = transformers.EsmForMaskedLM.from_pretrained(tmp_path, attn_implementation="attn_zoo").eval()
    assert loaded.config._attn_implementation == "attn_zoo" and is_patched(loaded)
    seen = []
    fn = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["attn_zoo"]
    orig_call = type(fn).__call__
    with pytest.MonkeyPatch.context() as mp:  # the registered function is what the layers call
        mp.setattr(type(fn), "__call__", lambda self, *a, **k: seen.append(1) or orig_call(self, *a, **k))
        with torch.no_grad():
            got = loaded(input_ids=ids, attention_mask=am).logits
    assert len(seen) == 2 and rel_err(got, ref) < TOL


def test_hf_deterministic_choice_and_idempotence():
    m = hf_model()
    ids, am = hf_inputs()
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=am).logits
    attn_zoo.patch(m, deterministic=False)
    attn_zoo.patch(m, deterministic=False)
    assert m.config._attn_implementation == "attn_zoo_nondeterministic"
    with torch.no_grad():
        assert rel_err(m(input_ids=ids, attention_mask=am).logits, ref) < TOL
    attn_zoo.patch(m)  # new options replace the old; unpatch still returns to the original
    assert m.config._attn_implementation == "attn_zoo"
    attn_zoo.unpatch(m)
    assert m.config._attn_implementation == "sdpa"


def test_hf_output_attentions_falls_back_with_reason():
    m = hf_model("eager")
    ids, am = hf_inputs()
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=am, output_attentions=True)
    assert len(ref.attentions) == 2
    attn_zoo.patch(m, backend="torch")
    with warnings.catch_warnings(record=True) as rec, torch.no_grad():
        warnings.simplefilter("always")
        got = m(input_ids=ids, attention_mask=am, output_attentions=True)
    assert any("output_attentions=True" in str(w.message) and "eager" in str(w.message) for w in rec)
    assert len(got.attentions) == 2
    for a, b in zip(got.attentions, ref.attentions):
        assert rel_err(a, b) < TOL
    assert rel_err(got.logits, ref.logits) < TOL


def test_hf_packed_rows_equal_separate_sequences():
    m = attn_zoo.patch(hf_model(), backend="torch")
    g = torch.Generator().manual_seed(3)
    lens = [5, 7, 4]
    seqs = [torch.randint(4, 24, (n,), generator=g) for n in lens]
    packed = torch.cat(seqs)[None]  # [1, 16]
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    # positions run on over the row (rotary attention depends only on differences within a sequence): restarting
    # ones would let transformers find the packing from position_ids itself, which some of its code paths do
    pos = torch.arange(int(cu[-1]))[None]
    with torch.no_grad():
        got = m(input_ids=packed, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7,
                max_length_k=7).logits[0]
        ref = torch.cat([m(input_ids=s[None]).logits[0] for s in seqs])
        unpacked = m(input_ids=packed, position_ids=pos).logits[0]  # without the ids: one long sequence
    assert rel_err(got, ref) < TOL
    assert rel_err(unpacked, ref) > 1e-3


# --------------------------------------------------------------------------------------------------
# Boltz-1 / Boltz-2
# --------------------------------------------------------------------------------------------------
def boltz_inputs(B=2, N=7, c_s=32, c_z=16, seed=0):
    """s, z and masks with a hole inside one sequence, padding at the end of the other, and pair holes off the
    diagonal (no real row or column of the pair mask is empty)."""
    g = torch.Generator().manual_seed(seed)
    s, z = torch.randn(B, N, c_s, generator=g), torch.randn(B, N, N, c_z, generator=g)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, 3] = False
    mask[1, N - 2:] = False
    holes = (torch.rand(B, N, N, generator=g) < 0.15) & ~torch.eye(N, dtype=torch.bool)
    pair_mask = mask[:, :, None] & mask[:, None, :] & ~holes
    assert holes[mask[:, :, None] & mask[:, None, :]].any()
    return s, z, mask, pair_mask


def boltz_layer(v2=True, seed=0):
    """Boltz-2's PairformerLayer, or Boltz-1's (its trunk module's own, with Boltz-1's AttentionPairBias)."""
    pytest.importorskip("boltz.model.layers.pairformer", reason="boltz==2.2.1 (--no-deps) is a test dependency")
    if v2:
        from boltz.model.layers import pairformer as mod
    else:  # Boltz-1's trunk module imports fairscale, which boltz --no-deps does not bring
        mod = pytest.importorskip("boltz.model.modules.trunk", reason="Boltz-1's trunk module needs fairscale")
    torch.manual_seed(seed)
    kw = dict(token_s=32, token_z=16, num_heads=2, dropout=0.25, pairwise_head_width=16, pairwise_num_heads=2)
    layer = mod.PairformerLayer(**kw, v2=True) if v2 else mod.PairformerLayer(**kw)
    return randomize_(layer, seed).eval()


def test_boltz_layer_subclass_with_its_own_forward_keeps_it():
    layer = boltz_layer()
    from boltz.model.layers import pairformer as mod

    class Custom(mod.PairformerLayer):  # the user's own layer: its forward is theirs
        def forward(self, s, z, mask, pair_mask, **kw):
            return super().forward(s, z, mask, pair_mask, **kw)

    custom = Custom(token_s=32, token_z=16, num_heads=2, pairwise_head_width=16, pairwise_num_heads=2, v2=True)
    attn_zoo.patch(custom)
    attn_zoo.patch(layer)
    assert "forward" not in custom.__dict__ and "forward" in custom.tri_att_start.__dict__
    assert isinstance(layer.__dict__.get("forward"), PatchedForward)


def boltz_run(layer, s, z, mask, pair_mask, seed=5, **kw):
    """Outputs at real positions and the parameters' gradients of a weighted sum over them (padded rows are
    defined differently: see models/integrations/boltz.py)."""
    layer.zero_grad(set_to_none=True)
    s_out, z_out = layer(s, z, mask.float(), pair_mask.float(), **kw)
    real_pairs = mask[:, :, None] & mask[:, None, :]
    g = torch.Generator().manual_seed(seed)
    loss = (s_out * torch.randn(s_out.shape, generator=g) * mask[..., None]).sum()
    loss = loss + (z_out * torch.randn(z_out.shape, generator=g) * real_pairs[..., None]).sum()
    loss.backward()
    return s_out[mask].detach(), z_out[real_pairs].detach(), param_grads(layer)


@pytest.mark.parametrize("v2", [True, False], ids=["boltz2", "boltz1"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_boltz_pairformer_layer_patched_equals_unpatched_with_grads(v2, backend):
    layer = boltz_layer(v2)
    x = boltz_inputs()
    s_ref, z_ref, g_ref = boltz_run(layer, *x)
    before = snapshot(layer)
    attn_zoo.patch(layer, backend=backend)
    patched_names = sorted(n for n, mod in layer.named_modules() if "forward" in mod.__dict__)
    # Boltz-2's layer itself too (its no-grad inference); Boltz-1's trunk layer is not
    assert patched_names == ([""] if v2 else []) + ["attention", "transition_s", "transition_z", "tri_att_end",
                                                     "tri_att_start", "tri_mul_in", "tri_mul_out"]
    assert_state_untouched(layer, before)
    s_got, z_got, g_got = boltz_run(layer, *x)
    assert rel_err(s_got, s_ref) < TOL and rel_err(z_got, z_ref) < TOL
    assert_close_grads(layer, g_got, g_ref, zero=("proj_z.0.bias",))
    attn_zoo.unpatch(layer)
    s_back, z_back, _ = boltz_run(layer, *x)
    assert torch.equal(s_back, s_ref) and torch.equal(z_back, z_ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_boltz2_pairformer_layer_training_with_dropout_equals_unpatched(backend):
    """Train mode, dropout 0.25: the patched layer draws Boltz's masks (same random stream, same order) and adds the
    updates in one pass; outputs and every parameter's gradient as Boltz's."""
    layer = boltz_layer().train()
    x = boltz_inputs()
    torch.manual_seed(3)
    s_ref, z_ref, g_ref = boltz_run(layer, *x)
    attn_zoo.patch(layer, backend=backend)
    torch.manual_seed(3)
    s_got, z_got, g_got = boltz_run(layer, *x)
    assert rel_err(s_got, s_ref) < TOL and rel_err(z_got, z_ref) < TOL
    assert_close_grads(layer, g_got, g_ref, zero=("proj_z.0.bias",))
    torch.manual_seed(4)  # another draw: another result (the masks are drawn, not fixed)
    s_other, _, _ = boltz_run(layer, *x)
    assert rel_err(s_other, s_got) > 1e-3


def _boltz_update_module(kind, c=8):
    if kind == "transition":
        tr = pytest.importorskip("boltz.model.layers.transition", reason="boltz==2.2.1 (--no-deps) is a test dependency")
        return randomize_(tr.Transition(c, 3 * c), 3)
    tm = pytest.importorskip("boltz.model.layers.triangular_mult", reason="boltz==2.2.1 (--no-deps) is a test dependency")
    cls = tm.TriangleMultiplicationOutgoing if kind == "outgoing" else tm.TriangleMultiplicationIncoming
    return randomize_(cls(c), 3)


@pytest.mark.parametrize("kind", ["outgoing", "incoming", "transition"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_boltz_triangle_multiplication_and_transition_on_our_code_with_grads(kind, train):
    """Boltz's triangle multiplications and transition, patched, run our blocks' code on Boltz's parameters: the
    same values and gradients (fp32, a pair mask with holes), the state untouched; unpatched, bitwise Boltz again."""
    mod = _boltz_update_module(kind).train(train)
    _, z, mask, pair_mask = boltz_inputs(c_z=8)
    z.requires_grad_(True)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(z.shape, generator=g)

    def run():
        mod.zero_grad(set_to_none=True)
        z.grad = None
        out = mod(z) if kind == "transition" else mod(z, mask=pair_mask.float())
        (out * w).sum().backward()
        return out.detach(), z.grad.clone(), param_grads(mod)

    ref, ref_dz, ref_g = run()
    before = snapshot(mod)
    attn_zoo.patch(mod)
    assert is_patched(mod)
    assert_state_untouched(mod, before)
    got, got_dz, got_g = run()
    assert rel_err(got, ref) < TOL and rel_err(got_dz, ref_dz) < TOL
    assert_close_grads(mod, got_g, ref_g)
    attn_zoo.unpatch(mod)
    assert torch.equal(run()[0], ref)


def test_boltz_transition_inference_chunks_and_cuequivariance_stay_boltz_own(monkeypatch):
    """What the patch leaves to Boltz's own forwards: the transition's hidden-width chunks (eval mode with
    ``chunk_size``: its inference memory) and a triangle multiplication asked for cuEquivariance by name
    (``use_kernels``, stood in for here by a recorder of the call)."""
    tr = _boltz_update_module("transition")
    x = torch.randn(2, 5, 5, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = tr.eval()(x, chunk_size=5)
        attn_zoo.patch(tr)
        calls = []
        from attn_zoo.models.integrations import boltz as integration
        real = integration.fused_linear
        monkeypatch.setattr(integration, "fused_linear", lambda *a: calls.append(1) or real(*a))
        got = tr(x, chunk_size=5)
        assert not calls  # Boltz's own loop over chunks of the hidden width, not the fused path
        assert torch.equal(got, want)
        tr(x)
        assert calls == [1]  # without chunks: ours
    tm = pytest.importorskip("boltz.model.layers.triangular_mult", reason="boltz==2.2.1 (--no-deps) is a test dependency")
    mul = _boltz_update_module("outgoing")
    attn_zoo.patch(mul)
    seen = []
    monkeypatch.setattr(tm, "kernel_triangular_mult", lambda x, direction, mask, **kw: seen.append(direction) or x)
    _, z, _, pair_mask = boltz_inputs(c_z=8)
    assert mul(z, pair_mask.float(), use_kernels=True) is z and seen == ["outgoing"]
    with pytest.raises(ValueError, match=r"mask: expected shape \(2, 7, 7\)"):
        mul(z, pair_mask[:, :5].float())


@pytest.mark.parametrize("chunk", [2, 3, 100])
def test_boltz_triangle_attention_chunks(chunk):
    layer = boltz_layer()
    tri = layer.tri_att_end
    _, z, mask, pair_mask = boltz_inputs(N=8)
    real_pairs = mask[:, :, None] & mask[:, None, :]
    with torch.no_grad():
        ref = tri(z, mask=pair_mask.float(), chunk_size=chunk)
        attn_zoo.patch(tri)
        got = tri(z, mask=pair_mask.float(), chunk_size=chunk)
        whole = tri(z, mask=pair_mask.float())
    assert rel_err(got[real_pairs], ref[real_pairs]) < TOL
    assert torch.equal(got, whole) or rel_err(got, whole) < TOL
    zg = z.clone().requires_grad_(True)  # the chunked path under autograd too
    out = tri(zg, mask=pair_mask.float(), chunk_size=chunk)
    (out * real_pairs[..., None]).sum().backward()
    attn_zoo.unpatch(tri)
    zr = z.clone().requires_grad_(True)
    (tri(zr, mask=pair_mask.float(), chunk_size=chunk) * real_pairs[..., None]).sum().backward()
    assert rel_err(zg.grad, zr.grad) < TOL
    with pytest.raises(ValueError, match="chunk_size"):
        attn_zoo.patch(tri)(z, mask=pair_mask.float(), chunk_size=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [None, 1, 3, 100])
def test_boltz2_pairformer_layer_no_grad_in_place_equals_unpatched(chunk, backend):
    """Without autograd in eval mode the patched layer runs the memory-bounded path (z updated in place on one copy,
    rows by chunks): Boltz's outputs at real positions, its dtypes, the caller's z untouched."""
    layer = boltz_layer()
    s, z, mask, pair_mask = boltz_inputs()
    real_pairs = mask[:, :, None] & mask[:, None, :]
    z_before = z.clone()
    with torch.no_grad():
        s_ref, z_ref = layer(s, z, mask.float(), pair_mask.float(), chunk_size_tri_attn=chunk)
        attn_zoo.patch(layer, backend=backend)
        s_got, z_got = layer(s, z, mask.float(), pair_mask.float(), chunk_size_tri_attn=chunk)
    assert (s_got.dtype, z_got.dtype, z_got.shape) == (s_ref.dtype, z_ref.dtype, z_ref.shape)
    assert rel_err(s_got[mask], s_ref[mask]) < TOL and rel_err(z_got[real_pairs], z_ref[real_pairs]) < TOL
    assert torch.equal(z, z_before) and z_got.data_ptr() != z.data_ptr()
    with pytest.raises(ValueError, match="chunk_size"):
        with torch.no_grad():
            layer(s, z, mask.float(), pair_mask.float(), chunk_size_tri_attn=0)


def test_boltz2_pairformer_layer_no_grad_in_place_under_autocast_and_noseq():
    """bf16 z under CPU autocast: float32 results as Boltz's (its float32 dropout mask promotes the sums), close to
    Boltz's at bf16 precision; PairformerNoSeqLayer (template / MSA pair stacks) in place too."""
    pf = pytest.importorskip("boltz.model.layers.pairformer", reason="boltz==2.2.1 (--no-deps) is a test dependency")
    layer = boltz_layer()
    s, z, mask, pair_mask = boltz_inputs()
    real_pairs = mask[:, :, None] & mask[:, None, :]
    zb = z.bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        s_ref, z_ref = layer(s, zb, mask.float(), pair_mask.float(), chunk_size_tri_attn=3)
        attn_zoo.patch(layer)
        s_got, z_got = layer(s, zb, mask.float(), pair_mask.float(), chunk_size_tri_attn=3)
    assert (s_got.dtype, z_got.dtype) == (s_ref.dtype, z_ref.dtype) == (torch.float32, torch.float32)
    assert rel_err(s_got[mask], s_ref[mask]) < 3e-2 and rel_err(z_got[real_pairs], z_ref[real_pairs]) < 3e-2
    torch.manual_seed(0)
    noseq = randomize_(pf.PairformerNoSeqLayer(token_z=16, pairwise_head_width=16, pairwise_num_heads=2)).eval()
    with torch.no_grad():
        ref = noseq(z, pair_mask.float(), chunk_size_tri_attn=2)
        attn_zoo.patch(noseq)
        got = noseq(z, pair_mask.float(), chunk_size_tri_attn=2)
    assert "forward" in noseq.__dict__ and rel_err(got[real_pairs], ref[real_pairs]) < TOL


def test_boltz2_pairformer_layer_no_grad_keeps_a_fused_triangle_multiplication(monkeypatch):
    """``use_cuequiv_mul`` (cuEquivariance's triangle multiplication) stays Boltz's kernel, whole, added in place:
    here a stand-in for the kernel (Boltz's own unfused forward) that counts its calls."""
    tm = pytest.importorskip("boltz.model.layers.triangular_mult",
                             reason="boltz==2.2.1 (--no-deps) is a test dependency")
    layer = boltz_layer()
    s, z, mask, pair_mask = boltz_inputs()
    real_pairs = mask[:, :, None] & mask[:, None, :]
    calls = []

    def kernel(x, direction, mask, **weights):
        calls.append(direction)
        mod = layer.tri_mul_out if direction == "outgoing" else layer.tri_mul_in
        return type(mod).forward(mod, x, mask, use_kernels=False)

    monkeypatch.setattr(tm, "kernel_triangular_mult", kernel)
    with torch.no_grad():
        s_ref, z_ref = layer(s, z, mask.float(), pair_mask.float(), chunk_size_tri_attn=2, use_cuequiv_mul=True)
        attn_zoo.patch(layer)
        calls.clear()
        s_got, z_got = layer(s, z, mask.float(), pair_mask.float(), chunk_size_tri_attn=2, use_cuequiv_mul=True)
    assert calls == ["outgoing", "incoming"]
    assert rel_err(s_got[mask], s_ref[mask]) < TOL and rel_err(z_got[real_pairs], z_ref[real_pairs]) < TOL


@pytest.mark.parametrize("version", [1, 2])
def test_boltz_pair_bias_attention_multiplicity_with_grads(version):
    """Boltz-1's and Boltz-2's AttentionPairBias alone, two diffusion samples per pair bias (multiplicity 2)."""
    name = "boltz.model.layers.attention" if version == 1 else "boltz.model.layers.attentionv2"
    APB = pytest.importorskip(name, reason="boltz==2.2.1 (--no-deps) is a test dependency").AttentionPairBias
    apb = randomize_(APB(c_s=32, c_z=16, num_heads=2))
    s, z, mask, _ = boltz_inputs()
    g = torch.Generator().manual_seed(6)
    s2, mask2 = s.repeat_interleave(2, 0) + 0.1 * torch.randn(4, *s.shape[1:], generator=g), mask.repeat_interleave(2, 0)
    w = torch.randn(s2.shape, generator=g)
    kw = {} if version == 1 else {"k_in": s2}

    def run():
        apb.zero_grad(set_to_none=True)
        out = apb(s2, z, mask2.float(), multiplicity=2, **kw)
        (out * w).sum().backward()
        return out.detach(), param_grads(apb)

    ref, ref_g = run()
    attn_zoo.patch(apb)
    got, got_g = run()
    assert rel_err(got, ref) < TOL
    assert_close_grads(apb, got_g, ref_g, zero=("proj_z.0.bias",))
    with pytest.raises(ValueError, match="multiplicity"):
        apb(s2, z, mask2.float(), multiplicity=3, **kw)


def test_boltz2_msa_layer_pair_stack_patched():
    trunk = pytest.importorskip("boltz.model.modules.trunkv2", reason="boltz==2.2.1 (--no-deps) is a test dependency")
    torch.manual_seed(0)
    msa = randomize_(trunk.MSALayer(msa_s=16, token_z=16, msa_dropout=0.0, z_dropout=0.0, pairwise_head_width=16,
                                    pairwise_num_heads=2)).eval()
    _, z, mask, pair_mask = boltz_inputs()
    m = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(4))
    msa_mask = mask[:, None, :].expand(2, 3, 7).float()
    real_pairs = mask[:, :, None] & mask[:, None, :]
    with torch.no_grad():
        z_ref, m_ref = msa(z, m, pair_mask.float(), msa_mask)
        attn_zoo.patch(msa)
        z_got, m_got = msa(z, m, pair_mask.float(), msa_mask)
    # the MSA track's own transition too (Boltz's Transition, wherever it sits); its pair-weighted averaging is not
    assert sorted(n for n, mod in msa.named_modules() if "forward" in mod.__dict__) == [
        "msa_transition", "pairformer_layer", "pairformer_layer.transition_z", "pairformer_layer.tri_att_end",
        "pairformer_layer.tri_att_start", "pairformer_layer.tri_mul_in", "pairformer_layer.tri_mul_out"]
    assert rel_err(z_got[real_pairs], z_ref[real_pairs]) < TOL and rel_err(m_got, m_ref) < TOL


def test_hf_esmc_patched_equals_sdpa_with_chains_and_grads():
    tr = pytest.importorskip("transformers", reason="transformers is a test dependency")
    if not hasattr(tr, "EsmcForMaskedLM"):
        pytest.skip(f"transformers {tr.__version__} has no ESM C")
    torch.manual_seed(0)
    config = tr.EsmcConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4)
    m = randomize_(tr.EsmcForMaskedLM(config), 0).eval()
    ids = torch.randint(4, 30, (2, 9), generator=torch.Generator().manual_seed(1))
    chains = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, -1, -1, -1]])  # two chains; padding

    def run():
        m.zero_grad(set_to_none=True)
        logits = m(input_ids=ids, sequence_id=chains).logits
        real = (chains >= 0)[..., None]
        (logits * real * torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        return logits[chains >= 0].detach(), param_grads(m)

    ref, ref_g = run()
    before = snapshot(m)
    attn_zoo.patch(m)
    assert all(isinstance(layer.self_attn.__dict__.get("forward"), PatchedForward) for layer in m.esmc.layers)
    assert_state_untouched(m, before)
    got, got_g = run()
    assert rel_err(got, ref) < TOL
    assert_close_grads(m, got_g, ref_g)
    attn_zoo.unpatch(m)
    assert not any("forward" in layer.self_attn.__dict__ for layer in m.esmc.layers)
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids, sequence_id=chains).logits[chains >= 0], ref)


@pytest.mark.parametrize("family", ["esm", "esmc"])
def test_hf_fused_attention_rotary_kernels_in_interpreter(family, monkeypatch):
    """The patched self-attention's q/k rotation (and ESM C's q/k norms) on the Triton kernels themselves (the
    CPU interpreter), against the unpatched model: outputs and every gradient."""
    from test_primitives import skip_unless_backend

    skip_unless_backend("triton")
    tr = pytest.importorskip("transformers", reason="transformers is a test dependency")
    from attn_zoo.models import kernels

    rotary_qkv = kernels.rotary_qkv

    if family == "esmc":
        if not hasattr(tr, "EsmcForMaskedLM"):
            pytest.skip(f"transformers {tr.__version__} has no ESM C")
        config = tr.EsmcConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2)
        torch.manual_seed(0)
        m = randomize_(tr.EsmcForMaskedLM(config), 0).eval()
    else:
        m = hf_model()
    ids, am = hf_inputs(L=9)
    ref, ref_g = hf_run(m, ids, am)
    calls = []
    monkeypatch.setattr(kernels, "rotary_qkv",
                        lambda *a, **kw: calls.append(1) or rotary_qkv(*a, **kw, force=True))
    attn_zoo.patch(m, backend="torch")
    got, got_g = hf_run(m, ids, am)
    assert calls and rel_err(got, ref) < TOL
    assert_close_grads(m, got_g, ref_g, unused="esm.contact_head.")


def test_hf_esmc_patched_under_autocast_within_twice_sdpa():
    """ESM C's q/k LayerNorms come out float32 under autocast while v is bfloat16 (sdpa casts all three): the
    patched attention serves the mix, with an error against float32 within twice sdpa's, and trains."""
    tr = pytest.importorskip("transformers", reason="transformers is a test dependency")
    if not hasattr(tr, "EsmcForMaskedLM"):
        pytest.skip(f"transformers {tr.__version__} has no ESM C")
    config = tr.EsmcConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4)
    m = randomize_(tr.EsmcForMaskedLM(config), 0).eval()
    ids = torch.randint(4, 30, (2, 11), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 11, dtype=torch.long)
    am[1, 7:] = 0

    def run():
        return m(input_ids=ids, attention_mask=am).logits.float()[am.bool()]

    with torch.no_grad():
        ref32 = run()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref16 = run()
            attn_zoo.patch(m, backend="torch")
            got16 = run()
    assert rel_err(got16, ref32) <= 2 * rel_err(ref16, ref32) + 1e-5, (rel_err(got16, ref32), rel_err(ref16, ref32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


@pytest.mark.slow
def test_triton_interpreter_serves_fair_esm_and_boltz():
    """The fused kernels themselves (Triton's interpreter on CPU): head dims 16."""
    from test_primitives import skip_unless_backend

    skip_unless_backend("triton")
    esm2 = pytest.importorskip("esm.model.esm2", reason="fair-esm is a test dependency")
    torch.manual_seed(0)
    m = randomize_(esm2.ESM2(num_layers=1, embed_dim=32, attention_heads=2)).eval()
    tok = fair_esm_tokens(m)[1:, :9]  # one sequence with holes, one padded at the end
    with torch.no_grad():
        ref = m(tok)["logits"]
        attn_zoo.patch(m, backend="triton")
        assert rel_err(m(tok)["logits"], ref) < TOL
    tri = boltz_layer().tri_att_start
    _, z, mask, pair_mask = boltz_inputs(N=6)
    real_pairs = mask[:, :, None] & mask[:, None, :]
    with torch.no_grad():
        ref = tri(z, mask=pair_mask.float())
        attn_zoo.patch(tri, backend="triton")
        got = tri(z, mask=pair_mask.float())
    assert rel_err(got[real_pairs], ref[real_pairs]) < TOL


@pytest.mark.slow
def test_bench_patch_script_runs(tmp_path):
    """scripts/bench_patch.py at tiny shapes on CPU: every row timed, every patched row close to its reference."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_patch

    rows = bench_patch.main(["--smoke", "--out", str(tmp_path), "--iters", "1", "--warmup", "1",
                             "--cases", "hf-esm2", "boltz2-pairformer"])
    assert rows and all(r.get("ms") and not r.get("note") for r in rows), rows
    patched = [r for r in rows if r["variant"] in ("attn_zoo", "patched")]
    assert len(patched) == len(rows) // 2 and all(float(r["diff_vs_unpatched"]) < 5e-2 for r in patched)
    assert (tmp_path / "patch.md").read_text().count("| hf-esm2 |") == 4


def test_wrapper_holding_several_projects_models():
    """A model of the user's holding a transformers model and a fair-esm model: both patched, both restored."""
    hf, fair = hf_model(), fair_esm_model()
    wrapper = nn.ModuleDict({"hf": hf, "fair": fair})
    ids, am = hf_inputs()
    tok = fair_esm_tokens(fair)
    with torch.no_grad():
        ref_hf, ref_fair = hf(input_ids=ids, attention_mask=am).logits, fair(tok)["logits"]
        attn_zoo.patch(wrapper, backend="torch")
        assert hf.config._attn_implementation == "attn_zoo_torch" and is_patched(fair) and is_patched(wrapper)
        assert rel_err(hf(input_ids=ids, attention_mask=am).logits, ref_hf) < TOL
        assert rel_err(fair(tok)["logits"], ref_fair) < TOL
        attn_zoo.unpatch(wrapper)
        assert not is_patched(wrapper) and hf.config._attn_implementation == "sdpa"
        assert torch.equal(hf(input_ids=ids, attention_mask=am).logits, ref_hf)
        assert torch.equal(fair(tok)["logits"], ref_fair)


# --------------------------------------------------------------------------------------------------
# OpenFold (not on PyPI; runs where it is installed)
# --------------------------------------------------------------------------------------------------
def openfold_block(seed=0):
    evo = pytest.importorskip("openfold.model.evoformer", reason="OpenFold is installed from source only")
    torch.manual_seed(seed)
    blk = evo.EvoformerBlock(c_m=16, c_z=16, c_hidden_msa_att=8, c_hidden_opm=4, c_hidden_mul=16,
                             c_hidden_pair_att=8, no_heads_msa=2, no_heads_pair=2, transition_n=2, msa_dropout=0.0,
                             pair_dropout=0.0, no_column_attention=False, opm_first=False,
                             fuse_projection_weights=False, inf=1e9, eps=1e-8)
    return randomize_(blk, seed).eval()


def openfold_inputs(B=2, S=3, N=7, seed=0):
    """m, z; an MSA mask with a residue hole and end padding (and one padded sequence), the pair mask from it."""
    g = torch.Generator().manual_seed(seed)
    m, z = torch.randn(B, S, N, 16, generator=g), torch.randn(B, N, N, 16, generator=g)
    res = torch.ones(B, N, dtype=torch.bool)
    res[0, 3] = False
    res[1, N - 2:] = False
    msa_mask = res[:, None, :].expand(B, S, N).clone()
    msa_mask[1, -1] = False  # a padded sequence
    pair_mask = res[:, :, None] & res[:, None, :]
    return m, z, msa_mask, pair_mask, res


def openfold_run(blk, m, z, msa_mask, pair_mask, res, seed=5, **kw):
    blk.zero_grad(set_to_none=True)
    m_out, z_out = blk(m, z, msa_mask.float(), pair_mask.float(), **kw)
    real_m = msa_mask & res[:, None, :]
    real_z = res[:, :, None] & res[:, None, :]
    g = torch.Generator().manual_seed(seed)
    if torch.is_grad_enabled():
        loss = (m_out * torch.randn(m_out.shape, generator=g) * real_m[..., None]).sum()
        (loss + (z_out * torch.randn(z_out.shape, generator=g) * real_z[..., None]).sum()).backward()
    return m_out[real_m].detach(), z_out[real_z].detach(), param_grads(blk)


@pytest.mark.parametrize("backend", BACKENDS)
def test_openfold_evoformer_block_patched_equals_unpatched_with_grads(backend):
    blk = openfold_block()
    x = openfold_inputs()
    m_ref, z_ref, g_ref = openfold_run(blk, *x)
    before = snapshot(blk)
    attn_zoo.patch(blk, backend=backend)
    assert sorted(n for n, mod in blk.named_modules() if "forward" in mod.__dict__) == [
        "msa_att_col._msa_att", "msa_att_row", "pair_stack.tri_att_end", "pair_stack.tri_att_start"]
    assert_state_untouched(blk, before)
    m_got, z_got, g_got = openfold_run(blk, *x)
    assert rel_err(m_got, m_ref) < TOL and rel_err(z_got, z_ref) < TOL
    assert_close_grads(blk, g_got, g_ref, zero=("layer_norm_z.bias",))
    with torch.no_grad():  # OpenFold's inference chunking
        m_ch, z_ch, _ = openfold_run(blk, *x, chunk_size=2)
    assert rel_err(m_ch, m_ref) < TOL and rel_err(z_ch, z_ref) < TOL
    attn_zoo.unpatch(blk)
    m_back, z_back, _ = openfold_run(blk, *x)
    assert torch.equal(m_back, m_ref) and torch.equal(z_back, z_ref)


# --------------------------------------------------------------------------------------------------
# GPU: the triton kernels in bf16, error bounded by the unpatched model's own bf16 error
# --------------------------------------------------------------------------------------------------
def _gpu_case(case):
    """(model on CUDA, fn() -> output at real positions) for one project, at sizes with head dims 16."""
    g = torch.Generator().manual_seed(11)
    if case == "fair-esm":
        esm2 = pytest.importorskip("esm.model.esm2", reason="fair-esm is a test dependency")
        m = randomize_(esm2.ESM2(num_layers=2, embed_dim=64, attention_heads=4)).cuda().eval()
        tok = torch.randint(4, 24, (3, 40), generator=g)
        tok[:, 0], tok[1, 10:13], tok[2, 30:] = m.cls_idx, m.padding_idx, m.padding_idx
        tok = tok.cuda()
        return m, lambda: m(tok)["logits"][tok != m.padding_idx]
    if case == "hf":
        m = hf_model().cuda()
        ids, am = (t.cuda() for t in hf_inputs(L=40))
        return m, lambda: m(input_ids=ids, attention_mask=am).logits[am.bool()]
    layer = boltz_layer().cuda()
    # boltz-odd: the triangle products' rows padded from 67 to 72 (models.triangle.gemm_pad)
    s, z, mask, pair_mask = (t.cuda() for t in boltz_inputs(N=67 if case == "boltz-odd" else 40))
    real = mask[:, :, None] & mask[:, None, :]
    return layer, lambda: layer(s, z, mask.float(), pair_mask.float())[1][real]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fair-esm", "hf", "boltz", "boltz-odd"])
def test_gpu_triton_bf16_error_within_twice_unpatched(case):
    model, run = _gpu_case(case)
    with torch.no_grad():
        ref32 = run().float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref16 = run().float()
            attn_zoo.patch(model, backend="triton")
            got16 = run().float()
    assert rel_err(got16, ref32) <= 2 * rel_err(ref16, ref32) + 1e-5, (rel_err(got16, ref32), rel_err(ref16, ref32))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        run().float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
