"""relpos.models: config, LM with cache and generation, encoder, absolute baselines."""

from __future__ import annotations

import json

import pytest
import torch

import relpos
from relpos.models import (
    ModelConfig,
    RelativeTransformerEncoderModel,
    RelativeTransformerLM,
    build_model,
)

F64 = torch.float64
POSITIONS = ["relative", "learned", "sinusoidal", "none"]


def _lm(positions: str = "relative", **kw) -> RelativeTransformerLM:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=31, d_model=24, num_heads=3, num_layers=2, max_distance=3,
                      positions=positions, max_length=64, **kw)
    model = build_model(cfg).to(F64).eval()
    assert isinstance(model, RelativeTransformerLM)
    return model


# ----------------------------------------------------------------------------- config
def test_config_round_trip_and_defaults():
    cfg = ModelConfig(vocab_size=100, share_heads=False, positions="learned", num_classes=5)
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert ModelConfig.from_dict(d) == cfg
    assert ModelConfig(vocab_size=10).ffn_dim == 4 * 64
    assert ModelConfig(vocab_size=10, dim_feedforward=7).ffn_dim == 7
    assert set(d) == {
        "vocab_size", "d_model", "num_layers", "num_heads", "dim_feedforward", "max_distance",
        "relative_keys", "relative_values", "share_heads", "positions", "max_length",
        "dropout", "causal", "num_classes",
    }


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(vocab_size=0), ValueError, "vocab_size"),
        (dict(vocab_size=10.0), TypeError, "vocab_size"),
        (dict(vocab_size=10, d_model=30, num_heads=4), ValueError, "divisible"),
        (dict(vocab_size=10, num_layers=0), ValueError, "num_layers"),
        (dict(vocab_size=10, max_distance=-1), ValueError, "max_distance"),
        (dict(vocab_size=10, max_distance=True), TypeError, "max_distance"),
        (dict(vocab_size=10, positions="absolute"), ValueError, "'relative', 'learned'"),
        (dict(vocab_size=10, relative_keys=False, relative_values=False), ValueError, "none"),
        (dict(vocab_size=10, dropout=1.0), ValueError, "dropout"),
        (dict(vocab_size=10, num_classes=0), ValueError, "num_classes"),
        (dict(vocab_size=10, causal="yes"), TypeError, "causal"),
        (dict(vocab_size=10, dim_feedforward=0), ValueError, "dim_feedforward"),
        (dict(vocab_size=10, max_length=0), ValueError, "max_length"),
    ],
)
def test_bad_config_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        ModelConfig(**kwargs)


def test_from_dict_errors():
    with pytest.raises(ValueError, match=r"unknown ModelConfig keys \['heads'\]; allowed"):
        ModelConfig.from_dict({"vocab_size": 3, "heads": 2})
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_dict({"d_model": 8})
    with pytest.raises(TypeError, match="dict"):
        ModelConfig.from_dict([("vocab_size", 3)])
    with pytest.raises(ValueError, match="d_model"):
        ModelConfig.from_dict({"vocab_size": 3, "d_model": -1})


def test_build_model_picks_the_class():
    assert isinstance(build_model(ModelConfig(vocab_size=5)), RelativeTransformerLM)
    enc = build_model(ModelConfig(vocab_size=5, causal=False))
    assert isinstance(enc, RelativeTransformerEncoderModel)
    with pytest.raises(ValueError, match="causal=True"):
        RelativeTransformerLM(ModelConfig(vocab_size=5, causal=False))
    with pytest.raises(TypeError, match="ModelConfig"):
        build_model({"vocab_size": 5})  # type: ignore[arg-type]
    assert relpos.models.build_model is build_model


# ----------------------------------------------------------------------------- LM
@pytest.mark.parametrize("positions", POSITIONS)
def test_lm_shapes_causality_and_cache(positions):
    model = _lm(positions)
    ids = torch.randint(0, 31, (2, 14))
    logits = model(ids)
    assert logits.shape == (2, 14, 31) and logits.dtype == F64
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 31
    torch.testing.assert_close(model(changed)[:, :9], logits[:, :9], atol=1e-12, rtol=0)
    with torch.no_grad():
        cache = model.new_cache()
        steps = [model(ids[:, :5], cache=cache)]
        steps += [model(ids[:, i : i + 1], cache=cache) for i in range(5, 9)]
        steps.append(model(ids[:, 9:], cache=cache))
    assert cache.length == 14
    torch.testing.assert_close(torch.cat(steps, dim=1), logits, atol=1e-10, rtol=0)


