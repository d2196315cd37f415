"""``relpos train``'s output: the loss unit, and evaluation lines without the progress bar."""

from __future__ import annotations

import math

import torch

from relpos.cli import main


def test_no_progress_keeps_the_evaluation_lines_and_losses_say_their_unit(tmp_path, capsys):
    before = torch.get_num_threads()
    code = main(["train", "--task", "recall", "--distances", "1,2", "--length", "8", "--steps",
                 "4", "--eval-every", "2", "--batch-size", "4", "--d-model", "16", "--heads",
                 "2", "--layers", "1", "-k", "2", "--no-progress", "--out", str(tmp_path / "r")])
    torch.set_num_threads(before)
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    periodic = [line for line in lines if line.startswith("step 2: eval loss ")]
    assert len(periodic) == 1 and " nats (" in periodic[0] and " bits) " in periodic[0], out
    final = next(line for line in lines if line.lstrip().startswith("length"))
    nats = float(final.split("loss ")[1].split(" nats")[0])
    bits = float(final.split(" nats (")[1].split(" bits")[0])
    assert math.isclose(bits, nats / math.log(2), abs_tol=1e-4), final
    assert "train" not in err  # no progress bar
