"""Data-parallel training: 2 CPU processes (gloo, 127.0.0.1) match 1 process, on fixed-length
batches and on variable-length ones (lines, packed; a rank may get no rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from relpos.cli import main
from relpos.models import ModelConfig
from relpos.training import TrainConfig, distributed, train
from relpos.training.data_parallel import DistContext, free_port, rank_slice
from relpos.training.tasks import TextLM

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


LINES = ["train", "--lines", "--length", "12", "--steps", "4", "--batch-size", "4",
         "--d-model", "16", "--heads", "2", "--layers", "1", "-k", "3", "--eval-every", "0",
         "--checkpoint-every", "0", "--no-progress"]


def test_two_processes_match_one_on_packed_lines(tmp_path, monkeypatch, lines_file):
    """Each step's lines (a varying number of rows) are split over the ranks, each packs its
    share; the losses are the single process's."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(distributed, "LAUNCH_TIMEOUT_S", 240.0)
    argv = [*LINES, "--text", str(lines_file[0])]
    one, _ = _run(argv, tmp_path, "one")
    two, _ = _run([*argv, "--nproc", "2"], tmp_path, "two")
    assert two["world_size"] == 2 and two["task"]["unit"] == "line"
    losses1 = [row[1] for row in one["history"]["train"]]
    losses2 = [row[1] for row in two["history"]["train"]]
    assert len(losses1) == len(losses2) == 4
    for a, b in zip(losses1, losses2, strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)


class OneRow(TextLM):
    """Lines, one row a batch: with two ranks, rank 1 has none."""

    def batch(self, **kw):
        return super().batch(**kw).slice(0, 1)


ONE_ROW_MODEL = {"d_model": 16, "num_layers": 1, "num_heads": 2, "max_distance": 3}
ONE_ROW_TRAIN = {"steps": 3, "batch_size": 2, "length": 8, "warmup": 1, "eval_lengths": [8],
                 "eval_tokens": 16}
ONE_ROW = f"""
import datetime, json, os, sys
import torch
import torch.distributed as dist
from relpos.models import ModelConfig
from relpos.training import TrainConfig, train
from relpos.training.data_parallel import DistContext
from relpos.training.tasks import TextLM


class OneRow(TextLM):
    def batch(self, **kw):
        return super().batch(**kw).slice(0, 1)


dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
torch.set_num_threads(1)
task = OneRow(sys.argv[1], unit="line")
model = ModelConfig(vocab_size=task.vocab_size, **{ONE_ROW_MODEL!r})
config = TrainConfig(**{ONE_ROW_TRAIN!r})
ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())
_, metrics = train(model, task, config, progress=False, ctx=ctx)
if ctx.is_main:
    with open(sys.argv[2], "w") as f:
        json.dump([row[1] for row in metrics["history"]["train"]], f)
dist.destroy_process_group()
"""


def test_a_rank_without_rows_takes_part(tmp_path, lines_file):
    """Rank 1 gets no rows: it still runs a forward and a backward (zero gradients), so
    DDP's all-reduce completes and the losses are the single process's."""
    task = OneRow(lines_file[0], unit="line")
    _, metrics = train(ModelConfig(vocab_size=task.vocab_size, **ONE_ROW_MODEL), task,
                       TrainConfig(**ONE_ROW_TRAIN), progress=False)
    losses1 = [row[1] for row in metrics["history"]["train"]]
    script = tmp_path / "one_row.py"
    script.write_text(ONE_ROW)
    out = tmp_path / "two.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                    "--nproc_per_node=2", "--master_addr=127.0.0.1",
                    f"--master_port={free_port()}", str(script), str(lines_file[0]), str(out)],
                   env=env, timeout=240, check=True)
    assert len(losses1) == 3 and json.loads(out.read_text()) == pytest.approx(losses1, rel=1e-5)
