"""relpos.integrations.transformers: real transformers models (small random-weight configs,
nothing downloaded) give the same outputs and gradients patched as unpatched."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertModel, Wav2Vec2BertConfig, Wav2Vec2BertModel  # noqa: E402

import relpos.integrations.transformers as hf  # noqa: E402

F64 = torch.float64


def _w2v_bert(attn: str = "sdpa", dtype: torch.dtype = F64, **overrides: object):
    torch.manual_seed(0)
    options = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        position_embeddings_type="relative_key", left_max_position_embeddings=6,
        right_max_position_embeddings=2, feature_projection_input_dim=16,
        conv_depthwise_kernel_size=3, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, apply_spec_augment=False,
    )
    options.update(overrides)
    config = Wav2Vec2BertConfig(**options)
    config._attn_implementation = attn
    return Wav2Vec2BertModel(config).to(dtype).eval()


def _inputs(dtype: torch.dtype = F64, frames: int = 23):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, frames, 16, generator=g).to(dtype)
    mask = torch.ones(3, frames, dtype=torch.long)
    mask[1, frames - 6 :] = 0  # a ragged batch
    mask[2, frames - 1 :] = 0
    return x, mask


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(("dtype", "tol"), [(F64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("padded", [False, True])
def test_patched_model_gives_the_same_outputs(attn, dtype, tol, padded):
    stock = _w2v_bert(attn, dtype)
    patched = copy.deepcopy(stock)
    assert hf.patch(patched) == 2
    x, mask = _inputs(dtype)
    kw = dict(attention_mask=mask) if padded else {}
    torch.testing.assert_close(patched(x, **kw).last_hidden_state,
                               stock(x, **kw).last_hidden_state, rtol=0, atol=tol)


def test_long_input_goes_through_the_native_backend(monkeypatch):
    stock = _w2v_bert()
    patched = copy.deepcopy(stock)
    hf.patch(patched)
    seen: list[dict] = []
    real = hf.relative_attention

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "relative_attention", spy)
    x, mask = _inputs(frames=1100)
    torch.testing.assert_close(patched(x, attention_mask=mask).last_hidden_state,
                               stock(x, attention_mask=mask).last_hidden_state, rtol=0, atol=1e-10)
    assert len(seen) == 2 and all(kw["attn_mask"] is None for kw in seen)  # padding as key_mask
    import relpos
    q = torch.randn(3, 4, 1100, 8, dtype=F64)
    assert relpos.select_backend(q, q, q, max_distance=(6, 2), key_mask=seen[0]["key_mask"],
                                 rel_keys=torch.randn(9, 8, dtype=F64)) == "native"


def test_gradients_are_the_same():
    stock = _w2v_bert().train()
    patched = copy.deepcopy(stock)
    hf.patch(patched)
    x, mask = _inputs()
    grads = []
    for model in (stock, patched):
        xx = x.clone().requires_grad_(True)
        model.zero_grad()
        torch.manual_seed(5)  # training mode draws random numbers: the same for both
        model(xx, attention_mask=mask).last_hidden_state.square().sum().backward()
        grads.append([xx.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    assert stock.encoder.layers[0].self_attn.distance_embedding.weight.grad.abs().sum() > 0


def test_state_dict_and_save_load_round_trip(tmp_path):
    stock = _w2v_bert()
    patched = copy.deepcopy(stock)
    hf.patch(patched)
    a, b = stock.state_dict(), patched.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    patched.save_pretrained(tmp_path)
    stock.save_pretrained(tmp_path / "stock")
    # The stock checkpoint: its config says nothing of relpos (loadable without it) ...
    assert (tmp_path / "config.json").read_text() == (tmp_path / "stock/config.json").read_text()
    loaded = Wav2Vec2BertModel.from_pretrained(tmp_path, torch_dtype=F64).eval()
    assert not hf.is_patched(loaded)  # ... so a stock model: patch it again after loading
    assert hf.patch(loaded) == 2 and hf.is_patched(loaded)
    x, mask = _inputs()
    torch.testing.assert_close(loaded(x, attention_mask=mask).last_hidden_state,
                               stock(x, attention_mask=mask).last_hidden_state, rtol=0, atol=1e-10)


def test_attention_weights_when_asked():
    stock = _w2v_bert("eager")
    patched = copy.deepcopy(stock)
    hf.patch(patched)
    x, mask = _inputs()
    want = stock(x, attention_mask=mask, output_attentions=True).attentions
    got = patched(x, attention_mask=mask, output_attentions=True).attentions
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def _seamless_encoder(**overrides: object):
    from transformers import SeamlessM4Tv2Config
    from transformers.models.seamless_m4t_v2.modeling_seamless_m4t_v2 import (
        SeamlessM4Tv2SpeechEncoder,
    )

    torch.manual_seed(0)
    options = dict(
        hidden_size=32, speech_encoder_layers=2, speech_encoder_attention_heads=4,
        speech_encoder_intermediate_size=64, feature_projection_input_dim=16,
        conv_depthwise_kernel_size=3, position_embeddings_type="relative_key",
        left_max_position_embeddings=5, right_max_position_embeddings=2,
        speech_encoder_dropout=0.0, dropout=0.0, add_adapter=False, speech_encoder_layerdrop=0.0)
    options.update(overrides)
    return SeamlessM4Tv2SpeechEncoder(SeamlessM4Tv2Config(**options)).to(F64).eval()


@pytest.mark.parametrize("model", ["w2v-bert", "seamless-m4t-v2"])
@pytest.mark.parametrize("asked_by", ["config", "call"])
def test_attention_outputs(model, asked_by):
    """transformers' own test_attention_outputs: one map per layer, (B, H, L, S), asked for by
    the config (transformers 5.x records them with hooks and does not pass the flag down) or
    by the call; the same maps as stock eager attention."""
    stock = _w2v_bert("eager") if model == "w2v-bert" else _seamless_encoder(
        attn_implementation="eager")
    patched = copy.deepcopy(stock)
    assert hf.patch(patched) == 2
    x, mask = _inputs()
    if model != "w2v-bert":
        # Stock SeamlessM4T v2 eager attention (transformers 5.25) adds its bool padding mask
        # to the scores (+1 where visible) instead of hiding the padded keys: no padding here.
        mask = torch.ones_like(mask)
    kw: dict = dict(attention_mask=mask)
    if asked_by == "config":
        stock.config.output_attentions = patched.config.output_attentions = True
    else:
        kw["output_attentions"] = True
    want, got = stock(x, **kw).attentions, patched(x, **kw).attentions
    assert len(got) == len(want) == 2
    for w, g in zip(want, got, strict=True):
        assert g.shape == (3, 4, 23, 23)
        real = mask.bool()  # rows of real frames (padded queries: see the chunked test)
        torch.testing.assert_close(g.transpose(1, 2)[real], w.transpose(1, 2)[real],
                                   rtol=0, atol=1e-10)
    # The call's False wins over the config's True, as in transformers.
    if asked_by == "config":
        assert not patched(x, attention_mask=mask, output_attentions=False).attentions


def test_retain_grad_hidden_states_attentions():
    """transformers' own test: with the config asking for hidden states and attentions, both
    are part of the graph and get gradients."""
    model = _w2v_bert("eager").train()
    hf.patch(model)
    model.config.output_hidden_states = True
    model.config.output_attentions = True
    x, _ = _inputs()
    outputs = model(x)
    hidden_states, attentions = outputs.hidden_states[0], outputs.attentions[0]
    hidden_states.retain_grad()
    attentions.retain_grad()
    outputs.last_hidden_state.flatten()[0].backward(retain_graph=True)
    assert hidden_states.grad is not None and attentions.grad is not None
    assert attentions.grad.abs().sum() > 0


@pytest.mark.parametrize("model", ["w2v-bert", "seamless-m4t-v2"])
def test_transformers_before_5_16_without_scaling(model):
    """transformers 5.0-5.15 attention modules have no ``scaling`` (they divide both score
    terms by sqrt(head_size)): a patched one computes that scale and gives stock's numbers."""
    stock = _w2v_bert() if model == "w2v-bert" else _seamless_encoder()
    patched = copy.deepcopy(stock)
    assert hf.patch(patched) == 2
    for module in patched.modules():
        if hf.is_patched(module) and "scaling" in vars(module):
            del module.scaling  # as built by transformers 5.0-5.15
    assert not any(hasattr(m, "scaling") for m in patched.modules())
    x, mask = _inputs()
    torch.testing.assert_close(patched(x, attention_mask=mask).last_hidden_state,
                               stock(x, attention_mask=mask).last_hidden_state, rtol=0, atol=1e-10)


