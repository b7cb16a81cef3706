"""The result store's queries: runs, their curves, evaluations and training histories, as
data frames (``ResultStore`` inherits them)."""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pandas as pd

from che_bench.config import RunConfig
from che_bench.errors import CheBenchError
from che_bench.protocol import EVAL_SEED, format_lengths
from che_bench.store.schema import CONFIG_COLUMNS, RUN_COLUMNS
from che_bench.train.history import HISTORY_FIELDS

#: ``evaluation`` argument of the readers: each run's own original evaluation.
ORIGINAL = "original"


def describe_protocol(protocol: dict[str, Any]) -> str:
    """One line about an evaluation protocol, e.g. ``test lengths 41..1000, 512 samples
    (batch 64), in-distribution 1..40 (5 lengths), dropout at eval``."""
    parts = [f"test lengths {format_lengths(protocol['test_lengths'])}"]
    if protocol["score_from_42"]:
        parts.append("score from 42")
    parts.append(f"{protocol['eval_samples']} samples (batch {protocol['eval_batch_size']})")
    parts.append(f"in-distribution {format_lengths(protocol['train_eval_lengths'])}")
    if protocol["eval_seed"] != EVAL_SEED:
        parts.append(f"eval seed {protocol['eval_seed']}")
    if protocol["dropout_at_eval"]:
        parts.append("dropout at eval")
    if protocol.get("eval_task_params"):
        given = ", ".join(f"{key}={value}" for key, value in protocol["eval_task_params"].items())
        parts.append(f"task {given}")
    return ", ".join(parts)


