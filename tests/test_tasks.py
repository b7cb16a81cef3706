"""Task generators: worked examples of the spec, other parameters, registry, errors (the
conformance checks of every task, oracle/sampler agreement included: test_conformance)."""

from __future__ import annotations

import numpy as np
import pytest

from che_bench.errors import CheBenchError
from che_bench.tasks import TASKS, get_task, list_tasks


def solve_one(task_name: str, tokens: list[int], **params) -> tuple[list[int], list[int]]:
    targets, mask = get_task(task_name, **params).solve(np.array([tokens]))
    return targets[0].tolist(), mask[0].astype(int).tolist()


# (task, params, input, target, mask or None for all ones); from spec section 2 and 7.
WORKED_EXAMPLES = [
    ("even_pairs", {}, [0, 1, 0, 0, 1, 1, 0], [0], None),
    ("even_pairs", {}, [1, 0, 0], [1], None),
    ("even_pairs", {}, [1], [0], None),
    ("modular_arithmetic", {}, [4, 6, 2, 7, 0, 7, 4], [4], None),  # 4 - 2 * 0 * 4
    ("modular_arithmetic", {}, [3, 5, 4, 5, 0], [2], None),  # 3 + 4 + 0 (requested n = 6)
    ("modular_arithmetic", {}, [1, 5, 2, 7, 3], [2], None),  # 1 + 2 * 3 = 7
    ("modular_arithmetic", {}, [1, 6, 1, 6, 1], [4], None),  # 1 - 1 - 1 = -1
    ("modular_arithmetic", {}, [0, 7, 1, 5, 4, 7, 3, 6, 2], [0], None),  # 0*1 + 4*3 - 2 = 10
    ("parity_check", {}, [0, 1, 0, 0, 1, 1, 0], [1], None),
    ("cycle_navigation", {}, [2, 0, 2, 2, 1, 1, 2], [3], None),
    ("cycle_navigation", {}, [0, 0], [3], None),  # two steps left of 0 on a 5-cycle
    ("stack_manipulation", {}, [1, 0, 1, 0, 1, 1, 2], [1, 0, 1, 0, 1, 2, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]),
    ("stack_manipulation", {}, [1], [1, 2], [1, 1]),
    ("stack_manipulation", {}, [0, 1, 1, 0, 4, 2, 2], [1, 1, 0, 2, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]),
    ("stack_manipulation", {}, [1, 1, 0, 2, 2, 2, 2], [2, 0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]),
    ("reverse_string", {}, [0, 1, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 1, 0], None),
    ("modular_arithmetic_brackets", {}, [8, 6, 0, 7, 6, 3, 9], [0], None),  # ( - 0 * - 3 )
    ("modular_arithmetic_brackets", {}, [8, 8, 0, 6, 3, 9, 6, 6, 3, 9], [0], None),  # ((0-3)--3)
    ("modular_arithmetic_brackets", {}, [8, 2, 7, 8, 6, 3, 9, 9], [4], None),  # ( 2 * ( - 3 ) )
    ("modular_arithmetic_brackets", {}, [6, 3], [2], None),  # - 3
    ("solve_equation", {}, [7, 1, 6, 9, 8, 10, 1], [0], None),  # ( 1 - x ) = 1
    ("solve_equation", {}, [7, 6, 9, 8, 10, 4], [1], None),  # ( - x ) = 4
    ("solve_equation", {}, [7, 3, 6, 6, 9, 8, 10, 0], [2], None),  # ( 3 - - x ) = 0
    ("solve_equation", {}, [9, 10, 3], [3], None),  # x = 3
    ("solve_equation", {}, [0, 0], [0], None),  # degenerate n < 3
    ("duplicate_string", {}, [0, 1, 1], [0, 1, 1, 0, 1, 1], None),
    ("missing_duplicate_string", {}, [1, 2, 1, 1, 0, 1, 3], [0], None),
    ("missing_duplicate_string", {}, [0, 1, 1, 0, 0, 2, 1, 0], [1], None),
    ("missing_duplicate_string", {}, [1], [1], None),
    ("odds_first", {}, [0, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1, 0], None),
    ("binary_addition", {}, [1, 1, 0, 1, 2, 1, 0], [0, 0, 1, 1, 2, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]),
    ("binary_addition", {}, [0, 1], [0, 1, 2], [1, 1, 1]),  # n = 2: N = 2, no separator
    ("binary_addition", {}, [0], [0, 2], [1, 1]),
    ("binary_multiplication", {}, [1, 1, 0, 1, 2, 1, 0], [1, 1, 0, 1, 2, 0, 0], [1, 1, 1, 1, 1, 0, 0]),
    ("binary_multiplication", {}, [1, 1], [0, 2], [1, 1]),  # constant target for n <= 2
    ("binary_multiplication", {}, [0], [2], [1]),
    ("compute_sqrt", {}, [0, 1, 1, 0, 0, 1, 1], [0, 1, 1, 1], None),
    ("compute_sqrt", {}, [1, 0, 0, 0, 0, 0, 0, 0], [1, 0, 1, 1], None),  # isqrt(128) = 11
    ("bucket_sort", {}, [2, 0, 3, 1, 1, 1], [0, 1, 1, 1, 2, 3], None),
    ("associative_recall", {"num_keys": 4, "num_values": 4}, [8, 3, 5, 0, 7, 0], [3], None),
    ("associative_recall", {"num_keys": 4, "num_values": 4}, [2, 6, 2], [2], None),
    ("induction", {"alphabet": 4}, [2, 4, 1, 3, 0, 4], [1], None),
    ("induction", {"alphabet": 4}, [4, 3, 4], [3], None),
]


