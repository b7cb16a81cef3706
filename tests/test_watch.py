"""Watching training: the history (cadence, resumes, read cadence), exact match, per-sample
predictions, the curves in the CLI, stuck runs, and the schema-2 -> 3 store upgrade.

Models here are tiny smoke-preset runs of a few steps; SYNTHETIC histories (made-up losses)
are marked as such and only test the bookkeeping."""

from __future__ import annotations

import io
import json
import shutil
import sqlite3
from pathlib import Path

import pandas as pd
import pytest
import torch

import che_bench.run.runner as runner
from che_bench.cli import main
from che_bench.config import make_config
from che_bench.outcomes import RunResult
from che_bench.errors import CheBenchError
from che_bench.reports.export import curves_frame
from che_bench.reports.plots import run_labels
from che_bench.reports.stuck import stuck_runs
from che_bench.run.runner import build_pack_model, execute_run
from che_bench.store import ResultStore
from che_bench.store.schema import SCHEMA_VERSION
from che_bench.train.history import TrainingHistory, input_blind_accuracy
from che_bench.train.loop import train_pack
from che_bench.train.metrics import exact_counts

V2_STORE = Path(__file__).parent / "data" / "store_v2.sqlite"
TINY = dict(steps=8, test_lengths="41,50", eval_samples=8, eval_batch_size=8)


def tiny_config(task: str = "reverse_string", **overrides):
    return make_config(task, "kerple", 3, "smoke", **{**TINY, **overrides})


def without_time(rows: list[dict]) -> list[dict]:
    return [{key: value for key, value in row.items() if key != "elapsed_s"} for row in rows]


def test_history_rows_every_k_steps_and_at_the_last_with_window_means():
    config = tiny_config()
    losses = []
    result = execute_run(config, device="cpu", progress=False, log_every=3,
                         on_step=lambda step, loss: losses.append(loss))
    rows = result.history
    assert [row["step"] for row in rows] == [3, 6, 8]
    for row, window in zip(rows, [losses[0:3], losses[3:6], losses[6:8]]):
        assert row["loss"] == pytest.approx(sum(window) / len(window), rel=1e-6)
        assert 0 <= row["accuracy"] <= 1 and row["grad_norm"] > 0 and row["lr"] == config.lr
    assert rows[0]["elapsed_s"] <= rows[1]["elapsed_s"] <= rows[2]["elapsed_s"]


def test_history_does_not_depend_on_how_often_the_device_is_read():
    """On a GPU the loop reads every 50 steps; the history must be the same as read each step."""
    config = tiny_config()
    task = config.build_task()
    histories = []
    for sync_every in (1, 50):
        model = build_pack_model(task, [config])
        training = train_pack(model, task, [config], torch.device("cpu"), progress=False,
                              sync_every=sync_every, log_every=3)
        histories.append(without_time(training.history[0]))
    assert histories[0] == histories[1]


def test_a_resumed_run_continues_its_history_without_gaps_or_duplicates(tmp_path, monkeypatch):
    config = tiny_config()
    reference = execute_run(config, device="cpu", progress=False, log_every=3)

    def stop_at_step_5(step: int, losses: list[float]) -> None:
        if step == 5:  # mid-window: steps 4 and 5 of the window 4..6 go into the checkpoint
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.execute_pack([config], device="cpu", checkpoint_dir=tmp_path, progress=False,
                            log_every=3, on_step=stop_at_step_5)
    resumed = execute_run(config, device="cpu", checkpoint_dir=tmp_path, progress=False,
                          log_every=3)
    assert without_time(resumed.history) == without_time(reference.history)


