"""GPU paths of issue 26 (items 2-4), simulated on a CPU: the evaluation of a model that does
not split its forward pass, the CPUs a process counts, ``--pack auto``'s probe and a local
sweep's workers on several GPUs."""

from __future__ import annotations

import multiprocessing
import os
import signal
from fractions import Fraction

import pytest
import torch

import che_bench.model.architectures as architectures
from che_bench import device_memory
from che_bench.config import make_config
from che_bench.eval import evaluation
from che_bench.eval.evaluation import ForwardRows, length_scores
from che_bench.model.base import BenchModel
from che_bench.model.recurrent import base as recurrent_base
from che_bench.run import local_backend, packing, ray_backend, runner
from che_bench.run.local_backend import LocalBackend, take_place, worker_devices
from che_bench.run.options import RuntimeOptions
from che_bench.train.batches import batch_workers_for
from tests.run_helpers import fake_cuda_memory

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


class Unsplit(BenchModel):
    """A model without a query split (``query_row_bytes`` 0, as every plugin's by default):
    right except at the first output position; a forward pass over more than ``limit``
    sequences runs out of (simulated) memory. Records each pass's sequences."""

    def __init__(self, task, limit=None):
        super().__init__()
        self.task, self.members, self.build_options, self.limit = task, 1, {}, limit
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.batches: list[int] = []

    def forward(self, inputs, draws=None, **ignored):
        inputs = self.member_inputs(inputs)
        self.batches.append(inputs.shape[1])
        if self.limit is not None and inputs.shape[1] > self.limit:
            raise torch.cuda.OutOfMemoryError("simulated")
        answer = inputs.flip(-1).clone()
        answer[..., 0] = 0
        return self.scale * torch.nn.functional.one_hot(answer, self.task.output_size).float()


def eval_config():
    return make_config("reverse_string", "none", None, "smoke", eval_samples=16,
                       eval_batch_size=8, dropout=0.0)


def test_a_model_that_does_not_split_is_given_fewer_sequences(monkeypatch):
    """Item 2: out of memory, a model without a query split gets half the sequences at a
    time (for the rest of the evaluation), not the same pass again; same numbers."""
    config = eval_config()
    task = config.build_task()
    whole = length_scores(Unsplit(task), task, config, 10, CPU)
    assert 0 < whole.token[0] < 1
    released = []
    monkeypatch.setattr(evaluation, "release_memory", released.append)
    model, rows = Unsplit(task, limit=2), ForwardRows()
    assert length_scores(model, task, config, 10, CPU, rows) == whole
    # Sub-batch 1: 8 and 4 fail, then 4 passes of 2; sub-batch 2 starts at 2.
    assert model.batches == [8, 4] + [2] * 8
    assert released == [CPU, CPU] and rows.limit == 2
    assert model.memory_budget_bytes == 1 << 30  # a budget it does not use is left alone


def test_a_model_that_does_not_fit_one_sequence_fails_at_once(monkeypatch):
    """Item 2: the error stands (the pack then splits) after halving down to one sequence,
    not after the budget is halved to nothing with the same pass each time."""
    config = eval_config()
    task = config.build_task()
    monkeypatch.setattr(evaluation, "release_memory", lambda device: None)
    model = Unsplit(task, limit=0)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        length_scores(model, task, config, 10, CPU)
    assert model.batches == [8, 4, 2, 1]


@pytest.fixture
def cpus(monkeypatch):
    """This process may run on CPUs 0-1 of a machine of 64 (a container's or taskset's
    limit); no allowance set yet."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(device_memory, "_cpu_allowance", None)
    monkeypatch.setattr(device_memory, "_gpu_share", Fraction(1))


def test_batch_workers_count_the_cpus_the_process_may_use(cpus, monkeypatch):
    """Item 3: 2 usable CPUs of 64: one batch worker, not four."""
    assert batch_workers_for(32, CUDA) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert batch_workers_for(32, CUDA) == 4
    device_memory.allow_cpus(3)
    assert batch_workers_for(32, CUDA) == 2
    assert batch_workers_for(32, CPU) == 0


def test_sweep_workers_and_ray_tasks_count_their_part_of_the_cpus(cpus, monkeypatch):
    """Item 3: each of a local sweep's 4 workers on 8 CPUs plans for 2; a Ray task for the
    CPUs Ray granted it."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    take_place(0, ["cpu"] * 4)
    assert device_memory.usable_cpus() == 2 and batch_workers_for(32, CUDA) == 1
    seen = []
    monkeypatch.setattr(ray_backend, "execute_runs",
                        lambda configs, options, pack: seen.append(device_memory.usable_cpus()))
    threads = torch.get_num_threads()
    try:
        ray_backend._run_in_ray_task([], 1, None, 3, 0.0)
    finally:
        torch.set_num_threads(threads)
    assert seen == [3]


