"""benchmarks/bench_pack.py's end-to-end estimate (defect 8 of issue 13, item 8 of issue 19):
training is timed between reads of the device after untimed warm-up steps, and evaluation
runs under the run's own memory budget."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from che_bench.config import make_config

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_pack.py"


def load_bench_pack():
    spec = importlib.util.spec_from_file_location("bench_pack", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_is_timed_between_device_reads_after_its_warm_up(monkeypatch):
    """Issue 19, item 8: start-up (here 1000 s before the first step: CUDA, batch workers) is
    neither timed nor extrapolated; a fake clock reads 1000 s + 2 s per step."""
    bench = load_bench_pack()
    real_train_pack, calls, clock = bench.train_pack, [], [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def slow_start(model, task, configs, device, *, on_step, **options):
        def read(step, losses):
            clock[0] = 1000.0 + 2.0 * step
            on_step(step, losses)

        calls.append(real_train_pack(model, task, configs, device, on_step=read, **options))
        return calls[-1]

    monkeypatch.setattr(bench, "train_pack", slow_start)
    configs = [make_config("even_pairs", "none", None, "smoke", seed=seed, length_seed=0, steps=3)
               for seed in (0, 1)]
    model, seconds_per_step = bench.timed_training(configs[0].build_task(), configs,
                                                   torch.device("cpu"), 2)
    assert [c.steps_done for c in calls] == [5]  # the warm-up, then the timed steps
    assert seconds_per_step == 2.0
    assert model.members == 2


def test_evaluation_uses_the_runs_budget_on_a_gpu(monkeypatch):
    from che_bench.eval import evaluation
    from che_bench.model.encoder import build_model

    bench = load_bench_pack()
    monkeypatch.setattr(evaluation, "evaluation_budget", lambda device: 123 << 20)
    config = make_config("even_pairs", "none", None, "smoke")
    model = build_model(config.build_task(), "none", **config.model_kwargs())
    bench.use_evaluation_budget(model, torch.device("cuda"))  # what evaluate() does
    assert model.memory_budget_bytes == 123 << 20
