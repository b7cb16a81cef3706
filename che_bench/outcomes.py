"""What executing a run produced: its scores (``Scores``) and how it went (``RunResult``),
carried from the evaluation to the store."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from che_bench.config import RunConfig


@dataclass
class Scores:
    """What an evaluation measured, carried as one object from the evaluation to the store.
    Accuracies are fractions in [0, 1]: token-level (``score``, ``per_length``, ...) and exact
    match, the share of sequences whose every masked position is right (``exact_score``,
    ``exact_per_length``, ...). ``train_*``: at the in-distribution lengths; the curves map a
    length to its accuracy. A new score is one field here (and its column in the store)."""

    score: float | None = None
    train_accuracy: float | None = None
    per_length: dict[int, float] = field(default_factory=dict)
    train_per_length: dict[int, float] = field(default_factory=dict)
    exact_score: float | None = None
    train_exact_accuracy: float | None = None
    exact_per_length: dict[int, float] = field(default_factory=dict)
    train_exact_per_length: dict[int, float] = field(default_factory=dict)
    pooled_score: float | None = None
    train_pooled_accuracy: float | None = None
    correct_per_length: dict[int, int] = field(default_factory=dict)
    scored_per_length: dict[int, int] = field(default_factory=dict)
    train_correct_per_length: dict[int, int] = field(default_factory=dict)
    train_scored_per_length: dict[int, int] = field(default_factory=dict)
    prefix_length: int | None = None
    prefix_accuracies: list[float] = field(default_factory=list)

    def take_scores(self, other: Scores) -> None:
        """Copy ``other``'s scores into this object."""
        for score in dataclasses.fields(Scores):
            setattr(self, score.name, getattr(other, score.name))

    def has_exact_match(self) -> bool:
        """Whether exact match was measured (stores of schema 2 have none)."""
        return (
            self.exact_score is not None
            or self.train_exact_accuracy is not None
            or bool(self.exact_per_length)
            or bool(self.train_exact_per_length)
        )

    def has_pooled_counts(self) -> bool:
        """Whether the pooled counts and the prefix curve were measured (stores of schema 3
        and older have none)."""
        return self.pooled_score is not None or bool(self.scored_per_length)


@dataclass(kw_only=True)
class RunResult(Scores):
    """Outcome of ``execute_run`` (picklable): its scores (``Scores``) and how it went."""

    run_id: str
    config: RunConfig
    status: str  # "complete" | "failed"
    #: Training history rows (``che_bench.train.history``), also of failed runs.
    history: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    #: The plugins behind its task, encoding and model, with their versions and source hashes
    #: (``che_bench.plugins.provenance_of``; {} for che-bench's own).
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)
    device: str = ""
    #: ``model.describe()`` plus anything else worth keeping (e.g. a failure's traceback).
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["config"] = self.config.to_dict()
        for name in _CURVE_FIELDS:
            data[name] = {str(n): acc for n, acc in getattr(self, name).items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        data = dict(data)
        data["config"] = RunConfig.from_dict(data["config"])
        for name in _CURVE_FIELDS:
            data[name] = {int(n): acc for n, acc in data.get(name, {}).items()}
        return cls(**data)


#: The per-length curves of ``Scores`` (JSON keys are strings).
_CURVE_FIELDS = tuple(
    score.name for score in dataclasses.fields(Scores) if score.name.endswith("per_length")
)
