"""Task generators: deterministic per seed, labels checked by brute force."""

from __future__ import annotations

import pytest
import torch

from relpos.training.tasks import (
    Agreement,
    OffsetRecall,
    SortWindows,
    TextLM,
    build_task,
    task_from_config,
)

SYNTHETIC = [
    OffsetRecall((1, 2, 5, 9)),
    Agreement((2, 3, 7, 12)),
    SortWindows(window=3, num_symbols=5),
]


def _same(a, b) -> bool:
    return (
        torch.equal(a.ids, b.ids)
        and torch.equal(a.targets, b.targets)
        and torch.equal(a.mask, b.mask)
        and a.meta.keys() == b.meta.keys()
        and all(torch.equal(a.meta[k], b.meta[k]) for k in a.meta)
    )


@pytest.mark.parametrize("task", SYNTHETIC, ids=lambda t: t.name)
def test_deterministic_per_seed_step_and_split(task):
    kw = {"batch_size": 6, "length": 40}
    a = task.batch(seed=3, step=7, split="train", **kw)
    assert _same(a, task.batch(seed=3, step=7, split="train", **kw))
    # A rebuilt task (as after resuming from a checkpoint) gives the same data.
    rebuilt = task_from_config(task.config())
    assert _same(a, rebuilt.batch(seed=3, step=7, split="train", **kw))
    assert not torch.equal(a.ids, task.batch(seed=3, step=8, split="train", **kw).ids)
    assert not torch.equal(a.ids, task.batch(seed=4, step=7, split="train", **kw).ids)
    assert not torch.equal(a.ids, task.batch(seed=3, step=7, split="eval", **kw).ids)
    assert a.ids.shape == (6, 40) and a.ids.dtype == torch.long
    assert int(a.ids.min()) >= 0 and int(a.ids.max()) < task.vocab_size
    assert a.mask.any(dim=1).all()


@pytest.mark.parametrize("task", SYNTHETIC, ids=lambda t: t.name)
def test_rank_slices_partition_the_global_batch(task):
    full = task.batch(seed=1, step=2, batch_size=8, length=30, split="train")
    parts = [full.slice(0, 4), full.slice(4, 8)]
    assert torch.equal(torch.cat([p.ids for p in parts]), full.ids)
    assert torch.equal(torch.cat([p.targets for p in parts]), full.targets)


def test_offset_recall_labels_brute_force():
    task = OffsetRecall((1, 2, 5, 9), num_symbols=6, probe_every=4)
    b = task.batch(seed=0, step=0, batch_size=16, length=50, split="train")
    seen = set()
    for row in range(16):
        ids, tgt, mask = b.ids[row].tolist(), b.targets[row].tolist(), b.mask[row].tolist()
        dist = b.meta["distance"][row].tolist()
        for p in range(50):
            if not mask[p]:
                assert dist[p] == -1
                continue
            d = dist[p]
            seen.add(d)
            assert ids[p] == task.num_symbols + task.distances.index(d)  # the probe of d
            assert ids[p - d] < task.num_symbols  # the answer is a symbol, not a probe
            assert tgt[p] == ids[p - d]
        # Every non-probe token is a symbol, every probe is scored.
        assert all((i >= task.num_symbols) == m for i, m in zip(ids, mask, strict=True))
    assert seen == set(task.distances)


def test_offset_recall_content_gives_no_hint():
    # Targets are uniform over symbols whatever the distance.
    task = OffsetRecall((1, 8), num_symbols=4)
    b = task.batch(seed=0, step=0, batch_size=200, length=64, split="train")
    counts = torch.bincount(b.targets[b.mask], minlength=4).float()
    assert (counts / counts.sum() - 0.25).abs().max() < 0.05


def test_agreement_labels_brute_force():
    task = Agreement((2, 3, 7, 12))
    b = task.batch(seed=5, step=1, batch_size=16, length=60, split="eval")
    verbs = 0
    for row in range(16):
        ids, tgt, mask = b.ids[row].tolist(), b.targets[row].tolist(), b.mask[row].tolist()
        dist = b.meta["distance"][row].tolist()
        assert ids[0] == task.subj_token
        for v in range(60):
            assert mask[v] == (ids[v] == task.verb_token)
            if ids[v] != task.verb_token:
                continue
            verbs += 1
            marker = max(m for m in range(v) if ids[m] == task.subj_token)
            subject = marker + 1
            number = task.noun_number(ids[subject])
            assert number is not None
            assert tgt[v] == (task.sg_token if number == "sg" else task.pl_token)
            assert dist[v] == v - subject
            assert dist[v] in task.distances
            # Only fillers and unmarked nouns lie between subject and verb.
            between = ids[subject + 1 : v]
            assert task.subj_token not in between and task.verb_token not in between
            # An earlier marked subject always competes.
            assert any(ids[m] == task.subj_token for m in range(marker))
    assert verbs >= 16


def test_sort_windows_labels_brute_force():
    task = SortWindows(window=3, num_symbols=5)
    b = task.batch(seed=2, step=0, batch_size=4, length=23, split="train")
    for row in range(4):
        ids, tgt, mask = b.ids[row].tolist(), b.targets[row].tolist(), b.mask[row].tolist()
        for start in range(0, 23 - 7 + 1, 7):
            xs = ids[start : start + 3]
            assert ids[start + 3] == task.sep_token
            assert ids[start + 4 : start + 7] == sorted(xs)
            for k in range(3):
                assert mask[start + 3 + k] and tgt[start + 3 + k] == sorted(xs)[k]
        assert ids[21:] == [task.pad_token] * 2 and not any(mask[21:])
    assert int(b.mask.sum()) == 4 * 3 * 3


def test_text_windows_come_from_the_right_split(tmp_path):
    text = "".join(chr(97 + (i * 7) % 26) for i in range(1000))
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    task = TextLM(path, valid_fraction=0.2)
    assert task.vocab_size == 26
    train_part, eval_part = text[:800], text[800:]
    for split, part in (("train", train_part), ("eval", eval_part)):
        b = task.batch(seed=0, step=3, batch_size=5, length=20, split=split)
        assert b.mask.all()
        for row in range(5):
            window = task.decode(b.ids[row].tolist())
            target = task.decode(b.targets[row].tolist())
            assert window in part
            assert window[1:] == target[:-1]
            assert (window + target[-1]) in part


def test_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TextLM(tmp_path / "missing.txt")
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij")
    with pytest.raises(ValueError, match="too short"):
        TextLM(short).batch(seed=0, step=0, batch_size=1, length=64, split="train")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(ValueError, match="UTF-8"):
        TextLM(binary)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        build_task("nope")
    with pytest.raises(ValueError, match="distances"):
        OffsetRecall((0, 2))
    with pytest.raises(ValueError, match="length >= 10"):
        OffsetRecall((1, 9)).batch(seed=0, step=0, batch_size=1, length=8, split="train")
    with pytest.raises(ValueError, match="split"):
        OffsetRecall((1,)).batch(seed=0, step=0, batch_size=1, length=8, split="test")
