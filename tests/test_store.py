"""ResultStore: creation, refusal of foreign files, atomic writes, several writer processes,
re-evaluations, and the upgrade of version-1 stores.

The RunResults here are SYNTHETIC fixtures (made-up accuracies), used only to test the
bookkeeping; they are not results of any model.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import sqlite3
import tempfile
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from che_bench.cli import main
from che_bench.config import make_config, protocol_id
from che_bench.outcomes import RunResult, Scores
from che_bench.errors import CheBenchError
from che_bench.store import ResultStore
from che_bench.store import schema as store_schema
from che_bench.store.schema import APPLICATION_ID, SCHEMA_VERSION


def synthetic_result(
    task: str = "even_pairs",
    pe: str = "kerple",
    kernel: int | None = None,
    seed: int = 0,
    score: float = 0.5,
    status: str = "complete",
    preset: str = "smoke",
    **overrides,
) -> RunResult:
    """A made-up complete run: every test length has accuracy ``score``."""
    config = make_config(task, pe, kernel, preset, seed=seed, **overrides)
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


def test_run_configs_read_back_each_runs_recorded_config(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    started, complete = synthetic_result(seed=1), synthetic_result(kernel=3, seed=2)
    store.mark_started(started.config)
    store.record(complete)
    assert store.run_configs([started.run_id, complete.run_id]) == {
        started.run_id: started.config, complete.run_id: complete.config}
    assert store.run_configs([complete.run_id]) == {complete.run_id: complete.config}
    assert store.run_configs(["not-a-run"]) == {}


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


def _open_when_all_are_ready(path: str, barrier, errors) -> None:
    barrier.wait()
    try:
        ResultStore(path)
    except CheBenchError as exc:
        errors.put(str(exc))


def test_processes_creating_one_new_store_at_once_all_open_it(tmp_path):
    # Races seen here before they were fixed: a store caught half-created was refused as
    # "another application", and the switch to WAL failed with "database is locked"; 60 such
    # trials gave 4 to 31 refusals.
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    for trial in range(30):
        barrier = context.Barrier(6)
        path = str(tmp_path / f"store{trial}.sqlite")
        openers = [context.Process(target=_open_when_all_are_ready, args=(path, barrier, errors))
                   for _ in range(6)]
        for opener in openers:
            opener.start()
        for opener in openers:
            opener.join(60)
            assert opener.exitcode == 0
    refusals = []
    while not errors.empty():
        refusals.append(errors.get())
    assert refusals == []


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


def reevaluation(result: RunResult, test_lengths=(41, 1000), accuracy: float = 0.25, **changes) -> dict:
    """Keyword arguments of ``record_evaluation`` for a made-up (SYNTHETIC) re-evaluation of
    ``result``'s model under its protocol with ``test_lengths`` and ``changes``."""
    protocol = dict(result.config.evaluation_protocol(), test_lengths=list(test_lengths), **changes)
    scores = Scores(score=accuracy, train_accuracy=0.95,
                    per_length={n: accuracy for n in test_lengths},
                    train_per_length={n: 0.95 for n in protocol["train_eval_lengths"]})
    return dict(protocol=protocol, scores=scores, device="synthetic-gpu",
                versions={"che_bench": "synthetic"}, timings={"eval_s": 2.0})


def with_scores(arguments: dict, **changes) -> dict:
    """``arguments`` of ``record_evaluation`` with ``changes`` to their scores."""
    return dict(arguments, scores=dataclasses.replace(arguments["scores"], **changes))


