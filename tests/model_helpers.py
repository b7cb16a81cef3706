"""What the tests of the built-in models share: tiny seeded models, a task's inputs, a short
training run on parity, the evaluation's split to the memory budget, and the peak memory of a
forward pass."""

from __future__ import annotations

import numpy as np
import torch

from che_bench.model.architectures import build_architecture
from che_bench.tasks import get_task
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import training_step

#: The sizes of a tiny model with heads (DeltaNet, xLSTM).
TINY = {"width": 8, "heads": 2}


def tiny(name, task="parity_check", seed=0, members=1, sizes=TINY, **options):
    """``name`` built with ``sizes`` (overridden by ``options``) after ``torch.manual_seed``."""
    torch.manual_seed(seed)
    return build_architecture(name, get_task(task), members=members, **{**sizes, **options})


def inputs_for(task, n, batch=2, seed=0):
    """A batch of task ``task``'s (a name) inputs at length ``n``, ``[batch, n]``."""
    return inputs_for_task(get_task(task), n, batch, seed)


def inputs_for_task(task, n, batch=2, seed=0):
    """A batch of ``task``'s inputs at length ``n``, ``[batch, n]``."""
    sample = task.sample(n, batch, np.random.default_rng(seed))
    return torch.from_numpy(sample.inputs.copy())


def assert_training_on_parity_reduces_the_loss(model, steps=40):
    """``steps`` Adam steps on parity at n = 2 (XOR), batches of 32: the mean loss of the last
    10 steps is at most half that of the first 10."""
    task = get_task("parity_check")
    optimiser = PackOptimizer(model, [1e-2], (0.9, 0.999), 1e-8, max_norm=1.0)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        batch = task.sample(2, 32, rng)
        inputs, targets = (torch.from_numpy(array)[None] for array in (batch.inputs, batch.targets))
        losses.append(training_step(model, optimiser, inputs, targets, [])[0].item())
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])


def assert_the_split_evaluation_is_the_whole_one(model):
    """Without gradients, a batch of 5 parity inputs at n = 70 given two sequences at a time
    by the memory budget has the logits of the batch in one pass."""
    model.eval()
    inputs = inputs_for("parity_check", 70, batch=5)
    with torch.no_grad():
        whole = model(inputs)
        model.set_memory_budget(model.query_row_bytes(70) * 2)  # two sequences at a time
        torch.testing.assert_close(model(inputs), whole)


def peak_bytes(model, inputs):
    """The most memory a forward pass without gradients holds at once, from the profiler's
    allocation events in time order."""
    with torch.no_grad(), torch.profiler.profile(profile_memory=True) as profiler:
        model(inputs)
    held = peak = 0
    for event in sorted(profiler.events(), key=lambda event: event.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak
