"""The per-row training signal: pair counts in closed form, gradients, movement."""

from __future__ import annotations

import pytest
import torch

from relpos.training.experiment.row_signal import RowSignal, count_pairs_per_row, pairs_per_row


@pytest.mark.parametrize(("length", "k"), [(1, 0), (8, 0), (8, 1), (8, 3), (8, 7), (8, 8),
                                           (8, 30), (33, 16), (128, 1023)])
def test_pairs_per_row_closed_form_matches_the_index(length, k):
    counts = pairs_per_row(length, k)
    assert counts == count_pairs_per_row(length, k)
    assert sum(counts) == length * (length + 1) // 2  # every causal pair uses one row
    for d in range(min(k, length - 1)):
        assert counts[d] == length - d


def test_row_signal_on_a_model_trained_shorter_than_k():
    from relpos.models import ModelConfig, build_model

    torch.manual_seed(0)
    k, length = 20, 6
    model = build_model(ModelConfig(vocab_size=11, d_model=16, num_layers=2, num_heads=2,
                                    max_distance=k, causal=True))
    rec = RowSignal(k, length, batch_size=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # as train()'s tables
    for step in range(3):
        ids = torch.randint(0, 11, (3, length))
        loss = model(ids).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        rec.on_backward(step, model)
        opt.step()
    out = rec.finish(model)
    assert len(out["mean_grad_norm"]) == len(out["moved"]) == k + 1 == len(out["pairs_per_batch"])
    assert out["pairs_per_batch"][:length] == [3 * (length - d) for d in range(length)]
    # Rows for d >= L never see a pair: no gradient, no movement; nearer rows move.
    assert all(g == 0 for g in out["mean_grad_norm"][length:])
    assert all(m == 0 for m in out["moved"][length:])
    assert all(g > 0 for g in out["mean_grad_norm"][:length])
    assert all(m > 0 for m in out["moved"][:length])