def test_reevaluations_are_kept_beside_the_original(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    first, second = synthetic_result(seed=0, score=0.6), synthetic_result(seed=1, score=0.7)
    for result in (first, second):
        store.record(result)
    original_id = protocol_id(first.config.evaluation_protocol())
    evaluation = store.record_evaluation(first.run_id, **reevaluation(first, dropout_at_eval=True))
    assert evaluation == protocol_id(reevaluation(first, dropout_at_eval=True)["protocol"])
    assert evaluation != original_id

    # "original": every run with its own score; the protocol id: only the runs evaluated under it
    runs = store.runs()
    assert dict(zip(runs["run_id"], runs["score"])) == {first.run_id: 0.6, second.run_id: 0.7}
    assert runs["evaluation"].tolist() == [original_id, original_id]
    chosen = store.runs(evaluation=evaluation)
    assert chosen["run_id"].tolist() == [first.run_id]
    assert chosen["score"].tolist() == [0.25]
    assert chosen["eval_device"].tolist() == ["synthetic-gpu"]
    assert json.loads(chosen["protocol"][0])["test_lengths"] == [41, 1000]
    curve = store.per_length(evaluation=evaluation)
    assert set(curve["evaluation"]) == {evaluation}
    assert sorted(curve.loc[curve["split"] == "test", "length"]) == [41, 1000]
    assert set(store.per_length()["evaluation"]) == {original_id}

    listing = store.evaluations()
    assert len(listing) == 3
    row = listing[~listing["original"]].iloc[0]
    assert (row["run_id"], row["evaluation"], row["score"]) == (first.run_id, evaluation, 0.25)
    assert row["protocol"].startswith("test lengths 41..1000 (2 lengths), 8 samples")
    assert row["protocol"].endswith("dropout at eval")
    assert store.evaluations([second.run_id])["original"].tolist() == [True]

    # the same (run, protocol) again replaces it; re-recording the run keeps it
    store.record_evaluation(first.run_id, **reevaluation(first, accuracy=0.5, dropout_at_eval=True))
    store.record(first)
    assert store.runs(evaluation=evaluation)["score"].tolist() == [0.5]
    assert len(store.evaluations()) == 3
    assert len(store.per_length(evaluation=evaluation)) == 2 + len(first.train_per_length)


def test_bad_reevaluations_are_refused_and_change_nothing(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    done, failed = synthetic_result(seed=0), synthetic_result(seed=1, status="failed")
    store.record(done)
    store.record(failed)
    before = store.evaluations()
    bad = {
        "no run": ("nonexistent", reevaluation(done)),
        "not complete": (failed.run_id, reevaluation(done)),
        "original evaluation": (done.run_id, reevaluation(done, done.config.test_lengths)),
        "lengths": (done.run_id, with_scores(reevaluation(done), per_length={41: 0.5})),
        "fields": (done.run_id, dict(reevaluation(done), protocol={"test_lengths": [41]})),
        r"\[0, 1\]": (done.run_id, with_scores(reevaluation(done), score=float("nan"))),
    }
    for match, (run_id, arguments) in bad.items():
        with pytest.raises(CheBenchError, match=match):
            store.record_evaluation(run_id, **arguments)
    assert before.equals(store.evaluations())
    with pytest.raises(CheBenchError, match=r"unknown evaluation 'abc'.*known: original, [0-9a-f]{10}"):
        store.runs(evaluation="abc")
    with pytest.raises(CheBenchError, match="unknown evaluation"):
        store.per_length(evaluation="abc")


# The schema of version-1 stores, verbatim (che-bench before evaluations were stored): a
# fixture for the upgrade, deliberately not derived from the current schema.
V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY,
    task TEXT NOT NULL,
    pe TEXT NOT NULL,
    kernel INTEGER,
    seed INTEGER NOT NULL,
    lr REAL NOT NULL,
    steps INTEGER NOT NULL,
    preset TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('started', 'complete', 'failed')),
    score REAL,
    train_accuracy REAL,
    config TEXT NOT NULL,
    versions TEXT,
    device TEXT,
    timings TEXT,
    details TEXT,
    error TEXT,
    attempts INTEGER NOT NULL DEFAULT 1,
    created_at TEXT NOT NULL,
    finished_at TEXT
);
CREATE TABLE accuracies (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    split TEXT NOT NULL CHECK (split IN ('test', 'train')),
    length INTEGER NOT NULL,
    accuracy REAL NOT NULL,
    PRIMARY KEY (run_id, split, length)
);
"""


def v1_store(path, results: list[RunResult]):
    """A version-1 store written with plain sqlite3, as che-bench 0.1 wrote it, each complete
    result's curves in ``accuracies``."""
    with closing(sqlite3.connect(path, isolation_level=None)) as connection:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.executescript(V1_SCHEMA)
        connection.executemany("INSERT INTO meta VALUES (?, ?)", [
            ("application", "che-bench"), ("schema_version", "1"), ("created_at", "2024-01-01")])
        connection.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        for number, result in enumerate(results):
            c = result.config
            connection.execute(
                """INSERT INTO runs (run_id, task, pe, kernel, seed, lr, steps, preset, status,
                   score, train_accuracy, config, versions, device, timings, error, created_at,
                   finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                (result.run_id, c.task, c.pe, c.kernel, c.seed, c.lr, c.steps, c.preset,
                 result.status, result.score, result.train_accuracy, json.dumps(c.to_dict()),
                 json.dumps(result.versions), result.device, json.dumps(result.timings),
                 result.error, f"2024-01-01T00:00:0{number}", "2024-01-02T00:00:00"),
            )
            curves = [("test", n, a) for n, a in result.per_length.items()]
            curves += [("train", n, a) for n, a in result.train_per_length.items()]
            connection.executemany("INSERT INTO accuracies VALUES (?, ?, ?, ?)",
                                   [(result.run_id, *curve) for curve in curves])
    return path


def dump(path) -> list[str]:
    with sqlite3.connect(path) as connection:
        return list(connection.iterdump())


def v1_results() -> list[RunResult]:
    return [synthetic_result(seed=0, score=0.6), synthetic_result("parity_check", kernel=3, score=0.8),
            synthetic_result(seed=2, status="failed")]


def test_a_version_1_store_is_upgraded_in_place_with_nothing_lost(tmp_path):
    results = v1_results()
    path = v1_store(tmp_path / "v1.sqlite", results)
    store = ResultStore(path)
    with sqlite3.connect(path) as connection:
        assert connection.execute(
            "SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (str(SCHEMA_VERSION),)
        assert connection.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID

    runs = store.runs().set_index("run_id")
    assert list(runs.index) == [result.run_id for result in results]
    assert list(runs["status"]) == ["complete", "complete", "failed"]
    assert list(runs["score"][:2]) == [0.6, 0.8]
    assert runs["error"].iloc[2] == "synthetic failure"
    curves = store.per_length()
    for result in results[:2]:
        mine = curves[curves["run_id"] == result.run_id]
        test, train = mine[mine["split"] == "test"], mine[mine["split"] == "train"]
        assert dict(zip(test["length"], test["accuracy"])) == result.per_length
        assert dict(zip(train["length"], train["accuracy"])) == result.train_per_length
        # the upgrade's original evaluation has the id a fresh record() would give
        assert set(mine["evaluation"]) == {protocol_id(result.config.evaluation_protocol())}
    listing = store.evaluations()
    assert sorted(listing["run_id"]) == sorted(r.run_id for r in results[:2])
    assert listing["original"].all()
    assert listing["device"].tolist() == ["synthetic", "synthetic"]
    # the upgraded store takes new runs and re-evaluations, and opens again as it is
    store.record_evaluation(results[0].run_id, **reevaluation(results[0]))
    store.record(synthetic_result(seed=5))
    assert len(ResultStore(path).runs()) == 4


def _upgrade_then_crash(path: str) -> None:
    """Child process: die (no rollback, no cleanup) in the middle of the upgrade, when the new
    tables exist and the first run's evaluation is written."""
    calls = []
    real_protocol_id = store_schema.protocol_id

    def protocol_id_then_crash(protocol):
        calls.append(protocol)
        if len(calls) == 2:
            os._exit(9)
        return real_protocol_id(protocol)

    store_schema.protocol_id = protocol_id_then_crash
    ResultStore(path)


def test_an_interrupted_or_failing_upgrade_leaves_the_version_1_store_intact(tmp_path):
    path = v1_store(tmp_path / "v1.sqlite", v1_results())
    before = dump(path)
    child = multiprocessing.get_context("fork").Process(target=_upgrade_then_crash, args=(str(path),))
    child.start()
    child.join(60)
    assert child.exitcode == 9
    assert dump(path) == before

    # a config without an evaluation field: the upgrade fails cleanly
    bad = v1_store(tmp_path / "old.sqlite", v1_results())
    with sqlite3.connect(bad) as connection:
        connection.execute("UPDATE runs SET config = json_remove(config, '$.test_lengths') "
                           "WHERE status = 'complete' AND task = 'parity_check'")
    bad_before = dump(bad)
    with pytest.raises(CheBenchError, match="cannot upgrade .* schema version 1 .*unchanged"):
        ResultStore(bad)
    assert dump(bad) == bad_before
    # after the crash, the next open upgrades the store
    assert len(ResultStore(path).per_length()) == sum(
        len(r.per_length) + len(r.train_per_length) for r in v1_results())


def test_newer_stores_are_refused_untouched(tmp_path):
    path = tmp_path / "future.sqlite"
    ResultStore(path)
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'",
                           (str(SCHEMA_VERSION + 1),))
    before = dump(path)
    with pytest.raises(CheBenchError, match=f"schema version {SCHEMA_VERSION + 1}"):
        ResultStore(path)
    assert dump(path) == before