@pytest.mark.parametrize(("name", "params", "tokens", "target", "mask"), WORKED_EXAMPLES)
def test_worked_examples(name, params, tokens, target, mask):
    got_target, got_mask = solve_one(name, tokens, **params)
    assert got_target == target
    assert got_mask == (mask if mask is not None else [1] * len(target))


def test_registry_lists_the_twenty_tasks_in_table_order():
    names = list_tasks()
    assert len(names) == 20
    assert names[:4] == ["even_pairs", "modular_arithmetic", "parity_check", "cycle_navigation"]
    assert names[-5:] == ["associative_recall", "induction", "mqar", "word_problem", "flip_flop"]
    # The state-tracking tasks are regular languages (a finite group; a one-bit memory).
    assert [get_task(name).level for name in names] == (
        ["regular"] * 4 + ["dcf"] * 4 + ["cs"] * 7 + ["recall"] * 3 + ["regular"] * 2
    )


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("missing_duplicate", "missing_duplicate_string"),
        ("MISSING DUPLICATE", "missing_duplicate_string"),
        ("MODULAR ARITHMETIC (SIMPLE)", "modular_arithmetic"),
        ("modular_arithmetic_simple", "modular_arithmetic"),
        ("Even Pairs", "even_pairs"),
        ("binary-addition", "binary_addition"),
        ("recall_single", "associative_recall"),
        ("induction_trigger", "induction"),
        ("word problems", "word_problem"),
        ("flipflop", "flip_flop"),
        ("FFL", "flip_flop"),
    ],
)
def test_aliases_resolve(alias, name):
    assert get_task(alias).name == name


# Sizes and output lengths of spec table 1.1 (reference parameters).
SIZES = {
    "even_pairs": (2, 2, 1), "modular_arithmetic": (9, 5, 1), "parity_check": (2, 2, 1),
    "cycle_navigation": (3, 5, 1), "stack_manipulation": (5, 3, 11), "reverse_string": (2, 2, 10),
    "modular_arithmetic_brackets": (11, 5, 1), "solve_equation": (11, 5, 1),
    "duplicate_string": (2, 2, 20), "missing_duplicate_string": (4, 2, 1), "odds_first": (2, 2, 10),
    "binary_addition": (3, 3, 11), "binary_multiplication": (3, 3, 10), "compute_sqrt": (2, 2, 5),
    "bucket_sort": (5, 5, 10), "associative_recall": (513, 256, 1), "induction": (17, 16, 1),
    "mqar": (64, 32, 10), "word_problem": (60, 60, 10), "flip_flop": (5, 2, 20),
}


@pytest.mark.parametrize("name", list_tasks())
def test_sizes_match_the_spec_table(name):
    task = get_task(name)
    assert (task.input_size, task.output_size, task.output_length(10)) == SIZES[name]
    assert task.chance == pytest.approx(1 / task.output_size)
    assert len(task.input_symbols) == task.input_size


