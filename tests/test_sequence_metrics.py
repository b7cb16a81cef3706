"""Issue 45, item 3 (a): sequence accuracy, DeltaProduct's cumulative sequence accuracy by
prefix, the pooled accuracy (flip-flop's read error), their store columns and reports."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pandas as pd
import pytest
import torch

from che_bench.cli import main
from che_bench.config import make_config
from che_bench.eval.evaluation import evaluate, pooled_accuracy, seed_for_length
from che_bench.model.architectures import build_architecture
from che_bench.model.packs import stack_members
from che_bench.outcomes import RunResult
from che_bench.reports.export import export_frame
from che_bench.reports.prefix import prefix_frame
from che_bench.reports.tables import format_table, summarize, with_metric
from che_bench.store import ResultStore
from che_bench.store.schema import POOLED_AND_PREFIX_SCHEMA, SCHEMA_VERSION
from che_bench.train.metrics import exact_counts, masked_counts, prefix_counts


def logits_predicting(predictions: list[list[int]], classes: int = 3) -> torch.Tensor:
    """Logits ``[1, B, L, classes]`` whose argmax is ``predictions``."""
    chosen = torch.tensor(predictions)
    return torch.nn.functional.one_hot(chosen, classes).float().unsqueeze(0)


# Three sequences of four positions; "x" marks a wrong prediction, "." an unscored position:
#   row 0: right right right right  -> right up to every t
#   row 1: right  x    right right  -> right up to t = 0 only
#   row 2:   .    .      x   right  -> right up to t = 1 (nothing scored before t = 2)
TARGETS = torch.tensor([[0, 1, 2, 0], [1, 1, 1, 1], [2, 2, 2, 2]])
MASK = torch.tensor([[True] * 4, [True] * 4, [False, False, True, True]])
PREDICTIONS = [[0, 1, 2, 0], [1, 0, 1, 1], [0, 0, 1, 2]]


def test_the_prefix_counts_stop_at_a_sequence_s_first_scored_error():
    counts = prefix_counts(logits_predicting(PREDICTIONS), TARGETS, MASK)
    assert counts.tolist() == [[3, 2, 1, 1]]
    # as DeltaProduct's curve (mean over the sequences) it never rises
    curve = counts[0] / 3
    assert (curve[1:] <= curve[:-1]).all()


def test_exact_match_is_every_scored_position_right_and_the_pooled_counts_are_positions():
    logits = logits_predicting(PREDICTIONS)
    assert [c.tolist() for c in exact_counts(logits, TARGETS, MASK)] == [[1], [3]]
    assert [c.tolist() for c in masked_counts(logits, TARGETS, MASK)] == [[8], [10]]
    # a sequence without a scored position is no sequence of exact match
    unscored = MASK.clone()
    unscored[2] = False
    assert [c.tolist() for c in exact_counts(logits, TARGETS, unscored)] == [[1], [2]]


def test_the_pooled_accuracy_weights_each_scored_position_alike():
    correct, scored = {41: 3, 42: 1, 43: 0}, {41: 4, 42: 1, 43: 0}
    assert pooled_accuracy(correct, scored, (41, 42)) == 0.8  # not (3/4 + 1) / 2
    assert pooled_accuracy(correct, scored, (42,)) == 1.0
    assert pooled_accuracy(correct, scored, (43,)) is None


def oracle_counts(model, task, config, length):
    """Correct and scored positions, and sequences right up to each position, recomputed one
    sequence at a time with plain Python from the evaluation's own test data."""
    data_rng, _ = seed_for_length(model, config, length)
    correct = scored = 0
    right_up_to = np.zeros(task.output_length(length))
    for size in (4, 4, 2):  # eval_samples 10 in sub-batches of 4
        batch = task.sample(length, size, data_rng)
        with torch.inference_mode():
            predicted = model(torch.from_numpy(batch.inputs.copy()), evaluating=True)
        for row in range(size):
            guesses = predicted[0, row].argmax(-1).tolist()
            wrong_yet = False
            for t, (guess, target, counted) in enumerate(
                zip(guesses, batch.targets[row].tolist(), batch.mask[row].tolist())
            ):
                if counted:
                    scored += 1
                    correct += guess == target
                    wrong_yet = wrong_yet or guess != target
                right_up_to[t] += not wrong_yet
    return correct, scored, right_up_to / 10


