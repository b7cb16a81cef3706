"""What the result store checks before it writes an evaluation, and the rows it writes."""

from __future__ import annotations

import json
import math
import sqlite3
from typing import Any

from che_bench.config import Scores
from che_bench.errors import CheBenchError
from che_bench.protocol import format_lengths
from che_bench.store.schema import now
from che_bench.train.history import HISTORY_FIELDS


def check_accuracy(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise CheBenchError(f"{name} must be an accuracy in [0, 1], got {value!r}")


def check_curve(split: str, curve: dict[int, float], lengths: list[int]) -> None:
    """A re-evaluation's curve must hold one accuracy per length of its protocol."""
    if sorted(curve) != sorted(lengths):
        raise CheBenchError(
            f"the {split} accuracies cover lengths {format_lengths(curve)}, the protocol's "
            f"{split} lengths are {format_lengths(lengths)}"
        )
    for length, accuracy in curve.items():
        check_accuracy(f"{split} accuracy at length {length}", accuracy)


def delete_evaluation(connection: sqlite3.Connection, run_id: str, evaluation_id: str) -> None:
    connection.execute(
        "DELETE FROM accuracies WHERE run_id = ? AND evaluation_id = ?", (run_id, evaluation_id)
    )
    connection.execute(
        "DELETE FROM evaluations WHERE run_id = ? AND evaluation_id = ?", (run_id, evaluation_id)
    )


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
                                    exact_score, train_exact_accuracy)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
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
        ),
    )
    accuracies = [
        (run_id, evaluation_id, "test", n, acc, scores.exact_per_length.get(n))
        for n, acc in scores.per_length.items()
    ]
    accuracies += [
        (run_id, evaluation_id, "train", n, acc, scores.train_exact_per_length.get(n))
        for n, acc in scores.train_per_length.items()
    ]
    connection.executemany(
        """INSERT INTO accuracies (run_id, evaluation_id, split, length, accuracy, exact_accuracy)
           VALUES (?, ?, ?, ?, ?, ?)""",
        accuracies,
    )


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