def test_absolute_baselines_have_no_relative_terms():
    for positions in ("learned", "sinusoidal", "none"):
        model = _lm(positions)
        for layer in model.layers:
            assert layer.self_attn.rel_keys is None and layer.self_attn.rel_values is None
        assert (model.pos_embed is not None) == (positions == "learned")
    rel = _lm("relative", relative_values=False, share_heads=False)
    attn = rel.layers[0].self_attn
    assert attn.rel_keys is not None and attn.rel_keys.shape == (3, 7, 8)
    assert attn.rel_values is None
    assert rel.pos_embed is None


def test_learned_positions_refuse_long_inputs_and_position_matters():
    model = _lm("learned")
    with pytest.raises(ValueError, match="max_length=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.zeros(1, 60, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="max_length=64"):
            model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    assert cache.length == 60  # the refused step changed nothing
    # Absolute positions: the same token at two positions gets different logits; the
    # relative model with no context (K-clipped, identical tokens) cannot tell them apart.
    same = torch.full((1, 6), 3)
    assert not torch.allclose(model(same)[0, 4], model(same)[0, 5])
    none = _lm("none")
    torch.testing.assert_close(none(same)[0, 4], none(same)[0, 5], atol=1e-12, rtol=0)


def test_relative_lm_runs_past_any_training_length():
    model = _lm("relative")
    assert model(torch.randint(0, 31, (1, 300))).shape == (1, 300, 31)


def test_tied_output_head():
    model = _lm()
    assert model.head is None
    names = [n for n, _ in model.named_parameters()]
    assert not any("head" in n for n in names)
    with torch.no_grad():
        model.embed.weight[7].zero_()
    ids = torch.randint(0, 7, (2, 5))  # token 7 absent from the input
    logits = model(ids)
    assert torch.all(logits[..., 7] == 0)  # its logit is h . embed[7]
    model.embed.weight.grad = None
    model(ids)[..., 8].sum().backward()
    assert model.embed.weight.grad is not None and model.embed.weight.grad[8].abs().sum() > 0
    separate = _lm(num_classes=4)
    assert separate(ids).shape == (2, 5, 4) and separate.head is not None


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (torch.zeros(2, 3), TypeError, "integer dtype"),
        (torch.zeros(3, dtype=torch.long), ValueError, r"\(B, L\)"),
        (torch.zeros(2, 0, dtype=torch.long), ValueError, r"\(B, L\)"),
        (torch.tensor([[0, 31]]), ValueError, r"\[0, vocab_size=31\), got values in \[0, 31\]"),
        (torch.tensor([[-1, 3]]), ValueError, "vocab_size"),
        ([[1, 2]], TypeError, "torch.Tensor"),
    ],
)
def test_bad_ids(bad, error, match):
    model = _lm()
    with pytest.raises(error, match=match):
        model(bad)


def test_bad_key_mask_and_cache_and_refused_steps_leave_cache_unchanged():
    model = _lm()
    ids = torch.randint(0, 31, (2, 4))
    with pytest.raises(TypeError, match="bool"):
        model(ids, key_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="shape of ids"):
        model(ids, key_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="layers"):
        model(ids, cache=relpos.KVCache(3))
    with pytest.raises(TypeError, match="KVCache"):
        model(ids, cache=relpos.LayerCache())  # type: ignore[arg-type]
    cache = model.new_cache(capacity=6, growable=False)
    with torch.no_grad():
        model(ids, cache=cache)
        snap = [(layer.keys.clone(), layer.values.clone()) for layer in cache]  # type: ignore[union-attr]
        for bad in (torch.randint(0, 31, (2, 3)),  # past the capacity
                    torch.randint(0, 31, (3, 1)),  # batch mismatch
                    torch.tensor([[40], [1]])):  # out of vocabulary
            with pytest.raises(ValueError):
                model(bad, cache=cache)
        assert cache.length == 4
        for layer, (k, v) in zip(cache, snap, strict=True):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)  # type: ignore[arg-type]


