"""Packed KV caches (relpos.PackedKVCache): sequences of different lengths decode together
without padding, and every step equals the matching rows of one causal pass per sequence;
``generate_packed`` gives each prompt the tokens it gets alone."""

from __future__ import annotations

import itertools

import pytest
import torch

import relpos
from relpos import PackedKVCache, PackedLayerCache
from relpos.models import ModelConfig, RelativeTransformerLM


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)])


@pytest.mark.parametrize("implementation", [None, "reference", "bucketed"])
def test_packed_steps_equal_one_causal_pass_per_sequence(implementation: str | None) -> None:
    torch.manual_seed(0)
    mha = relpos.RelativeMultiheadAttention(16, 4, max_distance=3, dtype=torch.float64,
                                            implementation=implementation).eval()
    totals = [9, 4, 12, 1]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n, 16, generator=g, dtype=torch.float64) for n in totals]
    full, _ = mha(torch.cat(seqs), cu_seqlens=_cu(totals), is_causal=True)
    want = full.split(totals)
    # Steps of different sizes per sequence (0 = the sequence waits), a small growable cache.
    steps = [[3, 1, 5, 1], [1, 0, 2, 0], [0, 2, 1, 0], [5, 1, 4, 0]]
    assert [sum(col) for col in zip(*steps, strict=True)] == totals
    cache = PackedLayerCache(len(totals), capacity=2)
    done = [0] * len(totals)
    for step in steps:
        x = torch.cat([s[d:d + t] for s, d, t in zip(seqs, done, step, strict=True)])
        out, _ = mha(x, cu_seqlens=_cu(step), is_causal=True, cache=cache)
        for s, part in enumerate(out.split(step)):
            torch.testing.assert_close(part, want[s][done[s]:done[s] + step[s]],
                                       rtol=0, atol=1e-12)
        done = [d + t for d, t in zip(done, step, strict=True)]
    assert cache.lengths == tuple(totals) and cache.capacity == 16  # 2 -> 4 -> 8 -> 16


def test_a_refused_append_leaves_the_cache_unchanged() -> None:
    cache = PackedLayerCache(2, capacity=4, growable=False)
    k = torch.randn(3, 2, 8)
    cache.append(k, k, _cu([1, 2]))
    for bad, match in [
        ((torch.randn(3, 2, 8), _cu([1, 1])), "end at 3"),
        ((torch.randn(3, 2, 8), _cu([1, 1, 1])), r"must be \(3,\)"),
        ((torch.randn(3, 2, 4), _cu([1, 2])), "the cache holds"),
        ((torch.randn(5, 2, 8), _cu([4, 1])), "holds 4 positions per sequence; this step needs 5"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache.append(bad[0], bad[0], bad[1])
        assert cache.lengths == (1, 2)
    with pytest.raises(ValueError, match="needs a capacity"):
        PackedLayerCache(2, growable=False)
    with pytest.raises(ValueError, match="num_sequences must be an int >= 1"):
        PackedLayerCache(0)


def test_a_packed_layer_cache_is_refused_outside_a_packed_call() -> None:
    mha = relpos.RelativeMultiheadAttention(8, 2, max_distance=2)
    with pytest.raises(TypeError, match=r"relpos\.LayerCache"):
        mha(torch.randn(1, 3, 8), cache=PackedLayerCache(1))
    with pytest.raises(TypeError, match=r"takes a relpos\.PackedLayerCache"):
        mha(torch.randn(3, 8), cu_seqlens=_cu([3]), cache=relpos.LayerCache())


@pytest.mark.parametrize("positions", ["relative", "learned", "sinusoidal"])
def test_generate_packed_gives_each_prompt_its_own_tokens(positions: str) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=17, d_model=16, num_heads=2, num_layers=2, max_distance=3,
                      positions=positions, max_length=64)
    model = RelativeTransformerLM(cfg).double()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 17, (n,), generator=g) for n in (5, 1, 11, 3)]
    eos = 4
    got = model.generate_packed(prompts, 12, top_k=1, eos_token_id=eos)
    for prompt, tokens in zip(prompts, got, strict=True):
        alone = model.generate(prompt[None], 12, top_k=1, eos_token_id=eos,
                               new_tokens_only=True)[0]
        if eos in alone.tolist():  # generate pads a finished row; generate_packed stops
            alone = alone[:alone.tolist().index(eos) + 1]
        assert tokens.tolist() == alone.tolist()


def test_packed_language_model_steps_equal_the_full_pass() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=13, d_model=16, num_heads=2, num_layers=2, max_distance=2)
    model = RelativeTransformerLM(cfg).double().eval()
    g = torch.Generator().manual_seed(3)
    totals = [6, 2, 9]
    ids = torch.randint(0, 13, (sum(totals),), generator=g)
    full = model(ids, cu_seqlens=_cu(totals)).split(totals)
    seqs = ids.split(totals)
    cache = model.new_packed_cache(3)
    done = [0, 0, 0]
    for step in ([4, 2, 3], [1, 0, 6], [1, 0, 0]):
        x = torch.cat([s[d:d + t] for s, d, t in zip(seqs, done, step, strict=True)])
        out = model(x, cu_seqlens=_cu(step), cache=cache).split(step)
        for s in range(3):
            torch.testing.assert_close(out[s], full[s][done[s]:done[s] + step[s]],
                                       rtol=0, atol=1e-10)
        done = [d + t for d, t in zip(done, step, strict=True)]
    with pytest.raises(ValueError, match="the cache holds 2 layers of 3 sequences"):
        model(ids[:2], cu_seqlens=_cu([1, 1]), cache=cache)
    assert isinstance(cache, PackedKVCache) and cache.lengths == (6, 2, 9)
