"""Flip-flop language modelling (Liu et al. 2023): the FFL(p) grammar of the spec
(shared/spec/word_problems.md 4.1), the official splits' distributions, the clean mode (only
the bit after each read is scored, in place), the oracle, and the length-generalisation run."""

from __future__ import annotations

import numpy as np
import pytest

from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.tasks import get_task
from che_bench.tasks.flip_flop import BIT0, IGNORE, READ, WRITE


def test_worked_example_of_the_docstring():
    w, r, i, zero, one = 0, 1, 2, 3, 4
    targets, mask = get_task("flip_flop").solve(np.array([[w, one, i, zero, r, one, r, one]]))
    assert mask[0].tolist() == [False] * 4 + [True, False, True, False]
    assert targets[0, [4, 6]].tolist() == [1, 1]


@pytest.mark.parametrize("p_ignore", [0.8, 0.98, 0.1])
def test_grammar_first_write_last_read_reads_repeat_the_latest_write(p_ignore):
    task = get_task("flip_flop", p_ignore=p_ignore)
    batch = task.sample(30, 200, np.random.default_rng(0))
    instructions, bits = batch.inputs[:, 0::2], batch.inputs[:, 1::2] - BIT0
    assert batch.inputs.shape == (200, 60)
    assert (instructions[:, 0] == WRITE).all() and (instructions[:, -1] == READ).all()
    assert set(np.unique(instructions)) <= {WRITE, READ, IGNORE}
    assert set(np.unique(bits)) <= {0, 1}
    for row_instructions, row_bits in zip(instructions, bits):
        memory = None
        for instruction, bit in zip(row_instructions, row_bits):
            if instruction == WRITE:
                memory = bit
            elif instruction == READ:
                assert bit == memory


@pytest.mark.parametrize("p_ignore", [0.8, 0.98, 0.1])
def test_instructions_follow_the_split_distribution(p_ignore):
    batch = get_task("flip_flop", p_ignore=p_ignore).sample(256, 400, np.random.default_rng(1))
    middle = batch.inputs[:, 2:-2:2]  # the i.i.d. instructions (not the first and last)
    shares = np.bincount(middle.ravel(), minlength=3) / middle.size
    expected = [(1 - p_ignore) / 2, (1 - p_ignore) / 2, p_ignore]
    np.testing.assert_allclose(shares, expected, atol=0.005)
    written = batch.inputs[:, 1::2][batch.inputs[:, 0::2] != READ] - BIT0
    assert abs(written.mean() - 0.5) < 0.01  # bits after w and i are uniform


def test_clean_mode_scores_the_bit_after_each_read_in_place():
    task = get_task("flip_flop")
    batch = task.sample(50, 100, np.random.default_rng(2))
    reads = np.zeros(batch.inputs.shape, dtype=bool)
    reads[:, 0::2] = batch.inputs[:, 0::2] == READ
    np.testing.assert_array_equal(batch.mask, reads)
    following = batch.inputs[:, 1::2] - BIT0  # the token after each instruction
    np.testing.assert_array_equal(batch.targets[:, 0::2][reads[:, 0::2]], following[reads[:, 0::2]])
    assert (batch.targets[~batch.mask] == 0).all()
    assert task.output_layout == "in_place" and task.causal  # the loss counts the reads only


@pytest.mark.parametrize("p_ignore", [0.8, 0.98, 0.1, 0.0, 1.0])
def test_the_oracle_recomputes_the_sampled_targets_over_many_seeds(p_ignore):
    task = get_task("flip_flop", p_ignore=p_ignore)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        for n in (2, 3, 17, 64):
            batch = task.sample(n, 16, rng)
            targets, mask = task.solve(batch.inputs)
            np.testing.assert_array_equal(targets, batch.targets)
            np.testing.assert_array_equal(mask, batch.mask)


def test_one_seed_gives_one_batch():
    task = get_task("flip_flop", p_ignore=0.98)
    first, again, other = (task.sample(40, 8, np.random.default_rng(s)) for s in (3, 3, 4))
    np.testing.assert_array_equal(first.inputs, again.inputs)
    assert not np.array_equal(first.inputs, other.inputs)


@pytest.mark.parametrize(
    "tokens, message",
    [([1, 3, 1, 4], "first w, last r"), ([0, 3, 2, 4], "first w, last r"), ([0, 3, 1], "pairs")],
)
def test_malformed_strings_are_refused_by_the_oracle(tokens, message):
    with pytest.raises(CheBenchError, match=message):
        get_task("flip_flop").solve(np.array([tokens]))


@pytest.mark.parametrize("p_ignore", [1.5, -0.1, "sparse", True, None])
def test_bad_parameters_are_one_line_errors(p_ignore):
    with pytest.raises(CheBenchError, match="p_ignore must") as error:
        get_task("flip_flop", p_ignore=p_ignore)
    assert "\n" not in str(error.value)
    with pytest.raises(CheBenchError, match="integer length >= 2"):
        get_task("flip_flop").sample(1, 2, np.random.default_rng(0))


def test_length_generalisation_trains_at_64_tokens_and_tests_at_512(tmp_path):
    """Grazzi et al.'s flip-flop variant: n = 32 instructions (T = 64) in training, n = 256
    (T = 512, the official length) in the test, end to end."""
    import pandas as pd

    from che_bench.cli import main

    config = make_config(
        "flip_flop", "rope", preset="smoke", curriculum="fixed",
        curriculum_options={"sequence_length": 32}, train_max_length=32, test_lengths="256",
    )
    task = config.build_task()
    assert task.model_length(32) == 64 and task.model_length(256) == 512 and config.causal
    store = str(tmp_path / "store.sqlite")
    assert main(["run", "--task", "flip_flop", "--task-param", "p_ignore=0.98", "--arch", "lstm",
                 "--arch-option", "hidden_size=8", "--preset", "smoke", "--steps", "2",
                 "--curriculum", "fixed", "--curriculum-option", "sequence_length=32",
                 "--train-max-length", "32", "--test-lengths", "256", "--eval-samples", "4",
                 "--store", store, "--no-keep-model", "--no-progress"]) == 0
    assert main(["export", "--store", store, "--per-length", "--out", str(tmp_path / "c.csv")]) == 0
    curves = pd.read_csv(tmp_path / "c.csv")
    assert curves.loc[curves["split"] == "test", "length"].tolist() == [256]