def _open_store(path: str) -> None:
    ResultStore(path).runs()


def test_several_processes_opening_a_version_1_store_upgrade_it_once(tmp_path):
    path = v1_store(tmp_path / "v1.sqlite", v1_results())
    context = multiprocessing.get_context("fork")
    openers = [context.Process(target=_open_store, args=(str(path),)) for _ in range(3)]
    for opener in openers:
        opener.start()
    for opener in openers:
        opener.join(60)
        assert opener.exitcode == 0
    assert len(ResultStore(path).evaluations()) == 2


def store_files(path) -> dict[str, bytes]:
    """The bytes of the store at ``path`` and of its side files (``-wal``, ``-shm``)."""
    return {file.name: file.read_bytes() for file in path.parent.glob(path.name + "*")}


def test_a_reader_writes_nothing_and_reads_older_schemas_as_they_are(tmp_path):
    results = v1_results()
    path = v1_store(tmp_path / "v1.sqlite", results)
    before = store_files(path)
    assert list(before) == ["v1.sqlite"]
    store = ResultStore(path, read_only=True)
    assert list(store.runs()["run_id"]) == [result.run_id for result in results]
    assert len(store.per_length()) == sum(len(r.per_length) + len(r.train_per_length)
                                          for r in results[:2])
    assert store.evaluations()["original"].all() and store.history().empty
    with pytest.raises(CheBenchError, match="read-only"):
        store.record(synthetic_result(seed=7))
    assert store_files(path) == before  # still version 1, no side file left behind

    current = tmp_path / "v3.sqlite"
    ResultStore(current).record(results[0])
    before = store_files(current)
    assert len(ResultStore(current, read_only=True).per_length()) > 0
    assert store_files(current) == before


