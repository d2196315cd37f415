"""Training under context parallelism, FSDP2 and activation checkpointing
(relpos.training.mesh_parallel): runs of 2 and 4 CPU ranks (gloo, 127.0.0.1) equal one process,
step by step (losses) and at the end (weights); a run resumes at another world size; the
refusals.

Each rank is a subprocess (``_parallel_worker.py``) joined under a timeout and killed after
it: a test may fail, never hang. The kernels are built here first, so ranks only load them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from relpos.training.data_parallel import DistContext
from relpos.training.mesh_parallel import Layout, Parallelism, shard_batch
from relpos.training.tasks import Batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _parallel_run import run_tiny

from helpers import run_ranks

WORKER = Path(__file__).with_name("_parallel_worker.py")
TIMEOUT_S = 240.0


def _ranks(world: int, out: Path, spec: dict) -> dict:
    run_ranks(str(WORKER), world, str(out), json.dumps(spec), timeout_s=TIMEOUT_S)
    return torch.load(out / "result.pt")


def _same_run(one: tuple, many: dict, *, rel: float = 1e-4) -> None:
    model, metrics = one
    losses = [row[1] for row in metrics["history"]["train"]]
    theirs = [row[1] for row in many["history"]["train"]]
    assert len(losses) == len(theirs) >= 3
    assert losses == pytest.approx(theirs, rel=rel, abs=1e-6)
    # Periodic evaluations by step (a run that ended at a step evaluated it in its final
    # metrics, not in the history, so a resumed history may lack that one).
    evals = {e["step"]: e["loss"] for e in metrics["history"]["eval"]}
    theirs_evals = {e["step"]: e["loss"] for e in many["history"]["eval"]}
    both = sorted(set(evals) & set(theirs_evals))
    assert len(both) >= len(evals) - 1 >= 1, (evals, theirs_evals)
    assert [evals[s] for s in both] == pytest.approx([theirs_evals[s] for s in both], rel=rel)
    for name, w in model.state_dict().items():
        theirs_w = many["weights"][name]
        if name.endswith("in_proj_bias"):
            # The key bias adds one constant per query row to the scores: its gradient is
            # exactly zero in exact arithmetic, so Adam turns float noise (1e-9) into steps
            # of the learning rate's size. Compare the query and value biases only.
            E = w.numel() // 3
            w, theirs_w = (torch.cat([t[:E], t[2 * E:]]) for t in (w, theirs_w))
        torch.testing.assert_close(theirs_w, w, rtol=1e-4, atol=2e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


SPEC = {"causal": True, "dropout": 0.0, "steps": 3, "fsdp": False, "ac": False, "cp": 1}


@pytest.mark.parametrize("world, spec", [
    (2, {"cp": 2, "ac": True}),                                   # one sequence on 2 ranks
    (2, {"cp": 2, "causal": False, "mode": "all_gather"}),        # bidirectional, contiguous
    (2, {"fsdp": True}),                                          # FSDP2 over 2 data ranks
    (4, {"cp": 2, "fsdp": True, "ac": True}),                     # dp 2 x cp 2, FSDP2
], ids=["cp2-ring-ac", "cp2-allgather-bidirectional", "fsdp2", "dp2xcp2-fsdp-ac"])
def test_ranks_train_as_one_process(tmp_path, world, spec):
    spec = {**SPEC, **spec}
    one = run_tiny(tmp_path / "one", spec)
    many = _ranks(world, tmp_path / "many", spec)
    assert many["parallelism"]["context_parallel"] == spec["cp"]
    _same_run(one, many)


def test_a_run_resumes_at_another_world_size(tmp_path):
    """Two steps in one process, then to four steps on dp 1 x cp 2 with FSDP2, equal four
    steps in one process; and the sharded run's checkpoint resumes in one process."""
    spec = {**SPEC, "steps": 4}
    straight = run_tiny(tmp_path / "straight", spec)
    run_tiny(tmp_path / "moved", {**spec, "steps": 2, "schedule": 4})  # stopped at 2 of 4
    resumed = _ranks(2, tmp_path / "moved", {**spec, "cp": 2, "fsdp": True, "resume": True})
    _same_run(straight, resumed)
    shutil.copytree(tmp_path / "moved", tmp_path / "back")
    _, metrics = run_tiny(tmp_path / "back", {**spec, "steps": 5, "schedule": 4,
                                                      "resume": True})
    assert metrics["resumed_from"] == 4 and len(metrics["history"]["train"]) == 5


def test_an_optimizer_state_in_another_order_on_each_rank_loads_into_fsdp_exactly(tmp_path):
    # A checkpoint's tensors come back from safetensors in an order of their own in each
    # process; torch's full-state loading pairs the ranks' entries by position, so an
    # unequal order would give each parameter a mix of other parameters' moments.
    result = _ranks(2, tmp_path, {"check": "optimizer_order"})
    want, got = result["want"]["state"], result["got"]["state"]
    assert sorted(got) == sorted(want) and len(want) > 10
    for i, entries in want.items():
        assert sorted(got[i]) == sorted(entries)
        for name, value in entries.items():
            assert torch.equal(got[i][name], value), (i, name)


def test_activation_checkpointing_gives_the_same_gradients_with_dropout():
    from torch.distributed._composable import checkpoint

    from relpos.models import ModelConfig, build_model

    config = ModelConfig(vocab_size=11, d_model=16, num_layers=2, num_heads=2, max_distance=3,
                         dropout=0.3)
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = build_model(config).train()
        if recompute:
            for block in model.layers:
                checkpoint(block)
        ids = torch.randint(0, 11, (3, 17), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)
        model(ids).logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def test_shard_batch_pads_to_the_layout_and_cuts_every_field():
    ids = torch.arange(2 * 10).view(2, 10)
    batch = Batch(ids, ids + 100, ids % 2 == 0, {"distance": ids % 3}, None)
    lay = Layout(dp=DistContext(), cp_rank=1, cp_size=2, sequence_layout="head_tail")
    mine = shard_batch(batch, lay)  # 10 -> 12 positions, chunks of 3: rank 1 holds 1 and 2
    assert mine.ids.tolist() == [[3, 4, 5, 6, 7, 8], [13, 14, 15, 16, 17, 18]]
    assert mine.targets.tolist() == [[103, 104, 105, 106, 107, 108],
                                     [113, 114, 115, 116, 117, 118]]
    lay0 = Layout(dp=DistContext(), cp_rank=0, cp_size=2, sequence_layout="head_tail")
    first = shard_batch(batch, lay0)  # chunks 0 and 3: the padding lands in chunk 3
    assert first.key_mask is not None and first.key_mask.tolist() == [
        [True, True, True, True, False, False]] * 2
    assert first.mask[:, 4:].any().item() is False
    assert first.meta["distance"][:, 4:].eq(-1).all()
    assert shard_batch(batch, Layout(dp=DistContext())) is batch


def test_refusals():
    with pytest.raises(ValueError, match="multiple of 2, got 3 processes"):
        Parallelism(context_parallel=2).check(3)
    with pytest.raises(ValueError, match="context_parallel must be an int >= 1, got 0"):
        Parallelism(context_parallel=0).check(1)
    with pytest.raises(ValueError, match="mode must be one of"):
        Parallelism(mode="ulysses").check(1)