def lstm_config():
    return make_config("reverse_string", None, None, "smoke", arch="lstm",
                       arch_options={"hidden_size": 8}, seed=0, length_seed=0)


def test_the_probe_measures_the_path_a_pack_takes(monkeypatch):
    """Item 4: ``--pack auto`` measures a pack of two (the batched loop every wider pack
    runs), not one member, which an LSTM on a GPU trains with the fused kernel (forced here
    on the CPU); the pack's peak above its weights is shared by its members."""
    fake_cuda_memory(monkeypatch, [100, 100 + 5000])
    monkeypatch.setattr(recurrent_base, "FUSED_TRAINING_DEVICES", ("cpu",))
    built, fused_calls, real_build = [], [], architectures.build_architecture
    monkeypatch.setattr(architectures, "build_architecture", lambda *args, **options: (
        built.append(options.get("members", 1)) or real_build(*args, **options)))
    monkeypatch.setattr(torch, "lstm", lambda *args: fused_calls.append(1))
    assert packing.training_bytes_per_member(lstm_config(), CPU) == 5000 // 2
    assert built == [packing.PROBE_MEMBERS] == [2] and fused_calls == []


def test_a_probe_that_does_not_fit_packs_one_member(monkeypatch):
    def out_of_memory(config, device):
        raise torch.cuda.OutOfMemoryError("simulated")

    released = []
    monkeypatch.setattr(packing, "training_bytes_per_member", out_of_memory)
    monkeypatch.setattr(packing, "release_memory", released.append)
    assert packing.resolve_width("auto", lstm_config(), CUDA) == 1
    assert released == [CUDA]


def test_the_probe_runs_under_the_runs_numerics(monkeypatch):
    """Item 4: TF32 and deterministic algorithms are set before ``--pack auto`` measures."""
    events = []

    class Stop(Exception):
        pass

    def execute_pack(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(runner, "configure_numerics", lambda tf32, deterministic=False, *more: (
        events.append(("numerics", tf32, deterministic))))
    monkeypatch.setattr(runner, "prepare_deterministic_cublas", lambda: None)
    monkeypatch.setattr(packing, "resolve_width", lambda pack, config, device: (
        events.append(("probe",)) or 1))
    monkeypatch.setattr(runner, "execute_pack", execute_pack)
    options = RuntimeOptions(device="cpu", tf32=True, deterministic=True)
    with pytest.raises(Stop):
        runner.execute_runs([lstm_config()], options, pack="auto")
    assert events == [("numerics", True, True), ("probe",)]


@pytest.fixture
def gpus(monkeypatch):
    """A CPU machine that claims ``count`` GPUs (the queries resolve_device makes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def claim(count):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return claim


def test_local_workers_spread_over_the_visible_gpus(gpus):
    """Item 4: worker k of a local sweep runs on cuda:(k mod GPUs), as Ray spreads its tasks;
    a GPU named by index, a single GPU or the CPU keep every worker where they were."""
    gpus(2)
    assert worker_devices("auto", 3) == ["cuda:0", "cuda:1", "cuda:0"]
    assert worker_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert worker_devices("cuda:1", 2) == ["cuda:1", "cuda:1"]
    assert worker_devices("cpu", 2) == ["cpu", "cpu"]
    assert LocalBackend(3, RuntimeOptions(device="auto")).devices == ["cuda:0", "cuda:1", "cuda:0"]
    gpus(1)
    assert worker_devices("auto", 2) == ["auto", "auto"]


def test_a_local_worker_runs_on_its_gpu_with_its_share(gpus, cpus, monkeypatch):
    """Item 4: a worker runs its packs on its own GPU and plans for its part of that GPU's
    memory (the workers on it share it, not all the sweep's workers)."""
    gpus(2)
    seen = []
    monkeypatch.setattr(local_backend, "execute_runs", lambda configs, options, pack: (
        seen.append(options.device) or []))
    monkeypatch.setattr(local_backend, "_worker_device", None)
    handler = signal.getsignal(signal.SIGINT)
    devices = worker_devices("auto", 3)
    try:
        take_place(1, devices)
        assert device_memory._gpu_share == 1  # alone on cuda:1
        local_backend._run_in_worker([], 1, RuntimeOptions(device="auto", progress=False))
        take_place(2, devices)
        assert device_memory._gpu_share == Fraction(1, 2)  # cuda:0, with worker 0
        local_backend._run_in_worker([], 1, RuntimeOptions(device="auto", progress=False))
    finally:
        signal.signal(signal.SIGINT, handler)
    assert seen == ["cuda:1", "cuda:0"]


def test_a_pools_workers_number_themselves_in_turn():
    counter = multiprocessing.get_context("spawn").Value("i", 0)
    assert [local_backend.claim_index(counter) for _ in range(3)] == [0, 1, 2]
