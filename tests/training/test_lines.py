"""Variable-length training: ``TextLM(unit="line")`` batches (deterministic, a token budget,
right padding with a key mask) and the trainer's packed steps, which match padded ones."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from relpos.models import ModelConfig
from relpos.training import TrainConfig, train
from relpos.training.data_parallel import DistContext, rank_share, rank_slice
from relpos.training.evaluation import forward, masked_stats
from relpos.training.tasks import Batch, OffsetRecall, TextLM, build_task, task_from_config

LENGTH = 12


def _same(a: Batch, b: Batch) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.ids, b.ids), (a.targets, b.targets),
                                               (a.mask, b.mask))) and (
        a.key_mask is not None and b.key_mask is not None and torch.equal(a.key_mask, b.key_mask)
    )


def test_line_batches_are_deterministic_per_seed_split_and_step(lines_file):
    task = TextLM(lines_file[0], unit="line")
    kw = {"batch_size": 4, "length": LENGTH}
    a = task.batch(seed=3, step=7, split="train", **kw)
    assert _same(a, task.batch(seed=3, step=7, split="train", **kw))
    # Rebuilt from its config (as on resume): the same data.
    rebuilt = task_from_config(task.config())
    assert rebuilt.unit == "line" and _same(a, rebuilt.batch(seed=3, step=7, split="train", **kw))
    for other in ({"seed": 3, "step": 8, "split": "train"},
                  {"seed": 4, "step": 7, "split": "train"},
                  {"seed": 3, "step": 7, "split": "eval"}):
        assert not _same(a, task.batch(**other, **kw)), other


@pytest.mark.parametrize(("batch_size", "length"), [(4, LENGTH), (3, 5), (2, 40), (1, 1)])
def test_line_batches_hold_the_token_budget_with_a_right_padded_key_mask(
        lines_file, batch_size, length):
    path, text = lines_file
    task = TextLM(path, unit="line")
    cut = int(len(text) * 0.9)
    for split, part in (("train", text[:cut]), ("eval", text[cut:])):
        lines = [line for line in part.splitlines(keepends=True) if len(line) >= 2]
        for step in range(3):
            b = task.batch(seed=1, step=step, batch_size=batch_size, length=length, split=split)
            assert b.key_mask is not None and b.key_mask.dtype == torch.bool
            sizes = b.key_mask.sum(1)
            assert b.tokens == int(sizes.sum()) == batch_size * length  # the budget, exactly
            assert len(b) >= batch_size and int(sizes.min()) >= 1
            assert int(sizes.max()) <= length and b.ids.shape == (len(b), int(sizes.max()))
            assert torch.equal(b.mask, b.key_mask)  # every real token scored, no padding
            positions = torch.arange(b.ids.shape[1])
            assert torch.equal(b.key_mask, positions < sizes.unsqueeze(1))  # right padding
            assert not b.ids[~b.key_mask].any() and not b.targets[~b.key_mask].any()
            assert b.meta == {}
            for row in range(len(b)):
                n = int(sizes[row])
                ids = task.decode(b.ids[row, :n].tolist())
                targets = task.decode(b.targets[row, :n].tolist())
                assert ids[1:] == targets[:-1]  # next-character prediction in the line
                chars = ids + targets[-1]
                # A whole line, a window of length + 1 of a longer one, or (the last row)
                # a line cut to fit the budget: always inside one line.
                assert any(chars in line for line in lines), (split, chars)
                if row < len(b) - 1 and n < length:
                    assert chars in lines, (split, chars)
                assert "\n" not in chars[:-1]


def test_line_batches_skip_one_character_lines_and_use_the_splits(tmp_path):
    from relpos.training.tasks import _line_spans

    path = tmp_path / "t.txt"
    path.write_text("ab\n\nc\n" * 40 + "XYZ\n\n" * 12, encoding="utf-8")  # 240 + 60
    task = TextLM(path, valid_fraction=0.2, unit="line")
    for split, rows in (("train", {"ab", "c", "a"}), ("eval", {"XYZ", "X", "XY"})):
        b = task.batch(seed=0, step=0, batch_size=8, length=4, split=split)
        assert b.key_mask is not None
        seen = {task.decode(b.ids[r][b.key_mask[r]].tolist()) for r in range(len(b))}
        # Whole lines, or the last one cut to fit; never a "\n" alone.
        assert seen <= rows and len(seen) >= 2, (split, seen)
    # The last line needs no newline; lines of 1 character are skipped.
    assert _line_spans("ab\n\nc", 0, 5) == [(0, 3)]
    assert _line_spans("ab\n\ncd", 0, 6) == [(0, 3), (4, 2)]
    assert _line_spans("ab\n\ncd", 3, 6) == [(1, 2)]


def test_window_unit_is_unchanged_and_old_configs_mean_windows(lines_file):
    path, _ = lines_file
    window = TextLM(path)
    assert window.unit == "window" and not window.variable_length
    config = window.config()
    assert "unit" not in config  # as written before units existed
    assert task_from_config(config).unit == "window"
    b = window.batch(seed=0, step=0, batch_size=3, length=LENGTH, split="train")
    assert b.key_mask is None and b.ids.shape == (3, LENGTH) and b.tokens == 3 * LENGTH
    assert _windows_as_before(window, b)
    lines = TextLM(path, unit="line")
    assert lines.variable_length and lines.config()["unit"] == "line"
    assert build_task("text", text=path, unit="line").config() == lines.config()


def _windows_as_before(task: TextLM, b: Batch) -> bool:
    """The windows the task drew before units existed (its ``_example`` stream)."""
    from relpos.training.tasks import _stream_seed

    rng = random.Random(_stream_seed("text", 0, "train", 0, LENGTH))
    rows = [task._example(rng, LENGTH, "train") for _ in range(3)]
    return torch.equal(b.ids, torch.tensor([r[0] for r in rows]))


def test_unit_errors(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello\nworld\n" * 10, encoding="utf-8")
    with pytest.raises(ValueError, match=r"unit must be one of 'window', 'line', got 'word'"):
        TextLM(path, unit="word")
    with pytest.raises(ValueError, match=r"unit 'line' \(--lines\) is for task 'text'"):
        build_task("recall", unit="line")
    blank = tmp_path / "blank.txt"
    blank.write_text("hello there\n" * 9 + "\n\n\n\n\n\n\n\n\n\n\n\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no line of 2 characters or more in its eval split"):
        TextLM(blank, unit="line")
    with pytest.raises(ValueError, match="split must be one of"):
        TextLM(path, unit="line").batch(seed=0, step=0, batch_size=1, length=4, split="test")


def test_packed_batch_is_the_real_tokens_end_to_end(lines_file):
    b = TextLM(lines_file[0], unit="line").batch(seed=0, step=0, batch_size=2, length=6,
                                                split="train")
    assert b.key_mask is not None
    packed, cu = b.packed()
    assert packed.key_mask is None and cu.dtype == torch.int32
    assert cu.tolist() == [0, *torch.cumsum(b.key_mask.sum(1), 0).tolist()]
    assert torch.equal(packed.ids, b.ids[b.key_mask])
    assert torch.equal(packed.targets, b.targets[b.key_mask]) and packed.mask.all()
    share = b.slice(1, 3)
    assert share.key_mask is not None and torch.equal(share.key_mask, b.key_mask[1:3])
    moved = b.to("cpu").key_mask
    assert moved is not None and torch.equal(moved, b.key_mask)


def test_rank_share_splits_any_number_of_rows():
    for rows in range(0, 9):
        for world in (1, 2, 3):
            shares = [rank_share(rows, DistContext(rank=r, world_size=world))
                      for r in range(world)]
            assert shares[0][0] == 0 and shares[-1][1] == rows
            assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))
            sizes = [stop - start for start, stop in shares]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            if rows % world == 0 and rows:
                assert shares == [rank_slice(rows, DistContext(rank=r, world_size=world))
                                  for r in range(world)]


# --- the trainer: packed by default, padded with pad=True -----------------------------------


def _model(task, **kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": task.vocab_size, "d_model": 16, "num_layers": 2,
                          "num_heads": 2, "max_distance": 3, **kw})


def _cfg(**kw) -> TrainConfig:
    base = {"steps": 3, "batch_size": 4, "length": LENGTH, "warmup": 1,
            "eval_lengths": (LENGTH,), "eval_tokens": 96}
    return TrainConfig(**{**base, **kw})


def _without_key_bias(state: dict[str, torch.Tensor], d_model: int) -> dict[str, torch.Tensor]:
    """The weights without the key part of the attention's input bias: its gradient is zero
    in exact arithmetic (softmax does not change when every score of a row moves by
    ``q . b_k``), so AdamW turns round-off of either sign into steps of +-lr there, and it
    changes no output. Everything else must agree."""
    out = {}
    for name, value in state.items():
        if name.endswith("in_proj_bias"):
            value = torch.cat([value[:d_model], value[2 * d_model:]])
        out[name] = value
    return out


@pytest.mark.parametrize("positions", ["relative", "learned"])
def test_packed_and_padded_training_agree(lines_file, positions):
    task = TextLM(lines_file[0], unit="line")
    if positions == "relative":
        config = _model(task)
    else:
        config = _model(task, positions="learned", max_length=LENGTH, relative_keys=False,
                        relative_values=False)
    packed, m_packed = train(config, task, _cfg(), progress=False)
    padded, m_padded = train(config, task, _cfg(pad=True), progress=False)
    assert m_padded["train"]["pad"] is True and "pad" not in m_packed["train"]
    losses = [row[1] for row in m_packed["history"]["train"]]
    assert losses == pytest.approx([row[1] for row in m_padded["history"]["train"]],
                                   rel=1e-5)
    assert m_packed["eval"][0]["loss"] == pytest.approx(m_padded["eval"][0]["loss"], rel=1e-5)
    assert m_packed["eval"][0]["count"] == m_padded["eval"][0]["count"] == 96
    torch.testing.assert_close(_without_key_bias(packed.state_dict(), 16),
                               _without_key_bias(padded.state_dict(), 16),
                               rtol=1e-5, atol=1e-6)
    # And the two models compute the same function.
    b = task.batch(seed=9, step=0, batch_size=2, length=LENGTH, split="eval")
    a_logits, a_scored = forward(packed.eval(), b)
    b_logits, b_scored = forward(padded.eval(), b, pad=True)
    assert a_logits.dim() == 2 and b_logits.dim() == 3
    ce_a = masked_stats(a_logits, a_scored)[0]
    ce_b = masked_stats(b_logits, b_scored)[0][b.mask]
    torch.testing.assert_close(ce_a, ce_b, rtol=1e-5, atol=1e-5)


def test_the_training_step_packs_unless_pad(lines_file, monkeypatch):
    from relpos.training import trainer

    task = TextLM(lines_file[0], unit="line")
    calls: list[tuple[tuple[int, ...], bool, bool]] = []
    real = trainer.forward

    def spy(model, batch, *, pad=False):
        logits, scored = real(model, batch, pad=pad)
        calls.append((tuple(scored.ids.shape), pad, batch.key_mask is not None))
        return logits, scored

    monkeypatch.setattr(trainer, "forward", spy)
    train(_model(task), task, _cfg(steps=2), progress=False)
    assert calls == [((4 * LENGTH,), False, True)] * 2  # (T,): packed, the budget's tokens
    calls.clear()
    train(_model(task), task, _cfg(steps=1, pad=True), progress=False)
    assert len(calls[0][0]) == 2 and calls[0][1] is True


def test_a_rank_without_rows_gives_zero_gradients_for_every_weight(lines_file):
    """What a DDP rank with no rows runs: an empty packed batch; every weight receives a
    gradient (DDP all-reduces them all), zero."""
    from relpos.models import build_model
    from relpos.training.trainer import _rank_loss

    task = TextLM(lines_file[0], unit="line")
    model = build_model(_model(task))
    b = task.batch(seed=0, step=0, batch_size=2, length=LENGTH, split="train").slice(0, 0)
    logits, scored = forward(model, b, pad=True)  # no rows: packed even with pad
    assert logits.shape == (0, task.vocab_size) and scored.ids.shape == (0,)
    for pad in (False, True):
        model.zero_grad(set_to_none=True)
        loss, ce, _, mask = _rank_loss(model, model, b, pad=pad, global_count=7,
                                        world_size=2)
        assert ce.shape == mask.shape == (0,) and float(loss.detach()) == 0.0
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and not p.grad.any(), name


def test_pad_is_refused_for_fixed_length_tasks():
    task = OffsetRecall((1, 2), num_symbols=4)
    config = ModelConfig(vocab_size=task.vocab_size, d_model=16, num_layers=1, num_heads=2,
                         max_distance=2)
    with pytest.raises(ValueError, match="task 'recall' has fixed-length rows"):
        train(config, task, _cfg(length=8, eval_lengths=(8,), pad=True), progress=False)
    with pytest.raises(TypeError, match="pad must be a bool"):
        TrainConfig(pad=1)  # type: ignore[arg-type]
    assert "pad" not in TrainConfig().to_dict()
    assert TrainConfig.from_dict(TrainConfig(pad=True).to_dict()).pad is True
