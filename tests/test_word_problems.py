"""Group word problems: the element order and product of the spec (shared/spec/word_problems.md
1.1-1.2), its test vectors, DeltaProduct's variants, PaTH's identity form, the oracle against
the sampler, and the refused parameters."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from che_bench.cli import main
from che_bench.errors import CheBenchError
from che_bench.tasks import get_task
from che_bench.tasks.groups import Group

S3_ORDER = [(1, 2, 3), (1, 3, 2), (2, 1, 3), (2, 3, 1), (3, 1, 2), (3, 2, 1)]


def solve(tokens, **params):
    targets, mask = get_task("word_problem", **params).solve(np.array([tokens]))
    return targets[0].tolist(), mask[0].tolist()


def test_the_spec_test_vectors_in_s3():
    assert solve([1, 2], group="S3")[0] == [1, 4]
    assert solve([2, 1], group="S3")[0] == [2, 3]
    assert solve([3, 3, 3], group="S3")[0] == [3, 4, 0]
    for tokens, expected in (([1, 2], [1, 4]), ([2, 1], [2, 3]), ([3, 3, 3], [3, 4, 0])):
        table, product = Group("S3").table, 0  # the sampler's way: the Cayley table
        assert [product := int(table[product, x]) for x in tokens] == expected


def test_element_order_identity_first_permutations_order_a_n_renumbered():
    assert list(Group("S3").factors[0].elements) == S3_ORDER
    a5 = Group("A5").factors[0].elements
    s5 = list(itertools.permutations(range(1, 6)))
    assert len(a5) == 60 and a5[0] == (1, 2, 3, 4, 5)
    assert sorted(a5, key=s5.index) == list(a5)  # their S5 order
    assert {(2, 3, 1, 4, 5), (2, 1, 4, 3, 5)} <= set(a5) and (2, 1, 3, 4, 5) not in a5
    assert Group("Z60").element(7) == (7,) and Group("z60").name == "Z60"


def test_product_indices_and_componentwise_product():
    group = Group("A4_x_Z5")
    a4 = Group("A4").factors[0].elements
    assert group.order == 60 and group.name == "A4_x_Z5"
    assert group.element(3 * 5 + 4) == (a4[3], 4)
    three = Group("S3_x_Z2_x_Z3")  # ((i_g * |H|) + i_h) * |K| + i_k
    assert three.element((4 * 2 + 1) * 3 + 2) == (S3_ORDER[4], 1, 2)
    table = group.table
    assert table[3 * 5 + 4, 7 * 5 + 3] == Group("A4").table[3, 7] * 5 + (4 + 3) % 5


@pytest.mark.parametrize("name", ["S3", "S4", "A4", "A5", "Z7", "A4_x_Z5", "S3_x_Z2_x_Z3"])
def test_cayley_table_equals_composing_the_tuples(name):
    group = Group(name)
    for a, b in itertools.product(range(group.order), repeat=2):
        expected = group.index(group.compose(group.element(a), group.element(b)))
        assert group.table[a, b] == expected


def test_permutations_compose_as_functions_a_after_b():
    s3 = Group("S3")
    a, b = (S3_ORDER[1],), (S3_ORDER[2],)  # (1,3,2) after (2,1,3): 1 -> 2 -> 3
    assert s3.compose(a, b) == ((3, 1, 2),)


VARIANTS = [
    {"group": "S3"},
    {"group": "A5"},
    {"group": "Z60"},
    {"group": "A4_x_Z5"},
    {"group": "S5", "variant": "only_swaps"},
    {"group": "S5", "variant": "limit_to", "m": 3},
    {"group": "A5", "variant": "limit_to", "m": 3},
    {"group": "S5", "variant": "only_swaps_hard"},
    {"group": "S4", "variant": "only_swaps_hard", "m": 3},
    {"group": "S5", "variant": "tokens", "m": 4},
    {"group": "S3", "variant": "tokens", "m": 3, "separator": False},
    {"variant": "identity"},
    {"group": "A4", "variant": "identity"},
]


@pytest.mark.parametrize("params", VARIANTS)
def test_the_oracle_recomputes_the_sampled_targets_over_many_seeds(params):
    task = get_task("word_problem", **params)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        for n in (task.min_length, 5, 13, 40):
            batch = task.sample(n, 16, rng)
            targets, mask = task.solve(batch.inputs)
            np.testing.assert_array_equal(targets, batch.targets)
            np.testing.assert_array_equal(mask, batch.mask)


@pytest.mark.parametrize("params", VARIANTS)
def test_one_seed_gives_one_batch(params):
    task = get_task("word_problem", **params)
    first, again, other = (task.sample(12, 8, np.random.default_rng(s)) for s in (3, 3, 4))
    np.testing.assert_array_equal(first.inputs, again.inputs)
    np.testing.assert_array_equal(first.targets, again.targets)
    assert not np.array_equal(first.inputs, other.inputs)


def test_standard_words_are_uniform_and_scored_everywhere():
    batch = get_task("word_problem", group="S3").sample(30, 400, np.random.default_rng(0))
    counts = np.bincount(batch.inputs.ravel(), minlength=6) / batch.inputs.size
    assert np.abs(counts - 1 / 6).max() < 0.01 and batch.mask.all()


def test_only_swaps_and_limit_to_draw_the_elements_moving_few_points():
    swaps = get_task("word_problem", group="S5", variant="only_swaps")
    assert swaps.letters.tolist() == [0, 1, 2, 5, 6, 14, 21, 24, 54, 80, 105]  # DeltaProduct's
    assert len(get_task("word_problem", group="S5", variant="limit_to", m=3).letters) == 31
    batch = swaps.sample(200, 8, np.random.default_rng(0))
    assert set(np.unique(batch.inputs)) <= set(swaps.letters.tolist())
    assert len(np.unique(batch.targets)) > 11  # the products leave the swaps


def test_only_swaps_hard_blocks_products_then_identities_labels_delayed():
    task = get_task("word_problem", group="S5", variant="only_swaps_hard")
    batch = task.sample(14, 32, np.random.default_rng(1))
    starts = np.arange(14) % 4 == 0
    assert (batch.inputs[:, ~starts] == 0).all()
    table = Group("S5").table
    for inputs, targets in zip(batch.inputs, batch.targets):
        product = 0
        for j, element in enumerate(inputs[starts]):
            before = product
            product = table[product, element]
            block = targets[4 * j : 4 * j + 4].tolist()
            # label at 4j+3 = p_0..p_j; at 4j..4j+2 = p_0..p_(j-1); the last block is cut
            assert block == ([before] * 3 + [product])[: len(block)]


def test_hard_elements_are_products_of_four_swaps():
    swaps = set(get_task("word_problem", group="S5", variant="only_swaps").letters.tolist())
    table = Group("S5").table
    products = {
        int(table[table[table[a, b], c], d]) for a, b, c, d in itertools.product(swaps, repeat=4)
    }
    batch = get_task("word_problem", group="S5", variant="only_swaps_hard").sample(
        16, 200, np.random.default_rng(0)
    )
    assert set(batch.inputs[:, ::4].ravel().tolist()) <= products


def test_tokens_variant_example_of_the_docstring():
    targets, mask = solve([3, 6, 3, 6, 3], group="S3", variant="tokens", m=2)
    assert targets == [0, 3, 3, 4, 4] and all(mask)
    copies = solve([3, 3, 3, 3, 3], group="S3", variant="tokens", m=2, separator=False)[0]
    assert copies == [0, 3, 3, 4, 4]
    batch = get_task("word_problem", group="S3", variant="tokens", m=2).sample(
        7, 4, np.random.default_rng(0)
    )
    assert (batch.inputs[:, 1::2] == 6).all() and (batch.inputs[:, 0::2] < 6).all()
    with pytest.raises(CheBenchError, match="block must start with an element"):
        solve([6, 3], group="S3", variant="tokens", m=2)


def test_identity_form_uses_paths_generators_and_balanced_classes():
    task = get_task("word_problem", variant="identity")
    a5 = Group("A5").factors[0].elements
    cycles = {a5[i] for i in task.letters}
    assert cycles == {
        (2, 3, 1, 4, 5), (2, 4, 3, 1, 5), (2, 5, 3, 4, 1),  # (1 2 3), (1 2 4), (1 2 5)
        (3, 1, 2, 4, 5), (4, 1, 3, 2, 5), (5, 1, 3, 4, 2),  # their inverses
    }
    for n in (2, 3, 17, 100):
        batch = task.sample(n, 2000, np.random.default_rng(n))
        assert batch.mask[:, -1].all() and batch.mask.sum() == 2000
        assert abs(batch.targets[:, -1].mean() - 0.5) < 0.04
        assert set(np.unique(batch.inputs)) <= set(task.letters.tolist())
    # n = 2: the identity words are the generators followed by their inverses.
    two = task.sample(2, 500, np.random.default_rng(0))
    identity_words = {tuple(a5[i] for i in row) for row in two.inputs[two.targets[:, -1] == 1]}
    assert len(identity_words) == 6
    assert all(Group("A5").compose((a,), (b,)) == (a5[0],) for a, b in identity_words)


def test_identity_words_of_one_length_are_uniform_among_themselves():
    """n = 3 words equal to the identity are exactly g g g for the 6 generators (3-cycles)."""
    task = get_task("word_problem", variant="identity", group="A4")
    batch = task.sample(3, 3000, np.random.default_rng(0))
    words = batch.inputs[batch.targets[:, -1] == 1]
    assert (words == words[:, :1]).all()
    counts = np.bincount(words[:, 0], minlength=12)[task.letters]
    assert counts.min() > 0.7 * counts.mean()


@pytest.mark.parametrize(
    "params, message",
    [
        ({"group": "S9"}, "S9 has more than 2048 elements"),
        ({"group": "Q3"}, "expected factors S<n>, A<n> or Z<n>"),
        ({"group": "S1"}, "S<n> needs n >= 2"),
        ({"group": "A2"}, "A<n> needs n >= 3"),
        ({"group": "S6_x_Z3"}, "S6_x_Z3 has 2160 elements"),
        ({"group": 5}, "group must be a string"),
        ({"variant": "swaps"}, "parameter 'variant' must be one of"),
        ({"group": "S5", "variant": "limit_to"}, "variant limit_to needs m"),
        ({"group": "S5", "m": 3}, "m is for variants"),
        ({"group": "S5", "variant": "tokens", "m": 1}, "'m' must be an integer >= 2"),
        ({"group": "S5", "separator": False}, "false only with variant tokens"),
        ({"group": "Z5", "variant": "only_swaps"}, "needs a group S<n> or A<n>, got Z5"),
        ({"group": "A5", "variant": "only_swaps"}, "only the identity moves at most 2"),
        ({"group": "S5", "variant": "identity"}, "variant identity needs a group A<n>"),
    ],
)
def test_bad_parameters_are_one_line_errors(params, message):
    with pytest.raises(CheBenchError, match=message) as error:
        get_task("word_problem", **params)
    assert "\n" not in str(error.value)


def test_identity_needs_two_letters_and_cli_errors_exit_two(capsys):
    with pytest.raises(CheBenchError, match="integer length >= 2"):
        get_task("word_problem", variant="identity").sample(1, 2, np.random.default_rng(0))
    assert main(["sample", "--task", "word_problem", "--length", "3", "--param", "group=X"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_causal_in_place_by_default():
    task = get_task("word_problem")
    assert task.causal and task.output_layout == "in_place" and task.params() == {
        "group": "A5", "variant": "standard", "m": None, "separator": True
    }
