"""Host work per step. Batches made in worker processes: the same batches and generator
states as in the step loop's process (so training and checkpoints are unchanged), errors and
dead workers are one line, and closing stops the workers. Fewer operators: the micro-batch
split in plain integers, the optimizer's gradients gathered by one ``cat``."""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest
import torch

from che_bench.batch_workers import BatchWorkers, shares
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.runner import build_pack_model
from che_bench.model import build_model
from che_bench.training import (
    BatchStream,
    PackOptimizer,
    batch_workers_for,
    micro_batch_rows,
    train_pack,
)


def pack_configs(task="solve_equation", members=3, **overrides):
    return [make_config(task, "none", None, "smoke", seed=seed, length_seed=0, **overrides)
            for seed in range(members)]


def test_shares_cover_the_members_once():
    for members, workers in ((5, 2), (32, 3), (3, 8)):
        parts = shares(members, workers)
        assert [m for share in parts for m in share] == list(range(members))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_worker_batches_equal_in_process_batches_and_closing_stops_the_workers():
    configs = pack_configs(batch_size=16)
    task = configs[0].build_task()
    alone, workers = iter(BatchStream(task, configs)), iter(BatchStream(task, configs, workers=2))
    for _ in range(6):
        expected, got = next(alone), next(workers)
        assert got.length == expected.length and got.rng_states == expected.rng_states
        for name in ("inputs", "targets", "mask"):
            assert torch.equal(getattr(got, name), getattr(expected, name))
    workers.close()
    assert multiprocessing.active_children() == []


def test_training_with_batch_workers_gives_the_same_losses():
    configs = pack_configs("reverse_string", 2, steps=4)
    task = configs[0].build_task()
    losses = []
    for workers in (0, 2):
        model = build_pack_model(task, configs)
        steps: list[list[float]] = []
        train_pack(model, task, configs, torch.device("cpu"), progress=False, batch_workers=workers,
                   on_step=lambda step, pack_losses: steps.append(pack_losses))
        losses.append(steps)
    assert losses[0] == losses[1]


def test_a_failing_or_dead_worker_is_a_one_line_error():
    configs = pack_configs(batch_size=4)
    task = configs[0].build_task()
    states = [np.random.default_rng(0).bit_generator.state] * 2
    with pytest.raises(CheBenchError, match="a batch worker failed: .*"):
        list(BatchWorkers(task, 4, states, 1).batches(iter([-5])))
    workers = BatchWorkers(task, 4, states, 1)
    workers._processes[0].kill()
    with pytest.raises(CheBenchError, match="died"):
        list(workers.batches(iter([5])))
    assert multiprocessing.active_children() == []


def test_ctrl_c_is_left_to_the_step_loop():
    configs = pack_configs(batch_size=4)
    states = [np.random.default_rng(0).bit_generator.state] * 2
    workers = BatchWorkers(configs[0].build_task(), 4, states, 1)
    made = workers.batches(iter([5, 6, 7]))
    next(made)  # the worker is up and has its handler
    os.kill(workers._processes[0].pid, signal.SIGINT)
    assert len(list(made)) == 2
    assert multiprocessing.active_children() == []


def test_only_wide_packs_on_a_gpu_use_workers():
    assert batch_workers_for(32, torch.device("cpu")) == 0
    assert batch_workers_for(2, torch.device("cuda")) == 0
    assert batch_workers_for(32, torch.device("cuda")) >= 1


def test_micro_batch_rows_split_like_tensor_split():
    for batch in range(1, 20):
        for parts in range(1, 9):
            expected = [(int(part[0]), int(part[-1]) + 1)
                        for part in torch.arange(batch).tensor_split(min(parts, batch))]
            assert [(rows.start, rows.stop) for rows in micro_batch_rows(batch, parts)] == expected


def test_the_optimizer_gathers_every_gradient_and_zero_for_none():
    task = make_config("even_pairs", preset="smoke").build_task()
    model = build_model(task, "kerple", members=2, layers=1, dim=8, heads=2, ffn=8)
    optimizer = PackOptimizer(model, [1e-3, 1e-3], (0.9, 0.999), 1e-8, max_norm=1e9)
    parameters = list(model.parameters())
    for index, parameter in enumerate(parameters[1:], start=1):
        parameter.grad = torch.full_like(parameter, float(index))
    optimizer.step()
    offset = 0
    for index, parameter in enumerate(parameters):
        size = parameter[0].numel()
        assert torch.all(optimizer.flat_grad[:, offset : offset + size] == index)  # 0: no grad
        offset += size
    optimizer.zero_grad()
    assert all(parameter.grad is None for parameter in parameters)
