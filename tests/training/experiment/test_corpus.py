"""The Python-source corpus: file selection, the split by path hash, bracket targets."""

from __future__ import annotations

import pytest
import torch

from relpos.training.experiment.corpus import (
    MAX_FILE_BYTES,
    PythonSourceLM,
    SourceCorpus,
    bracket_pairs,
    find_sources,
    split_of,
)


def test_bracket_pairs_skip_strings_and_comments():
    assert bracket_pairs("f(a[1], '(')  # )") == [(3, 5), (1, 11)]
    text = 'x = {"a": (1, """)]}\n"""), \'[\'}\n# (\ny = [2]'
    pairs = bracket_pairs(text)
    assert [(text[o], text[c]) for o, c in pairs] == [("(", ")"), ("{", "}"), ("[", "]")]
    assert bracket_pairs(r"s = 'it\'s (' + (x)") == [(16, 18)]
    # A closer that matches nothing resets the stack instead of pairing wrongly.
    assert bracket_pairs("(]())") == [(2, 3)]


def test_split_is_a_fixed_hash_of_the_path():
    names = [f"pkg/mod{i}.py" for i in range(400)]
    splits = [split_of(n) for n in names]
    assert splits == [split_of(n) for n in names]
    share = {s: splits.count(s) / len(names) for s in ("train", "validation", "test")}
    assert 0.7 < share["train"] < 0.9 and 0.05 < share["validation"] < 0.16
    # Pinned: the split is the same on every machine (blake2b of the POSIX path).
    assert split_of("json/decoder.py") == split_of("json/decoder.py")
    assert {split_of("a.py"), split_of("b.py"), split_of("c.py")} <= {"train", "validation",
                                                                      "test"}


def test_sources_skip_tests_site_packages_and_big_files(tmp_path, fake_stdlib):
    root = fake_stdlib
    (root / "huge.py").write_text("x = 1\n" * (MAX_FILE_BYTES // 6 + 10))
    found = [p.relative_to(root).as_posix() for p in find_sources(root)]
    assert len(found) == 30 and "huge.py" not in found
    assert not any(part in ("test", "tests", "site-packages") for f in found
                   for part in f.split("/"))
    assert found == sorted(found)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        find_sources(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no \.py files"):
        find_sources(tmp_path / "empty")


def test_corpus_splits_by_file_and_marks_closers(tmp_path, fake_stdlib):
    root = fake_stdlib
    corpus = SourceCorpus(root)
    info = corpus.describe()
    assert sum(info["files"].values()) == 30 and all(v > 0 for v in info["files"].values())
    again = SourceCorpus(root)
    assert again.digest == corpus.digest
    for name, split in corpus.splits.items():
        text = bytes(split.ids.tolist()).decode("ascii")
        # Every marked closer is a closer whose opener sits d characters back.
        where = (split.distance > 0).nonzero().flatten().tolist()
        assert where, name
        for p in where:
            d = int(split.distance[p])
            assert text[p] in ")]}" and text[p - d] == {")": "(", "]": "[", "}": "{"}[text[p]]
    # Whole files go to one split: each module's text is in exactly one.
    texts = {n: bytes(s.ids.tolist()).decode("ascii") for n, s in corpus.splits.items()}
    for path in find_sources(root):
        body = path.read_text()
        assert sum(body in t for t in texts.values()) == 1


def test_batches_are_deterministic_and_meta_sees_only_the_window(fake_stdlib):
    task = PythonSourceLM(SourceCorpus(fake_stdlib))
    a = task.batch(seed=3, step=2, batch_size=4, length=50, split="eval")
    b = task.batch(seed=3, step=2, batch_size=4, length=50, split="eval")
    assert torch.equal(a.ids, b.ids) and torch.equal(a.meta["distance"], b.meta["distance"])
    assert torch.equal(a.ids[:, 1:], a.targets[:, :-1]) and bool(a.mask.all())
    dist = a.meta["distance"]
    for row in range(4):
        for t in range(50):
            d = int(dist[row, t])
            if d > 0:
                # The target at t is the closer; its opener is at input position t + 1 - d.
                assert t + 1 - d >= 0 and chr(int(a.ids[row, t + 1 - d])) in "([{"
                assert chr(int(a.targets[row, t])) in ")]}"
    assert (dist > 0).any() and (dist == -1).any()
    with pytest.raises(ValueError, match="split must be one of"):
        task.batch(seed=0, step=0, batch_size=1, length=8, split="valid")
    with pytest.raises(ValueError, match="too few for length"):
        task.batch(seed=0, step=0, batch_size=1, length=10**7, split="train")


def test_a_root_of_binary_py_files_is_refused_in_one_clear_line(tmp_path):
    for i in range(30):
        (tmp_path / f"blob{i}.py").write_bytes(bytes([0xFF, 0xFE, 0x00, 0x80]) * 8)
    with pytest.raises(ValueError, match=r"no text for the train and validation split\(s\) "
                                         r"\(30 \.py files, 30 of them unreadable or not UTF-8"):
        SourceCorpus(tmp_path)


def test_experiment_with_a_binary_corpus_root_exits_2_and_leaves_nothing(tmp_path, capsys):
    from relpos.cli import main

    root = tmp_path / "root"
    root.mkdir()
    (root / "blob.py").write_bytes(b"\xff\xfe\x00\x80")
    before = sorted(tmp_path.rglob("*"))
    code = main(["experiment", "--tasks", "pysrc", "--corpus-root", str(root), "--out",
                 str(tmp_path / "exp"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no text for the train" in err, err
    assert sorted(tmp_path.rglob("*")) == before
