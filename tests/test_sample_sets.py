"""Fixed sample sets (``--sample-set``, Merrill et al.'s data): drawn once from the seed,
distinct, split 80/20 at the longest training length, the held-out part never trained on."""

from __future__ import annotations

import dataclasses
import textwrap

import numpy as np
import pytest
import torch

from che_bench.cli import main
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.eval.evaluation import evaluate
from che_bench.model.architectures import build_architecture
from che_bench.run.suites import load_suite
from che_bench.tasks import get_task
from che_bench.tasks.sample_sets import HELD_OUT, TRAINING, SampleSet, SetDraws
from che_bench.train.batches import BatchStream

K = 5  # the split length: S3 has 6^5 = 7,776 words of it


def s3_config(**overrides):
    settings = {"task_params": {"group": "S3"}, "sample_set": 40, "train_max_length": K,
                "test_lengths": f"{K},8", "steps": 200}
    return make_config("word_problem", preset="smoke", **{**settings, **overrides})


def rows(inputs: np.ndarray) -> set[tuple[int, ...]]:
    return {tuple(row) for row in np.asarray(inputs).tolist()}


def test_a_set_is_distinct_drawn_from_the_seed_and_split_80_20_at_the_longest_length():
    config = s3_config()
    sample_set = config.build_task().source.sample_set
    again = s3_config(seed=5).build_evaluation_task().source.sample_set  # another run, one set
    for n in (1, 2, 3, K):
        found = sample_set.sequences(n)
        assert len(rows(found.inputs)) == len(found.inputs) == min(40, 6**n)  # all where fewer
        assert rows(again.sequences(n).inputs) == rows(found.inputs)
        targets, mask = get_task("word_problem", group="S3").solve(found.inputs)
        assert (targets == found.targets).all() and (mask == found.mask).all()
    training, held_out = (rows(sample_set.part(K, part).inputs) for part in (TRAINING, HELD_OUT))
    assert (len(training), len(held_out)) == (32, 8) and not training & held_out
    assert sample_set.part(3, TRAINING) is sample_set.sequences(3)  # shorter lengths: whole
    other_seed = dataclasses.replace(config, eval_seed=2).build_task().source.sample_set
    assert rows(other_seed.sequences(K).inputs) != rows(sample_set.sequences(K).inputs)


def test_training_draws_only_the_training_part_and_the_evaluation_only_the_held_out_one(
    monkeypatch,
):
    config = s3_config()
    stream = iter(BatchStream(config.build_task(), [config]))
    sample_set = SampleSet(get_task("word_problem", group="S3"), 40, config.eval_seed, K)
    trained: dict[int, set] = {}
    for _ in range(config.steps):
        batch = next(stream)
        trained.setdefault(batch.length, set()).update(rows(batch.inputs[0]))
    assert trained[K] == rows(sample_set.part(K, TRAINING).inputs)  # every one, and no other
    for n in range(1, K):
        assert trained[n] <= rows(sample_set.sequences(n).inputs)

    tested: dict[int, set] = {}
    original = SetDraws.sample

    def recorded(self, n, batch_size, rng):
        batch = original(self, n, batch_size, rng)
        assert self.part == HELD_OUT
        tested.setdefault(n, set()).update(rows(batch.inputs) if batch is not None else {None})
        return batch

    monkeypatch.setattr(SetDraws, "sample", recorded)
    task = config.build_evaluation_task()
    model = build_architecture("lstm", task, hidden_size=4)
    evaluate(model, task, config, torch.device("cpu"))
    assert tested[K] and tested[K] <= rows(sample_set.part(K, HELD_OUT).inputs)
    assert not tested[K] & trained[K]
    assert tested[8] == {None}  # past the split: fresh sequences, never trained on


def test_the_setting_enters_run_and_protocol_ids_only_when_set_and_the_merrill_preset_uses_it():
    plain = s3_config(sample_set=None)
    assert "sample_set" not in plain.to_dict() and "sample_set" not in plain.evaluation_protocol()
    assert plain.run_id() == s3_config(sample_set=None, seed=0).run_id()
    assert s3_config().run_id() != plain.run_id()
    assert s3_config().evaluation_protocol()["sample_set"] == 40
    assert make_config("word_problem", preset="merrill").sample_set == 1_000_000


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"test_lengths": "4,5"}, "test length 4 is below train_max_length 5"),
        ({"eval_task_params": {"variant": "only_swaps"}}, "leave out eval_task_params"),
        ({"sample_set": 1}, "sample_set must be"),
    ],
)
def test_a_test_that_could_draw_training_sequences_is_refused(overrides, message):
    with pytest.raises(CheBenchError, match=message) as error:
        s3_config(**overrides)
    assert "\n" not in str(error.value)


def test_a_split_length_with_one_sequence_has_nothing_to_hold_out():
    one = SampleSet(get_task("word_problem", group="S3"), 1, 0, 2)
    with pytest.raises(CheBenchError, match="too few to hold 20% out"):
        one.part(2, TRAINING)


def test_a_set_is_made_again_in_a_worker_not_pickled():
    import pickle

    task = s3_config().build_task()
    task.source.sample_set.sequences(K)
    copied = pickle.loads(pickle.dumps(task))
    assert copied.source.sample_set._sets == {}
    rng, same = np.random.default_rng(3), np.random.default_rng(3)
    assert (copied.sample(K, 6, rng).inputs == task.sample(K, 6, same).inputs).all()


def test_from_the_command_line_and_in_a_suite(tmp_path):
    store = str(tmp_path / "store.sqlite")
    assert main(["run", "--task", "word_problem", "--task-param", "group=S3", "--arch", "lstm",
                 "--arch-option", "hidden_size=4", "--preset", "smoke", "--steps", "3",
                 "--sample-set", "40", "--train-max-length", str(K), "--test-lengths", str(K),
                 "--store", store, "--no-keep-model", "--no-progress"]) == 0
    assert main(["evaluations", "--store", store]) == 0
    suite = tmp_path / "suite.toml"
    suite.write_text(textwrap.dedent(f"""
        preset = "smoke"
        tasks = [{{ name = "word_problem", params = {{ group = "S3" }} }}]
        architectures = [{{ name = "lstm", options = {{ hidden_size = 4 }} }}]
        [overrides]
        sample_set = 40
        train_max_length = {K}
        test_lengths = "{K}"
    """))
    (config,) = load_suite(suite).configs()
    assert config.sample_set == 40
    assert main(["sweep", str(suite), "--store", store, "--no-keep-model", "--no-progress"]) == 0
