"""The result store's writes: a run's start, a finished run, a re-evaluation (``ResultStore``
inherits them), what it checks before it writes an evaluation, and the rows it writes."""

from __future__ import annotations

import json
import math
import sqlite3
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from che_bench.config import RunConfig, protocol_id
from che_bench.errors import CheBenchError
from che_bench.outcomes import RunResult, Scores
from che_bench.protocol import format_lengths
from che_bench.store.schema import CONFIG_COLUMNS, checked_protocol, now
from che_bench.train.history import HISTORY_FIELDS


def check_accuracy(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise CheBenchError(f"{name} must be an accuracy in [0, 1], got {value!r}")


def check_curve(
    split: str, curve: dict[int, Any], lengths: list[int], *, counts: bool = False
) -> None:
    """A re-evaluation's curve must hold one accuracy (with ``counts``: one count, an
    integer >= 0) per length of its protocol."""
    what = "counts" if counts else "accuracies"
    if sorted(curve) != sorted(lengths):
        raise CheBenchError(
            f"the {split} {what} cover lengths {format_lengths(curve)}, the protocol's "
            f"{split} lengths are {format_lengths(lengths)}"
        )
    for length, value in curve.items():
        if not counts:
            check_accuracy(f"{split} accuracy at length {length}", value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheBenchError(f"{split} count at length {length} must be >= 0, got {value!r}")


def delete_evaluation(connection: sqlite3.Connection, run_id: str, evaluation_id: str) -> None:
    connection.execute(
        "DELETE FROM accuracies WHERE run_id = ? AND evaluation_id = ?", (run_id, evaluation_id)
    )
    connection.execute(
        "DELETE FROM evaluations WHERE run_id = ? AND evaluation_id = ?", (run_id, evaluation_id)
    )


def delete_evaluations(connection: sqlite3.Connection, run_id: str) -> None:
    """Every evaluation of ``run_id`` (original and re-evaluations) with its curves."""
    connection.execute("DELETE FROM accuracies WHERE run_id = ?", (run_id,))
    connection.execute("DELETE FROM evaluations WHERE run_id = ?", (run_id,))


def replaces_other_code(stored: tuple | None, result: RunResult) -> bool:
    """Whether ``result`` replaces a complete run (``stored``: its ``plugins`` column, None
    when there is no complete run) that recorded other plugins than ``result`` did."""
    return stored is not None and stored[0] is not None and json.loads(stored[0]) != result.plugins


def check_scores(scores: Scores, protocol: dict[str, Any]) -> None:
    """Every accuracy in [0, 1], every curve over exactly the protocol's lengths."""
    checked = [("score", scores.score), ("train_accuracy", scores.train_accuracy)]
    curves = [
        ("test", scores.per_length, "test_lengths"),
        ("in-distribution", scores.train_per_length, "train_eval_lengths"),
    ]
    if scores.has_exact_match():
        checked += [
            ("exact_score", scores.exact_score),
            ("train_exact_accuracy", scores.train_exact_accuracy),
        ]
        curves += [
            ("exact-match test", scores.exact_per_length, "test_lengths"),
            ("exact-match in-distribution", scores.train_exact_per_length, "train_eval_lengths"),
        ]
    for name, value in checked:
        check_accuracy(name, value)
    for split, curve, lengths in curves:
        check_curve(split, curve, protocol[lengths])
    if scores.has_pooled_counts():
        check_pooled_counts(scores, protocol)


def check_pooled_counts(scores: Scores, protocol: dict[str, Any]) -> None:
    """Counts over exactly the protocol's lengths, none correct beyond those scored; the
    pooled scores accuracies (or None: nothing scored); a prefix curve of accuracies at the
    longest test length."""
    for split, correct, scored, lengths in (
        ("test", scores.correct_per_length, scores.scored_per_length, "test_lengths"),
        (
            "in-distribution",
            scores.train_correct_per_length,
            scores.train_scored_per_length,
            "train_eval_lengths",
        ),
    ):
        for name, counts in (("correct", correct), ("scored", scored)):
            check_curve(f"{split} {name}-position", counts, protocol[lengths], counts=True)
        if any(correct[n] > scored[n] for n in scored):
            raise CheBenchError(f"more correct than scored {split} positions")
    for name in ("pooled_score", "train_pooled_accuracy"):
        if getattr(scores, name) is not None:
            check_accuracy(name, getattr(scores, name))
    if scores.prefix_length != max(protocol["test_lengths"]):
        raise CheBenchError(
            f"the prefix curve is at length {scores.prefix_length}, the protocol's longest "
            f"test length is {max(protocol['test_lengths'])}"
        )
    for position, accuracy in enumerate(scores.prefix_accuracies):
        check_accuracy(f"prefix accuracy at position {position}", accuracy)


def insert_evaluation(
    connection: sqlite3.Connection,
    run_id: str,
    evaluation_id: str,
    protocol: dict[str, Any],
    scores: Scores,
    *,
    is_original: bool,
    device: str,
    versions: dict[str, str],
    timings: dict[str, float],
) -> None:
    connection.execute(
        """INSERT INTO evaluations (run_id, evaluation_id, protocol, is_original, score,
                                    train_accuracy, device, versions, timings, created_at,
                                    exact_score, train_exact_accuracy, pooled_score,
                                    train_pooled_accuracy, prefix_length, prefix_accuracies)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
        (
            run_id,
            evaluation_id,
            json.dumps(protocol),
            int(is_original),
            scores.score,
            scores.train_accuracy,
            device,
            json.dumps(versions),
            json.dumps(timings),
            now(),
            scores.exact_score,
            scores.train_exact_accuracy,
            scores.pooled_score,
            scores.train_pooled_accuracy,
            scores.prefix_length,
            json.dumps(scores.prefix_accuracies) if scores.prefix_accuracies else None,
        ),
    )
    accuracies = [(run_id, evaluation_id, *row) for row in _accuracy_rows(scores)]
    connection.executemany(
        """INSERT INTO accuracies (run_id, evaluation_id, split, length, accuracy, exact_accuracy,
                                   correct, scored)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
        accuracies,
    )


def _accuracy_rows(scores: Scores) -> list[tuple]:
    """The ``accuracies`` rows of ``scores`` after their run and evaluation ids: split,
    length, accuracy, exact accuracy, correct and scored positions (None where not
    measured)."""
    return [
        (split, n, accuracy, exact.get(n), correct.get(n), scored.get(n))
        for split, curve, exact, correct, scored in (
            (
                "test",
                scores.per_length,
                scores.exact_per_length,
                scores.correct_per_length,
                scores.scored_per_length,
            ),
            (
                "train",
                scores.train_per_length,
                scores.train_exact_per_length,
                scores.train_correct_per_length,
                scores.train_scored_per_length,
            ),
        )
        for n, accuracy in curve.items()
    ]


def replace_history(
    connection: sqlite3.Connection, run_id: str, rows: list[dict[str, Any]]
) -> None:
    """A run's training history rows, replacing any earlier ones (non-finite values: NULL)."""
    connection.execute("DELETE FROM history WHERE run_id = ?", (run_id,))
    connection.executemany(
        f"INSERT INTO history (run_id, {', '.join(HISTORY_FIELDS)}) "
        f"VALUES (?, {', '.join('?' for _ in HISTORY_FIELDS)})",
        [(run_id, *(finite_or_none(row[name]) for name in HISTORY_FIELDS)) for row in rows],
    )


def finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


#: ``CONFIG_COLUMNS`` in SQL, and a placeholder for each.
_CONFIG_NAMES, _CONFIG_MARKS = ", ".join(CONFIG_COLUMNS), ", ".join("?" for _ in CONFIG_COLUMNS)


def config_values(config: RunConfig) -> tuple:
    """The values of ``CONFIG_COLUMNS`` for a run of ``config``."""
    return tuple(getattr(config, column) for column in CONFIG_COLUMNS)


def run_row(result: RunResult) -> tuple:
    """The ``runs`` row of a finished run, in ``record``'s column order."""
    config = result.config
    return (
        result.run_id,
        *config_values(config),
        result.status,
        result.score,
        result.train_accuracy,
        json.dumps(config.to_dict()),
        json.dumps(result.versions),
        result.device,
        json.dumps(result.timings),
        json.dumps(result.details, default=str),
        result.error,
        json.dumps(result.plugins),
        now(),
        now(),
    )


class StoreWrites:
    """The writing methods of ``ResultStore`` (which provides ``_transaction`` and ``path``)."""

    path: Path

    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError  # ResultStore's

    def mark_started(self, config: RunConfig) -> None:
        """Record that a run begins (a complete run is left untouched)."""
        run_id = config.run_id()
        with self._transaction() as connection:
            connection.execute(
                f"""INSERT INTO runs (run_id, {_CONFIG_NAMES}, status, config, created_at)
                    VALUES (?, {_CONFIG_MARKS}, 'started', ?, ?)
                    ON CONFLICT (run_id) DO UPDATE SET
                        status = 'started', attempts = attempts + 1, error = NULL,
                        finished_at = NULL
                    WHERE status != 'complete'""",
                (run_id, *config_values(config), json.dumps(config.to_dict()), now()),
            )

    def record(self, result: RunResult) -> None:
        """Write a finished run (row with its plugins' provenance, original evaluation and its
        curves, training history) in one transaction. The run's re-evaluations are kept,
        unless it replaces a complete run made with other plugin code (``--rerun-stale``):
        they evaluated the model it replaces."""
        config = result.config
        protocol = config.evaluation_protocol()
        evaluation_id = protocol_id(protocol)
        with self._transaction() as connection:
            stored = connection.execute(
                "SELECT plugins FROM runs WHERE run_id = ? AND status = 'complete'",
                (result.run_id,),
            ).fetchone()
            connection.execute(
                f"""INSERT INTO runs (run_id, {_CONFIG_NAMES}, status, score, train_accuracy,
                                      config, versions, device, timings, details, error,
                                      plugins, created_at, finished_at)
                    VALUES (?, {_CONFIG_MARKS}, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (run_id) DO UPDATE SET
                        status = excluded.status, score = excluded.score,
                        train_accuracy = excluded.train_accuracy, config = excluded.config,
                        versions = excluded.versions, device = excluded.device,
                        timings = excluded.timings, details = excluded.details,
                        error = excluded.error, plugins = excluded.plugins,
                        finished_at = excluded.finished_at""",
                run_row(result),
            )
            if replaces_other_code(stored, result):
                delete_evaluations(connection, result.run_id)
            else:
                delete_evaluation(connection, result.run_id, evaluation_id)
            if result.status == "complete" or result.per_length or result.train_per_length:
                insert_evaluation(
                    connection,
                    result.run_id,
                    evaluation_id,
                    protocol,
                    result,
                    is_original=True,
                    device=result.device,
                    versions=result.versions,
                    timings=result.timings,
                )
            replace_history(connection, result.run_id, result.history)

    def record_evaluation(
        self,
        run_id: str,
        protocol: dict[str, Any],
        scores: Scores,
        *,
        device: str,
        versions: dict[str, str],
        timings: dict[str, float],
    ) -> str:
        """Record a re-evaluation of complete run ``run_id`` under ``protocol`` (a dict like
        ``RunConfig.evaluation_protocol()``) with its ``scores`` in one transaction, replacing
        an earlier one under the same protocol; returns the evaluation id (the protocol's id).
        The curves must cover exactly the protocol's test and in-distribution lengths; the
        exact-match values come all together or not at all."""
        protocol = checked_protocol(protocol)
        check_scores(scores, protocol)
        evaluation_id = protocol_id(protocol)
        with self._transaction() as connection:
            run = connection.execute(
                "SELECT status FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            if run is None:
                raise CheBenchError(f"no run {run_id!r} in result store {self.path}")
            if run[0] != "complete":
                raise CheBenchError(
                    f"run {run_id} is {run[0]}, not complete: nothing to re-evaluate"
                )
            original = connection.execute(
                "SELECT evaluation_id FROM evaluations WHERE run_id = ? AND is_original = 1",
                (run_id,),
            ).fetchone()
            if original is not None and original[0] == evaluation_id:
                raise CheBenchError(
                    f"protocol {evaluation_id} is the original evaluation of run {run_id}; "
                    "re-evaluate under another protocol"
                )
            delete_evaluation(connection, run_id, evaluation_id)
            insert_evaluation(
                connection,
                run_id,
                evaluation_id,
                protocol,
                scores,
                is_original=False,
                device=device,
                versions=versions,
                timings=timings,
            )
        return evaluation_id
