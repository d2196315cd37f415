"""Reading the results document (relpos.training.experiment.results)."""

from __future__ import annotations

import gzip
import json

import pytest

from relpos.training.experiment import ExperimentConfig, load_results
from relpos.training.experiment.results import eval_lengths, results_bytes, signal_groups


def test_results_documents_are_read_compressed_or_plain(tmp_path):
    doc = {"format_version": 2, "runs": [{"eval": [{"bpc": 1.5}]}]}
    data = results_bytes(doc)
    assert data == results_bytes(dict(doc)) and data[:2] == b"\x1f\x8b"  # no time stamp
    assert json.loads(gzip.decompress(data)) == doc
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "results.json.gz").write_bytes(data)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text(json.dumps(doc))
    for where in ("new", "new/results.json.gz", "old", "old/results.json"):
        assert load_results(tmp_path / where) == doc
    # Told apart by content: a plain document under the new name is read too.
    (tmp_path / "plain.gz").write_text(json.dumps(doc))
    assert load_results(tmp_path / "plain.gz") == doc
    with pytest.raises(FileNotFoundError, match=r"holds no results document \(results"
                       r".json.gz or results.json\)"):
        load_results(tmp_path)
    (tmp_path / "bad.gz").write_bytes(data[:20])
    with pytest.raises(ValueError, match=r"bad\.gz' is not a results document"):
        load_results(tmp_path / "bad.gz")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        load_results(tmp_path / "list.json")


def test_eval_lengths_and_signal_groups():
    cfg = ExperimentConfig.quick().to_dict()
    results = {"config": cfg, "runs": [
        {"spec": {"task": "pysrc", "depth": 1, "seed": s}, "model_label": label,
         **({"signal": {}} if label != "learned" else {})}
        for s in (1, 0) for label in ("K=4", "learned")]}
    assert eval_lengths(results, "pysrc") == [64, 256]
    assert eval_lengths(results, "recall") == [64, 256]
    groups = signal_groups(results)
    assert list(groups) == ["K=4"]
    assert [r["spec"]["seed"] for r in groups["K=4"]] == [0, 1]
    assert signal_groups({**results, "runs": []}) == {}