def test_a_reader_sees_a_running_writer_s_results_and_leaves_its_side_files(tmp_path):
    path = tmp_path / "s.sqlite"
    ResultStore(path)
    with closing(sqlite3.connect(path)) as writer_at_work:  # keeps the WAL from checkpointing
        writer_at_work.execute("SELECT count(*) FROM runs").fetchone()
        ResultStore(path).record(synthetic_result())
        before = store_files(path)
        assert "s.sqlite-wal" in before
        assert len(ResultStore(path, read_only=True).runs()) == 1
        after = store_files(path)
        # (-shm is SQLite's shared memory, where readers mark what they read)
        assert {name: after[name] for name in ("s.sqlite", "s.sqlite-wal")} == \
            {name: before[name] for name in ("s.sqlite", "s.sqlite-wal")}


def test_an_empty_file_is_no_store_for_a_reader(tmp_path):
    path = tmp_path / "empty.sqlite"
    path.write_bytes(b"")
    with pytest.raises(CheBenchError, match="empty"):
        ResultStore(path, read_only=True)
    assert path.read_bytes() == b""


NOBODY = 65534


@contextmanager
def unprivileged():
    """Run the body as a user who cannot write an ``unwritable_directory``: as root (whom
    permissions do not stop), with effective user and group nobody, root again afterwards.
    (Python's standard library is under /root, closed to nobody: modules the body needs are
    imported before, by running the same commands as root.)"""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.fixture
def unwritable_directory():
    """A world-readable directory that ``unprivileged`` code cannot write once
    ``make_unwritable`` (owned by root, or read-only)."""
    directory = Path(tempfile.mkdtemp(prefix="che-bench-unwritable-"))
    yield directory
    directory.chmod(0o755)
    shutil.rmtree(directory)


