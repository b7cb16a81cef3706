"""The evaluation's memory plan (``query_row_bytes``) of the six state-tracking models at
DeltaProduct's evaluation length (n = 512) on word_problem, whose every position is read out
(issue 45 item 6): parity_check reads one position, and the tests of each model measure it
there."""

from __future__ import annotations

import pytest
from model_helpers import inputs_for_task, peak_bytes

from che_bench.model.architectures import build_architecture
from che_bench.model.state_tracking import MODELS
from che_bench.tasks import get_task

#: DeltaProduct's evaluation length (its README's S3 protocol: train 128, test 512).
LENGTH = 512


@pytest.mark.parametrize("name", [model.name for model in MODELS])
def test_the_estimate_covers_a_default_model_reading_every_position(name):
    """At most twice the measured peak of a forward pass without gradients, never below it
    (per sequence, measured on 2); DeltaProduct's evaluation batch of 64 fits the default
    1 GiB budget in at most two parts."""
    task = get_task("word_problem", group="S5")
    model = build_architecture(name, task).eval()
    measured = peak_bytes(model, inputs_for_task(task, LENGTH)) / 2
    assert measured <= model.query_row_bytes(LENGTH) <= 2 * measured
    assert 64 * model.query_row_bytes(LENGTH) <= 2 * model.memory_budget_bytes
