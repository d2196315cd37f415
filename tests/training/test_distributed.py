"""Data-parallel training: 2 CPU processes (gloo, 127.0.0.1) match 1 process."""

from __future__ import annotations

import json
import os
import sys

import pytest

from relpos.cli import main
from relpos.training import distributed
from relpos.training.distributed import DistContext, free_port, rank_slice

ARGS = [
    "train",
    "--task",
    "agree",
    "--distances",
    "2,4",
    "--length",
    "24",
    "--steps",
    "6",
    "--batch-size",
    "8",
    "--d-model",
    "16",
    "--heads",
    "2",
    "--layers",
    "1",
    "-k",
    "4",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "3",
    "--no-progress",
]


def test_rank_slice_partitions_the_batch():
    slices = [rank_slice(12, DistContext(rank=r, world_size=3)) for r in range(3)]
    assert slices == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="divisible"):
        rank_slice(10, DistContext(rank=0, world_size=3))


def test_free_port_is_local():
    assert 0 < free_port() < 65536


def _run(argv, tmp_path, name):
    out = tmp_path / name
    # In-process CLI; with --nproc it starts torchrun (-m relpos) on 127.0.0.1, a free port.
    assert main([*argv, "--out", str(out)]) == 0
    return json.loads((out / "metrics.json").read_text()), out


def test_two_processes_match_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(distributed, "LAUNCH_TIMEOUT_S", 240.0)
    one, _ = _run(ARGS, tmp_path, "one")
    two, out = _run([*ARGS, "--nproc", "2"], tmp_path, "two")
    assert two["world_size"] == 2 and one["world_size"] == 1
    losses1 = [row[1] for row in one["history"]["train"]]
    losses2 = [row[1] for row in two["history"]["train"]]
    assert len(losses1) == len(losses2) == 6
    assert losses1[-1] < losses1[0]
    for a, b in zip(losses1, losses2, strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
    # Only rank 0 wrote: one checkpoint directory set, no stray files.
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.json"]