def test_left_padded_prompts_decode_like_unpadded():
    model = _lm()
    prompt = torch.randint(0, 31, (2, 7))
    key_mask = torch.ones(2, 7, dtype=torch.bool)
    key_mask[1, :3] = False  # row 1 is a 4-token prompt, left-padded
    out = model.generate(prompt, 5, top_k=1, key_mask=key_mask)
    alone = model.generate(prompt[1:, 3:], 5, top_k=1)
    assert torch.equal(out[1:, 7:], alone[:, 4:])
    assert torch.equal(out[:1], model.generate(prompt[:1], 5, top_k=1))


# ----------------------------------------------------------------------------- generation
def test_generate_greedy_equals_argmax_of_full_forward():
    model = _lm()
    prompt = torch.randint(0, 31, (3, 4))
    out = model.generate(prompt, 8, top_k=1)
    assert out.shape == (3, 12) and torch.equal(out[:, :4], prompt)
    logits = model(out[:, :-1])
    assert torch.equal(logits[:, 3:].argmax(-1), out[:, 4:])
    assert torch.equal(model.generate(prompt, 8, temperature=0.0), out)


def test_generate_reproducible_with_generator_and_restores_mode():
    model = _lm("sinusoidal")
    model.train()
    prompt = torch.randint(0, 31, (2, 3))
    a = model.generate(prompt, 10, top_k=5, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 10, top_k=5, generator=torch.Generator().manual_seed(1))
    c = model.generate(prompt, 10, temperature=2.0, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and c.shape == a.shape
    assert model.training
    # top_k=5: every sampled token is among the 5 most likely under a full forward pass
    logits = model.eval()(a[:, :-1])[:, 2:]
    top5 = logits.topk(5, dim=-1).indices
    assert torch.all((top5 == a[:, 3:, None]).any(-1))
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_generate_bad_arguments():
    model = _lm()
    prompt = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, -1)
    with pytest.raises(TypeError, match="max_new_tokens"):
        model.generate(prompt, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, 2, top_k=0)
    with pytest.raises(TypeError, match="Generator"):
        model.generate(prompt, 2, generator=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_classes"):
        _lm(num_classes=3).generate(prompt, 2)
    with pytest.raises(ValueError, match="max_length"):
        _lm("learned").generate(prompt, 63)


# ----------------------------------------------------------------------------- encoder
@pytest.mark.parametrize("positions", POSITIONS)
def test_encoder_shapes_pooling_and_bidirectional(positions):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=20, d_model=16, num_heads=2, causal=False, num_classes=3,
                      max_distance=2, positions=positions, max_length=32)
    model = build_model(cfg).to(F64).eval()
    ids = torch.randint(0, 20, (2, 9))
    per_token = model(ids)
    assert per_token.shape == (2, 9, 3)
    assert model(ids, pool="mean").shape == (2, 3) and model(ids, pool="first").shape == (2, 3)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 20
    assert not torch.allclose(model(changed)[:, 0], per_token[:, 0])  # sees the future
    # padding is neither attended nor pooled
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[:, 6:] = False
    padded = model(ids, key_mask=key_mask, pool="mean")
    other = ids.clone()
    other[:, 6:] = 0
    torch.testing.assert_close(model(other, key_mask=key_mask, pool="mean"), padded,
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(model(ids[:, :6], pool="mean"), padded, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="cache"):
        model(ids, cache=relpos.KVCache(2))
    with pytest.raises(ValueError, match="pool"):
        model(ids, pool="max")  # type: ignore[arg-type]


def test_encoder_tied_head_and_dropout_trains():
    cfg = ModelConfig(vocab_size=12, d_model=16, num_heads=2, causal=False, dropout=0.1)
    model = build_model(cfg)
    ids = torch.randint(0, 12, (3, 5))
    logits = model(ids)
    assert logits.shape == (3, 5, 12)
    logits.logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
