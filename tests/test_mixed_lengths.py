"""Mixed-length training batches (``batch_lengths = "mixed"``, the xLSTM harness's): each
sequence its own length, padded, read after its own inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture
from che_bench.tasks import get_task
from che_bench.train.batches import BatchStream, mixed_batch


def test_mixed_batch_pads_each_sequence_after_its_own_tokens():
    task = get_task("modular_arithmetic")
    inputs, targets, mask, lengths = mixed_batch(task, [(3, 2), (7, 1)], np.random.default_rng(0))
    assert lengths.tolist() == [3, 3, 7]
    assert inputs.shape == (3, 7) and (inputs[:2, 3:] == 0).all()
    assert targets.shape == (3, 1) and mask.all()
    solved, _ = task.solve(inputs[2:])
    assert (solved == targets[2:]).all()
    for row in range(2):
        assert (task.solve(inputs[row : row + 1, :3])[0] == targets[row]).all()


def test_mixed_batch_of_an_in_place_task_masks_the_padding():
    task = get_task("word_problem", group="Z5")
    _, _, mask, lengths = mixed_batch(task, [(2, 1), (5, 1)], np.random.default_rng(0))
    assert lengths.tolist() == [2, 5]
    assert mask[0].tolist() == [True, True, False, False, False]
    assert mask[1].all()


@pytest.mark.parametrize("task_name", ["modular_arithmetic", "parity_check"])
def test_each_sequence_reads_as_it_would_alone(task_name):
    """A causal model's logits for a padded sequence of a mixed batch are those of the
    sequence alone: the padding is never read (a read at the batch's end would fail)."""
    task = get_task(task_name)
    torch.manual_seed(0)
    model = build_architecture("deltanet", task, layers=1, width=16, heads=2)
    inputs, _, _, lengths = mixed_batch(task, [(3, 2), (9, 2)], np.random.default_rng(1))
    mixed = model(torch.from_numpy(inputs), lengths=torch.from_numpy(lengths))
    for row, length in enumerate(lengths):
        alone = model(torch.from_numpy(inputs[row : row + 1, :length]))
        torch.testing.assert_close(mixed[:, row], alone[:, 0], rtol=1e-5, atol=1e-6)


def test_stream_draws_a_length_per_sequence_from_the_curriculum():
    config = make_config(
        task="parity_check", arch="deltanet", preset="smoke", batch_lengths="mixed", seed=3
    )
    stream = BatchStream(get_task("parity_check"), [config])
    batch = next(iter(stream))
    assert batch.lengths is not None and len(set(batch.lengths.tolist())) > 1
    assert batch.inputs.shape[-1] == batch.length == int(batch.lengths.max())
    again = next(iter(BatchStream(get_task("parity_check"), [config])))
    assert torch.equal(batch.inputs, again.inputs)  # the same seed, the same batch


def test_mixed_batches_enter_the_run_id_only_when_set():
    plain = make_config(task="parity_check", arch="deltanet", preset="smoke")
    mixed = make_config(task="parity_check", arch="deltanet", preset="smoke", batch_lengths="mixed")
    assert "batch_lengths" not in plain.to_dict() and mixed.run_id() != plain.run_id()
    assert mixed.to_dict()["batch_lengths"] == "mixed"


def test_a_model_that_cannot_read_lengths_is_refused():
    with pytest.raises(CheBenchError, match="cannot train on mixed-length batches"):
        make_config(task="parity_check", preset="smoke", batch_lengths="mixed")


def test_an_unknown_batch_kind_is_refused():
    with pytest.raises(CheBenchError, match="batch_lengths"):
        make_config(task="parity_check", preset="smoke", batch_lengths="ragged")
