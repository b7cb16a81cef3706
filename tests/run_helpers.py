"""What the tests of runs share: a run stopped part-way as Ctrl-C stops it, and CUDA's memory
queries faked on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch

from che_bench.run.runner import execute_runs


def run_interrupted_at(step, configs, checkpoint_dir, **options):
    """``execute_runs`` of ``configs`` on the CPU, checkpointing into ``checkpoint_dir``,
    stopped by a KeyboardInterrupt at training step ``step`` (``options``: its others)."""

    def stop(at, losses):
        if at == step:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute_runs(configs, device="cpu", progress=False, checkpoint_dir=checkpoint_dir,
                     on_step=stop, **options)


def fake_cuda_memory(monkeypatch, readings):
    """CUDA's memory queries faked: synchronising, resetting the peak and emptying the cache
    do nothing; ``memory_allocated`` and ``max_memory_allocated`` give ``readings`` in turn."""
    readings = iter(readings)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(readings))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(readings))
