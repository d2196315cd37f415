"""The K sweep's configuration: what it trains and evaluates, its presets (:meth:`full`,
:meth:`long`, :meth:`quick`) and the ``relpos experiment`` command that reproduces it.

How long a preset takes is stated in one place only, from its plan of runs:
:func:`relpos.training.experiment.calibrate.time_claim` (the time on the reference machine,
2 CPU cores)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["CODE_TASK", "SYNTHETIC_TASKS", "ExperimentConfig", "default_command"]

#: The real-data task (a character-level LM on Python source).
CODE_TASK = "pysrc"
SYNTHETIC_TASKS = ("recall", "agree")


@dataclass
class ExperimentConfig:
    """What the sweep trains and evaluates (defaults: the README's default run; see
    :meth:`full` and :meth:`quick`).

    Synthetic tasks use ``ks``, ``depths``, ``train_length``, ``eval_lengths``, ``steps``,
    ``batch_size``, ``lr``, ``eval_tokens``; ``pysrc`` the ``code_*`` fields (its lengths are
    ``code_train_length`` times ``code_eval_factors``; ``code_unclipped`` adds a model whose
    K covers the longest evaluation length, so no offset it meets is ever clipped).
    """

    tasks: tuple[str, ...] = ("recall", "agree", CODE_TASK)
    ks: tuple[int, ...] = (0, 2, 4, 8, 16, 32, 64)
    depths: tuple[int, ...] = (1,)
    baselines: tuple[str, ...] = ("learned",)
    seeds: tuple[int, ...] = (0, 1, 2)
    train_length: int = 64
    eval_lengths: tuple[int, ...] = (64, 128, 256, 512)
    steps: int = 120
    batch_size: int = 32
    d_model: int = 64
    num_heads: int = 4
    lr: float = 1e-2
    warmup: int = 20
    eval_tokens: int = 8192
    code_ks: tuple[int, ...] = (4, 16, 32, 64, 128)
    code_unclipped: bool = True
    code_baselines: tuple[str, ...] = ("learned",)
    code_depth: int = 2
    code_train_length: int = 128
    code_eval_factors: tuple[int, ...] = (1, 4, 8)
    code_steps: int = 150
    code_batch_size: int = 16
    code_lr: float = 3e-3
    code_eval_tokens: int = 16384
    #: Seeds of ``pysrc`` (None: ``seeds``), so a task whose seeds disagree more can have
    #: more of them.
    code_seeds: tuple[int, ...] | None = None
    #: More seeds for some ``pysrc`` models alone (``code_extra_models``: ``K=<k>`` of
    #: ``code_ks``, ``unclipped``): a comparison whose seeds spread widely gets them
    #: without every K trained again. Comparisons pair the seeds both models have.
    code_extra_seeds: tuple[int, ...] = ()
    code_extra_models: tuple[str, ...] = ()
    corpus_root: str | None = None
    threads: int = 1
    #: Runs trained at once, each in its own process with ``threads`` threads (the numbers
    #: do not depend on it); ``relpos experiment`` without ``--jobs`` runs one per usable
    #: core (:func:`~relpos.training.experiment.calibrate.default_jobs`).
    jobs: int = 1
    #: Learning curves: the synthetic tasks' ``curve_ks`` and ``pysrc``'s ``code_curve_ks``
    #: are also trained, for ``curve_seeds``, at each other budget of ``curve_steps`` /
    #: ``code_curve_steps`` (each a run of its own, with its own learning-rate schedule);
    #: the sweep's own runs give its budget's point. Budgets above the sweep's probe
    #: whether its models have stopped learning.
    curve_steps: tuple[int, ...] = ()
    code_curve_steps: tuple[int, ...] = ()
    curve_ks: tuple[int, ...] = ()
    code_curve_ks: tuple[int, ...] = ()
    curve_seeds: tuple[int, ...] = ()
    preset: str = "default"

    def __post_init__(self) -> None:
        for name in ("tasks", "ks", "depths", "baselines", "seeds", "eval_lengths", "code_ks",
                     "code_baselines", "code_eval_factors", "curve_steps", "code_curve_steps",
                     "curve_ks", "code_curve_ks", "curve_seeds", "code_extra_seeds",
                     "code_extra_models"):
            setattr(self, name, tuple(getattr(self, name)))
        unknown = [t for t in self.tasks if t not in (*SYNTHETIC_TASKS, CODE_TASK)]
        if unknown or not self.tasks:
            raise ValueError(f"unknown task(s) {unknown!r}; allowed: "
                             f"{', '.join((*SYNTHETIC_TASKS, CODE_TASK))}")
        if self.code_seeds is not None:
            self.code_seeds = tuple(self.code_seeds)
        for name in ("seeds", "code_seeds", "code_extra_seeds"):
            seeds = getattr(self, name)
            if seeds is None or (name == "code_extra_seeds" and not seeds):
                continue
            if not seeds or len(set(seeds)) != len(seeds):
                raise ValueError(f"{name} must be distinct and at least one, got {list(seeds)}")
            if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= 2**64 - 1
                   for s in seeds):
                raise ValueError(f"{name} must be ints in 0..2**64 - 1, got {list(seeds)}")
        self._check_extra_seeds()
        for name in ("tasks", "ks", "depths", "baselines", "code_ks", "code_baselines"):
            values = list(getattr(self, name))
            if len(set(values)) != len(values):  # each would train and report twice
                raise ValueError(f"{name} must be distinct, got {values}")
        for name in ("ks", "code_ks"):
            if any(isinstance(k, bool) or not isinstance(k, int) or k < 0
                   for k in getattr(self, name)):
                raise ValueError(f"{name} must be ints >= 0, got {list(getattr(self, name))}")
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1:
            raise ValueError(f"jobs must be an int >= 1, got {self.jobs!r}")
        if any(f < 1 for f in self.code_eval_factors) or 1 not in self.code_eval_factors:
            raise ValueError("code_eval_factors must be ints >= 1 and include 1, got "
                             f"{list(self.code_eval_factors)}")
        for name, full in (("curve_steps", self.steps), ("code_curve_steps", self.code_steps)):
            values = list(getattr(self, name))
            if len(set(values)) != len(values) or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 1 or v == full
                    for v in values):
                raise ValueError(f"{name} must be distinct ints >= 1 other than the sweep's "
                                 f"budget {full} (its own runs are that point), got {values}")
        for name, sweep in (("curve_ks", "ks"), ("code_curve_ks", "code_ks"),
                            ("curve_seeds", "seeds"), ("curve_seeds", "code_seeds")):
            extra = [v for v in getattr(self, name) if v not in (getattr(self, sweep)
                                                                  or self.seeds)]
            if extra or len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ValueError(f"{name} must be distinct values of {sweep} (the full "
                                 f"budget's point is the sweep's own run), got "
                                 f"{list(getattr(self, name))}")

    def _check_extra_seeds(self) -> None:
        repeated = [s for s in self.code_extra_seeds if s in self.seeds_of(CODE_TASK)]
        if repeated:
            raise ValueError(f"code_extra_seeds must not repeat the seeds of {CODE_TASK}, got "
                             f"{repeated} in both")
        models = self.code_models
        wrong = [m for m in self.code_extra_models if m not in models]
        if wrong or len(set(self.code_extra_models)) != len(self.code_extra_models):
            raise ValueError(f"code_extra_models must be distinct models of the {CODE_TASK} "
                             f"sweep ({', '.join(models)}), got {list(self.code_extra_models)}")
        if bool(self.code_extra_seeds) != bool(self.code_extra_models):
            raise ValueError(
                "code_extra_seeds and code_extra_models go together: got "
                f"{list(self.code_extra_seeds)} and {list(self.code_extra_models)}")

    @property
    def code_models(self) -> tuple[str, ...]:
        """The labels of the relative ``pysrc`` models: ``K=<k>`` and ``unclipped``."""
        return (*(f"K={k}" for k in self.code_ks), *(("unclipped",) * self.code_unclipped))

    @classmethod
    def full(cls) -> ExperimentConfig:
        """The whole study: every K, both absolute baselines, depths 1 and 2."""
        return cls(
            ks=(0, 1, 2, 4, 8, 16, 32, 64),
            depths=(1, 2),
            baselines=("learned", "sinusoidal"),
            code_ks=(0, 1, 2, 4, 8, 16, 32, 64, 128),
            code_baselines=("learned", "sinusoidal"),
            code_steps=250,
            code_eval_tokens=32768,
            preset="full",
        )

    @classmethod
    def long(cls) -> ExperimentConfig:
        """The long study: agreement and ``pysrc`` (20 seeds each) trained until learned,
        large evaluations, and the learning curves the budget was chosen from (the curve K
        at 1/4 and 1/2 of it, and ``pysrc`` at 2x and 4x it), two jobs (``reuse`` extends a
        finished sweep by its new runs alone).

        ``pysrc``'s K=128 and unclipped models get 41 more seeds (61 in all): beyond the
        training length both put every far offset on table rows no training pair reached,
        and at 8x it their seeds differ by about 0.16 bits per character."""
        return cls(
            tasks=("agree", CODE_TASK),
            ks=(4, 8, 16, 32, 64),
            depths=(1, 2),
            baselines=(),
            seeds=tuple(range(20)),
            steps=2000,
            eval_tokens=65536,
            code_ks=(4, 8, 16, 32, 64, 128),
            code_baselines=(),
            code_steps=2000,
            code_eval_tokens=131072,
            code_seeds=tuple(range(20)),
            code_extra_seeds=tuple(range(20, 61)),
            code_extra_models=("K=128", "unclipped"),
            curve_steps=(500, 1000),
            code_curve_steps=(500, 1000, 4000, 8000),
            curve_ks=(4, 16, 64),
            code_curve_ks=(4, 16, 128),
            curve_seeds=(0, 1),
            jobs=2,
            preset="long",
        )

    @classmethod
    def quick(cls) -> ExperimentConfig:
        """A small sweep: recall and ``pysrc``, fewer K, steps and evaluated tokens."""
        return cls(
            tasks=("recall", CODE_TASK),
            ks=(0, 4, 16, 64),
            baselines=(),
            steps=100,
            eval_lengths=(64, 256),
            eval_tokens=4096,
            code_ks=(4, 16, 64),
            code_baselines=(),
            code_depth=1,
            code_train_length=64,
            code_eval_factors=(1, 4),
            code_steps=60,
            code_eval_tokens=8192,
            preset="quick",
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExperimentConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def seeds_of(self, task: str) -> tuple[int, ...]:
        """The seeds ``task`` is trained with."""
        return (self.code_seeds or self.seeds) if task == CODE_TASK else self.seeds

    @property
    def main_seeds(self) -> tuple[int, ...]:
        """The seeds every model of some task is trained with, in order (``seeds``, then the
        other ``code_seeds``)."""
        used = {s for task in self.tasks for s in self.seeds_of(task)}
        order = (*self.seeds, *(s for s in self.code_seeds or () if s not in self.seeds))
        return tuple(s for s in order if s in used)

    @property
    def all_seeds(self) -> tuple[int, ...]:
        """Every seed of the sweep: :attr:`main_seeds`, then ``code_extra_seeds`` (where
        ``pysrc`` is one of the tasks)."""
        extra = self.code_extra_seeds if CODE_TASK in self.tasks else ()
        return (*self.main_seeds, *extra)

    @property
    def code_eval_lengths(self) -> tuple[int, ...]:
        return tuple(self.code_train_length * f for f in self.code_eval_factors)

    @property
    def unclipped_k(self) -> int:
        """K of the unclipped code model: no offset at any evaluated length is clipped."""
        return max(self.code_eval_lengths) - 1


def default_command(config: ExperimentConfig) -> str:
    """The ``relpos experiment`` command of a preset (custom sweeps: the preset's name)."""
    flag = {"full": " --full", "quick": " --quick", "long": " --long"}.get(config.preset, "")
    preset = {"full": ExperimentConfig.full, "quick": ExperimentConfig.quick,
              "long": ExperimentConfig.long}.get(config.preset, ExperimentConfig)()
    seeds = ""
    if config.seeds != preset.seeds:
        seeds = f" --seeds {','.join(map(str, config.seeds))}"
    if config.code_seeds is not None and config.code_seeds != preset.code_seeds:
        seeds += f" --code-seeds {','.join(map(str, config.code_seeds))}"
    if config.code_extra_seeds and config.code_extra_seeds != preset.code_extra_seeds:
        seeds += f" --code-extra-seeds {','.join(map(str, config.code_extra_seeds))}"
    if config.code_extra_models != preset.code_extra_models:
        seeds += f" --code-extra-models {','.join(config.code_extra_models) or 'none'}"
    return f"relpos experiment{flag}{seeds}"