def test_an_evaluation_records_the_pooled_counts_and_the_prefix_curve_of_its_test_data():
    config = make_config("flip_flop", preset="smoke", test_lengths="6,9", eval_samples=10,
                         eval_batch_size=4, train_eval_lengths="3")
    task = config.build_task()
    torch.manual_seed(0)
    model = build_architecture("lstm", task, hidden_size=4)
    (result,) = evaluate(model, task, config, torch.device("cpu"), progress=False)
    for length in (6, 9):
        correct, scored, _ = oracle_counts(model, task, config, length)
        assert (result.correct_per_length[length], result.scored_per_length[length]) == (
            correct, scored)
    correct, scored, curve = oracle_counts(model, task, config, 9)
    assert result.prefix_length == 9 and len(result.prefix_accuracies) == 18  # 2n positions
    assert result.prefix_accuracies == pytest.approx(curve.tolist())
    pooled = (result.correct_per_length[6] + correct) / (result.scored_per_length[6] + scored)
    assert result.pooled_score == pytest.approx(pooled)
    assert result.train_pooled_accuracy == pytest.approx(
        result.train_correct_per_length[3] / result.train_scored_per_length[3])


def test_each_member_of_a_pack_gets_its_own_counts_and_curve():
    config = make_config("flip_flop", preset="smoke", test_lengths="7", eval_samples=6,
                         eval_batch_size=4, train_eval_lengths="3")
    task = config.build_task()
    members = []
    for seed in (0, 1, 2):  # (three: a mix-up of the member and count axes shows)
        torch.manual_seed(seed)
        members.append(build_architecture("lstm", task, hidden_size=4))
    alone = [evaluate(m, task, config, torch.device("cpu"), progress=False)[0] for m in members]
    packed = evaluate(stack_members(members), task, config, torch.device("cpu"), progress=False)
    for one, member in zip(alone, packed, strict=True):
        assert member.correct_per_length == one.correct_per_length
        assert member.scored_per_length == one.scored_per_length
        assert member.prefix_accuracies == pytest.approx(one.prefix_accuracies)
        assert member.pooled_score == pytest.approx(one.pooled_score)
    assert alone[0].correct_per_length != alone[1].correct_per_length  # (two different models)


def counted_result(seed: int = 0, **overrides) -> RunResult:
    """A made-up complete flip_flop run with pooled counts and a prefix curve."""
    config = make_config("flip_flop", preset="smoke", seed=seed, test_lengths="41,100",
                         train_eval_lengths="40", **overrides)
    return RunResult(
        run_id=config.run_id(), config=config, status="complete", score=0.7,
        train_accuracy=1.0, per_length={41: 0.6, 100: 0.8}, train_per_length={40: 1.0},
        exact_score=0.25, train_exact_accuracy=1.0, exact_per_length={41: 0.5, 100: 0.0},
        train_exact_per_length={40: 1.0}, pooled_score=0.75, train_pooled_accuracy=1.0,
        correct_per_length={41: 5, 100: 70}, scored_per_length={41: 10, 100: 90},
        train_correct_per_length={40: 9}, train_scored_per_length={40: 9},
        prefix_length=100, prefix_accuracies=[1.0, 0.5, 0.25], device="synthetic",
    )


