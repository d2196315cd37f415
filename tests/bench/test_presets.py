"""The benchmark presets (relpos bench --preset training / encoder) at tiny sizes: the shapes
they build, the two encoders they compare, and the reports they write. Benchmarks are not
tests: nothing here checks a speed."""

from __future__ import annotations

import argparse

import pytest
import torch

from relpos.bench import encoder, presets


def test_token_shapes_hold_the_token_budget() -> None:
    assert presets.token_shapes(4096) == [
        (64, 64), (32, 128), (16, 256), (8, 512), (4, 1024), (2, 2048), (1, 4096)]
    assert presets.token_shapes(1024) == [(16, 64), (8, 128), (4, 256), (2, 512), (1, 1024)]
    assert presets.token_shapes(64) == [(1, 64)]
    assert presets.token_shapes(4096, [128, 512]) == [(32, 128), (8, 512)]
    assert presets.token_shapes(1000, [64, 100]) == [(15, 64), (10, 100)]  # B = tokens // n
    for tokens in (64, 100, 3000, 8192):
        shapes = presets.token_shapes(tokens)
        assert all(B * n <= tokens < (B + 1) * n for B, n in shapes)
        assert [n for _, n in shapes] == sorted({n for _, n in shapes})


@pytest.mark.parametrize(("tokens", "lengths", "match"), [
    (0, None, "--tokens must be >= 1"),
    (32, None, "default lengths start at n = 64"),
    (4096, [8192], "n = 8192 does not fit"),
    (4096, [0], "n = 0 does not fit"),
])
def test_token_shapes_refuse(tokens: int, lengths: list[int] | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        presets.token_shapes(tokens, lengths)


def test_training_settings_defaults() -> None:
    s = presets.training_settings(argparse.Namespace())
    assert s.shapes == presets.token_shapes(4096)
    assert (s.max_distances, s.causal, s.heads, s.head_dim) == ([16, 64], [False, True], 8, 64)
    assert s.backends == ["auto", "native", "flash_regions", "bucketed", "reference"]
    only_causal = presets.training_settings(argparse.Namespace(causal=True, max_distances=(3,)))
    assert (only_causal.causal, only_causal.max_distances) == ([True], [3])
    with pytest.raises(ValueError, match="unknown"):
        presets.training_settings(argparse.Namespace(backends="sdpa"))


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_encoder_models_compare_like_with_like() -> None:
    plain, relative = encoder.build_models(16, ("auto", "bucketed"))
    assert len(plain.layers) == len(relative["auto"].layers) == 6
    layer = relative["auto"].layers[0]
    assert (layer.self_attn.embed_dim, layer.self_attn.num_heads, layer.linear1.out_features,
            layer.norm_first, layer.self_attn.batch_first) == (512, 8, 2048, True, True)
    for model in relative.values():
        # Equal parameter counts but for relpos's tables: 2 x (2K + 1) x D per layer.
        assert _count(model) - encoder.relative_table_count(model) == _count(plain)
        assert encoder.relative_table_count(model) == 6 * 2 * 33 * 64
    x = torch.randn(2, 9, 512)
    with torch.no_grad():
        outputs = [plain(x), *(m(x) for m in relative.values())]
    assert all(out.shape == x.shape for out in outputs)


def test_encoder_models_share_weights_zero_tables_give_torch() -> None:
    plain, relative = encoder.build_models(3, ("auto", "flash_regions"), layers=2, d_model=16,
                                           nhead=2, dim_feedforward=32, dtype=torch.float64)
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    auto, regions = relative["auto"], relative["flash_regions"]
    torch.testing.assert_close(auto(x), regions(x))  # the same weights and tables
    with torch.no_grad():
        for model in relative.values():
            for name, p in model.named_parameters():
                if name.endswith(("rel_keys", "rel_values")):
                    p.zero_()
    torch.testing.assert_close(auto(x), plain(x))
    torch.testing.assert_close(regions(x), plain(x))


def test_encoder_settings() -> None:
    s = encoder.encoder_settings(argparse.Namespace())
    assert (s.shapes, s.max_distances, s.implementations) == ([(32, 128), (8, 512)], [16],
                                                               ["auto"])
    with pytest.raises(ValueError, match="unknown"):
        encoder.encoder_settings(argparse.Namespace(backends="auto,nope"))