def test_output_lengths_at_odd_lengths_and_modular_arithmetic_input_length():
    assert get_task("compute_sqrt").output_length(7) == 4
    modular = get_task("modular_arithmetic")
    assert [modular.input_length(n) for n in (1, 2, 6, 7)] == [1, 1, 5, 7]
    assert get_task("duplicate_string").input_length(6) == 6


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("modular_arithmetic", {"modulus": 7}),
        ("cycle_navigation", {"cycle_length": 3}),
        ("reverse_string", {"vocab_size": 4}),
        ("modular_arithmetic_brackets", {"modulus": 7, "mult": False}),
        ("solve_equation", {"modulus": 3}),
        ("bucket_sort", {"vocab_size": 3}),
        ("associative_recall", {"num_keys": 32, "num_values": 4, "value_mode": "iid", "distance": "far"}),
        ("associative_recall", {"num_keys": 64, "num_values": 64, "distance": "near"}),
        ("induction", {"alphabet": 3}),
    ],
)
def test_oracle_agrees_with_sampler_for_other_parameters(name, params):
    task = get_task(name, **params)
    assert task.params() == {**get_task(name).params(), **params}
    rng = np.random.default_rng(7)
    for n in (task.min_length, 5, 16, 33, 60):
        batch = task.sample(n, 64, rng)
        targets, mask = task.solve(batch.inputs)
        np.testing.assert_array_equal(targets, batch.targets)
        np.testing.assert_array_equal(mask, batch.mask)


def test_modular_arithmetic_brackets_without_mult_never_multiplies():
    without = get_task("modular_arithmetic_brackets", mult=False).sample(60, 64, np.random.default_rng(0))
    with_mult = get_task("modular_arithmetic_brackets").sample(60, 64, np.random.default_rng(0))
    assert not (without.inputs == 7).any() and (with_mult.inputs == 7).any()


@pytest.mark.parametrize("name", [name for name in list_tasks() if TASKS.get(name).permutation_invariant])
def test_permutation_invariant_targets_survive_a_shuffle(name):
    task = get_task(name)
    rng = np.random.default_rng(3)
    batch = task.sample(30, 64, rng)
    shuffled = batch.inputs[:, rng.permutation(30)]
    np.testing.assert_array_equal(task.solve(shuffled)[0], batch.targets)


def test_order_dependent_task_changes_under_a_shuffle():
    task = get_task("reverse_string")
    batch = task.sample(30, 64, np.random.default_rng(3))
    shuffled = batch.inputs[:, np.random.default_rng(4).permutation(30)]
    assert not np.array_equal(task.solve(shuffled)[0], batch.targets)


def test_recall_ceiling_distinct_is_one_over_the_number_of_pairs():
    task = get_task("associative_recall")
    assert task.ceiling(7) == pytest.approx(1 / 3)
    assert task.ceiling(41) == pytest.approx(1 / 20)
    assert task.ceiling(42) == pytest.approx(1 / 20)  # leading BLANK, same pairs
    assert task.ceiling(500) == pytest.approx(1 / 249)
    assert task.ceiling(3) == 1.0


def test_recall_ceiling_iid_matches_exact_values_and_is_deterministic():
    task = get_task("associative_recall", num_values=16, value_mode="iid")
    assert task.ceiling(3) == 1.0  # one pair
    # Two pairs: the mode count is 2 with probability 1/V, so E[max]/P = (1 + 1/V) / 2.
    assert task.ceiling(5) == pytest.approx((1 + 1 / 16) / 2, abs=0.01)
    assert task.ceiling(101) == task.ceiling(101)
    assert 1 / 16 < task.ceiling(501) < task.ceiling(101) < task.ceiling(11)


def test_recall_ceiling_iid_is_the_accuracy_of_guessing_the_most_frequent_value():
    task = get_task("associative_recall", num_keys=16, num_values=4, value_mode="iid")
    batch = task.sample(9, 20_000, np.random.default_rng(0))  # P = 4 pairs
    values = batch.inputs[:, 1:-1:2] - task.num_keys
    counts = np.stack([(values == v).sum(axis=1) for v in range(4)], axis=1)
    # Credit a guess among the tied modes with the chance of picking the right one.
    modes = counts == counts.max(axis=1, keepdims=True)
    right = modes[np.arange(len(values)), batch.targets[:, 0]] / modes.sum(axis=1)
    assert right.mean() == pytest.approx(task.ceiling(9), abs=0.01)


