"""RelativeTransformerLM.generate_packed on the fast decoder: token for token what generate gives
(greedy and seeded sampling; equal lengths against the stacked prompts, different lengths
against each prompt alone and against the left-padded batch), with end tokens, finished
sequences dropped from the step cache, in float64 random-weight models of every positional
setting."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers import DECODING_CONFIGS, random_lm
from relpos import KVCache
from relpos.models import ModelConfig, RelativeTransformerLM, generation

V = 23

CONFIGS: list[dict[str, Any]] = [*DECODING_CONFIGS, dict(positions="none")]
IDS = [",".join(f"{k}={v}" for k, v in kw.items()) for kw in CONFIGS]
SAMPLING = [dict(top_k=1), dict(temperature=1.0), dict(top_k=5, top_p=0.9, temperature=0.7)]


def _lm(**kw: object) -> RelativeTransformerLM:
    return random_lm(**kw)


def _prompts(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


def _cut(tokens: list[int], stop: set[int]) -> list[int]:
    """generate's row up to its first end token (generate pads after it)."""
    hit = next((i for i, t in enumerate(tokens) if t in stop), None)
    return tokens if hit is None else tokens[: hit + 1]


def _seeded(sampling: dict) -> dict:
    return {**sampling, "generator": torch.Generator().manual_seed(7)}


class _CountCompactions:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int | None, int, int]] = []
        original = generation.compacted

        def counted(cache: KVCache, keep: list[int], skip: int, capacity: int) -> KVCache:
            self.calls.append((cache.batch_size, len(keep), skip))
            return original(cache, keep, skip, capacity)

        monkeypatch.setattr(generation, "compacted", counted)


@pytest.mark.parametrize("sampling", SAMPLING, ids=str)
@pytest.mark.parametrize("kw", CONFIGS, ids=IDS)
def test_equal_lengths_give_generates_tokens(kw: dict, sampling: dict) -> None:
    """The same generator gives generate's tokens on the stacked prompts: one row per prompt
    sampled in order every step, also after a prompt finished."""
    model = _lm(**kw)
    prompts = _prompts([6] * 4)
    free = model.generate(torch.stack(prompts), 14, new_tokens_only=True, **_seeded(sampling))
    got = model.generate_packed(prompts, 14, **_seeded(sampling))
    assert [t.tolist() for t in got] == free.tolist()
    eos = int(free[1, 3])  # a token some prompt emits part-way
    want = model.generate(torch.stack(prompts), 14, eos_token_id=eos, new_tokens_only=True,
                          **_seeded(sampling))
    got = model.generate_packed(prompts, 14, eos_token_id=eos, **_seeded(sampling))
    assert [t.tolist() for t in got] == [_cut(row, {eos}) for row in want.tolist()]
    assert len(got[1]) <= 4


@pytest.mark.parametrize("kw", CONFIGS, ids=IDS)
def test_different_lengths_give_each_prompt_its_greedy_tokens_alone(kw: dict) -> None:
    model = _lm(**kw)
    prompts = _prompts([5, 1, 11, 3, 8])
    alone = [model.generate(p[None], 12, top_k=1, new_tokens_only=True)[0].tolist()
             for p in prompts]
    assert [t.tolist() for t in model.generate_packed(prompts, 12, top_k=1)] == alone
    stop = {alone[2][1], alone[4][0]}  # two end tokens: prompts finish at different steps
    got = model.generate_packed(prompts, 12, top_k=1, eos_token_id=sorted(stop))
    assert [t.tolist() for t in got] == [_cut(a, stop) for a in alone]


@pytest.mark.parametrize("sampling", SAMPLING[1:], ids=str)
@pytest.mark.parametrize("kw", [kw for kw in CONFIGS
                                if kw.get("positions") not in ("learned", "sinusoidal")],
                         ids=[i for i, kw in zip(IDS, CONFIGS, strict=True)
                              if kw.get("positions") not in ("learned", "sinusoidal")])
def test_different_lengths_sample_what_generate_samples_left_padded(kw: dict,
                                                                    sampling: dict) -> None:
    """Without absolute positions, a left-padded batch is each prompt's own: the same
    generator gives the same tokens, end tokens or not."""
    model = _lm(**kw)
    prompts = _prompts([5, 1, 11, 3, 8], seed=3)
    ids, mask = generation.left_pad(prompts)
    want = model.generate(ids, 16, key_mask=mask, new_tokens_only=True, **_seeded(sampling))
    got = model.generate_packed(prompts, 16, **_seeded(sampling))
    assert [t.tolist() for t in got] == want.tolist()
    stop = {int(want[0, 2]), int(want[3, 1])}
    want = model.generate(ids, 16, key_mask=mask, eos_token_id=sorted(stop),
                          new_tokens_only=True, **_seeded(sampling))
    got = model.generate_packed(prompts, 16, eos_token_id=sorted(stop), **_seeded(sampling))
    assert [t.tolist() for t in got] == [_cut(row, stop) for row in want.tolist()]