def test_torch_save_and_load_keep_the_patch(tmp_path):
    stock = _w2v_bert()
    patched = copy.deepcopy(stock)
    hf.patch(patched)
    x, mask = _inputs()
    before = patched(x, attention_mask=mask).last_hidden_state
    torch.save(patched, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert hf.is_patched(loaded)
    attention = loaded.encoder.layers[0].self_attn
    assert attention.forward.func is hf._relpos_forward and attention.forward.args == (attention,)
    after = loaded(x, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch.testing.assert_close(after, stock(x, attention_mask=mask).last_hidden_state,
                               rtol=0, atol=1e-10)


def test_seamless_m4t_v2_speech_encoder():
    stock = _seamless_encoder()
    patched = copy.deepcopy(stock)
    assert hf.patch(patched) == 2
    x, mask = _inputs()
    torch.testing.assert_close(patched(x, attention_mask=mask).last_hidden_state,
                               stock(x, attention_mask=mask).last_hidden_state, rtol=0, atol=1e-10)


def test_seamless_m4t_v2_chunked_attention_with_padding():
    """What the README says: real frames equal stock; a padded frame whose chunk holds no
    real key (its query sees none) is zeros in relpos's attention, where stock differs."""
    from transformers import SeamlessM4Tv2Config
    from transformers.models.seamless_m4t_v2.modeling_seamless_m4t_v2 import (
        SeamlessM4Tv2SpeechEncoder,
    )

    torch.manual_seed(0)
    config = SeamlessM4Tv2Config(
        hidden_size=32, speech_encoder_layers=1, speech_encoder_attention_heads=4,
        speech_encoder_intermediate_size=64, feature_projection_input_dim=16,
        conv_depthwise_kernel_size=3, position_embeddings_type="relative_key",
        left_max_position_embeddings=5, right_max_position_embeddings=2,
        speech_encoder_dropout=0.0, dropout=0.0, add_adapter=False, speech_encoder_layerdrop=0.0,
        speech_encoder_chunk_size=4, speech_encoder_left_chunk_num=0)
    stock = SeamlessM4Tv2SpeechEncoder(config).to(F64).eval()
    patched = copy.deepcopy(stock)
    hf.patch(patched)
    x, mask = _inputs()  # row 1: its last 6 frames are padding, a whole chunk of them
    got = patched(x, attention_mask=mask).last_hidden_state
    want = stock(x, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-12)
    assert not torch.allclose(got[~real], want[~real], atol=1e-6)


def _forwards(model: torch.nn.Module) -> list[object]:
    return [m.forward for m in model.modules()]


@pytest.mark.parametrize("kind", ["rotary", "relative", None])
def test_unsupported_configurations_are_refused_and_nothing_is_patched(kind):
    model = _w2v_bert(position_embeddings_type=kind)
    before = _forwards(model)
    with pytest.raises(ValueError, match=r"relpos|no attention") as err:
        hf.patch(model)
    assert "relative_key" in str(err.value)
    assert _forwards(model) == before and not hf.is_patched(model)


def test_models_without_supported_attention_and_non_models_are_refused():
    bert = BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32, vocab_size=50))
    with pytest.raises(ValueError, match="BertModel has no attention relpos can serve"):
        hf.patch(bert)
    with pytest.raises(TypeError, match="got str"):
        hf.patch("facebook/w2v-bert-2.0")  # type: ignore[arg-type]


def test_patched_model_with_a_mask_compiles_with_fullgraph():
    """The mask conversion has no data-dependent branch, so the patched model compiles as
    one graph, like the stock one."""
    stock = _w2v_bert(dtype=torch.float32)
    patched = copy.deepcopy(stock)
    hf.patch(patched)
    x, mask = _inputs(torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        got = compiled(x, attention_mask=mask).last_hidden_state
        want = stock(x, attention_mask=mask).last_hidden_state
    valid = mask.bool()[..., None].expand_as(want)  # padded frames: see test above
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-5)