def test_exact_counts_need_every_scored_position_right():
    targets = torch.tensor([[1, 2, 0], [1, 2, 0], [0, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    predicted = torch.tensor([[[1, 2, 2], [1, 2, 1], [1, 1, 1]]])  # [M=1, B, L]
    logits = torch.nn.functional.one_hot(predicted, 3).float()
    exact, sequences = exact_counts(logits, targets, mask)
    # sequence 0: right where scored; 1: wrong at a scored position; 2: nothing scored
    assert exact.tolist() == [1] and sequences.tolist() == [2]


def test_exact_match_and_samples_agree_with_the_evaluation(tmp_path):
    """The samples are the evaluation's own sequences: with one sub-batch per length, their
    share of exact answers is the stored exact match, their pooled correctness the accuracy."""
    store = tmp_path / "s.sqlite"
    samples = tmp_path / "samples.jsonl"
    assert main(["run", "--task", "binary_addition", "--pe", "none", "--preset", "smoke",
                 "--steps", "30", "--test-lengths", "3,5,41", "--eval-samples", "8",
                 "--eval-batch-size", "8", "--device", "cpu", "--no-progress",
                 "--store", str(store), "--samples", str(samples)]) == 0
    curves = ResultStore(store).per_length()
    curves = curves[curves["split"] == "test"].set_index("length")
    records = pd.DataFrame([json.loads(line) for line in samples.read_text().splitlines()])
    assert sorted(set(records["length"])) == [3, 5, 41]
    for length, group in records.groupby("length"):
        assert len(group) == 8
        assert group["exact"].mean() == pytest.approx(curves.at[length, "exact_accuracy"])
        scored = [c for row in group["correct"] for c in row if c is not None]
        assert sum(scored) / len(scored) == pytest.approx(curves.at[length, "accuracy"])
    first = records.iloc[0]
    assert len(first["input_text"].split()) == len(first["input"])
    assert first["target_text"].count("·") == first["mask"].count(0)
    assert ResultStore(store).runs()["exact_score"].iloc[0] == pytest.approx(
        curves["exact_accuracy"].mean())


def test_evaluate_writes_samples_and_records_exact_match(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    base = ["--task", "even_pairs", "--pe", "none", "--preset", "smoke", "--steps", "4",
            "--device", "cpu", "--no-progress", "--store", str(store)]
    assert main(["run", *base]) == 0
    run_id = ResultStore(store).runs()["run_id"].iloc[0]
    out = tmp_path / "more.jsonl"
    assert main(["evaluate", run_id, "--test-lengths", "60,70", "--samples", str(out),
                 "--samples-per-length", "3", "--store", str(store), "--no-progress"]) == 0
    assert "exact match" in " ".join(capsys.readouterr().out.split())  # (wrapped lines)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [record["length"] for record in records] == [60] * 3 + [70] * 3
    # Named by the stored run, not by the re-evaluation's (other) configuration.
    assert {record["run_id"] for record in records} == {run_id}
    evaluation = ResultStore(store).evaluations()["evaluation"].iloc[-1]
    exact = ResultStore(store).per_length(evaluation=evaluation)["exact_accuracy"]
    assert exact.notna().all()


def test_curves_export_metric_and_log_every_outside_the_run_id(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    config = tiny_config(seed=1)
    for seed in ("0", "1"):
        assert main(["run", "--task", "reverse_string", "--pe", "kerple", "--kernel", "3",
                     "--preset", "smoke", "--steps", "8", "--test-lengths", "41,50",
                     "--eval-samples", "8", "--eval-batch-size", "8", "--seed", seed,
                     "--log-every", "4", "--device", "cpu", "--no-progress",
                     "--store", str(store)]) == 0
    capsys.readouterr()
    run_ids = list(ResultStore(store).runs()["run_id"])
    assert config.run_id() in run_ids  # --log-every changes no run id

    assert main(["curves", *run_ids, "--store", str(store), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["export", "--curves", "--store", str(store)]) == 0
    exported = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert exported.groupby("run_id")["step"].apply(list).tolist() == [[4, 8], [4, 8]]
    assert {"loss", "accuracy", "grad_norm", "lr", "elapsed_s", "seed"} <= set(exported.columns)
    assert main(["export", "--curves", "--metric", "exact", "--store", str(store)]) == 2
    assert "do not apply" in capsys.readouterr().err

    assert main(["table", "--metric", "exact", "--format", "csv", "--store", str(store)]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out))
    scores = ResultStore(store).runs()["exact_score"]
    assert table.filter(like=" max").iloc[0, 0] == pytest.approx(100 * scores.max(), abs=1e-4)
    assert main(["export", "--metric", "exact", "--per-length", "--store", str(store)]) == 0
    per_length = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert (per_length["accuracy"] == per_length["exact_accuracy"]).all()
    assert main(["table", "--metric", "exact", "--compare", "paper", "--store", str(store)]) == 2
    assert "--compare paper needs --metric token" in capsys.readouterr().err
    assert main(["plot", "--metric", "exact", "--store", str(store),
                 "--out", str(tmp_path / "p.png")]) == 0
    assert main(["curves", "nosuchrun", "--store", str(store)]) == 2


def synthetic_history(accuracies: list[float], losses: list[float]) -> list[dict]:
    """SYNTHETIC history rows every 100 steps with the given training accuracies and losses
    (bookkeeping only)."""
    return [{"step": 100 * (i + 1), "loss": loss, "accuracy": accuracy, "grad_norm": 1.0,
             "lr": 1e-3, "elapsed_s": float(i)}
            for i, (accuracy, loss) in enumerate(zip(accuracies, losses))]


def record_synthetic_run(store: ResultStore, config, accuracies: list[float],
                         losses: list[float]) -> str:
    store.record(RunResult(run_id=config.run_id(), config=config, status="complete",
                           score=0.5, train_accuracy=0.5,
                           per_length={n: 0.5 for n in config.test_lengths},
                           train_per_length={n: 0.5 for n in config.train_eval_lengths},
                           history=synthetic_history(accuracies, losses)))
    return config.run_id()


#: A SYNTHETIC parity run at chance: its loss (nats) scatters around log 2 and one window dips
#: below 0.99 log 2, which let it off under the old lowest-window test.
AT_CHANCE = ([0.49, 0.52, 0.50, 0.505, 0.498], [0.70, 0.675, 0.694, 0.693, 0.694])


def test_stuck_runs_are_flagged_in_runs_and_the_report(tmp_path, capsys):
    from che_bench.reports.html import render_report

    store = ResultStore(tmp_path / "s.sqlite")
    stuck_id = record_synthetic_run(store, make_config("parity_check", "none", None, "quick", seed=0),
                                    *AT_CHANCE)
    record_synthetic_run(store, make_config("parity_check", "none", None, "quick", seed=1),
                         [0.6, 0.9, 0.99], [0.6, 0.3, 0.05])
    assert main(["runs", "--store", str(store.path)]) == 0
    listing = capsys.readouterr().out
    assert "1 stuck" in listing
    assert [line for line in listing.splitlines() if "stuck" in line and stuck_id in line]
    page = render_report(store)
    assert "Stuck: 1 of 2 runs" in page and stuck_id in page
    assert page.count("alt=\"training curves") == 1  # one table cell, its two seeds overlaid


def test_a_run_at_chance_is_stuck_and_runs_that_learn_are_not(tmp_path):
    """Judged on the scored positions only: a bidirectional mqar run at 26% (chance 1/32),
    whose loss over its 4 scored queries stays far above that of the class frequencies over
    every position, learned something; a parity run at chance did not, lucky window or not."""
    store = ResultStore(tmp_path / "s.sqlite")
    mqar = make_config("mqar", "none", None, "quick", seed=0, causal=False, task_params={
        "vocab_size": 64, "num_pairs": 4, "random_non_queries": False})
    runs = {
        record_synthetic_run(store, mqar, [0.03, 0.15, 0.25, 0.26, 0.26], [3.5, 2.9, 2.6, 2.5, 2.5]): False,
        record_synthetic_run(store, make_config("parity_check", "none", None, "quick", seed=0),
                             *AT_CHANCE): True,
        record_synthetic_run(store, make_config("parity_check", "none", None, "quick", seed=1),
                             [0.5, 0.7, 0.95, 0.97, 0.99], [0.69, 0.5, 0.1, 0.08, 0.05]): False,
    }
    judged = stuck_runs(store).set_index("run_id")
    assert judged["stuck"].to_dict() == runs
    assert judged.at[mqar.run_id(), "baseline_accuracy"] == pytest.approx(1 / 32, abs=0.005)
    assert judged["baseline_accuracy"].drop(mqar.run_id()).tolist() == pytest.approx([0.5] * 2, abs=0.01)
    assert (judged["margin"] < 0.02).all()  # 300 steps x 32 sequences: a narrow margin


def test_curves_label_causal_runs_as_causal(tmp_path, capsys):
    store = ResultStore(tmp_path / "s.sqlite")
    run_id = record_synthetic_run(store, make_config("parity_check", "kerple", 3, "quick", causal=True),
                                  *AT_CHANCE)
    assert set(curves_frame(store)["encoding"]) == {"DAPE_k3_Kerple (causal)"}
    assert main(["export", "--curves", "--store", str(store.path)]) == 0
    assert set(pd.read_csv(io.StringIO(capsys.readouterr().out))["encoding"]) == {"DAPE_k3_Kerple (causal)"}
    assert run_labels(curves_frame(store, [run_id])) == {run_id: "parity_check, DAPE_k3_Kerple (causal)"}


def test_the_input_blind_guess_reads_the_class_of_each_position():
    """bucket_sort's outputs are sorted: the most frequent class at each position is right
    far more often than 1 in 5, without reading the input."""
    assert input_blind_accuracy("bucket_sort", "{}", 20) > 0.6
    assert input_blind_accuracy("parity_check", "{}", 20) == pytest.approx(0.5, abs=0.01)


def test_a_history_object_restores_an_open_window():
    whole = TrainingHistory([1e-3], log_every=4, last_step=4)
    parts = TrainingHistory([1e-3], log_every=4, last_step=4)
    for step in (1, 2, 3, 4):
        whole.add(step, [float(step)], [1.0], [2.0], [0.5], 0.0)
    for step in (1, 2):
        parts.add(step, [float(step)], [1.0], [2.0], [0.5], 0.0)
    resumed = TrainingHistory([1e-3], log_every=4, last_step=4)
    resumed.restore(0, parts.state(0))
    for step in (3, 4):
        resumed.add(step, [float(step)], [1.0], [2.0], [0.5], 0.0)
    assert resumed.rows == whole.rows == [[{"step": 4, "loss": 2.5, "accuracy": 0.5,
                                            "grad_norm": 0.5, "lr": 1e-3, "elapsed_s": 0.0}]]


@pytest.mark.parametrize("args, message", [
    (["--log-every", "0"], "--log-every must be an integer >= 1"),
    (["--samples", "x.jsonl", "--samples-per-length", "0"], "--samples-per-length must be at least 1"),
    (["--samples", "x.jsonl", "--no-keep-model"], "--samples reads the kept models"),
])
def test_bad_watch_flags_are_one_line_errors_before_anything_runs(tmp_path, capsys, args, message):
    store = tmp_path / "s.sqlite"
    assert main(["run", "--task", "even_pairs", "--preset", "smoke", *args,
                 "--store", str(store)]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    assert not store.exists()


# --- the upgrade of a schema-2 store ------------------------------------------------------

def table_rows(path: Path, query: str) -> list[tuple]:
    with sqlite3.connect(path) as connection:
        return connection.execute(query).fetchall()


def test_a_version_2_store_made_by_che_bench_is_upgraded_in_place(tmp_path):
    """tests/data/store_v2.sqlite was written by che-bench before this schema (smoke runs of
    parity_check x 2 seeds and binary_addition + ALiBi + DAPE k3, one re-evaluation)."""
    path = shutil.copy(V2_STORE, tmp_path / "v2.sqlite")
    old_runs = table_rows(path, "SELECT run_id, status, score, config FROM runs ORDER BY run_id")
    old_evaluations = table_rows(path, "SELECT run_id, evaluation_id, score, train_accuracy "
                                       "FROM evaluations ORDER BY 1, 2")
    old_accuracies = table_rows(path, "SELECT run_id, evaluation_id, split, length, accuracy "
                                      "FROM accuracies ORDER BY 1, 2, 3, 4")
    assert table_rows(path, "SELECT value FROM meta WHERE key = 'schema_version'") == [("2",)]

    store = ResultStore(path)
    assert table_rows(path, "SELECT value FROM meta WHERE key = 'schema_version'") == [
        (str(SCHEMA_VERSION),)]
    assert table_rows(path, "SELECT run_id, status, score, config FROM runs ORDER BY run_id") == old_runs
    assert table_rows(path, "SELECT run_id, evaluation_id, score, train_accuracy FROM evaluations "
                            "ORDER BY 1, 2") == old_evaluations
    assert table_rows(path, "SELECT run_id, evaluation_id, split, length, accuracy FROM accuracies "
                            "ORDER BY 1, 2, 3, 4") == old_accuracies
    assert store.per_length()["exact_accuracy"].isna().all()  # not recorded back then
    assert store.history().empty
    # Exact-match views leave the old runs out rather than inventing values.
    assert main(["table", "--metric", "exact", "--store", str(path)]) == 0
    # The upgraded store takes a new run with its history and exact match.
    result = execute_run(tiny_config(), device="cpu", progress=False, log_every=4)
    store.record(result)
    assert list(ResultStore(path).history([result.run_id])["step"]) == [4, 8]
    assert ResultStore(path).runs([result.run_id])["exact_score"].notna().all()


def test_a_failing_upgrade_leaves_the_version_2_store_intact(tmp_path, monkeypatch):
    from che_bench.store import schema as store_schema

    path = shutil.copy(V2_STORE, tmp_path / "v2.sqlite")
    with sqlite3.connect(path) as connection:
        before = list(connection.iterdump())

    def half_done_then_fail(connection):
        connection.execute("ALTER TABLE evaluations ADD COLUMN exact_score REAL")
        raise sqlite3.OperationalError("disk I/O error (simulated)")

    monkeypatch.setitem(store_schema.MIGRATIONS, 2, half_done_then_fail)
    with pytest.raises(CheBenchError, match="cannot upgrade .* schema version 2 .*unchanged"):
        ResultStore(path)
    with sqlite3.connect(path) as connection:
        assert list(connection.iterdump()) == before
