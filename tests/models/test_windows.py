"""Windows ``max_distance=(left, right)`` in the models: the config takes and round-trips the
pair, every layer gets it, cached decoding and generation equal one full pass."""

from __future__ import annotations

import json

import pytest
import torch

from relpos.models import (
    ModelConfig,
    RelativeTransformerEncoderModel,
    RelativeTransformerLM,
    build_model,
)

F64 = torch.float64


def _lm(window, **kwargs):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=13, d_model=12, num_heads=3, num_layers=2,
                      max_distance=window, **kwargs)
    return RelativeTransformerLM(cfg).to(F64).eval()


@pytest.mark.parametrize("window", [(5, 2), [5, 2], (0, 0), (64, 8)])
def test_config_takes_and_round_trips_a_window(window):
    cfg = ModelConfig(vocab_size=10, max_distance=window)
    assert cfg.max_distance == tuple(window) and isinstance(cfg.max_distance, tuple)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    through_json = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert through_json == cfg and through_json.max_distance == tuple(window)
    model = build_model(cfg)
    left, right = window
    for layer in model.layers:
        assert layer.self_attn.max_distance == (left, right)
        assert layer.self_attn.rel_keys.shape == (left + right + 1, 16)
    assert ModelConfig(vocab_size=10, max_distance=4).max_distance == 4


@pytest.mark.parametrize(("window", "error", "fragment"), [
    ((1, 2, 3), ValueError, "3 values"),
    ((-1, 2), ValueError, r"max_distance\[0\] \(left\) must be >= 0"),
    ((1, 2.0), TypeError, r"max_distance\[1\] \(right\)"),
    ("8", TypeError, "pair"),
    (True, TypeError, "max_distance"),
])
def test_bad_config_windows(window, error, fragment):
    with pytest.raises(error, match=fragment):
        ModelConfig(vocab_size=10, max_distance=window)


@pytest.mark.parametrize("window", [(5, 2), (3, 0), (0, 3), (40, 1)])
def test_lm_cached_decoding_equals_full_pass(window):
    model = _lm(window)
    ids = torch.randint(0, 13, (2, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        for sizes in ([1] * 15, [7, 1, 3, 4], [4, 4, 4, 3]):
            cache, outs, pos = model.new_cache(), [], 0
            for size in sizes:
                outs.append(model(ids[:, pos : pos + size], cache=cache))
                pos += size
            torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=1e-10)


def test_lm_generate_greedy_equals_argmax_of_full_forward_with_a_window():
    model = _lm((6, 1))
    prompt = torch.randint(0, 13, (2, 4), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, 9, top_k=1)
    with torch.no_grad():
        logits = model(out[:, :-1])
    assert torch.equal(out[:, 4:], logits[:, 3:].argmax(-1))


def test_window_changes_the_lm_and_symmetric_pair_equals_k():
    ids = torch.randint(0, 13, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        by_k, by_pair = _lm(3)(ids), _lm((3, 3))(ids)
        torch.testing.assert_close(by_pair, by_k, rtol=0, atol=0)
        # Causal attention reads rows -left..0 only: (3, 0) gives the same numbers as (3, 3)
        # once its tables are the first 4 rows of the symmetric ones.
        sym, left_only = _lm(3), _lm((3, 0))
        state = {k: v[..., :4, :] if k.endswith(("rel_keys", "rel_values")) else v
                 for k, v in sym.state_dict().items() if not k.endswith("_extra_state")}
        left_only.load_state_dict(state, strict=False)
        torch.testing.assert_close(left_only(ids), sym(ids), rtol=0, atol=1e-10)


def test_encoder_model_with_a_window_matches_the_reference_backend():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, d_model=12, num_heads=3, causal=False, num_classes=4,
                      max_distance=(2, 7))
    model = RelativeTransformerEncoderModel(cfg).to(F64).eval()
    ids = torch.randint(0, 11, (3, 10))
    key_mask = torch.ones(3, 10, dtype=torch.bool)
    key_mask[2, 7:] = False
    with torch.no_grad():
        got = model(ids, key_mask=key_mask)
        for layer in model.layers:
            layer.self_attn.implementation = "reference"
        want = model(ids, key_mask=key_mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert type(model)(**model.get_config()).config.max_distance == (2, 7)