def make_unwritable(directory: Path) -> None:
    directory.chmod(0o755 if os.geteuid() == 0 else 0o555)


def test_a_store_in_a_directory_the_user_cannot_write_is_read_and_refused_for_writing(
        unwritable_directory, capsys):
    current = unwritable_directory / "v3.sqlite"
    ResultStore(current).record(synthetic_result(score=0.75))
    old = v1_store(unwritable_directory / "v1.sqlite", v1_results())
    commands = [["table", "--store", str(current)], ["runs", "--store", str(old)],
                ["evaluate", "no_such_run", "--device", "cpu", "--store", str(current)]]
    as_root = [main(command) for command in commands]  # (imports what they need)
    assert as_root == [0, 0, 2]
    capsys.readouterr()
    make_unwritable(unwritable_directory)
    before = {path: store_files(path) for path in (current, old)}

    with unprivileged():
        with pytest.raises(OSError):
            (unwritable_directory / "probe").write_text("")
        assert [main(command) for command in commands] == as_root
    out, err = capsys.readouterr()
    assert "75.00" in out and "2 complete, 1 failed" in out
    # the writer (evaluate) cannot open the store: one line, read-only, not "corrupt"
    assert err.count("\n") == 1 and "is read-only" in err and "SQLite database" not in err
    assert {path: store_files(path) for path in (current, old)} == before


def test_an_evaluations_scores_are_declared_once_and_are_the_stores_columns(tmp_path):
    """Issue 20, item 2: ``Scores`` is the one description of what an evaluation measured;
    its single values are columns of ``evaluations`` and its curves those of ``accuracies``
    (``accuracy`` / ``exact_accuracy`` per split)."""
    store = ResultStore(tmp_path / "s.sqlite")
    with sqlite3.connect(store.path) as connection:
        columns = {table: {row[1] for row in connection.execute(f"PRAGMA table_info({table})")}
                   for table in ("evaluations", "accuracies")}
    fields = [field.name for field in dataclasses.fields(Scores)]
    single = [name for name in fields if not name.endswith("per_length")]
    curves = [name for name in fields if name.endswith("per_length")]
    bookkeeping = {"run_id", "evaluation_id", "protocol", "is_original", "device", "versions",
                   "timings", "created_at"}
    assert set(single) == columns["evaluations"] - bookkeeping  # no score column without a field
    assert set(curves) == {"per_length", "train_per_length", "exact_per_length",
                           "train_exact_per_length", "correct_per_length", "scored_per_length",
                           "train_correct_per_length", "train_scored_per_length"}
    assert columns["accuracies"] == {"run_id", "evaluation_id", "split", "length", "accuracy",
                                     "exact_accuracy", "correct", "scored"}
    from che_bench.eval.evaluation import Evaluation

    assert issubclass(Evaluation, Scores) and issubclass(RunResult, Scores)


@pytest.mark.parametrize("size", [100, 4096, 100_000, 212_000])
def test_a_truncated_store_is_called_damaged_and_left_as_it_is(tmp_path, size):
    """Issue 26, item 14: a truncated copy of a real store was called "not an SQLite
    database"; it is an SQLite database, damaged."""
    committed = Path(__file__).resolve().parent.parent / "results" / "laptop" / "laptop.sqlite"
    path = tmp_path / "truncated.sqlite"
    path.write_bytes(committed.read_bytes()[:size])
    before = store_files(path)
    for read_only in (False, True):
        with pytest.raises(CheBenchError) as error:
            ResultStore(path, read_only=read_only)
        assert "is damaged or truncated" in str(error.value)
        assert "not an SQLite database" not in str(error.value)
        assert "\n" not in str(error.value)
        assert store_files(path) == before


def test_a_store_damaged_past_its_schema_is_a_one_line_error_when_read(tmp_path):
    committed = Path(__file__).resolve().parent.parent / "results" / "laptop" / "laptop.sqlite"
    data = bytearray(committed.read_bytes())
    data[20 * 4096:21 * 4096] = bytes(4096)  # one page of its tables zeroed
    path = tmp_path / "damaged.sqlite"
    path.write_bytes(bytes(data))
    store = ResultStore(path, read_only=True)  # (the schema is intact: it opens)
    with pytest.raises(CheBenchError, match="is damaged or truncated"):
        store.runs()