def test_the_store_keeps_the_counts_and_the_curve_and_the_metrics_read_them(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    result = counted_result()
    store.record(result)
    runs = store.runs()
    assert runs.loc[0, "pooled_score"] == 0.75
    curves = store.per_length()
    test = curves[curves["split"] == "test"].set_index("length")
    assert test["correct"].tolist() == [5, 70] and test["scored"].tolist() == [10, 90]
    assert test["pooled_accuracy"].tolist() == [0.5, 70 / 90]
    assert store.prefix_curves()["accuracy"].tolist() == [1.0, 0.5, 0.25]
    assert with_metric(runs, "pooled").loc[0, "score"] == 0.75
    assert with_metric(runs, "sequence").loc[0, "score"] == 0.25
    assert with_metric(curves, "pooled")["accuracy"].tolist() == curves["pooled_accuracy"].tolist()
    cells = summarize(store, metric="pooled")
    assert cells.loc[0, "max"] == 75.0 and cells.loc[0, "chance"] == 50.0
    assert summarize(store, metric="sequence").loc[0, "max"] == 25.0
    exported = export_frame(store, per_length=True, metric="pooled")
    assert exported["accuracy"].tolist() == exported["pooled_accuracy"].tolist()
    prefix = prefix_frame(store)
    assert prefix["position"].tolist() == [0, 1, 2] and set(prefix["length"]) == {100}
    assert set(prefix["trained_positions"]) == {80.0}  # 2 x train_max_length 40


def test_a_version_4_store_is_upgraded_and_its_evaluations_have_no_counts(tmp_path):
    path = tmp_path / "v4.sqlite"
    ResultStore(path).record(counted_result())
    with sqlite3.connect(path) as connection:  # back to version 4: the step's columns dropped
        for statement in POOLED_AND_PREFIX_SCHEMA.split(";"):
            if statement.strip():
                table, column = statement.split()[2], statement.split()[-2]
                connection.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        connection.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    store = ResultStore(path)
    with sqlite3.connect(path) as connection:
        assert connection.execute("SELECT value FROM meta WHERE key = 'schema_version'"
                                  ).fetchone() == (str(SCHEMA_VERSION),)
    assert store.runs().loc[0, "score"] == 0.7 and pd.isna(store.runs().loc[0, "pooled_score"])
    assert store.per_length()["scored"].isna().all() and store.prefix_curves().empty
    assert summarize(store, metric="pooled").empty  # runs without it are left out
    assert format_table(store, metric="pooled") == "(no complete runs with pooled scores recorded)\n"
    store.record(counted_result(seed=1))  # and it takes new ones
    assert len(summarize(store, metric="pooled")) == 1


def test_bad_counts_are_refused(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    result = counted_result()
    store.record(result)
    protocol = {**result.config.evaluation_protocol(), "eval_samples": 99}
    for change, message in (
        ({"correct_per_length": {41: 11, 100: 70}}, "more correct than scored"),
        ({"scored_per_length": {41: 10}}, "cover lengths"),
        ({"prefix_length": 41}, "prefix curve is at length 41"),
        ({"prefix_accuracies": [1.5]}, "prefix accuracy at position 0"),
    ):
        scores = counted_result()
        for name, value in change.items():
            setattr(scores, name, value)
        with pytest.raises(Exception, match=message):
            store.record_evaluation(result.run_id, protocol, scores, device="d", versions={},
                                    timings={})
    assert len(store.evaluations()) == 1


def test_the_metrics_and_the_prefix_curve_from_the_command_line(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    ResultStore(store).record(counted_result())
    assert main(["table", "--metric", "pooled", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "75.00" in out and "read error" in out
    out_csv = tmp_path / "prefix.csv"
    assert main(["export", "--prefix", "--out", str(out_csv), "--store", str(store)]) == 0
    assert pd.read_csv(out_csv)["accuracy"].tolist() == [1.0, 0.5, 0.25]
    assert main(["plot", "--prefix", "--out", str(tmp_path / "p.png"), "--store", str(store)]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0
    assert main(["plot", "--prefix", "--metric", "exact", "--out", str(tmp_path / "q.png"),
                 "--store", str(store)]) == 2
    assert json.loads(json.dumps(counted_result().to_dict()))["prefix_accuracies"] == [
        1.0, 0.5, 0.25]


def test_the_report_shows_word_problems_and_flip_flop_under_their_metrics(tmp_path):
    """Issue 45, item 7: the HTML report of the state-tracking tasks, a final-only word
    problem and flip-flop, by sequence and pooled accuracy."""
    from html import escape

    from che_bench.reports.metrics import METRIC_NOTES

    store = str(tmp_path / "s.sqlite")
    for task, params in (("word_problem", ["--task-param", "variant=identity"]), ("flip_flop", [])):
        assert main(["run", "--task", task, *params, "--arch", "lstm", "--arch-option",
                     "hidden_size=4", "--preset", "smoke", "--steps", "2", "--test-lengths", "41",
                     "--eval-samples", "4", "--store", store, "--no-keep-model",
                     "--no-progress"]) == 0
    for metric in ("sequence", "pooled"):
        page = tmp_path / f"{metric}.html"
        assert main(["report", "--store", store, "--metric", metric, "--out", str(page)]) == 0
        text = page.read_text()
        assert "word_problem" in text and "flip_flop" in text
        assert escape(METRIC_NOTES[metric]) in text
