"""eole's own command line with relpos: ``eole build_vocab``, then ``train`` and ``predict``
through the entry script the README documents (``patch_on_build()`` then eole's ``main()``), on
a tiny Shaw model (``position_encoding_type: Relative``) and tiny corpora written here; nothing
is downloaded. Each patched build says so in eole's log."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

# eole is in the dev extra: without it this import fails (the tests never skip silently).
from eole.config.inference import InferenceConfig
from eole.config.models import TransformerModelConfig
from eole.inputters.inputter import dict_to_vocabs
from eole.models.model import BaseModel, get_model_class

import relpos.integrations.eole as rp_eole

# eole's configs call pydantic's deprecated v1 methods on every update.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:eole")

TOKENS = ["<unk>", "<blank>", "<s>", "</s>"] + [f"w{i}" for i in range(12)]

# The README's entry script ("Train and translate with eole").
ENTRY = """\
import relpos.integrations.eole
relpos.integrations.eole.patch_on_build()   # eole models built from here on use relpos

if __name__ == "__main__":
    from eole.bin.main import main
    main()
"""

CONFIG = """\
save_data: run
src_vocab: run/vocab.src
tgt_vocab: run/vocab.tgt
share_vocab: true
n_sample: {n_sample}
overwrite: true
seed: 1
data:
  corpus_1:
    path_src: src.txt
    path_tgt: tgt.txt
model:
  architecture: transformer
  layers: 1
  hidden_size: 16
  heads: 2
  transformer_ff: 32
  embeddings:
    word_vec_size: 16
    position_encoding_type: Relative
    n_positions: 3
training:
  model_path: run/model
  train_steps: 3
  valid_steps: 1000
  save_checkpoint_steps: 3
  batch_size: 16
  batch_type: sents
  bucket_size: 64
  prefetch_factor: 1
  num_workers: 0
  world_size: 1
  gpu_ranks: []
"""

LOG_LINE = ("relpos: patched 2 self-attention layers of EncoderDecoderModel "
            "(position_encoding_type=Relative, n_positions=3)")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _build(position: str) -> BaseModel:
    options: dict = dict(
        hidden_size=16, heads=2, transformer_ff=32, layers=2,
        embeddings={"word_vec_size": 16, "position_encoding_type": position, "n_positions": 5},
    )
    if position == "Rotary":
        options["rope_config"] = {}  # eole's validator fails to default it at model level
    config = TransformerModelConfig(**options)
    vocabs = dict_to_vocabs({
        "src": TOKENS, "tgt": TOKENS, "decoder_start_token": "<s>",
        "specials": {"bos_token": "<s>", "pad_token": "<blank>", "eos_token": "</s>",
                     "unk_token": "<unk>"},
    })
    running = InferenceConfig(self_attn_backend="pytorch")
    return get_model_class(config).build(config, vocabs, running)


def test_patch_on_build_logs_each_patched_model_in_eoles_log(monkeypatch):
    monkeypatch.setattr(BaseModel, "build", BaseModel.__dict__["build"])  # restored afterwards
    eole_logger = logging.getLogger("eole")
    handler = _Lines()
    level = eole_logger.level
    eole_logger.setLevel(logging.INFO)
    eole_logger.addHandler(handler)
    try:
        rp_eole.patch_on_build()
        rp_eole.patch_on_build()  # once is enough: one line per model, not two
        assert rp_eole.is_patched(_build("Relative"))
        assert not rp_eole.is_patched(_build("Rotary"))  # built as before, and not logged
        assert rp_eole.is_patched(_build("Relative"))
    finally:
        eole_logger.removeHandler(handler)
        eole_logger.setLevel(level)
    ours = [line for line in handler.lines if line.startswith("relpos:")]
    want = ("relpos: patched 4 self-attention layers of EncoderDecoderModel "
            "(position_encoding_type=Relative, n_positions=5)")
    assert ours == [want, want]


def _corpora(directory: Path) -> None:
    rng = random.Random(0)
    words = TOKENS[4:]
    src, tgt = [], []
    for _ in range(48):
        sentence = [rng.choice(words) for _ in range(rng.randint(3, 8))]
        src.append(" ".join(sentence))
        tgt.append(" ".join(reversed(sentence)))
    (directory / "src.txt").write_text("\n".join(src) + "\n")
    (directory / "tgt.txt").write_text("\n".join(tgt) + "\n")
    (directory / "test.txt").write_text("\n".join(src[:4]) + "\n")


def _run(args: list[str], cwd: Path) -> str:
    """Run a command in ``cwd`` (3 minutes at most); returns its output, fails on an error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=180, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    return output


def test_eole_cli_builds_vocab_trains_and_predicts_through_relpos(tmp_path):
    _corpora(tmp_path)
    (tmp_path / "vocab.yaml").write_text(CONFIG.format(n_sample=-1))
    (tmp_path / "train.yaml").write_text(CONFIG.format(n_sample=0))
    (tmp_path / "eole_relpos.py").write_text(ENTRY)
    script = Path(sys.executable).parent / "eole"  # eole's console script, beside this python
    eole = [str(script)] if script.exists() else [sys.executable, "-m", "eole.bin.main"]

    # eole's own command (it imports every eole tool: aiohttp comes with relpos[eole]).
    vocab_log = _run([*eole, "build_vocab", "-config", "vocab.yaml"], tmp_path)
    assert "ModuleNotFoundError" not in vocab_log
    vocab = (tmp_path / "run" / "vocab.src").read_text().split("\n")
    assert {line.split("\t")[0] for line in vocab if line} == set(TOKENS[4:])

    train_log = _run([sys.executable, "eole_relpos.py", "train", "-config", "train.yaml"],
                     tmp_path)
    assert LOG_LINE in train_log, train_log[-4000:]
    assert (tmp_path / "run" / "model" / "model.00.safetensors").is_file()

    predict_log = _run(
        [sys.executable, "eole_relpos.py", "predict", "-model_path", "run/model", "-src",
         "test.txt", "-output", "pred.txt", "-beam_size", "2", "-min_length", "2",
         "-max_length", "12"], tmp_path,
    )
    assert LOG_LINE in predict_log, predict_log[-4000:]
    predictions = (tmp_path / "pred.txt").read_text().splitlines()
    assert len(predictions) == 4 and all(predictions), predictions
    assert all(set(p.split()) <= set(TOKENS) for p in predictions), predictions
