"""Statistical checks that the samplers draw from the distributions of spec sections 2 and 7.

Each check uses a fixed seed and a tolerance of about five standard errors, so it is stable
yet fails for a wrong range or an off-by-one in a split.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from che_bench.tasks import get_task

SAMPLES = 6000


def sample(name: str, n: int, count: int = SAMPLES, seed: int = 0, **params):
    return get_task(name, **params).sample(n, count, np.random.default_rng(seed))


def assert_uniform(values: np.ndarray, low: int, high: int) -> None:
    """Every value in low..high occurs, none outside, each with frequency ~1/(high-low+1)."""
    support = np.arange(low, high + 1)
    assert set(np.unique(values)) == set(support.tolist())
    frequency = (values[:, None] == support[None, :]).mean(axis=0)
    p = 1 / len(support)
    tolerance = 5 * math.sqrt(p * (1 - p) / len(values))
    assert np.abs(frequency - p).max() <= tolerance, frequency


def test_bits_are_balanced_for_the_iid_string_tasks():
    for name in ("even_pairs", "parity_check", "reverse_string", "duplicate_string", "odds_first"):
        inputs = sample(name, 50, 2000).inputs
        assert_uniform(inputs.ravel(), 0, 1)


def test_cycle_navigation_and_bucket_sort_tokens_are_uniform():
    assert_uniform(sample("cycle_navigation", 50, 2000).inputs.ravel(), 0, 2)
    assert_uniform(sample("bucket_sort", 50, 2000).inputs.ravel(), 0, 4)


def test_modular_arithmetic_layout_and_operator_frequencies():
    inputs = sample("modular_arithmetic", 40).inputs
    assert inputs.shape[1] == 39  # even n uses n-1 tokens
    assert_uniform(inputs[:, 0::2].ravel(), 0, 4)
    assert_uniform(inputs[:, 1::2].ravel(), 5, 7)  # +, -, * equally often; the blank 8 never


def test_stack_size_is_uniform_between_one_and_n_minus_one():
    inputs = sample("stack_manipulation", 10).inputs
    stack_size = np.argmax(inputs >= 2, axis=1)
    assert (inputs[:, -1] >= 2).all()  # at least one action
    assert_uniform(stack_size, 1, 9)
    position = np.arange(10)[None, :]
    assert_uniform(inputs[position < stack_size[:, None]], 0, 1)
    assert_uniform(inputs[position >= stack_size[:, None]], 2, 4)
    assert_uniform(sample("stack_manipulation", 1).inputs.ravel(), 0, 1)  # n = 1: one bit


@pytest.mark.parametrize("name", ["binary_addition", "binary_multiplication"])
def test_binary_operand_sizes_and_values(name):
    n = 9
    inputs = sample(name, n).inputs
    assert ((inputs == 2).sum(axis=1) == 1).all()
    first_size = np.argmax(inputs == 2, axis=1)
    assert_uniform(first_size, 1, n - 2)
    operands = [[int(bits[::-1], 2) for bits in "".join(map(str, row)).split("2")] for row in inputs]
    first, second = np.array(operands).T
    assert (first >= 1).all() and (second >= 1).all()
    assert (first[first_size == 1] == 1).all()  # a one-bit operand is always 1
    assert_uniform(first[first_size == 3], 1, 7)
    assert_uniform(second[first_size == 4], 1, 15)  # 9 - 1 - 4 = 4 bits
    # High zero padding occurs: the top bit of a 7-bit operand is 0 about half the time.
    top_bit = inputs[first_size == 7, 6]
    assert 0.4 < top_bit.mean() < 0.6


def test_binary_short_lengths_have_no_separator():
    assert_uniform(sample("binary_addition", 2).inputs @ np.array([1, 2]), 0, 2)
    assert (sample("binary_multiplication", 1).inputs == 0).all()


def test_compute_sqrt_numbers_are_uniform_and_never_zero():
    inputs = sample("compute_sqrt", 4).inputs
    assert_uniform(inputs @ np.array([8, 4, 2, 1]), 1, 15)


def _left_operand_size(tokens: np.ndarray, open_id: int, close_id: int, minus_id: int) -> int:
    """Size of L in the root ``( L op R )``."""
    if tokens[1] == minus_id:
        return 2
    if tokens[1] != open_id:
        return 1
    depth = 0
    for index in range(1, len(tokens)):
        depth += int(tokens[index] == open_id) - int(tokens[index] == close_id)
        if depth == 0:
            return index
    raise AssertionError("unbalanced")


def test_bracket_grammar_root_split_and_operators_are_uniform():
    n = 12
    inputs = sample("modular_arithmetic_brackets", n, 3000).inputs
    left = np.array([_left_operand_size(row, 8, 9, 6) for row in inputs])
    assert_uniform(left, 1, n - 4)
    operators = inputs[np.arange(len(inputs)), 1 + left]
    assert_uniform(operators, 5, 7)
    assert (inputs[:, 0] == 8).all() and (inputs[:, -1] == 9).all()


def test_bracket_grammar_short_forms():
    forms = {1: [None], 2: [6, None], 3: [8, None, 9], 4: [8, 6, None, 9]}  # None = a digit
    for n, form in forms.items():
        inputs = sample("modular_arithmetic_brackets", n, 500).inputs
        for index, token in enumerate(form):
            if token is None:
                assert_uniform(inputs[:, index], 0, 4)
            else:
                assert (inputs[:, index] == token).all()


def test_bracket_class_zero_is_overrepresented_as_in_the_reference():
    targets = sample("modular_arithmetic_brackets", 100, 3000).targets[:, 0]
    assert 0.24 < (targets == 0).mean() < 0.34  # spec: ~29% at long lengths


def test_solve_equation_x_moves_right_cyclically_to_a_digit():
    # n = 7: E = ( d op d ); a start at 0, 1 or 4 (wrapping) lands on index 1, at 2 or 3 on 3.
    inputs = sample("solve_equation", 7).inputs
    at_first_digit = (inputs[:, 1] == 9).mean()
    assert abs(at_first_digit - 0.6) < 5 * math.sqrt(0.24 / SAMPLES)
    assert ((inputs == 9).sum(axis=1) == 1).all()
    assert_uniform(inputs[:, 2], 5, 6)  # + and - only, never *
    assert_uniform(sample("solve_equation", 30).targets[:, 0], 0, 4)


def test_missing_duplicate_blank_is_uniform_and_padding_only_for_odd_lengths():
    odd = sample("missing_duplicate_string", 9).inputs
    assert (odd[:, -1] == 3).all() and not (odd[:, :-1] == 3).any()
    assert_uniform(np.argmax(odd == 2, axis=1), 0, 7)
    even = sample("missing_duplicate_string", 8).inputs
    assert not (even == 3).any()
    assert_uniform(np.argmax(even == 2, axis=1), 0, 7)
    assert (sample("missing_duplicate_string", 1, 10).inputs == 1).all()


@pytest.mark.parametrize("n", [2, 3, 8, 41, 500])
def test_missing_duplicates_answer_is_the_parity_of_the_ones_left(n):
    """ss holds every bit twice, so an even number of ones: blanking one leaves the answer as
    the parity of the ones in the input. A model that solves parity_check (regular) solves
    this context-sensitive task (docs/tasks.md)."""
    batch = sample("missing_duplicate_string", n)
    assert ((batch.inputs == 1).sum(axis=1) % 2 == batch.targets[:, 0]).all()


def _recall_query_index(inputs: np.ndarray) -> np.ndarray:
    """1-based index of the queried pair (inputs without a leading BLANK)."""
    return np.argmax(inputs[:, :-1:2] == inputs[:, -1:], axis=1) + 1


@pytest.mark.parametrize(
    ("distance", "n", "low", "high"),
    [("uniform", 21, 1, 10), ("near", 41, 17, 20), ("near", 5, 1, 2), ("far", 41, 1, 5), ("far", 5, 1, 1)],
)
def test_recall_query_position_ranges(distance, n, low, high):
    inputs = sample("associative_recall", n, distance=distance).inputs
    assert_uniform(_recall_query_index(inputs), low, high)


def test_recall_keys_values_and_leading_blank():
    task = get_task("associative_recall")
    even = task.sample(42, 2000, np.random.default_rng(0)).inputs
    assert (even[:, 0] == task.blank).all() and not (even[:, 1:] == task.blank).any()
    body = even[:, 1:-1]
    keys, values = body[:, 0::2], body[:, 1::2]
    assert (keys < 256).all() and ((values >= 256) & (values < 512)).all()
    assert all(len(set(row)) == 20 for row in keys) and all(len(set(row)) == 20 for row in values)
    assert_uniform(keys.ravel(), 0, 255)
    odd = task.sample(41, 10, np.random.default_rng(0)).inputs
    assert not (odd == task.blank).any()
    iid = sample("associative_recall", 41, 100, num_values=4, value_mode="iid").inputs
    assert any(len(set(row)) < 20 for row in iid[:, 1:-1:2])  # repeats happen


def test_induction_trigger_position_and_layout():
    n = 12
    inputs = sample("induction", n).inputs
    assert ((inputs == 16).sum(axis=1) == 2).all() and (inputs[:, -1] == 16).all()
    assert_uniform(np.argmax(inputs == 16, axis=1), 0, n - 3)
    assert_uniform(inputs[inputs != 16], 0, 15)
