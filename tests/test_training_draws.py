"""The randomized encodings' training draws are made with the batches, off the step loop
(issue 19, item 10): the same draws as the step made (results and run ids unchanged), their
generators' states saved with the batch trained on, so a resume is still exact."""

from __future__ import annotations

import threading

import pytest
import torch

from che_bench.config import make_config
from che_bench.run.runner import build_pack_model
from che_bench.train.batches import BatchStream, draw_seed
from che_bench.train.loop import train_pack
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import micro_batches_for, projected_modules, training_step

CPU = torch.device("cpu")


def cell(pe="random_rope", steps=5):
    return [make_config("reverse_string", pe, None, "smoke", seed=seed, lr=lr, steps=steps,
                        dropout=0.1, length_seed=0)  # dropout: the global RNG must not move
            for seed, lr in ((0, 1e-3), (1, 3e-3))]


def trained_with_draws_in_the_step(configs):
    """The loop before: every step drew its sample itself (``training_step`` without draws)."""
    task = configs[0].build_task()
    model = build_pack_model(task, configs).train()
    model.seed_draws([draw_seed(config.seed) for config in configs])
    optimizer = PackOptimizer(model, [c.lr for c in configs], configs[0].adam_betas,
                              configs[0].adam_eps, configs[0].grad_clip_norm)
    batches, losses = iter(BatchStream(task, configs)), []
    for _ in range(configs[0].steps):
        batch = next(batches)
        step_losses, _ = training_step(model, optimizer, batch.inputs, batch.targets,
                                       projected_modules(model), micro_batches_for(2, CPU))
        losses.append(step_losses.tolist())
    return model, losses


def trained(configs, **options):
    task = configs[0].build_task()
    model, losses = build_pack_model(task, configs), []
    train_pack(model, task, configs, CPU, progress=False,
               on_step=lambda step, step_losses: losses.append(step_losses), **options)
    return model, losses


def assert_same_training(got, expected):
    (got_model, got_losses), (expected_model, expected_losses) = got, expected
    assert got_losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(got_model.parameters(),
                                                 expected_model.parameters()))
    # The evaluation goes on drawing where the last trained batch left the generators.
    assert all(torch.equal(a, b) for a, b in zip(got_model.draw_states(),
                                                 expected_model.draw_states()))


@pytest.mark.parametrize("pe", ["random_rope", "random_alibi"])
def test_draws_made_with_the_batches_are_those_the_step_made(monkeypatch, pe):
    configs = cell(pe)
    expected = trained_with_draws_in_the_step(configs)
    encoding_class = type(build_pack_model(configs[0].build_task(), configs).encoding)
    sample, drawing_threads = encoding_class.sample_draws, set()

    def recorded(self, length, generators):
        drawing_threads.add(threading.current_thread())
        return sample(self, length, generators)

    monkeypatch.setattr(encoding_class, "sample_draws", recorded)
    got = trained(configs, prefetch=True)  # the GPU's producer thread, on a CPU
    assert drawing_threads and threading.main_thread() not in drawing_threads
    assert_same_training(got, expected)


def test_a_resume_while_batches_were_drawn_ahead_is_exact(tmp_path):
    configs = cell(steps=8)
    expected = trained(configs, prefetch=True)
    paths = [tmp_path / f"{member}.pt" for member in range(2)]
    seen: list[list[float]] = []

    def stop_at_step_3(step, losses):
        seen.append(losses)
        if step == 3:  # the producer has drawn for batches 4.. by now
            raise KeyboardInterrupt

    task = configs[0].build_task()
    with pytest.raises(KeyboardInterrupt):
        train_pack(build_pack_model(task, configs), task, configs, CPU, progress=False,
                   prefetch=True, checkpoints=paths, on_step=stop_at_step_3)
    model, rest = trained(configs, prefetch=True, checkpoints=paths)
    assert_same_training((model, seen + rest), expected)
