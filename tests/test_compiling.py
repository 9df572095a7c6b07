"""compile_module: torch.compile with the Inductor setting the blocks need across lengths."""
import pytest
import torch

from attn_zoo.models.compiling import INDUCTOR_OPTIONS, compile_module, compile_options


def test_options_carry_the_setting_and_translate_modes():
    assert compile_options() == INDUCTOR_OPTIONS
    ro = compile_options("reduce-overhead")
    assert ro["triton.cudagraphs"] is True and ro["triton.coalesce_tiling_analysis"] is False
    # the caller's own options win over ours
    assert compile_options(options={"triton.coalesce_tiling_analysis": True})["triton.coalesce_tiling_analysis"]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mode 'fastest'"):
        compile_options("fastest")
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        compile_module(lambda x: x)


def test_options_reach_torch_compile(monkeypatch):
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda module, **kw: seen.update(kw) or module)
    m = torch.nn.Linear(2, 2)
    assert compile_module(m, mode="reduce-overhead", dynamic=True) is m
    assert "mode" not in seen and seen["dynamic"] is True
    assert seen["options"]["triton.cudagraphs"] and seen["options"]["triton.coalesce_tiling_analysis"] is False
    seen.clear()
    compile_module(m, backend="eager", mode="default")  # no Inductor options for another backend
    assert seen == {"backend": "eager", "mode": "default"}


def test_in_place_keeps_the_module_and_its_keys(monkeypatch):
    seen = {}
    m = torch.nn.Linear(2, 2)
    monkeypatch.setattr(m, "compile", lambda **kw: seen.update(kw))
    keys = list(m.state_dict())
    assert compile_module(m, in_place=True) is m and list(m.state_dict()) == keys
    assert seen["options"] == INDUCTOR_OPTIONS


@pytest.mark.slow
def test_triangle_update_compiles_through_lengths_on_cpu():
    """The wiring end to end on the CPU's Inductor: two lengths, the second symbolic, equal to eager."""
    from attn_zoo.models.triangle import TriangleMultiplicationOutgoing

    torch.manual_seed(0)
    m = TriangleMultiplicationOutgoing(8, 8)
    torch.nn.init.normal_(m.linear_z.weight)
    c = compile_module(m)
    for n in (9, 13):
        z = torch.randn(1, n, n, 8)
        torch.testing.assert_close(c(z), m(z), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["esm2", "esmc", "transformer"])
def test_language_models_trace_as_one_graph_with_padding(model):
    """ESM-2, ESM C and the transformer LM, in training with a padded batch: Dynamo sees one graph, no break (a
    data-dependent branch such as "is anything padded?" would split the step and sync the host)."""
    from attn_zoo.models.esm2 import ESM2
    from attn_zoo.models.esmc import ESMC
    from attn_zoo.models.transformer import TransformerLM

    torch.manual_seed(0)
    tok = torch.randint(4, 24, (2, 12))
    tok[1, 8:] = 1  # padding (index 1 in both ESM alphabets)
    if model == "esm2":
        m, run = ESM2(num_layers=2, embed_dim=32, attention_heads=4, attention="torch"), lambda: m(tok)["logits"]
    elif model == "esmc":
        m, run = ESMC(num_layers=2, width=32, heads=4, attention="torch"), lambda: m(tok)["logits"]
    else:
        m = TransformerLM(33, 32, 2, 4, causal=False, attention="torch")
        run = lambda: m(tok, pad_mask=tok != 1)  # noqa: E731
    m.train()
    explained = torch._dynamo.explain(lambda: run().float().sum())()
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1