@pytest.mark.parametrize("kw", [dict(max_distance=3), dict(positions="learned"),
                                dict(positions="sinusoidal")], ids=str)
def test_finished_prompts_leave_the_step_cache(kw: dict, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    """Once most prompts have finished (the longest among them), the step cache keeps the
    live rows only, without the columns that are padding in all of them; the tokens stay
    each prompt's own."""
    model = _lm(**kw)
    prompts = _prompts([30, 2, 25, 4, 3, 28], seed=5)
    alone = [model.generate(p[None], 20, top_k=1, new_tokens_only=True)[0].tolist()
             for p in prompts]
    # end tokens that finish the long prompts early and leave a short one running
    stop = {alone[0][0], alone[2][0], alone[5][0]}
    assert not stop & set(alone[1])
    count = _CountCompactions(monkeypatch)
    got = model.generate_packed(prompts, 20, top_k=1, eos_token_id=sorted(stop))
    assert [t.tolist() for t in got] == [_cut(a, stop) for a in alone]
    assert count.calls, "no compaction"
    batch, kept, skip = count.calls[0]
    assert batch == 6 and kept <= 3 and skip > 0


def test_compacted_and_padded_caches_hold_the_right_rows() -> None:
    model = _lm(max_distance=2)
    prompts = _prompts([4, 1, 3])
    packed = model.new_packed_cache(3, capacity=4, growable=False)
    lengths = [4, 1, 3]
    cu = torch.tensor([0, 4, 5, 8])
    with torch.no_grad():
        model(torch.cat(prompts), cu_seqlens=cu, cache=packed)
    cache = generation.padded_from_packed(packed, lengths, 6)
    assert (cache.length, cache.capacity, cache.batch_size) == (4, 6, 3)
    mask = cache[0].key_mask
    assert mask is not None and mask.tolist() == [[True] * 4, [False] * 3 + [True],
                                                 [False] + [True] * 3]
    storage = packed[1].storage
    assert storage is not None
    keys = cache[1].keys
    assert keys is not None
    assert torch.equal(keys[2, :, 1:], storage[0][:, 2, :3])
    small = generation.compacted(cache, [2], 1, 5)
    assert (small.length, small.capacity, small.batch_size) == (3, 5, 1)
    assert small[0].key_mask is None  # every kept column is real
    assert torch.equal(small[1].keys, storage[0][:, 2, :3][None])  # type: ignore[arg-type]


def test_float32_steps_equal_generate_on_equal_prompts() -> None:
    """The float32 path (the native decode kernels where built) through generate_packed."""
    torch.manual_seed(0)
    model = RelativeTransformerLM(ModelConfig(vocab_size=V, d_model=32, num_heads=4,
                                              max_distance=3)).eval()
    prompts = _prompts([7] * 3)
    want = model.generate(torch.stack(prompts), 9, top_k=1, new_tokens_only=True)
    assert [t.tolist() for t in model.generate_packed(prompts, 9, top_k=1)] == want.tolist()


def test_generate_packed_keeps_its_contract() -> None:
    model = _lm(max_distance=2)
    model.train()
    prompts = _prompts([3, 5])
    out = model.generate_packed(prompts, 0)
    assert [t.shape for t in out] == [(0,), (0,)] and all(t.dtype == torch.long for t in out)
    out = model.generate_packed(prompts, 1, top_k=1)
    assert [len(t) for t in out] == [1, 1]
    assert model.training  # restored
    bad_prompts: list[tuple[Any, type[Exception], str]] = [
        ([], TypeError, "non-empty list"),
        (torch.zeros(2, 3, dtype=torch.long), TypeError, "non-empty list"),
        ([torch.zeros(0, dtype=torch.long)], ValueError, r"prompts\[0\] must be a \(P,\)"),
        ([torch.zeros(2, 2, dtype=torch.long)], ValueError, r"prompts\[0\]"),
        ([torch.zeros(2)], TypeError, "integer dtype"),
        ([torch.full((2,), V)], ValueError, "vocab_size"),
    ]
    for bad, error, match in bad_prompts:
        with pytest.raises(error, match=match):
            model.generate_packed(bad, 2)
    bad_args: list[tuple[dict[str, Any], type[Exception], str]] = [
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=2.0), TypeError, "max_new_tokens"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(eos_token_id=V), ValueError, "eos_token_id"),
        (dict(generator=1), TypeError, "Generator"),
    ]
    for kwargs, error, match in bad_args:
        with pytest.raises(error, match=match):
            model.generate_packed(prompts, **{"max_new_tokens": 2, **kwargs})
    with pytest.raises(ValueError, match="num_classes"):
        _lm(num_classes=3).generate_packed(prompts, 2)
    with pytest.raises(ValueError, match="max_length"):
        _lm(positions="learned", max_length=8).generate_packed(prompts, 4)
