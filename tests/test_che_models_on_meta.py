"""CHE's models train and evaluate on the meta device, where any host synchronisation inside
forward or backward (``.item()``, ``int(tensor)``, ``bool(tensor)``, a data-dependent size)
fails: the GPU path of each, checked on a CPU machine, as the state-tracking models' blocks are
(tests/test_deltanet.py)."""

from __future__ import annotations

import pytest
import torch

from che_bench.model.architectures import build_architecture
from che_bench.tasks import get_task

SMALL = {
    "rnn": {"hidden_size": 8},
    "lstm": {"hidden_size": 8, "fused": False},
    "stack_rnn": {"hidden_size": 8, "stack_size": 5},
    # Past its stack of 6 the nondeterministic stack freezes, as CHE's JAX code does.
    "ndstack_rnn": {"hidden_size": 8, "stack_size": 6},
    "tape_rnn": {"hidden_size": 8, "n_tapes": 2, "computation_steps_mult": 1},
    "autoregressive_transformer": {"layers": 1, "dim": 16, "heads": 2, "ffn": 32, "dropout": 0.0},
}


@pytest.mark.parametrize("arch", list(SMALL))
def test_training_and_evaluation_run_without_reading_the_device(arch):
    model = build_architecture(arch, get_task("reverse_string"), members=2, **SMALL[arch])
    model = model.to("meta")
    inputs = torch.randint(0, 2, (2, 3, 9), device="meta")
    targets = torch.randint(0, 2, (2, 3, 9), device="meta")
    given = {"targets": targets} if model.uses_targets else {}
    logits = model(inputs, **given)
    logits.sum().backward()
    assert logits.shape == (2, 3, 9, 2)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        assert model(inputs).shape == (2, 3, 9, 2)
