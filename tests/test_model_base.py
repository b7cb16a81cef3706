"""``BenchModel``'s shared steps of a forward pass: CHE's empty output tokens appended to the
inputs, and a function run over sub-batches that fit the evaluation memory budget."""

from __future__ import annotations

import pytest
import torch

from che_bench.errors import CheBenchError
from che_bench.model.base import BenchModel
from che_bench.tasks import get_task


class Bare(BenchModel):
    """A model with ``BenchModel``'s defaults (``query_row_bytes`` 0: never split)."""

    def __init__(self, task, members=1):
        super().__init__()
        self.task, self.members, self.build_options = task, members, {}


class TenBytesASequence(Bare):
    def query_row_bytes(self, input_tokens, device=None):
        return 10


def test_output_tokens_are_appended_after_the_inputs_or_none_in_place():
    task = get_task("modular_arithmetic")  # one answer after an odd number of tokens
    inputs = torch.zeros(2, 3, 5, dtype=torch.long)
    tokens, read = Bare(task, members=2).with_output_tokens(inputs)
    assert tokens.shape == (2, 3, 6) and read == 1
    assert tokens[..., :5].equal(inputs) and (tokens[..., 5] == task.input_size).all()
    in_place = Bare(get_task("mqar"))
    ids = torch.zeros(1, 2, 7, dtype=torch.long)
    tokens, read = in_place.with_output_tokens(ids)
    assert tokens.equal(ids) and read == 7
    with pytest.raises(CheBenchError, match="never produces inputs of 4 tokens"):
        Bare(task).with_output_tokens(torch.zeros(1, 1, 4, dtype=torch.long))


def test_without_gradients_the_batch_is_split_to_the_budget_and_joined():
    model = TenBytesASequence(get_task("parity_check"))
    model.set_memory_budget(25)  # two sequences of 10 bytes at a time
    tokens = torch.arange(5).reshape(1, 5, 1)
    sizes = []

    def double(part):
        sizes.append(part.shape[1])
        return 2 * part

    with torch.no_grad():
        assert model.in_sub_batches(double, tokens, 1).equal(2 * tokens)
    assert sizes == [2, 2, 1]
    sizes.clear()
    model.in_sub_batches(double, tokens, 1)  # with gradients: one pass
    assert sizes == [5]


def test_a_model_without_a_row_estimate_runs_the_batch_whole():
    sizes = []
    with torch.no_grad():
        Bare(get_task("parity_check")).in_sub_batches(
            lambda part: sizes.append(part.shape[1]) or part, torch.zeros(1, 4, 3), 3
        )
    assert sizes == [4]
