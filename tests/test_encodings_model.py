"""Every encoding inside the encoder: a training step works and row-chunked evaluation is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from che_bench.encodings import list_encodings
from che_bench.model import build_model
from che_bench.tasks import get_task

SMALL = {"layers": 2, "dim": 32, "heads": 4, "ffn": 64, "train_length": 10}


@pytest.mark.parametrize("name", [cls.name for cls in list_encodings()])
def test_encoding_trains_and_evaluates_in_row_chunks(name):
    task = get_task("reverse_string")
    rng = np.random.default_rng(0)
    randomized = {"randomize_at_eval": False} if "random" in name else {}
    torch.manual_seed(0)
    model = build_model(task, pe=name, **SMALL, **randomized)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = task.sample(10, 8, rng)
    logits = model(torch.as_tensor(batch.inputs))
    loss = torch.nn.functional.cross_entropy(
        logits[0].flatten(0, 1), torch.as_tensor(batch.targets).flatten()
    )
    optimizer.zero_grad()
    loss.backward()
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all()
        for p in model.encoding.parameters()
    )
    optimizer.step()
    model.encoding.project_()

    # A budget of a few query rows forces chunked attention; it must not change the result.
    chunked = build_model(task, pe=name, memory_budget_bytes=50_000, **SMALL, **randomized)
    chunked.load_state_dict(model.state_dict())
    inputs = torch.as_tensor(task.sample(50, 4, rng).inputs)  # beyond the training lengths
    with torch.inference_mode():
        expected = model.eval()(inputs)
        torch.testing.assert_close(chunked.eval()(inputs), expected)
    assert torch.isfinite(expected).all()
