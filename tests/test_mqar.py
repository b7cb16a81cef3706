"""MQAR (Zoology's multi-query associative recall): the generator's facts, both axes, the
oracle, and the in-place output layout of the model (logits at the input positions, loss on
the queries)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from che_bench.errors import CheBenchError
from che_bench.model.encoder import build_model
from che_bench.tasks import get_task
from che_bench.train.metrics import token_loss

SMALL = {"vocab_size": 16, "num_pairs": 2, "power_a": 1.0, "random_non_queries": False}


def test_worked_example_of_the_docstring():
    tokens = [3, 9, 5, 12, 5, 0, 0, 0, 3, 0]
    targets, mask = get_task("mqar", **SMALL).solve(np.array([tokens]))
    assert mask[0].nonzero()[0].tolist() == [4, 8]
    assert targets[0, [4, 8]].tolist() == [12 - 8, 9 - 8]


def test_context_pairs_then_every_key_queried_once_at_an_even_offset():
    task = get_task("mqar", vocab_size=64, num_pairs=5, random_non_queries=False)
    batch = task.sample(41, 200, np.random.default_rng(0))
    keys, values = batch.inputs[:, 0:10:2], batch.inputs[:, 1:10:2]
    assert ((1 <= keys) & (keys < 32)).all() and ((32 <= values) & (values < 64)).all()
    for row_keys, row_values in ((np.sort(k), np.sort(v)) for k, v in zip(keys, values)):
        assert len(set(row_keys)) == 5 and len(set(row_values)) == 5
    region = batch.inputs[:, 10:]
    assert (region[:, 1::2] == 0).all() and region[:, -1].tolist() == [0] * 200  # odd L: last is filler
    queried = np.sort(np.where(region[:, 0::2] > 0, region[:, 0::2], 64), axis=1)[:, :5]
    np.testing.assert_array_equal(queried, np.sort(keys, axis=1))
    assert (batch.mask.sum(1) == 5).all() and not batch.mask[:, :10].any()
    answers = batch.inputs[:, 1::2][:, :5]  # the values, in key order
    for row in range(200):
        bound = dict(zip(keys[row], answers[row] - 32))
        for position in batch.mask[row].nonzero()[0]:
            assert batch.targets[row, position] == bound[batch.inputs[row, position]]


def test_power_law_puts_queries_near_the_context_and_a_1_is_uniform():
    def mean_query_offset(power_a):
        task = get_task("mqar", vocab_size=64, num_pairs=4, power_a=power_a, random_non_queries=False)
        batch = task.sample(200, 400, np.random.default_rng(3))
        return batch.mask[:, 8:].nonzero()[1].mean()

    # 96 slots at even offsets 0..190: uniform choice averages offset 95; a = 0.01 ~ 1/i weights
    assert mean_query_offset(1.0) == pytest.approx(95, abs=6)
    assert mean_query_offset(0.01) < 60


def test_random_non_queries_fill_from_the_whole_vocabulary():
    batch = get_task("mqar", vocab_size=32, random_non_queries=True).sample(100, 50, np.random.default_rng(0))
    filler = batch.inputs[:, 8:][~batch.mask[:, 8:]]
    assert filler.min() == 0 and filler.max() == 31 and len(np.unique(filler)) == 32


def test_a_filler_repeating_a_key_before_its_query_is_the_scored_occurrence():
    # k3 -> v9; offset 0 of the query region holds a filler k3, the query slot is offset 2
    targets, mask = get_task("mqar", vocab_size=16, num_pairs=1).solve(np.array([[3, 9, 3, 7, 3, 0]]))
    assert mask[0].tolist() == [False, False, True, False, False, False] and targets[0, 2] == 1


def test_pairs_as_a_function_of_the_length():
    task = get_task("mqar", vocab_size=64, length_per_pair=16)
    assert [task.pairs(n) for n in (16, 64, 128, 255)] == [1, 4, 8, 15]
    assert task.min_length == 16 and task.max_length == 32 * 16 - 1
    batch = task.sample(128, 8, np.random.default_rng(0))
    assert (batch.mask.sum(1) == 8).all()


def test_formula_and_axis_label_name_the_axis_of_each_instance():
    by_length = get_task("mqar")
    by_pairs = get_task("mqar", axis="pairs", sequence_length=64)
    assert (by_length.output_length_formula, by_length.length_label) == ("n (in place)", "length n")
    assert (by_pairs.output_length_formula, by_pairs.length_label) == (
        "64 (in place)",
        "pairs D (length 64)",
    )
    assert get_task("mqar").output_length_formula == "n (in place)"  # the class keeps its own


def test_pairs_axis_fixes_the_length_and_the_oracle_counts_the_pairs():
    task = get_task("mqar", vocab_size=64, axis="pairs", sequence_length=64)
    assert (task.min_length, task.max_length, task.length_label) == (1, 16, "pairs D (length 64)")
    rng = np.random.default_rng(5)
    for pairs in (1, 2, 7, 16):
        batch = task.sample(pairs, 64, rng)
        assert batch.inputs.shape == batch.targets.shape == (64, 64)
        assert (batch.mask.sum(1) == pairs).all()
        targets, mask = task.solve(batch.inputs)
        np.testing.assert_array_equal(targets, batch.targets)
        np.testing.assert_array_equal(mask, batch.mask)
    with pytest.raises(CheBenchError, match="up to 16"):
        task.sample(17, 4, rng)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"vocab_size": 15}, "even"),
        ({"vocab_size": 8, "num_pairs": 4}, "vocab_size >= 10"),
        ({"power_a": 0}, r"power_a must lie in \(0, 1\]"),
        ({"power_a": 1.5}, "power_a"),
        ({"axis": "width"}, "length, pairs"),
        ({"num_pairs": 4, "length_per_pair": 16}, "without num_pairs"),
        ({"axis": "pairs", "num_pairs": 4}, "number of pairs"),
        ({"random_non_queries": 1}, "true or false"),
    ],
)
def test_bad_parameters_raise(params, message):
    with pytest.raises(CheBenchError, match=message):
        get_task("mqar", **params)


def test_lengths_below_four_times_the_pairs_are_refused():
    with pytest.raises(CheBenchError, match=">= 16"):
        get_task("mqar").sample(15, 2, np.random.default_rng(0))


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([3, 2, 5, 12, 5, 0, 3, 0], "alternate keys and values"),
        ([3, 9, 3, 12, 3, 0, 3, 0], "distinct"),
        ([3, 9, 5, 12, 5, 0, 0, 3], "never queried"),
    ],
)
def test_oracle_rejects_malformed_inputs(tokens, message):
    with pytest.raises(CheBenchError, match=message):
        get_task("mqar", **SMALL).solve(np.array([tokens]))


# -- the in-place layout -----------------------------------------------------------------------


def _model(task, **options):
    torch.manual_seed(0)
    return build_model(task, "rope", layers=1, dim=16, heads=2, ffn=32, dropout=0.0, **options).eval()


def test_in_place_logits_sit_on_the_input_positions_without_placeholders():
    task = get_task("mqar", vocab_size=32)
    model = _model(task)
    inputs = torch.from_numpy(task.sample(20, 3, np.random.default_rng(0)).inputs)
    assert model(inputs).shape == (1, 3, 20, 16)
    assert model.placeholders(20) == 0 and task.model_length(20) == 20


def test_causal_in_place_model_is_zoologys_task_no_position_sees_the_future():
    task = get_task("mqar", vocab_size=32)
    model = _model(task, causal=True)
    inputs = torch.from_numpy(task.sample(24, 2, np.random.default_rng(0)).inputs)
    changed = inputs.clone()
    changed[:, 15:] = (changed[:, 15:] + 1) % 32
    before, after = model(inputs), model(changed)
    torch.testing.assert_close(before[:, :, :15], after[:, :, :15])
    assert not torch.allclose(before[:, :, 15:], after[:, :, 15:])


def test_masked_loss_averages_over_the_masked_positions_only():
    logits = torch.randn(2, 3, 5, 4)
    targets = torch.randint(0, 4, (2, 3, 5))
    mask = torch.rand(3, 5) < 0.4
    mask[0, 0] = True
    per_token = torch.nn.functional.cross_entropy(logits.permute(0, 3, 1, 2), targets, reduction="none")
    expected = torch.stack([per_token[m][mask].mean() for m in range(2)])
    torch.testing.assert_close(token_loss(logits, targets, mask), expected)
    torch.testing.assert_close(token_loss(logits, targets), per_token.flatten(1).mean(1))


def test_pairs_axis_runs_end_to_end_with_results_per_pair_count(tmp_path):
    import pandas as pd

    from che_bench.cli import main

    store = str(tmp_path / "store.sqlite")
    assert main(["run", "--task", "mqar", "--pe", "rope", "--preset", "smoke", "--steps", "3",
                 "--task-param", "axis=pairs", "--task-param", "sequence_length=32",
                 "--train-max-length", "4", "--test-lengths", "5:8", "--eval-samples", "4",
                 "--store", store, "--no-keep-model", "--no-progress"]) == 0
    assert main(["export", "--store", store, "--per-length", "--out", str(tmp_path / "c.csv")]) == 0
    curves = pd.read_csv(tmp_path / "c.csv")
    assert sorted(curves.loc[curves["split"] == "test", "length"]) == [5, 6, 7, 8]  # pair counts
    assert main(["plot", "--store", store, "--out", str(tmp_path / "p.png")]) == 0


def test_ceiling_without_positions_is_one_over_the_pairs_and_is_drawn():
    """With filler 0 every context key appears twice (context and query) and every value once,
    so the bag of tokens cannot tell which value a key is bound to: 1/D for each axis."""
    from matplotlib.figure import Figure

    from che_bench.reports.plots import _draw_task_guides

    task = get_task("mqar", vocab_size=64, num_pairs=4, random_non_queries=False)
    batch = task.sample(40, 50, np.random.default_rng(0))
    for row in batch.inputs:
        counts = np.bincount(row[row > 0], minlength=64)
        assert set(counts[1:32]) <= {0, 2} and set(counts[32:]) <= {0, 1}
    assert task.ceiling(40) == task.ceiling(500) == 1 / 4
    assert get_task("mqar", length_per_pair=8).ceiling(40) == 1 / 5
    assert get_task("mqar", axis="pairs", sequence_length=64).ceiling(6) == 1 / 6
    assert get_task("mqar", random_non_queries=True).ceiling(40) is None  # not known
    ax = Figure().subplots()
    _draw_task_guides(ax, task, 60, "token")
    assert [line.get_label() for line in ax.get_lines()] == ["chance", "ceiling without positions"]