class StoreReads:
    """The reading methods of ``ResultStore`` (which provides ``_connect`` and ``path``)."""

    path: Path

    def _connect(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError  # ResultStore's

    def completed_run_ids(self) -> set[str]:
        with self._connect() as connection:
            rows = connection.execute("SELECT run_id FROM runs WHERE status = 'complete'")
            return {row[0] for row in rows}

    def run_details(self, run_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """What was recorded about each run besides its results (model, pack, tf32, ...)."""
        where, params = run_filter("r", run_ids)
        with self._connect() as connection:
            rows = connection.execute(f"SELECT r.run_id, r.details FROM runs r {where}", params)
            return {run_id: json.loads(text or "{}") for run_id, text in rows}

    def run_configs(self, run_ids: Iterable[str]) -> dict[str, RunConfig]:
        """Each run's configuration as recorded when it started."""
        where, params = run_filter("r", run_ids)
        with self._connect() as connection:
            rows = connection.execute(f"SELECT r.run_id, r.config FROM runs r {where}", params)
            return {run_id: RunConfig.from_dict(json.loads(text)) for run_id, text in rows}

    def run_plugins(self, run_ids: Iterable[str]) -> dict[str, dict[str, Any] | None]:
        """The plugins each run recorded using (``che_bench.plugins.provenance_of``: {} for
        che-bench's own). A run stored before schema 4 has the plugin versions its versions
        name (``"plugin LABEL": version``, "(module)" for none) without source hashes, or
        None (not recorded) where they name none."""
        where, params = run_filter("r", run_ids)
        with self._connect() as connection:
            rows = connection.execute(
                f"SELECT r.run_id, r.plugins, r.versions FROM runs r {where}", params
            ).fetchall()
        return {
            run_id: json.loads(used) if used is not None else _plugins_in_versions(versions)
            for run_id, used, versions in rows
        }

    def runs(
        self, run_ids: Iterable[str] | None = None, evaluation: str = ORIGINAL
    ) -> pd.DataFrame:
        """One row per run, oldest first; ``kernel`` is None without DAPE. ``score``,
        ``train_accuracy``, ``exact_score``, ``train_exact_accuracy`` (NaN where exact match
        was not recorded), ``pooled_score``, ``train_pooled_accuracy`` (NaN where pooled
        counts were not recorded) and ``EVALUATION_COLUMNS`` come from ``evaluation``:
        ``"original"`` (every run, each with its original evaluation where it has one) or a
        protocol id (only the runs evaluated under it)."""
        run_columns = ", ".join(f"r.{column}" for column in RUN_COLUMNS)
        with self._connect() as connection:
            join, params = self._evaluation_join(connection, evaluation)
            frame = pd.read_sql_query(
                f"""SELECT {run_columns}, e.score, e.train_accuracy, e.exact_score,
                           e.train_exact_accuracy, e.pooled_score, e.train_pooled_accuracy,
                           e.evaluation_id AS evaluation, e.protocol,
                           e.device AS eval_device, e.timings AS eval_timings
                    FROM runs r {join}
                    ORDER BY r.created_at, r.run_id""",
                connection,
                params=params,
            )
        return _selected(frame, run_ids)

    def per_length(
        self, run_ids: Iterable[str] | None = None, evaluation: str = ORIGINAL
    ) -> pd.DataFrame:
        """Per-length accuracies of complete runs under ``evaluation`` (as in ``runs``):
        ``accuracy``, ``exact_accuracy``, and the ``correct`` and ``scored`` positions with
        their ratio ``pooled_accuracy`` (NaN where not recorded), with the evaluation id and
        the run's identifying columns."""
        with self._connect() as connection:
            join, params = self._evaluation_join(connection, evaluation, inner=True)
            config_columns = ", ".join(f"r.{column}" for column in CONFIG_COLUMNS)
            frame = pd.read_sql_query(
                f"""SELECT r.run_id, e.evaluation_id AS evaluation, {config_columns}, a.split,
                           a.length, a.accuracy, a.exact_accuracy, a.correct, a.scored,
                           CAST(a.correct AS REAL) / a.scored AS pooled_accuracy
                    FROM runs r {join}
                    JOIN accuracies a
                        ON a.run_id = e.run_id AND a.evaluation_id = e.evaluation_id
                    WHERE r.status = 'complete'
                    ORDER BY r.created_at, r.run_id, a.split, a.length""",
                connection,
                params=params,
            )
        return _selected(frame, run_ids)

    def prefix_curves(
        self, run_ids: Iterable[str] | None = None, evaluation: str = ORIGINAL
    ) -> pd.DataFrame:
        """DeltaProduct's cumulative sequence accuracy of complete runs under ``evaluation``
        (as in ``runs``): one row per run and output position: ``run_id``, ``evaluation``,
        ``length`` (the test length it was measured at), ``position`` (t, from 0) and
        ``accuracy`` (the share of sequences with every scored position 0..t right); runs
        evaluated before it was recorded have no rows."""
        with self._connect() as connection:
            join, params = self._evaluation_join(connection, evaluation, inner=True)
            stored = connection.execute(
                f"""SELECT r.run_id, e.evaluation_id, e.prefix_length, e.prefix_accuracies
                    FROM runs r {join}
                    WHERE r.status = 'complete' AND e.prefix_accuracies IS NOT NULL
                    ORDER BY r.created_at, r.run_id""",
                params,
            ).fetchall()
        rows = [
            (run_id, evaluation_id, length, position, accuracy)
            for run_id, evaluation_id, length, curve in stored
            for position, accuracy in enumerate(json.loads(curve))
        ]
        frame = pd.DataFrame(
            rows, columns=["run_id", "evaluation", "length", "position", "accuracy"]
        )
        if run_ids is not None:
            frame = frame[frame["run_id"].isin(set(run_ids))]
        return frame.reset_index(drop=True)

    def history(self, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
        """Training history rows (``che_bench.train.history.HISTORY_FIELDS``) with their ``run_id``,
        of every run or of ``run_ids``, by run (oldest first) and step; non-finite values read
        back as NaN."""
        where, params = run_filter("h", run_ids)
        with self._connect() as connection:
            frame = pd.read_sql_query(
                f"""SELECT h.run_id, {", ".join(f"h.{name}" for name in HISTORY_FIELDS)}
                    FROM history h JOIN runs r ON r.run_id = h.run_id {where}
                    ORDER BY r.created_at, r.run_id, h.step""",
                connection,
                params=params,
            )
        return frame.astype({name: float for name in HISTORY_FIELDS[1:]})

    def lowest_losses(self, run_ids: Iterable[str] | None = None) -> pd.Series:
        """Each run's lowest logged training loss (NaN when every logged loss was not finite),
        indexed by run id, for the runs with a history (of ``run_ids``)."""
        where, params = run_filter("h", run_ids)
        with self._connect() as connection:
            rows = connection.execute(
                f"SELECT h.run_id, min(h.loss) FROM history h {where} GROUP BY h.run_id", params
            ).fetchall()
        return pd.Series(
            {run_id: math.nan if loss is None else loss for run_id, loss in rows}, dtype=float
        )

    def evaluations(self, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
        """One row per evaluation, oldest first: ``evaluation`` (protocol id), ``run_id``,
        ``original`` (bool), ``protocol`` (a readable summary), ``score``, ``train_accuracy``,
        ``device``, ``versions`` (JSON) and ``created_at``."""
        with self._connect() as connection:
            frame = pd.read_sql_query(
                """SELECT evaluation_id AS evaluation, run_id, is_original AS original, protocol,
                          score, train_accuracy, device, versions, created_at
                   FROM evaluations ORDER BY created_at, run_id, is_original DESC, evaluation_id""",
                connection,
            )
        frame["original"] = frame["original"].astype(bool)
        frame["protocol"] = [describe_protocol(json.loads(text)) for text in frame["protocol"]]
        if run_ids is not None:
            frame = frame[frame["run_id"].isin(set(run_ids))]
        return frame.reset_index(drop=True)

    def _evaluation_join(
        self, connection: sqlite3.Connection, evaluation: str, *, inner: bool = False
    ) -> tuple[str, tuple]:
        """SQL joining ``runs r`` to the chosen evaluation ``e`` of each run, and its parameters;
        an unknown evaluation id is a CheBenchError listing the known ones."""
        if evaluation == ORIGINAL:
            kind = "JOIN" if inner else "LEFT JOIN"
            return f"{kind} evaluations e ON e.run_id = r.run_id AND e.is_original = 1", ()
        known = [
            row[0]
            for row in connection.execute(
                "SELECT DISTINCT evaluation_id FROM evaluations ORDER BY evaluation_id"
            )
        ]
        if evaluation not in known:
            listed = ", ".join([ORIGINAL, *known[:20]]) + (", ..." if len(known) > 20 else "")
            raise CheBenchError(
                f"unknown evaluation {evaluation!r} in {self.path}; known: {listed} "
                "(see `che-bench evaluations`)"
            )
        return "JOIN evaluations e ON e.run_id = r.run_id AND e.evaluation_id = ?", (evaluation,)


def _plugins_in_versions(versions: str | None) -> dict[str, Any] | None:
    """The plugins a run's versions (JSON) name, as ``run_plugins`` gives them; None: none."""
    used = {
        key.removeprefix("plugin "): {
            "version": None if version == "(module)" else version,
            "source": None,
        }
        for key, version in json.loads(versions or "{}").items()
        if key.startswith("plugin ")
    }
    return used or None


def run_filter(alias: str, run_ids: Iterable[str] | None) -> tuple[str, tuple]:
    """SQL ``WHERE`` clause restricting table ``alias`` to ``run_ids`` (none: every run), and
    its parameter (one JSON list, however many ids)."""
    if run_ids is None:
        return "", ()
    return f"WHERE {alias}.run_id IN (SELECT value FROM json_each(?))", (json.dumps(list(run_ids)),)


def _selected(frame: pd.DataFrame, run_ids: Iterable[str] | None) -> pd.DataFrame:
    """``frame`` with plain-int kernels, restricted to ``run_ids`` when given."""
    frame["kernel"] = _nullable_ints(frame["kernel"])
    if run_ids is not None:
        frame = frame[frame["run_id"].isin(set(run_ids))]
    return frame.reset_index(drop=True)


def _nullable_ints(column: pd.Series) -> pd.Series:
    """SQLite NULLs come back as NaN in a float column; keep None and plain ints instead."""
    values = [None if pd.isna(value) else int(value) for value in column]
    return pd.Series(values, index=column.index, dtype=object)
