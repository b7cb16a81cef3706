"""Proposition 1 of DAPE V2: with a 1xk kernel on the attention scores, a transformer WITHOUT
any positional encoding can do associative recall, at every length.

Hand-set two-layer attention model (no training) on ``associative_recall``; each layer's
scores go through the real ``DapeProcessor`` with kernel 3 and hand-assigned weights.
Residual stream = one-hot tokens; projections are written as lookup tables (a linear map
of a one-hot vector):

* layer 1: only the placeholder attends with a non-zero score, and only to itself
  (``S1[i, j] = a [x_i = ph] [x_j = ph]``). The processor turns this into
  ``b * S1[i, j+1]``: the placeholder now attends to the token just before it, the queried
  key, and copies its one-hot key code.
* layer 2: the placeholder's query is that key code, so ``S2[i, j] = g [x_j = queried key]``
  (minus a large constant at the placeholder key). The processor adds ``b * S2[i, j-1]``:
  the peak moves from the earlier copy of the key to the token right after it, its value,
  which is copied out. Nothing here depends on absolute position, hence on the length.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from che_bench.model.dape import DapeProcessor
from che_bench.tasks import get_task

ALPHA, GAMMA, SHIFT_GAIN, PLACEHOLDER_PENALTY = 10.0, 10.0, 4.0, 100.0


def shift_processor(offset: int, cancel_centre: bool) -> DapeProcessor:
    """Kernel-3 DAPE V2 whose logits are ``S + gain * S[., j + offset]`` (minus S if asked)."""
    processor = DapeProcessor(heads=1, kernel=3, width=2)
    with torch.no_grad():
        for parameter in processor.parameters():
            parameter.zero_()
        # Weights [member, out, in, tap]; one member.
        processor.weight1[0, 0, 0, 1 + offset] = 1.0  # hidden 0 = S at key j + offset
        processor.weight2[0, 0, 0, 1] = SHIFT_GAIN
        if cancel_centre:  # hidden 1 = S at key j, subtracted again: removes the residual
            processor.weight1[0, 1, 0, 1] = 1.0
            processor.weight2[0, 0, 1, 1] = -1.0
    return processor


class HandSetRecall(torch.nn.Module):
    def __init__(self, num_keys: int, num_values: int) -> None:
        super().__init__()
        self.num_keys, self.num_values = num_keys, num_values
        self.placeholder = num_keys + num_values + 1  # = task.input_size
        self.previous_token = shift_processor(offset=+1, cancel_centre=True)
        self.next_token = shift_processor(offset=-1, cancel_centre=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        placeholders = inputs.new_full((inputs.shape[0], 1), self.placeholder)
        tokens = torch.cat([inputs, placeholders], dim=1)
        is_placeholder = (tokens == self.placeholder).float()
        keys = torch.nn.functional.one_hot(tokens.clamp(max=self.num_keys), self.num_keys + 1)
        keys = keys[..., : self.num_keys].float()  # one-hot key code, zero for other tokens
        values = tokens - self.num_keys
        values = torch.nn.functional.one_hot(values.clamp(0, self.num_values), self.num_values + 1)
        values = values[..., : self.num_values].float() * (tokens < self.num_keys + self.num_values)[..., None]
        # Layer 1: find the token before the placeholder; copy its key code.
        scores = ALPHA * is_placeholder[:, :, None] * is_placeholder[:, None, :]
        logits = self.previous_token(scores[None, :, None])[0, :, 0]  # [M, B, H, T, T] in
        fetched = torch.softmax(logits, dim=-1) @ keys
        # Layer 2: match that key, move to the next token, copy its value.
        scores = GAMMA * fetched @ keys.transpose(1, 2)
        scores = scores - PLACEHOLDER_PENALTY * is_placeholder[:, None, :]
        logits = self.next_token(scores[None, :, None])[0, :, 0]
        read = torch.softmax(logits, dim=-1) @ values
        return read[:, -1]  # the placeholder's output: class scores over the values


def recall_accuracy(lengths, sequences=16) -> dict[int, float]:
    task = get_task("associative_recall")
    model = HandSetRecall(task.params()["num_keys"], task.params()["num_values"])
    rng = np.random.default_rng(0)
    accuracy = {}
    with torch.no_grad():
        for n in lengths:
            batch = task.sample(n, sequences, rng)
            prediction = model(torch.from_numpy(batch.inputs)).argmax(-1).numpy()
            accuracy[n] = float((prediction == batch.targets[:, 0]).mean())
    return accuracy


def test_hand_set_nope_dape_v2_recalls_at_strided_lengths():
    accuracy = recall_accuracy([3, 4, 7, 40, *range(41, 501, 77), 500], sequences=8)
    assert all(value == 1.0 for value in accuracy.values()), accuracy


def test_the_shift_is_what_solves_it():
    """Without the kernel's off-centre taps (a k=1-like processor) the construction fails."""
    task = get_task("associative_recall")
    model = HandSetRecall(task.params()["num_keys"], task.params()["num_values"])
    with torch.no_grad():
        model.next_token.weight1.copy_(torch.zeros_like(model.next_token.weight1))
    batch = task.sample(101, 64, np.random.default_rng(1))
    with torch.no_grad():
        prediction = model(torch.from_numpy(batch.inputs)).argmax(-1).numpy()
    assert (prediction == batch.targets[:, 0]).mean() < 0.2


@pytest.mark.slow
def test_hand_set_nope_dape_v2_recalls_at_every_test_length():
    accuracy = recall_accuracy(range(41, 501), sequences=8)
    assert all(value == 1.0 for value in accuracy.values()), [
        n for n, value in accuracy.items() if value < 1.0
    ]
