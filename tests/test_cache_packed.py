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


def _lm(num_layers: int = 3) -> RelativeTransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=13, d_model=16, num_heads=2, num_layers=num_layers,
                      max_distance=2)
    return RelativeTransformerLM(cfg).double().eval()


def test_a_packed_step_that_fails_mid_way_leaves_every_layer_as_it_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _lm()
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 13, (7,), generator=g)
    step = torch.randint(0, 13, (2,), generator=g)
    linear1 = model.layers[1].linear1  # the feed-forward of the middle layer
    assert isinstance(linear1, torch.nn.Linear)
    original, armed = linear1.forward, [True]

    def feed_forward(x: torch.Tensor) -> torch.Tensor:  # runs out of memory while armed
        if armed[0]:
            raise RuntimeError("out of memory (injected)")
        return original(x)

    monkeypatch.setattr(linear1, "forward", feed_forward)
    cache = model.new_packed_cache(2, capacity=4)
    # A failed prefill forgets what the first layers stored (their dtype and head shapes too).
    with pytest.raises(RuntimeError, match="injected"):
        model(prompt, cu_seqlens=_cu([3, 4]), cache=cache)
    assert [layer.lengths for layer in cache] == [(0, 0)] * 3 and cache.lengths == (0, 0)
    armed[0] = False
    model(prompt, cu_seqlens=_cu([3, 4]), cache=cache)
    # A failed step (which grew the first two layers' regions, 4 -> 8) is undone everywhere.
    armed[0] = True
    with pytest.raises(RuntimeError, match="injected"):
        model(step, cu_seqlens=_cu([1, 1]), cache=cache)
    assert [layer.lengths for layer in cache] == [(3, 4)] * 3 and cache.lengths == (3, 4)
    armed[0] = False
    retry = model(step, cu_seqlens=_cu([1, 1]), cache=cache)
    uninterrupted = model.new_packed_cache(2, capacity=4)
    model(prompt, cu_seqlens=_cu([3, 4]), cache=uninterrupted)
    want = model(step, cu_seqlens=_cu([1, 1]), cache=uninterrupted)
    torch.testing.assert_close(retry, want, rtol=0, atol=1e-12)
    assert [layer.lengths for layer in cache] == [(4, 5)] * 3


def test_a_packed_step_is_refused_when_the_layers_hold_different_lengths() -> None:
    model = _lm()
    cache = model.new_packed_cache(2)
    model(torch.arange(5), cu_seqlens=_cu([2, 3]), cache=cache)
    kv = torch.zeros(1, 2, 8, dtype=torch.float64)
    cache[1].append(kv, kv, _cu([0, 1]))  # one layer stepped alone
    with pytest.raises(ValueError, match=r"different lengths \[\(2, 3\), \(2, 4\)\]"):
        model(torch.arange(2), cu_seqlens=_cu([1, 1]), cache=cache)
    assert [layer.lengths for layer in cache] == [(2, 3), (2, 4), (2, 3)]
    with pytest.raises(ValueError, match="different lengths"):
        cache.check_step([1, 1])


def test_a_packed_append_refuses_mismatched_dtypes_up_front() -> None:
    cache = PackedLayerCache(2)
    k32, k64 = torch.randn(3, 2, 8), torch.randn(3, 2, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"share dtype and device, got torch\.float32 on cpu "
                                        r"and torch\.float64 on cpu"):
        cache.append(k32, k64, _cu([1, 2]))
    assert cache.lengths == (0, 0) and repr(cache).endswith("capacity=64)")
    cache.append(k64, k64, _cu([1, 2]))  # the refused append fixed no dtype
    with pytest.raises(TypeError, match=r"the cache holds torch\.float64, got torch\.float32"):
        cache.append(k32, k32, _cu([1, 2]))
    with pytest.raises(TypeError, match="value must be a floating point tensor, got dtype "
                                        r"torch\.int64"):
        cache.append(k64, torch.zeros(3, 2, 8, dtype=torch.long), _cu([1, 2]))
    with pytest.raises(TypeError, match=r"key must be a torch\.Tensor, got list"):
        cache.append([0.0], k64, _cu([1, 2]))  # type: ignore[arg-type]
    assert cache.lengths == (1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_a_packed_append_refuses_boundaries_that_are_not_integers(dtype: torch.dtype) -> None:
    cache = PackedLayerCache(2, capacity=4, growable=False)
    kv = torch.randn(3, 2, 8)
    with pytest.raises(TypeError, match=rf"cu_seqlens must be int32 or int64 .*, got dtype "
                                        rf"{dtype}"):
        cache.append(kv, kv, torch.tensor([0, 1, 3]).to(dtype))
    with pytest.raises(TypeError, match=r"cu_seqlens must be a torch\.Tensor, got list"):
        cache.append(kv, kv, [0, 1, 3])  # type: ignore[arg-type]
    assert cache.lengths == (0, 0)


def test_a_packed_attention_step_that_fails_after_its_append_leaves_the_layer_as_it_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mha = relpos.RelativeMultiheadAttention(8, 2, max_distance=2, dtype=torch.float64)
    cache = PackedLayerCache(2)
    x = torch.randn(3, 8, dtype=torch.float64)
    mha(x, cu_seqlens=_cu([1, 2]), is_causal=True, cache=cache)

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("refused (injected)")

    monkeypatch.setattr(relpos.varlen, "relative_attention_varlen", refuse)
    with pytest.raises(ValueError, match="injected"):
        mha(x, cu_seqlens=_cu([2, 1]), is_causal=True, cache=cache)
    assert cache.lengths == (1, 2)