def test_induction_ceiling_and_other_tasks():
    induction = get_task("induction")
    assert induction.ceiling(3) == 1.0  # a body of two symbols, one overwritten: x is left
    assert 1 / 16 < induction.ceiling(500) < induction.ceiling(41) < induction.ceiling(5)
    assert get_task("parity_check").ceiling(40) == 1.0
    assert get_task("reverse_string").ceiling(40) is None


def test_unknown_task_names_the_valid_ones():
    with pytest.raises(CheBenchError, match="even_pairs.*induction"):
        get_task("evenpairs_typo")


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("even_pairs", {"vocab_size": 3}, r"no parameter vocab_size \(it has no parameters\)"),
        ("reverse_string", {"vocab": 3}, "its parameters: vocab_size"),
        ("reverse_string", {"vocab_size": 1}, "vocab_size"),
        ("modular_arithmetic", {"modulus": "5"}, "modulus"),
        ("modular_arithmetic_brackets", {"mult": 1}, "mult"),
        ("cycle_navigation", {"cycle_length": True}, "cycle_length"),
        ("associative_recall", {"value_mode": "random"}, "distinct, iid"),
        ("associative_recall", {"distance": "middle"}, "uniform, near, far"),
        ("associative_recall", {"num_keys": 0}, "num_keys"),
        ("induction", {"alphabet": 1}, "alphabet"),
    ],
)
def test_bad_parameters_raise(name, params, message):
    with pytest.raises(CheBenchError, match=message):
        get_task(name, **params)


@pytest.mark.parametrize("length", [0, -3, 2.5, "7", True, None])
def test_bad_lengths_raise(length):
    with pytest.raises(CheBenchError, match="integer length >= 1"):
        get_task("reverse_string").sample(length, 4, np.random.default_rng(0))


def test_recall_lengths_are_bounded_by_min_length_and_the_key_count():
    recall = get_task("associative_recall", num_keys=8, num_values=64)
    with pytest.raises(CheBenchError, match=">= 3"):
        recall.sample(2, 4, np.random.default_rng(0))
    assert recall.max_length == 18  # P = (n-1)//2 <= 8 keys
    recall.sample(18, 4, np.random.default_rng(0))
    with pytest.raises(CheBenchError, match="up to 18"):
        recall.sample(19, 4, np.random.default_rng(0))
    assert get_task("associative_recall").max_length == 514
    assert get_task("associative_recall", num_values=16, value_mode="iid").max_length == 514
    assert get_task("associative_recall", num_values=16).max_length == 34
    with pytest.raises(CheBenchError, match=">= 3"):
        get_task("induction").ceiling(2)


@pytest.mark.parametrize("batch_size", [0, -1, 1.5])
def test_bad_batch_sizes_raise(batch_size):
    with pytest.raises(CheBenchError, match="batch size"):
        get_task("parity_check").sample(5, batch_size, np.random.default_rng(0))


@pytest.mark.parametrize(
    ("name", "tokens"),
    [
        ("stack_manipulation", [1, 2, 0]),  # a bit after an action
        ("binary_addition", [1, 2, 1, 2, 1]),  # two separators
        ("binary_addition", [1, 1, 1]),  # no separator at n >= 3
        ("missing_duplicate_string", [0, 1, 0, 1]),  # no blank
        ("solve_equation", [7, 1, 6, 2, 8, 10, 1]),  # no x
        ("solve_equation", [9, 5, 9, 10, 1]),  # two x
        ("modular_arithmetic_brackets", [8, 1, 5, 9]),  # ( 1 + )
        ("modular_arithmetic_brackets", [8, 1, 5, 2]),  # unclosed bracket
        ("modular_arithmetic", [1, 5]),  # dangling operator
        ("associative_recall", [0, 256, 1]),  # the queried key never occurred
        ("induction", [1, 2, 3]),  # no trigger at the end
    ],
)
def test_oracle_rejects_malformed_inputs(name, tokens):
    with pytest.raises(CheBenchError):
        get_task(name).solve(np.array([tokens]))


def test_oracle_rejects_out_of_range_ids_and_bad_shapes():
    with pytest.raises(CheBenchError, match="0..1"):
        get_task("parity_check").solve(np.array([[0, 2]]))
    with pytest.raises(CheBenchError, match="2-D"):
        get_task("parity_check").solve(np.array([0, 1]))
