"""ResultStore: creation, refusal of foreign files, atomic writes, several writer processes.

The RunResults here are SYNTHETIC fixtures (made-up accuracies), used only to test the
bookkeeping; they are not results of any model.
"""

from __future__ import annotations

import multiprocessing
import sqlite3

import pytest

from che_bench.errors import CheBenchError
from che_bench.config import RunResult, make_config
from che_bench.store import APPLICATION_ID, ResultStore


def synthetic_result(
    task: str = "even_pairs",
    pe: str = "kerple",
    kernel: int | None = None,
    seed: int = 0,
    score: float = 0.5,
    status: str = "complete",
    **overrides,
) -> RunResult:
    """A made-up complete run: every test length has accuracy ``score``."""
    config = make_config(task, pe, kernel, "smoke", seed=seed, **overrides)
    complete = status == "complete"
    return RunResult(
        run_id=config.run_id(),
        config=config,
        status=status,
        score=score if complete else None,
        train_accuracy=0.9 if complete else None,
        per_length={n: score for n in config.test_lengths} if complete else {},
        train_per_length={n: 0.9 for n in config.train_eval_lengths} if complete else {},
        error=None if complete else "synthetic failure",
        timings={"train_s": 1.0, "eval_s": 0.5, "total_s": 1.5},
        versions={"che_bench": "synthetic"},
        device="synthetic",
    )


def test_new_store_is_marked_and_reopens(tmp_path):
    path = tmp_path / "sub" / "store.sqlite"
    ResultStore(path)
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert ResultStore(path).runs().empty


def test_foreign_files_are_refused_untouched(tmp_path):
    text_file = tmp_path / "notes.sqlite"
    text_file.write_bytes(b"my thesis draft, not a database\n" * 100)
    other_db = tmp_path / "other.sqlite"
    with sqlite3.connect(other_db) as connection:
        connection.execute("CREATE TABLE runs (x)")
    before = {path: path.read_bytes() for path in (text_file, other_db)}
    for path in before:
        with pytest.raises(CheBenchError, match="not a che-bench result store"):
            ResultStore(path)
        assert path.read_bytes() == before[path]


def test_record_and_read_back(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    result = synthetic_result(kernel=3, score=0.75)
    store.mark_started(result.config)
    assert store.runs()["status"].tolist() == ["started"]
    assert store.completed_run_ids() == set()
    store.record(result)

    runs = store.runs()
    assert runs["status"].tolist() == ["complete"]
    assert runs["kernel"].tolist() == [3]
    assert runs["score"].tolist() == [0.75]
    assert store.completed_run_ids() == {result.run_id}
    curves = store.per_length()
    test = curves[curves["split"] == "test"]
    assert sorted(test["length"]) == list(result.config.test_lengths)
    assert set(curves["split"]) == {"test", "train"}


def test_complete_run_is_not_reset_by_mark_started(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    result = synthetic_result()
    store.record(result)
    store.mark_started(result.config)
    assert store.runs()["status"].tolist() == ["complete"]


def test_a_failing_write_leaves_nothing_half_written(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    result = synthetic_result()
    store.mark_started(result.config)
    result.per_length[41] = None  # violates NOT NULL on the last insert of the transaction
    with pytest.raises(CheBenchError):
        store.record(result)
    assert store.runs()["status"].tolist() == ["started"]
    assert store.per_length().empty


def test_crashed_run_stays_started_and_others_are_kept(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    crashed = synthetic_result(seed=1)
    store.mark_started(crashed.config)  # process "died" here
    done = synthetic_result(seed=2)
    store.mark_started(done.config)
    store.record(done)
    statuses = dict(zip(store.runs()["run_id"], store.runs()["status"]))
    assert statuses == {crashed.run_id: "started", done.run_id: "complete"}
    assert store.completed_run_ids() == {done.run_id}


def _write_results(path: str, results: list[RunResult]) -> None:
    store = ResultStore(path)
    for result in results:
        store.mark_started(result.config)
        store.record(result)


def test_several_writer_processes(tmp_path):
    path = str(tmp_path / "s.sqlite")
    batches = [[synthetic_result(seed=10 * worker + i) for i in range(4)] for worker in range(3)]
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_write_results, args=(path, batch)) for batch in batches]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    store = ResultStore(path)
    expected = {result.run_id for batch in batches for result in batch}
    assert store.completed_run_ids() == expected
    assert len(store.per_length()) == sum(
        len(r.per_length) + len(r.train_per_length) for batch in batches for r in batch
    )
