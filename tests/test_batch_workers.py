"""Host work per step. Batches made in worker processes: the same batches and generator
states as in the step loop's process (so training and checkpoints are unchanged), errors and
dead workers are one line, closing stops the workers, a killed owner's workers exit, and a
script without a ``__main__`` guard can start them. Fewer operators: the micro-batch split in
plain integers, the optimizer's gradients gathered by one ``cat``."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import che_bench
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.model.encoder import build_model
from che_bench.run.runner import build_pack_model
from che_bench.train import batch_workers
from che_bench.train.batch_workers import BatchWorkers, shares
from che_bench.train.batches import BatchStream, batch_workers_for
from che_bench.train.loop import train_pack
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import micro_batch_rows


def pack_configs(task="solve_equation", members=3, **overrides):
    return [make_config(task, "none", None, "smoke", seed=seed, length_seed=0, **overrides)
            for seed in range(members)]


def test_shares_cover_the_members_once():
    for members, workers in ((5, 2), (32, 3), (3, 8)):
        parts = shares(members, workers)
        assert [m for share in parts for m in share] == list(range(members))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.fixture
def started(monkeypatch):
    """The worker processes started during the test."""
    processes = []
    start = batch_workers._start_worker

    def start_and_record(*args):
        process, *pipes = start(*args)
        processes.append(process)
        return process, *pipes

    monkeypatch.setattr(batch_workers, "_start_worker", start_and_record)
    return processes


def all_exited(processes):
    return bool(processes) and all(process.poll() is not None for process in processes)


def test_worker_batches_equal_in_process_batches_and_closing_stops_the_workers(started):
    configs = pack_configs(batch_size=16)
    task = configs[0].build_task()
    alone, workers = iter(BatchStream(task, configs)), iter(BatchStream(task, configs, workers=2))
    for _ in range(6):
        expected, got = next(alone), next(workers)
        assert got.length == expected.length and got.rng_states == expected.rng_states
        for name in ("inputs", "targets", "mask"):
            assert torch.equal(getattr(got, name), getattr(expected, name))
    workers.close()
    assert len(started) == 2 and all_exited(started)


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


def test_a_failing_or_dead_worker_is_a_one_line_error(started):
    configs = pack_configs(batch_size=4)
    task = configs[0].build_task()
    states = [np.random.default_rng(0).bit_generator.state] * 2
    with pytest.raises(CheBenchError, match="a batch worker failed: .*"):
        list(BatchWorkers(task, 4, states, 1).batches(iter([-5])))
    workers = BatchWorkers(task, 4, states, 1)
    workers._processes[0].kill()
    with pytest.raises(CheBenchError, match="died"):
        list(workers.batches(iter([5])))
    assert len(started) == 2 and all_exited(started)


def test_a_worker_that_cannot_start_is_a_one_line_error(monkeypatch):
    """One that exits at once (a broken interpreter) while it is sent its work: more than a
    pipe holds, 1000 members' states."""
    task = pack_configs()[0].build_task()
    monkeypatch.setattr(batch_workers.sys, "executable", shutil.which("true"))
    with pytest.raises(CheBenchError, match="a batch worker process died"):
        BatchWorkers(task, 4, [np.random.default_rng(seed).bit_generator.state
                               for seed in range(1000)], 1)


def test_ctrl_c_is_left_to_the_step_loop(started):
    configs = pack_configs(batch_size=4)
    states = [np.random.default_rng(0).bit_generator.state] * 2
    workers = BatchWorkers(configs[0].build_task(), 4, states, 1)
    made = workers.batches(iter([5, 6, 7]))
    next(made)  # the worker is up and has its handler
    os.kill(workers._processes[0].pid, signal.SIGINT)
    assert len(list(made)) == 2
    assert all_exited(started)


#: Where the scripts below find che-bench (the checkout under test).
CHECKOUT = str(Path(che_bench.__file__).resolve().parents[1])

OWNER = """
import sys
import numpy as np
from che_bench.train.batch_workers import BatchWorkers
from che_bench.config import make_config

task = make_config("solve_equation", "none", None, "smoke").build_task()
workers = BatchWorkers(task, 4, [np.random.default_rng(0).bit_generator.state] * 2, 2)
made = workers.batches(iter(lambda: 5, None))
next(made)  # the workers are up, waiting for lengths
print(*(process.pid for process in workers._processes), flush=True)
sys.stdin.read()  # until killed
"""


def wait_for_exit(pid_fd: int, bound_s: float) -> bool:
    """Whether the process of ``pid_fd`` exits within ``bound_s`` (a pidfd becomes readable
    when its process has ended, reaped or not)."""
    readable, _, _ = select.select([pid_fd], [], [], bound_s)
    return bool(readable)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux pidfds")
def test_workers_exit_when_their_owner_is_killed():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": CHECKOUT})
    pids = [int(pid) for pid in owner.stdout.readline().split()]
    assert len(pids) == 2
    pid_fds = [os.pidfd_open(pid) for pid in pids]  # (before the kill: no pid reuse)
    try:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert all(wait_for_exit(fd, bound_s=120) for fd in pid_fds)  # the event, not a deadline
    finally:
        for fd in pid_fds:
            os.close(fd)
        owner.stdin.close(), owner.stdout.close()


UNGUARDED_SCRIPT = """
import torch
from che_bench.config import make_config
from che_bench.run.runner import build_pack_model
from che_bench.train.loop import train_pack

with open("runs.txt", "a") as runs:  # a worker running this script again would add a line
    runs.write("ran\\n")
configs = [make_config("reverse_string", "none", None, "smoke", seed=seed, length_seed=0, steps=3)
           for seed in range(2)]
task = configs[0].build_task()
train_pack(build_pack_model(task, configs), task, configs, torch.device("cpu"), progress=False,
           batch_workers=2)
print("trained")
"""


def test_a_script_without_a_main_guard_trains_with_batch_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, check=False, env={**os.environ, "PYTHONPATH": CHECKOUT})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["trained"]
    assert (tmp_path / "runs.txt").read_text() == "ran\n"


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
